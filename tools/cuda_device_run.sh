#!/usr/bin/env bash
# One call on the GPU machine for the cuda backend: build (NVRTC, in parallel), the CUDA tests,
# the conformance suite (full), compute-sanitizer memcheck on the quick suite, and the benchmark.
# Logs go to $OUT (at most 8 files come back). Steps are chosen by the arguments:
#   tools/cuda_device_run.sh [tests] [conformance] [sanitizer] [bench] [benchquick] [sweep] [ncu]
# Run from the repository root, with .whl carried (bitsandbytes' wheel).
set -u
OUT=${OUT:-/tmp/qc_out}
mkdir -p "$OUT"
STEPS=${*:-tests conformance sanitizer bench}
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export QUANTCORE_CACHE_DIR=/tmp/qc_cache
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$SUMMARY"
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)" 2>&1 | tee -a "$SUMMARY"

t0=$(date +%s)
python3 - <<'EOF' 2>&1 | tee -a "$SUMMARY"
import time
t = time.time()
from quantcore.backends import cuda
from quantcore.backends.cuda import runtime as rt
print("availability:", cuda.create().availability())
n = rt.precompile(cuda.kernel_instances(), 0, workers=16)
print(f"precompiled {n} kernels in {time.time() - t:.1f} s")
EOF

for step in $STEPS; do
  s=$(date +%s)
  case $step in
    tests)
      timeout 150 python3 -m pytest tests/test_cuda.py -q -rs --durations=8 > "$OUT/pytest_cuda.log" 2>&1
      say "tests: rc=$? $(tail -1 "$OUT/pytest_cuda.log")";;
    conformance)
      timeout 120 python3 -m quantcore.conformance --backend cuda --full --json "$OUT/conformance_full.json" \
        > "$OUT/conformance_full.log" 2>&1
      say "conformance full: rc=$? $(tail -1 "$OUT/conformance_full.log")";;
    sanitizer)
      timeout 300 compute-sanitizer --tool memcheck --leak-check no --print-limit 20 \
        python3 -m quantcore.conformance --backend cuda --quick > "$OUT/sanitizer_quick.log" 2>&1
      say "sanitizer: rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer_quick.log" | tail -1) $(grep -E '^(PASS|FAIL)' "$OUT/sanitizer_quick.log" | tail -1)";;
    bench|benchquick)
      q=""; [ "$step" = benchquick ] && q="--quick"
      timeout 130 python3 -m quantcore.bench --backend cuda $q --json "$OUT/bench.json" --png "$OUT/bench.png" -v \
        > "$OUT/bench.log" 2>&1
      say "bench: rc=$?";;
    ncu)
      timeout 240 ncu --clock-control none --kernel-name regex:"quantize_4bit_kernel|gemv_4bit_mma|gemm_q4_0" \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
        --section LaunchStats --section SchedulerStats python3 tools/cuda_profile.py > "$OUT/ncu.log" 2>&1
      say "ncu: rc=$?";;
    sweep)
      timeout 90 python3 tools/cuda_tune_sweep.py >> "$OUT/bench.log" 2>&1
      say "sweep: rc=$? (appended to bench.log)";;
    *) say "unknown step $step";;
  esac
  say "  ($step took $(( $(date +%s) - s )) s)"
done
say "total $(( $(date +%s) - t0 )) s"
