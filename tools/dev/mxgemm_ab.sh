#!/bin/bash
# scaled_fp4_mm A/B on the GPU machine: the wgmma kernel of this tree against the one in $OLD (a
# copy of kernels_cuda/mx_gemm.cu, e.g. `git show HEAD:kernels_cuda/mx_gemm.cu`), timed in one
# process per tree at 8192^3 with torch bf16 matmul alongside, plus the MMA-only (_nodq) and
# dequantization-only (_nomma) variants; then the GEMM GPU tests and conformance cases of this tree.
# Usage: OLD=.scratch/mx_gemm_old.cu bash tools/dev/mxgemm_ab.sh   (logs under $OUT)
set -o pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/mxgemm_ab}"
mkdir -p "$OUT"
ROOT=$PWD
if [ -n "${OLD:-}" ]; then
  rm -rf /tmp/oldtree && mkdir -p /tmp/oldtree && cp -r quantcore backends kernels_cuda kernels_sycl kernels_maca /tmp/oldtree/ 2>/dev/null
  cp "$OLD" /tmp/oldtree/kernels_cuda/mx_gemm.cu
fi
cat > /tmp/mxgemm_time.py <<'PY'
import statistics, sys, torch
from quantcore.backends.cuda import mx as cmx
from quantcore.formats import mx
tag = sys.argv[1]
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
print(f"[{tag}] torch bf16 matmul {tt:.4f} ms {flops / tt / 1e9:.0f} TFLOPS")
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
        print(f"[{tag}] {fmt} wgmma{var}: {t:.4f} ms {flops / t / 1e9:.0f} TFLOPS {tt / t:.3f}x torch")
PY
if [ -n "${OLD:-}" ]; then
  (cd /tmp && PYTHONPATH=/tmp/oldtree QUANTCORE_CACHE_DIR=/tmp/qc-old timeout 150 python3 /tmp/mxgemm_time.py old) 2>&1 | tee "$OUT/time_old.log"
fi
PYTHONPATH=$ROOT QUANTCORE_CACHE_DIR=/tmp/qc-new timeout 150 python3 /tmp/mxgemm_time.py new 2>&1 | tee "$OUT/time_new.log"
if [ -n "${OLD:-}" ]; then
  (cd /tmp && PYTHONPATH=/tmp/oldtree QUANTCORE_CACHE_DIR=/tmp/qc-old timeout 100 python3 /tmp/mxgemm_time.py old2) 2>&1 | tee -a "$OUT/time_old.log"
fi
if [ -z "${NOTEST:-}" ]; then
  PYTHONPATH=$ROOT QUANTCORE_CACHE_DIR=/tmp/qc-new timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_mx.py -k "mm" 2>&1 | tail -4 | tee "$OUT/pytest_mm.log"
  PYTHONPATH=$ROOT QUANTCORE_CACHE_DIR=/tmp/qc-new timeout 120 python3 -m quantcore.conformance --backend cuda --full -k scaled_fp4_mm 2>&1 | tail -4 | tee "$OUT/conf_mm.log"
fi
