"""NF4 linear for many rows on the GPU machine (kernels_cuda/bnb_gemm.cu): the fused GEMM's error
against dequantize_4bit + an fp32 matmul, and its time per CTA shape (QUANTCORE_CUDA_TUNE gm_cfg)
beside dequantize + torch matmul, bitsandbytes' matmul_4bit and torch bf16 F.linear, in one process
(CUDA events, median of reps, 3 rotating weights).
Usage: python tools/dev/gemm4_time.py [--quick] [--rows 32,64] [--shapes 1024x4096,...] [--fused-only]
(--fused-only: the launcher's choice alone, no checks or baselines: run from an older tree's root
with this file copied there to time its kernel in the same call)
"""

from __future__ import annotations

import os
import sys
import time

import torch
from quantcore.backends import cuda
from quantcore.backends.cuda import plans as cuda_plans
from quantcore.backends.cuda import runtime as rt

import quantcore as qc
from quantcore.bench import CudaTimer

SHAPES = ((14336, 4096), (4096, 14336))
ROWS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
#: QUANTCORE_CUDA_TUNE settings timed per row count ("": the launcher's choice; gm_cfg=i the mma.sync
#: GEMM's CTA shape backends/cuda/bnb.py _GM_CONFIGS[i - 1]; gemm4wg=0 the mma.sync GEMM's default
#: instead of the wgmma GEMM; gw_nb the wgmma GEMM's input rows per CTA)
_WG = ["gemm4wg=0", "gw_min_rows=1,gw_nb=128", "gw_min_rows=1,gw_nb=256"]
VARIANTS = {16: [""], 32: ["", "gm_cfg=3", "gm_cfg=4", "gm_cfg=5", *_WG[1:]],
            64: ["", "gm_cfg=1", "gm_cfg=4", "gm_cfg=5", *_WG[1:]], 96: ["", *_WG[1:]],
            128: ["", "gm_cfg=1", "gm_cfg=5", *_WG], 256: ["", *_WG], 512: ["", *_WG], 1024: ["", *_WG],
            2048: ["", *_WG], 4096: ["", *_WG]}


def events_us(fns, reps: int = 20) -> float:
    """quantcore.bench's kernel timer (a sleep kernel, CUDA events around each call, the median)."""
    return CudaTimer(torch).kernel(fns, reps, warmup=3)


def set_tune(cfg: str) -> None:
    if cfg:
        os.environ[rt.ENV_TUNE] = cfg
    else:
        os.environ.pop(rt.ENV_TUNE, None)


def main() -> None:
    quick = "--quick" in sys.argv
    fused_only = "--fused-only" in sys.argv
    rows_list = ROWS
    shapes = SHAPES
    if "--shapes" in sys.argv:  # e.g. --shapes 1024x4096,4096x4096 (N x K)
        shapes = tuple(tuple(int(v) for v in sh.split("x")) for sh in sys.argv[sys.argv.index("--shapes") + 1].split(","))
    if "--rows" in sys.argv:
        rows_list = tuple(int(r) for r in sys.argv[sys.argv.index("--rows") + 1].split(","))
    t0 = time.time()
    if not fused_only:
        inst = [fe for fe in cuda.kernel_instances() if fe[0] == "bnb_gemm.cu"]
        print(f"precompiled {rt.precompile(inst, 0, workers=16)} bnb_gemm.cu kernels in {time.time() - t0:.1f} s",
              flush=True)
    be = qc.get_backend("cuda")
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    lin = torch.nn.functional.linear
    # correctness on the big shapes: fused vs dequantize_4bit + fp32 matmul (rel. Frobenius error)
    for (n, k) in () if fused_only else shapes:
        for rows in (17, 100, 200, 512) if quick else (17, 64, 100, 200, 512, 2048):
            for qt, nested, dt in (("nf4", True, torch.bfloat16), ("fp4", False, torch.float16)):
                w = torch.randn(n, k, device="cuda", dtype=dt) * 0.05
                p, s = qc.quantize_4bit(w, 64, qt, nested, backend=be)
                x = torch.randn(rows, k, device="cuda", dtype=dt)
                y = qc.gemv_4bit(x, p, s, backend=be)
                wd = qc.dequantize_4bit(p, s, backend=be).float()
                ref = x.float() @ wd.T
                err = ((y.float() - ref).norm() / ref.norm()).item()
                bad = not torch.isfinite(y).all().item()
                print(f"check N{n} K{k} rows{rows} {qt} nested={nested} {dt}: rel err {err:.2e}{' NONFINITE' if bad else ''}",
                      flush=True)
    # timing
    lines = []
    for (n, k) in shapes:
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(3)]
        qs = [qc.quantize_4bit(w, 64, "nf4", True, backend=be) for w in ws]
        bq = [] if fused_only else [F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
                                    for w in ws]
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
            flops = 2 * rows * n * k
            if fused_only:
                t_torch = t_dq = t_bnb = float("nan")
            else:
                t_torch = events_us([lambda w=w, x=x: lin(x, w) for w in ws])
                t_dq = events_us([lambda p=p, s=s, x=x: lin(x, qc.dequantize_4bit(p, s, backend=be)) for p, s in qs])
                t_bnb = events_us([lambda p=p, s=s, x=x: bnb.matmul_4bit(x, p.t(), quant_state=s) for p, s in bq])
            res = []
            for cfg in [""] if fused_only else VARIANTS.get(rows, [""]):
                set_tune(cfg)
                t = events_us([lambda p=p, s=s, x=x, out=out, n=n, k=k: be.gemv_4bit(x, p, s.absmax, out, n=n, k=k, blocksize=64,
                                                             quant_type="nf4", nested=cuda_plans._state_nested(s))
                               for p, s in qs])
                res.append((cfg, t))
            set_tune("")
            best = min(r[1] for r in res)
            vs = " ".join(f"[{cfg or 'default'}] {t:.1f}" for cfg, t in res)
            line = (f"N{n} K{k} rows{rows:5d}: torch {t_torch:8.1f} us ({flops / t_torch / 1e6:4.0f} TF) | dq+mm "
                    f"{t_dq:8.1f} ({t_torch / t_dq:.2f}x) | bnb {t_bnb:8.1f} ({t_torch / t_bnb:.2f}x) | fused best "
                    f"{best:8.1f} ({flops / best / 1e6:4.0f} TF, {t_torch / best:.2f}x torch, {t_bnb / best:.2f}x bnb) | {vs}")
            lines.append(line)
            print(line, flush=True)
        del ws, qs, bq
        torch.cuda.empty_cache()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
