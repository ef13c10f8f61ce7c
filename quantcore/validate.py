"""Shared argument validation: every backend rejects bad input here, the same way, before work.

Every public entry point of :mod:`quantcore.api` and :mod:`quantcore.api_mx` runs its arguments
through these checks before it allocates anything or calls a backend, so an invalid input raises
the same :class:`~quantcore.errors.QuantcoreError` subclass with the same message on every backend:

- arrays: anything without ``shape`` / ``dtype`` (a list, a float, None ...), a dtype quantcore
  does not know (torch complex64 / uint16 / float8_e5m2 ...), a sparse or nested torch tensor, a
  non-native byte order -> :class:`DTypeError`; an empty array where the op needs data ->
  :class:`ShapeError`;
- integer parameters (blocksize, M / N / K, rows / cols): a Python ``int`` or a numpy integer
  scalar, converted to ``int`` here so backends never see numpy scalars; a float (``64.0``), a
  bool, a string ... -> :class:`ParameterError`;
- string choices (quant_type, fmt, scale_mode) must be strings; flags (compress_statistics,
  swizzle) bools (numpy bools and the integers 0 / 1 too);
- float parameters (global_scale, alpha): a Python or numpy number (checked for finiteness, and
  positivity where asked) or a float32 array of one element (left on its device, its value not
  read: nothing synchronizes).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from .arrays import FLOAT_DTYPES, as_dtype, dtype_name, is_torch
from .errors import DTypeError, ParameterError, ShapeError
from .formats import bnb, ggml

_ARRAY_KINDS = "a numpy array, a torch tensor, a CuPy array or a SYCL USM array"


def describe(x: Any) -> str:
    """A short description of a rejected argument (its type, and its value when small), the same
    for an array of any kind (numpy, torch, CuPy, USM: shape and dtype, not the kind), so that
    every backend gives the same message."""
    if x is None or isinstance(x, (bool, int, float, complex, np.generic)):
        return f"{type(x).__name__} {x!r}"
    if isinstance(x, str):
        return f"str {x[:40]!r}"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        try:
            return f"an array of shape {tuple(int(d) for d in x.shape)} and dtype {dtype_name(x.dtype)}"
        except (TypeError, ValueError):
            pass
    return type(x).__name__



def array(x: Any, what: str) -> tuple[tuple[int, ...], np.dtype]:
    """``(shape, numpy dtype)`` of an array argument, without moving it.

    DTypeError for anything that is not an array quantcore can read: no ``shape`` / ``dtype``
    (lists, numbers, None), a dtype quantcore has no name for, a sparse / nested torch tensor,
    a non-native byte order."""
    if isinstance(x, np.ndarray):
        dt = x.dtype
        if not dt.isnative:
            raise DTypeError(f"{what} has the non-native byte order {dt.str!r}; convert it first "
                             f"({what}.astype({what}.dtype.newbyteorder('=')))")
        return x.shape, dt
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise DTypeError(f"{what} must be an array ({_ARRAY_KINDS}), got {describe(x)}; "
                         f"wrap data in numpy.asarray(...) or torch.tensor(...) first")
    if is_torch(x):
        torch = sys.modules["torch"]
        if x.layout != torch.strided or getattr(x, "is_nested", False):
            layout = "nested" if getattr(x, "is_nested", False) else str(x.layout)
            raise DTypeError(f"{what} is a torch tensor with layout {layout}; quantcore takes dense "
                             f"(strided) tensors: pass {what}.to_dense() (or a padded tensor)")
    try:
        shape = tuple(int(s) for s in x.shape)
    except (TypeError, ValueError) as exc:
        raise DTypeError(f"{what} has no integer shape ({type(x).__name__}.shape = {x.shape!r})") from exc
    try:
        dt = as_dtype(x.dtype)
    except (TypeError, ValueError) as exc:
        raise DTypeError(f"{what} has dtype {x.dtype}, which quantcore does not take (see the "
                         "function's documentation for the dtypes it accepts)") from exc
    return shape, dt


def float_array(x: Any, what: str) -> tuple[tuple[int, ...], str]:
    """Shape and dtype name of a float input (fp32 / fp16 / bf16), non-empty."""
    shape, dt = array(x, what)
    if dt not in FLOAT_DTYPES:
        raise DTypeError(f"{what} must be float32, float16 or bfloat16, got {dtype_name(dt)}")
    if math.prod(shape) == 0:
        raise ShapeError(f"{what} is empty (shape {shape}); quantization needs at least one element")
    return shape, dtype_name(dt)


def uint8_array(x: Any, what: str, *, nonempty: bool = False) -> tuple[int, ...]:
    """Shape of a uint8 input; with ``nonempty`` an array of no elements is a ShapeError."""
    shape, dt = array(x, what)
    if dt != np.uint8:
        raise DTypeError(f"{what} must be uint8, got {dtype_name(dt)}")
    if nonempty and math.prod(shape) == 0:
        raise ShapeError(f"{what} is empty (shape {shape}); there is nothing to decode")
    return shape


def out_dtype(d: Any) -> str:
    """Name of an output dtype given as a name, a numpy / ml_dtypes dtype or a torch dtype."""
    if d is None:
        raise DTypeError("output dtype must be float32, float16 or bfloat16, got None")
    try:
        name = dtype_name(d)
    except (TypeError, ValueError) as exc:
        raise DTypeError(f"output dtype must be float32, float16 or bfloat16, got {describe(d)} "
                         f"({exc})") from exc
    if name not in ("float32", "float16", "bfloat16"):
        raise DTypeError(f"output dtype must be float32, float16 or bfloat16, got {name}")
    return name


def integer(value: Any, what: str) -> int:
    """A Python int or a numpy integer scalar, as an ``int``; anything else (a float such as
    64.0, a bool, a string, an array) is a ParameterError."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return int(value)
    raise ParameterError(f"{what} must be an integer (int or numpy integer), got {describe(value)}")


