"""The kernels of one quantize_4bit-with-double-quantization call on a timeline (session 7).

CUPTI (through torch.profiler) records every kernel of the process, CuPy's launches included, with
its GPU start and end: this prints, per kernel of the call, its start relative to the first kernel's
start, its duration and the gap before it, as medians over --reps calls (each queued behind a sleep
kernel so that host launch time never shows). 16384 x 16384 bf16 NF4 blocksize 64, as in the bench.
argv: QUANTCORE_CUDA_TUNE settings separated by ";" (each a row block; "" for the default).

Run on the GPU machine: PYTHONPATH=. python3 tools/dev/q4_timeline.py "" "dq_v=2"
"""

from __future__ import annotations

import os
import statistics
import sys

import torch
from quantcore.backends.cuda.runtime import ENV_TUNE
from torch.profiler import ProfilerActivity, profile

import quantcore as qc

sys.path.insert(0, os.path.dirname(__file__))
from bnb4_time import BS, buffers  # noqa: E402


def main() -> None:
    reps = 20
    configs = sys.argv[1:] or [""]
    be = qc.get_backend("cuda")
    bs = BS
    x, packed, _, q, a2, off = buffers()
    for cfg in configs:
        os.environ[ENV_TUNE] = cfg.replace(";", ",")
        call = lambda: be.quantize_4bit_nested(x, packed, q, a2, off, blocksize=bs, quant_type="nf4")  # noqa: E731
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                torch.cuda._sleep(2_000_000)
                call()
            torch.cuda.synchronize()
        evs = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and "spin_kernel" not in e.name
                      and "Memcpy" not in e.name), key=lambda e: e.time_range.start)
        calls: list[list] = []
        last_end = None
        for e in evs:  # a call starts after a sleep: a gap of more than 500 us
            if last_end is None or e.time_range.start - last_end > 500:
                calls.append([])
            calls[-1].append(e)
            last_end = e.time_range.end
        width = max(len(k) for k in calls)
        print(f"config {cfg or 'default'!r}: {len(calls)} calls, kernels per call {sorted({len(k) for k in calls})}")
        for i in range(width):
            rows = [k for k in calls if len(k) == width]
            name = rows[0][i].name[:70]
            start = statistics.median(k[i].time_range.start - k[0].time_range.start for k in rows)
            dur = statistics.median(k[i].time_range.end - k[i].time_range.start for k in rows)
            gap = statistics.median(k[i].time_range.start - k[i - 1].time_range.end for k in rows) if i else 0.0
            print(f"  {name:70s} start {start:7.1f} us  dur {dur:7.1f} us  gap before {gap:5.1f} us")
        total = statistics.median(k[-1].time_range.end - k[0].time_range.start for k in calls if len(k) == width)
        print(f"  first start to last end: {total:.1f} us")
    os.environ[ENV_TUNE] = ""


if __name__ == "__main__":
    main()
