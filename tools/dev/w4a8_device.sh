#!/usr/bin/env bash
# One GPU-machine call for gemm_w4a8 N <= 8 (kernels_cuda/ggml.cu: gemm_w4a8_stream_kernel, the
# version-12 gemm_w4a8_small_kernel kept behind QUANTCORE_CUDA_TUNE=w4a8_small=1): precompile of
# ggml.cu, GPU tests and conformance (gemm) for the default and for every cluster size, old/new
# timing side by side with a geometry sweep, the bench rows, an ncu profile of the new kernel,
# memcheck. Logs under $OUT. Run from the repository root: bash tools/dev/w4a8_device.sh
# (next sweep, suggested: W4_CONFIGS="w4a8_small=1;;w4s_kc=64;w4s_kc=224;w4s_cl=2,w4s_kc=224;w4s_stages=2").
set -u
OUT=${OUT:-/tmp/qc_out}
mkdir -p "$OUT"
S="$OUT/summary.txt"
: > "$S"
say() { echo "$*" | tee -a "$S"; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export QUANTCORE_CACHE_DIR=/tmp/qc_cache
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv | tee -a "$S"
t0=$(date +%s)
python3 - <<'EOF' 2>&1 | tee -a "$S"
import time
t = time.time()
from quantcore.backends import cuda
from quantcore.backends.cuda import runtime as rt
print("availability:", cuda.create().availability())
n = rt.precompile([i for i in cuda.kernel_instances() if i[0] == "ggml.cu"], 0, workers=16)
print(f"precompiled {n} ggml.cu kernels in {time.time() - t:.1f} s")
EOF

cat > /tmp/w4time.py <<'EOF'
# old (version 12) and new (stream) N <= 8 kernels side by side: CUDA events around one call queued
# behind a ~1 ms sleep kernel, 4 weight sets rotated (4 x 33 MB > L2), median of 50, bf16 activation;
# every config's output compared with the version-12 kernel's (outputs start as NaN).
import os, sys
import numpy as np, torch
from quantcore.backends.cuda import create
be = create()
def med(fn, reps=50):
    for i in range(5): fn(i)
    ts = []
    for i in range(reps):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        torch.cuda._sleep(1_500_000); s.record(); fn(i); e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    return float(np.median(ts)), float(np.percentile(ts, 10)), float(np.percentile(ts, 90))
configs = sys.argv[1].split(";")
shapes = [(4096, 14336, (1, 2, 4, 8)), (14336, 4096, (1, 2, 4, 8))]
print("config".ljust(34), "shape".ljust(22), "median us  p10   p90   GB/s(w)  rel.diff vs v12")
for m, k, ns in shapes:
    g = torch.Generator(device="cuda"); g.manual_seed(m)
    wqs = []
    for _ in range(4):
        w = torch.randint(0, 256, (m, k // 32, 18), dtype=torch.uint8, device="cuda", generator=g)
        d = (torch.rand(m, k // 32, device="cuda", generator=g) * 0.02 + 0.001).half()
        w[..., 0:2] = d.view(torch.uint8).view(m, k // 32, 2)
        wqs.append(w)
    for n in ns:
        a = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g)
        ref = None
        for cfg in configs:
            os.environ["QUANTCORE_CUDA_TUNE"] = cfg
            o = torch.full((m, n), float("nan"), device="cuda")
            be.gemm_w4a8(wqs[0], a, o); torch.cuda.synchronize()
            o0 = o.clone()
            if ref is None: ref = o0
            t, p10, p90 = med(lambda i: be.gemm_w4a8(wqs[i % 4], a, o))
            err = float(((o0 - ref).norm() / ref.norm()).item()) if torch.isfinite(o0).all() else float("nan")
            gbs = m * k // 32 * 18 / t / 1e3
            print(f"{cfg or 'default':34s} M{m} K{k} N{n}".ljust(58), f"{t:7.1f} {p10:6.1f} {p90:6.1f} {gbs:7.0f}  {err:.1e}")
os.environ["QUANTCORE_CUDA_TUNE"] = ""
EOF

# correctness first: the GPU gemm tests and the conformance gemm cases with the default, the
# gemm tests again with each cluster size forced (the default picks by shape)
s=$(date +%s)
timeout 100 python3 -m pytest tests/test_cuda.py -q -rs -k gemm > "$OUT/pytest_gemm.log" 2>&1
say "tests -k gemm (default): rc=$? $(tail -1 "$OUT/pytest_gemm.log")"
: > "$OUT/pytest_cl.log"
for cl in 1 2 4; do
  QUANTCORE_CUDA_TUNE=w4s_cl=$cl timeout 45 python3 -m pytest tests/test_cuda.py -q -k "small_n_streaming and bfloat16" >> "$OUT/pytest_cl.log" 2>&1
  say "tests small_n_streaming bf16 (w4s_cl=$cl): rc=$? $(tail -1 "$OUT/pytest_cl.log")"
done
QUANTCORE_CUDA_TUNE=w4s_cl=2,w4s_kc=8,w4s_stages=2 timeout 45 python3 -m pytest tests/test_cuda.py -q -k "small_n_streaming and bfloat16" >> "$OUT/pytest_cl.log" 2>&1
say "tests small_n_streaming bf16 (cl=2 kc=8 stages=2: ring wraps): rc=$? $(tail -1 "$OUT/pytest_cl.log")"
timeout 90 python3 -m quantcore.conformance --backend cuda --full -k gemm > "$OUT/conformance_gemm.log" 2>&1
say "conformance --full -k gemm: rc=$? $(tail -1 "$OUT/conformance_gemm.log")"
say "  (correctness took $(( $(date +%s) - s )) s)"

s=$(date +%s)
# configs (QUANTCORE_CUDA_TUNE strings, ";"-separated, "" = the default); the list of the run in
# docs/performance.md version 13 (then the default was kc = 64) unless W4_CONFIGS is set
W4_CONFIGS=${W4_CONFIGS:-"w4a8_small=1;;w4s_cl=1;w4s_cl=2;w4s_cl=4;w4s_kc=32;w4s_kc=128;w4s_stages=4;w4s_cl=1,w4s_kc=128"}
timeout 100 python3 /tmp/w4time.py "$W4_CONFIGS" > "$OUT/timing.log" 2>&1
say "timing: rc=$? ($(( $(date +%s) - s )) s)"
cat "$OUT/timing.log" >> "$S"

s=$(date +%s)
timeout 60 python3 -m quantcore.bench --backend cuda --ops gemm_w4a8 -v > "$OUT/bench.log" 2>&1
say "bench: rc=$? ($(( $(date +%s) - s )) s)"
grep -E "copy|gemm_w4a8" "$OUT/bench.log" >> "$S"

s=$(date +%s)
cat > /tmp/w4prof.py <<'EOF'
import torch
from quantcore.backends.cuda import create
be = create()
for m, k, n in ((4096, 14336, 1), (4096, 14336, 8)):
    w = torch.randint(0, 256, (m, k // 32, 18), dtype=torch.uint8, device="cuda")
    w[..., 1] = 0x20
    a = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    o = torch.empty(m, n, device="cuda")
    for _ in range(3): be.gemm_w4a8(w, a, o)
    torch.cuda.synchronize()
EOF
timeout 60 ncu --clock-control none --kernel-name regex:gemm_w4a8_stream --launch-skip 2 --launch-count 2 \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
  --section MemoryWorkloadAnalysis python3 /tmp/w4prof.py > "$OUT/ncu.log" 2>&1
say "ncu: rc=$? ($(( $(date +%s) - s )) s)"
grep -E "gemm_w4a8_stream|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Achieved Occupancy|Issued Warp|No Eligible|Warp Cycles Per Issued|Registers Per" "$OUT/ncu.log" >> "$S"
s=$(date +%s)
cat > /tmp/w4mem.py <<'EOF'
import os, torch
from quantcore.backends.cuda import create
be = create()
for cfg in ("", "w4s_cl=2", "w4s_cl=4,w4s_kc=8,w4s_stages=2"):
    os.environ["QUANTCORE_CUDA_TUNE"] = cfg
    for m, n, k in ((37, 3, 1024), (130, 8, 4096 + 256), (20, 1, 256)):
        w = torch.randint(0, 256, (m, k // 32, 18), dtype=torch.uint8, device="cuda")
        w[..., 1] = 0x20
        a = torch.randn(n, k, device="cuda", dtype=torch.float16)
        o = torch.empty(m, n, device="cuda")
        be.gemm_w4a8(w, a, o)
torch.cuda.synchronize()
print("memcheck script done")
EOF
timeout 75 compute-sanitizer --tool memcheck --leak-check no --print-limit 10 python3 /tmp/w4mem.py > "$OUT/memcheck.log" 2>&1
say "memcheck: rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1) ($(( $(date +%s) - s )) s)"
say "total $(( $(date +%s) - t0 )) s"
