"""Time the numpy reference (the cpu backend) on one core: issue 2's speed check.

    taskset -c 0 python tools/bench_reference.py [--size 4096]

Prints the median of 3 runs of quantize_4bit (NF4, double quantization), dequantize_4bit and
quantize_q4_0 on a size x size fp32 matrix. A benchmark, not a test: CPU timings here are not
performance figures for the GPU backends.
"""

import argparse

import numpy as np

import quantcore as qc
from quantcore import bench


def median_time(fn, reps=3):
    """Median seconds of ``reps`` calls (quantcore.bench's host timer; numpy needs no sync)."""
    return bench.HostTimer(lambda: None).kernel([fn], reps, 0) / 1e6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=int, default=4096)
    n = p.parse_args().size
    x = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    packed, state = qc.quantize_4bit(x, 64, "nf4", True)
    rows = [
        ("quantize_4bit nf4 + double quant", median_time(lambda: qc.quantize_4bit(x, 64, "nf4", True))),
        ("dequantize_4bit -> fp32", median_time(lambda: qc.dequantize_4bit(packed, state))),
        ("quantize_q4_0", median_time(lambda: qc.quantize_q4_0(x))),
    ]
    for name, t in rows:
        print(f"{name:36s} {n}x{n} fp32: {t:.3f} s")


if __name__ == "__main__":
    main()
