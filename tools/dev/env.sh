# The GPU-machine scripts' common environment; source it from the repository root with the default
# log folder: . tools/dev/env.sh /tmp/some_out  (sets OUT unless given, PYTHONPATH, the kernel cache)
set -o pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$1}"
mkdir -p "$OUT"
export QUANTCORE_CACHE_DIR=/tmp/qc-cache
