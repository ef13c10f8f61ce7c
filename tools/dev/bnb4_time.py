"""Kernel times of quantize_4bit (with and without double_quantize), double_quantize alone and
dequantize_4bit on the cuda backend, with the copy and write-only bandwidths of the same device.

Run on the GPU machine: python3 tools/dev/bnb4_time.py [--ncu-one]. CUDA events around one call
queued behind a 1 ms sleep kernel, median of --reps, two rounds so the spread between rounds shows
the noise. 16384 x 16384 bf16, NF4, blocksize 64, nested (double-quant) statistics, as in
quantcore bench. quantize_4bit with double quantization is timed both ways: the one cooperative
launch (quantize_4bit_nested_kernel, opt-in: QUANTCORE_CUDA_TUNE=q4_nested=1) and the two ops (the
default: quantize_4bit, then double_quantize version 3).
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
from quantcore.backends.cuda.runtime import ENV_TUNE as TUNE

import quantcore as qc
from quantcore import bench
from quantcore.backend import Nested
from quantcore.formats import bnb


def timed(fn, reps: int) -> float:
    """Median microseconds of fn() over reps (quantcore.bench's CUDA-event timer, behind a sleep kernel)."""
    return bench.CudaTimer(torch).kernel([fn], reps, 0)


R = C = 16384  # the bench's shape
BS = 64


def buffers() -> tuple[torch.Tensor, ...]:
    """x (R x C bf16, seed 0) and quantize_4bit's outputs: packed, absmax, qabsmax, absmax2, offset."""
    n = R * C
    nb = bnb.nblocks(n, BS)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn((R, C), device="cuda", generator=g, dtype=torch.float32).to(torch.bfloat16)
    packed = torch.empty(((n + 1) // 2, 1), dtype=torch.uint8, device="cuda")
    absmax = torch.empty((nb,), dtype=torch.float32, device="cuda")
    q = torch.empty((nb,), dtype=torch.uint8, device="cuda")
    a2 = torch.empty((bnb.nblocks(nb, 256),), dtype=torch.float32, device="cuda")
    off = torch.empty((1,), dtype=torch.float32, device="cuda")
    return x, packed, absmax, q, a2, off


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--ncu-one", action="store_true", help="one launch of each kernel (for ncu)")
    args = p.parse_args()
    be = qc.get_backend("cuda")
    r, c, bs = R, C, BS
    n = r * c
    nb = bnb.nblocks(n, bs)
    x, packed, absmax, q, a2, off = buffers()
    code2 = torch.from_numpy(bnb.DYNAMIC_MAP.astype(np.float32)).cuda()
    out = torch.empty((r, c), dtype=torch.bfloat16, device="cuda")
    be.quantize_4bit(x, packed, absmax, blocksize=bs, quant_type="nf4")
    be.double_quantize(absmax, q, a2, off)
    nest = Nested(a2, code2, off)
    torch.cuda.synchronize()

    q4 = lambda: be.quantize_4bit(x, packed, absmax, blocksize=bs, quant_type="nf4")  # noqa: E731
    dq = lambda: be.double_quantize(absmax, q, a2, off)  # noqa: E731
    q4dq = lambda: (q4(), dq())  # noqa: E731

    def fused():  # the one launch (opt-in)
        os.environ[TUNE] = "q4_nested=1"
        be.quantize_4bit_nested(x, packed, q, a2, off, blocksize=bs, quant_type="nf4")
        os.environ[TUNE] = ""

    dq4 = lambda: be.dequantize_4bit(packed, q, out, blocksize=bs, quant_type="nf4", nested=nest)  # noqa: E731
    if args.ncu_one:
        q4dq()
        fused()
        dq4()
        torch.cuda.synchronize()
        return

    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    big2 = torch.empty_like(big)
    wr = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    q4dq()  # warm-up: compile and load
    fused()
    dq4()
    torch.cuda.synchronize()
    res: dict[str, list[float]] = {}
    for _ in range(2):
        res.setdefault("copy 2 GiB d2d", []).append(timed(lambda: big2.copy_(big), args.reps))
        res.setdefault("fill 512 MiB bf16 (write only)", []).append(
            timed(lambda: wr.fill_(1.0), args.reps))
        res.setdefault("dequantize_4bit", []).append(timed(dq4, args.reps))
        res.setdefault("quantize_4bit (kernel only)", []).append(timed(q4, args.reps))
        res.setdefault("quantize_4bit + double_quantize (two ops)", []).append(
            timed(q4dq, args.reps))
        res.setdefault("quantize_4bit nested (one launch)", []).append(timed(fused, args.reps))
        res.setdefault("double_quantize alone", []).append(timed(dq, args.reps))
    copy_gbps = 2 * (1 << 30) / (min(res["copy 2 GiB d2d"]) * 1e-6) / 1e9
    dq_bytes = n // 2 + nb + 2 * bnb.nblocks(nb, 256) + 2 * 256 + 2 * n
    q_bytes = 2 * n + n // 2 + nb + 4 * bnb.nblocks(nb, 256) + 4 * 256 + 4
    print(f"device: {torch.cuda.get_device_name()}; copy {copy_gbps:.0f} GB/s; median of {args.reps}, 2 rounds")
    for k, vals in res.items():
        nbytes = (2 << 30) if k.startswith("copy") else 2 * n if k.startswith("fill") else \
            dq_bytes if k.startswith("dequantize") else q_bytes if "quantize_4bit" in k else 0
        best = min(vals)
        extra = f"{nbytes / (best * 1e-6) / 1e9:7.0f} GB/s {100 * nbytes / (best * 1e-6) / 1e9 / copy_gbps:5.1f}% copy" \
            if nbytes else ""
        print(f"{k:42s} " + " ".join(f"{v:8.1f}" for v in vals) + f" us  {extra}")


if __name__ == "__main__":
    main()
