#!/usr/bin/env bash
# The PyTorch layer on the GPU machine: the torch/nn/hf test files, the eager host-time table and
# (with E2E="args") the end-to-end benchmark. Logs go to $OUT. Run from the repository root with
# .whl carried (bitsandbytes' wheel).
set -u
OUT=${OUT:-/tmp/qc_out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 QUANTCORE_CACHE_DIR=/tmp/qc_cache HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
t0=$(date +%s)
python3 - <<'PY'
import time
t = time.time()
from quantcore.backends import cuda
from quantcore.backends.cuda import runtime as rt
print(f"precompiled {rt.precompile(cuda.kernel_instances(), 0, workers=16)} kernels in {time.time() - t:.1f} s")
PY
for step in ${STEPS:-tests host}; do
  case $step in
    tests) timeout ${PYTEST_LIMIT:-300} python3 -m pytest ${TESTS:-tests/test_torch_nn.py} -q -rs -p no:cacheprovider \
             > "$OUT/pytest_torch.log" 2>&1
           echo "pytest: rc=$? $(tail -1 "$OUT/pytest_torch.log") [+$(( $(date +%s) - t0 ))s]"
           grep -E "^(FAILED|ERROR)" "$OUT/pytest_torch.log" | head -20;;
    host) timeout 200 python3 tools/dev/linear_host_time.py ${HOST_ARGS:-} 2>&1 | tee "$OUT/host_time.txt"
          echo "[+$(( $(date +%s) - t0 ))s]";;
    e2e) timeout ${E2E_LIMIT:-400} python3 -m quantcore.bench --e2e ${E2E:-} 2>&1 | tee "$OUT/e2e.log" | tail -60
         echo "[+$(( $(date +%s) - t0 ))s]";;
  esac
done
