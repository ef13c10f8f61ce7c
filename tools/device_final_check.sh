#!/usr/bin/env bash
# One call on the GPU machine that checks the whole project there: the project's own test command
# (pytest, as in `nox -s tests`; GPU tests run, SYCL tests skip without dpctl), the full
# conformance suite for the cuda and maca backends, and compute-sanitizer memcheck on the cuda
# quick suite. Logs and JSON go to $OUT. Run from the repository root with .whl carried.
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
timeout ${PYTEST_LIMIT:-330} python3 -m pytest -m "not slow" -q -rs -p no:cacheprovider > "$OUT/pytest_all.log" 2>&1
say "pytest (not slow): rc=$? $(tail -1 "$OUT/pytest_all.log") [+$(( $(date +%s) - t0 ))s]"
for be in cuda maca; do
  timeout 120 python3 -m quantcore.conformance --backend $be --full --json "$OUT/conformance_$be.json" \
    > "$OUT/conformance_$be.log" 2>&1
  say "conformance $be full: rc=$? $(grep -E '^(PASS|FAIL)' "$OUT/conformance_$be.log" | tail -1) [+$(( $(date +%s) - t0 ))s]"
done
if [ "${SANITIZER:-1}" = 1 ]; then
  timeout ${SAN_LIMIT:-200} compute-sanitizer --tool memcheck --leak-check no --print-limit 20 \
    python3 -m quantcore.conformance --backend cuda --quick > "$OUT/sanitizer_quick.log" 2>&1
  say "memcheck cuda quick: rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer_quick.log" | tail -1) $(grep -E '^(PASS|FAIL)' "$OUT/sanitizer_quick.log" | tail -1) [+$(( $(date +%s) - t0 ))s]"
fi
cat "$S"
