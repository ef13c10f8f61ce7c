#!/usr/bin/env bash
# One GPU-machine call for the W4A8 tensor-core GEMM (kernels_cuda/ggml.cu gemm_w4a8_tc_kernel):
# precompile of ggml.cu, GPU tests (-k "gemm or graph"), conformance --full -k gemm, memcheck of
# small shapes, timing (tools/dev/w4a8_tc_time.py). Steps chosen by $W4T_STEPS (default all);
# $W4T_NS the n values, $W4T_CONFIGS the QUANTCORE_CUDA_TUNE settings compared. Logs under $OUT.
set -u
. tools/dev/env.sh /tmp/qc_out
S="$OUT/summary.txt"
: > "$S"
say() { echo "$*" | tee -a "$S"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee -a "$S"
t0=$(date +%s)
timeout 150 python3 - <<'PY' 2>&1 | tee -a "$S"
import time
t = time.time()
from quantcore.backends import cuda
from quantcore.backends.cuda import runtime as rt
n = rt.precompile([i for i in cuda.kernel_instances() if i[0] == "ggml.cu"], 0, workers=16)
print(f"precompiled {n} ggml.cu kernels in {time.time() - t:.1f} s")
PY
cat > /tmp/w4tprof.py <<'PY'
import torch
from quantcore.backends.cuda import create
be = create()
m, k, n = 4096, 14336, 512
w = torch.randint(0, 256, (m, k // 32, 18), dtype=torch.uint8, device="cuda")
w[..., 1] = 0x20
a = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
o = torch.empty(m, n, device="cuda")
for _ in range(3): be.gemm_w4a8(w, a, o)
torch.cuda.synchronize()
PY
for step in ${W4T_STEPS:-tests conformance memcheck timing}; do
  s=$(date +%s)
  case $step in
    tests)
      timeout 200 python3 -m pytest tests/test_cuda.py -q -rs -x -k "gemm or graph or w4a8" -p no:cacheprovider > "$OUT/pytest_gemm.log" 2>&1
      say "tests -k gemm/graph/w4a8: rc=$? $(tail -1 "$OUT/pytest_gemm.log") ($(( $(date +%s) - s )) s)"
      grep -E "Error|assert|FAILED" "$OUT/pytest_gemm.log" | head -20 >> "$S";;
    conformance)
      timeout 150 python3 -m quantcore.conformance --backend cuda --full -k gemm > "$OUT/conformance_gemm.log" 2>&1
      say "conformance --full -k gemm: rc=$? $(tail -1 "$OUT/conformance_gemm.log") ($(( $(date +%s) - s )) s)"
      grep -E "FAIL" "$OUT/conformance_gemm.log" | head -20 >> "$S";;
    memcheck)
      cat > /tmp/w4tmem.py <<'PY'
import torch
from quantcore.backends.cuda import create
be = create()
for m, n, k in ((37, 17, 1024), (130, 9, 4096 + 64), (20, 100, 256), (129, 513, 512)):
    w = torch.randint(0, 256, (m, k // 32, 18), dtype=torch.uint8, device="cuda")
    w[..., 1] = 0x20
    a = torch.randn(n, k, device="cuda", dtype=torch.float16)
    o = torch.empty(m, n, device="cuda")
    be.gemm_w4a8(w, a, o)
torch.cuda.synchronize()
print("memcheck script done")
PY
      timeout 90 compute-sanitizer --tool memcheck --leak-check no --print-limit 10 python3 /tmp/w4tmem.py > "$OUT/memcheck.log" 2>&1
      say "memcheck: rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1) ($(( $(date +%s) - s )) s)";;
    timing)
      timeout ${W4T_TIME_LIMIT:-240} python3 tools/dev/w4a8_tc_time.py "${W4T_NS:-16,64,512,2048,4096}" "${W4T_CONFIGS:-}" > "$OUT/timing.log" 2>&1
      say "timing: rc=$? ($(( $(date +%s) - s )) s)"
      cat "$OUT/timing.log" >> "$S";;
    crossover)
      timeout 120 python3 tools/dev/w4a8_linear_crossover.py > "$OUT/crossover.log" 2>&1
      say "crossover: rc=$? ($(( $(date +%s) - s )) s)"
      cat "$OUT/crossover.log" >> "$S";;
    bench)
      timeout 200 python3 -m quantcore.bench --backend cuda --ops gemm_w4a8 -v > "$OUT/bench.log" 2>&1
      say "bench: rc=$? ($(( $(date +%s) - s )) s)"
      grep -E "copy|gemm_w4a8" "$OUT/bench.log" >> "$S";;
    stalls)
      timeout 120 ncu --clock-control none --kernel-name regex:gemm_w4a8_tc --launch-skip 2 --launch-count 1 \
        --metrics regex:smsp__warp_issue_stalled_.*_per_warp_active.pct,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_imma.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed \
        python3 /tmp/w4tprof.py > "$OUT/stalls.log" 2>&1
      say "stalls: rc=$? ($(( $(date +%s) - s )) s)"
      grep -E "stalled|issue_active|imma|wavefronts" "$OUT/stalls.log" | sort -k3 -n -r | head -30 >> "$S";;
    ncu)
      timeout 120 ncu --clock-control none --kernel-name regex:w4a8_tc --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
        --section ComputeWorkloadAnalysis --section InstructionStats python3 /tmp/w4tprof.py > "$OUT/ncu.log" 2>&1
      say "ncu: rc=$? ($(( $(date +%s) - s )) s)"
      grep -E "w4a8_tc|Duration|Throughput|Achieved Occupancy|Issued Warp|No Eligible|Warp Cycles Per Issued|Registers Per|Issue Slots|Executed Ipc|Stall|Pipe" "$OUT/ncu.log" | head -60 >> "$S";;
  esac
done
say "total $(( $(date +%s) - t0 )) s"
