"""The public API of the MX family: NVFP4, MXFP4, MXFP8 and the swizzled scale layout.

Names follow LightX2V's interface (``scaled_nvfp4_quant``, ``scaled_mxfp4_quant``,
``cutlass_scaled_nvfp4_mm`` -> :func:`scaled_fp4_mm`); the exact rules are in
:mod:`quantcore.formats.mx`. As in :mod:`quantcore.api`, each function validates in the core,
allocates through the selected backend and calls one kernel-level op.

Codes and scales are returned as uint8 arrays (packed E2M1 nibbles, E4M3 bytes, E8M0 bytes);
:func:`as_torch_fp4`, :func:`as_torch_float8_e4m3` and :func:`as_torch_float8_e8m0` give
zero-copy views in torch's own dtypes, and every function here also accepts those dtypes (and
ml_dtypes' float8 arrays) wherever it takes codes or scales.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import validate as v
from .api import _backend
from .arrays import BF16, as_dtype, dtype_name, is_torch
from .backend import Backend
from .errors import DeviceError, DTypeError, ParameterError, ShapeError, UnsupportedError
from .formats import mx

F32 = np.dtype(np.float32)
U8 = np.dtype(np.uint8)

_BYTE_DTYPES = ("float8_e4m3fn", "float8_e8m0fnu", "float4_e2m1fn_x2")


def _as_bytes(x: Any) -> Any:
    """uint8 view of codes / scales given in a one-byte float dtype (torch or ml_dtypes)."""
    if not hasattr(x, "shape"):
        return x  # not an array: the validation names it
    name = str(getattr(x, "dtype", "")).rsplit(".", 1)[-1]
    if name not in _BYTE_DTYPES:
        return x
    if is_torch(x):
        return x.view(sys.modules["torch"].uint8)
    return x.view(np.uint8)


def _scalar(be: Backend, value: Any, host: float | None, like: Any) -> Any:
    """fp32 [1] native array of a scalar validated by ``v.f32_scalar`` (``host``: its value, or
    None for a one-element fp32 array, used as it is)."""
    if host is None:
        return be.prepare(value)
    return be.from_numpy(np.array([host], dtype=F32), like=like)


def _lead(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(shape[:-1])


# -- quantize ------------------------------------------------------------------------------------
def quantize_mx(
    x: Any, fmt: str, *, scale_mode: str = "floor", global_scale: Any = None, swizzle: bool = True,
    backend: str | Backend | None = None,
) -> tuple[Any, Any]:
    """Quantize ``x [..., K]`` (fp32 / fp16 / bf16, K a multiple of the block size) to ``fmt``.

    ``fmt``: "mxfp4" (E2M1, block 32, E8M0 scales), "mxfp8" (E4M3, block 32, E8M0) or "nvfp4"
    (E2M1, block 16, E4M3 scales, needs ``global_scale``). ``scale_mode`` ("floor" or "rceil")
    applies to MX only. Returns ``(codes, scales)``: codes uint8 ``[..., K/2]`` (fp4, element 2i
    in the low nibble) or ``[..., K]`` (mxfp8); scales uint8, swizzled
    ``[ceil(R/128)*128, ceil(K/blk/4)*4]`` with R = prod(leading dims) (padding zero) when
    ``swizzle``, else row-major ``[..., K/blk]``.
    """
    be = _backend(backend)
    fmt = v.mx_format(fmt)
    shape, rows, k, dt = v.mx_input(x, fmt)
    swizzle = v.flag(swizzle, "swizzle")
    mode = v.scale_mode(scale_mode)  # checked for every format; NVFP4's kernels take none
    if fmt == "nvfp4":
        if global_scale is None:
            raise ParameterError("nvfp4 needs global_scale (2688 / amax(x); see nvfp4_global_scale)")
        host_g = v.f32_scalar(global_scale, "global_scale", positive=True)
        mode = None
    elif global_scale is not None:
        raise ParameterError(f"{fmt} takes no global_scale (it is an NVFP4 parameter)")
    blk = mx.block_size(fmt)
    be.require("mx_quantize", fmt, dt, blk)
    xn = be.prepare(x)
    g = _scalar(be, global_scale, host_g, xn) if fmt == "nvfp4" else None
    codes = be.empty(_lead(shape) + (mx.codes_cols(fmt, k),), U8, like=xn)
    sshape = mx.swizzled_shape(rows, k // blk) if swizzle else _lead(shape) + (k // blk,)
    scales = be.empty(sshape, U8, like=xn)
    be.mx_quantize(xn, codes, scales, rows=rows, cols=k, fmt=fmt, scale_mode=mode,
                   swizzled=swizzle, global_scale=g)
    return be.finish(codes, x), be.finish(scales, x)


def scaled_nvfp4_quant(x: Any, global_scale: Any, *, swizzle: bool = True,
                       backend: str | Backend | None = None) -> tuple[Any, Any]:
    """NVFP4 (LightX2V's ``scaled_nvfp4_quant``): ``x [..., K]`` (K % 16 == 0) ->
    ``(codes uint8 [..., K/2], E4M3 scales uint8)``, swizzled by default.

    ``global_scale``: ``g = 2688 / amax(x)`` as a number or a float32 array of one element
    (kept on the device). Per block: ``s8 = e4m3(g * (amax_b * f32(1/6)))``,
    ``q = e2m1(x * f32(g * (1/s)))``.
    """
    return quantize_mx(x, "nvfp4", global_scale=global_scale, swizzle=swizzle, backend=backend)


def scaled_mxfp4_quant(x: Any, *, scale_mode: str = "floor", swizzle: bool = True,
                       backend: str | Backend | None = None) -> tuple[Any, Any]:
    """MXFP4: ``x [..., K]`` (K % 32 == 0) -> ``(codes uint8 [..., K/2], E8M0 scales uint8)``.

    ``scale_mode`` "floor" (OCP spec, torchao's default) or "rceil" (cuBLAS / LightX2V).
    """
    return quantize_mx(x, "mxfp4", scale_mode=scale_mode, swizzle=swizzle, backend=backend)


def scaled_mxfp8_quant(x: Any, *, scale_mode: str = "floor", swizzle: bool = True,
                       backend: str | Backend | None = None) -> tuple[Any, Any]:
    """MXFP8 (E4M3 elements): ``x [..., K]`` (K % 32 == 0) -> ``(codes uint8 [..., K],
    E8M0 scales uint8)``."""
    return quantize_mx(x, "mxfp8", scale_mode=scale_mode, swizzle=swizzle, backend=backend)


def nvfp4_global_scale(amax: float) -> np.float32:
    """``f32(2688 / amax)`` for a host number ``amax`` (the tensor's max |x|): a Python or numpy
    number, or a real array of one element.

    ``amax`` must be finite and > 0 (in float32), and ``2688 / amax`` a finite float32 (amax >=
    about 7.9e-36); anything else is a :class:`~quantcore.errors.ParameterError`. A tensor holding
    an Inf or a NaN, or only zeros, has no NVFP4 global scale (it would be 0, NaN or Inf and make
    every value non-finite): replace the non-finite values first, or pass a global scale of your
    choice to :func:`scaled_nvfp4_quant`. A global scale given to the quantize / dequantize
    functions as a number must likewise be finite and > 0; one given as a float32 array of one
    element is used as it is (its value is not read back from the device).
    """
    return mx.nvfp4_global_scale(amax)


# -- dequantize ----------------------------------------------------------------------------------
def dequantize_mx(
    codes: Any, scales: Any, fmt: str, out_dtype: Any = "float32", *, global_scale: Any = None,
    swizzled: bool = True, backend: str | Backend | None = None,
) -> Any:
    """Inverse of :func:`quantize_mx`: ``[..., K]`` in ``out_dtype`` (fp32 / fp16 / bf16).

    MX: ``elem(q) * 2^(b-127)``; NVFP4: ``(e2m1(q) * s) / g``; computed in fp32, rounded once to
    ``out_dtype``. ``swizzled`` says which scale layout ``scales`` has.
    """
    be = _backend(backend)
    fmt = v.mx_format(fmt)
    codes, scales = _as_bytes(codes), _as_bytes(scales)
    shape, rows, k = v.mx_codes(codes, fmt)
    blk = mx.block_size(fmt)
    swizzled = v.flag(swizzled, "swizzled")
    v.mx_scales(scales, _lead(shape), rows, k // blk, swizzled)
    if fmt == "nvfp4" and global_scale is None:
        raise ParameterError("nvfp4 needs the global_scale the codes were made with")
    if fmt != "nvfp4" and global_scale is not None:
        raise ParameterError(f"{fmt} takes no global_scale (it is an NVFP4 parameter)")
    host_g = v.f32_scalar(global_scale, "global_scale", positive=True) if fmt == "nvfp4" else None
    dt = v.out_dtype(out_dtype)
    be.require("mx_dequantize", fmt, dt, blk)
    cn = be.prepare(codes)
    g = _scalar(be, global_scale, host_g, cn) if fmt == "nvfp4" else None
    out = be.empty(_lead(shape) + (k,), as_dtype(dt), like=cn)
    be.mx_dequantize(cn, be.prepare(scales), out, rows=rows, cols=k, fmt=fmt,
                     swizzled=swizzled, global_scale=g)
    return be.finish(out, codes)


def dequantize_nvfp4(codes: Any, scales: Any, global_scale: Any, out_dtype: Any = "float32", *,
                     swizzled: bool = True, backend: str | Backend | None = None) -> Any:
    """NVFP4 codes [..., K/2] + E4M3 scales + global scale -> ``[..., K]``."""
    return dequantize_mx(codes, scales, "nvfp4", out_dtype, global_scale=global_scale,
                         swizzled=swizzled, backend=backend)


def dequantize_mxfp4(codes: Any, scales: Any, out_dtype: Any = "float32", *, swizzled: bool = True,
                     backend: str | Backend | None = None) -> Any:
    """MXFP4 codes [..., K/2] + E8M0 scales -> ``[..., K]``."""
    return dequantize_mx(codes, scales, "mxfp4", out_dtype, swizzled=swizzled, backend=backend)


def dequantize_mxfp8(codes: Any, scales: Any, out_dtype: Any = "float32", *, swizzled: bool = True,
                     backend: str | Backend | None = None) -> Any:
    """MXFP8 codes [..., K] (E4M3 bytes) + E8M0 scales -> ``[..., K]``."""
    return dequantize_mx(codes, scales, "mxfp8", out_dtype, swizzled=swizzled, backend=backend)


# -- scale layout ----------------------------------------------------------------------------------
def swizzle_scales(scales: Any, *, backend: str | Backend | None = None) -> Any:
    """Row-major scales uint8 ``[M, C]`` -> ``[ceil(M/128)*128, ceil(C/4)*4]`` in cuBLAS' 128x4
    tile layout (element (r, c) of a tile at ``(r%32)*16 + (r//32)*4 + c``), padding zero."""
    be = _backend(backend)
    scales = _as_bytes(scales)
    shape = v.uint8_array(scales, "scales")
    if len(shape) != 2 or 0 in shape:
        raise ShapeError(f"scales must be a non-empty 2-D array [M, C], got shape {shape}")
    be.require("swizzle_scales", "scales128x4", "uint8", mx.SWIZZLE_TILE_BYTES)
    sn = be.prepare(scales)
    out = be.empty(mx.swizzled_shape(*shape), U8, like=sn)
    be.swizzle_scales(sn, out, rows=shape[0], cols=shape[1])
    return be.finish(out, scales)


def unswizzle_scales(swz: Any, rows: int, cols: int, *, backend: str | Backend | None = None) -> Any:
    """Inverse of :func:`swizzle_scales`: the row-major ``[rows, cols]`` scales."""
    be = _backend(backend)
    swz = _as_bytes(swz)
    shape = v.uint8_array(swz, "swz")
    rows, cols = v.positive_int(rows, "rows"), v.positive_int(cols, "cols")
    expect = mx.swizzled_shape(rows, cols)
    if shape != expect:
        raise ShapeError(f"swz must have shape {expect} for [{rows}, {cols}] scales, got {shape}")
    be.require("unswizzle_scales", "scales128x4", "uint8", mx.SWIZZLE_TILE_BYTES)
    sn = be.prepare(swz)
    out = be.empty((rows, cols), U8, like=sn)
    be.unswizzle_scales(sn, out, rows=rows, cols=cols)
    return be.finish(out, swz)


# -- GEMM ----------------------------------------------------------------------------------------
def scaled_fp4_mm(
    a: Any, b: Any, scale_a: Any, scale_b: Any, alpha: Any = 1.0, bias: Any = None, *,
    fmt: str = "nvfp4", backend: str | Backend | None = None,
) -> Any:
    """``D = alpha * A @ B^T + bias`` on fp4 operands -> bfloat16 ``[M, N]``
    (LightX2V's ``cutlass_scaled_nvfp4_mm``).

    ``a`` uint8 [M, K/2], ``b`` uint8 [N, K/2] (packed E2M1); ``scale_a`` / ``scale_b`` their
    swizzled scales (E4M3 for "nvfp4", E8M0 for "mxfp4"), as :func:`scaled_nvfp4_quant` returns
    them; ``alpha`` a number or a float32 array of one element (for NVFP4 ``1 / (g_a * g_b)``);
    ``bias`` None or bfloat16 [N] / [1, N]. Accumulation in fp32 or better (tolerance tier).
    """
    be = _backend(backend)
    fmt = v.mx_format(fmt, mx.FP4_FORMATS)
    a, b, scale_a, scale_b = (_as_bytes(t) for t in (a, b, scale_a, scale_b))
    sa, sb = v.uint8_array(a, "a"), v.uint8_array(b, "b")
    if len(sa) != 2 or len(sb) != 2 or 0 in sa or 0 in sb:
        raise ShapeError(f"a and b must be non-empty 2-D [M, K/2] and [N, K/2], got {sa} and {sb}")
    if sa[1] != sb[1]:
        raise ShapeError(f"a holds K = {2 * sa[1]} per row, b holds K = {2 * sb[1]}; they must agree")
    m, n, k = sa[0], sb[0], 2 * sa[1]
    blk = mx.block_size(fmt)
    if k % blk:
        raise ShapeError(f"K = {k} is not a multiple of the {fmt} block size {blk}")
    v.mx_scales(scale_a, (m,), m, k // blk, True, "scale_a")
    v.mx_scales(scale_b, (n,), n, k // blk, True, "scale_b")
    host_alpha = v.f32_scalar(alpha, "alpha")
    if bias is not None:
        bshape, bdt = v.array(bias, "bias")
        if bdt != BF16:
            raise DTypeError(f"bias must be bfloat16 (the output dtype), got {dtype_name(bdt)}; convert it first")
        if bshape not in ((n,), (1, n)):
            raise ShapeError(f"bias must have shape ({n},) or (1, {n}), got {bshape}")
    be.require("scaled_fp4_mm", fmt, "bfloat16", blk)
    an = be.prepare(a)
    al = _scalar(be, alpha, host_alpha, an)
    out = be.empty((m, n), BF16, like=an)
    be.scaled_fp4_mm(an, be.prepare(b), be.prepare(scale_a), be.prepare(scale_b), al,
                     None if bias is None else be.prepare(bias), out, m=m, n=n, k=k, fmt=fmt)
    return be.finish(out, a)


# -- weight-only linear ------------------------------------------------------------------------
def linear_mx(
    x: Any, codes: Any, scales: Any, fmt: str, *, global_scale: Any = None, swizzled: bool = True,
    backend: str | Backend | None = None,
) -> Any:
    """``y = x @ W^T`` for an fp4 weight W [N, K] kept quantized (weight-only MXFP4 / NVFP4):
    ``x [..., K]`` (fp32 / fp16 / bf16) -> ``[..., N]`` in x's dtype.

    ``codes`` uint8 [N, K/2] and ``scales`` (swizzled, or row-major [N, K/blk] with
    ``swizzled=False``) as :func:`scaled_mxfp4_quant` / :func:`scaled_nvfp4_quant` return them
    for the weight; ``fmt`` "mxfp4" or "nvfp4"; ``global_scale`` the NVFP4 weight's global
    scale (a number or a float32 array of one element), None for MXFP4. Bias is left to the
    caller (``quantcore.torch.linear_fp4`` adds it).

    Semantics (tolerance tier, :func:`quantcore.formats.mx.linear_mx`): W dequantized to fp32 as
    :func:`dequantize_mx` does, ``f32(x) @ W^T`` accumulated in fp32 (any order), rounded once to
    x's dtype. The backends read the codes once for all rows of x (B = 1..16 is the decode case).
    """
    be = _backend(backend)
    swizzled = v.flag(swizzled, "swizzled")
    shape, dt, w = _linear_weight(be, x, codes, scales, fmt, global_scale, swizzled)
    rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    xn = be.prepare(x)
    out = be.empty((rows, w.n), as_dtype(dt), like=xn)
    if rows > 0:
        be.linear_mx(xn, be.prepare(w.codes), be.prepare(w.scales), out, n=w.n, k=w.k, fmt=w.fmt,
                     swizzled=swizzled, global_scale=w.global_scale(be, xn))
    return be.finish(out, x).reshape(_lead(shape) + (w.n,))


class _LinearWeight:
    """A weight of ``linear_mx`` checked by :func:`_linear_weight`: its byte views, format, N and K,
    and its global scale (NVFP4; a number or a one-element fp32 array, ``host_g`` its value where it
    was a number)."""

    def __init__(self, codes: Any, scales: Any, fmt: str, n: int, k: int, g: Any, host_g: float | None):
        self.codes, self.scales, self.fmt, self.n, self.k, self._g, self._host_g = codes, scales, fmt, n, k, g, host_g

    def global_scale(self, be: Backend, like: Any) -> Any:
        """The global scale as the kernels take it (fp32 [1] on ``like``'s device), None for MXFP4."""
        return _scalar(be, self._g, self._host_g, like) if self.fmt == "nvfp4" else None


def _linear_weight(be: Backend, x: Any, codes: Any, scales: Any, fmt: str, global_scale: Any,
                   swizzled: bool) -> tuple[tuple[int, ...], str, _LinearWeight]:
    """Check one weight of linear_mx / linear_mx_grouped against the input ``x`` (shapes, format,
    scale layout, global scale, the backend's capability) -> (x's shape, x's dtype name, the weight)."""
    fmt = v.mx_format(fmt, mx.FP4_FORMATS)
    codes, scales = _as_bytes(codes), _as_bytes(scales)
    shape, dt, n, k = v.mx_linear(x, codes, fmt)
    blk = mx.block_size(fmt)
    v.mx_scales(scales, (n,), n, k // blk, swizzled)
    if fmt == "nvfp4" and global_scale is None:
        raise ParameterError("nvfp4 needs the global_scale the weight's codes were made with")
    if fmt != "nvfp4" and global_scale is not None:
        raise ParameterError(f"{fmt} takes no global_scale (it is an NVFP4 parameter)")
    host_g = v.f32_scalar(global_scale, "global_scale", positive=True) if fmt == "nvfp4" else None
    be.require("linear_mx", fmt, dt, blk)
    return shape, dt, _LinearWeight(codes, scales, fmt, n, k, global_scale, host_g)


def linear_mx_grouped(
    x: Any, weights: Sequence[tuple], *, swizzled: bool = True, backend: str | Backend | None = None,
) -> Any:
    """Several fp4 weights that share one input (an attention layer's q / k / v, an MLP's gate / up)
    in one call: ``x [..., K]`` and ``weights`` [(codes_i, scales_i, fmt_i, global_scale_i)] (each as
    :func:`linear_mx` takes it; ``global_scale_i`` None for MXFP4; one scale layout, ``swizzled``, for
    all) -> ``[..., N_1 + N_2 + ...]`` in x's dtype, equal to the concatenation of
    ``linear_mx(x, codes_i, scales_i, fmt_i, global_scale=global_scale_i)`` along the last dimension
    (each block within linear_mx's tolerance). A backend that implements the grouped kernel-level op
    reads several weights in one launch (cuda: up to 4 of one format where its decode gemv runs); the
    others run linear_mx per weight and concatenate."""
    from .api import concat_last

    be = _backend(backend)
    swizzled = v.flag(swizzled, "swizzled")
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence) or len(weights) == 0:
        raise ParameterError("weights must be a non-empty sequence of (codes, scales, fmt, global_scale) tuples, "
                             f"got {v.describe(weights)}")
    checked = []
    for i, item in enumerate(weights):
        if not isinstance(item, (tuple, list)) or len(item) != 4:
            raise ParameterError(f"weights[{i}] must be a (codes, scales, fmt, global_scale) tuple, got "
                                 f"{v.describe(item)}")
        try:
            shape, dt, w = _linear_weight(be, x, *item, swizzled)
        except ShapeError as exc:
            raise ShapeError(f"weights[{i}]: {exc}") from None
        checked.append(w)
    if type(be).linear_mx_grouped is Backend.linear_mx_grouped:
        parts = [linear_mx(x, c, s, f, global_scale=g, swizzled=swizzled, backend=be) for c, s, f, g in weights]
        try:
            return concat_last(parts)
        except UnsupportedError:  # a backend's own array type: joined on the host
            host = np.concatenate([np.asarray(be.to_numpy(be.prepare(r))) for r in parts], axis=-1)
            return be.finish(be.from_numpy(host, like=be.prepare(x)), x)
    rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    ntot = sum(w.n for w in checked)
    xn = be.prepare(x)
    out = be.empty((rows, ntot), as_dtype(dt), like=xn)
    if rows > 0:
        groups = [(be.prepare(w.codes), be.prepare(w.scales), w.global_scale(be, xn), w.n, w.fmt, swizzled)
                  for w in checked]
        be.linear_mx_grouped(xn, groups, out, k=checked[0].k)
    return be.finish(out, x).reshape(_lead(shape) + (ntot,))


# -- torch dtype views -----------------------------------------------------------------------------
def _torch_view(x: Any, dtype_name: str) -> Any:
    try:
        import torch
    except ImportError as exc:
        raise UnsupportedError("torch dtype views need torch installed") from exc
    dtype = getattr(torch, dtype_name, None)
    if dtype is None:
        raise UnsupportedError(f"this torch ({torch.__version__}) has no torch.{dtype_name}")
    x = _as_bytes(x)
    if not is_torch(x):
        v.uint8_array(x, "the array to view")
        if not isinstance(x, (np.ndarray, np.generic)):
            raise DeviceError(f"torch dtype views take numpy arrays or torch tensors, got {type(x).__name__}; "
                              "wrap it as a torch tensor first (torch.from_dlpack)")
    t = x if is_torch(x) else torch.from_numpy(np.ascontiguousarray(x))
    if t.dtype != torch.uint8:
        raise DTypeError(f"expected uint8 bytes to view as torch.{dtype_name}, got {t.dtype}")
    return t.view(dtype)


def as_torch_fp4(codes: Any) -> Any:
    """Zero-copy ``torch.float4_e2m1fn_x2`` view of packed fp4 codes (uint8, 2 codes a byte;
    a numpy array is wrapped first). torch offers no arithmetic on this dtype."""
    return _torch_view(codes, "float4_e2m1fn_x2")


def as_torch_float8_e4m3(a: Any) -> Any:
    """Zero-copy ``torch.float8_e4m3fn`` view of E4M3 bytes (NVFP4 scales, MXFP8 codes)."""
    return _torch_view(a, "float8_e4m3fn")


def as_torch_float8_e8m0(scales: Any) -> Any:
    """Zero-copy ``torch.float8_e8m0fnu`` view of E8M0 scale bytes (MX scales)."""
    return _torch_view(scales, "float8_e8m0fnu")


def torch_has_mx_dtypes() -> bool:
    """True when the installed torch has all three dtypes (float4_e2m1fn_x2, e4m3fn, e8m0fnu)."""
    try:
        import torch
    except ImportError:
        return False
    return all(hasattr(torch, n) for n in _BYTE_DTYPES)


__all__ = [
    "as_torch_float8_e4m3", "as_torch_float8_e8m0", "as_torch_fp4", "dequantize_mx",
    "dequantize_mxfp4", "dequantize_mxfp8", "dequantize_nvfp4", "linear_mx", "nvfp4_global_scale",
    "quantize_mx", "scaled_fp4_mm", "scaled_mxfp4_quant", "scaled_mxfp8_quant",
    "scaled_nvfp4_quant", "swizzle_scales", "torch_has_mx_dtypes", "unswizzle_scales",
]
