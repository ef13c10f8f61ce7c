"""The backend protocol: what a backend declares and the kernel-level ops it implements.

A backend is found through the entry-point group ``quantcore.backends`` (the built-in ones
register there too). The public API (:mod:`quantcore.api`) validates every argument in the core,
allocates the outputs through the backend's ``empty`` and then calls one of the kernel-level ops
below with *native* arrays (the backend's own array type, contiguous, on its device) and plain
Python parameters. Kernel-level ops write into the outputs they are given and return nothing;
they never allocate. The conformance suite calls the same ops with poisoned, guarded outputs.

Shapes in the op docstrings below give the element counts; arrays arrive contiguous in the shape
the caller used (``x`` of any shape for ``quantize_4bit``, ``a`` as [K] or [B, K] for
``gemv_4bit``, ``packed`` as [(n+1)//2] or [(n+1)//2, 1], ggml blocks as [nb, bytes] or
[R, nb, bytes]), so kernels work on flat memory and take sizes from the keywords and outputs.

Every op a backend supports is listed by :meth:`Backend.capabilities`; the full list of what a
complete backend covers is :data:`quantcore.ops.ALL_CAPABILITIES`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import UnsupportedError


@dataclass(frozen=True)
class Capability:
    """One supported combination: op name, format, dtype of the float side, block size."""

    op: str
    fmt: str
    dtype: str
    blocksize: int

    def __str__(self) -> str:
        return f"{self.op}[{self.fmt},{self.dtype},{self.blocksize}]"


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str = ""
    mode: str = ""  #: e.g. "validated through the CUDA compatibility header"

    def __bool__(self) -> bool:
        return self.ok


@dataclass
class Nested:
    """Second-level state of double quantization, as native arrays of the backend.

    ``absmax[b] = code2[qabsmax[b]] * absmax2[b // 256] + offset[0]`` (two fp32 roundings).
    """

    absmax2: Any  #: fp32 [ceil(nblocks / 256)]
    code2: Any  #: fp32 [256]
    offset: Any  #: fp32 [1]


class _LaunchContext(threading.local):
    after_foreign = False


#: Per thread: ``after_foreign`` is True while the calls being made follow another library's GPU work in
#: the same stream (:class:`after_foreign_work` sets it; the torch layer runs its ops in it: in a model the
#: kernel before each of quantcore's is torch's). A backend may launch differently there: the cuda
#: backend launches no programmatic dependents (behind a kernel that never releases its dependents early
#: such a launch only costs time: ~1 us a launch, docs/performance.md "Session 27").
LAUNCH_CONTEXT = _LaunchContext()


class after_foreign_work:  # noqa: N801 - used as a context manager, like contextlib's
    """``with after_foreign_work(): ...``: :data:`LAUNCH_CONTEXT` ``.after_foreign`` is True inside (nestable,
    restored on exit, per thread)."""

    __slots__ = ("_prev",)

    def __enter__(self) -> None:
        self._prev = LAUNCH_CONTEXT.after_foreign
        LAUNCH_CONTEXT.after_foreign = True

    def __exit__(self, *exc: object) -> None:
        LAUNCH_CONTEXT.after_foreign = self._prev


def grouped_run_end(groups: Sequence[tuple], i: int, limit: int, fits: Callable[[tuple], bool] | None = None) -> int:
    """Where the run of weights that one grouped-gemv launch takes from ``groups[i]`` ends: at most
    ``limit`` weights, of group i's blocksize and quant type, each one ``fits`` accepts (``groups``
    as :meth:`Backend.gemv_4bit_grouped` takes them: (packed, absmax, nested, n, blocksize, quant_type))."""
    kind = groups[i][4:]
    j = i + 1
    while j < len(groups) and j - i < limit and groups[j][4:] == kind and (fits is None or fits(groups[j])):
        j += 1
    return j


def grouped_run_padded(groups: Sequence[tuple], i: int, j: int, limit: int) -> list[tuple]:
    """The run ``groups[i:j]`` (from :func:`grouped_run_end`) padded to ``limit`` weights with empty ones
    (no arrays, n = 0, the run's blocksize and quant type): a grouped launch's parameter list is fixed."""
    return list(groups[i:j]) + [(None, None, None, 0, *groups[i][4:])] * (limit - (j - i))


class Backend:
    """Base class. Subclasses set ``name`` and implement the adapters and the ops they declare.

    Array adapters (all arrays below are the backend's native arrays unless said otherwise):

    - ``prepare(x)``: the caller's array as a contiguous native array without a host/device copy;
      raises :class:`~quantcore.errors.DeviceError` for an array on the wrong side.
    - ``finish(native, like)``: a result in the caller's array kind (torch in, torch out).
    - ``empty(shape, dtype, like=None)``: an uninitialised output on ``like``'s device.
    - ``from_numpy(a, like=None)`` / ``to_numpy(x)``: explicit copies (tests, conformance).
    - ``view(buf, byte_offset, shape, dtype)``: a typed view into a 1-D uint8 native buffer.

    Optional planning hooks ``plan_<op>(*args, previous, **facts)`` (today
    ``plan_gemv_4bit(A, packed, state, *, previous, n, k)``): asked by the core after a validated
    call of the public op; returns a callable that gives the same call's result for arguments it
    recognises (None for any other), or None. See ``quantcore.api.EAGER_PLANS``.
    """

    name = "base"

    # -- discovery -------------------------------------------------------------------------
    def availability(self) -> Availability:
        return Availability(True)

    def devices(self) -> list[str]:
        return []

    def use_device(self, index: int) -> None:
        """Make device ``index`` (of :meth:`devices`) the one the calling thread's new arrays and
        launches go to (``quantcore quantize --devices``: threads per GPU). A backend with one
        device takes index 0 only."""
        if index != 0:
            raise UnsupportedError(f"backend {self.name!r} has no device {index} to select per thread")

    def capabilities(self) -> frozenset[Capability]:
        return frozenset()

    def supports(self, op: str, fmt: str, dtype: str, blocksize: int) -> bool:
        return Capability(op, fmt, dtype, blocksize) in self.capabilities()

    def require(self, op: str, fmt: str, dtype: str, blocksize: int) -> None:
        if not self.supports(op, fmt, dtype, blocksize):
            raise UnsupportedError(
                f"backend {self.name!r} does not support {op} for format {fmt}, dtype {dtype}, "
                f"blocksize {blocksize}; use quantcore.use_backend('cpu') for the reference"
            )

    # -- arrays ----------------------------------------------------------------------------
    def prepare(self, x: Any) -> Any:
        raise NotImplementedError

    def finish(self, native: Any, like: Any) -> Any:
        raise NotImplementedError

    def empty(self, shape: tuple[int, ...], dtype: np.dtype, like: Any = None) -> Any:
        raise NotImplementedError

    def from_numpy(self, a: np.ndarray, like: Any = None) -> Any:
        raise NotImplementedError

    def to_numpy(self, x: Any) -> np.ndarray:
        raise NotImplementedError

    def view(self, buf: Any, byte_offset: int, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for all work this backend queued (used by benchmarks and the suite)."""

    # -- kernel-level ops (outputs preallocated, arguments already validated) ----------------
    # bitsandbytes family
    def quantize_4bit(self, x, packed, absmax, *, blocksize: int, quant_type: str) -> None:
        """x [n] float -> packed uint8 [(n+1)//2], absmax fp32 [ceil(n/blocksize)]."""
        raise NotImplementedError

    def dequantize_4bit(
        self, packed, absmax, out, *, blocksize: int, quant_type: str, nested: Nested | None
    ) -> None:
        """packed uint8, absmax (fp32, or uint8 codes when ``nested``) -> out [n] float."""
        raise NotImplementedError

    def double_quantize(self, absmax, qabsmax, absmax2, offset) -> None:
        """absmax fp32 [nb] -> qabsmax uint8 [nb], absmax2 fp32 [ceil(nb/256)], offset fp32 [1]."""
        raise NotImplementedError

    def quantize_4bit_nested(self, x, packed, qabsmax, absmax2, offset, *, blocksize: int, quant_type: str) -> None:
        """quantize_4bit, then double_quantize of its absmax: x [n] float -> packed uint8 [(n+1)//2],
        qabsmax uint8 [nb], absmax2 fp32 [ceil(nb/256)], offset fp32 [1]. This default runs the two
        ops with the fp32 absmax in a temporary; a backend may fuse them (bit for bit the same)."""
        absmax = self.empty((qabsmax.shape[0],), np.dtype(np.float32), like=x)
        self.quantize_4bit(x, packed, absmax, blocksize=blocksize, quant_type=quant_type)
        self.double_quantize(absmax, qabsmax, absmax2, offset)

    def quantize_blockwise(self, x, thresholds, codes, absmax, *, blocksize: int) -> None:
        """x [n] float -> codes uint8 [n], absmax fp32 [nb]; thresholds fp32 [255]."""
        raise NotImplementedError

    def dequantize_blockwise(self, codes, absmax, code, out, *, blocksize: int) -> None:
        """codes uint8 [n], absmax fp32 [nb], code fp32 [256] -> out [n] float."""
        raise NotImplementedError

    def gemv_4bit(
        self, a, packed, absmax, out, *, n: int, k: int, blocksize: int, quant_type: str,
        nested: Nested | None,
    ) -> None:
        """a [B, K] float, weight [N, K] 4-bit -> out [B, N] in a's dtype (fp32 accumulation)."""
        raise NotImplementedError

    def gemv_4bit_grouped(self, a, groups, out, *, k: int) -> None:
        """Optional (``quantcore.gemv_4bit_grouped`` runs gemv_4bit per weight and concatenates
        where a backend leaves this out): a [B, K] float and ``groups`` [(packed, absmax, nested,
        n, blocksize, quant_type)] -> out [B, sum n] in a's dtype, group i's gemv_4bit in columns
        [n_0 + ... + n_{i-1}, + n_i)."""
        raise NotImplementedError

    # ggml family
    def quantize_q4_0(self, w, out) -> None:
        """w [R, K] float -> out uint8 [R, K/32, 18]."""
        raise NotImplementedError

    def quantize_q8_0(self, a, out) -> None:
        """a [R, K] float -> out uint8 [R, K/32, 34]."""
        raise NotImplementedError

    def quantize_q8_1(self, a, out) -> None:
        """a [R, K] float -> out uint8 [R, K/32, 36]."""
        raise NotImplementedError

    def dequantize_ggml(self, q, out, *, fmt: str) -> None:
        """q uint8 [R, K/32, bytes(fmt)] -> out [R, K] float."""
        raise NotImplementedError

    def gemm_q4_0_q8_1(self, wq, aq, out) -> None:
        """wq uint8 [M, K/32, 18], aq uint8 [N, K/32, 36] -> out fp32 [M, N]."""
        raise NotImplementedError

    def gemm_w4a8(self, wq, a, out) -> None:
        """wq uint8 [M, K/32, 18], a [N, K] float (quantized to Q8_1 inside) -> out fp32 [M, N]."""
        raise NotImplementedError

    # -- MX family (NVFP4, MXFP4, MXFP8) -------------------------------------------------------
    # Rules: quantcore.formats.mx (docs/formats-mx.md). Shapes come as keywords so a
    # backend can work on flat memory; ``x`` of any shape [..., K] is treated as [rows, cols].
    # Scale matrices are uint8 (E8M0 bytes for mxfp4 / mxfp8, E4M3 bytes for nvfp4), either
    # row-major [rows, cols/blk] or swizzled: [ceil(rows/128)*128, ceil(cols/blk/4)*4] in 128x4
    # tiles (quantcore.formats.mx.swizzle), the padding written as zeros. Scalars that a kernel
    # reads (the NVFP4 global scale, the GEMM's alpha) are fp32 [1] native arrays, so no call
    # has to synchronize to read them on the host.
    def mx_quantize(
        self, x, codes, scales, *, rows: int, cols: int, fmt: str, scale_mode: str | None,
        swizzled: bool, global_scale=None,
    ) -> None:
        """x [rows, cols] float -> codes uint8 [rows, cols/2] (fp4, element 2i in the low nibble)
        or [rows, cols] (mxfp8, E4M3 bytes); scales row-major or swizzled (see above).

        ``fmt`` "mxfp4" | "mxfp8" | "nvfp4"; ``scale_mode`` "floor" | "rceil" for MX, None for
        nvfp4; ``global_scale`` fp32 [1] for nvfp4, None for MX.
        """
        raise NotImplementedError

    def mx_dequantize(
        self, codes, scales, out, *, rows: int, cols: int, fmt: str, swizzled: bool,
        global_scale=None,
    ) -> None:
        """Inverse of :meth:`mx_quantize`: codes + scales (+ global_scale for nvfp4) -> out
        [rows, cols] float (fp32 / fp16 / bf16), computed in fp32 then rounded once."""
        raise NotImplementedError

    def swizzle_scales(self, scales, out, *, rows: int, cols: int) -> None:
        """scales uint8 [rows, cols] -> out uint8 [ceil(rows/128)*128, ceil(cols/4)*4] swizzled,
        padding zeroed."""
        raise NotImplementedError

    def unswizzle_scales(self, swz, out, *, rows: int, cols: int) -> None:
        """swz uint8 [ceil(rows/128)*128, ceil(cols/4)*4] -> out uint8 [rows, cols] row-major."""
        raise NotImplementedError

    def scaled_fp4_mm(
        self, a, b, scale_a, scale_b, alpha, bias, out, *, m: int, n: int, k: int, fmt: str
    ) -> None:
        """``out = bf16(alpha * A @ B^T + bias)``: a uint8 [m, k/2], b uint8 [n, k/2] (packed
        E2M1), scale_a / scale_b swizzled ([ceil(m/128)*128, ...] / [ceil(n/128)*128, ...]),
        alpha fp32 [1], bias bf16 [n] or None, out bf16 [m, n]. ``fmt`` "nvfp4" | "mxfp4"; the
        NVFP4 global scales are folded into alpha by the caller. Tolerance tier (fp32
        accumulation of the exactly dequantized operands)."""
        raise NotImplementedError

    def linear_mx(
        self, x, codes, scales, out, *, n: int, k: int, fmt: str, swizzled: bool, global_scale=None
    ) -> None:
        """Weight-only fp4 linear: x [B, K] float, codes uint8 [n, k/2] (packed E2M1), scales
        row-major [n, k/blk] or swizzled, global_scale fp32 [1] (nvfp4) or None -> out [B, n] in
        x's dtype: ``out = T(f32(x) @ W^T)`` with W dequantized as :meth:`mx_dequantize` does
        (fp32), fp32 accumulation. ``fmt`` "mxfp4" | "nvfp4". Tolerance tier."""
        raise NotImplementedError

    def linear_mx_grouped(self, x, groups, out, *, k: int) -> None:
        """Optional (``quantcore.linear_mx_grouped`` runs linear_mx per weight and concatenates where
        a backend leaves this out): x [B, K] float and ``groups`` [(codes, scales, global_scale, n,
        fmt, swizzled)] -> out [B, sum n] in x's dtype, group i's linear_mx in columns
        [n_0 + ... + n_{i-1}, + n_i). (The tuple ends with what one launch's weights share, as
        :func:`grouped_run_end` reads it.)"""
        raise NotImplementedError
