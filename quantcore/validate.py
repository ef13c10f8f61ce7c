"""Shared argument validation: every backend rejects bad input here, the same way, before work."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .arrays import FLOAT_DTYPES, dtype_name, meta
from .errors import DTypeError, ParameterError, ShapeError
from .formats import bnb, ggml


def float_array(x: Any, what: str) -> tuple[tuple[int, ...], str]:
    """Shape and dtype name of a float input (fp32 / fp16 / bf16), non-empty."""
    shape, dt = meta(x)
    if dt not in FLOAT_DTYPES:
        raise DTypeError(f"{what} must be float32, float16 or bfloat16, got {dtype_name(dt)}")
    if math.prod(shape) == 0:
        raise ShapeError(f"{what} is empty (shape {shape}); quantization needs at least one element")
    return shape, dtype_name(dt)


def uint8_array(x: Any, what: str) -> tuple[int, ...]:
    shape, dt = meta(x)
    if dt != np.uint8:
        raise DTypeError(f"{what} must be uint8, got {dtype_name(dt)}")
    return shape


def out_dtype(d: Any) -> str:
    try:
        name = dtype_name(d)
    except TypeError as exc:
        raise DTypeError(str(exc)) from exc
    if name not in ("float32", "float16", "bfloat16"):
        raise DTypeError(f"output dtype must be float32, float16 or bfloat16, got {name}")
    return name


def choice(value: Any, allowed: Sequence[Any], what: str) -> Any:
    if value not in allowed:
        raise ParameterError(f"{what} must be one of {list(allowed)}, got {value!r}")
    return value


def quant_type(qt: Any) -> str:
    return choice(qt, bnb.QUANT_TYPES, "quant_type")


def blocksize_4bit(bs: Any) -> int:
    return choice(bs, bnb.BLOCKSIZES_4BIT, "blocksize (4-bit)")


def blocksize_8bit(bs: Any) -> int:
    return choice(bs, bnb.BLOCKSIZES_8BIT, "blocksize (8-bit)")


def ggml_rows(x: Any, what: str) -> tuple[int, int, str]:
    """A float [R, K] (or [K]) input for a ggml quantizer: K must be a multiple of 32."""
    shape, dt = float_array(x, what)
    if len(shape) not in (1, 2):
        raise ShapeError(f"{what} must be [K] or [rows, K], got shape {shape}")
    k = shape[-1]
    if k % ggml.QK:
        raise ShapeError(f"{what}: K = {k} is not a multiple of {ggml.QK} (the ggml block size)")
    return (shape[0] if len(shape) == 2 else 1), k, dt


def ggml_blocks(q: Any, rows: int, k: int, fmt: str, what: str) -> None:
    shape = uint8_array(q, what)
    expect = (rows, k // ggml.QK, ggml.BLOCK_BYTES[fmt])
    if shape != expect:
        raise ShapeError(f"{what} must have shape {expect} ({fmt} blocks of [{rows}, {k}]), got {shape}")


def mnk(m: Any, n: Any, k: Any) -> tuple[int, int, int]:
    for name, v in (("M", m), ("N", n), ("K", k)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
            raise ParameterError(f"{name} must be a positive integer, got {v!r}")
    if k % ggml.QK:
        raise ShapeError(f"K = {k} is not a multiple of {ggml.QK} (the ggml block size)")
    return int(m), int(n), int(k)


# -- MX family (NVFP4, MXFP4, MXFP8) ---------------------------------------------------------------
def mx_format(fmt: Any, allowed: Sequence[str] | None = None) -> str:
    from .formats import mx

    return choice(fmt, tuple(allowed) if allowed is not None else mx.MX_FORMATS, "fmt")


def scale_mode(mode: Any) -> str:
    from .formats import mx

    return choice(mode, mx.SCALE_MODES, "scale_mode")


def mx_input(x: Any, fmt: str, what: str = "x") -> tuple[tuple[int, ...], int, int, str]:
    """A float input [..., K] for an MX / NVFP4 quantizer: ``(shape, rows, K, dtype name)``;
    K must be a multiple of the format's block size."""
    from .formats import mx

    shape, dt = float_array(x, what)
    if len(shape) == 0:
        raise ShapeError(f"{what} must have at least one dimension, got a scalar")
    k = shape[-1]
    blk = mx.block_size(fmt)
    if k % blk:
        raise ShapeError(f"{what}: the last dimension K = {k} is not a multiple of {blk} "
                         f"(the {fmt} block size); pad K to a multiple of {blk}")
    return shape, math.prod(shape[:-1]) if len(shape) > 1 else 1, k, dt


def mx_codes(codes: Any, fmt: str, what: str = "codes") -> tuple[tuple[int, ...], int, int]:
    """Packed codes [..., K/2] (fp4) or [..., K] (mxfp8): ``(shape, rows, K)``."""
    from .formats import mx

    shape = uint8_array(codes, what)
    if len(shape) == 0 or math.prod(shape) == 0:
        raise ShapeError(f"{what} must be a non-empty array [..., K/2] or [..., K], got shape {shape}")
    per_byte = 2 if mx.element_format(fmt) == "e2m1" else 1
    k = shape[-1] * per_byte
    blk = mx.block_size(fmt)
    if k % blk:
        raise ShapeError(f"{what}: {shape[-1]} bytes per row hold K = {k} elements, not a multiple "
                         f"of the {fmt} block size {blk}")
    return shape, math.prod(shape[:-1]) if len(shape) > 1 else 1, k


def mx_scales(scales: Any, lead: tuple[int, ...], rows: int, ncols: int, swizzled: bool,
              what: str = "scales") -> None:
    """Scales of ``rows`` x ``ncols`` blocks: swizzled [ceil(rows/128)*128, ceil(ncols/4)*4], or
    row-major ``lead + (ncols,)`` / ``(rows, ncols)``."""
    from .formats import mx

    shape = uint8_array(scales, what)
    if swizzled:
        expect = mx.swizzled_shape(rows, ncols)
        if shape != expect:
            raise ShapeError(f"{what} (swizzled) must have shape {expect} for {rows} rows of "
                             f"{ncols} blocks, got {shape}; pass swizzled=False for row-major scales")
    elif shape not in (tuple(lead) + (ncols,), (rows, ncols)):
        raise ShapeError(f"{what} (row-major) must have shape {tuple(lead) + (ncols,)}, got {shape}; "
                         "pass swizzled=True for scales in the 128x4 tile layout")


def f32_scalar(v: Any, what: str, *, positive: bool = False) -> float | None:
    """A scalar parameter given as a number (returned as a float) or as a float32 array of one
    element (left on its device: returns None; its value is not read, so nothing synchronizes)."""
    if hasattr(v, "shape") and hasattr(v, "dtype"):
        shape, dt = meta(v)
        if dt != np.float32:
            raise DTypeError(f"{what} must be a float32 array of one element, got {dtype_name(dt)}")
        if math.prod(shape) != 1:
            raise ShapeError(f"{what} must hold exactly one element, got shape {shape}")
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise ParameterError(f"{what} must be a number or a float32 array of one element, got {v!r}")
    f = float(np.float32(v))
    if not np.isfinite(f) or (positive and f <= 0):
        raise ParameterError(f"{what} must be a finite{' positive' if positive else ''} number, got {v!r}")
    return f
