#!/usr/bin/env bash
# One device call for quantize_4bit (plain, and with double quantization in one launch) and
# dequantize_4bit: build, GPU tests, the conformance suite for both ops, the kernel timing
# (tools/dev/bnb4_time.py), the bench rows, and an ncu profile of one launch of each kernel.
# Run from the repository root with .whl carried; logs under $OUT.
set -u
OUT=${OUT:-/tmp/qc_out}
mkdir -p "$OUT"
S="$OUT/summary.txt"
: > "$S"
say() { echo "$*" | tee -a "$S"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null \
  && export PYTHONPATH=/tmp/site
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} QUANTCORE_CACHE_DIR=/tmp/qc_cache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$S"
t0=$(date +%s)
python3 - <<'PY' 2>&1 | tail -3 | tee -a "$S"
import time; t = time.time()
from quantcore.backends import cuda
from quantcore.backends.cuda import runtime as rt
from quantcore.formats import bnb
inst = []
for qt in bnb.QUANT_TYPES:
    for tag in cuda.TYPE_TAG.values():
        inst += [(cuda._F4, cuda._q4(tag, qt)), (cuda._F4, cuda._q4(tag, qt, nested=True))]
        inst += [(cuda._F4, cuda._dq4(tag, qt, nd)) for nd in (False, True)]
inst += [(cuda._F8, cuda._tree(None, 3))] + [(cuda._F8, cuda._qbw(t, 3)) for t in cuda.TYPE_TAG.values()]
print(f"precompiled {rt.precompile(inst, 0, workers=16)} kernels in {time.time() - t:.1f} s")
PY
step() { local name=$1; shift; local s=$(date +%s); "$@"; say "$name: rc=$? ($(( $(date +%s) - s )) s)"; }
step tests timeout ${TEST_LIMIT:-150} python3 -m pytest tests/test_cuda_quantize_nested.py tests/test_cuda_double_quant.py \
  tests/test_cuda_bnb4_speed.py tests/test_cuda.py -q -rs -x \
  -k "nested or fused or double_quantize or (4bit and not gemv and not compile) or 2_31" > "$OUT/pytest.log" 2>&1
say "  $(tail -1 "$OUT/pytest.log")"
step conformance timeout 120 python3 -m quantcore.conformance --backend cuda --full -k quantize_4bit \
  > "$OUT/conformance.log" 2>&1
say "  $(tail -1 "$OUT/conformance.log")"
step timing timeout 50 python3 tools/dev/bnb4_time.py > "$OUT/timing.log" 2>&1
cat "$OUT/timing.log" | tee -a "$S"
step bench timeout 60 python3 -m quantcore.bench --backend cuda --ops dequantize_4bit quantize_4bit -v \
  --json "$OUT/bench.json" --png "$OUT/bench.png" > "$OUT/bench.log" 2>&1
grep -E "^(copy|dequantize_4bit|quantize_4bit)" "$OUT/bench.log" | tee -a "$S"
step ncu timeout 35 ncu --clock-control none --kernel-name regex:"quantize_4bit" \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
  --section LaunchStats python3 tools/dev/bnb4_time.py --ncu-one > "$OUT/ncu.log" 2>&1
grep -E "quantize_4bit|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|Issued Ipc|No Eligible|Stall Long|Warp Cycles Per Issued" "$OUT/ncu.log" | head -80 > "$OUT/ncu_short.txt"
say "total $(( $(date +%s) - t0 )) s"
