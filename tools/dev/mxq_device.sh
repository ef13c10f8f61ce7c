#!/usr/bin/env bash
# One GPU-machine call for the MX quantize kernels (kernels_cuda/mx_quant.cu): NVRTC build with
# resource usage, bit-exactness (conformance of the mx_quant.cu ops, the GPU tests of both kernel
# versions), side-by-side timing of version 1 / version 2 and its variants, the bench rows, and a
# short ncu profile. Run from the repository root; logs under $OUT (at most 8 files come back).
#   bash tools/dev/mxq_device.sh
set -u
OUT=${OUT:-/tmp/mxq_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} QUANTCORE_CACHE_DIR=/tmp/qc_cache
S="$OUT/summary.txt"
: > "$S"
say() { echo "$*" | tee -a "$S"; }
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv | tee -a "$S"

# -- build: NVRTC cubin, registers / spills per quantize kernel ------------------------------------
timeout 60 python3 - <<'EOF' 2>&1 | tee -a "$S"
import re, shutil, subprocess, time
from quantcore.backends.cuda import mx as cmx
t = time.time()
cub = cmx.compile_cubin(cmx.QUANT_SOURCE, "sm_90")
print(f"NVRTC mx_quant.cu sm_90: {time.time() - t:.1f} s, {len(cub)} bytes")
open("/tmp/mxq.cubin", "wb").write(cub)
tool = shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump"
r = subprocess.run([tool, "-res-usage", "/tmp/mxq.cubin"], capture_output=True, text=True)
for name, info in re.findall(r"Function (qc_mx_quantize\w*bfloat16):\s*\n?\s*(REG:\d+ STACK:\d+ SHARED:\d+ LOCAL:\d+)", r.stdout):
    print(f"  {name}: {info}")
if r.returncode:
    print("cuobjdump:", r.returncode, r.stderr[:300])
EOF
say "  (build $(( $(date +%s) - t0 )) s)"

# -- bit-exactness: conformance of the ops in mx_quant.cu -------------------------------------------
s=$(date +%s)
timeout 45 python3 -m quantcore.conformance --backend cuda --full -k mx_quantize -k mx_dequantize \
  -k swizzle_scales -k unswizzle_scales > "$OUT/conformance.log" 2>&1
say "conformance (mx_quantize, mx_dequantize, swizzle, unswizzle; full): rc=$? $(tail -1 "$OUT/conformance.log") ($(( $(date +%s) - s )) s)"

# -- timing: version 1 vs version 2 (and variants), CUDA events, median of 30 --------------------
s=$(date +%s)
timeout 70 python3 - <<'EOF' > "$OUT/time.log" 2>&1
import json, os, statistics
import torch
from quantcore.backends.cuda import mx as cmx
from quantcore.formats import mx

OUT = os.environ.get("OUT", "/tmp/mxq_out")
dev = torch.device("cuda")


def timed(fn, reps=30, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def tune(spec):
    os.environ["QUANTCORE_CUDA_TUNE"] = spec


src = torch.empty(2**31 // 4, dtype=torch.float32, device=dev).uniform_()
dst = torch.empty_like(src)
tc = timed(lambda: dst.copy_(src))
copy = 2 * src.numel() * 4 / tc / 1e6
print(f"copy 2 GiB d2d: {tc * 1e3:.1f} us, {copy:.0f} GB/s", flush=True)
del src, dst
res = {"copy_GBps": copy, "device": torch.cuda.get_device_name()}
VARS = [("v1", "mx_quant_v=1"), ("v2", "mx_quant_v=2"), ("v2 fp32-path", "mx_quant_v=2,mx_quant_bf16x2=0"),
        ("v2 1cta/SM", "mx_quant_v=2,mx_quant_ctas=1"), ("v2 2cta/SM", "mx_quant_v=2,mx_quant_ctas=2"),
        ("v2 again", "mx_quant_v=2")]


def case(n, k, dtname, variants):
    tdt = getattr(torch, dtname)
    x = (torch.randn((n, k), device=dev) * torch.exp2(torch.empty((n, 1), device=dev).uniform_(-4, 4))).to(tdt)
    g = torch.tensor([mx.nvfp4_global_scale(float(x.abs().max()))], dtype=torch.float32, device=dev)
    for fmt in ("nvfp4", "mxfp4", "mxfp8"):
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
        for name, spec in variants:
            if name.startswith("v2 fp32") and not (fmt == "mxfp4" and dtname == "bfloat16"):
                continue
            tune(spec)
            codes.fill_(0xA5)
            scales.fill_(0xA5)
            q()
            torch.cuda.synchronize()
            out = (codes.clone(), scales.clone())
            same = ""
            if ref is None:
                ref = out
            else:
                same = "same bits as v1" if torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]) \
                    else "DIFFERS FROM v1"
            t = timed(q)
            gbs = nbytes / t / 1e6
            print(f"{dtname:8s} {n}x{k} {fmt:5s} {name:13s} {t * 1e3:8.1f} us {gbs:6.0f} GB/s "
                  f"{100 * gbs / copy:5.1f}% of copy  {same}", flush=True)
            res[f"{dtname} {n}x{k} {fmt} {name}"] = [t * 1e3, 100 * gbs / copy, same]
        del codes, scales, out, ref
    del x


