"""The catalogue of ops: every (op, format, dtype, blocksize) a complete backend covers.

Declared once here (as bitsandbytes' ``_ops.py`` declares its ops); backends declare the subset
they support through :meth:`quantcore.backend.Backend.capabilities`, and the conformance suite
reports coverage against :data:`ALL_CAPABILITIES`.
"""

from __future__ import annotations

from itertools import product

from .backend import Capability
from .formats import bnb, ggml

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
BNB_4BIT_FORMATS = bnb.QUANT_TYPES
GGML_FORMATS = ("q4_0", "q8_0", "q8_1")


def bnb_capabilities() -> list[Capability]:
    caps: list[Capability] = []
    for op in ("quantize_4bit", "dequantize_4bit", "gemv_4bit"):
        for fmt, dt, bs in product(BNB_4BIT_FORMATS, FLOAT_DTYPES, bnb.BLOCKSIZES_4BIT):
            caps.append(Capability(op, fmt, dt, bs))
    for op in ("quantize_blockwise", "dequantize_blockwise"):
        for dt, bs in product(FLOAT_DTYPES, bnb.BLOCKSIZES_8BIT):
            caps.append(Capability(op, "dynamic8", dt, bs))
    caps.append(Capability("double_quantize", "dynamic8", "float32", bnb.NESTED_BLOCKSIZE))
    return caps


def ggml_capabilities() -> list[Capability]:
    caps: list[Capability] = []
    for fmt, dt in product(GGML_FORMATS, FLOAT_DTYPES):
        caps.append(Capability(f"quantize_{fmt}", fmt, dt, ggml.QK))
        caps.append(Capability("dequantize_ggml", fmt, dt, ggml.QK))
    caps.append(Capability("gemm_q4_0_q8_1", "q4_0", "float32", ggml.QK))
    for dt in FLOAT_DTYPES:
        caps.append(Capability("gemm_w4a8", "q4_0", dt, ggml.QK))
    return caps


def mx_capabilities() -> list[Capability]:
    try:
        from .formats import mx
    except ImportError:
        return []
    return list(mx.capabilities()) if hasattr(mx, "capabilities") else []


ALL_CAPABILITIES: frozenset[Capability] = frozenset(
    bnb_capabilities() + ggml_capabilities() + mx_capabilities()
)
