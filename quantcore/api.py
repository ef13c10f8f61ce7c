"""The public API. Each function validates every argument in the core (:mod:`quantcore.validate`:
the same exception type and message on every backend, before any allocation or launch),
allocates outputs through the selected backend and calls one kernel-level op (see
:mod:`quantcore.backend`) with plain Python parameters. Results come back as the caller's array
kind on the caller's device.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import validate as v
from .arrays import array_kind, as_dtype, device_of, meta
from .backend import Backend, Nested
from .errors import ParameterError, ShapeError, StateError, UnsupportedError
from .formats import bnb, ggml
from .registry import get_backend
from .state import QuantState

F32 = np.dtype(np.float32)
U8 = np.dtype(np.uint8)


def _backend(backend: str | Backend | None) -> Backend:
    if isinstance(backend, Backend):
        return backend
    if backend is not None and not isinstance(backend, str):
        raise ParameterError(f"backend must be a backend name (str), a quantcore.Backend or None, "
                             f"got {type(backend).__name__}")
    return get_backend(backend)


#: Eager launch plans for gemv_4bit and dequantize_4bit (on by default; QUANTCORE_EAGER_PLANS=0 at
#: import, or setting this to False, turns them off). After a call has been validated and run, a
#: backend with a ``plan_<op>`` method may return a plan: a callable ``plan(*args)`` that gives the
#: result of the same call for arguments it recognises and None for anything else. It is kept on
#: the QuantState
#: (``state._plans``: dropped when a field of the state is assigned, never copied or pickled), so
#: a repeated call with the same state and input geometry skips the validation and the launch
#: set-up. The plan must recognise only arguments for which the core's checks, the backend's
#: adapters and its kernel choice would all come out the same (geometry, dtypes, strides,
#: devices, the state's arrays' pointers and shapes, the backend's tuning), so errors and
#: results are those of the full path.
EAGER_PLANS = os.environ.get("QUANTCORE_EAGER_PLANS", "1") != "0"


def _planned(op: str, be: Backend, state: Any, args: tuple) -> Any:
    """The result of a plan cached on ``state`` for ``op`` on ``be``, or None (not planned)."""
    plans = getattr(state, "_plans", None)
    if plans is None:
        return None
    entry = plans.get(op)
    if entry is None or entry[0] is not be:
        return None
    return entry[1](*args)


def _keep_plan(op: str, be: Backend, state: Any, args: tuple, **facts: Any) -> None:
    """Ask ``be`` for a plan of the call just made (validated, run) and keep it on ``state``.

    ``plan_<op>(*args, previous=, **facts)`` gets the caller's arguments, the plan kept so far
    for this op (which it may extend with another input geometry and return) and the facts the
    core derived; it returns a plan or None."""
    planner = getattr(be, "plan_" + op, None)
    if planner is None or type(state) is not QuantState:  # subclasses may validate differently
        return
    plans = state._plans
    entry = plans.get(op) if plans else None
    plan = planner(*args, previous=entry[1] if entry is not None and entry[0] is be else None, **facts)
    if plan is None:
        return
    if plans is None:
        plans = state._plans = {}
    plans[op] = (be, plan)


_CONSTANTS: dict[tuple, Any] = {}


def _const(be: Backend, name: str, values: np.ndarray, like: Any) -> Any:
    """A constant table (code map, thresholds) on ``like``'s device in the caller's array kind.

    Made once per (backend, array kind, device) and reused: a host-to-device copy on every call
    would synchronize and could not be captured in a CUDA graph. Treat the tables as read-only.
    """
    key = (be.name, id(be), array_kind(like), device_of(like), name)
    table = _CONSTANTS.get(key)
    if table is None:
        table = be.finish(be.from_numpy(np.ascontiguousarray(values), like=be.prepare(like)), like)
        if isinstance(table, np.ndarray):
            table.flags.writeable = False  # shared by every state made here
        _CONSTANTS[key] = table
    return table


# -- bitsandbytes 4-bit ------------------------------------------------------------------------
def _format_4bit(fmt: Any, quant_type: Any) -> str:
    """The 4-bit format given as ``fmt`` or as its bitsandbytes name ``quant_type`` (one of them)."""
    if quant_type is not None:
        if fmt not in ("nf4", quant_type):  # fmt left at its default, or the same value twice
            raise ParameterError(f"the 4-bit format is given twice (fmt={fmt!r}, quant_type={quant_type!r}); "
                                 "quant_type is bitsandbytes' name for fmt: pass one of them")
        fmt = quant_type
    return v.choice(fmt, bnb.QUANT_TYPES, "fmt")


def quantize_4bit(
    x: Any, blocksize: int = 64, fmt: str = "nf4", compress_statistics: bool = True,
    *, quant_type: str | None = None, backend: str | Backend | None = None,
) -> tuple[Any, QuantState]:
    """bitsandbytes 4-bit quantization of ``x`` (any shape, fp32 / fp16 / bf16).

    ``fmt``: "nf4" or "fp4" (``quant_type=`` is accepted as bitsandbytes' name for it). Returns
    ``(packed uint8 [(n+1)//2, 1], QuantState)``. With ``compress_statistics`` the fp32 absmax is
    itself quantized to 8 bits in blocks of 256 (double quantization). Note the defaults follow
    ``bnb.nn.Linear4bit`` (nf4, double quantization), not ``bnb.functional``.
    """
    be = _backend(backend)
    shape, dt = v.float_array(x, "x")
    quant_type = _format_4bit(fmt, quant_type)  # the state keeps bitsandbytes' field name
    blocksize = v.blocksize_4bit(blocksize)
    compress_statistics = v.flag(compress_statistics, "compress_statistics")
    be.require("quantize_4bit", quant_type, dt, blocksize)
    xn = be.prepare(x)
    n = math.prod(shape)
    nb = bnb.nblocks(n, blocksize)
    packed = be.empty(((n + 1) // 2, 1), U8, like=xn)
    state = QuantState(absmax=None, shape=shape, code=_const(be, quant_type, bnb.code_4bit(quant_type), x),
                       blocksize=blocksize, quant_type=quant_type, dtype=dt)
    if compress_statistics:
        be.require("double_quantize", "dynamic8", "float32", bnb.NESTED_BLOCKSIZE)
        qabsmax = be.empty((nb,), U8, like=xn)
        absmax2 = be.empty((bnb.nblocks(nb, bnb.NESTED_BLOCKSIZE),), F32, like=xn)
        offset = be.empty((1,), F32, like=xn)
        be.quantize_4bit_nested(xn, packed, qabsmax, absmax2, offset, blocksize=blocksize, quant_type=quant_type)
        state.absmax = be.finish(qabsmax, x)
        state.offset = be.finish(offset, x)
        state.state2 = QuantState(absmax=be.finish(absmax2, x), code=_const(be, "dynamic_map", bnb.DYNAMIC_MAP, x),
                                  blocksize=bnb.NESTED_BLOCKSIZE, dtype="float32")
    else:
        absmax = be.empty((nb,), F32, like=xn)
        be.quantize_4bit(xn, packed, absmax, blocksize=blocksize, quant_type=quant_type)
        state.absmax = be.finish(absmax, x)
    return be.finish(packed, x), state


def _check_state(state: Any) -> QuantState:
    """``state.validate()``: every field (a nested state's offset a float32 array of one element
    included), the code table against quant_type."""
    if not isinstance(state, QuantState):
        raise StateError(f"expected a quantcore.QuantState, got {type(state).__name__}")
    state.validate()
    return state


def _geometry(state: QuantState) -> tuple[tuple[int, ...], int]:
    """The validated state's shape and blocksize (validate() made them plain ints: backends never
    see numpy scalars)."""
    return state.shape, state.blocksize


def _check_packed(packed: Any, state: QuantState) -> None:
    _check_state(state)
    if state.quant_type is None:
        raise StateError("this state has no 4-bit quant_type (is it an 8-bit blockwise state?)")
    shape = v.uint8_array(packed, "packed", nonempty=True)
    if math.prod(shape) != (state.n + 1) // 2:
        raise ShapeError(f"packed holds {math.prod(shape)} bytes; the state describes {state.n} "
                         f"elements, which pack into {(state.n + 1) // 2}")


def _nested(be: Backend, state: QuantState) -> Nested | None:
    if not state.nested:
        return None
    return Nested(absmax2=be.prepare(state.state2.absmax), code2=be.prepare(state.state2.code),
                  offset=be.prepare(state.offset))


def dequantize_4bit(
    packed: Any, state: QuantState, out_dtype: Any = None, *, backend: str | Backend | None = None
) -> Any:
    """Inverse of :func:`quantize_4bit`: an array of ``state.shape`` in ``out_dtype`` (default the
    original dtype). ``out = T(code[q] * absmax)``; nested statistics are decoded in the same op."""
    be = _backend(backend)
    if EAGER_PLANS:
        res = _planned("dequantize_4bit", be, state, (packed, state, out_dtype))
        if res is not None:
            return res
    _check_packed(packed, state)
    dt = v.out_dtype(out_dtype if out_dtype is not None else state.dtype)
    shape, blocksize = _geometry(state)
    be.require("dequantize_4bit", state.quant_type, dt, blocksize)
    pn = be.prepare(packed)
    out = be.empty(shape, as_dtype(dt), like=pn)
    be.dequantize_4bit(pn, be.prepare(state.absmax), out, blocksize=blocksize,
                       quant_type=state.quant_type, nested=_nested(be, state))
    res = be.finish(out, packed)
    if EAGER_PLANS:
        _keep_plan("dequantize_4bit", be, state, (packed, state, out_dtype), dtype=dt)
    return res


def gemv_4bit(A: Any, packed: Any, state: QuantState, *, backend: str | Backend | None = None) -> Any:
    """``A @ W.T`` for a 4-bit weight W of shape [N, K]: A [..., K] -> [..., N] in A's dtype.

    fp32 accumulation. B, the number of rows of A (its leading dimensions flattened: the tokens),
    may be any: bitsandbytes takes one token; the backends read the weight once for B up to 8
    (cuda's decode kernel on sm_90: 16).
    """
    be = _backend(backend)
    if EAGER_PLANS:
        res = _planned("gemv_4bit", be, state, (A, packed, state))
        if res is not None:
            return res
    _check_packed(packed, state)
    wshape, blocksize = _geometry(state)
    if len(wshape) != 2:
        raise ShapeError(f"gemv_4bit needs a 2-D weight state [N, K], got shape {wshape}")
    n, k = wshape
    shape, dt = v.float_array(A, "A")
    if len(shape) == 0 or shape[-1] != k:
        raise ShapeError(f"A must have shape [..., K] with K = {k} (the weight's), got shape {shape}")
    be.require("gemv_4bit", state.quant_type, dt, blocksize)
    B = math.prod(shape[:-1]) if len(shape) > 1 else 1  # noqa: N806 - the row count's name everywhere
    an = be.prepare(A)
    pn = be.prepare(packed)
    out = be.empty((B, n), as_dtype(dt), like=an)
    be.gemv_4bit(an, pn, be.prepare(state.absmax), out, n=n, k=k, blocksize=blocksize,
                 quant_type=state.quant_type, nested=_nested(be, state))
    res = be.finish(out, A).reshape(tuple(shape[:-1]) + (n,))
    if EAGER_PLANS:
        _keep_plan("gemv_4bit", be, state, (A, packed, state), n=n, k=k)
    return res


def gemv_4bit_grouped(A: Any, weights: Sequence[tuple[Any, QuantState]], *,
                      backend: str | Backend | None = None) -> Any:
    """Several 4-bit weights that share one input (an attention layer's q / k / v, an MLP's gate /
    up) in one call: A [..., K] and ``weights`` [(packed_i, state_i)] with states of shape
    [N_i, K] -> [..., N_1 + N_2 + ...] in A's dtype, equal to the concatenation of
    ``gemv_4bit(A, packed_i, state_i)`` along the last dimension (each block within gemv_4bit's
    tolerance). A backend that implements the grouped kernel-level op reads every weight in one
    launch (cuda and maca: up to 4 weights of one quant type, blocksize and nestedness per launch;
    sycl: up to 4 of one quant type and blocksize; sycl and maca below 9 rows); the others run
    gemv_4bit per weight and concatenate.
    """
    be = _backend(backend)
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence) or len(weights) == 0:
        raise ParameterError("weights must be a non-empty sequence of (packed, QuantState) pairs, got "
                             f"{v.describe(weights)}")
    shape, dt = v.float_array(A, "A")
    geo = []
    for i, pair in enumerate(weights):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ParameterError(f"weights[{i}] must be a (packed, QuantState) pair, got {v.describe(pair)}")
        packed, state = pair
        _check_packed(packed, state)
        wshape, blocksize = _geometry(state)
        if len(wshape) != 2:
            raise ShapeError(f"weights[{i}]: gemv_4bit_grouped needs 2-D weight states [N, K], got shape {wshape}")
        geo.append((wshape[0], wshape[1], blocksize))
    k = geo[0][1]
    if any(g[1] != k for g in geo):
        raise ShapeError(f"the weights must share K (the input's length), got shapes {[g[:2] for g in geo]}")
    if len(shape) == 0 or shape[-1] != k:
        raise ShapeError(f"A must have shape [..., K] with K = {k} (the weights'), got shape {shape}")
    for (_, _, blocksize), (_, state) in zip(geo, weights):
        be.require("gemv_4bit", state.quant_type, dt, blocksize)
    rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    ntot = sum(g[0] for g in geo)
    lead = tuple(shape[:-1])
    if type(be).gemv_4bit_grouped is Backend.gemv_4bit_grouped:
        parts = [gemv_4bit(A, p, st, backend=be) for p, st in weights]
        try:
            return concat_last(parts)
        except UnsupportedError:  # a backend's own array type: joined on the host
            host = np.concatenate([np.asarray(be.to_numpy(be.prepare(r))) for r in parts], axis=-1)
            return be.finish(be.from_numpy(host, like=be.prepare(A)), A)
    an = be.prepare(A)
    out = be.empty((rows, ntot), as_dtype(dt), like=an)
    if rows > 0 and ntot > 0:
        groups = [(be.prepare(p), be.prepare(st.absmax), _nested(be, st), g[0], g[2], st.quant_type)
                  for (p, st), g in zip(weights, geo)]
        be.gemv_4bit_grouped(an, groups, out, k=k)
    return be.finish(out, A).reshape(lead + (ntot,))


def concat_last(results: Sequence[Any]) -> Any:
    """Arrays of one kind (numpy, torch, CuPy, or any array-API namespace such as dpctl.tensor)
    concatenated along the last dimension."""
    first = results[0]
    kind = array_kind(first)
    if kind == "numpy":
        return np.concatenate(results, axis=-1)
    if kind == "torch":
        import torch

        return torch.cat(list(results), dim=-1)
    if kind == "cupy":
        import cupy

        return cupy.concatenate(results, axis=-1)
    ns = getattr(first, "__array_namespace__", None)
    if ns is not None:
        return ns().concat(list(results), axis=-1)
    raise UnsupportedError(f"cannot concatenate arrays of type {type(first).__name__}")


def bind_gemv_4bit(A: Any, packed: Any, state: QuantState, *, backend: str | Backend | None = None) -> Any:
    """For a caller that repeats one ``gemv_4bit`` call (a module's eager forward): a callable
    ``f(A2)`` that gives ``gemv_4bit(A2, packed, state)`` for an input of A's geometry while nothing
    about ``packed`` and ``state`` has changed, and None otherwise (then call :func:`gemv_4bit`,
    which validates everything). Returns None where the backend binds nothing. Made from the launch
    plan that a previous ``gemv_4bit(A, packed, state)`` call left on the state."""
    plan = _bindable_plan("gemv_4bit", _backend(backend), state)
    return None if plan is None else plan.bind(A, packed, state)


def bind_dequantize_4bit(packed: Any, state: QuantState, out_dtype: Any = None, *,
                         backend: str | Backend | None = None) -> Any:
    """For a caller that repeats one ``dequantize_4bit`` call (a module's eager dequantize +
    matmul): a callable ``f()`` that gives ``dequantize_4bit(packed, state, out_dtype)`` while
    nothing about ``packed`` and ``state`` has changed, and None otherwise (then call
    :func:`dequantize_4bit`). Returns None where the backend binds nothing. Made from the launch
    plan that a previous ``dequantize_4bit(packed, state, out_dtype)`` call left on the state."""
    plan = _bindable_plan("dequantize_4bit", _backend(backend), state)
    return None if plan is None else plan.bind(packed, state, out_dtype)


def _bindable_plan(op: str, be: Backend, state: Any) -> Any:
    """The launch plan of ``op`` that ``be`` left on ``state``, where it can bind (else None)."""
    entry = (getattr(state, "_plans", None) or {}).get(op)
    if not EAGER_PLANS or entry is None or entry[0] is not be or not hasattr(entry[1], "bind"):
        return None
    return entry[1]


# -- bitsandbytes blockwise 8-bit --------------------------------------------------------------
def quantize_blockwise(
    x: Any, blocksize: int = 4096, *, backend: str | Backend | None = None
) -> tuple[Any, QuantState]:
    """Blockwise 8-bit with the dynamic map: ``(codes uint8 of x's shape, QuantState)``."""
    be = _backend(backend)
    shape, dt = v.float_array(x, "x")
    blocksize = v.blocksize_8bit(blocksize)
    be.require("quantize_blockwise", "dynamic8", dt, blocksize)
    xn = be.prepare(x)
    n = math.prod(shape)
    codes = be.empty(shape, U8, like=xn)
    absmax = be.empty((bnb.nblocks(n, blocksize),), F32, like=xn)
    thresholds = be.prepare(_const(be, "dynamic_thresholds", bnb.DYNAMIC_THRESHOLDS, x))
    be.quantize_blockwise(xn, thresholds, codes, absmax, blocksize=blocksize)
    state = QuantState(absmax=be.finish(absmax, x), shape=shape, code=_const(be, "dynamic_map", bnb.DYNAMIC_MAP, x),
                       blocksize=blocksize, dtype=dt)
    return be.finish(codes, x), state


def dequantize_blockwise(
    codes: Any, state: QuantState, out_dtype: Any = None, *, backend: str | Backend | None = None
) -> Any:
    """``out = T(code[q] * absmax[i // blocksize])`` with the state's 256-entry code."""
    be = _backend(backend)
    _check_state(state)
    if state.quant_type is not None:
        raise StateError(f"this is a 4-bit ({state.quant_type}) state; use dequantize_4bit")
    shape = v.uint8_array(codes, "codes", nonempty=True)
    if math.prod(shape) != state.n:
        raise ShapeError(f"codes hold {math.prod(shape)} values, the state describes {state.n}")
    dt = v.out_dtype(out_dtype if out_dtype is not None else state.dtype)
    oshape, blocksize = _geometry(state)
    be.require("dequantize_blockwise", "dynamic8", dt, blocksize)
    cn = be.prepare(codes)
    out = be.empty(oshape, as_dtype(dt), like=cn)
    be.dequantize_blockwise(cn, be.prepare(state.absmax), be.prepare(state.code), out,
                            blocksize=blocksize)
    return be.finish(out, codes)


# -- ggml ----------------------------------------------------------------------------------------
def quantize_ggml(x: Any, fmt: str, *, backend: str | Backend | None = None) -> Any:
    """ggml block quantization of a float ``[R, K]`` (or ``[K]``), K % 32 == 0, to ``fmt``
    ("q4_0", "q8_0" or "q8_1") -> uint8 ``[R, K/32, bytes per block]`` (ggml's bytes; ``[K/32,
    bytes]`` for a 1-D input). :func:`quantize_q4_0` and the others are this with ``fmt`` fixed."""
    fmt = v.choice(fmt, tuple(ggml.BLOCK_BYTES), "fmt")
    be = _backend(backend)
    rows, k, dt = v.ggml_rows(x, "x")
    be.require(f"quantize_{fmt}", fmt, dt, ggml.QK)
    xn = be.prepare(x)
    out = be.empty((rows, k // ggml.QK, ggml.BLOCK_BYTES[fmt]), U8, like=xn)
    getattr(be, f"quantize_{fmt}")(xn, out)
    res = be.finish(out, x)
    return res if len(meta(x)[0]) == 2 else res.reshape(k // ggml.QK, ggml.BLOCK_BYTES[fmt])


def quantize_q4_0(w: Any, *, backend: str | Backend | None = None) -> Any:
    """ggml Q4_0: float ``[M, K]`` (K % 32 == 0) -> uint8 ``[M, K/32, 18]`` (ggml's bytes)."""
    return quantize_ggml(w, "q4_0", backend=backend)


def quantize_q8_0(a: Any, *, backend: str | Backend | None = None) -> Any:
    """ggml Q8_0: float ``[N, K]`` -> uint8 ``[N, K/32, 34]``."""
    return quantize_ggml(a, "q8_0", backend=backend)


def quantize_q8_1(a: Any, *, backend: str | Backend | None = None) -> Any:
    """ggml Q8_1: float ``[N, K]`` -> uint8 ``[N, K/32, 36]`` with ``s = fp16(d * sum(q))``."""
    return quantize_ggml(a, "q8_1", backend=backend)


def dequantize_ggml(q: Any, fmt: str, out_dtype: Any = "float32", *,
                    backend: str | Backend | None = None) -> Any:
    """Inverse of :func:`quantize_ggml`: uint8 blocks ``[R, K/32, bytes]`` (or ``[K/32, bytes]``)
    of ``fmt`` -> ``[R, K]`` (or ``[K]``) in ``out_dtype``."""
    fmt = v.choice(fmt, tuple(ggml.BLOCK_BYTES), "fmt")
    be = _backend(backend)
    shape = v.uint8_array(q, "q")
    if len(shape) not in (2, 3) or shape[-1] != ggml.BLOCK_BYTES[fmt]:
        raise ShapeError(f"{fmt} blocks must have shape [rows, K/32, {ggml.BLOCK_BYTES[fmt]}], got {shape}")
    if math.prod(shape) == 0:
        raise ShapeError(f"q is empty (shape {shape}); {fmt} blocks [rows, K/32, {ggml.BLOCK_BYTES[fmt]}] "
                         "need rows >= 1 and K >= 32")
    rows = shape[0] if len(shape) == 3 else 1
    k = shape[-2] * ggml.QK
    dt = v.out_dtype(out_dtype)
    be.require("dequantize_ggml", fmt, dt, ggml.QK)
    qn = be.prepare(q)
    out = be.empty((rows, k), as_dtype(dt), like=qn)
    be.dequantize_ggml(qn, out, fmt=fmt)
    res = be.finish(out, q)
    return res if len(shape) == 3 else res.reshape(k)


def dequantize_q4_0(wq: Any, out_dtype: Any = "float32", *, backend=None) -> Any:
    """uint8 ``[M, K/32, 18]`` -> ``[M, K]``: ``(q - 8) * d``."""
    return dequantize_ggml(wq, "q4_0", out_dtype, backend=backend)


def dequantize_q8_0(aq: Any, out_dtype: Any = "float32", *, backend=None) -> Any:
    """uint8 ``[N, K/32, 34]`` -> ``[N, K]``: ``q * d``."""
    return dequantize_ggml(aq, "q8_0", out_dtype, backend=backend)


def dequantize_q8_1(aq: Any, out_dtype: Any = "float32", *, backend=None) -> Any:
    """uint8 ``[N, K/32, 36]`` -> ``[N, K]``: ``q * d``."""
    return dequantize_ggml(aq, "q8_1", out_dtype, backend=backend)


def gemm_q4_0_q8_1(wq: Any, aq: Any, M: int, N: int, K: int, *, backend=None) -> Any:
    """W4A8 GEMM on quantized operands: ``wq [M, K/32, 18]``, ``aq [N, K/32, 36]`` -> fp32 ``[M, N]``.

    Per block: ``d4 * (d8 * sum(q4 * q8) - 8 * s8)``, integer dot products, fp32 accumulation.
    """
    be = _backend(backend)
    M, N, K = v.mnk(M, N, K)
    v.ggml_blocks(wq, M, K, "q4_0", "wq")
    v.ggml_blocks(aq, N, K, "q8_1", "aq")
    be.require("gemm_q4_0_q8_1", "q4_0", "float32", ggml.QK)
    wn = be.prepare(wq)
    out = be.empty((M, N), F32, like=wn)
    be.gemm_q4_0_q8_1(wn, be.prepare(aq), out)
    return be.finish(out, wq)


def gemm_w4a8(wq: Any, a: Any, M: int, N: int, K: int, *, backend=None) -> Any:
    """W4A8 GEMM with the activation ``a [N, K]`` (float) quantized to Q8_1 inside the op
    (the same bytes :func:`quantize_q8_1` gives): ``wq [M, K/32, 18]`` -> fp32 ``[M, N]``."""
    be = _backend(backend)
    M, N, K = v.mnk(M, N, K)
    v.ggml_blocks(wq, M, K, "q4_0", "wq")
    shape, dt = v.float_array(a, "a")
    if shape not in ((N, K),) and not (N == 1 and shape == (K,)):
        raise ShapeError(f"a must have shape ({N}, {K}), got {shape}")
    be.require("gemm_w4a8", "q4_0", dt, ggml.QK)
    wn = be.prepare(wq)
    out = be.empty((M, N), F32, like=wn)
    be.gemm_w4a8(wn, be.prepare(a), out)
    return be.finish(out, wq)


def bind_gemm_w4a8(wq: Any, a: Any, M: int, N: int, K: int, *, linear: bool = False,
                   backend: str | Backend | None = None) -> Any:
    """For a caller that repeats one ``gemm_w4a8`` call (a module's eager forward): a callable
    ``f(a2)`` that gives ``gemm_w4a8(wq, a2, M, N, K)`` for an input of a's geometry while ``wq`` is
    unchanged (same pointer, no in-place change), and None otherwise (then call :func:`gemm_w4a8`,
    which validates everything). ``linear=True``: ``f`` gives a linear layer's ``a2 @ W.T`` instead,
    a's leading shape + ``(M,)`` in a's dtype, each value rounded once from the same fp32 sum (the
    bits of ``gemm_w4a8(...).T`` converted to a's dtype). Returns None where the backend binds
    nothing or has kept no launch for this call: make the call once through :func:`gemm_w4a8` first."""
    be = _backend(backend)
    binder = getattr(be, "bind_gemm_w4a8", None)
    if not EAGER_PLANS or binder is None:
        return None
    return binder(wq, a, m=M, n=N, k=K, linear=linear)


def same_kind(result: Any, like: Any) -> bool:
    """True when ``result`` is the same array kind as ``like`` (used by tests)."""
    return array_kind(result) == array_kind(like)
