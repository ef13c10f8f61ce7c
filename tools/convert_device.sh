#!/usr/bin/env bash
# Conversion spread over GPUs (issue #24 item 3) on the 2-GPU device kind: a synthetic bf16
# safetensors checkpoint of Llama-3-8B's linear shapes (LAYERS layers, default 8: ~3.5 GB) quantized
# to nf4 with `quantcore quantize --devices cuda:0` and `--devices cuda:0,cuda:1`; wall time of each
# (process start-up included; the input in the page cache after the first, untimed, read) and the
# outputs compared byte for byte; then both settings again in one process whose start-up is done (the
# conversion alone: one_inprocess_s, two_inprocess_s). Summary in $OUT/convert.json.
#   OUT=/some/dir tools/convert_device.sh     # LAYERS=8 FMT=nf4 REPS=2
#   ONE="--workers 1" TWO="--workers 2" LAYERS=1 OUT=... tools/convert_device.sh   # CPU processes instead
#   PROFILE=1 OUT=... tools/convert_device.sh   # also a cProfile of each setting (every thread) in $OUT/profile*.txt
set -euo pipefail
: "${OUT:?set OUT to the folder for the JSON}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
W=${WORK:-/tmp/qc_convert}
rm -rf "$W" && mkdir -p "$W"
"$PY" - "$W/model.safetensors" "${LAYERS:-8}" <<'PY'
import sys, torch
from safetensors.torch import save_file
path, layers = sys.argv[1], int(sys.argv[2])
shapes = {"self_attn.q_proj": (4096, 4096), "self_attn.k_proj": (1024, 4096), "self_attn.v_proj": (1024, 4096),
          "self_attn.o_proj": (4096, 4096), "mlp.gate_proj": (14336, 4096), "mlp.up_proj": (14336, 4096),
          "mlp.down_proj": (4096, 14336)}
g = torch.Generator().manual_seed(0)
t = {f"model.layers.{i}.{k}.weight": (torch.randn(n, m, generator=g) * 0.02).to(torch.bfloat16)
     for i in range(layers) for k, (n, m) in shapes.items()}
save_file(t, path)
print(f"wrote {sum(v.numel() * 2 for v in t.values()) / 1e9:.2f} GB in {len(t)} tensors")
PY
cat "$W/model.safetensors" > /dev/null   # into the page cache
"$PY" - "$W" "$OUT/convert.json" "${FMT:-nf4}" "${REPS:-2}" "${ONE:---devices cuda:0}" "${TWO:---devices cuda:0,cuda:1}" <<'PY'
import filecmp, json, os, shutil, subprocess, sys, time
work, out, fmt, reps, one, two = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6]
best = {}
for devs, dst in ((one, os.path.join(work, "out_one")), (two, os.path.join(work, "out_two"))):
    for r in range(reps):
        shutil.rmtree(dst, ignore_errors=True)
        if os.path.isfile(dst):
            os.remove(dst)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "quantcore", "quantize", os.path.join(work, "model.safetensors"),
                        "-o", dst, "--format", fmt, *devs.split(), "-q"], check=True)
        t = time.perf_counter() - t0
        print(f"{devs} rep {r}: {t:.2f} s", flush=True)
        best[devs] = min(best.get(devs, t), t)
# the conversion alone, in one process whose interpreter, torch, CuPy, CUDA contexts and compiled kernels are
# ready (what a long conversion amortizes; the process runs above include ~4-6 s of start-up each)
inproc = {}
code = r"""
import sys, time
import quantcore, torch
from quantcore.convert import quantize_checkpoint
src, dst, fmt, reps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
settings = [s.split()[-1] for s in sys.argv[5:]]
for i in range(torch.cuda.device_count()):
    torch.zeros(1, device=f"cuda:{i}")
import shutil, os
best = {}
for r in range(reps + 1):  # the first round untimed: kernels compiled, each GPU's buffers made
    for devs in settings:
        if os.path.exists(dst):
            os.remove(dst)
        t0 = time.perf_counter()
        quantize_checkpoint(src, dst, fmt, devices=devs, progress=False)
        t = time.perf_counter() - t0
        if r:
            best[devs] = min(best.get(devs, t), t)
            print(f"in-process {devs} rep {r}: {t:.2f} s", file=sys.stderr, flush=True)
print(" ".join(f"{best[d]:.4f}" for d in settings))
"""
if one.startswith("--devices") and two.startswith("--devices"):
    r = subprocess.run([sys.executable, "-c", code, os.path.join(work, "model.safetensors"),
                        os.path.join(work, "out_inproc.safetensors"), fmt, str(reps), one, two],
                       check=True, stdout=subprocess.PIPE, text=True)
    t1, t2 = map(float, r.stdout.split()[-2:])
    inproc = {"one_inprocess_s": t1, "two_inprocess_s": t2, "speedup_inprocess": t1 / t2}
a, b = os.path.join(work, "out_one"), os.path.join(work, "out_two")
if os.path.isdir(a):  # a model folder in, a folder out
    files = sorted(os.listdir(a))
    same = files == sorted(os.listdir(b)) and all(
        filecmp.cmp(os.path.join(a, f), os.path.join(b, f), shallow=False) for f in files)
else:  # a .safetensors file in, one file out
    files, same = [os.path.basename(a)], filecmp.cmp(a, b, shallow=False)
res = {"input_bytes": os.path.getsize(os.path.join(work, "model.safetensors")), "format": fmt,
       "one": one, "two": two, "one_s": best[one], "two_s": best[two], "speedup": best[one] / best[two],
       "identical_output": same, "files": files, **inproc}
json.dump(res, open(out, "w"), indent=1)
print(json.dumps(res))
sys.exit(0 if same else "convert_device.sh: the outputs differ")
PY
if [ "${PROFILE:-0}" = 1 ]; then  # where one conversion's time goes: cProfile of each setting, every thread
  for devs in "${ONE:---devices cuda:0}" "${TWO:---devices cuda:0,cuda:1}"; do
    tag=$(echo "$devs" | tr -c 'a-z0-9' '_')
    rm -rf "$W/out_prof"
    # (a file, not stdin: --workers spawns processes, which import the main script)
    cat > "$W/prof.py" <<'PY'
import cProfile, io, pstats, sys, threading, time


def main():
    src, dst, fmt, report, *devs = sys.argv[1:]
    profiles = []

    def trace(*_):  # a profiler in every worker thread too (replaces this hook in that thread)
        sys.setprofile(None)
        p = cProfile.Profile()
        profiles.append(p)
        p.enable()

    first = cProfile.Profile()
    profiles.append(first)
    t0 = time.perf_counter()
    first.enable()
    threading.setprofile(trace)
    from quantcore.cli import main as cli
    rc = cli(["quantize", src, "-o", dst, "--format", fmt, *devs, "-q"])
    threading.setprofile(None)
    wall = time.perf_counter() - t0
    for p in profiles:
        p.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiles[0], stream=out)
    for p in profiles[1:]:
        stats.add(p)
    stats.sort_stats("tottime").print_stats(30)
    open(report, "w").write(f"{' '.join(devs)}: rc {rc}, {wall:.2f} s wall (imports included), "
                            f"{len(profiles)} profiles (threads of this process; not --workers processes)\n"
                            + out.getvalue())
    print(f"profile of {' '.join(devs)}: {wall:.2f} s -> {report}")


if __name__ == "__main__":  # (--workers processes import this file)
    main()
PY
    "$PY" "$W/prof.py" "$W/model.safetensors" "$W/out_prof" "${FMT:-nf4}" "$OUT/profile$tag.txt" $devs
  done
fi
