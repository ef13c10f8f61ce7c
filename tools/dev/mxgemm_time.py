"""scaled_fp4_mm at 8192^3 on the cuda backend's wgmma kernel, with torch bf16 matmul in the same
process: the full kernel (NVFP4, MXFP4) and the timing variants of the NVFP4 one, _nodq (MMAs on
stale tiles, no dequantization), _nomma (dequantization only), _alu (the MMAs with the
dequantization's arithmetic but not its shared-memory traffic) and _smem (the MMAs with that
traffic but one XOR per pair for the decode), _nohmul / _nof2fp (the fp16 decode's multiplies
or its E4M3 conversions replaced by one integer-pipe instruction each), _ss (A read by
the MMAs from shared memory, its dequantization still done) and _ssnodq (the same, no
dequantization). CUDA events around one call
queued behind a 1 ms sleep kernel, median of 15. argv[1] (optional): the back ends to time, comma
separated ("wgmma" by default). Run by tools/dev/ab_tree.sh (old against new)."""

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tools/: cuda_mx_bench
from cuda_mx_bench import timed  # noqa: E402  (median ms behind a sleep kernel)
from quantcore.backends.cuda import mx as cmx

from quantcore.formats import mx

M = N = K = 8192


def operands(fmt: str, dev: torch.device, m: int = M, n: int = N, k: int = K) -> tuple:
    """Random packed operands and swizzled scales (NVFP4 bytes 40-59, MXFP4 120-129), alpha 1
    (also used by mxfast_time.py-style scripts)."""
    blk = mx.block_size(fmt)
    ac = torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, device=dev)
    bc = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)
    lo, hi = (40, 60) if fmt == "nvfp4" else (120, 130)
    sa = torch.randint(lo, hi, mx.swizzled_shape(m, k // blk), dtype=torch.uint8, device=dev)
    sb = torch.randint(lo, hi, mx.swizzled_shape(n, k // blk), dtype=torch.uint8, device=dev)
    return ac, bc, sa, sb, torch.ones(1, dtype=torch.float32, device=dev)


def torch_matmul_ms(dev: torch.device, m: int = M, n: int = N, k: int = K) -> float:
    """torch's bf16 matmul of random [m, k] x [n, k]^T: median ms, printed with its TFLOPS (also
    the bf16 reference of this script)."""
    a16 = torch.randn((m, k), device=dev, dtype=torch.bfloat16)
    b16 = torch.randn((n, k), device=dev, dtype=torch.bfloat16)
    tt = timed(lambda: torch.matmul(a16, b16.t()), 15)
    print(f"torch bf16 matmul {tt:.4f} ms {2.0 * m * n * k / tt / 1e9:.0f} TFLOPS")
    return tt


def main() -> None:
    dev = torch.device("cuda")
    flops = 2.0 * M * N * K
    tt = torch_matmul_ms(dev)
    out = torch.empty((M, N), dtype=torch.bfloat16, device=dev)
    variants = {mode: ("",) + v for mode, v in cmx.GEMM_TIMING_VARIANTS.items()}
    for mode in (sys.argv[1] if len(sys.argv) > 1 else "wgmma").split(","):
        for fmt in ("nvfp4", "mxfp4"):
            ac, bc, sa, sb, alpha = operands(fmt, dev)
            for var in variants[mode] if fmt == "nvfp4" else ("",):
                def mm(fmt=fmt, var=var, mode=mode, ops=(ac, bc, sa, sb, alpha)):
                    cmx.scaled_fp4_mm(None, *ops, None, out, m=M, n=N, k=K, fmt=fmt, mode=mode, variant=var)

                t = timed(mm, 15)
                print(f"{fmt} {mode}{var}: {t:.4f} ms {flops / t / 1e9:.0f} TFLOPS {tt / t:.3f}x torch")


if __name__ == "__main__":
    main()
