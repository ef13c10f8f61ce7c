#!/bin/bash
# MACA backend, compatibility mode: build + tests + full conformance on the GPU machine (compat mode). Logs to $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD XDG_CACHE_HOME=/tmp/qc-cache
cd "$(dirname "$0")/.."
{ nvidia-smi -L; nvcc --version | tail -2; python3 -c "import torch; print('torch', torch.__version__)"; } 2>&1 | tee $OUT/device.txt
START=$(date +%s)
python3 - <<'PY' 2>&1 | tee $OUT/build.log
import time, quantcore.backends.maca as m
b = m.create(); print(b.availability())
t = time.time(); b.library(); print("built", b.library_path, f"{time.time()-t:.1f}s")
PY
echo "build done at +$(( $(date +%s) - START ))s"
timeout ${PYTEST_LIMIT:-200} python3 -m pytest tests/test_maca.py -q -p no:cacheprovider -W ignore::RuntimeWarning 2>&1 | tee $OUT/pytest.log | tail -40
echo "pytest done at +$(( $(date +%s) - START ))s"
if [ "${SKIP_CONFORMANCE:-0}" != 1 ]; then
  timeout ${CONF_LIMIT:-300} python3 -m quantcore.conformance --backend maca --full --json $OUT/conformance_maca.json 2>&1 | tee $OUT/conformance.log | grep -v "^    " | tail -70
  echo "conformance exit ${PIPESTATUS[0]} at +$(( $(date +%s) - START ))s"
fi
