"""Host-side profile of eager public-API calls on the cuda backend (device machine): gemv_4bit
4096x4096 NF4 (nested) on a bf16 [1, 4096] input, with and without the eager launch plans
(quantcore.api.EAGER_PLANS), against torch's eager bf16 linear, back to back in one process.

Prints: a bitwise check of the planned result against the full path, the per-call time of each
(median and best of ROUNDS interleaved rounds of CALLS calls), a breakdown of one planned call
by step (perf_counter_ns), and cProfile's top functions of each path by own time.
"""

import cProfile
import pstats
import statistics
import time

import torch

import quantcore as qc
from quantcore import api, bench

CALLS, ROUNDS = 2000, 5

w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
p, s = qc.quantize_4bit(w, 64, "nf4", True, backend="cuda")
a = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
lin = torch.nn.functional.linear


def gemv():
    return qc.gemv_4bit(a, p, s, backend="cuda")


def plans(on: bool):
    api.EAGER_PLANS = on


plans(False)
ref = gemv()
plans(True)
got = [gemv() for _ in range(3)]
torch.cuda.synchronize()
plan = s._plans["gemv_4bit"][1]
print(f"planned == full path (bitwise): {all(torch.equal(g.view(torch.int16), ref.view(torch.int16)) for g in got)}"
      f"; plan hits {plan.hits}, geometries {len(plan.entries)}, kernel {next(iter(plan.entries.values()))[1].expr}")

for on in (False, True):
    plans(on)
    for _ in range(200):
        gemv()
        lin(a, w)
torch.cuda.synchronize()

cases = {"quantcore gemv_4bit, full path": (False, gemv), "quantcore gemv_4bit, planned": (True, gemv),
         "torch linear bf16": (True, lambda: lin(a, w))}
times: dict[str, list[float]] = {name: [] for name in cases}
for _ in range(ROUNDS):
    for name, (on, fn) in cases.items():
        plans(on)
        times[name].append(bench.CudaTimer(torch).eager([fn], CALLS))
for name, ts in times.items():
    print(f"{name}: {statistics.median(ts):.1f} us per eager call (best {min(ts):.1f}; rounds "
          + " ".join(f"{x:.1f}" for x in ts) + ")")
med = {k: statistics.median(v) for k, v in times.items()}
print(f"planned / torch: {med['quantcore gemv_4bit, planned'] / med['torch linear bf16']:.2f}x; "
      f"full path / torch: {med['quantcore gemv_4bit, full path'] / med['torch linear bf16']:.2f}x")

# one planned call by step (the same steps as _GemvPlan.__call__), median over CALLS
plans(True)
be = qc.get_backend("cuda")
entry = plan.match(a, p, s)
steps = {"get_backend": lambda: api._backend("cuda"), "match (key, packed, state)": lambda: plan.match(a, p, s),
         "context check": plan._ctx_now, "output new_empty": lambda: a.new_empty(entry[0]),
         "current stream": lambda: plan._stream(plan.device),
         "launch (fill + cuLaunchKernel)": lambda: entry[1](plan._stream(plan.device), a.data_ptr(), ref.data_ptr()),
         "whole public call": gemv}
for name, fn in steps.items():
    ns = []
    for _ in range(CALLS):
        t0 = time.perf_counter_ns()
        fn()
        ns.append(time.perf_counter_ns() - t0)
    print(f"  {name}: {statistics.median(ns) / 1e3:.2f} us")
torch.cuda.synchronize()

for on in (True, False):
    plans(on)
    print(f"-- cProfile, {'planned' if on else 'full path'}")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(CALLS):
        gemv()
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(12 if on else 20)
