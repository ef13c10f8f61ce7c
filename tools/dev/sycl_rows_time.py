"""Time gemv_4bit (NF4 bs 64, double quantization) and gemm_w4a8 (Q4_0) of a 4096x4096 weight on the
sycl backend with many activation rows: wall time and process CPU time (user + system, which moves
less than wall time on a shared machine), median of 3 calls after a warm-up.

    PYTHONPATH=<tree> python tools/dev/sycl_rows_time.py ROWS [DTYPE]

Uses only the backend API, so it times any tree (the before / after log in docs/performance.md,
"SYCL/MACA many rows")."""

from __future__ import annotations

import resource
import sys
import time

import numpy as np

from quantcore import api
from quantcore.arrays import as_dtype
from quantcore.backend import Nested
from quantcore.registry import get_backend


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(rows: int, dtype: str) -> None:
    sycl = get_backend("sycl")
    n = k = 4096
    dt = as_dtype(dtype)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, k)).astype(np.float32)
    packed, state = api.quantize_4bit(w.astype(dt), 64, "nf4", compress_statistics=True, backend="cpu")
    wq = api.quantize_q4_0(w, backend="cpu")
    put = sycl.from_numpy
    nested = Nested(absmax2=put(state.state2.absmax), code2=put(state.state2.code), offset=put(state.offset))
    a, p, am, q = put(rng.standard_normal((rows, k)).astype(dt)), put(packed), put(state.absmax), put(wq)
    y, out = sycl.empty((rows, n), dt), sycl.empty((n, rows), np.float32)

    def gemv():
        sycl.gemv_4bit(a, p, am, y, n=n, k=k, blocksize=64, quant_type="nf4", nested=nested)

    def gemm():
        sycl.gemm_w4a8(q, a, out)

    for name, fn in (("gemv", gemv), ("gemm", gemm)):
        fn()
        sycl.synchronize()
        cpu, wall = [], []
        for _ in range(3):
            c0, t0 = _cpu_s(), time.perf_counter()
            fn()
            sycl.synchronize()
            cpu.append((_cpu_s() - c0) * 1e3)
            wall.append((time.perf_counter() - t0) * 1e3)
        print(f"{name} rows {rows}: wall {np.median(wall):.0f} ms, cpu {np.median(cpu):.0f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 64, sys.argv[2] if len(sys.argv) > 2 else "bfloat16")
