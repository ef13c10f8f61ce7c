set -u; OUT=${OUT:-/tmp/o}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export QUANTCORE_CACHE_DIR=/tmp/qc_cache
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 - <<'P' 2>&1 | tail -3
import time; t=time.time()
from quantcore.backends import cuda
from quantcore.backends.cuda import runtime as rt
inst=[i for i in cuda.kernel_instances() if "gemv" in i[1] or "quantize_4bit_kernel" in i[1] or "quantize_blockwise" in i[1] or "tree" in i[1]]
print("precompiled", rt.precompile(inst, 0, workers=16), "in", round(time.time()-t,1), "s")
P
timeout 120 python3 -m pytest tests/test_cuda.py -q -x -k gemv > $OUT/pytest_gemv.log 2>&1; echo "pytest gemv rc=$? $(tail -1 $OUT/pytest_gemv.log)"
timeout 90 python3 -m quantcore.conformance --backend cuda --full -k gemv > $OUT/conf_gemv.log 2>&1; echo "conformance gemv rc=$? $(tail -2 $OUT/conf_gemv.log | head -1)"; grep -m5 FAIL $OUT/conf_gemv.log
timeout 100 python3 -m quantcore.bench --backend cuda --ops gemv_4bit --json $OUT/bench_new.json --png $OUT/b.png > $OUT/bench_new.log 2>&1; echo "bench new rc=$?"
[ -n "${SWEEP:-}" ] && timeout 90 python3 tools/cuda_tune_sweep.py > $OUT/sweep.log 2>&1; echo "sweep rc=$?"
timeout 60 ncu --clock-control none --kernel-name regex:gemv_4bit --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section SchedulerStats --section InstructionStats --launch-count 1 python3 tools/cuda_profile_gemv.py > $OUT/ncu_gemv.log 2>&1; echo "ncu rc=$?"
grep -E "copy|gemv" $OUT/bench_new.log | grep -v "^\[" | cut -c1-150
[ -n "${SWEEP:-}" ] && grep SWEEP $OUT/sweep.log
grep -E "gemv_4bit_tma|DRAM Throughput|Duration|Memory Throughput|Achieved Occupancy|No Eligible|Issued Warp|Executed Instructions  |Warp Cycles Per Issued" $OUT/ncu_gemv.log | cut -c1-100 | head -30