def positive_int(value: Any, what: str) -> int:
    n = integer(value, what)
    if n <= 0:
        raise ParameterError(f"{what} must be a positive integer, got {n}")
    return n


def flag(value: Any, what: str) -> bool:
    """A bool (numpy bools and the integers 0 / 1 too), as a ``bool``."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    raise ParameterError(f"{what} must be True or False, got {describe(value)}")


def choice(value: Any, allowed: Sequence[Any], what: str) -> Any:
    """``value`` if it is one of ``allowed`` (strings: a ``str``; integers: see :func:`integer`),
    as the plain Python value."""
    if allowed and isinstance(allowed[0], str):
        ok = isinstance(value, str) and value in allowed
        value = str(value) if ok else value
    else:
        if not (isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))):
            raise ParameterError(f"{what} must be one of {list(allowed)} (an integer), got {describe(value)}")
        value = int(value)
        ok = value in allowed
    if not ok:
        raise ParameterError(f"{what} must be one of {list(allowed)}, got {describe(value)}")
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
    m, n, k = positive_int(m, "M"), positive_int(n, "N"), positive_int(k, "K")
    if k % ggml.QK:
        raise ShapeError(f"K = {k} is not a multiple of {ggml.QK} (the ggml block size)")
    return m, n, k


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


def mx_linear(x: Any, codes: Any, fmt: str) -> tuple[tuple[int, ...], str, int, int]:
    """The operands of ``linear_mx``: a float input ``x [..., K]`` and packed fp4 codes
    ``[N, K/2]`` of one of the FP4 formats -> ``(x's shape, x's dtype name, N, K)``. K must be a
    multiple of the format's block size and agree between the two."""
    from .formats import mx

    shape, dt = float_array(x, "x")
    cshape = uint8_array(codes, "codes")
    if len(cshape) != 2 or 0 in cshape:
        raise ShapeError(f"codes must be a non-empty 2-D array [N, K/2] (the weight's packed fp4 codes), "
                         f"got shape {cshape}")
    n, k = cshape[0], 2 * cshape[1]
    blk = mx.block_size(fmt)
    if k % blk:
        raise ShapeError(f"codes: {cshape[1]} bytes per row hold K = {k} elements, not a multiple of the "
                         f"{fmt} block size {blk}")
    if len(shape) == 0 or shape[-1] != k:
        raise ShapeError(f"x must have shape [..., K] with K = {k} (the weight's), got shape {shape}")
    return shape, dt, n, k


def f32_scalar(v: Any, what: str, *, positive: bool = False) -> float | None:
    """A scalar parameter given as a number (returned as a float) or as a float32 array of one
    element (left on its device: returns None; its value is not read, so nothing synchronizes).

    Python numbers and numpy scalars (``np.float32(x)``, ``np.int64(x)``) are treated alike: the
    value, rounded to fp32, must be finite (and > 0 with ``positive``)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        if isinstance(v, np.generic) or not (hasattr(v, "shape") and hasattr(v, "dtype")):
            raise ParameterError(f"{what} must be a number or a float32 array of one element, "
                                 f"got {describe(v)}")
        shape, dt = array(v, what)
        if dt != np.float32:
            raise DTypeError(f"{what} must be a float32 array of one element, got {dtype_name(dt)}")
        if math.prod(shape) != 1:
            raise ShapeError(f"{what} must hold exactly one element, got shape {shape}")
        return None
    try:
        with np.errstate(over="ignore"):
            f = float(np.float32(v))
    except OverflowError:  # a Python int beyond any float
        f = math.inf
    if not np.isfinite(f) or (positive and f <= 0):
        raise ParameterError(f"{what} must be a finite{' positive' if positive else ''} number "
                             f"(after rounding to float32), got {describe(v)}")
    return f
