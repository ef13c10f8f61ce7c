#!/bin/bash
# Old against new of one source file on the GPU machine, in one call: a timing script runs with a
# copy of this tree in which $AS is replaced by $OLD ("old"), then with this tree ("new"), then with
# the copy again ("old2": the drift between the two old runs bounds the noise). Each tree builds
# into its own kernel cache. Usage, from the repository root (carry the old file):
#   OLD=.scratch/mx_gemm_old.cu AS=kernels_cuda/mx_gemm.cu bash tools/dev/ab_tree.sh tools/dev/mxgemm_time.py
#   OLD=.scratch/ggml_old.cu AS=kernels_cuda/ggml.cu bash tools/dev/ab_tree.sh tools/dev/w4a8_time.py ""
# (git show HEAD:kernels_cuda/ggml.cu > .scratch/ggml_old.cu makes the old file; OLD may be a folder:
# mkdir .scratch/k && git archive HEAD~1 kernels_cuda | tar -x -C .scratch/k, then OLD=.scratch/k/kernels_cuda AS=kernels_cuda;
# or several folders of an old tree: git archive HEAD kernels_cuda backends | tar -x -C .scratch/old, then
# OLD=.scratch/old AS=.)
set -o pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/ab_out}"
mkdir -p "$OUT"
ROOT=$PWD
SCRIPT=$ROOT/$1
shift
rm -rf /tmp/oldtree && mkdir -p /tmp/oldtree
cp -r quantcore backends kernels_cuda kernels_sycl kernels_maca /tmp/oldtree/
cp -rT "$OLD" "/tmp/oldtree/$AS"  # (a file, or a folder such as kernels_cuda)
run() {  # tag tree cache [script args]
  local tag=$1 tree=$2 cache=$3
  shift 3
  (cd /tmp && PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} QUANTCORE_CACHE_DIR=$cache timeout "${AB_LIMIT:-150}" python3 "$SCRIPT" "$@") 2>&1 \
    | sed "s/^/[$tag] /" | tee -a "$OUT/ab.log"
}
: > "$OUT/ab.log"
run old /tmp/oldtree /tmp/qc-old "$@"
run new "$ROOT" /tmp/qc-new "$@"
run old2 /tmp/oldtree /tmp/qc-old "$@"
