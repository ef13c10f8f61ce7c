#!/usr/bin/env bash
# One device call for double_quantize / quantize_blockwise (versions 1-3, QUANTCORE_CUDA_TUNE
# "dq_v=V,qbw_v=V"; 3 the default): GPU tests, the conformance suite for the ops, kernel times side by side
# (CUDA events behind a sleep kernel: tools/dev/bnb4_time.py's timer and buffers), the bench rows of quantize_4bit
# and an ncu profile of one launch of each kernel. Every step has a timeout inside one overall
# budget (BUDGET seconds, default 225). Run from the repository root; logs under $OUT.
set -u
OUT=${OUT:-/tmp/qc_out}
mkdir -p "$OUT"
S="$OUT/summary.txt"
: > "$S"
say() { echo "$*" | tee -a "$S"; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} QUANTCORE_CACHE_DIR=/tmp/qc_cache PYTHONUNBUFFERED=1
T_END=$(( $(date +%s) + ${BUDGET:-225} ))
left() { local l=$(( T_END - $(date +%s) )); local m=$1; [ "$l" -lt "$m" ] && m=$l; [ "$m" -lt 1 ] && m=1; echo "$m"; }
step() { local name=$1 lim=$2; shift 2; local s=$(date +%s); timeout "$(left "$lim")" "$@"; say "$name: rc=$? ($(( $(date +%s) - s )) s)"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$S"

cat > /tmp/dq_time.py <<'PY'
"""double_quantize / quantize_blockwise kernel times, versions 1, 2 and 3, on the bench's shapes."""
import os
import statistics
import sys

import numpy as np
import torch

import quantcore as qc
from quantcore.backends import cuda
from quantcore.backends.cuda import runtime as rt
from quantcore.formats import bnb

sys.path.insert(0, "tools/dev")
from bnb4_time import BS, buffers, timed  # noqa: E402

TUNE = rt.ENV_TUNE
be = qc.get_backend("cuda")
bs = BS
x, packed, absmax, q, a2, off = buffers()
nb = absmax.numel()
g = torch.Generator(device="cuda").manual_seed(0)
thr = torch.from_numpy(bnb.DYNAMIC_THRESHOLDS.astype(np.float32)).cuda()
x8 = torch.randn((4096, 16384), device="cuda", generator=g, dtype=torch.float32).to(torch.bfloat16)
c8 = torch.empty(x8.numel(), dtype=torch.uint8, device="cuda")
m8 = torch.empty(x8.numel() // 256, dtype=torch.float32, device="cuda")
f8 = torch.randn(nb, device="cuda", generator=g, dtype=torch.float32)
cf8 = torch.empty(nb, dtype=torch.uint8, device="cuda")
mf8 = torch.empty(nb // 4096, dtype=torch.float32, device="cuda")
be.quantize_4bit(x, packed, absmax, blocksize=bs, quant_type="nf4")
parts = torch.empty(nb // 8192 + 2, dtype=torch.float64, device="cuda")
scratch = torch.empty(4, dtype=torch.int32, device="cuda")
VERSIONS = (1, 2, 3)
launch = rt.Launcher(absmax)

q4 = lambda: be.quantize_4bit(x, packed, absmax, blocksize=bs, quant_type="nf4")  # noqa: E731
dq = lambda: be.double_quantize(absmax, q, a2, off)  # noqa: E731
q4dq = lambda: (q4(), dq())  # noqa: E731
qbw = lambda: be.quantize_blockwise(x8, thr, c8, m8, blocksize=256)  # noqa: E731
qbwf = lambda: be.quantize_blockwise(f8, thr, cf8, mf8, blocksize=4096)  # noqa: E731
sums = lambda: launch(cuda._F8, cuda._tree(None), (nb // 8192,), 256, (  # noqa: E731
    rt.ptr_arg(absmax), rt.i64(nb), rt.i32(1), np.uint64(parts.data_ptr()), np.uint64(parts.data_ptr() + 8 * (nb // 8192))))
sums3 = lambda: launch(cuda._F8, cuda._tree(None, 3), (nb // 8192,), 1024, (  # noqa: E731
    rt.ptr_arg(absmax), rt.i64(nb), rt.i32(1), np.uint64(parts.data_ptr()), np.uint64(scratch.data_ptr())))

if "--ncu-one" in sys.argv:
    for v in VERSIONS:
        os.environ[TUNE] = f"dq_v={v},qbw_v={min(v, 3)}"
        dq()
        if v < 4:
            qbw()
    torch.cuda.synchronize()
    sys.exit(0)

outs = {}
for v in VERSIONS:  # warm-up (compile) and the versions' outputs on the bench's data
    os.environ[TUNE] = f"dq_v={v},qbw_v={min(v, 3)}"
    q4dq()
    qbw()
    qbwf()
    torch.cuda.synchronize()
    outs[v] = [t.clone() for t in (q, a2, off, c8, m8, cf8, mf8)]
sums()
sums3()
for v in VERSIONS[1:]:
    same = [bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8))) for a, b in zip(outs[1], outs[v])]
    print(f"v1 == v{v} bitwise (q, absmax2, offset, codes8, absmax8, codes8 f32, absmax8 f32):", same)
rq, ra2, roff = bnb.double_quantize(absmax.cpu().numpy())
for v in VERSIONS:
    print(f"v{v} == numpy reference:", np.array_equal(outs[v][0].cpu().numpy(), rq),
          np.array_equal(outs[v][1].cpu().numpy().view(np.uint32), ra2.view(np.uint32)),
          outs[v][2].cpu().numpy().view(np.uint32)[0] == np.float32(roff).view(np.uint32))

big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
big2 = torch.empty_like(big)
res = {}
for _ in range(2):
    res.setdefault("copy 2 GiB d2d", []).append(statistics.median(timed(lambda: big2.copy_(big), 40)))
    for v in VERSIONS:
        os.environ[TUNE] = f"dq_v={v},qbw_v={min(v, 3)}"
        res.setdefault(f"double_quantize nb=4M v{v}", []).append(statistics.median(timed(dq, 40)))
        res.setdefault(f"quantize_4bit + double_quantize v{v}", []).append(statistics.median(timed(q4dq, 40)))
        if v == 4:
            continue
        res.setdefault(f"quantize_blockwise bf16 64M bs256 v{v}", []).append(statistics.median(timed(qbw, 40)))
        res.setdefault(f"quantize_blockwise f32 4M bs4096 v{v}", []).append(statistics.median(timed(qbwf, 40)))
    res.setdefault("quantize_4bit kernel alone", []).append(statistics.median(timed(q4, 40)))
    res.setdefault("v2 chunk-sum kernel alone (nb=4M)", []).append(statistics.median(timed(sums, 40)))
    res.setdefault("v3 chunk-sum kernel alone (nb=4M)", []).append(statistics.median(timed(sums3, 40)))
copy = 2 * (1 << 30) / (min(res["copy 2 GiB d2d"]) * 1e-6) / 1e9
nbytes = {"double_quantize": 4 * nb + nb + 4 * (nb // 256), "quantize_blockwise bf16": 3 * x8.numel(),
          "quantize_blockwise f32": 5 * nb, "v2 chunk": 4 * nb, "v3 chunk": 4 * nb}
print(f"device {torch.cuda.get_device_name()}; copy {copy:.0f} GB/s; median of 40, 2 rounds (us)")
for k, vals in res.items():
    nbb = next((b for p, b in nbytes.items() if k.startswith(p)), 0)
    extra = f"  {nbb / (min(vals) * 1e-6) / 1e9:6.0f} GB/s ({100 * nbb / (min(vals) * 1e-6) / 1e9 / copy:4.1f}% copy, one pass)" if nbb else ""
    print(f"{k:42s}" + " ".join(f"{t:8.1f}" for t in vals) + extra)
PY

step timing 75 python3 /tmp/dq_time.py > "$OUT/timing.log" 2>&1
cat "$OUT/timing.log" | tail -28 | tee -a "$S"
step tests_dq 80 python3 -m pytest tests/test_cuda_double_quant.py -q -rs --tb=short > "$OUT/pytest_dq.log" 2>&1
say "  $(tail -1 "$OUT/pytest_dq.log")"
step conformance_dq_bw 35 python3 -m quantcore.conformance --backend cuda --full -k double -k blockwise \
  > "$OUT/conformance_dq_bw.log" 2>&1
say "  $(tail -1 "$OUT/conformance_dq_bw.log")"
step bench 40 python3 -m quantcore.bench --backend cuda --ops quantize_4bit -v > "$OUT/bench.log" 2>&1
grep -E "^(copy|quantize_4bit)|quantize_4bit" "$OUT/bench.log" | head -12 | tee -a "$S"
step tests_cuda 30 python3 -m pytest tests/test_cuda.py -q -rs --tb=short \
  -k "(blockwise or double or quantize_4bit) and not compile" > "$OUT/pytest_cuda.log" 2>&1
say "  $(tail -1 "$OUT/pytest_cuda.log")"
step conformance_q4 40 python3 -m quantcore.conformance --backend cuda --full -k quantize_4bit \
  > "$OUT/conformance_q4.log" 2>&1
say "  $(tail -1 "$OUT/conformance_q4.log")"
step ncu 30 ncu --clock-control none --kernel-name regex:"quantize_blockwise|absmax_|double_quantize" \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
  python3 /tmp/dq_time.py --ncu-one > "$OUT/ncu.log" 2>&1
grep -E "qc::|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|Grid Size|Block Size" \
  "$OUT/ncu.log" | head -60 > "$OUT/ncu_short.txt"
say "done, $(( $(date +%s) - T_END + ${BUDGET:-225} )) s"
