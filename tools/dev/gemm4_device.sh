#!/usr/bin/env bash
# NF4 prefill (kernels_cuda/bnb_gemm.cu) on the GPU machine, one call: the GEMM's GPU tests
# (TESTS=1), the timing / CTA-shape sweep (tools/dev/gemm4_time.py; ROWS=32,64 limits the rows),
# the same rows' default kernel of an older tree (OLD=<its root>: this gemm4_time.py copied there,
# --fused-only), the conformance suite's gemv_4bit cases on cuda (full level), and
# `quantcore bench --ops linear_4bit` (BENCH=1, JSON + table). Run from the repository root with the
# bitsandbytes wheel importable; logs go to $OUT.
. tools/dev/env.sh "${OUT:-/tmp/gm_out}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
t0=$(date +%s)
rows_arg=${ROWS:+--rows $ROWS}
if [ -n "${TESTS:-}" ]; then
  timeout ${TEST_LIMIT:-150} python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py \
    -k "many_rows or refuse_less or gemv_4bit" > "$OUT/tests_gemm4.log" 2>&1
  echo "tests: rc=$? $(tail -1 "$OUT/tests_gemm4.log") [+$(( $(date +%s) - t0 ))s]"
  grep -E "^(FAILED|ERROR)|Error" "$OUT/tests_gemm4.log" | head -8
fi
timeout ${TIME_LIMIT:-300} python3 tools/dev/gemm4_time.py ${TIME_ARGS:-} $rows_arg 2>&1 | tee "$OUT/gemm4_time.log" | grep -v "^check" | tail -25
grep "^check" "$OUT/gemm4_time.log" | awk '{print $NF, $0}' | sort -g | tail -3
echo "[time sweep +$(( $(date +%s) - t0 ))s]"
if [ -n "${OLD:-}" ]; then
  cp tools/dev/gemm4_time.py "$OLD/tools/dev/gemm4_time.py"
  (cd "$OLD" && PYTHONPATH="$PWD${PYTHONPATH#"${PYTHONPATH%%:*}"}" QUANTCORE_CACHE_DIR=/tmp/qc-cache-old \
    timeout ${OLD_LIMIT:-120} python3 tools/dev/gemm4_time.py --fused-only $rows_arg 2>&1 | tail -14 | sed 's/^/old: /')
  echo "[old tree +$(( $(date +%s) - t0 ))s]"
fi
timeout ${CONF_LIMIT:-150} python3 -m quantcore.conformance --backend cuda --full -k gemv_4bit \
  --json "$OUT/conformance_gemv.json" > "$OUT/conformance_gemv.log" 2>&1
echo "conformance gemv_4bit (full): rc=$? $(grep -E '^(PASS|FAIL)' "$OUT/conformance_gemv.log" | tail -3) [+$(( $(date +%s) - t0 ))s]"
grep -E "FAILED|Error" "$OUT/conformance_gemv.log" | head -8
if [ -n "${BENCH:-}" ]; then
  timeout ${BENCH_LIMIT:-200} python3 -m quantcore bench --backend cuda --ops linear_4bit --json "$OUT/bench_linear_4bit.json" \
    --png "$OUT/bench_linear_4bit.png" -q > "$OUT/bench_linear_4bit.log" 2>&1
  echo "bench: rc=$? [+$(( $(date +%s) - t0 ))s]"
  tail -22 "$OUT/bench_linear_4bit.log"
fi
