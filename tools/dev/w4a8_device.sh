#!/usr/bin/env bash
# One GPU-machine call for gemm_w4a8 N <= 8 (kernels_cuda/ggml.cu: gemm_w4a8_stream_kernel, its ring
# filled by bulk copies from a producer warp (LD 0, the default) or by cp.async from every warp
# (LD 1, QUANTCORE_CUDA_TUNE=w4s_load=1, W-14); w4a8_small=0 sends N <= 8 to the tensor-core kernel)
# : precompile of ggml.cu, GPU tests (with the filler tests of
# tests/test_cuda_w4a8_stream.py) and conformance (gemm) for both fillers, the configs side by side
# (bit comparison against the first), the bench rows, an ncu profile, memcheck of the cp.async
# filler. Logs under $OUT; W-14's call took 88 s. Run from the repository root:
# bash tools/dev/w4a8_device.sh
set -u
OUT=${OUT:-/tmp/qc_out}
mkdir -p "$OUT"
S="$OUT/summary.txt"
: > "$S"
say() { echo "$*" | tee -a "$S"; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export QUANTCORE_CACHE_DIR=/tmp/qc_cache
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv | tee -a "$S"
t0=$(date +%s)
timeout 70 python3 - <<'EOF' 2>&1 | tee -a "$S"
import time
t = time.time()
from quantcore.backends import cuda
from quantcore.backends.cuda import runtime as rt
print("availability:", cuda.create().availability())
n = rt.precompile([i for i in cuda.kernel_instances() if i[0] == "ggml.cu"], 0, workers=16)
print(f"precompiled {n} ggml.cu kernels in {time.time() - t:.1f} s")
EOF

# correctness first (steps in order of need, so a step cut by the call's limit loses the least):
# the GPU gemm tests and the filler tests (bit equality of the two fillers, ring wrap, short
# chunks, every cluster size) and the conformance gemm cases with the cp.async filler
s=$(date +%s)
QUANTCORE_CUDA_TUNE=w4s_load=1 timeout 60 python3 -m pytest tests/test_cuda.py tests/test_cuda_w4a8_stream.py -q -rs -k "gemm or w4a8 or filler" > "$OUT/pytest_gemm.log" 2>&1
say "tests -k gemm + test_cuda_w4a8_stream (w4s_load=1): rc=$? $(tail -1 "$OUT/pytest_gemm.log")"
QUANTCORE_CUDA_TUNE=w4s_load=1 timeout 40 python3 -m quantcore.conformance --backend cuda --full -k gemm > "$OUT/conformance_gemm.log" 2>&1
say "conformance --full -k gemm (w4s_load=1): rc=$? $(tail -1 "$OUT/conformance_gemm.log")"
say "  (correctness took $(( $(date +%s) - s )) s)"

s=$(date +%s)
# configs (QUANTCORE_CUDA_TUNE strings, ";"-separated, "" = the default; the first is the
# reference of the bit comparison); W-14's list was
# "w4s_load=0;w4s_load=1;w4s_load=1,w4s_kc=64;w4s_load=1,w4s_fly=128;w4s_load=1,w4s_stages=4;w4s_load=1,w4s_cl=2;w4s_load=0"
# (then w4s_load=1 was the default and was written as "")
W4_CONFIGS=${W4_CONFIGS:-"w4s_load=0;w4s_load=1;w4s_load=1,w4s_stages=4;w4s_kc=224;w4s_load=0"}
timeout 60 python3 tools/dev/w4a8_time.py "$W4_CONFIGS" > "$OUT/timing.log" 2>&1
say "timing: rc=$? ($(( $(date +%s) - s )) s)"
cat "$OUT/timing.log" >> "$S" && rm -f "$OUT/timing.log"  # in the summary: at most 8 files come back

s=$(date +%s)
cat > /tmp/w4mem.py <<'EOF'
import os, torch
from quantcore.backends.cuda import create
be = create()
for cfg in ("w4s_load=1", "w4s_load=1,w4s_cl=2,w4s_kc=16,w4s_stages=3", "w4s_load=1,w4s_cl=4,w4s_kc=8,w4s_stages=2"):
    os.environ["QUANTCORE_CUDA_TUNE"] = cfg
    for m, n, k in ((37, 3, 1024), (130, 8, 4096 + 256), (20, 1, 256)):
        w = torch.randint(0, 256, (m, k // 32, 18), dtype=torch.uint8, device="cuda")
        w[..., 1] = 0x20
        a = torch.randn(n, k, device="cuda", dtype=torch.float16)
        o = torch.empty(m, n, device="cuda")
        be.gemm_w4a8(w, a, o)
torch.cuda.synchronize()
print("memcheck script done")
EOF
timeout 45 compute-sanitizer --tool memcheck --leak-check no --print-limit 10 python3 /tmp/w4mem.py > "$OUT/memcheck.log" 2>&1
say "memcheck: rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1) ($(( $(date +%s) - s )) s)"
# the same for the bulk filler (the default, w4s_load=0)
s=$(date +%s)
QUANTCORE_CUDA_TUNE=w4s_load=0 timeout 30 python3 -m pytest tests/test_cuda.py -q -rs -k gemm > "$OUT/pytest_gemm_bulk.log" 2>&1
say "tests -k gemm (w4s_load=0): rc=$? $(tail -1 "$OUT/pytest_gemm_bulk.log")"
QUANTCORE_CUDA_TUNE=w4s_load=0 timeout 30 python3 -m quantcore.conformance --backend cuda --full -k gemm > "$OUT/conformance_gemm_bulk.log" 2>&1
say "conformance --full -k gemm (w4s_load=0): rc=$? $(tail -1 "$OUT/conformance_gemm_bulk.log") ($(( $(date +%s) - s )) s)"

s=$(date +%s)
timeout 40 python3 -m quantcore.bench --backend cuda --ops gemm_w4a8 -v > "$OUT/bench.log" 2>&1
say "bench: rc=$? ($(( $(date +%s) - s )) s)"
grep -E "copy|gemm_w4a8" "$OUT/bench.log" >> "$S"

s=$(date +%s)
cat > /tmp/w4prof.py <<'EOF'
import torch
from quantcore.backends.cuda import create
be = create()
for m, k, n in ((4096, 14336, 1), (4096, 14336, 8)):
    w = torch.randint(0, 256, (m, k // 32, 18), dtype=torch.uint8, device="cuda")
    w[..., 1] = 0x20
    a = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    o = torch.empty(m, n, device="cuda")
    for _ in range(3): be.gemm_w4a8(w, a, o)
    torch.cuda.synchronize()
EOF
timeout 40 ncu --clock-control none --kernel-name regex:gemm_w4a8_stream --launch-skip 2 --launch-count 2 \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
  --section MemoryWorkloadAnalysis python3 /tmp/w4prof.py > "$OUT/ncu.log" 2>&1
say "ncu: rc=$? ($(( $(date +%s) - s )) s)"
grep -E "gemm_w4a8_stream|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Achieved Occupancy|Issued Warp|No Eligible|Warp Cycles Per Issued|Registers Per|L1/TEX Hit|Mem Busy|Max Bandwidth" "$OUT/ncu.log" >> "$S"
say "total $(( $(date +%s) - t0 )) s"
