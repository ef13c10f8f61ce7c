"""Host time of one eager linear call at batch 1: quantcore.nn modules against torch's F.linear (bf16)
and bnb.nn.Linear4bit, on the GPU machine.

Each figure is the host's time per call: 200 calls queued behind a sleep kernel that keeps the GPU
busy (so no call waits for the GPU, whatever its kernels take), median of 9 rounds, the rounds of
all implementations taken in turn; the op-dispatch path (torch.ops.quantcore.linear_4bit) is timed
too, and a cProfile of each module's call goes to $OUT/linear_host_profile.txt (Linear4bit) and
$OUT/linear_q4_0_host_profile.txt (LinearQ4_0).

    python3 tools/dev/linear_host_time.py [--shapes 4096x4096,14336x4096] [--breakdown] [--breakdown-q4]
        [--gpu-time] [--q4-only]

--breakdown first times each layer of the eager Linear4bit path, the launch alone (CuPy's driver
binding, ctypes) and torch's own launch of an empty kernel, at the first shape; --breakdown-q4 the
same for LinearQ4_0's bound forward; --gpu-time the GPU time per call of LinearQ4_0's forward
(CUDA events around 200 calls queued behind a sleep kernel: every kernel the call launches);
--q4-only times F.linear and LinearQ4_0 alone.
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

SLEEP_CYCLES = 200_000_000  #: ~100 ms of GPU sleep: longer than the host needs to queue one round


def interleaved(fns: dict, calls: int = 200, rounds: int = 9) -> dict[str, float]:
    """Host us per call of each function: the wall time of ``calls`` calls queued while a sleep
    kernel keeps the GPU busy (fewer calls than the launch queue holds, so no call waits for the
    GPU: the host's cost alone, whatever the kernels take), median of ``rounds``, the rounds of
    all functions taken in turn (host noise hits all alike)."""
    for fn in fns.values():
        for _ in range(50):
            fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            torch.cuda._sleep(SLEEP_CYCLES)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t0) / calls * 1e6)
            torch.cuda.synchronize()
    return {name: statistics.median(t) for name, t in times.items()}


def measure_shape(shape: str, bnb, profile: bool, q4_only: bool = False, rows: int = 1) -> dict[str, float]:
    """Host us per call of each implementation at ``shape`` ("NxK"), ``rows`` input rows (batch 1:
    decode; 512: a prefill's), bf16 (``q4_only``: F.linear and LinearQ4_0 alone)."""
    n, k = (int(s) for s in shape.split("x"))
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = lin.weight.detach()
    fns, mods = {}, []
    with torch.no_grad():
        fns["torch F.linear bf16"] = lambda: torch.nn.functional.linear(x, w)
        if not q4_only:
            m = qnn.Linear4bit.from_linear(lin)
            fns["quantcore Linear4bit nf4"] = lambda: m(x)
            sa = m._state_args()
            op = torch.ops.quantcore.linear_4bit.default
            fns["torch.ops.quantcore.linear_4bit"] = lambda: op(x, *sa, n, k, m.blocksize, m.quant_type, None)
            mods.append(("linear_host_profile.txt", m))
        q = qnn.LinearQ4_0.from_linear(lin)
        fns["quantcore LinearQ4_0"] = lambda: q(x)
        mods.append(("linear_q4_0_host_profile.txt", q))
        if bnb is not None and not q4_only:
            b = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
            b.load_state_dict(lin.state_dict())
            b = b.cuda()
            fns["bnb Linear4bit nf4"] = lambda: b(x)
        res = interleaved(fns)
        if profile:
            for name, mod in mods:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(2000):
                    mod(x)
                prof.disable()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
                with open(os.path.join(os.environ["OUT"], name), "w") as f:
                    f.write(s.getvalue())
    return res


def per_call_us(fn) -> float:
    """Host us per call of one function (the method of :func:`interleaved`)."""
    return interleaved({"f": fn})["f"]


def breakdown(shape: str) -> dict[str, float]:
    """Host us per call of each layer of the eager Linear4bit path, outermost first (4-bit nf4, B1)."""
    from quantcore.backends.cuda import runtime as rt

    import quantcore as qc
    import quantcore.torch as qct

    n, k = (int(s) for s in shape.split("x"))
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    m = qnn.Linear4bit.from_linear(lin)
    sa = m._state_args()
    be = qct.backend_for(x.device)
    res = {}

    with torch.no_grad():
        st = m.quant_state
        res["module forward"] = per_call_us(lambda: m(x))
        res["qct.linear_4bit_eager(state=)"] = per_call_us(
            lambda: qct.linear_4bit_eager(x, *sa, n, k, 64, "nf4", None, state=st))
        res["api.gemv_4bit(backend=)"] = per_call_us(lambda: qc.gemv_4bit(x, m.weight, st, backend=be))
        plan = st._plans["gemv_4bit"][1]
        res["plan(A, packed, state)"] = per_call_us(lambda: plan(x, m.weight, st))
        res["plan.match"] = per_call_us(lambda: plan.match(x, m.weight, st))
        entry = plan.match(x, m.weight, st)
        launch, stream = entry[1], rt.raw_stream_getter()
        out = x.new_empty((1, n))
        res["launch only (stream getter + PlannedLaunch)"] = per_call_us(
            lambda: launch(stream(0), x.data_ptr(), out.data_ptr()))
        gx, gy, gz = launch.grid
        raw = (launch._fn, gx, gy, gz, launch.block, 1, 1, launch.shared_mem, stream(0), launch._params_ptr, 0)
        res["cupy driver.launchKernel alone"] = per_call_us(lambda: launch._launch(*raw))
        slot = launch._slots[0]
        import ctypes

        libcuda = ctypes.CDLL("libcuda.so.1")
        cu_launch = libcuda.cuLaunchKernel
        cu_launch.restype = ctypes.c_int
        cu_launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 6 + [ctypes.c_uint, ctypes.c_void_p,
                                                                      ctypes.c_void_p, ctypes.c_void_p]
        res["ctypes cuLaunchKernel alone"] = per_call_us(lambda: cu_launch(*raw))
        res["torch.cuda._sleep(0) (a runtime launch through torch)"] = per_call_us(lambda: torch.cuda._sleep(0))
        res["one ctypes slot write"] = per_call_us(lambda: setattr(slot, "value", 12345))
        res["stream getter"] = per_call_us(lambda: stream(0))
        res["x.new_empty"] = per_call_us(lambda: x.new_empty((1, n)))
        res["m.quant_state"] = per_call_us(lambda: m.quant_state)
        res["torch.compiler.is_compiling"] = per_call_us(torch.compiler.is_compiling)
        res["F.linear bf16"] = per_call_us(lambda: torch.nn.functional.linear(x, lin.weight))
    return res


def gpu_us(fn, calls: int = 200, rounds: int = 5) -> float:
    """GPU us per call of ``fn``: CUDA events around ``calls`` calls queued behind a sleep kernel (so
    they run back to back on the GPU, whatever the host takes), median of ``rounds``."""
    for _ in range(20):
        fn()
    times = []
    for _ in range(rounds):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        e0.record()
        for _ in range(calls):
            fn()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / calls)
    return statistics.median(times)


def gpu_time_q4_0(shapes: list[str]) -> dict[str, float]:
    """GPU us per call of LinearQ4_0's eager forward (B1, bf16, no bias) at each shape: every kernel
    the call launches."""
    res = {}
    with torch.no_grad():
        for shape in shapes:
            n, k = (int(s) for s in shape.split("x"))
            lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            q = qnn.LinearQ4_0.from_linear(lin)
            res[shape] = gpu_us(lambda q=q, x=x: q(x))
    return res


def breakdown_q4_0(shape: str) -> dict[str, float]:
    """Host us per call of each layer of LinearQ4_0's bound eager forward, outermost first (B1, bf16),
    and of the pieces of the bound call (backends/cuda/plans.py _BoundW4a8)."""
    from quantcore.backends.cuda import runtime as rt

    n, k = (int(s) for s in shape.split("x"))
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    res = {}
    with torch.no_grad():
        q = qnn.LinearQ4_0.from_linear(lin)
        q(x)
        bound = q._bound
        w = q.weight
        res["module call q(x)"] = per_call_us(lambda: q(x))
        res["q.forward(x)"] = per_call_us(lambda: q.forward(x))
        res["nn._eager(x, None)"] = per_call_us(lambda: qnn._eager(x, None))
        res["bound(x)"] = per_call_us(lambda: bound(x))
        shape_, dtype_, dev = x.shape, x.dtype, x.get_device()
        res["input checks (type, shape, dtype, ptr, contiguous, device)"] = per_call_us(
            lambda: (type(x) is torch.Tensor, x.shape == shape_, x.dtype == dtype_, x.data_ptr() & 15,
                     x.is_contiguous(), x.get_device() == dev))
        res["weight checks (data_ptr, _version)"] = per_call_us(lambda: (w.data_ptr(), w._version))
        res["rt.tune_spec()"] = per_call_us(rt.tune_spec)
        ctx_now = rt.cupy().cuda.driver.ctxGetCurrent
        res["cupy ctxGetCurrent"] = per_call_us(ctx_now)
        stream = rt.raw_stream_getter()
        res["stream getter"] = per_call_us(lambda: stream(0))
        res["x.new_empty((1, n))"] = per_call_us(lambda: x.new_empty((1, n)))
        res["launch as the bound call makes it (driver call from its parts)"] = per_call_us(
            lambda: bound._driver(*bound._head, stream(0), bound._params, 0))
        raw = (*bound._head, stream(0), bound._params, 0)
        res["cupy driver.launchKernel alone (arguments prebuilt)"] = per_call_us(lambda: bound._driver(*raw))
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="4096x4096,14336x4096,1024x4096")
    p.add_argument("--breakdown", action="store_true", help="also time each layer of the eager path")
    p.add_argument("--breakdown-q4", action="store_true", help="also time each layer of LinearQ4_0's bound path")
    p.add_argument("--gpu-time", action="store_true", help="also the GPU time per call of LinearQ4_0's forward")
    p.add_argument("--q4-only", action="store_true", help="time F.linear and LinearQ4_0 only")
    p.add_argument("--rows", type=int, default=1, help="input rows of the module calls (default 1)")
    args = p.parse_args()
    if args.breakdown:
        for name, us in breakdown(args.shapes.split(",")[0]).items():
            print(f"breakdown {name:48} {us:8.2f} us")
    if args.gpu_time:
        for shape, us in gpu_time_q4_0(args.shapes.split(",")).items():
            print(f"gpu-time LinearQ4_0 {shape:>12} {us:8.2f} us")
    if args.breakdown_q4:
        for name, us in breakdown_q4_0(args.shapes.split(",")[0]).items():
            print(f"breakdown-q4 {name:60} {us:8.2f} us")
    try:
        import bitsandbytes as bnb
    except ImportError:
        bnb = None
    rows = []
    for i, shape in enumerate(args.shapes.split(",")):
        res = measure_shape(shape, bnb, profile=(i == 0 and bool(os.environ.get("OUT"))), q4_only=args.q4_only,
                            rows=args.rows)
        base = res["torch F.linear bf16"]
        rows += [(shape, name, us, us / base) for name, us in res.items()]
    print(f"{'shape':>12}  {'call':34}  {'us/call':>8}  {'x F.linear':>10}")
    for shape, name, us, ratio in rows:
        print(f"{shape:>12}  {name:34}  {us:8.2f}  {ratio:10.2f}")


if __name__ == "__main__":
    main()
