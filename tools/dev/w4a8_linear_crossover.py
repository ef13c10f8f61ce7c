"""linear_q4_0 (quantcore.torch) for 9..512 rows: the W4A8 path (gemm_w4a8, then the transpose to
the activation's dtype) against dequantize + bf16 matmul, at 4096x14336 and 14336x4096 (M x K),
bf16 activation; CUDA events behind a sleep kernel, 3 weights rotated, median of 30. Run by
tools/dev/w4a8_tc_device.sh (step crossover)."""

import torch
from quantcore.backends.cuda import create

from quantcore import api
from quantcore import torch as qt
from quantcore.bench import CudaTimer


def med(fn, reps: int = 30) -> float:
    """fn(i) for rotating i (its three weights) timed by quantcore.bench's kernel timer."""
    return CudaTimer(torch).kernel([lambda j=j: fn(j) for j in range(3)], reps, warmup=3)


def main() -> None:
    be = create()
    print(f"{'M x K':14s} {'rows':>5s} {'w4a8 us':>9s} {'dequant+mm us':>14s}")
    for m, k in ((4096, 14336), (14336, 4096)):
        wqs = [api.quantize_q4_0(torch.randn(m, k, device="cuda") * 0.05, backend=be) for _ in range(3)]
        for rows in (9, 16, 32, 64, 128, 256, 512):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            res = []
            for limit in (1 << 30, 0):
                qt.W4A8_MAX_ROWS = qt.W4A8_MAX_ROWS_CUDA = limit
                res.append(med(lambda i, x=x, wqs=wqs: qt.linear_q4_0_eager(x, wqs[i % 3])))
            print(f"{m}x{k:<9d} {rows:5d} {res[0]:9.1f} {res[1]:14.1f}", flush=True)
    qt.W4A8_MAX_ROWS, qt.W4A8_MAX_ROWS_CUDA = 8, 64


if __name__ == "__main__":
    main()
