"""SYCL against the numpy reference on the ops the issue names: ``python -m quantcore.backends.sycl.bench``.

Both sides run the kernel-level op on their own native arrays (no host <-> device copies timed),
warm-up first, then the median of ``repeats`` wall-clock runs, the SYCL side waiting for its queue
each time. On a CPU OpenCL device these are CPU timings of the machine it runs on, not the
project's performance figures (those come from the GPU machine, see docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import numpy as np

from quantcore import api
from quantcore.arrays import as_dtype
from quantcore.backend import Nested
from quantcore.bench import HostTimer
from quantcore.registry import get_backend


def _median_seconds(fn: Callable[[], Any], sync: Callable[[], None], repeats: int) -> float:
    """One warm-up call, then the median of ``repeats`` (quantcore.bench's host timer), in seconds."""
    return HostTimer(sync).kernel([fn], repeats, 1) / 1e6


def compare(n: int = 4096, k: int = 4096, dtype: str = "bfloat16", quant_type: str = "nf4",
            blocksize: int = 64, nested: bool = True, repeats: int = 10, seed: int = 0) -> dict:
    """Time dequantize_4bit and gemv_4bit (batch 1) of an [n, k] weight on sycl and on cpu.

    Returns ``{"device", "shape", "dtype", ..., "ops": {op: {"cpu_ms", "sycl_ms", "speedup"}}}``.
    """
    cpu, sycl = get_backend("cpu"), get_backend("sycl")
    dt = as_dtype(dtype)
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(dt)
    a = rng.standard_normal((1, k)).astype(dt)
    packed, state = api.quantize_4bit(w, blocksize, quant_type, compress_statistics=nested, backend=cpu)

    def natives(be):
        put = be.from_numpy
        st = {"absmax": put(state.absmax), "packed": put(packed), "a": put(a),
              "out": be.empty((n, k), dt), "y": be.empty((1, n), dt), "nested": None}
        if nested:
            st["nested"] = Nested(absmax2=put(state.state2.absmax), code2=put(state.state2.code),
                                  offset=put(state.offset))
        return st

    result = {"device": sycl.devices()[0].strip("* "), "shape": [n, k], "dtype": dtype,
              "quant_type": quant_type, "blocksize": blocksize, "nested": nested,
              "repeats": repeats, "ops": {}}
    timings: dict[str, dict[str, float]] = {"dequantize_4bit": {}, "gemv_4bit": {}}
    for name, be in (("cpu", cpu), ("sycl", sycl)):
        s = natives(be)

        def dequant(be=be, s=s):
            be.dequantize_4bit(s["packed"], s["absmax"], s["out"], blocksize=blocksize,
                               quant_type=quant_type, nested=s["nested"])

        def gemv(be=be, s=s):
            be.gemv_4bit(s["a"], s["packed"], s["absmax"], s["y"], n=n, k=k, blocksize=blocksize,
                         quant_type=quant_type, nested=s["nested"])

        timings["dequantize_4bit"][name] = _median_seconds(dequant, be.synchronize, repeats)
        timings["gemv_4bit"][name] = _median_seconds(gemv, be.synchronize, repeats)
    for op, t in timings.items():
        result["ops"][op] = {"cpu_ms": t["cpu"] * 1e3, "sycl_ms": t["sycl"] * 1e3,
                             "speedup": t["cpu"] / t["sycl"]}
    return result


def many_rows(rows: int, n: int = 4096, k: int = 4096, dtype: str = "bfloat16", quant_type: str = "nf4",
              blocksize: int = 64, repeats: int = 3, seed: int = 0) -> dict:
    """Time gemv_4bit (double-quantized ``quant_type``) and gemm_w4a8 (Q4_0) of an [n, k] weight
    with ``rows`` activation rows on sycl; returns ``{"device", "rows", "shape", "ops": {op: ms}}``."""
    sycl = get_backend("sycl")
    dt = as_dtype(dtype)
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    a = rng.standard_normal((rows, k)).astype(dt)
    packed, state = api.quantize_4bit(w.astype(dt), blocksize, quant_type, compress_statistics=True,
                                      backend="cpu")
    wq = api.quantize_q4_0(w, backend="cpu")
    put = sycl.from_numpy
    nested = Nested(absmax2=put(state.state2.absmax), code2=put(state.state2.code), offset=put(state.offset))
    s = {"a": put(a), "packed": put(packed), "absmax": put(state.absmax), "wq": put(wq),
         "y": sycl.empty((rows, n), dt), "out": sycl.empty((n, rows), np.float32)}

    def gemv():
        sycl.gemv_4bit(s["a"], s["packed"], s["absmax"], s["y"], n=n, k=k, blocksize=blocksize,
                       quant_type=quant_type, nested=nested)

    def gemm():
        sycl.gemm_w4a8(s["wq"], s["a"], s["out"])

    ops = {f"gemv_4bit {quant_type} bs{blocksize} nested": gemv, "gemm_w4a8 q4_0": gemm}
    return {"device": sycl.devices()[0].strip("* "), "rows": rows, "shape": [n, k], "dtype": dtype,
            "repeats": repeats,
            "ops": {op: _median_seconds(fn, sycl.synchronize, repeats) * 1e3 for op, fn in ops.items()}}


def table(res: dict) -> str:
    rows = [f"SYCL vs numpy reference, {res['quant_type']} bs {res['blocksize']}"
            f"{' double-quant' if res['nested'] else ''}, weight {res['shape'][0]}x{res['shape'][1]}, "
            f"{res['dtype']}, median of {res['repeats']} (device: {res['device']})",
            "| op | numpy reference (ms) | sycl (ms) | sycl speedup |", "| --- | --- | --- | --- |"]
    for op, r in res["ops"].items():
        rows.append(f"| {op} | {r['cpu_ms']:.2f} | {r['sycl_ms']:.2f} | {r['speedup']:.1f}x |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--quant-type", default="nf4", choices=["nf4", "fp4"])
    p.add_argument("--blocksize", type=int, default=64)
    p.add_argument("--no-nested", action="store_true")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", help="also write the result to this file")
    p.add_argument("--rows", type=int, nargs="*",
                   help="instead: time gemv_4bit and gemm_w4a8 with these numbers of activation rows")
    args = p.parse_args(argv)
    if args.rows:
        results = [many_rows(r, args.n, args.k, args.dtype, args.quant_type, args.blocksize, args.repeats)
                   for r in args.rows]
        for res in results:
            print(f"rows {res['rows']}, weight {args.n}x{args.k}, {args.dtype}, median of {res['repeats']} "
                  f"({res['device']}): " + ", ".join(f"{op} {ms:.1f} ms" for op, ms in res["ops"].items()))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
        return 0
    res = compare(args.n, args.k, args.dtype, args.quant_type, args.blocksize, not args.no_nested,
                  args.repeats)
    print(table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
