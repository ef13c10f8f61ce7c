"""scaled_fp4_mm's wgmma kernel with 256 threads (two warpgroups of 128 rows) against 512 (four of
64 rows), on the GPU machine: first bit-for-bit equality of the two outputs on shapes off every tile
edge (both copy widths, with bias), then the time of each at 8192^3 next to torch bf16 matmul, the
two block sizes alternated three times. Usage: python3 tools/dev/mxgemm_threads.py [reps]."""

import os
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tools/: cuda_mx_bench
from cuda_mx_bench import timed  # noqa: E402  (median ms behind a sleep kernel)
from mxgemm_time import operands  # noqa: E402

from quantcore.backends.cuda import mx as cmx
from quantcore.backends.cuda import runtime as rt

SHAPES = ((8192, 8192, 8192), (300, 200, 512), (257, 129, 4096), (1000, 520, 1056), (64, 384, 2080))


def run(fmt, ops, out, m, n, k, threads, bias=None):
    os.environ[rt.ENV_TUNE] = f"mx_gemm_threads={threads}"
    cmx.scaled_fp4_mm(None, *ops, bias, out, m=m, n=n, k=k, fmt=fmt, mode="wgmma")


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    dev = torch.device("cuda")
    bad = 0
    for fmt in ("nvfp4", "mxfp4"):
        for m, n, k in SHAPES:
            ops = operands(fmt, dev, m, n, k)
            bias = torch.randn(n, device=dev).to(torch.bfloat16)
            for b in (None, bias):
                outs = {}
                for threads in (256, 512):
                    outs[threads] = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
                    run(fmt, ops, outs[threads], m, n, k, threads, b)
                same = torch.equal(outs[256].view(torch.int16), outs[512].view(torch.int16))
                bad += not same
                print(f"{fmt} {m}x{n}x{k} bias={b is not None}: 512 == 256 bit for bit: {same}")
            if (k // 2) % 16 == 0:  # the 4-byte copy path: operands at an offset of 4 bytes
                a4 = torch.empty(ops[0].numel() + 4, dtype=torch.uint8, device=dev)[4:].view(ops[0].shape)
                a4.copy_(ops[0])
                ops4 = (a4, *ops[1:])
                o256 = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
                o512 = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
                run(fmt, ops4, o256, m, n, k, 256)
                run(fmt, ops4, o512, m, n, k, 512)
                same = torch.equal(o256.view(torch.int16), o512.view(torch.int16))
                bad += not same
                print(f"{fmt} {m}x{n}x{k} cp4: 512 == 256 bit for bit: {same}")
    m = n = k = 8192
    flops = 2.0 * m * n * k
    a16 = torch.randn((m, k), device=dev, dtype=torch.bfloat16)
    b16 = torch.randn((n, k), device=dev, dtype=torch.bfloat16)
    tt = timed(lambda: torch.matmul(a16, b16.t()), reps)
    print(f"torch bf16 matmul {tt:.4f} ms {flops / tt / 1e9:.0f} TFLOPS")
    out = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
    for fmt in ("nvfp4", "mxfp4"):
        ops = operands(fmt, dev, m, n, k)
        for rnd in range(3):
            for threads in (256, 512):
                t = timed(lambda: run(fmt, ops, out, m, n, k, threads), reps)
                print(f"{fmt} threads {threads} round {rnd}: {t:.4f} ms {flops / t / 1e9:.0f} TFLOPS "
                      f"{tt / t:.3f}x torch")
    print("mismatches:", bad)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
