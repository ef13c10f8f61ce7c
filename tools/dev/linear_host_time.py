"""Host time of one eager linear call at batch 1: quantcore.nn modules against torch's F.linear (bf16)
and bnb.nn.Linear4bit, on the GPU machine.

Each figure is the wall time of many back-to-back calls divided by their count (the GPU's time per
call is below the host's at these shapes, so this is the host's cost), median of 5 rounds; the
op-dispatch path (torch.ops.quantcore.linear_4bit) is timed too, and a cProfile of the module call
goes to $OUT/linear_host_profile.txt.

    python3 tools/dev/linear_host_time.py [--shapes 4096x4096,14336x4096]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import torch

import quantcore.nn as qnn


def per_call_us(fn, calls: int = 2000, rounds: int = 5) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(out)


def measure_shape(shape: str, bnb, profile: bool) -> dict[str, float]:
    """Host us per call of each implementation at ``shape`` ("NxK"), batch 1, bf16."""
    n, k = (int(s) for s in shape.split("x"))
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    w = lin.weight.detach()
    res = {}
    with torch.no_grad():
        res["torch F.linear bf16"] = per_call_us(lambda: torch.nn.functional.linear(x, w))
        m = qnn.Linear4bit.from_linear(lin)
        res["quantcore Linear4bit nf4"] = per_call_us(lambda: m(x))
        sa = m._state_args()
        op = torch.ops.quantcore.linear_4bit.default
        res["torch.ops.quantcore.linear_4bit"] = per_call_us(
            lambda: op(x, *sa, n, k, m.blocksize, m.quant_type, None))
        q = qnn.LinearQ4_0.from_linear(lin)
        res["quantcore LinearQ4_0"] = per_call_us(lambda: q(x))
        if bnb is not None:
            b = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
            b.load_state_dict(lin.state_dict())
            b = b.cuda()
            res["bnb Linear4bit nf4"] = per_call_us(lambda: b(x))
        if profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(2000):
                m(x)
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
            with open(os.path.join(os.environ["OUT"], "linear_host_profile.txt"), "w") as f:
                f.write(s.getvalue())
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="4096x4096,14336x4096,1024x4096")
    args = p.parse_args()
    try:
        import bitsandbytes as bnb
    except ImportError:
        bnb = None
    rows = []
    for i, shape in enumerate(args.shapes.split(",")):
        res = measure_shape(shape, bnb, profile=(i == 0 and bool(os.environ.get("OUT"))))
        base = res["torch F.linear bf16"]
        rows += [(shape, name, us, us / base) for name, us in res.items()]
    print(f"{'shape':>12}  {'call':34}  {'us/call':>8}  {'x F.linear':>10}")
    for shape, name, us, ratio in rows:
        print(f"{shape:>12}  {name:34}  {us:8.2f}  {ratio:10.2f}")


if __name__ == "__main__":
    main()
