"""Benchmark of the CUDA MX kernels against their ceilings, measured in one process.

* copy bandwidth: a 2 GiB device-to-device copy (bytes read + written), the quantize ceiling;
* scaled_nvfp4_quant / scaled_mxfp4_quant / mxfp8 quantize of a 16384^2 bf16 tensor (swizzled
  scales): bytes = input + codes + scales, as a fraction of the copy bandwidth;
* mx_dequantize of the same tensors back to bf16;
* scaled_fp4_mm at 8192^3 (nvfp4, mxfp4; wgmma and mma.sync back ends) against torch bf16
  matmul (cuBLAS) on random data of the same shape, in TFLOPS.

CUDA events around each region, warm-up first, median of the repeats; random data. Prints a
table and writes JSON (``--json``). Run on the GPU machine: python tools/cuda_mx_bench.py
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch
from quantcore.backends.cuda import mx as cmx

from quantcore import bench
from quantcore.formats import mx


def timed(fn, reps: int, warmup: int = 3) -> float:
    """Median milliseconds of fn() over reps: quantcore.bench's CUDA-event timer (each call between
    two events recorded behind a ~1 ms sleep kernel, so fn()'s host launch time is not inside the
    timed region)."""
    return bench.CudaTimer(torch).kernel([fn], reps, warmup) / 1e3


def copy_ceiling(reps: int) -> tuple[float, float]:
    """(ms, GB/s) of a 2 GiB device-to-device copy (read + write bytes), timed as :func:`timed` does:
    the ceiling the MX scripts' % of copy are against."""
    src = torch.empty(2**31 // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), reps)
    return t, 2 * src.numel() * 4 / t / 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--quant-n", type=int, default=16384)
    ap.add_argument("--mm", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--skip-mma", action="store_true")
    ap.add_argument("--experiments", action="store_true", help="also time the GEMM without dequant / MMA")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}

    # -- copy ceiling
    t, copy_gbs = copy_ceiling(args.reps)
    res["copy_GBps"] = copy_gbs
    rows.append(("device-to-device copy 2 GiB", t, f"{copy_gbs:.0f} GB/s", ""))

    # -- quantize / dequantize 16384^2 bf16
    n = args.quant_n
    x = torch.randn((n, n), device=dev, dtype=torch.float32)
    x = (x * torch.exp2(torch.empty((n, 1), device=dev).uniform_(-4, 4))).to(torch.bfloat16)
    g = torch.tensor([mx.nvfp4_global_scale(float(x.abs().max()))], dtype=torch.float32, device=dev)
    for fmt in ("nvfp4", "mxfp4", "mxfp8"):
        blk = mx.block_size(fmt)
        codes = torch.empty((n, mx.codes_cols(fmt, n)), dtype=torch.uint8, device=dev)
        scales = torch.empty(mx.swizzled_shape(n, n // blk), dtype=torch.uint8, device=dev)
        gs = g if fmt == "nvfp4" else None
        mode = None if fmt == "nvfp4" else "floor"

        nbytes = x.numel() * 2 + codes.numel() + scales.numel()
        def q(codes=codes, scales=scales, gs=gs, fmt=fmt, mode=mode):
            cmx.mx_quantize(None, x, codes, scales, rows=n, cols=n, fmt=fmt, scale_mode=mode, swizzled=True,
                            global_scale=gs)

        t = timed(q, args.reps)
        gbs = nbytes / t / 1e6
        res[f"quantize_{fmt}_ms"] = t
        res[f"quantize_{fmt}_frac_copy"] = gbs / copy_gbs
        rows.append((f"quantize {fmt} {n}^2 bf16 (swizzled)", t, f"{gbs:.0f} GB/s", f"{100 * gbs / copy_gbs:.1f}% of copy"))
        out = torch.empty((n, n), dtype=torch.bfloat16, device=dev)

        def dq(codes=codes, scales=scales, gs=gs, fmt=fmt, out=out):
            cmx.mx_dequantize(None, codes, scales, out, rows=n, cols=n, fmt=fmt, swizzled=True, global_scale=gs)

        t = timed(dq, args.reps)
        gbs = nbytes / t / 1e6
        res[f"dequantize_{fmt}_ms"] = t
        res[f"dequantize_{fmt}_frac_copy"] = gbs / copy_gbs
        rows.append((f"dequantize {fmt} {n}^2 -> bf16", t, f"{gbs:.0f} GB/s", f"{100 * gbs / copy_gbs:.1f}% of copy"))
        del codes, scales, out
    x = None

    # -- GEMM 8192^3
    m = nn = k = args.mm
    flops = 2.0 * m * nn * k
    a16 = torch.randn((m, k), device=dev, dtype=torch.bfloat16)
    b16 = torch.randn((nn, k), device=dev, dtype=torch.bfloat16)
    t = timed(lambda: torch.matmul(a16, b16.t()), args.reps)
    ref_tf = flops / t / 1e9
    res["torch_bf16_matmul_TFLOPS"] = ref_tf
    rows.append((f"torch bf16 matmul {m}^3 (cuBLAS)", t, f"{ref_tf:.0f} TFLOPS", "1.00x"))
    modes = ["wgmma", "mma"] if not args.skip_mma else ["wgmma"]
    major, minor = cmx.compute_capability(torch.cuda.current_device())
    if (major, minor) != (9, 0):
        modes = ["mma"]
    for fmt in mx.FP4_FORMATS:
        blk = mx.block_size(fmt)
        ac = torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, device=dev)
        bc = torch.randint(0, 256, (nn, k // 2), dtype=torch.uint8, device=dev)
        lo, hi = (40, 60) if fmt == "nvfp4" else (120, 130)  # finite, moderate scales
        sa = torch.randint(lo, hi, mx.swizzled_shape(m, k // blk), dtype=torch.uint8, device=dev)
        sb = torch.randint(lo, hi, mx.swizzled_shape(nn, k // blk), dtype=torch.uint8, device=dev)
        alpha = torch.tensor([1.0], dtype=torch.float32, device=dev)
        out = torch.empty((m, nn), dtype=torch.bfloat16, device=dev)
        for mode in modes:
            def mm(ac=ac, bc=bc, sa=sa, sb=sb, alpha=alpha, out=out, fmt=fmt, mode=mode):
                cmx.scaled_fp4_mm(None, ac, bc, sa, sb, alpha, None, out, m=m, n=nn, k=k, fmt=fmt, mode=mode)

            t = timed(mm, max(5, args.reps // 2))
            tf = flops / t / 1e9
            res[f"scaled_fp4_mm_{fmt}_{mode}_TFLOPS"] = tf
            res[f"scaled_fp4_mm_{fmt}_{mode}_ratio"] = tf / ref_tf
            rows.append((f"scaled_fp4_mm {fmt} {mode} {m}^3", t, f"{tf:.0f} TFLOPS", f"{tf / ref_tf:.2f}x torch bf16"))
            if fmt == "nvfp4" and mode == "wgmma" and args.experiments:
                for variant in ("_nodq", "_nomma"):
                    def mmx(variant=variant, ac=ac, bc=bc, sa=sa, sb=sb, alpha=alpha, out=out):
                        cmx.scaled_fp4_mm(None, ac, bc, sa, sb, alpha, None, out, m=m, n=nn, k=k, fmt="nvfp4",
                                          mode="wgmma", variant=variant)

                    t = timed(mmx, max(5, args.reps // 2))
                    res[f"experiment{variant}_ms"] = t
                    what = "without dequantization" if variant == "_nodq" else "without MMAs"
                    rows.append((f"  experiment: nvfp4 wgmma {what}", t, f"{flops / t / 1e9:.0f} TFLOPS", ""))
        # spot check against the fp64 reference on a corner (the full check is in the tests)
        out_h = out[:64, :64].float().cpu().numpy()
        A = mx.fp4_operand(ac[:64].cpu().numpy(), _rows_of_swizzled(sa, m, k // blk, 64), fmt)
        B = mx.fp4_operand(bc[:64].cpu().numpy(), _rows_of_swizzled(sb, nn, k // blk, 64), fmt)
        ref = A @ B.T
        res[f"scaled_fp4_mm_{fmt}_corner_max_rel_err"] = float(np.max(np.abs(out_h - ref)) / np.max(np.abs(ref)))
        del ac, bc, sa, sb, out

    w = max(len(r[0]) for r in rows)
    print(f"device: {res['device']}")
    for name, ms, rate, note in rows:
        print(f"{name:<{w}}  {ms:9.4f} ms  {rate:>14}  {note}")
    for key, val in res.items():
        if key.endswith("corner_max_rel_err"):
            print(f"{key}: {val:.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def _rows_of_swizzled(s, rows: int, cols: int, take: int) -> np.ndarray:
    """Swizzled scales of the first ``take`` rows (a swizzled buffer of its own)."""
    full = mx.unswizzle(s.cpu().numpy(), rows, cols)
    return mx.swizzle(full[:take])


if __name__ == "__main__":
    sys.exit(main())
