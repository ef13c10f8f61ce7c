"""scaled_fp4_mm at 8192^3 on the cuda backend's wgmma kernel, with torch bf16 matmul in the same
process: the full kernel (NVFP4, MXFP4) and the timing variants of the NVFP4 one, _nodq (MMAs on
stale tiles, no dequantization) and _nomma (dequantization only). CUDA events around one call
queued behind a 1 ms sleep kernel, median of 15. Run by tools/dev/ab_tree.sh (old against new)."""
import statistics, sys, torch
from quantcore.backends.cuda import mx as cmx
from quantcore.formats import mx
def timed(fn, reps=15, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)
        a.record(); fn(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)
m = n = k = 8192
dev = torch.device("cuda")
flops = 2.0 * m * n * k
a16 = torch.randn((m, k), device=dev, dtype=torch.bfloat16)
b16 = torch.randn((n, k), device=dev, dtype=torch.bfloat16)
tt = timed(lambda: torch.matmul(a16, b16.t()))
print(f"torch bf16 matmul {tt:.4f} ms {flops / tt / 1e9:.0f} TFLOPS")
for fmt in ("nvfp4", "mxfp4"):
    blk = mx.block_size(fmt)
    ac = torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, device=dev)
    bc = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)
    lo, hi = (40, 60) if fmt == "nvfp4" else (120, 130)
    sa = torch.randint(lo, hi, mx.swizzled_shape(m, k // blk), dtype=torch.uint8, device=dev)
    sb = torch.randint(lo, hi, mx.swizzled_shape(n, k // blk), dtype=torch.uint8, device=dev)
    alpha = torch.ones(1, dtype=torch.float32, device=dev)
    out = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
    for var in ("", "_nodq", "_nomma") if fmt == "nvfp4" else ("",):
        f = lambda: cmx.scaled_fp4_mm(None, ac, bc, sa, sb, alpha, None, out, m=m, n=n, k=k, fmt=fmt, mode="wgmma", variant=var)
        t = timed(f)
        print(f"{fmt} wgmma{var}: {t:.4f} ms {flops / t / 1e9:.0f} TFLOPS {tt / t:.3f}x torch")
