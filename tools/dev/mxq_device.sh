#!/usr/bin/env bash
# One GPU-machine call for the MX quantize kernels (kernels_cuda/mx_quant.cu), sized for a
# 200-second device call: NVRTC build with resource usage, side-by-side timing of version 1 and
# the version-2 layouts / variants (alone on the GPU), the bench rows (alone), then the
# correctness runs side by side (conformance of the mx_quant.cu ops, the GPU tests of every
# kernel variant, memcheck of the version-2 layouts), and a short ncu profile if time is left.
# Run from the repository root; logs under $OUT (at most 8 files come back).
#   bash tools/dev/mxq_device.sh
set -u
OUT=${OUT:-/tmp/mxq_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} QUANTCORE_CACHE_DIR=/tmp/qc_cache
S="$OUT/summary.txt"
: > "$S"
say() { echo "$*" | tee -a "$S"; }
t0=$(date +%s)
BUDGET=${MXQ_BUDGET:-185}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv | tee -a "$S"

# -- build: NVRTC cubin (cached for every later process), registers / spills per quantize kernel ----
timeout 40 python3 - <<'EOF' 2>&1 | tee -a "$S"
import re, shutil, subprocess, time
from quantcore.backends.cuda import mx as cmx
t = time.time()
cub = cmx.compile_cubin(cmx.QUANT_SOURCE, "sm_90")
print(f"NVRTC mx_quant.cu sm_90: {time.time() - t:.1f} s, {len(cub)} bytes")
open("/tmp/mxq.cubin", "wb").write(cub)
tool = shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump"
try:
    r = subprocess.run([tool, "-res-usage", "/tmp/mxq.cubin"], capture_output=True, text=True)
    for name, info in re.findall(r"Function (qc_mx_quantize2\w*(?:bfloat16|float32)):\s*\n?\s*(REG:\d+ STACK:\d+ SHARED:\d+ LOCAL:\d+)", r.stdout):
        print(f"  {name}: {info}")
except OSError as e:
    print("cuobjdump:", e)
EOF
say "  (build $(( $(date +%s) - t0 )) s)"

# -- timing: CUDA events, median of 30, alone on the GPU --------------------------------------------
s=$(date +%s)
timeout 60 python3 - <<'EOF' > "$OUT/time.log" 2>&1
import json, os, statistics
import torch
from quantcore.backends.cuda import mx as cmx
from quantcore.formats import mx

OUT = os.environ.get("OUT", "/tmp/mxq_out")
dev = torch.device("cuda")


def timed(fn, reps=30, warm=3):
    # each timed call queued behind a ~1 ms sleep kernel: the events then time the kernel, not
    # the Python launcher (which takes longer than a 16384^2 quantize; quantcore.bench does the same)
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


