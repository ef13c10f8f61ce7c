"""Shared argument validation: every backend rejects bad input here, the same way, before work."""

from __future__ import annotations

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
    if int(np.prod(shape)) == 0:
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
