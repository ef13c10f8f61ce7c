"""``quantcore bench``: speed of quantcore's ops against the peers, in one process.

One run measures, on the selected backend: quantcore through its public API, the peers that are
installed (bitsandbytes; torch bf16 for the matrix products) and the device's copy bandwidth (a
large device-to-device copy, bytes read + written) as the ceiling. It prints a table (time, GB/s
on the counted bytes, % of copy, speedup of quantcore over each peer), and writes JSON and a PNG
plot. Method (docs/performance.md): random data, warm-up, median of many runs, input
buffers rotated when a call's data would fit in L2, bytes counted as each input read once plus
each output written once (4-bit dequantize: the seeds' ``n/2 + nblocks + 2*ngroups + 2*256 +
itemsize*n``).

GPU time on CUDA: each timed call is queued behind a sleep kernel (~1 ms) so the host has queued
the two events and the call before the GPU reaches them; the event pair then measures the GPU's
time for the call alone (``kernel``). quantcore's kernel time is taken on the backend's
kernel-level op (outputs preallocated, as in the conformance suite); ``eager`` is the host wall
time per call of many back-to-back calls of the public API (validation, allocation and Python
overhead included) after one untimed call per input (steady state: a state's first gemv_4bit call
also builds its launch plan), which is what a small shape costs a caller. The peers are timed through
their public functions for both.
Other backends (sycl, cpu, reference) are timed with the host clock after ``synchronize()``.
On the host backends (cpu, reference) the peers are bitsandbytes' CPU backend (``bnb.matmul_4bit``,
``F.quantize_4bit`` / ``F.dequantize_4bit`` on torch CPU tensors) and torch's fp32 and bf16
``F.linear`` on the unquantized weights, when installed; the ceilings are the compiled library's
stream read (a multithreaded fp32 sum) and stream copy of 256 MiB; inputs are rotated until a pass
over them is 96 MiB (three times a 32 MB L3), so the weights come from memory.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from . import __version__, api
from .arrays import as_dtype
from .backend import Nested
from .errors import QuantcoreError
from .formats import bnb as fbnb
from .registry import get_backend

ROTATE_BYTES = 256 << 20  #: rotate input sets until a pass over them is this large (L2 is 50-60 MB)
HOST_ROTATE_BYTES = 96 << 20  #: the same on the host backends (beyond the last-level cache)
HOST_STREAM_BYTES = 256 << 20  #: array size of the host stream read / copy ceilings
#: The host backends whose arrays are numpy arrays (bitsandbytes CPU and torch CPU peers).
HOST_BACKENDS = ("cpu", "reference")
SLEEP_CYCLES = 2_000_000  #: ~1 ms at 2 GHz: longer than the host needs to queue one timed call


@dataclass
class Row:
    op: str
    shape: str
    impl: str
    nbytes: int
    kernel_us: float | None = None
    best_us: float | None = None  #: host timers: the fastest call (a shared machine's medians wander)
    eager_us: float | None = None
    gbps: float | None = None
    pct_copy: float | None = None
    pct_read: float | None = None
    speedup: dict[str, float] = field(default_factory=dict)  #: peer impl -> t_peer / t_quantcore
    note: str = ""


# -- timers -------------------------------------------------------------------------------------------
class CudaTimer:
    """CUDA-event timing of single calls (see the module docstring) through torch."""

    def __init__(self, torch):
        self.torch = torch

    def kernel(self, fns: list[Callable[[], Any]], reps: int, warmup: int) -> float:
        t = self.torch
        for i in range(warmup):
            fns[i % len(fns)]()
        t.cuda.synchronize()
        starts = [t.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [t.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            t.cuda._sleep(SLEEP_CYCLES)
            starts[i].record()
            fns[i % len(fns)]()
            ends[i].record()
        t.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3

    def eager(self, fns: list[Callable[[], Any]], reps: int) -> float:
        for fn in fns:  # steady state: every input's first call (caches, launch plans) is not timed
            fn()
        self.torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(reps):
            fns[i % len(fns)]()
        self.torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps * 1e6


class HostTimer:
    """Host-clock timing for backends without CUDA events."""

    def __init__(self, sync: Callable[[], None]):
        self.sync = sync
        self.best_us: float | None = None  #: the fastest call of the last kernel() timing

    def kernel(self, fns: list[Callable[[], Any]], reps: int, warmup: int) -> float:
        for i in range(warmup):
            fns[i % len(fns)]()
        self.sync()
        times = []
        for i in range(reps):
            t0 = time.perf_counter()
            fns[i % len(fns)]()
            self.sync()
            times.append(time.perf_counter() - t0)
        self.best_us = min(times) * 1e6
        return statistics.median(times) * 1e6

    def eager(self, fns: list[Callable[[], Any]], reps: int) -> float:
        return self.kernel(fns, reps, len(fns))


def capture_graph(fn: Callable[[], Any]) -> Any:
    """``fn`` (a sequence of launches on torch's current CUDA stream) captured in a torch CUDAGraph after one
    warm-up call on a side stream (kernel builds, launch plans, allocator pools), replayed once."""
    import torch as t  # noqa: PLC0415 - a CUDA-only helper; the module imports without torch

    s = t.cuda.Stream()
    s.wait_stream(t.cuda.current_stream())
    with t.cuda.stream(s):
        fn()
    t.cuda.current_stream().wait_stream(s)
    g = t.cuda.CUDAGraph()
    with t.cuda.graph(g):
        fn()
    g.replay()
    t.cuda.synchronize()
    return g


def replay_us(g: Any, reps: int) -> list[float]:
    """GPU time in us of each of ``reps`` replays of the CUDA graph ``g`` (CUDA events around each)."""
    import torch as t  # noqa: PLC0415

    times = []
    for _ in range(reps):
        e0, e1 = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        t.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3)
    return times


def graph_us(fn: Callable[[], Any], reps: int = 5) -> float:
    """GPU time in us of ``fn`` captured once in a CUDA graph (:func:`capture_graph`), median of ``reps`` replays."""
    g = capture_graph(fn)
    return statistics.median(replay_us(g, reps))


def trace_kernels(prof: Any) -> list[tuple[float, float, str]]:
    """The GPU work a finished ``torch.profiler.profile`` recorded, from its trace: (start us, duration us,
    name) of each kernel, memset and memcpy, in start order (the tools that measure launch gaps use it)."""
    import tempfile  # noqa: PLC0415

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as fh:
            events = json.load(fh)["traceEvents"]
    return sorted((e["ts"], e["dur"], e["name"]) for e in events
                  if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy"))


def timer_for(be: Any) -> CudaTimer | HostTimer:
    """The timer of a backend: CUDA events through torch on the cuda backend, else the host clock
    after ``be.synchronize()`` (the bench, the tools and ``quantcore check --perf`` use it)."""
    if be.name == "cuda":
        import torch  # noqa: PLC0415 - the CUDA timer records torch events

        return CudaTimer(torch)
    return HostTimer(be.synchronize)


# -- the cases ------------------------------------------------------------------------------------------
CUDA_SIZES = {
    "dequantize_4bit": [(16384, 16384), (8192, 8192), (4096, 4096)],
    "quantize_4bit": [(16384, 16384), (4096, 4096)],
    # the linear shapes of Llama-3-8B and -70B (N x K) at decode batches 1, 4, 8, 16
    "gemv_4bit": [(b, n, k) for n, k in ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (8192, 8192),
                                         (1024, 8192), (28672, 8192), (8192, 28672)) for b in (1, 4, 8, 16)],
    "gemm_w4a8": [(1, 4096, 14336), (2, 4096, 14336), (4, 4096, 14336), (8, 4096, 14336),
                  (1, 14336, 4096), (8, 14336, 4096)]
    # prefill: the int8 tensor-core GEMM
    + [(n, m, k) for m, k in ((4096, 14336), (14336, 4096)) for n in (16, 64, 512, 2048, 4096)],
}
QUICK_CUDA_SIZES = {
    "dequantize_4bit": [(16384, 16384), (4096, 4096)],
    "quantize_4bit": [(16384, 16384)],
    "gemv_4bit": [(1, 16384, 16384), (1, 14336, 4096), (8, 16384, 16384)],
    "gemm_w4a8": [(1, 4096, 14336), (8, 4096, 14336), (1, 14336, 4096), (512, 4096, 14336)],
}
# linear_4bit (NF4, the torch layer's path choice) for prefill / batched rows: (rows, N, K)
CUDA_SIZES["linear_4bit"] = [(r, n, k) for n, k in ((4096, 14336), (14336, 4096)) for r in (16, 64, 512, 2048, 4096)]
QUICK_CUDA_SIZES["linear_4bit"] = [(64, 14336, 4096), (512, 14336, 4096)]
# the decode step: Llama-3-8B's seven linears x 32 layers in one CUDA graph, at these batches
CUDA_SIZES["decode_step"] = [(1,), (8,), (16,)]
QUICK_CUDA_SIZES["decode_step"] = [(1,)]
HOST_SIZES = {
    "dequantize_4bit": [(4096, 4096)],
    "quantize_4bit": [(4096, 4096)],
    "gemv_4bit": [(1, 4096, 4096)],
    "gemm_w4a8": [(1, 4096, 4096)],
}
QUICK_HOST_SIZES = {
    "dequantize_4bit": [(1024, 1024)],
    "quantize_4bit": [(1024, 1024)],
    "gemv_4bit": [(1, 1024, 1024)],
    "gemm_w4a8": [(1, 1024, 1024)],
}
#: The cpu backend's shapes (the goals of docs/cpu.md: 4096x4096 and 14336x4096, n = 1 and 8).
CPU_SIZES = {
    "dequantize_4bit": [(4096, 4096)],
    "quantize_4bit": [(4096, 4096)],
    "gemv_4bit": [(1, 4096, 4096), (1, 14336, 4096), (8, 4096, 4096)],
    "gemm_w4a8": [(1, 4096, 4096), (1, 14336, 4096), (8, 4096, 4096)],
    "mx_quantize": [(1024, 1024)], "mx_dequantize": [(1024, 1024)], "scaled_fp4_mm": [(128, 128, 256)],
}
# -- MX family: NVFP4 / MXFP4 / MXFP8 quantize and scaled_fp4_mm (added with the CUDA MX kernels;
# the methods of the same names are in Bench's "MX family" block) ---------------------------------
CUDA_SIZES.update({"mx_quantize": [(16384, 16384)], "mx_dequantize": [(16384, 16384)],
                   "scaled_fp4_mm": [(8192, 8192, 8192)]})
QUICK_CUDA_SIZES.update({"mx_quantize": [(16384, 16384)], "mx_dequantize": [(16384, 16384)],
                         "scaled_fp4_mm": [(8192, 8192, 8192)]})
HOST_SIZES.update({"mx_quantize": [(1024, 1024)], "mx_dequantize": [(1024, 1024)],
                   "scaled_fp4_mm": [(128, 128, 256)]})
QUICK_HOST_SIZES.update({"mx_quantize": [(256, 256)], "mx_dequantize": [(256, 256)],
                         "scaled_fp4_mm": [(64, 64, 128)]})
# weight-only MX (linear_mx, decode): MXFP4 / NVFP4 weights, bf16 activations, batch 1 and 8; the
# larger layers at batch 1 and 16 (one launch of the tensor-core gemv either way)
CUDA_SIZES["linear_mx"] = [(b, n, k) for b in (1, 8) for n, k in ((4096, 14336), (14336, 4096))] + [
    (b, n, k) for n, k in ((8192, 8192), (28672, 8192)) for b in (1, 16)]
QUICK_CUDA_SIZES["linear_mx"] = [(1, 4096, 14336), (1, 14336, 4096)]
HOST_SIZES["linear_mx"] = [(1, 1024, 1024)]
QUICK_HOST_SIZES["linear_mx"] = [(1, 256, 256)]
CPU_SIZES["linear_mx"] = [(1, 4096, 4096)]
OPS = tuple(CUDA_SIZES)


def _dq_bytes(n: int, bs: int, out_itemsize: int) -> int:
    nb = fbnb.nblocks(n, bs)
    return n // 2 + nb + 2 * fbnb.nblocks(nb, 256) + 2 * 256 + out_itemsize * n


def _nested_bytes(n: int, bs: int) -> int:
    nb = fbnb.nblocks(n, bs)
    return nb + 4 * fbnb.nblocks(nb, 256) + 4 * 256 + 4


class Bench:
    def __init__(self, backend: str, quick: bool, reps: int | None, verbose: bool):
        self.be = get_backend(backend)
        self.backend = backend
        self.quick = quick
        self.reps = reps or (20 if quick else 60)
        self.verbose = verbose
        self.torch = None
        self.bnb = None
        self.rows: list[Row] = []
        self.copy_gbps: float | None = None
        self.read_gbps: float | None = None
        self.ht = None  #: torch for the host peers (CPU tensors)
        self.device = platform.processor() or platform.machine()
        self.notes: list[str] = []
        if backend == "cuda":
            import torch  # noqa: PLC0415 - the CUDA bench drives torch tensors

            self.torch = torch
            self.device = torch.cuda.get_device_name()
            try:
                import bitsandbytes  # noqa: PLC0415
                import bitsandbytes.functional  # noqa: F401, PLC0415

                self.bnb = bitsandbytes
            except Exception as exc:  # noqa: BLE001 - not installed or broken: no bnb rows
                self.notes.append(f"bitsandbytes not measured: {type(exc).__name__}: {exc}")
        elif backend in HOST_BACKENDS:
            self._host_peers()
        self.timer: Any = timer_for(self.be)

    def _host_peers(self) -> None:
        try:
            import torch  # noqa: PLC0415 - optional peer

            self.ht = torch
            self.notes.append(f"torch {torch.__version__} CPU, {torch.get_num_threads()} threads")
        except ImportError:
            self.notes.append("torch not installed: no torch / bitsandbytes rows")
            return
        try:
            import bitsandbytes  # noqa: PLC0415
            import bitsandbytes.functional  # noqa: F401, PLC0415

            self.bnb = bitsandbytes
        except Exception as exc:  # noqa: BLE001 - not installed or broken: no bnb rows
            self.notes.append(f"bitsandbytes not measured: {type(exc).__name__}: {exc}")
        threads = getattr(self.be, "num_threads", None)
        if callable(threads):
            self.notes.append(f"quantcore {self.backend}: {self.be.availability().mode}")

    def peer(self, x):
        """A peer's view of one of our inputs: the tensor itself on CUDA, a torch CPU tensor (no
        copy) on the host backends."""
        if self.torch is not None:
            return x
        from .arrays import numpy_to_torch  # noqa: PLC0415

        return numpy_to_torch(np.ascontiguousarray(x))

    # -- helpers --------------------------------------------------------------------------------------
    def log(self, msg: str) -> None:
        if self.verbose:
            print(msg, flush=True)

    def sets(self, bytes_per_call: int) -> int:
        if self.torch is not None:
            return max(1, min(16, math.ceil(ROTATE_BYTES / max(bytes_per_call, 1))))
        if self.backend in HOST_BACKENDS:
            return max(1, min(16, math.ceil(HOST_ROTATE_BYTES / max(bytes_per_call, 1))))
        return 1

    def rand(self, shape, dtype: str, scale: float = 1.0):
        if self.torch is not None:
            t = self.torch
            return (t.randn(*shape, device="cuda", dtype=t.float32) * scale).to(getattr(t, dtype))
        a = (np.random.default_rng(len(self.rows)).standard_normal(shape) * scale).astype(as_dtype(dtype))
        return self.be.from_numpy(a)

    def measure(self, op: str, shape: str, impl: str, nbytes: int, fns: list[Callable[[], Any]],
                note: str = "", eager: list[Callable[[], Any]] | None = None) -> Row:
        def timed(row: Row) -> None:
            row.kernel_us = self.timer.kernel(fns, self.reps, warmup=max(3, len(fns)))
            row.best_us = getattr(self.timer, "best_us", None)
            row.eager_us = self.timer.eager(eager or fns, max(10, self.reps // 2))

        return self._row(op, shape, impl, nbytes, timed, note)

    def _row(self, op: str, shape: str, impl: str, nbytes: int, timed: Callable[[Row], None], note: str) -> Row:
        """A table row: ``timed`` fills its times; rates and ceilings from kernel_us."""
        row = Row(op, shape, impl, nbytes, note=note)
        try:
            timed(row)
            row.gbps = nbytes / (row.kernel_us * 1e-6) / 1e9
            if self.copy_gbps:
                row.pct_copy = 100.0 * row.gbps / self.copy_gbps
            if self.read_gbps:
                row.pct_read = 100.0 * row.gbps / self.read_gbps
        except Exception as exc:  # noqa: BLE001 - a peer that fails is reported, not fatal
            row.note = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
        self.rows.append(row)
        self.log(f"  {op:16s} {shape:22s} {impl:12s} {row.kernel_us or float('nan'):10.1f} us  {row.note}")
        return row

    def group(self, rows: list[Row]) -> None:
        """Speedups of the quantcore row over each peer row of one (op, shape)."""
        qc = [r for r in rows if r.impl == "quantcore" and r.kernel_us]  # (decode_step: the grouped launches)
        for q in qc:
            for r in rows:
                if r is not q and r.kernel_us:
                    q.speedup[r.impl] = r.kernel_us / q.kernel_us

    # -- the copy ceiling -------------------------------------------------------------------------------
    def copy(self) -> None:
        if self.torch is not None:
            t = self.torch
            nbytes = 2 << 30
            src = t.empty(nbytes, dtype=t.uint8, device="cuda").random_(0, 255)
            dst = t.empty_like(src)
            row = self.measure("copy", "2 GiB d2d", "torch", 2 * nbytes, [lambda: dst.copy_(src)])
            del src, dst
            t.cuda.empty_cache()
        elif getattr(self.be, "library", None) is not None and self.be.library() is not None:
            lib = self.be.library()
            n = HOST_STREAM_BYTES // 4
            src = np.random.default_rng(0).standard_normal(n).astype(np.float32)
            dst = np.empty_like(src)
            ps, pd = src.ctypes.data, dst.ctypes.data
            read = self.measure("stream read", f"{src.nbytes >> 20} MiB fp32 sum", "C++ OpenMP", src.nbytes,
                                [lambda: lib.qc_stream_read(ps, n, 0)])
            self.read_gbps = read.gbps
            read.pct_read = 100.0 if read.gbps else None
            row = self.measure("stream copy", f"{src.nbytes >> 20} MiB", "C++ OpenMP", 2 * src.nbytes,
                               [lambda: lib.qc_stream_copy(ps, pd, n, 0)])
            del src, dst
        else:
            n = (64 << 20) // 8
            src = np.random.default_rng(0).standard_normal(n)
            dst = np.empty_like(src)
            row = self.measure("copy", "64 MiB host", "numpy", 2 * src.nbytes, [lambda: np.copyto(dst, src)])
        self.copy_gbps = row.gbps
        row.pct_copy = 100.0 if row.gbps else None

    # -- ops ----------------------------------------------------------------------------------------------
    def dequantize_4bit(self, rows_cols, qt: str = "nf4") -> None:
        r, c = rows_cols
        n, bs = r * c, 64
        nbytes = _dq_bytes(n, bs, 2)
        k = self.sets(nbytes)
        shape = f"{r}x{c} {qt} bs64 dq"
        xs = [self.rand((r, c), "bfloat16") for _ in range(k)]
        qs = [api.quantize_4bit(x, bs, qt, True, backend=self.be) for x in xs]
        outs = [self.be.empty((r, c), as_dtype("bfloat16"), like=xs[0]) for _ in range(k)]
        be = self.be
        rows = [self.measure(
            "dequantize_4bit", shape, "quantcore", nbytes,
            [lambda p=p, s=s, o=o: be.dequantize_4bit(p, s.absmax, o, blocksize=bs, quant_type=qt,
                                                      nested=_nested(s)) for (p, s), o in zip(qs, outs)],
            eager=[lambda p=p, s=s: api.dequantize_4bit(p, s, backend=be) for p, s in qs])]
        del qs, outs
        if self.bnb is not None:
            F = self.bnb.functional
            bq = [F.quantize_4bit(self.peer(x), blocksize=bs, compress_statistics=True, quant_type=qt)
                  for x in xs]
            rows.append(self.measure("dequantize_4bit", shape, "bnb", nbytes,
                                     [lambda p=p, s=s: F.dequantize_4bit(p, s) for p, s in bq]))
            del bq
        self.group(rows)

    def quantize_4bit(self, rows_cols, qt: str = "nf4") -> None:
        r, c = rows_cols
        n, bs = r * c, 64
        nbytes = 2 * n + n // 2 + _nested_bytes(n, bs)
        k = self.sets(nbytes)
        shape = f"{r}x{c} bf16 {qt} bs64 dq"
        xs = [self.rand((r, c), "bfloat16") for _ in range(k)]
        be, nb = self.be, fbnb.nblocks(n, bs)
        u8, f32 = as_dtype("uint8"), as_dtype("float32")
        bufs = [(be.empty(((n + 1) // 2, 1), u8, like=x), be.empty((nb,), u8, like=x),
                 be.empty((fbnb.nblocks(nb, 256),), f32, like=x), be.empty((1,), f32, like=x)) for x in xs]

        def kernel(x, p, q, a2, off):
            be.quantize_4bit_nested(x, p, q, a2, off, blocksize=bs, quant_type=qt)

        rows = [self.measure("quantize_4bit", shape, "quantcore", nbytes,
                             [lambda x=x, b=b: kernel(x, *b) for x, b in zip(xs, bufs)],
                             eager=[lambda x=x: api.quantize_4bit(x, bs, qt, True, backend=be) for x in xs])]
        del bufs
        if self.bnb is not None:
            F = self.bnb.functional
            txs = [self.peer(x) for x in xs]
            rows.append(self.measure("quantize_4bit", shape, "bnb", nbytes,
                                     [lambda x=x: F.quantize_4bit(x, blocksize=bs, compress_statistics=True,
                                                                  quant_type=qt) for x in txs]))
        self.group(rows)

    def _nf4_case(self, rows: int, n: int, k: int, qt: str, bs: int = 64) -> tuple:
        """A 4-bit linear case (blocksize ``bs``, double quantization, bf16): its bytes (the 4-bit
        weight and statistics, the input and the output once), the bf16 weights (rotated sets),
        their quantizations and a bf16 input of ``rows`` rows."""
        nbytes = n * k // 2 + _nested_bytes(n * k, bs) + 2 * rows * k + 2 * rows * n
        ws = [self.rand((n, k), "bfloat16", 0.05) for _ in range(self.sets(nbytes))]
        x = self.rand((rows, k), "bfloat16")
        return nbytes, ws, [api.quantize_4bit(w, bs, qt, True, backend=self.be) for w in ws], x

    def gemv_4bit(self, bnk, qt: str = "nf4") -> None:
        b, n, k = bnk
        bs = 64
        shape = f"B{b} N{n} K{k} {qt}"
        nbytes, ws, qs, a = self._nf4_case(b, n, k, qt, bs)
        be = self.be
        out = be.empty((b, n), as_dtype("bfloat16"), like=a)
        rows = [self.measure(
            "gemv_4bit", shape, "quantcore", nbytes,
            [lambda p=p, s=s: be.gemv_4bit(a, p, s.absmax, out, n=n, k=k, blocksize=bs, quant_type=qt,
                                           nested=_nested(s)) for p, s in qs],
            eager=[lambda p=p, s=s: api.gemv_4bit(a, p, s, backend=be) for p, s in qs])]
        del qs
        if self.bnb is not None:
            F = self.bnb.functional
            bq = [F.quantize_4bit(self.peer(w), blocksize=bs, compress_statistics=True, quant_type=qt)
                  for w in ws]
            ta = self.peer(a)
            rows.append(self.measure("gemv_4bit", shape, "bnb", nbytes,
                                     [lambda p=p, s=s: self.bnb.matmul_4bit(ta, p.t(), quant_state=s)
                                      for p, s in bq]))
            del bq
        if self.ht is not None:
            self.host_linear(rows, "gemv_4bit", shape, ws, a, n, k, b)
        if self.torch is not None:
            lin = self.torch.nn.functional.linear
            tbytes = 2 * n * k + 2 * b * k + 2 * b * n
            tsets = self.sets(tbytes)
            wt = (ws * tsets)[:tsets] if len(ws) >= tsets else ws + [self.rand((n, k), "bfloat16", 0.05)
                                                                     for _ in range(tsets - len(ws))]
            rows.append(self.measure("gemv_4bit", shape, "torch-bf16", tbytes,
                                     [lambda w=w: lin(a, w) for w in wt], note="bf16 weight bytes"))
            del wt
        del ws
        self.group(rows)

    def linear_4bit(self, rnk, qt: str = "nf4") -> None:
        """``x @ W.T`` for an NF4 W [N, K] (bs 64, double quantization) and ``rows`` bf16 input rows
        (CUDA): quantcore's torch layer (``linear_4bit_eager``, whichever path it picks, the
        dequantization counted), its two paths alone (the fused GEMM behind ``gemv_4bit``;
        ``dequantize_4bit`` + ``F.linear``), bitsandbytes' ``matmul_4bit`` and torch bf16
        ``F.linear`` on the unquantized weight. Bytes: the 4-bit weight and its statistics, the
        input and the output once; the TFLOPS are in the notes."""
        from . import torch as qct  # noqa: PLC0415 - CUDA bench only

        rows_, n, k = rnk
        bs, t = 64, self.torch
        lin = t.nn.functional.linear
        shape = f"rows{rows_} N{n} K{k} {qt}"
        nbytes, ws, qs, x = self._nf4_case(rows_, n, k, qt, bs)
        be = self.be

        def layer(p, s):
            s2 = s.state2
            return qct.linear_4bit_eager(x, p, s.absmax, s2.absmax, s2.code, s.offset, n, k, bs, qt, state=s)

        out = be.empty((rows_, n), as_dtype("bfloat16"), like=x)
        path = qct.linear_path(rows_, backend=be, k=k, device=x.device, n=n)  # the input's device decides
        rows = [self.measure("linear_4bit", shape, "quantcore", nbytes, [lambda p=p, s=s: layer(p, s) for p, s in qs],
                             note=f"path {path}"),
                self.measure("linear_4bit", shape, "qc-gemv_4bit", nbytes,
                             [lambda p=p, s=s: be.gemv_4bit(x, p, s.absmax, out, n=n, k=k, blocksize=bs,
                                                            quant_type=qt, nested=_nested(s)) for p, s in qs]),
                self.measure("linear_4bit", shape, "qc-dq+mm", nbytes,
                             [lambda p=p, s=s: lin(x, api.dequantize_4bit(p, s, backend=be)) for p, s in qs])]
        del qs
        if self.bnb is not None:
            F = self.bnb.functional
            bq = [F.quantize_4bit(w, blocksize=bs, compress_statistics=True, quant_type=qt) for w in ws]
            rows.append(self.measure("linear_4bit", shape, "bnb", nbytes,
                                     [lambda p=p, s=s: self.bnb.matmul_4bit(x, p.t(), quant_state=s) for p, s in bq]))
            del bq
        tbytes = 2 * n * k + 2 * rows_ * k + 2 * rows_ * n
        wt = [ws[i % len(ws)] for i in range(self.sets(tbytes))]
        rows.append(self.measure("linear_4bit", shape, "torch-bf16", tbytes, [lambda w=w: lin(x, w) for w in wt],
                                 note="bf16 weight bytes"))
        del wt, ws
        flops = 2 * rows_ * n * k
        for r in rows:
            if r.kernel_us:
                tf = f"{flops / r.kernel_us / 1e6:.0f} TFLOPS"
                r.note = f"{tf}; {r.note}" if r.note else tf
        self.group(rows)

    def graph_us(self, fn: Callable[[], Any], reps: int = 5) -> float:
        """GPU time of ``fn`` (a sequence of launches) captured once in a CUDA graph, median of
        ``reps`` replays."""
        return graph_us(fn, reps)

    def decode_step(self, batch_t) -> None:
        """The linear layers of one Llama-3-8B decode step (q, k, v, o, gate, up, down x 32 layers,
        random NF4 weights, double quantization, blocksize 64) captured in one CUDA graph: quantcore
        with q/k/v and gate/up grouped (4 launches a layer) and one launch per linear, bitsandbytes'
        matmul_4bit, torch bf16 F.linear. Bytes: the 4-bit weights and statistics (bf16 weights for
        torch), inputs and outputs."""
        (b,) = batch_t
        t = self.torch
        layers, hid, inter = 32, 4096, 14336
        names = (("q", 4096, hid), ("k", 1024, hid), ("v", 1024, hid), ("o", hid, 4096), ("gate", inter, hid),
                 ("up", inter, hid), ("down", hid, inter))
        shape = f"B{b} 32x(q,k,v,o,gate,up,down)"
        be, qt, bs = self.be, "nf4", 64
        self.log(f"  decode_step B{b}: quantizing 224 weights")
        base = {}
        for _, n, k in names:
            if (n, k) not in base:
                base[(n, k)] = api.quantize_4bit(self.rand((n, k), "bfloat16", 0.02), bs, qt, True, backend=be)
        w4 = [[(base[(n, k)][0].clone(), base[(n, k)][1], n, k) for _, n, k in names] for _ in range(layers)]
        x = {k: self.rand((b, k), "bfloat16") for k in (hid, inter)}
        outs = {n: be.empty((b, n), as_dtype("bfloat16"), like=x[hid]) for n in (4096, 1024, inter)}
        gout = {n: be.empty((b, n), as_dtype("bfloat16"), like=x[hid]) for n in (6144, 2 * inter)}
        io = 2 * b * sum(n + k for _, n, k in names) * layers
        nbytes = sum(p.numel() + _nested_bytes(n * k, bs) for layer in w4 for p, _, n, k in layer) + io

        def one(p, st, n, k):
            be.gemv_4bit(x[k], p, st.absmax, outs[n], n=n, k=k, blocksize=bs, quant_type=qt, nested=_nested(st))

        def grp(members, k, out):
            be.gemv_4bit_grouped(x[k], [(p, st.absmax, _nested(st), n, bs, qt) for p, st, n, _ in members], out, k=k)

        def step_grouped():
            for q, kk, v, o, g, u, d in w4:
                grp((q, kk, v), hid, gout[6144])
                one(*o)
                grp((g, u), hid, gout[2 * inter])
                one(*d)

        def step_single():
            for layer in w4:
                for w in layer:
                    one(*w)

        rows = []
        for impl, fn in (("quantcore", step_grouped), ("qc-ungrouped", step_single)):
            rows.append(self._graph_row("decode_step", shape, impl, nbytes, fn,
                                        "q/k/v and gate/up grouped" if impl == "quantcore" else "one launch a linear"))
        w4.clear()
        base.clear()
        t.cuda.empty_cache()
        if self.bnb is not None:
            F = self.bnb.functional
            bq = {}
            for _, n, k in names:
                if (n, k) not in bq:
                    bq[(n, k)] = F.quantize_4bit(self.rand((n, k), "bfloat16", 0.02), blocksize=bs,
                                                 compress_statistics=True, quant_type=qt)
            wb = [[(bq[(n, k)][0].clone(), bq[(n, k)][1], k) for _, n, k in names] for _ in range(layers)]

            def step_bnb():
                for layer in wb:
                    for p, st, k in layer:
                        self.bnb.matmul_4bit(x[k], p.t(), quant_state=st)

            rows.append(self._graph_row("decode_step", shape, "bnb", nbytes, step_bnb))
            wb.clear()
            bq.clear()
            t.cuda.empty_cache()
        wt = [[self.rand((n, k), "bfloat16", 0.02) for _, n, k in names] for _ in range(layers)]
        lin = t.nn.functional.linear

        def step_torch():
            for layer in wt:
                for w in layer:
                    lin(x[w.shape[1]], w)

        tbytes = sum(2 * w.numel() for layer in wt for w in layer) + io
        rows.append(self._graph_row("decode_step", shape, "torch-bf16", tbytes, step_torch, "bf16 weight bytes"))
        wt.clear()
        self.group(rows)

    def _graph_row(self, op: str, shape: str, impl: str, nbytes: int, fn: Callable[[], Any], note: str = "") -> Row:
        def timed(row: Row) -> None:
            row.kernel_us = self.graph_us(fn)

        return self._row(op, shape, impl, nbytes, timed, note)

    def gemm_w4a8(self, nmk) -> None:
        nn, m, k = nmk
        wbytes = m * (k // 32) * 18
        nbytes = wbytes + 2 * nn * k + 4 * m * nn
        sets = self.sets(nbytes)
        shape = f"N{nn} M{m} K{k} q4_0"
        wqs = [api.quantize_q4_0(self.rand((m, k), "float32", 0.05), backend=self.be) for _ in range(sets)]
        a = self.rand((nn, k), "bfloat16")
        be = self.be
        out = be.empty((m, nn), as_dtype("float32"), like=a)
        rows = [self.measure("gemm_w4a8", shape, "quantcore", nbytes,
                             [lambda wq=wq: be.gemm_w4a8(wq, a, out) for wq in wqs],
                             eager=[lambda wq=wq: api.gemm_w4a8(wq, a, m, nn, k, backend=be) for wq in wqs])]
        ops = 2.0 * nn * m * k

        def tops(row: Row) -> str:
            return f"{ops / row.kernel_us / 1e6:.0f} TOPS" if row.kernel_us else ""

        if rows[0].kernel_us:
            rows[0].note = f"weights {wbytes / 1e6:.1f} MB: {wbytes / rows[0].kernel_us / 1e3:.0f} GB/s" \
                if nn <= 8 else f"{tops(rows[0])} (Q8_1 quantization of the activation included)"
        del wqs
        if self.torch is not None:
            t = self.torch
            lin = t.nn.functional.linear
            tbytes = 2 * m * k + 2 * nn * k + 2 * nn * m
            wt = [self.rand((m, k), "bfloat16", 0.05) for _ in range(self.sets(tbytes))]
            rows.append(self.measure("gemm_w4a8", shape, "torch-bf16", tbytes, [lambda w=w: lin(a, w) for w in wt],
                                     note="bf16 weight bytes"))
            if nn > 8:
                rows[-1].note = tops(rows[-1])
            del wt
            if nn > 16:  # cuBLASLt int8 on int8 operands of the same shape (torch._int_mm wants more than 16 rows)
                ibytes = m * k + nn * k + 4 * nn * m
                ai = t.randint(-128, 128, (nn, k), device="cuda", dtype=t.int8)
                wi = [t.randint(-128, 128, (m, k), device="cuda", dtype=t.int8).t() for _ in range(self.sets(ibytes))]
                rows.append(self.measure("gemm_w4a8", shape, "torch-int_mm", ibytes,
                                         [lambda w=w: t._int_mm(ai, w) for w in wi]))
                rows[-1].note = tops(rows[-1]) + " (int8 x int8, no scales)" if rows[-1].kernel_us else rows[-1].note
                del wi
        if self.ht is not None:
            ws = [self.rand((m, k), "bfloat16", 0.05) for _ in range(self.sets(2 * m * k))]
            self.host_linear(rows, "gemm_w4a8", shape, ws, a, m, k, nn)
        self.group(rows)

    def host_linear(self, rows: list[Row], op: str, shape: str, ws: list, a, n: int, k: int, b: int) -> None:
        """torch's fp32 and bf16 F.linear on the host, on the unquantized weights ``ws`` (rotated
        beyond the last-level cache like ours)."""
        t = self.ht
        lin = t.nn.functional.linear
        for dt, size in (("float32", 4), ("bfloat16", 2)):
            tbytes = size * (n * k + b * k + b * n)
            sets = self.sets(tbytes)
            wt = [self.peer(ws[i % len(ws)]).to(getattr(t, dt)) for i in range(sets)]
            ta = self.peer(a).to(getattr(t, dt))
            rows.append(self.measure(op, shape, f"torch-{'fp32' if size == 4 else 'bf16'}", tbytes,
                                     [lambda w=w, ta=ta: lin(ta, w) for w in wt],
                                     note=f"{'fp32' if size == 4 else 'bf16'} weight bytes"))
            del wt

    # -- MX family (NVFP4, MXFP4, MXFP8) -----------------------------------------------------------------
    def mx_quantize(self, rows_cols) -> None:
        """bf16 [r, c] -> codes + swizzled scales, each format; bytes = input + codes + scales."""
        from . import api_mx  # noqa: PLC0415 - only the MX cases need it
        from .formats import mx  # noqa: PLC0415

        r, c = rows_cols
        be = self.be
        u8 = as_dtype("uint8")
        for fmt in mx.MX_FORMATS:
            blk = mx.block_size(fmt)
            if not be.supports("mx_quantize", fmt, "bfloat16", blk):
                continue
            sshape = mx.swizzled_shape(r, c // blk)
            nbytes = 2 * r * c + r * mx.codes_cols(fmt, c) + sshape[0] * sshape[1]
            xs = [self.rand((r, c), "bfloat16") for _ in range(self.sets(nbytes))]
            codes = be.empty((r, mx.codes_cols(fmt, c)), u8, like=xs[0])
            scales = be.empty(sshape, u8, like=xs[0])
            g = be.from_numpy(np.array([mx.nvfp4_global_scale(6.0)], np.float32), like=xs[0]) \
                if fmt == "nvfp4" else None
            mode = None if fmt == "nvfp4" else "floor"
            kw = {"global_scale": g} if fmt == "nvfp4" else {}
            self.measure(
                "mx_quantize", f"{r}x{c} {fmt} bf16 swizzled", "quantcore", nbytes,
                [lambda x=x, f=fmt, m=mode, g=g, o=codes, s=scales: be.mx_quantize(
                    x, o, s, rows=r, cols=c, fmt=f, scale_mode=m, swizzled=True, global_scale=g) for x in xs],
                eager=[lambda x=x, f=fmt, kw=kw: api_mx.quantize_mx(x, f, backend=be, **kw) for x in xs])
            del xs, codes, scales

    def mx_dequantize(self, rows_cols) -> None:
        """codes + swizzled scales -> bf16 [r, c], each format (NVFP4 with its global scale); bytes
        = codes + scales read + output written (the % of copy is the goal's measure)."""
        from . import api_mx  # noqa: PLC0415
        from .formats import mx  # noqa: PLC0415

        r, c = rows_cols
        be = self.be
        for fmt in mx.MX_FORMATS:
            blk = mx.block_size(fmt)
            if not be.supports("mx_dequantize", fmt, "bfloat16", blk):
                continue
            x = self.rand((r, c), "bfloat16")
            kw = {"global_scale": float(mx.nvfp4_global_scale(6.0))} if fmt == "nvfp4" else {}
            codes, scales = api_mx.quantize_mx(x, fmt, backend=be, **kw)
            del x
            g = be.from_numpy(np.array([kw["global_scale"]], np.float32), like=codes) if kw else None
            out = be.empty((r, c), as_dtype("bfloat16"), like=codes)
            nbytes = r * mx.codes_cols(fmt, c) + scales.shape[0] * scales.shape[1] + 2 * r * c
            self.measure(
                "mx_dequantize", f"{r}x{c} {fmt} bf16 swizzled", "quantcore", nbytes,
                [lambda f=fmt, g=g, cd=codes, s=scales, o=out: be.mx_dequantize(
                    cd, s, o, rows=r, cols=c, fmt=f, swizzled=True, global_scale=g)],
                eager=[lambda f=fmt, cd=codes, s=scales, kw=kw: api_mx.dequantize_mx(
                    cd, s, f, "bfloat16", backend=be, **kw)])
            del codes, scales, out

    def scaled_fp4_mm(self, mnk) -> None:
        """D = A @ B^T on packed fp4 operands (nvfp4, mxfp4) against torch bf16 matmul of the same
        shape; the TFLOPS are in the note, the speedup column compares times."""
        from . import api_mx  # noqa: PLC0415
        from .formats import mx  # noqa: PLC0415

        m, n, k = mnk
        be = self.be
        flops = 2.0 * m * n * k
        rows = []
        for fmt in mx.FP4_FORMATS:
            blk = mx.block_size(fmt)
            if not be.supports("scaled_fp4_mm", fmt, "bfloat16", blk):
                continue
            xa, xb = self.rand((m, k), "bfloat16"), self.rand((n, k), "bfloat16")
            kw = {"global_scale": float(mx.nvfp4_global_scale(6.0))} if fmt == "nvfp4" else {}
            a, sa = api_mx.quantize_mx(xa, fmt, backend=be, **kw)
            b, sb = api_mx.quantize_mx(xb, fmt, backend=be, **kw)
            del xa, xb
            alpha = be.from_numpy(np.array([1.0], np.float32), like=a)
            out = be.empty((m, n), as_dtype("bfloat16"), like=a)
            nbytes = (m + n) * k // 2 + (sa.shape[0] * sa.shape[1] + sb.shape[0] * sb.shape[1]) + 2 * m * n
            row = self.measure(
                "scaled_fp4_mm", f"M{m} N{n} K{k}", f"quantcore-{fmt}", nbytes,
                [lambda a=a, b=b, sa=sa, sb=sb, al=alpha, o=out, f=fmt: be.scaled_fp4_mm(
                    a, b, sa, sb, al, None, o, m=m, n=n, k=k, fmt=f)],
                eager=[lambda a=a, b=b, sa=sa, sb=sb, al=alpha, f=fmt: api_mx.scaled_fp4_mm(
                    a, b, sa, sb, al, fmt=f, backend=be)])
            if row.kernel_us:
                row.note = f"{flops / row.kernel_us / 1e6:.0f} TFLOPS" + (f"; {row.note}" if row.note else "")
            rows.append(row)
        if self.torch is not None and rows:
            t = self.torch
            a16, b16 = self.rand((m, k), "bfloat16"), self.rand((n, k), "bfloat16")
            row = self.measure("scaled_fp4_mm", f"M{m} N{n} K{k}", "torch-bf16", 2 * (m * k + n * k + m * n),
                               [lambda: t.matmul(a16, b16.t())])
            if row.kernel_us:
                row.note = f"{flops / row.kernel_us / 1e6:.0f} TFLOPS (cuBLAS)"
            rows.append(row)
            for q in rows[:-1]:  # group() compares only the impl named "quantcore"
                if q.kernel_us and row.kernel_us:
                    q.speedup["torch-bf16"] = row.kernel_us / q.kernel_us

    def linear_mx(self, bnk) -> None:
        """Weight-only MX (decode): x [B, K] bf16 @ W^T for an MXFP4 / NVFP4 weight [N, K] with swizzled
        scales; bytes = codes + scale bytes + activations + output. torch bf16 linear beside it."""
        from . import api_mx  # noqa: PLC0415
        from .formats import mx  # noqa: PLC0415

        b, n, k = bnk
        be = self.be
        trow = None
        if self.torch is not None:
            lin = self.torch.nn.functional.linear
            tbytes = 2 * n * k + 2 * b * k + 2 * b * n
            ta = self.rand((b, k), "bfloat16")
            wt = [self.rand((n, k), "bfloat16", 0.05) for _ in range(self.sets(tbytes))]
            trow = self.measure("linear_mx", f"B{b} N{n} K{k}", "torch-bf16", tbytes,
                                [lambda w=w: lin(ta, w) for w in wt], note="bf16 weight bytes")
            del wt
        for fmt in mx.FP4_FORMATS:
            blk = mx.block_size(fmt)
            if not be.supports("linear_mx", fmt, "bfloat16", blk):
                continue
            nbytes = n * k // 2 + n * (k // blk) + 2 * b * k + 2 * b * n
            a = self.rand((b, k), "bfloat16")
            kw = {"global_scale": float(mx.nvfp4_global_scale(0.25))} if fmt == "nvfp4" else {}
            ws = []
            for _ in range(self.sets(nbytes)):
                w = self.rand((n, k), "bfloat16", 0.05)
                ws.append(api_mx.quantize_mx(w, fmt, backend=be, **kw))
                del w
            g = be.from_numpy(np.array([kw["global_scale"]], np.float32), like=a) if kw else None
            out = be.empty((b, n), as_dtype("bfloat16"), like=a)
            row = self.measure(
                "linear_mx", f"B{b} N{n} K{k} {fmt}", "quantcore", nbytes,
                [lambda c=c, s=s, f=fmt, a=a, o=out, g=g: be.linear_mx(a, c, s, o, n=n, k=k, fmt=f, swizzled=True,
                                                                       global_scale=g) for c, s in ws],
                eager=[lambda c=c, s=s, f=fmt, a=a, kw=kw: api_mx.linear_mx(a, c, s, f, backend=be, **kw)
                       for c, s in ws])
            del ws
            self.group([row] + ([trow] if trow is not None else []))

    def run(self, ops: tuple[str, ...], sizes: dict[str, list] | None) -> None:
        table = sizes or (
            (QUICK_CUDA_SIZES if self.quick else CUDA_SIZES) if self.torch is not None
            else QUICK_HOST_SIZES if self.quick
            else CPU_SIZES if self.backend == "cpu" else HOST_SIZES)
        self.log(f"quantcore bench on {self.backend} ({self.device})")
        self.copy()
        for op in ops:
            for size in table.get(op, []):
                getattr(self, op)(tuple(size))
                if op == "dequantize_4bit" and tuple(size) == tuple(table[op][0]):
                    self.dequantize_4bit(tuple(size), "fp4")
                if self.torch is not None:
                    self.torch.cuda.empty_cache()

    # -- report --------------------------------------------------------------------------------------------
    def table(self) -> str:
        peers = sorted({p for r in self.rows for p in r.speedup})
        read = [["% read"], []] if self.read_gbps else [[], []]
        best = any(r.best_us is not None for r in self.rows)
        header = ["op", "shape", "impl", "kernel us"] + (["best us"] if best else []) + \
            ["eager us", "GB/s", "% copy"] + read[0] + [f"vs {p}" for p in peers]
        lines = []
        for r in self.rows:
            lines.append([r.op, r.shape, r.impl, _f(r.kernel_us, 1)] + ([_f(r.best_us, 1)] if best else []) +
                         [_f(r.eager_us, 1),
                          _f(r.gbps, 0 if (r.gbps or 0) >= 100 else 2),
                          _f(r.pct_copy, 1)] + ([_f(r.pct_read, 1)] if self.read_gbps else []) + [(_f(r.speedup[p], 2) + "x") if p in r.speedup else ""
                                                for p in peers] + ([r.note] if r.note else []))
        out = [f"quantcore {__version__} bench, backend {self.backend}, device: {self.device}",
               *table_lines(header, lines)]
        return "\n".join(out + self.notes)

    def as_dict(self) -> dict:
        versions = {"quantcore": __version__, "python": platform.python_version(), "numpy": np.__version__}
        if self.torch is not None:
            versions["torch"] = self.torch.__version__
        if self.ht is not None:
            versions["torch"] = self.ht.__version__
        if self.bnb is not None:
            versions["bitsandbytes"] = getattr(self.bnb, "__version__", "?")
        return {"backend": self.backend, "device": self.device, "copy_gbps": self.copy_gbps,
                "read_gbps": self.read_gbps,
                "versions": versions, "method": __doc__.split("\n\n")[2].replace("\n", " "),
                "rows": [asdict(r) for r in self.rows], "notes": self.notes}

    def plot(self, path: str) -> str:
        try:
            import matplotlib  # noqa: PLC0415

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt  # noqa: PLC0415
        except ImportError:
            return "matplotlib is not installed: no plot written (pip install matplotlib)"
        rows = [r for r in self.rows if r.gbps]
        labels = [f"{r.op} {r.shape} [{r.impl}]" for r in rows]
        vals = [r.pct_copy if r.pct_copy is not None else r.gbps for r in rows]
        colors = {"quantcore": "tab:blue", "bnb": "tab:orange", "torch-bf16": "tab:green"}
        fig, ax = plt.subplots(figsize=(11, 0.28 * len(rows) + 1.5))
        ax.barh(range(len(rows)), vals, color=[colors.get(r.impl, "tab:gray") for r in rows])
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels(labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("% of device copy bandwidth (counted bytes)" if self.copy_gbps else "GB/s")
        ax.set_title(f"quantcore bench: {self.backend} on {self.device}")
        ax.axvline(100.0, color="k", lw=0.5)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return f"plot written to {path}"


def _nested(state) -> Nested | None:
    if state.state2 is None:
        return None
    return Nested(absmax2=state.state2.absmax, code2=state.state2.code, offset=state.offset)


def table_lines(header: list[str], lines: list[list[str]]) -> list[str]:
    """A plain-text table: the header, a rule and one line per row, columns padded to the widest cell
    (cells past the header's columns, such as a note, are appended as they are)."""
    widths = [max(len(str(x[i])) for x in [header, *lines] if i < len(x)) for i in range(len(header))]
    fmt = lambda cells: "  ".join(str(c).ljust(widths[i]) if i < len(widths) else str(c)  # noqa: E731
                                  for i, c in enumerate(cells)).rstrip()
    return [fmt(header), fmt(["-" * w for w in widths]), *map(fmt, lines)]


def _f(v: float | None, nd: int) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def run(backend: str = "cuda", ops: tuple[str, ...] | list[str] = OPS, sizes: dict[str, list] | None = None,
        json_path: str | None = None, png_path: str | None = None, quick: bool = False,
        reps: int | None = None, verbose: bool = False) -> dict:
    """Run the benchmark in this process and return the report (``rows``, ``copy_gbps`` ...).

    ``ops``: any of :data:`OPS` (``dequantize_4bit``, ``quantize_4bit``, ``gemv_4bit``, ``gemm_w4a8``,
    ``linear_mx`` ...). ``sizes``: per op, a list of shapes ((rows, cols) for the 4-bit quantizers,
    (B, N, K) for gemv_4bit and linear_mx, (N, M, K) for gemm_w4a8) replacing the defaults. Prints
    the table.
    """
    b = Bench(backend, quick, reps, verbose)
    b.run(tuple(ops), sizes)
    print(b.table())
    report = b.as_dict()
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"JSON written to {json_path}")
    if png_path:
        print(b.plot(png_path))
    return report


def default_backend() -> str:
    """$QUANTCORE_BACKEND, else cuda where it is available, else cpu."""
    import os  # noqa: PLC0415

    from .registry import available_backends  # noqa: PLC0415

    env = os.environ.get("QUANTCORE_BACKEND")
    if env:
        return env
    return "cuda" if available_backends().get("cuda") and available_backends()["cuda"].ok else "cpu"


def main(argv: list[str] | None = None) -> int:
    """``quantcore bench [--backend NAME] [--quick] [--json PATH] [--png PATH] [--ops ...]``."""
    p = argparse.ArgumentParser(prog="quantcore bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default=None,
                   help="backend to measure (default: $QUANTCORE_BACKEND, else cuda where available, else cpu)")
    p.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    p.add_argument("--json", default="bench.json", help="JSON report path (default bench.json)")
    p.add_argument("--png", default="bench.png", help="plot path (default bench.png)")
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS), help="ops to measure")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per case")
    p.add_argument("-v", "--verbose", action="store_true", help="print each case as it is measured (the default)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines, only the table")
    p.add_argument("--e2e", action="store_true",
                   help="the end-to-end model benchmark instead (quantcore.bench_e2e; every other option goes "
                        "to it: quantcore bench --e2e --help)")
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--e2e" in argv:
        from . import bench_e2e  # noqa: PLC0415 - needs torch and transformers

        return bench_e2e.main([a for a in argv if a != "--e2e"])
    args = p.parse_args(argv)
    backend = args.backend or default_backend()
    print(f"quantcore bench: backend {backend}", flush=True)
    try:
        run(backend, args.ops, None, args.json, args.png, args.quick, args.reps, not args.quiet)
    except QuantcoreError as exc:
        print(f"quantcore bench: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
