#!/usr/bin/env bash
# linear_mx's gemv on the GPU machine, from the repository root (after . tools/dev/env.sh $OUT):
#   tests   the GPU linear_mx tests of tests/test_cuda_mx.py
#   ab      tools/dev/mx_gemv_ab.py: linear_mx's kernels against each other (its --variants; single launch and
#           graph-timed), the docs/performance.md table (AB_ARGS: its arguments)
#   conf    python3 -m quantcore.conformance --backend cuda --full -k linear_mx (and maca: the MACA port
#           through its compatibility header)
#   memcheck  compute-sanitizer memcheck of the quick linear_mx conformance cases
#   bench   quantcore bench --backend cuda --ops linear_mx (JSON in $OUT)
# Usage: bash tools/dev/mx_gemv_device.sh [steps...] (default: tests ab conf)
S="$OUT/summary.txt"; : > "$S"; t0=$(date +%s)
say() { echo "$*" | tee -a "$S"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader | tee -a "$S"
for step in ${*:-tests ab conf}; do
  case $step in
    tests)
      timeout ${PYTEST_LIMIT:-200} python3 -m pytest tests/test_cuda_mx.py -k "${PYTEST_K:-linear_mx or gemv}" -q -rs -x \
        -p no:cacheprovider > "$OUT/pytest_mx.log" 2>&1
      say "pytest linear_mx: rc=$? $(tail -1 "$OUT/pytest_mx.log") [+$(( $(date +%s) - t0 ))s]"
      grep -E "^(FAILED|E  )" "$OUT/pytest_mx.log" | head -20 | tee -a "$S";;
    ab)
      timeout ${AB_LIMIT:-200} python3 tools/dev/mx_gemv_ab.py ${AB_ARGS:-} > "$OUT/ab.log" 2>&1
      say "ab: rc=$? [+$(( $(date +%s) - t0 ))s]"; grep -v AB_JSON "$OUT/ab.log" | tee -a "$S" > /dev/null;;
    conf)
      for be in ${CONF_BACKENDS:-cuda maca}; do
        timeout ${CONF_LIMIT:-150} python3 -m quantcore.conformance --backend $be --full -k linear_mx \
          --json "$OUT/conformance_$be.json" > "$OUT/conformance_$be.log" 2>&1
        say "conformance $be -k linear_mx: rc=$? $(grep -E '^(PASS|FAIL)' "$OUT/conformance_$be.log" | tail -1) [+$(( $(date +%s) - t0 ))s]"
      done;;
    memcheck)
      timeout ${SAN_LIMIT:-120} compute-sanitizer --tool memcheck --leak-check no --print-limit 20 \
        python3 -m quantcore.conformance --backend cuda --quick -k linear_mx > "$OUT/memcheck.log" 2>&1
      say "memcheck linear_mx quick: rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1) [+$(( $(date +%s) - t0 ))s]";;
    bench)
      timeout ${BENCH_LIMIT:-150} python3 -m quantcore.bench --backend cuda --ops linear_mx --json "$OUT/bench_linear_mx.json" \
        > "$OUT/bench.log" 2>&1
      say "bench: rc=$? [+$(( $(date +%s) - t0 ))s]"; tail -30 "$OUT/bench.log" >> "$S";;
    *) say "unknown step $step";;
  esac
done
cat "$S"
