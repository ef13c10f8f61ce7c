"""quantcore's ops as PyTorch custom ops (``torch.ops.quantcore.*``), imported only when used.

Every public op is defined once here with a schema, a fake (meta) implementation that gives
shapes and dtypes without running anything (so ``torch.compile(fullgraph=True)`` traces through
it), and one implementation that routes by the tensors' device type to the backend that serves it
(:func:`backend_for`): ``cpu`` tensors -> the cpu backend, ``cuda`` tensors -> the cuda backend (or
maca where the MetaX SDK is installed, whose PyTorch calls its devices "cuda"), ``xpu`` tensors ->
the sycl backend. :func:`set_backend_for` changes a route (for example ``("cpu", "sycl")`` runs torch
CPU tensors on the SYCL CPU device through host copies: a validation path, not a fast one).

The ops take and return plain tensors (a bitsandbytes state is passed as its arrays), so they
work on tensors torch made and inside CUDA graphs. The linear ops (``linear_4bit``,
``linear_q4_0``, ``linear_fp4``) choose their path by row count (:func:`linear_path`) and carry
an autograd formula for the input and the bias (a frozen quantized weight, as QLoRA trains).

Ops are defined with ``torch.library.Library`` rather than ``torch.library.custom_op``: the same
registration (schema, fake, autograd), at about half the eager dispatch cost. The module layer
(:mod:`quantcore.nn`) calls the same implementations directly for eager calls that need no
autograd graph (:func:`linear_4bit_eager`), which keeps the dispatcher out of the hot path.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .. import api, api_mx
from .. import validate as v
from ..arrays import dtype_name
from ..backend import after_foreign_work
from ..errors import DTypeError, ParameterError, ShapeError
from ..formats import bnb, ggml, mx
from ..registry import get_backend
from ..state import QuantState

NAMESPACE = "quantcore"

#: linear_4bit / linear_q4_0 use the batch kernels (weights read once for all rows) up to this
#: many rows, dequantize + matmul above (PERFORMANCE: gemv_4bit equals torch bf16 at 16 rows and
#: falls to 0.36x at 64, where dequantize + cuBLAS gives 0.50x)
GEMV_MAX_ROWS = 16
#: ... except on a backend with a many-row 4-bit GEMM (the cuda backend's bnb_gemm.cu, behind
#: gemv_4bit): there linear_4bit takes gemv_4bit up to this many rows when no device is named, and up
#: to the backend's ``gemm_4bit_rows(device, n, k, rows, eager)`` for a device (cuda: 512 on compute
#: capability 9.0 for weights of 4096 x 4096 elements or more, the wgmma GEMM, and up to 2048 rows where
#: the call's rows fill its waves; 128 for smaller weights in a call captured in a CUDA graph, 512 in an
#: eager one, whose time is the host's; 0 without the GEMM),
#: dequantize + matmul above (docs/performance.md, "NF4 prefill"; both paths' times grow with N * K,
#: so the crossover is mostly a row count; above 512 rows the wgmma GEMM's wave fill decides per call)
FUSED_4BIT_MAX_ROWS = {"cuda": 128}
#: gemm_w4a8's stream kernel reads the weight once for up to 8 activation rows
W4A8_MAX_ROWS = 8
#: on the cuda backend linear_q4_0 takes gemm_w4a8 (its int8 tensor-core GEMM above 8 rows) up to
#: this many rows: faster than dequantize + bf16 matmul there (H200: 16 rows 48 against 82 us,
#: 64 rows 46-67 against 83-85 us; 128 rows 89-96 against 83-87 us; docs/performance.md "W4A8 prefill")
W4A8_MAX_ROWS_CUDA = 64

#: QUANTCORE_TORCH_DEBUG=1 prints each linear op's path choice (rows, path) to stderr
DEBUG = os.environ.get("QUANTCORE_TORCH_DEBUG", "0") == "1"

# -- routing ----------------------------------------------------------------------------------------
_ROUTES: dict[str, str] = {"cpu": "cpu", "xpu": "sycl"}
_BACKENDS: dict[str, Any] = {}


def _default_cuda_backend() -> str:
    # MetaX's PyTorch names its devices "cuda": tell MetaX from NVIDIA by the SDK, not by torch
    from ..backends.maca import build

    return "maca" if build.find_maca_path() is not None else "cuda"


def set_backend_for(device_type: str, name: str | None) -> None:
    """Route tensors of ``device_type`` ("cpu", "cuda", "xpu", ...) to backend ``name``; None
    restores the default route."""
    if not isinstance(device_type, str):
        raise ParameterError(f"device_type must be a string such as 'cuda', got {device_type!r}")
    if name is None:
        _ROUTES.pop(device_type, None)
        _ROUTES.update({k: v for k, v in (("cpu", "cpu"), ("xpu", "sycl")) if k == device_type})
    else:
        get_backend(name)  # unknown or unavailable: the registry's error, now
        _ROUTES[device_type] = name
    _BACKENDS.pop(device_type, None)


def backend_for(device: torch.device | str) -> Any:
    """The backend that serves tensors on ``device`` (a torch device or its type)."""
    dtype = device if isinstance(device, str) else device.type
    be = _BACKENDS.get(dtype)
    if be is None:
        name = _ROUTES.get(dtype) or (_default_cuda_backend() if dtype == "cuda" else None)
        if name is None:
            raise ParameterError(f"no quantcore backend serves torch '{dtype}' tensors; route one "
                                 "with quantcore.torch.set_backend_for(device_type, backend_name)")
        be = _BACKENDS[dtype] = get_backend(name)
    return be


def _host_route(be: Any, device: torch.device) -> bool:
    """True when CPU tensors were routed to a device backend (sycl's CPU device): its arrays are
    its own (USM), so the tensors travel through host copies, explicitly asked for by the route."""
    return device.type == "cpu" and be.name != "cpu"


def _moved(be: Any, obj: Any) -> Any:
    """``obj`` (a CPU tensor, a QuantState of them, or anything else) as ``be``'s arrays."""
    from ..arrays import torch_to_numpy

    if isinstance(obj, torch.Tensor):
        return be.from_numpy(torch_to_numpy(obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_moved(be, o) for o in obj)
    if isinstance(obj, QuantState):
        return QuantState(absmax=_moved(be, obj.absmax), shape=obj.shape, code=_moved(be, obj.code),
                          blocksize=obj.blocksize, quant_type=obj.quant_type, dtype=obj.dtype,
                          offset=_moved(be, obj.offset), state2=_moved(be, obj.state2))
    return obj


def _run(device: torch.device, fn, args: tuple, **kw) -> Any:
    """``fn(*args, backend=be, **kw)`` (a public API function) on the backend routed for ``device``, in
    :class:`~quantcore.backend.after_foreign_work` (the backend's kernels follow torch's)."""
    be = backend_for(device)
    if not _host_route(be, device):
        with after_foreign_work():  # a model's kernels run between the torch layer's calls
            return fn(*args, backend=be, **kw)
    from ..arrays import numpy_to_torch

    kw = {k: _moved(be, v) for k, v in kw.items()}
    res = fn(*(_moved(be, a) for a in args), backend=be, **kw)
    if isinstance(res, tuple):
        return tuple(numpy_to_torch(be.to_numpy(r)) for r in res)
    return numpy_to_torch(be.to_numpy(res))


# -- the library --------------------------------------------------------------------------------------
_LIB = torch.library.Library(NAMESPACE, "DEF")


def _define(schema: str, impl, fake, autograd: tuple | None = None) -> None:
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIB)
    if autograd is not None:
        torch.library.register_autograd(f"{NAMESPACE}::{name}", autograd[0], setup_context=autograd[1],
                                        lib=_LIB)


_TORCH_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _check_float(x: torch.Tensor, what: str) -> None:
    if x.dtype not in _TORCH_FLOATS:
        raise DTypeError(f"{what} must be float32, float16 or bfloat16, got {x.dtype}")


# -- QuantState from tensors (kept per packed weight so eager launch plans survive across calls) ----
_STATES = WeakIdKeyDictionary()


def _fp(t: torch.Tensor | None) -> Any:
    return None if t is None else (t.data_ptr(), t.shape, t.dtype, t.device)


def state_of(packed: torch.Tensor, absmax: torch.Tensor, absmax2: torch.Tensor | None,
             code2: torch.Tensor | None, offset: torch.Tensor | None, shape: tuple[int, ...],
             blocksize: int, quant_type: str, dtype: str | None = None) -> QuantState:
    """The :class:`QuantState` of a 4-bit weight given as tensors (nested when ``absmax2`` is given).

    The same state object comes back while the tensors (pointers, shapes) and parameters are the
    same, so the backend's launch plans kept on it are reused; it lives as long as ``packed``.
    ``dtype`` (the dtype the weight had, which only a default ``out_dtype`` and a checkpoint read)
    None takes any: the ops always name their output dtype."""
    key = (_fp(absmax), _fp(absmax2), _fp(code2), _fp(offset), tuple(shape), blocksize, quant_type)
    hit = _STATES.get(packed)
    if hit is not None and hit[0] == key and (dtype is None or hit[1].dtype == dtype):
        return hit[1]
    v.quant_type(quant_type)
    # the code tables in the tensors' own kind and device (a host route moves the whole state)
    be = get_backend("cpu") if packed.device.type == "cpu" else backend_for(packed.device)
    state = QuantState(absmax=absmax, shape=tuple(int(s) for s in shape),
                       code=api._const(be, quant_type, bnb.code_4bit(quant_type), packed),
                       blocksize=int(blocksize), quant_type=quant_type, dtype=dtype or "float32")
    if absmax2 is not None:
        if offset is None:
            raise ParameterError("a nested 4-bit state needs its offset with absmax2")
        if code2 is None:
            code2 = api._const(be, "dynamic_map", bnb.DYNAMIC_MAP, packed)
        state.offset = offset
        state.state2 = QuantState(absmax=absmax2, code=code2, blocksize=bnb.NESTED_BLOCKSIZE, dtype="float32")
    _STATES[packed] = (key, state)
    return state


# -- quantize_4bit ----------------------------------------------------------------------------------
def _quantize_4bit(x, blocksize, quant_type, compress_statistics):
    packed, st = _run(x.device, api.quantize_4bit, (x,), blocksize=blocksize, quant_type=quant_type,
                      compress_statistics=compress_statistics)
    if st.nested:
        return packed, st.absmax, st.state2.absmax, st.offset.reshape(1)
    return packed, st.absmax, x.new_empty((0,), dtype=torch.float32), x.new_empty((0,), dtype=torch.float32)


def _quantize_4bit_fake(x, blocksize, quant_type, compress_statistics):
    n = x.numel()
    nb = bnb.nblocks(n, blocksize)
    packed = x.new_empty(((n + 1) // 2, 1), dtype=torch.uint8)
    if compress_statistics:
        return (packed, x.new_empty((nb,), dtype=torch.uint8),
                x.new_empty((bnb.nblocks(nb, bnb.NESTED_BLOCKSIZE),), dtype=torch.float32),
                x.new_empty((1,), dtype=torch.float32))
    empty = x.new_empty((0,), dtype=torch.float32)
    return packed, x.new_empty((nb,), dtype=torch.float32), empty, empty.clone()


_define("quantize_4bit(Tensor x, int blocksize, str quant_type, bool compress_statistics) "
        "-> (Tensor packed, Tensor absmax, Tensor absmax2, Tensor offset)", _quantize_4bit, _quantize_4bit_fake)


def quantize_4bit(x: torch.Tensor, blocksize: int = 64, quant_type: str = "nf4",
                  compress_statistics: bool = True) -> tuple[torch.Tensor, QuantState]:
    """:func:`quantcore.quantize_4bit` through the custom op: ``(packed, QuantState)``."""
    packed, absmax, absmax2, offset = torch.ops.quantcore.quantize_4bit(x, blocksize, quant_type,
                                                                        compress_statistics)
    nested = compress_statistics
    return packed, state_of(packed, absmax, absmax2 if nested else None, None, offset if nested else None,
                            tuple(x.shape), blocksize, quant_type, dtype_name(x.dtype))


# -- dequantize_4bit / gemv_4bit ----------------------------------------------------------------------
def _dequantize_4bit(packed, absmax, absmax2, code2, offset, shape, blocksize, quant_type, out_dtype):
    state = state_of(packed, absmax, absmax2, code2, offset, tuple(shape), blocksize, quant_type)
    return _run(packed.device, api.dequantize_4bit, (packed, state), out_dtype=out_dtype)


def _dequantize_4bit_fake(packed, absmax, absmax2, code2, offset, shape, blocksize, quant_type, out_dtype):
    return packed.new_empty(tuple(shape), dtype=out_dtype)


_STATE_ARGS = "Tensor packed, Tensor absmax, Tensor? absmax2, Tensor? code2, Tensor? offset"
_define(f"dequantize_4bit({_STATE_ARGS}, SymInt[] shape, int blocksize, str quant_type, ScalarType out_dtype) "
        "-> Tensor", _dequantize_4bit, _dequantize_4bit_fake)


def _gemv_4bit(A, packed, absmax, absmax2, code2, offset, n, k, blocksize, quant_type):
    state = state_of(packed, absmax, absmax2, code2, offset, (n, k), blocksize, quant_type)
    return _run(A.device, api.gemv_4bit, (A, packed, state))


def _gemv_4bit_fake(A, packed, absmax, absmax2, code2, offset, n, k, blocksize, quant_type):
    _check_float(A, "A")
    return A.new_empty(tuple(A.shape[:-1]) + (n,))


_define(f"gemv_4bit(Tensor A, {_STATE_ARGS}, int n, int k, int blocksize, str quant_type) -> Tensor",
        _gemv_4bit, _gemv_4bit_fake)


def _gemv_4bit_grouped(A, packed, absmax, absmax2, code2, offset, n, k, blocksize, quant_type):
    if not (len(packed) == len(absmax) == len(absmax2) == len(code2) == len(offset) == len(n)) or not packed:
        raise ParameterError("gemv_4bit_grouped takes one packed, absmax, absmax2, code2, offset and n per "
                             f"weight (at least one), got {len(packed)}, {len(absmax)}, {len(absmax2)}, "
                             f"{len(code2)}, {len(offset)}, {len(n)}")
    weights = [(p, state_of(p, am, a2, c2, off, (ni, k), blocksize, quant_type))
               for p, am, a2, c2, off, ni in zip(packed, absmax, absmax2, code2, offset, n)]
    return _run(A.device, api.gemv_4bit_grouped, (A, weights))


def _gemv_4bit_grouped_fake(A, packed, absmax, absmax2, code2, offset, n, k, blocksize, quant_type):
    _check_float(A, "A")
    return A.new_empty(tuple(A.shape[:-1]) + (sum(n),))


_define("gemv_4bit_grouped(Tensor A, Tensor[] packed, Tensor[] absmax, Tensor?[] absmax2, Tensor?[] code2, "
        "Tensor?[] offset, int[] n, int k, int blocksize, str quant_type) -> Tensor",
        _gemv_4bit_grouped, _gemv_4bit_grouped_fake)


# -- linear_4bit ----------------------------------------------------------------------------------------
def linear_path(rows: int, op: str = "linear_4bit", backend: Any = None, k: int = 0, device: Any = None,
                n: int = 0) -> str:
    """The path a linear op takes for ``rows`` input rows of ``k`` elements on ``backend`` (a backend
    or its name; None: any backend) and ``device`` (a torch device; None: any) with an [n, k] weight:
    "gemv" (the batch kernels, or the fused many-row GEMM where the backend has one on that device,
    read the weight once for many rows; linear_q4_0: gemm_w4a8) or "dequantize+matmul" (the weight
    dequantized into a temporary, then torch's matmul on tensor cores). The rule is a row count; with a
    device, the backend's ``gemm_4bit_rows(device, n, k, rows, eager)`` sets it for linear_4bit (n, k 0:
    any weight; ``eager``: the call is not being captured in a CUDA graph, so its host time counts)."""
    path = "gemv" if 0 < rows <= _gemv_rows(op, backend, k, device, n, rows) else "dequantize+matmul"
    if DEBUG:
        print(f"quantcore.torch: {op} rows={rows} -> {path}", file=sys.stderr)
    return path


def _gemv_rows(op: str, backend: Any, k: int, device: Any, n: int, rows: int = 0) -> int:
    """The most input rows for which ``linear_path`` says "gemv" (its arguments; ``rows``: for a call of
    that many rows, which a backend's rule may take above its plain limit)."""
    name = backend if backend is None or isinstance(backend, str) else getattr(backend, "name", None)
    if op == "linear_q4_0":
        return W4A8_MAX_ROWS_CUDA if name == "cuda" else W4A8_MAX_ROWS
    limit = GEMV_MAX_ROWS
    if op == "linear_4bit" and name is not None:
        fused = FUSED_4BIT_MAX_ROWS.get(name, 0)
        rows_on = getattr(backend, "gemm_4bit_rows", None)
        if fused and rows_on is not None and device is not None:
            fused = rows_on(device, n, k, rows)  # the device's GEMM (0: none, e.g. too little shared memory per CTA)
            if rows > fused:  # an eager call may take the GEMM further: its time is the host's
                eager = rows_on(device, n, k, rows, True)
                if eager > fused and not _capturing():
                    fused = eager
        limit = max(limit, fused)
    return limit


def _capturing() -> bool:
    """Is the current CUDA stream being captured into a graph (False on a torch without CUDA)?"""
    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:  # torch built without CUDA
        return False


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0


def _check_linear(x: torch.Tensor, k: int, bias: torch.Tensor | None, n: int) -> None:
    _check_float(x, "x")
    if x.dim() == 0 or x.shape[-1] != k:
        raise ShapeError(f"x must have {k} elements in its last dimension (the weight's K), got shape "
                         f"{tuple(x.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise ShapeError(f"bias must have shape ({n},), got {tuple(bias.shape)}")


def add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``y += bias`` in y's dtype (the gemv paths' bias: a separate add after the product)."""
    return y if bias is None else y.add_(bias.to(y.dtype))


def linear_4bit_eager(x, packed, absmax, absmax2, code2, offset, n, k, blocksize, quant_type, bias=None, *,
                      state: QuantState | None = None):
    """``x @ W.T + bias`` for a 4-bit W [n, k]: the implementation behind ``quantcore::linear_4bit``
    (the module layer calls it directly for eager calls that build no autograd graph, with the
    ``state`` it keeps for these tensors)."""
    _check_linear(x, k, bias, n)
    if state is None:
        state = state_of(packed, absmax, absmax2, code2, offset, (n, k), blocksize, quant_type)
    rows = _rows(x)
    if linear_path(rows, backend=backend_for(x.device), k=k, device=x.device, n=n) == "gemv":
        x2 = x if x.is_contiguous() else x.contiguous()
        return add_bias(_run(x.device, api.gemv_4bit, (x2, packed, state)), bias)
    w = _run(x.device, api.dequantize_4bit, (packed, state), out_dtype=x.dtype)
    # (the bias added after the product in x's dtype, as on the gemv path: the same bits either way)
    return add_bias(torch.nn.functional.linear(x, w), bias)


class _BoundDequantLinear:
    """The dequantize + matmul path bound to a module's weight (``quantcore.api.bind_dequantize_4bit``),
    then ``F.linear``; the bias is the caller's (added after, as the unbound path does). None for an
    input this binding does not serve (another dtype, device or K, rows the gemv path takes) or where
    the bound launch declines (the weight's tensors changed, the tuning, the thread's context)."""

    __slots__ = ("dequantize", "dtype", "device", "k", "n", "backend", "where")

    def __init__(self, dequantize: Any, x: torch.Tensor, n: int, backend: Any):
        self.dequantize, self.dtype, self.device = dequantize, x.dtype, x.get_device()
        self.k, self.n, self.backend, self.where = x.shape[-1], n, backend, x.device

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        if (type(x) is not torch.Tensor or x.dtype != self.dtype or x.get_device() != self.device or not x.dim()
                or x.shape[-1] != self.k):
            return None
        rows = x.numel() // self.k
        if rows <= _gemv_rows("linear_4bit", self.backend, self.k, self.where, self.n, rows):
            return None
        w = self.dequantize()
        return None if w is None else torch.nn.functional.linear(x, w)


def bind_linear_4bit(x: torch.Tensor, packed: torch.Tensor, state: QuantState) -> Any:
    """The path's launch bound to these tensors for x's geometry: the gemv's (``quantcore.bind_gemv_4bit``),
    or the dequantize + matmul path's (``quantcore.api.bind_dequantize_4bit``, then ``F.linear``); a
    callable ``f(x)`` giving the linear without its bias, or None (a host route, a backend that binds
    nothing, no launch plan for it yet)."""
    be = backend_for(x.device)
    if _host_route(be, x.device):
        return None
    n, k = (state.shape[0], x.shape[-1]) if len(state.shape) == 2 else (0, x.shape[-1])
    if linear_path(_rows(x), backend=be, k=k, device=x.device, n=n) != "gemv":
        from ..api import bind_dequantize_4bit

        dq = bind_dequantize_4bit(packed, state, x.dtype, backend=be)
        # (the bound call serves any input that takes this path: the path asked per call)
        return None if dq is None else _BoundDequantLinear(dq, x, n, be)
    from ..api import bind_gemv_4bit

    with after_foreign_work():  # the bound launch keeps it: a module calls it behind torch's kernels
        return bind_gemv_4bit(x if x.is_contiguous() else x.contiguous(), packed, state, backend=be)


def _linear_4bit_fake(x, packed, absmax, absmax2, code2, offset, n, k, blocksize, quant_type, bias=None):
    _check_linear(x, k, bias, n)
    return x.new_empty(tuple(x.shape[:-1]) + (n,))


def _linear_setup(ctx, inputs, output):
    ctx.inputs = inputs  # the weight's tensors are frozen; only x and bias get gradients
    ctx.x_meta = (inputs[0].dtype, inputs[0].shape)


def _bias_grad(ctx, grad, bias):
    if bias is None or not ctx.needs_input_grad[-1]:
        return None
    return grad.reshape(-1, grad.shape[-1]).sum(0).to(bias.dtype)


def _linear_4bit_backward(ctx, grad):
    x, packed, absmax, absmax2, code2, offset, n, k, blocksize, quant_type, bias = ctx.inputs
    gx = None
    if ctx.needs_input_grad[0]:
        w = torch.ops.quantcore.dequantize_4bit(packed, absmax, absmax2, code2, offset, [n, k], blocksize,
                                                quant_type, grad.dtype)
        gx = (grad @ w).to(x.dtype)
    return gx, None, None, None, None, None, None, None, None, None, _bias_grad(ctx, grad, bias)


_define(f"linear_4bit(Tensor x, {_STATE_ARGS}, int n, int k, int blocksize, str quant_type, Tensor? bias=None) "
        "-> Tensor", linear_4bit_eager, _linear_4bit_fake, (_linear_4bit_backward, _linear_setup))


# -- ggml: gemm_w4a8 and linear_q4_0 ----------------------------------------------------------------------
def _gemm_w4a8(wq, a, M, N, K):
    return _run(wq.device, api.gemm_w4a8, (wq, a, M, N, K))


def _gemm_w4a8_fake(wq, a, M, N, K):
    return wq.new_empty((M, N), dtype=torch.float32)


_define("gemm_w4a8(Tensor wq, Tensor a, int M, int N, int K) -> Tensor", _gemm_w4a8, _gemm_w4a8_fake)


def _dequantize_q4_0(wq, out_dtype):
    return _run(wq.device, api.dequantize_q4_0, (wq,), out_dtype=out_dtype)


def _dequantize_q4_0_fake(wq, out_dtype):
    return wq.new_empty((wq.shape[0], wq.shape[1] * ggml.QK), dtype=out_dtype)


_define("dequantize_q4_0(Tensor wq, ScalarType out_dtype) -> Tensor", _dequantize_q4_0, _dequantize_q4_0_fake)


def _quantize_q4_0(w):
    return _run(w.device, api.quantize_q4_0, (w,))


def _quantize_q4_0_fake(w):
    return w.new_empty((w.shape[0], w.shape[1] // ggml.QK, ggml.BLOCK_BYTES["q4_0"]), dtype=torch.uint8)


_define("quantize_q4_0(Tensor w) -> Tensor", _quantize_q4_0, _quantize_q4_0_fake)


def _check_q4_0(wq: torch.Tensor) -> tuple[int, int]:
    if wq.dim() != 3 or wq.shape[2] != ggml.BLOCK_BYTES["q4_0"] or wq.dtype != torch.uint8:
        raise ShapeError(f"wq must be uint8 [M, K/32, 18] (ggml Q4_0 blocks), got {wq.dtype} {tuple(wq.shape)}")
    return int(wq.shape[0]), int(wq.shape[1]) * ggml.QK


def _from_w4a8(y: torch.Tensor, x: torch.Tensor, m: int) -> torch.Tensor:
    """gemm_w4a8's fp32 [M, rows] result as linear's output: x's leading shape + (M,), x's dtype,
    contiguous (.to(memory_format=...) would keep the transposed strides for fp32)."""
    return y.t().to(x.dtype).contiguous().view(tuple(x.shape[:-1]) + (m,))


def linear_q4_0_eager(x, wq, bias=None):
    """``x @ W.T + bias`` for a ggml Q4_0 weight ``wq [M, K/32, 18]``: W4A8 (the activation quantized
    to Q8_1 inside the kernel) up to :data:`W4A8_MAX_ROWS` rows (:data:`W4A8_MAX_ROWS_CUDA` on the cuda
    backend), dequantize + matmul above."""
    m, k = _check_q4_0(wq)
    _check_linear(x, k, bias, m)
    rows = _rows(x)
    if linear_path(rows, "linear_q4_0", backend_for(wq.device).name) == "gemv":
        x2 = x.reshape(rows, k)
        y = _run(wq.device, api.gemm_w4a8, (wq, x2 if x2.is_contiguous() else x2.contiguous(), m, rows, k))
        return add_bias(_from_w4a8(y, x, m), bias)
    w = _dequantize_q4_0(wq, x.dtype)
    return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))


def bind_linear_q4_0(x: torch.Tensor, wq: torch.Tensor) -> Any:
    """linear_q4_0's W4A8 launch bound to ``wq`` for x's geometry (``quantcore.api.bind_gemm_w4a8``
    with ``linear=True``): a callable ``f(x2)`` giving ``x2 @ W.T`` (no bias) like
    :func:`linear_q4_0_eager`, bitwise, from one launch that writes x2's leading shape + ``(M,)`` in
    x2's dtype; or None where nothing binds (the dequantize path, a host route, a backend or kernel
    that keeps no launch). ``f`` returns None for an input it was not bound for."""
    m, k = _check_q4_0(wq)
    be = backend_for(wq.device)
    rows = _rows(x)
    if (linear_path(rows, "linear_q4_0", be.name) != "gemv" or _host_route(be, x.device) or not x.is_contiguous()
            or x.shape[-1] != k):
        return None
    from ..api import bind_gemm_w4a8

    return bind_gemm_w4a8(wq, x, m, rows, k, linear=True, backend=be)


def _linear_q4_0_fake(x, wq, bias=None):
    m, k = _check_q4_0(wq)
    _check_linear(x, k, bias, m)
    return x.new_empty(tuple(x.shape[:-1]) + (m,))


def _linear_q4_0_backward(ctx, grad):
    x, wq, bias = ctx.inputs
    gx = None
    if ctx.needs_input_grad[0]:
        gx = (grad @ torch.ops.quantcore.dequantize_q4_0(wq, grad.dtype)).to(x.dtype)
    return gx, None, _bias_grad(ctx, grad, bias)


_define("linear_q4_0(Tensor x, Tensor wq, Tensor? bias=None) -> Tensor", linear_q4_0_eager, _linear_q4_0_fake,
        (_linear_q4_0_backward, _linear_setup))


# -- MX: quantize / dequantize / scaled_fp4_mm / linear_fp4 ---------------------------------------------------
def _quantize_mx(x, fmt, scale_mode, global_scale, swizzle):
    return _run(x.device, api_mx.quantize_mx, (x,), fmt=fmt, scale_mode=scale_mode,
                global_scale=global_scale, swizzle=swizzle)


def _quantize_mx_fake(x, fmt, scale_mode, global_scale, swizzle):
    fmt = v.mx_format(fmt)
    k = x.shape[-1]
    blk = mx.block_size(fmt)
    lead = tuple(x.shape[:-1])
    rows = math.prod(lead)
    codes = x.new_empty(lead + (mx.codes_cols(fmt, k),), dtype=torch.uint8)
    sshape = mx.swizzled_shape(rows, k // blk) if swizzle else lead + (k // blk,)
    return codes, x.new_empty(sshape, dtype=torch.uint8)


_define("quantize_mx(Tensor x, str fmt, str scale_mode, Tensor? global_scale, bool swizzle) "
        "-> (Tensor codes, Tensor scales)", _quantize_mx, _quantize_mx_fake)


def _dequantize_mx(codes, scales, fmt, out_dtype, global_scale, swizzled):
    return _run(codes.device, api_mx.dequantize_mx, (codes, scales), fmt=fmt, out_dtype=out_dtype,
                global_scale=global_scale, swizzled=swizzled)


def _dequantize_mx_fake(codes, scales, fmt, out_dtype, global_scale, swizzled):
    fmt = v.mx_format(fmt)
    k = codes.shape[-1] * (2 if fmt in mx.FP4_FORMATS else 1)
    return codes.new_empty(tuple(codes.shape[:-1]) + (k,), dtype=out_dtype)


_define("dequantize_mx(Tensor codes, Tensor scales, str fmt, ScalarType out_dtype, Tensor? global_scale, "
        "bool swizzled) -> Tensor", _dequantize_mx, _dequantize_mx_fake)


def _scaled_fp4_mm(a, b, scale_a, scale_b, alpha, bias, fmt):
    return _run(a.device, api_mx.scaled_fp4_mm, (a, b, scale_a, scale_b, alpha, bias), fmt=fmt)


def _scaled_fp4_mm_fake(a, b, scale_a, scale_b, alpha, bias, fmt):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=torch.bfloat16)


_define("scaled_fp4_mm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor alpha, Tensor? bias, str fmt) "
        "-> Tensor", _scaled_fp4_mm, _scaled_fp4_mm_fake)


def _linear_mx(x, codes, scales, fmt, global_scale, swizzled):
    x2 = x if x.is_contiguous() else x.contiguous()
    return _run(x.device, api_mx.linear_mx, (x2, codes, scales, fmt), global_scale=global_scale,
                swizzled=swizzled)


def _linear_mx_fake(x, codes, scales, fmt, global_scale, swizzled):
    n, k = _check_fp4(codes, fmt)
    _check_linear(x, k, None, n)
    return x.new_empty(tuple(x.shape[:-1]) + (n,))


_define("linear_mx(Tensor x, Tensor codes, Tensor scales, str fmt, Tensor? global_scale, bool swizzled) "
        "-> Tensor", _linear_mx, _linear_mx_fake)


def _grouped_fp4_check(x, codes, scales, global_scale, fmt) -> int:
    """Sum of N over the weights of linear_mx_grouped (one codes, scales, global_scale per weight)."""
    if not (len(codes) == len(scales) == len(global_scale)) or not codes:
        raise ParameterError("linear_mx_grouped takes one codes, scales and global_scale per weight (at least "
                             f"one), got {len(codes)}, {len(scales)}, {len(global_scale)}")
    ntot = 0
    for c in codes:
        n, k = _check_fp4(c, fmt)
        _check_linear(x, k, None, n)
        ntot += n
    return ntot


def _linear_mx_grouped(x, codes, scales, global_scale, fmt):
    _grouped_fp4_check(x, codes, scales, global_scale, fmt)
    x2 = x if x.is_contiguous() else x.contiguous()
    weights = [(c, s, fmt, g) for c, s, g in zip(codes, scales, global_scale)]
    return _run(x.device, api_mx.linear_mx_grouped, (x2, weights), swizzled=False)


def _linear_mx_grouped_fake(x, codes, scales, global_scale, fmt):
    return x.new_empty(tuple(x.shape[:-1]) + (_grouped_fp4_check(x, codes, scales, global_scale, fmt),))


_define("linear_mx_grouped(Tensor x, Tensor[] codes, Tensor[] scales, Tensor?[] global_scale, str fmt) -> Tensor",
        _linear_mx_grouped, _linear_mx_grouped_fake)


def _check_fp4(codes: torch.Tensor, fmt: str) -> tuple[int, int]:
    v.mx_format(fmt, mx.FP4_FORMATS)
    if codes.dim() != 2 or codes.dtype != torch.uint8:
        raise ShapeError(f"codes must be uint8 [N, K/2], got {codes.dtype} {tuple(codes.shape)}")
    return int(codes.shape[0]), 2 * int(codes.shape[1])


def linear_fp4_eager(x, codes, scales, global_scale, fmt, bias=None):
    """``x @ W.T + bias`` for an NVFP4 / MXFP4 weight (codes uint8 [N, K/2], row-major scales
    [N, K/blk], NVFP4's global scale fp32 [1]) with float activations: up to
    :data:`GEMV_MAX_ROWS` rows through the weight-only kernel (``quantcore.linear_mx``: the codes
    read once, fp32 accumulation, then the bias added in x's dtype); more rows dequantize the
    weight into x's dtype, then torch's matmul."""
    n, k = _check_fp4(codes, fmt)
    _check_linear(x, k, bias, n)
    if linear_path(_rows(x), "linear_fp4") == "gemv":
        return add_bias(_linear_mx(x, codes, scales, fmt, global_scale, False), bias)
    w = _dequantize_mx(codes, scales, fmt, x.dtype, global_scale, False)
    return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))


def _linear_fp4_fake(x, codes, scales, global_scale, fmt, bias=None):
    n, k = _check_fp4(codes, fmt)
    _check_linear(x, k, bias, n)
    return x.new_empty(tuple(x.shape[:-1]) + (n,))


def _linear_fp4_backward(ctx, grad):
    x, codes, scales, global_scale, fmt, bias = ctx.inputs
    gx = None
    if ctx.needs_input_grad[0]:
        w = torch.ops.quantcore.dequantize_mx(codes, scales, fmt, grad.dtype, global_scale, False)
        gx = (grad @ w).to(x.dtype)
    return gx, None, None, None, None, _bias_grad(ctx, grad, bias)


_define("linear_fp4(Tensor x, Tensor codes, Tensor scales, Tensor? global_scale, str fmt, Tensor? bias=None) "
        "-> Tensor", linear_fp4_eager, _linear_fp4_fake, (_linear_fp4_backward, _linear_setup))


#: every op this module defines, as ``torch.ops.quantcore.<name>``
OPS = ("quantize_4bit", "dequantize_4bit", "gemv_4bit", "gemv_4bit_grouped", "linear_4bit", "gemm_w4a8", "quantize_q4_0",
       "dequantize_q4_0", "linear_q4_0", "quantize_mx", "dequantize_mx", "scaled_fp4_mm", "linear_mx",
       "linear_mx_grouped", "linear_fp4")

__all__ = ["FUSED_4BIT_MAX_ROWS", "GEMV_MAX_ROWS", "OPS", "W4A8_MAX_ROWS", "W4A8_MAX_ROWS_CUDA", "backend_for", "bind_linear_4bit",
           "bind_linear_q4_0", "linear_4bit_eager", "linear_fp4_eager", "linear_path", "linear_q4_0_eager", "quantize_4bit", "set_backend_for", "state_of"]
