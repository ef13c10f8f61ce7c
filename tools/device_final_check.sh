#!/usr/bin/env bash
# The final check of the project on the GPU machine, in steps that fit one or two calls:
#   tests        the GPU test files (tests/test_cuda*.py, tests/test_maca.py, the torch layer's tests)
#                through pytest; NVCC_CHECKS=0 skips the nvcc compile checks (they need no GPU)
#   alltests     the project's whole test command (pytest -m "not slow"; SYCL tests skip there)
#   conformance  the full conformance suite on the cuda backend (JSON + log)
#   maca         the full conformance suite on the maca backend (compatibility mode)
#   sanitizer    compute-sanitizer memcheck on the cuda quick suite
#   bench        quantcore bench (all ops, JSON + PNG)
# Usage: tools/device_final_check.sh [steps...] (default: alltests conformance maca sanitizer).
# Logs and JSON go to $OUT. Run from the repository root with .whl carried.
set -u
OUT=${OUT:-/tmp/qc_out}
mkdir -p "$OUT"
S="$OUT/summary.txt"
: > "$S"
say() { echo "$*" | tee -a "$S"; }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 QUANTCORE_CACHE_DIR=/tmp/qc_cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$S"
t0=$(date +%s)
python3 - <<'EOF' 2>&1 | tee -a "$S"
import time
t = time.time()
from quantcore.backends import cuda
from quantcore.backends.cuda import runtime as rt
n = rt.precompile(cuda.kernel_instances(), 0, workers=16)
print(f"precompiled {n} kernels in {time.time() - t:.1f} s")
EOF
for step in ${*:-alltests conformance maca sanitizer}; do
  case $step in
    tests)
      # NVCC_CHECKS=0 leaves out the nvcc compile checks (about half the time on an H200; they need
      # no GPU and run wherever nvcc is: pytest tests/test_cuda.py tests/test_cuda_mx.py -k nvcc ...)
      sel=(); [ "${NVCC_CHECKS:-1}" = 0 ] && sel=(-k "not nvcc and not source_compiles and not compiles_and_links")
      timeout ${PYTEST_LIMIT:-560} python3 -m pytest tests/test_cuda.py tests/test_cuda_*.py tests/test_maca.py \
        tests/test_torch_nn.py tests/test_torch_hf.py -m "not slow" -q -rs -p no:cacheprovider ${sel[@]+"${sel[@]}"} \
        > "$OUT/pytest_gpu.log" 2>&1
      say "pytest GPU files: rc=$? $(tail -1 "$OUT/pytest_gpu.log") [+$(( $(date +%s) - t0 ))s]";;
    alltests)
      timeout ${PYTEST_LIMIT:-560} python3 -m pytest -m "not slow" -q -rs -p no:cacheprovider > "$OUT/pytest_all.log" 2>&1
      say "pytest (not slow): rc=$? $(tail -1 "$OUT/pytest_all.log") [+$(( $(date +%s) - t0 ))s]";;
    conformance|maca)
      be=cuda; [ "$step" = maca ] && be=maca
      timeout ${CONF_LIMIT:-150} python3 -m quantcore.conformance --backend $be --full --json "$OUT/conformance_$be.json" \
        > "$OUT/conformance_$be.log" 2>&1
      say "conformance $be full: rc=$? $(grep -E '^(PASS|FAIL)' "$OUT/conformance_$be.log" | tail -1) [+$(( $(date +%s) - t0 ))s]";;
    sanitizer)
      timeout ${SAN_LIMIT:-240} compute-sanitizer --tool memcheck --leak-check no --print-limit 20 \
        python3 -m quantcore.conformance --backend cuda --quick > "$OUT/sanitizer_quick.log" 2>&1
      say "memcheck cuda quick: rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer_quick.log" | tail -1) $(grep -E '^(PASS|FAIL)' "$OUT/sanitizer_quick.log" | tail -1) [+$(( $(date +%s) - t0 ))s]";;
    bench)
      timeout ${BENCH_LIMIT:-200} python3 -m quantcore.bench --backend cuda --json "$OUT/bench.json" --png "$OUT/bench.png" \
        > "$OUT/bench.log" 2>&1
      say "bench: rc=$? [+$(( $(date +%s) - t0 ))s]";;
    *) say "unknown step $step";;
  esac
done
cat "$S"