case(16384, 16384, "bfloat16", VARS)
case(16384, 16384, "float16", VARS[:2])
case(8192, 16384, "float32", VARS[:2])
case(4096, 14336, "bfloat16", VARS[:2])
case(8192, 8192, "bfloat16", VARS[:2])
tune("")
json.dump(res, open(f"{OUT}/time.json", "w"), indent=1)
EOF
say "timing: rc=$? ($(( $(date +%s) - s )) s)"
tee -a "$S" < "$OUT/time.log"

# -- GPU tests: both versions on adversarial inputs, and the MX quantize tests ----------------------
s=$(date +%s)
timeout 85 python3 -m pytest -q --maxfail=5 tests/test_cuda_mx_quant_versions.py tests/test_cuda_mx.py \
  -k "versions or (quantize and not graph)" > "$OUT/pytest.log" 2>&1
say "pytest: rc=$? $(tail -1 "$OUT/pytest.log") ($(( $(date +%s) - s )) s)"

# -- memcheck: version 2 on partial tiles, every format and input type --------------------------------
s=$(date +%s)
cat > /tmp/mxq_memcheck.py <<'EOF2'
import torch
from quantcore.backends.cuda import mx as cmx
from quantcore.formats import mx
for dt in (torch.bfloat16, torch.float16, torch.float32):
    for rows, k in ((8, 4000 - 4000 % 32), (3, 32), (130, 96)):
        x = torch.randn((rows, k), device="cuda").to(dt)
        for fmt in ("nvfp4", "mxfp4", "mxfp8"):
            blk = mx.block_size(fmt)
            for swz in (False, True):
                codes = torch.empty((rows, mx.codes_cols(fmt, k)), dtype=torch.uint8, device="cuda")
                sh = mx.swizzled_shape(rows, k // blk) if swz else (rows, k // blk)
                scales = torch.empty(sh, dtype=torch.uint8, device="cuda")
                g = torch.tensor([1.0], device="cuda") if fmt == "nvfp4" else None
                cmx.mx_quantize(None, x, codes, scales, rows=rows, cols=k, fmt=fmt, scale_mode=None if g is not None
                                else "rceil", swizzled=swz, global_scale=g)
torch.cuda.synchronize()
print("memcheck script done")
EOF2
timeout 60 compute-sanitizer --tool memcheck --print-limit 20 python3 /tmp/mxq_memcheck.py > "$OUT/memcheck.log" 2>&1
say "memcheck: rc=$? $(grep -E 'ERROR SUMMARY|script done' "$OUT/memcheck.log" | tr '\n' ' ') ($(( $(date +%s) - s )) s)"

# -- bench rows ---------------------------------------------------------------------------------------
s=$(date +%s)
timeout 45 python3 -m quantcore.bench --backend cuda --ops mx_quantize -v --json /tmp/bench.json \
  --png /tmp/bench.png > "$OUT/bench.log" 2>&1
say "bench: rc=$? ($(( $(date +%s) - s )) s)"

# -- ncu: version 2 (three formats) and version 1 (nvfp4) at 16384^2 bf16 -----------------------------
s=$(date +%s)
left=$(( 285 - ($(date +%s) - t0) ))
if [ $left -gt 25 ] && command -v ncu >/dev/null; then
  cat > /tmp/mxq_prof.py <<'EOF'
import os
import torch
from quantcore.backends.cuda import mx as cmx
from quantcore.formats import mx
n = 16384
x = torch.randn((n, n), device="cuda").to(torch.bfloat16)
g = torch.tensor([mx.nvfp4_global_scale(float(x.abs().max()))], dtype=torch.float32, device="cuda")
for spec, fmt in (("mx_quant_v=2", "nvfp4"), ("mx_quant_v=2", "mxfp4"), ("mx_quant_v=2", "mxfp8"),
                  ("mx_quant_v=1", "nvfp4")):
    os.environ["QUANTCORE_CUDA_TUNE"] = spec
    blk = mx.block_size(fmt)
    codes = torch.empty((n, mx.codes_cols(fmt, n)), dtype=torch.uint8, device="cuda")
    scales = torch.empty(mx.swizzled_shape(n, n // blk), dtype=torch.uint8, device="cuda")
    cmx.mx_quantize(None, x, codes, scales, rows=n, cols=n, fmt=fmt, scale_mode=None if fmt == "nvfp4" else "floor",
                    swizzled=True, global_scale=g if fmt == "nvfp4" else None)
torch.cuda.synchronize()
EOF
  timeout $left ncu --clock-control none --kernel-name regex:qc_mx_quantize --section SpeedOfLight \
    --section SchedulerStats --section Occupancy --section WarpStateStats python3 /tmp/mxq_prof.py \
    > "$OUT/ncu.log" 2>&1
  say "ncu: rc=$? ($(( $(date +%s) - s )) s)"
fi
say "total $(( $(date +%s) - t0 )) s"
