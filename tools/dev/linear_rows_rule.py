"""linear_4bit's row rule on the GPU machine: for each weight shape and row count, the GPU time of the
wgmma NF4 GEMM (gemv_4bit forced onto it), of dequantize_4bit + F.linear (linear_4bit's path above its
rows) and of torch bf16 F.linear, in one process (quantcore.bench's CudaTimer: CUDA events behind a
sleep kernel, median of --reps, 3 rotating weights), and what linear_4bit takes today
(backends/cuda/bnb.py LINEAR_GEMM_ROWS, LINEAR_WGMMA_MIN_WEIGHT, the wave-fill rule) against the faster
of the two.

    python3 tools/dev/linear_rows_rule.py [--shapes 4096x4096,14336x4096] [--rows 512,1024,2048] [--reps 20]
        [--gemm-tunes ";gw_persist=1"]

--gemm-tunes times the GEMM under each QUANTCORE_CUDA_TUNE setting (added to gw_min_rows=1), taken in
turn, and checks that their outputs are bitwise equal to the first's; --checksum prints a checksum of the
GEMM's output per case (seeded inputs: two trees' runs compare bit for bit, tools/dev/ab_tree.sh).
"""

from __future__ import annotations

import argparse
import os

import torch
from quantcore.backends import cuda
from quantcore.backends.cuda import plans as cuda_plans
from quantcore.backends.cuda import runtime as rt

import quantcore as qc
from quantcore.bench import CudaTimer

SHAPES = "4096x4096,1024x4096,14336x4096,4096x14336,8192x8192,1024x8192,28672x8192,8192x28672"
ROWS = "256,512,768,1024,1536,2048,3072,4096"


def time_row(be, timer, ws, qs, n: int, k: int, rows: int, reps: int, tunes: list[str]):
    """torch bf16, dequantize + matmul and the GEMM under each of ``tunes`` at ``rows`` rows: us each."""
    lin = torch.nn.functional.linear
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    t_torch = timer.kernel([lambda w=w: lin(x, w) for w in ws], reps, warmup=3)
    t_dq = timer.kernel([lambda p=p, s=s: lin(x, qc.dequantize_4bit(p, s, backend=be)) for p, s in qs], reps, warmup=3)
    t_gws, first = [], None  # (first: the first setting's output)
    for tune in tunes:
        os.environ[rt.ENV_TUNE] = "gw_min_rows=1" + ("," + tune if tune else "")
        call = [lambda p=p, s=s: be.gemv_4bit(x, p, s.absmax, out, n=n, k=k, blocksize=64, quant_type="nf4",
                                              nested=cuda_plans._state_nested(s)) for p, s in qs]
        t_gws.append(timer.kernel(call, reps, warmup=3))
        call[0]()
        if first is None:
            first = out.clone()
        elif not torch.equal(first.view(torch.int16), out.view(torch.int16)):
            print(f"  OUTPUT DIFFERS under {tune!r}", flush=True)
    os.environ.pop(rt.ENV_TUNE, None)
    return t_torch, t_dq, t_gws, int(first.view(torch.int16).to(torch.int64).sum())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=SHAPES, help="N x K weights, ','-separated")
    p.add_argument("--rows", default=ROWS)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--gemm-tunes", default="", help="';'-separated GEMM settings timed side by side")
    p.add_argument("--checksum", action="store_true", help="print a checksum of the GEMM's output per case")
    args = p.parse_args()
    be = qc.get_backend("cuda")
    timer = CudaTimer(torch)
    os.environ.pop(rt.ENV_TUNE, None)
    cuda.CudaBackend._GEMM4_RULE.clear()
    tunes = args.gemm_tunes.split(";") if args.gemm_tunes else [""]
    print("shape rows: torch bf16 | wgmma GEMM | dequantize + matmul (us, x = torch's time over it) | "
          "linear_4bit takes (graph / eager) | faster | the GEMM under the other --gemm-tunes", flush=True)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        torch.manual_seed(n * 7 + k)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(3)]
        qs = [qc.quantize_4bit(w, 64, "nf4", True, backend=be) for w in ws]
        for rows in (int(r) for r in args.rows.split(",")):
            torch.manual_seed(rows)
            t_torch, t_dq, t_gws, check = time_row(be, timer, ws, qs, n, k, rows, args.reps, tunes)
            t_gw = t_gws[0]
            others = "".join(f" | [{tn}] {tg:8.1f} ({t_torch / tg:.2f}x)" for tn, tg in zip(tunes[1:], t_gws[1:]))
            takes = ["gemm" if rows <= be.gemm_4bit_rows(0, n, k, rows, eager) else "dq+mm" for eager in (False, True)]
            faster = "gemm" if t_gw < t_dq else "dq+mm"
            print(f"{n}x{k} {rows:5d}: torch {t_torch:8.1f} | gemm {t_gw:8.1f} ({t_torch / t_gw:.2f}x) | dq+mm "
                  f"{t_dq:8.1f} ({t_torch / t_dq:.2f}x) | takes {takes[0]} / {takes[1]} | {faster}"
                  f"{'' if takes[0] == faster else '  <- rule differs'}{others}"
                  + (f" | checksum {check}" if args.checksum else ""), flush=True)
        del ws, qs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
