#!/usr/bin/env bash
# Tensor parallel decode on the 2-GPU device kind (nvidia-h100-x2), NCCL, NVLink multicast off:
# one decode step of Llama-3-70B widths (tools/tp_decode.py) at TP=1 (GPU 0) and TP=2 (torchrun),
# each captured in a CUDA graph where NCCL allows; JSON to $OUT (tp1.json, tp2.json, tp_decode.json).
#   OUT=/some/dir tools/tp_device.sh    # LAYERS=32 by default (80 layers of nf4: ~35 GB by arithmetic)
#   LAYERS=80 CTX=1024 STEPS=200 FMT=nf4 REDUCE=float32 OUT=... tools/tp_device.sh
#   ALL_REDUCE="group symm_mem oneshot" OUT=... tools/tp_device.sh   # TP=2 with each all-reduce (tp2.json, tp2_<name>.json)
#   ALL_REDUCE="oneshot oneshot:ar_mode=0,ar_pdl=0" OUT=... tools/tp_device.sh  # one all-reduce, tuned two ways
#   COMPILE_GLUE=1 TP_LIMIT=150 OUT=... tools/tp_device.sh     # the elementwise parts torch.compile'd
#   TRACE_LAYERS=1 LAYERS=80 OUT=... tools/tp_device.sh         # + the first layer where graph and eager part
#   GROUP=1 OUT=... tools/tp_device.sh                          # q/k/v and gate/up as grouped gemv launches
#   FUSE_NORM=1 OUT=... tools/tp_device.sh                      # each all-reduce fused with the add + norm after it
#   FUSE_ROPE=1 OUT=... tools/tp_device.sh                      # rope and the KV-cache writes as one glue function
#   PROFILE_STEPS=20 OUT=... tools/tp_device.sh                 # + GPU time per kernel name (kernel_profile)
#   DEVICE=cpu LAYERS=2 HIDDEN=256 INTERMEDIATE=512 HEADS=4 KV_HEADS=2 OUT=... tools/tp_device.sh  # gloo twin
set -euo pipefail
: "${OUT:?set OUT to the folder for the JSON}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast stays off
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python}
ARGS=(--device "$DEVICE" --layers "${LAYERS:-32}" --hidden "${HIDDEN:-8192}" --intermediate "${INTERMEDIATE:-28672}"
      --heads "${HEADS:-64}" --kv-heads "${KV_HEADS:-8}" --ctx "${CTX:-1024}" --steps "${STEPS:-200}"
      --fmt "${FMT:-nf4}" --reduce-dtype "${REDUCE:-activation}")
[ "${COMPILE_GLUE:-0}" = 1 ] && ARGS+=(--compile-glue)  # torch.compile the norms, rope and silu * up
[ "${TRACE_LAYERS:-0}" = 1 ] && ARGS+=(--trace-layers)  # per-layer graph-against-eager comparison
[ "${GROUP:-0}" = 1 ] && ARGS+=(--group-linears)  # q/k/v and gate/up as grouped gemv launches
[ "${FUSE_NORM:-0}" = 1 ] && ARGS+=(--fuse-reduce-norm)  # TP>1: all-reduce + residual add + norm in one call
[ "${FUSE_ROPE:-0}" = 1 ] && ARGS+=(--fuse-rope-cache)  # rope and the cache writes as one glue function
[ -n "${PROFILE_STEPS:-}" ] && ARGS+=(--profile "$PROFILE_STEPS")  # GPU time per kernel name (kernel_profile in the JSON)
if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
  n=$(nvidia-smi -L | wc -l)
  [ "$n" -ge 2 ] || { echo "tp_device.sh: needs 2 GPUs, found $n" >&2; exit 1; }
  "$PY" -c "import torch, sys; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
fi
t0=$(date +%s)
# each run under a time limit (TP_LIMIT s), so one that hangs leaves the others their time
CUDA_VISIBLE_DEVICES=${TP1_GPU:-0} timeout "${TP_LIMIT:-300}" "$PY" tools/tp_decode.py "${ARGS[@]}" --out "$OUT/tp1.json" --save-ref "$OUT/tp1_ref.pt"
# the rowwise all-reduce: group (NCCL), symm_mem and / or oneshot; NAME:TUNE runs NAME with
# QUANTCORE_CUDA_TUNE=TUNE (e.g. oneshot:ar_mode=0,ar_pdl=0), its JSON tp2_NAME_TUNE.json
for ar in ${ALL_REDUCE:-group}; do
  name=${ar%%:*}; tune=""; [ "$name" = "$ar" ] || tune=${ar#*:}
  f=tp2.json; [ "$ar" = group ] || f=tp2_$(printf %s "$ar" | tr ':=,' '___').json
  QUANTCORE_CUDA_TUNE="$tune" timeout "${TP_LIMIT:-300}" "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 \
    tools/tp_decode.py "${ARGS[@]}" --all-reduce "$name" --out "$OUT/$f" --ref "$OUT/tp1_ref.pt" \
    || echo "tp_device.sh: TP=2 with $ar failed or ran out of time (rc $?)" >&2
done
"$PY" - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
t1 = json.load(open(os.path.join(out, "tp1.json")))
res, bad = {"tp1": t1}, []
for path in sorted(glob.glob(os.path.join(out, "tp2*.json"))):
    t2 = json.load(open(path))
    key = os.path.basename(path)[:-5]
    res[key] = t2
    res[f"speedup_{key}_over_tp1"] = t2["tokens_per_s"] / t1["tokens_per_s"]
    print(json.dumps({"run": key, "all_reduce": t2.get("all_reduce", "group"),
                      "tp1_tokens_per_s": round(t1["tokens_per_s"], 1), "tp2_tokens_per_s": round(t2["tokens_per_s"], 1),
                      "speedup": round(t2["tokens_per_s"] / t1["tokens_per_s"], 3), "tp1_graph": t1["graph"],
                      "tp2_graph": t2["graph"],
                      "ms_per_step_eager": [t1.get("ms_per_step_eager"), t2.get("ms_per_step_eager")], "eager_repeat": [t1.get("eager_repeat_rel_l2"), t2.get("eager_repeat_rel_l2")],
                      "vs_tp1": t2.get("vs_tp1"), "out_digest": t2.get("out_digest"),
                      "gpu_bytes_tp1": [r.get("peak_allocated", r["weights_bytes"]) for r in t1["per_rank"]],
                      "gpu_bytes_tp2": [r.get("peak_allocated", r["weights_bytes"]) for r in t2["per_rank"]]}, indent=1))
    # One layer (attention and MLP, both all-reduces) against TP=1's: bf16 partial sums are a few bf16
    # roundings apart (~1e-3); a wrong shard or reduce is O(1) off. The whole step's distance is
    # reported, not judged: a random-weight stack amplifies rounding differences with depth.
    if not t2.get("vs_tp1") or t2["vs_tp1"]["layer0_rel_l2"] > 1e-2:
        bad.append(key)
json.dump(res, open(os.path.join(out, "tp_decode.json"), "w"), indent=1)
if bad:
    sys.exit(f"tp_device.sh: TP=2's output is too far from TP=1's in {bad}")
PY
echo "tp_device.sh: done in $(( $(date +%s) - t0 )) s"
