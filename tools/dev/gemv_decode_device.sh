#!/bin/bash
# The decode gemv (kernels_cuda/bnb_gemv.cu) on the GPU machine in one call: the conformance suite's
# gemv_4bit cases (full) on this tree, then tools/dev/gemv_decode_ab.py on a copy of the tree whose
# bnb_gemv.cu is $OLD ("old") and on this tree ("new"), each with its own kernel cache; RUNS lists
# the order (default "old new"; "old new old" bounds the drift; a tag tune_X runs this tree under
# QUANTCORE_CUDA_TUNE=X; any other tag T runs a copy whose bnb_gemv.cu is $VARDIR/T.cu and whose
# kernel_defines.py is $VARDIR/T.defines.py, where they exist: experiments). NCU="N K ..." also
# profiles this tree's kernel at those shapes (batch 1) under Nsight Compute (--set full and the stall reasons, $OUT/ncu.log); TESTS=1
# runs the GPU gemv_4bit tests of tests/test_cuda.py first; BENCH=1 ends with `quantcore bench --ops
# decode_step gemv_4bit` on this tree (bitsandbytes from .whl when carried). Extra arguments go to
# the timing script. From the repository root, the old file carried:
#   git show main:kernels_cuda/bnb_gemv.cu > old_bnb_gemv.cu
#   OLD=old_bnb_gemv.cu bash tools/dev/gemv_decode_device.sh
. tools/dev/env.sh /tmp/gv_out
ROOT=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
if [ "${CONF:-1}" = 1 ]; then
  timeout "${CONF_LIMIT:-150}" python3 -m quantcore.conformance --backend cuda --full -k gemv_4bit \
    > "$OUT/conf_gemv.log" 2>&1
  echo "conformance gemv_4bit (full): rc=$? $(grep -E '^(PASS|FAIL)' "$OUT/conf_gemv.log" | tail -1 | cut -c1-200)"
  grep -m8 -E "FAIL|mismatch|error" "$OUT/conf_gemv.log" | cut -c1-200
fi
if [ "${TESTS:-0}" = 1 ]; then
  timeout "${TESTS_LIMIT:-120}" python3 -m pytest tests/test_cuda.py -q -p no:cacheprovider \
    -k "gemv_4bit_within_bounds or gemv_4bit_kernels_and_k_splits or gemv_4bit_rings_sum_alike" > "$OUT/pytest_gemv.log" 2>&1
  echo "pytest gemv_4bit: rc=$? $(tail -1 "$OUT/pytest_gemv.log")"
fi
if [ -n "${NCU:-}" ]; then
  timeout "${NCU_LIMIT:-120}" ncu --clock-control none --kernel-name regex:gemv_4bit_tc --launch-count 2 --set full \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
    python3 tools/cuda_profile_gemv.py $NCU > "$OUT/ncu.log" 2>&1
  echo "ncu: rc=$?"
fi
: > "$OUT/ab.log"
for tag in ${RUNS:-old new}; do
  tree=$ROOT
  tune=${QUANTCORE_CUDA_TUNE:-}
  if [ "${tag#tune_}" != "$tag" ]; then
    tune=${tag#tune_}  # this tree under QUANTCORE_CUDA_TUNE=<the rest of the tag>
  elif [ "$tag" = old ] && [ -n "${OLDTREE:-}" ]; then
    tree=$ROOT/$OLDTREE  # a whole old tree (its launcher too)
  elif [ "$tag" != new ]; then
    tree=/tmp/tree_$tag
    rm -rf "$tree" && mkdir -p "$tree"
    cp -r quantcore backends kernels_cuda kernels_sycl kernels_maca kernels_cpu "$tree/"
    if [ "$tag" = old ]; then cp "$OLD" "$tree/kernels_cuda/bnb_gemv.cu"
    elif [ -f "$VARDIR/$tag.cu" ]; then cp "$VARDIR/$tag.cu" "$tree/kernels_cuda/bnb_gemv.cu"; fi
    # a variant may also change the launch geometry: $VARDIR/T.defines.py replaces kernel_defines.py
    if [ "$tag" != old ] && [ -f "$VARDIR/$tag.defines.py" ]; then
      cp "$VARDIR/$tag.defines.py" "$tree/quantcore/formats/kernel_defines.py"; fi
  fi
  (cd /tmp && PYTHONPATH=$tree:${PYTHONPATH:-} QUANTCORE_CACHE_DIR=/tmp/qc-$tag QUANTCORE_CUDA_TUNE=$tune \
     timeout "${AB_LIMIT:-150}" python3 "$ROOT/tools/dev/gemv_decode_ab.py" "$tag" "$@") >> "$OUT/ab.log" 2>&1
  echo "$tag: rc=$?"
done
grep -v AB_JSON "$OUT/ab.log" | grep -v Warning | tail -40
if [ "${BENCH:-0}" = 1 ]; then
  ls .whl/*.whl > /dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
  timeout "${BENCH_LIMIT:-200}" python3 -m quantcore.bench --backend cuda --ops decode_step gemv_4bit \
    --json "$OUT/bench_decode.json" --png "$OUT/bench_decode.png" > "$OUT/bench_decode.log" 2>&1
  echo "bench: rc=$?"
  grep -E "copy|decode_step|gemv_4bit" "$OUT/bench_decode.log" | grep -v "^\[" | cut -c1-160 | tail -60
fi
