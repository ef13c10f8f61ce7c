#!/usr/bin/env bash
# NF4 prefill (kernels_cuda/bnb_gemm.cu) on the GPU machine, one call: the timing / tile sweep
# (tools/dev/gemm4_time.py), the conformance suite's gemv_4bit cases on cuda (full level), and
# `quantcore bench --ops linear_4bit` (JSON + table). Run from the repository root with the
# bitsandbytes wheel importable; logs go to $OUT.
. tools/dev/env.sh "${OUT:-/tmp/gm_out}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
t0=$(date +%s)
timeout ${TIME_LIMIT:-300} python3 tools/dev/gemm4_time.py ${TIME_ARGS:-} 2>&1 | tee "$OUT/gemm4_time.log" | grep -v "^check" | tail -25
grep "^check" "$OUT/gemm4_time.log" | awk '{print $NF, $0}' | sort -g | tail -3
echo "[time sweep +$(( $(date +%s) - t0 ))s]"
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
