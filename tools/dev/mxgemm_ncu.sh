#!/bin/bash
# scaled_fp4_mm (wgmma kernel, NVFP4, 8192^3) under ncu on the GPU machine: warp-state statistics
# and the per-SASS-instruction stall samples (source page), to see where the warps of the
# dequantizing wgmma kernel wait. Usage: [MODE=wgmma KERNEL=qc_mx_gemm_wgmma_nvfp4_cp16 VARIANT=_nodq] bash
# tools/dev/mxgemm_ncu.sh   (logs under $OUT)
. tools/dev/env.sh /tmp/mxgemm_ncu  # OUT, PYTHONPATH, the kernel cache
KERNEL="${KERNEL:-qc_mx_gemm_wgmma_nvfp4_cp16}"
VARIANT="${VARIANT:-}"
MODE="${MODE:-wgmma}"
cat > /tmp/mxgemm_one.py <<PY
import sys, torch
from quantcore.backends.cuda import mx as cmx
m = n = k = 8192
dev = torch.device("cuda")
ac = torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, device=dev)
bc = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)
from quantcore.formats import mx
sa = torch.randint(40, 60, mx.swizzled_shape(m, k // 16), dtype=torch.uint8, device=dev)
sb = torch.randint(40, 60, mx.swizzled_shape(n, k // 16), dtype=torch.uint8, device=dev)
alpha = torch.ones(1, dtype=torch.float32, device=dev)
out = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
for _ in range(2):
    cmx.scaled_fp4_mm(None, ac, bc, sa, sb, alpha, None, out, m=m, n=n, k=k, fmt="nvfp4", mode="$MODE", variant="$VARIANT")
torch.cuda.synchronize()
print("ok")
PY
timeout 120 python3 /tmp/mxgemm_one.py || exit 1
timeout 240 ncu --clock-control none --kernel-name "$KERNEL$VARIANT" --launch-skip 1 --launch-count 1 \
  --set full --import-source no -o /tmp/gemm -f python3 /tmp/mxgemm_one.py > "$OUT/ncu_run.log" 2>&1
echo "ncu rc=$?"; tail -3 "$OUT/ncu_run.log"
ncu -i /tmp/gemm.ncu-rep --page details --section WarpStateStats --section SchedulerStats \
  --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy > "$OUT/details.txt" 2>&1
ncu -i /tmp/gemm.ncu-rep --page source --csv --print-source sass > "$OUT/source_sass.csv" 2>"$OUT/source_err.txt" \
  || ncu -i /tmp/gemm.ncu-rep --page source --csv > "$OUT/source_sass.csv" 2>>"$OUT/source_err.txt"
ls -la "$OUT"; head -c 600 "$OUT/source_sass.csv"; cat "$OUT/source_err.txt" | head