src = torch.empty(2**31 // 4, dtype=torch.float32, device=dev).uniform_()
dst = torch.empty_like(src)
tc = timed(lambda: dst.copy_(src))
copy = 2 * src.numel() * 4 / tc / 1e6
print(f"copy 2 GiB d2d: {tc * 1e3:.1f} us, {copy:.0f} GB/s", flush=True)
del src, dst
res = {"copy_GBps": copy, "device": torch.cuda.get_device_name()}
OLD = "mx_quant_v=2,mx_quant_layout=0,mx_quant_sst=0"  # version 2 as it was (flat, byte scale stores)
V = {
    "nvfp4": [("v1", "mx_quant_v=1"), ("v2 old", OLD), ("v2 flat+sst", "mx_quant_v=2,mx_quant_layout=0"),
              ("v2 band", "mx_quant_v=2"), ("band 3cta", "mx_quant_v=2,mx_quant_ctas=3"),
              ("band 1cta", "mx_quant_v=2,mx_quant_ctas=1"), ("flat+sst 3cta", "mx_quant_v=2,mx_quant_layout=0,mx_quant_ctas=3"),
              ("v2 band again", "mx_quant_v=2")],
    "mxfp8": [("v1", "mx_quant_v=1"), ("v2 old", OLD), ("v2 pair", "mx_quant_v=2,mx_quant_layout=2"),
              ("pair 2cta", "mx_quant_v=2,mx_quant_layout=2,mx_quant_ctas=2"),
              ("pair 1cta", "mx_quant_v=2,mx_quant_layout=2,mx_quant_ctas=1"),
              ("v1 again", "mx_quant_v=1")],
    "mxfp4": [("v2 default", "")],
}
SHORT = {"nvfp4": [("v1", "mx_quant_v=1"), ("v2 old", OLD), ("v2 band", "mx_quant_v=2")],
         "mxfp8": [("v1", "mx_quant_v=1"), ("v2 old", OLD), ("v2 pair", "mx_quant_v=2,mx_quant_layout=2")]}


def case(n, k, dtname, variants):
    tdt = getattr(torch, dtname)
    x = (torch.randn((n, k), device=dev) * torch.exp2(torch.empty((n, 1), device=dev).uniform_(-4, 4))).to(tdt)
    g = torch.tensor([mx.nvfp4_global_scale(float(x.abs().max()))], dtype=torch.float32, device=dev)
    for fmt, vs in variants.items():
        blk = mx.block_size(fmt)
        codes = torch.empty((n, mx.codes_cols(fmt, k)), dtype=torch.uint8, device=dev)
        scales = torch.empty(mx.swizzled_shape(n, k // blk), dtype=torch.uint8, device=dev)
        gs = g if fmt == "nvfp4" else None
        mode = None if fmt == "nvfp4" else "floor"
        nbytes = x.numel() * x.element_size() + codes.numel() + scales.numel()

        def q():
            cmx.mx_quantize(None, x, codes, scales, rows=n, cols=k, fmt=fmt, scale_mode=mode, swizzled=True,
                            global_scale=gs)

        ref = None
        for name, spec in vs:
            os.environ["QUANTCORE_CUDA_TUNE"] = spec
            codes.fill_(0xA5)
            scales.fill_(0xA5)
            q()
            torch.cuda.synchronize()
            out = (codes.clone(), scales.clone())
            same = ""
            if ref is None:
                ref = out
            else:
                same = "same bits" if torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]) else "DIFFERS"
            t = timed(q)
            gbs = nbytes / t / 1e6
            print(f"{dtname:8s} {n}x{k} {fmt:5s} {name:14s} {t * 1e3:8.1f} us {gbs:6.0f} GB/s "
                  f"{100 * gbs / copy:5.1f}% of copy  {same}", flush=True)
            res[f"{dtname} {n}x{k} {fmt} {name}"] = [t * 1e3, 100 * gbs / copy, same]
        del codes, scales, out, ref
    del x


case(16384, 16384, "bfloat16", V)
case(16384, 16384, "float16", SHORT)
case(8192, 16384, "float32", SHORT)
case(4096, 14336, "bfloat16", SHORT)
os.environ["QUANTCORE_CUDA_TUNE"] = ""
json.dump(res, open(f"{OUT}/time.json", "w"), indent=1)
EOF
say "timing: rc=$? ($(( $(date +%s) - s )) s)"
tee -a "$S" < "$OUT/time.log"

# -- bench rows (alone) ---------------------------------------------------------------------------------
s=$(date +%s)
timeout 35 python3 -m quantcore.bench --backend cuda --ops mx_quantize -v > "$OUT/bench.log" 2>&1
say "bench: rc=$? ($(( $(date +%s) - s )) s)"

# -- correctness, side by side: conformance, GPU tests of every variant, memcheck ------------------------
s=$(date +%s)
left=$(( BUDGET - 20 - (s - t0) ))
[ $left -lt 30 ] && left=30
cat > /tmp/mxq_memcheck.py <<'EOF2'
import os
import torch
from quantcore.backends.cuda import mx as cmx
from quantcore.formats import mx
for spec in ("mx_quant_v=2", "mx_quant_v=2,mx_quant_layout=0", "mx_quant_v=2,mx_quant_layout=2"):
    os.environ["QUANTCORE_CUDA_TUNE"] = spec
    for dt in (torch.bfloat16, torch.float32):
        for rows, k in ((8, 3968), (3, 32), (130, 256), (200, 320)):
            x = torch.randn((rows, k), device="cuda").to(dt)
            for fmt in ("nvfp4", "mxfp8"):
                blk = mx.block_size(fmt)
                for swz in (False, True):
                    codes = torch.empty((rows, mx.codes_cols(fmt, k)), dtype=torch.uint8, device="cuda")
                    sh = mx.swizzled_shape(rows, k // blk) if swz else (rows, k // blk)
                    scales = torch.empty(sh, dtype=torch.uint8, device="cuda")
                    g = torch.tensor([1.0], device="cuda") if fmt == "nvfp4" else None
                    cmx.mx_quantize(None, x, codes, scales, rows=rows, cols=k, fmt=fmt,
                                    scale_mode=None if g is not None else "rceil", swizzled=swz, global_scale=g)
torch.cuda.synchronize()
print("memcheck script done")
EOF2
timeout $left python3 -m quantcore.conformance --backend cuda --full -k mx_quantize -k mx_dequantize \
  -k swizzle_scales -k unswizzle_scales > "$OUT/conformance.log" 2>&1 &
p1=$!
timeout $left python3 -m pytest -q -p no:cacheprovider tests/test_cuda_mx_quant_versions.py tests/test_cuda_mx.py \
  -k "versions or (quant and not graph)" > "$OUT/pytest.log" 2>&1 &
p2=$!
timeout $left compute-sanitizer --tool memcheck --print-limit 20 python3 /tmp/mxq_memcheck.py > "$OUT/memcheck.log" 2>&1 &
p3=$!
wait $p1; r1=$?
wait $p2; r2=$?
wait $p3; r3=$?
say "conformance (mx_quantize, mx_dequantize, swizzle, unswizzle; full): rc=$r1 $(tail -1 "$OUT/conformance.log")"
say "pytest: rc=$r2 $(tail -1 "$OUT/pytest.log")"
say "memcheck: rc=$r3 $(grep -E 'ERROR SUMMARY|script done' "$OUT/memcheck.log" | tr '\n' ' ')"
say "  (correctness $(( $(date +%s) - s )) s)"

# -- ncu: band nvfp4 and pair mxfp8 at 16384^2 bf16, if time is left --------------------------------------
s=$(date +%s)
left=$(( BUDGET - (s - t0) ))
if [ $left -gt 25 ] && command -v ncu >/dev/null; then
  cat > /tmp/mxq_prof.py <<'EOF'
import os
import torch
from quantcore.backends.cuda import mx as cmx
from quantcore.formats import mx
n = 16384
x = torch.randn((n, n), device="cuda").to(torch.bfloat16)
g = torch.tensor([mx.nvfp4_global_scale(float(x.abs().max()))], dtype=torch.float32, device="cuda")
for spec, fmt in (("mx_quant_v=2", "nvfp4"), ("mx_quant_v=2,mx_quant_layout=2", "mxfp8")):
    os.environ["QUANTCORE_CUDA_TUNE"] = spec
    blk = mx.block_size(fmt)
    codes = torch.empty((n, mx.codes_cols(fmt, n)), dtype=torch.uint8, device="cuda")
    scales = torch.empty(mx.swizzled_shape(n, n // blk), dtype=torch.uint8, device="cuda")
    cmx.mx_quantize(None, x, codes, scales, rows=n, cols=n, fmt=fmt, scale_mode=None if fmt == "nvfp4" else "floor",
                    swizzled=True, global_scale=g if fmt == "nvfp4" else None)
torch.cuda.synchronize()
EOF
  timeout $left ncu --clock-control none --kernel-name regex:qc_mx_quantize --section SpeedOfLight \
    --section Occupancy python3 /tmp/mxq_prof.py > "$OUT/ncu.log" 2>&1
  say "ncu: rc=$? ($(( $(date +%s) - s )) s)"
fi
say "total $(( $(date +%s) - t0 )) s"
