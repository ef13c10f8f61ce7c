"""Hardening of the public API (issue 22): every invalid input of every public function raises the
same :class:`~quantcore.QuantcoreError` subclass with the same message on every backend, before
any work; numpy integer / float scalars are treated like Python numbers; the NaN / Inf rules of
NVFP4's global scale and of ggml's tiny blocks (gguf-py parity).

Each case is built once per backend from the same numpy data: numpy arrays for ``cpu``, USM arrays
(``get_backend("sycl").from_numpy``) for ``sycl`` when that backend is available. Cases that pass
a non-array (a list, a number, a torch tensor of a dtype quantcore does not take) pass it as it is
on every backend: the core rejects it before it asks the backend to read it.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import quantcore as qc
from quantcore.arrays import BF16, as_dtype
from quantcore.errors import (
    BackendUnavailableError,
    DTypeError,
    ParameterError,
    QuantcoreError,
    ShapeError,
    StateError,
)
from quantcore.formats import bnb, ggml

BACKENDS = ["cpu"] + [n for n, a in qc.available_backends().items() if n == "sycl" and a.ok]

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


class Env:
    """One backend's view of the fixture data: ``arr(np)`` makes the backend's own array."""

    def __init__(self, name: str):
        self.name = name
        self.be = qc.get_backend(name)
        rng = np.random.default_rng(22)
        self.x_np = rng.standard_normal((8, 64)).astype(np.float32)
        self.x = self.arr(self.x_np)
        self.packed, self.state = qc.quantize_4bit(self.x, 64, "nf4", False, backend=name)
        self.packed_n, self.state_n = qc.quantize_4bit(self.x, 64, "nf4", True, backend=name)
        self.codes8, self.state8 = qc.quantize_blockwise(self.x, 256, backend=name)
        self.wq = qc.quantize_q4_0(self.x, backend=name)  # [8, 2, 18]
        self.aq = qc.quantize_q8_1(self.arr(self.x_np[:3]), backend=name)  # [3, 2, 36]
        self.nv_c, self.nv_s = qc.scaled_nvfp4_quant(self.x, 100.0, backend=name)  # [8, 32], [128, 4]
        self.mx_c, self.mx_s = qc.scaled_mxfp4_quant(self.x, backend=name)  # [8, 32], [128, 4]
        self.mx8_c, self.mx8_s = qc.scaled_mxfp8_quant(self.x, backend=name)

    def arr(self, a: Any) -> Any:
        a = np.ascontiguousarray(a)
        return a if self.name == "cpu" else self.be.from_numpy(a)

    def host(self, a: Any) -> np.ndarray:
        return np.asarray(a) if self.name == "cpu" else self.be.to_numpy(a)


_ENVS: dict[str, Env] = {}


@pytest.fixture(scope="module", params=BACKENDS)
def env(request) -> Env:
    if request.param not in _ENVS:
        _ENVS[request.param] = Env(request.param)
    return _ENVS[request.param]


def _torch():
    return pytest.importorskip("torch")


def _torch_tensor(kind: str) -> Any:
    torch = _torch()
    if kind == "complex64":
        return torch.zeros(8, 64, dtype=torch.complex64)
    if kind == "float64":
        return torch.zeros(8, 64, dtype=torch.float64)
    if kind in ("uint16", "float8_e5m2", "uint32"):
        if not hasattr(torch, kind):
            pytest.skip(f"this torch has no {kind}")
        return torch.zeros(8, 64, dtype=getattr(torch, kind))
    if kind == "sparse_coo":
        return torch.zeros(8, 64).to_sparse()
    if kind == "sparse_csr":
        return torch.zeros(8, 64).to_sparse_csr()
    raise KeyError(kind)


def _nested_with(e: Env, **fields: Any) -> qc.QuantState:
    return dataclasses.replace(e.state_n, **fields)


# -- the table: (function name, case name, call(env), expected type) -----------------------------------------
Call = Callable[[Env], Any]
CASES: list[tuple[str, str, Call, type]] = []


def case(fn: str, name: str, expected: type, call: Call) -> None:
    CASES.append((fn, name, call, expected))


NOT_ARRAYS = {"list": [[1.0, 2.0]], "float": 3.0, "none": None, "object": object(), "str": "abc",
              "dict": {"a": 1}}

# quantize_4bit
for k, bad in NOT_ARRAYS.items():
    case("quantize_4bit", f"x={k}", DTypeError, lambda e, bad=bad: qc.quantize_4bit(bad, backend=e.name))
for kind in ("complex64", "uint16", "float8_e5m2", "sparse_coo", "sparse_csr"):
    case("quantize_4bit", f"x=torch-{kind}", DTypeError,
         lambda e, kind=kind: qc.quantize_4bit(_torch_tensor(kind), backend=e.name))
case("quantize_4bit", "x=complex64", DTypeError,
     lambda e: qc.quantize_4bit(e.arr(np.zeros((4, 64), np.complex64)), backend=e.name))
case("quantize_4bit", "x=int32", DTypeError,
     lambda e: qc.quantize_4bit(e.arr(np.zeros((4, 64), np.int32)), backend=e.name))
case("quantize_4bit", "x=float64", DTypeError,
     lambda e: qc.quantize_4bit(e.arr(np.zeros((4, 64), np.float64)), backend=e.name))
case("quantize_4bit", "x-big-endian", DTypeError,
     lambda e: qc.quantize_4bit(np.zeros((4, 64), ">f4"), backend=e.name))
case("quantize_4bit", "x-empty", ShapeError,
     lambda e: qc.quantize_4bit(e.arr(np.zeros((0, 64), np.float32)), backend=e.name))
for k, bad in {"64.0": 64.0, "np.float64": np.float64(64), "True": True, "str": "64", "None": None,
               "63": 63, "8bit-only-size": 16, "array": np.array([64])}.items():
    case("quantize_4bit", f"blocksize={k}", ParameterError,
         lambda e, bad=bad: qc.quantize_4bit(e.x, bad, backend=e.name))
for k, bad in {"nf5": "nf5", "None": None, "int": 4, "array": np.array(["nf4"]), "NF4": "NF4"}.items():
    case("quantize_4bit", f"quant_type={k}", ParameterError,
         lambda e, bad=bad: qc.quantize_4bit(e.x, 64, bad, backend=e.name))
for k, bad in {"str": "yes", "None": None, "2": 2, "float": 1.0}.items():
    case("quantize_4bit", f"compress_statistics={k}", ParameterError,
         lambda e, bad=bad: qc.quantize_4bit(e.x, 64, "nf4", bad, backend=e.name))
case("quantize_4bit", "backend=int", ParameterError, lambda e: qc.quantize_4bit(e.x, backend=5))
case("quantize_4bit", "backend=unknown", BackendUnavailableError,
     lambda e: qc.quantize_4bit(e.x, backend="no-such-backend"))

# dequantize_4bit
for k, bad in NOT_ARRAYS.items():
    case("dequantize_4bit", f"packed={k}", DTypeError, lambda e, bad=bad: qc.dequantize_4bit(bad, e.state, backend=e.name))
case("dequantize_4bit", "packed=float32", DTypeError,
     lambda e: qc.dequantize_4bit(e.arr(np.zeros((256, 1), np.float32)), e.state, backend=e.name))
case("dequantize_4bit", "packed-wrong-size", ShapeError,
     lambda e: qc.dequantize_4bit(e.arr(np.zeros((255, 1), np.uint8)), e.state, backend=e.name))
for k, bad in {"str": "state", "dict": {"absmax": 1}, "None": None}.items():
    case("dequantize_4bit", f"state={k}", StateError, lambda e, bad=bad: qc.dequantize_4bit(e.packed, bad, backend=e.name))
for k, bad in {"float64": "float64", "int8": np.int8, "list": [1], "garbage": "garbage"}.items():
    case("dequantize_4bit", f"out_dtype={k}", DTypeError,
         lambda e, bad=bad: qc.dequantize_4bit(e.packed, e.state, bad, backend=e.name))
case("dequantize_4bit", "out_dtype=torch.complex64", DTypeError,
     lambda e: qc.dequantize_4bit(e.packed, e.state, _torch().complex64, backend=e.name))
for dt in ("float64", "float16", "int32"):  # sycl decoded these bytes as float32 (values off by 3.7e19)
    case("dequantize_4bit", f"offset={dt}", StateError,
         lambda e, dt=dt: qc.dequantize_4bit(e.packed_n, _nested_with(e, offset=e.arr(np.array([0.5], dt))),
                                             backend=e.name))
case("dequantize_4bit", "offset=float", StateError,
     lambda e: qc.dequantize_4bit(e.packed_n, _nested_with(e, offset=0.5), backend=e.name))
# sycl decoded these with the wrong table while cpu raised StateError
case("dequantize_4bit", "quant_type=fp4-on-nf4-data", StateError,
     lambda e: qc.dequantize_4bit(e.packed, dataclasses.replace(e.state, quant_type="fp4"), backend=e.name))
case("dequantize_4bit", "reversed-nf4-map", StateError,
     lambda e: qc.dequantize_4bit(e.packed, dataclasses.replace(
         e.state, code=e.arr(bnb.code_4bit("nf4")[::-1].copy())), backend=e.name))
case("dequantize_4bit", "8bit-state", StateError, lambda e: qc.dequantize_4bit(e.codes8, e.state8, backend=e.name))

# gemv_4bit_grouped (the pair list, then each weight as gemv_4bit checks it)
case("gemv_4bit_grouped", "weights-empty", ParameterError,
     lambda e: qc.gemv_4bit_grouped(e.arr(np.zeros((1, 64), np.float32)), [], backend=e.name))
case("gemv_4bit_grouped", "weights-not-pairs", ParameterError,
     lambda e: qc.gemv_4bit_grouped(e.arr(np.zeros((1, 64), np.float32)), [e.packed], backend=e.name))
case("gemv_4bit_grouped", "A=float64", DTypeError,
     lambda e: qc.gemv_4bit_grouped(e.arr(np.zeros((1, 64), np.float64)), [(e.packed, e.state)], backend=e.name))
case("gemv_4bit_grouped", "A-wrong-K", ShapeError,
     lambda e: qc.gemv_4bit_grouped(e.arr(np.zeros((1, 32), np.float32)), [(e.packed, e.state)] * 2,
                                    backend=e.name))
case("gemv_4bit_grouped", "state-1d", ShapeError,
     lambda e: qc.gemv_4bit_grouped(e.arr(np.zeros((1, 64), np.float32)),
                                    [(e.packed, dataclasses.replace(e.state, shape=(e.state.shape[0] * 64,)))],
                                    backend=e.name))
# gemv_4bit
for k, bad in NOT_ARRAYS.items():
    case("gemv_4bit", f"A={k}", DTypeError, lambda e, bad=bad: qc.gemv_4bit(bad, e.packed, e.state, backend=e.name))
case("gemv_4bit", "A=complex64", DTypeError,
     lambda e: qc.gemv_4bit(e.arr(np.zeros((1, 64), np.complex64)), e.packed, e.state, backend=e.name))
case("gemv_4bit", "A=torch-sparse", DTypeError,
     lambda e: qc.gemv_4bit(_torch().zeros(1, 64).to_sparse(), e.packed, e.state, backend=e.name))
case("gemv_4bit", "A-wrong-K", ShapeError,
     lambda e: qc.gemv_4bit(e.arr(np.zeros((1, 32), np.float32)), e.packed, e.state, backend=e.name))
case("gemv_4bit", "A-empty", ShapeError,
     lambda e: qc.gemv_4bit(e.arr(np.zeros((0, 64), np.float32)), e.packed, e.state, backend=e.name))
case("gemv_4bit", "packed=list", DTypeError,
     lambda e: qc.gemv_4bit(e.arr(np.zeros((1, 64), np.float32)), [1, 2], e.state, backend=e.name))
case("gemv_4bit", "offset=float64", StateError,
     lambda e: qc.gemv_4bit(e.arr(np.zeros((1, 64), np.float32)), e.packed_n,
                            _nested_with(e, offset=e.arr(np.array([0.5], np.float64))), backend=e.name))
case("gemv_4bit", "state=None", StateError,
     lambda e: qc.gemv_4bit(e.arr(np.zeros((1, 64), np.float32)), e.packed, None, backend=e.name))

# quantize_blockwise
for k, bad in NOT_ARRAYS.items():
    case("quantize_blockwise", f"x={k}", DTypeError, lambda e, bad=bad: qc.quantize_blockwise(bad, backend=e.name))
case("quantize_blockwise", "x=torch-uint16", DTypeError,
     lambda e: qc.quantize_blockwise(_torch_tensor("uint16"), backend=e.name))
case("quantize_blockwise", "x-empty", ShapeError,
     lambda e: qc.quantize_blockwise(e.arr(np.zeros((0,), np.float32)), backend=e.name))
for k, bad in {"4096.0": 4096.0, "True": True, "str": "256", "32": 32, "None": None}.items():
    case("quantize_blockwise", f"blocksize={k}", ParameterError,
         lambda e, bad=bad: qc.quantize_blockwise(e.x, bad, backend=e.name))

# dequantize_blockwise
for k, bad in NOT_ARRAYS.items():
    case("dequantize_blockwise", f"codes={k}", DTypeError,
         lambda e, bad=bad: qc.dequantize_blockwise(bad, e.state8, backend=e.name))
case("dequantize_blockwise", "codes-empty", ShapeError,
     lambda e: qc.dequantize_blockwise(e.arr(np.zeros((0,), np.uint8)), e.state8, backend=e.name))
case("dequantize_blockwise", "4bit-state", StateError,
     lambda e: qc.dequantize_blockwise(e.arr(np.zeros(512, np.uint8)), e.state, backend=e.name))
case("dequantize_blockwise", "out_dtype=int8", DTypeError,
     lambda e: qc.dequantize_blockwise(e.codes8, e.state8, "int8", backend=e.name))
case("dequantize_blockwise", "state=list", StateError,
     lambda e: qc.dequantize_blockwise(e.codes8, [1], backend=e.name))

# ggml quantizers
for fn in ("quantize_q4_0", "quantize_q8_0", "quantize_q8_1"):
    for k, bad in NOT_ARRAYS.items():
        case(fn, f"x={k}", DTypeError, lambda e, bad=bad, fn=fn: getattr(qc, fn)(bad, backend=e.name))
    case(fn, "x=torch-complex64", DTypeError, lambda e, fn=fn: getattr(qc, fn)(_torch_tensor("complex64"), backend=e.name))
    case(fn, "x=float8_e5m2", DTypeError, lambda e, fn=fn: getattr(qc, fn)(_torch_tensor("float8_e5m2"), backend=e.name))
    case(fn, "x=float64", DTypeError,
         lambda e, fn=fn: getattr(qc, fn)(e.arr(np.zeros((2, 64), np.float64)), backend=e.name))
    case(fn, "K=48", ShapeError, lambda e, fn=fn: getattr(qc, fn)(e.arr(np.zeros((2, 48), np.float32)), backend=e.name))
    case(fn, "empty", ShapeError, lambda e, fn=fn: getattr(qc, fn)(e.arr(np.zeros((0, 32), np.float32)), backend=e.name))
    case(fn, "3-D", ShapeError, lambda e, fn=fn: getattr(qc, fn)(e.arr(np.zeros((2, 2, 32), np.float32)), backend=e.name))

# ggml dequantizers
for fn, nbytes in (("dequantize_q4_0", 18), ("dequantize_q8_0", 34), ("dequantize_q8_1", 36)):
    for k, bad in NOT_ARRAYS.items():
        case(fn, f"q={k}", DTypeError, lambda e, bad=bad, fn=fn: getattr(qc, fn)(bad, backend=e.name))
    # the case: cpu raised ValueError, sycl returned an array of shape (0, 128)
    case(fn, "empty-rows", ShapeError,
         lambda e, fn=fn, nb=nbytes: getattr(qc, fn)(e.arr(np.zeros((0, 4, nb), np.uint8)), backend=e.name))
    case(fn, "empty-blocks", ShapeError,
         lambda e, fn=fn, nb=nbytes: getattr(qc, fn)(e.arr(np.zeros((2, 0, nb), np.uint8)), backend=e.name))
    case(fn, "empty-2d", ShapeError,
         lambda e, fn=fn, nb=nbytes: getattr(qc, fn)(e.arr(np.zeros((0, nb), np.uint8)), backend=e.name))
    case(fn, "q=float32", DTypeError,
         lambda e, fn=fn, nb=nbytes: getattr(qc, fn)(e.arr(np.zeros((2, 1, nb), np.float32)), backend=e.name))
    case(fn, "wrong-block-bytes", ShapeError,
         lambda e, fn=fn, nb=nbytes: getattr(qc, fn)(e.arr(np.zeros((2, 1, nb + 1), np.uint8)), backend=e.name))
    for k, bad in {"float64": "float64", "None": None, "uint16": "uint16", "list": [1]}.items():
        case(fn, f"out_dtype={k}", DTypeError,
             lambda e, fn=fn, nb=nbytes, bad=bad: getattr(qc, fn)(e.arr(np.zeros((2, 1, nb), np.uint8)), bad,
                                                                  backend=e.name))

# the generic ggml functions (the shorthands above with fmt fixed): the format is checked too
for k, bad in {"q5_0": "q5_0", "Q8_0": "Q8_0", "None": None, "int": 0}.items():
    case("quantize_ggml", f"fmt={k}", ParameterError,
         lambda e, bad=bad: qc.quantize_ggml(e.arr(np.zeros((2, 32), np.float32)), bad, backend=e.name))
    case("dequantize_ggml", f"fmt={k}", ParameterError,
         lambda e, bad=bad: qc.dequantize_ggml(e.arr(np.zeros((2, 1, 34), np.uint8)), bad, backend=e.name))
case("quantize_ggml", "K=48", ShapeError,
     lambda e: qc.quantize_ggml(e.arr(np.zeros((2, 48), np.float32)), "q8_0", backend=e.name))
case("dequantize_ggml", "wrong-block-bytes", ShapeError,
     lambda e: qc.dequantize_ggml(e.arr(np.zeros((2, 1, 34), np.uint8)), "q4_0", backend=e.name))

# ggml GEMMs (wq [8, 2, 18] = M 8, K 64; aq [3, 2, 36] = N 3)
for fn in ("gemm_q4_0_q8_1", "gemm_w4a8"):
    def second(e, fn=fn):
        return e.aq if fn == "gemm_q4_0_q8_1" else e.arr(e.x_np[:3])
    for k, (m, n, kk) in {"M=8.0": (8.0, 3, 64), "N=True": (8, True, 64), "K=str": (8, 3, "64"),
                          "M=0": (0, 3, 64), "N=-3": (8, -3, 64), "M=None": (None, 3, 64),
                          "K=np.float64": (8, 3, np.float64(64))}.items():
        case(fn, k, ParameterError,
             lambda e, fn=fn, m=m, n=n, kk=kk, second=second: getattr(qc, fn)(e.wq, second(e), m, n, kk, backend=e.name))
    case(fn, "K=48", ShapeError, lambda e, fn=fn, second=second: getattr(qc, fn)(e.wq, second(e), 8, 3, 48, backend=e.name))
    case(fn, "wq=list", DTypeError, lambda e, fn=fn, second=second: getattr(qc, fn)([1], second(e), 8, 3, 64, backend=e.name))
    case(fn, "wq-wrong-M", ShapeError, lambda e, fn=fn, second=second: getattr(qc, fn)(e.wq, second(e), 7, 3, 64, backend=e.name))
case("gemm_q4_0_q8_1", "aq=float32", DTypeError,
     lambda e: qc.gemm_q4_0_q8_1(e.wq, e.arr(np.zeros((3, 2, 36), np.float32)), 8, 3, 64, backend=e.name))
case("gemm_w4a8", "a=list", DTypeError, lambda e: qc.gemm_w4a8(e.wq, [[1.0] * 64] * 3, 8, 3, 64, backend=e.name))
case("gemm_w4a8", "a=int8", DTypeError,
     lambda e: qc.gemm_w4a8(e.wq, e.arr(np.zeros((3, 64), np.int8)), 8, 3, 64, backend=e.name))
case("gemm_w4a8", "a-wrong-shape", ShapeError,
     lambda e: qc.gemm_w4a8(e.wq, e.arr(np.zeros((4, 64), np.float32)), 8, 3, 64, backend=e.name))

# 0-d arrays (numpy scalars are 0-d host arrays; the sycl adapter keeps the shape ())
case("quantize_q4_0", "x-0d", ShapeError, lambda e: qc.quantize_q4_0(e.arr(np.array(1.0, np.float32)), backend=e.name))
case("gemv_4bit", "A-0d", ShapeError,
     lambda e: qc.gemv_4bit(e.arr(np.array(1.0, np.float32)), e.packed, e.state, backend=e.name))
case("swizzle_scales", "0-d", ShapeError, lambda e: qc.swizzle_scales(e.arr(np.array(1, np.uint8)), backend=e.name))
case("scaled_mxfp4_quant", "x-0d", ShapeError,
     lambda e: qc.scaled_mxfp4_quant(e.arr(np.array(1.0, np.float32)), backend=e.name))
case("dequantize_q8_0", "q-0d", ShapeError, lambda e: qc.dequantize_q8_0(e.arr(np.array(1, np.uint8)), backend=e.name))

# MX quantize
BAD_GLOBAL = {"str": "x", "None-nvfp4": None, "0.0": 0.0, "-1.0": -1.0, "inf": math.inf, "nan": math.nan,
              "np.float32-nan": np.float32("nan"), "np.float32-inf": np.float32("inf"), "np.float32-0": np.float32(0),
              "np.float64-neg": np.float64(-2.0), "True": True, "1e39": 1e39, "complex": 1j}
for k, g in BAD_GLOBAL.items():
    case("quantize_mx", f"global_scale={k}", ParameterError,
         lambda e, g=g: qc.quantize_mx(e.x, "nvfp4", global_scale=g, backend=e.name))
    case("scaled_nvfp4_quant", f"global_scale={k}", ParameterError,
         lambda e, g=g: qc.scaled_nvfp4_quant(e.x, g, backend=e.name))
case("scaled_nvfp4_quant", "global_scale=float64-array", DTypeError,
     lambda e: qc.scaled_nvfp4_quant(e.x, e.arr(np.array([1.0])), backend=e.name))
case("scaled_nvfp4_quant", "global_scale=2-elements", ShapeError,
     lambda e: qc.scaled_nvfp4_quant(e.x, e.arr(np.ones(2, np.float32)), backend=e.name))
case("scaled_nvfp4_quant", "global_scale=list", ParameterError, lambda e: qc.scaled_nvfp4_quant(e.x, [1.0], backend=e.name))
for fn in ("scaled_nvfp4_quant", "scaled_mxfp4_quant", "scaled_mxfp8_quant"):
    args = (100.0,) if fn == "scaled_nvfp4_quant" else ()
    for k, bad in NOT_ARRAYS.items():
        case(fn, f"x={k}", DTypeError, lambda e, fn=fn, bad=bad, args=args: getattr(qc, fn)(bad, *args, backend=e.name))
    case(fn, "x=torch-complex64", DTypeError,
         lambda e, fn=fn, args=args: getattr(qc, fn)(_torch_tensor("complex64"), *args, backend=e.name))
    case(fn, "x=int8", DTypeError,
         lambda e, fn=fn, args=args: getattr(qc, fn)(e.arr(np.zeros((2, 64), np.int8)), *args, backend=e.name))
    case(fn, "x-empty", ShapeError,
         lambda e, fn=fn, args=args: getattr(qc, fn)(e.arr(np.zeros((0, 64), np.float32)), *args, backend=e.name))
    case(fn, "K=8", ShapeError,
         lambda e, fn=fn, args=args: getattr(qc, fn)(e.arr(np.zeros((2, 8), np.float32)), *args, backend=e.name))
    for k, bad in {"str": "yes", "None": None, "array": np.array([True, False])}.items():
        case(fn, f"swizzle={k}", ParameterError,
             lambda e, fn=fn, args=args, bad=bad: getattr(qc, fn)(e.x, *args, swizzle=bad, backend=e.name))
for k, bad in {"round": "round", "None": None, "int": 0}.items():
    case("scaled_mxfp4_quant", f"scale_mode={k}", ParameterError,
         lambda e, bad=bad: qc.scaled_mxfp4_quant(e.x, scale_mode=bad, backend=e.name))
for k, bad in {"fp4": "fp4", "int": 2, "None": None, "array": np.array(["mxfp4"])}.items():
    case("quantize_mx", f"fmt={k}", ParameterError, lambda e, bad=bad: qc.quantize_mx(e.x, bad, backend=e.name))
case("quantize_mx", "mxfp4-with-global_scale", ParameterError,
     lambda e: qc.quantize_mx(e.x, "mxfp4", global_scale=1.0, backend=e.name))

# linear_mx (weight-only fp4): x [8, 64] against the [8, 64] weight's codes
for k, bad in NOT_ARRAYS.items():
    case("linear_mx", f"x={k}", DTypeError, lambda e, bad=bad: qc.linear_mx(bad, e.mx_c, e.mx_s, "mxfp4", backend=e.name))
    case("linear_mx", f"codes={k}", DTypeError, lambda e, bad=bad: qc.linear_mx(e.x, bad, e.mx_s, "mxfp4", backend=e.name))
    case("linear_mx", f"scales={k}", DTypeError, lambda e, bad=bad: qc.linear_mx(e.x, e.mx_c, bad, "mxfp4", backend=e.name))
case("linear_mx", "x-wrong-K", ShapeError,
     lambda e: qc.linear_mx(e.arr(np.zeros((2, 32), np.float32)), e.mx_c, e.mx_s, "mxfp4", backend=e.name))
case("linear_mx", "x-int64", DTypeError,
     lambda e: qc.linear_mx(e.arr(np.zeros((2, 64), np.int64)), e.mx_c, e.mx_s, "mxfp4", backend=e.name))
case("linear_mx", "codes-3d", ShapeError,
     lambda e: qc.linear_mx(e.x, e.arr(np.zeros((2, 4, 32), np.uint8)), e.mx_s, "mxfp4", backend=e.name))
case("linear_mx", "codes-empty", ShapeError,
     lambda e: qc.linear_mx(e.x, e.arr(np.zeros((0, 32), np.uint8)), e.mx_s, "mxfp4", backend=e.name))
case("linear_mx", "fmt=mxfp8", ParameterError, lambda e: qc.linear_mx(e.x, e.mx8_c, e.mx8_s, "mxfp8", backend=e.name))
case("linear_mx", "scales-row-major-as-swizzled", ShapeError,
     lambda e: qc.linear_mx(e.x, e.mx_c, e.arr(np.zeros((8, 2), np.uint8)), "mxfp4", backend=e.name))
case("linear_mx", "mxfp4-global_scale", ParameterError,
     lambda e: qc.linear_mx(e.x, e.mx_c, e.mx_s, "mxfp4", global_scale=1.0, backend=e.name))
for k, g in BAD_GLOBAL.items():
    case("linear_mx", f"nvfp4-global_scale={k}", ParameterError,
         lambda e, g=g: qc.linear_mx(e.x, e.nv_c, e.nv_s, "nvfp4", global_scale=g, backend=e.name))
for k, bad in {"str": "no", "None": None, "float": 1.0}.items():
    case("linear_mx", f"swizzled={k}", ParameterError,
         lambda e, bad=bad: qc.linear_mx(e.x, e.mx_c, e.mx_s, "mxfp4", swizzled=bad, backend=e.name))

# linear_mx_grouped: the weights list, then each weight as linear_mx checks it (named by its index)
for k, bad in {"empty": [], "None": None, "str": "mxfp4", "tuple-of-3": [("a", "b", "mxfp4")],
               "not-a-tuple": [1.0]}.items():
    case("linear_mx_grouped", f"weights={k}", ParameterError,
         lambda e, bad=bad: qc.linear_mx_grouped(e.x, bad, backend=e.name))
for k, bad in NOT_ARRAYS.items():
    case("linear_mx_grouped", f"x={k}", DTypeError,
         lambda e, bad=bad: qc.linear_mx_grouped(bad, [(e.mx_c, e.mx_s, "mxfp4", None)], backend=e.name))
case("linear_mx_grouped", "second-weight-wrong-K", ShapeError,
     lambda e: qc.linear_mx_grouped(e.x, [(e.mx_c, e.mx_s, "mxfp4", None),
                                          (e.arr(np.zeros((8, 16), np.uint8)), e.mx_s, "mxfp4", None)], backend=e.name))
case("linear_mx_grouped", "nvfp4-without-global_scale", ParameterError,
     lambda e: qc.linear_mx_grouped(e.x, [(e.mx_c, e.mx_s, "mxfp4", None), (e.nv_c, e.nv_s, "nvfp4", None)],
                                    backend=e.name))
case("linear_mx_grouped", "fmt=mxfp8", ParameterError,
     lambda e: qc.linear_mx_grouped(e.x, [(e.mx8_c, e.mx8_s, "mxfp8", None)], backend=e.name))
for k, bad in {"str": "no", "None": None}.items():
    case("linear_mx_grouped", f"swizzled={k}", ParameterError,
         lambda e, bad=bad: qc.linear_mx_grouped(e.x, [(e.mx_c, e.mx_s, "mxfp4", None)], swizzled=bad,
                                                 backend=e.name))

# MX dequantize
for k, bad in NOT_ARRAYS.items():
    case("dequantize_mx", f"codes={k}", DTypeError, lambda e, bad=bad: qc.dequantize_mx(bad, e.mx_s, "mxfp4", backend=e.name))
    case("dequantize_mx", f"scales={k}", DTypeError, lambda e, bad=bad: qc.dequantize_mx(e.mx_c, bad, "mxfp4", backend=e.name))
case("dequantize_mx", "codes=float32", DTypeError,
     lambda e: qc.dequantize_mx(e.arr(np.zeros((8, 32), np.float32)), e.mx_s, "mxfp4", backend=e.name))
case("dequantize_mx", "codes-empty", ShapeError,
     lambda e: qc.dequantize_mx(e.arr(np.zeros((0, 32), np.uint8)), e.mx_s, "mxfp4", backend=e.name))
case("dequantize_mx", "scales-wrong-shape", ShapeError,
     lambda e: qc.dequantize_mx(e.mx_c, e.arr(np.zeros((8, 2), np.uint8)), "mxfp4", backend=e.name))
case("dequantize_mx", "fmt=nvfp5", ParameterError, lambda e: qc.dequantize_mx(e.mx_c, e.mx_s, "nvfp5", backend=e.name))
for k, bad in {"str": "no", "None": None, "float": 1.0}.items():
    case("dequantize_mx", f"swizzled={k}", ParameterError,
         lambda e, bad=bad: qc.dequantize_mx(e.mx_c, e.mx_s, "mxfp4", swizzled=bad, backend=e.name))
for k, bad in {"float64": "float64", "torch.float8_e5m2": "torch-f8", "None": None}.items():
    case("dequantize_mxfp8", f"out_dtype={k}", DTypeError,
         lambda e, bad=bad: qc.dequantize_mxfp8(e.mx8_c, e.mx8_s, _torch().float8_e5m2 if bad == "torch-f8" else bad,
                                                backend=e.name))
for k, g in BAD_GLOBAL.items():
    if k != "None-nvfp4":
        case("dequantize_nvfp4", f"global_scale={k}", ParameterError,
             lambda e, g=g: qc.dequantize_nvfp4(e.nv_c, e.nv_s, g, backend=e.name))
case("dequantize_nvfp4", "global_scale=None", ParameterError, lambda e: qc.dequantize_nvfp4(e.nv_c, e.nv_s, None, backend=e.name))
case("dequantize_mxfp4", "codes=torch-sparse", DTypeError,
     lambda e: qc.dequantize_mxfp4(_torch().zeros(8, 32, dtype=_torch().uint8).to_sparse(), e.mx_s, backend=e.name))

# scale layout
for k, bad in NOT_ARRAYS.items():
    case("swizzle_scales", f"scales={k}", DTypeError, lambda e, bad=bad: qc.swizzle_scales(bad, backend=e.name))
case("swizzle_scales", "empty", ShapeError, lambda e: qc.swizzle_scales(e.arr(np.zeros((0, 4), np.uint8)), backend=e.name))
case("swizzle_scales", "3-D", ShapeError, lambda e: qc.swizzle_scales(e.arr(np.zeros((2, 2, 4), np.uint8)), backend=e.name))
case("swizzle_scales", "float32", DTypeError, lambda e: qc.swizzle_scales(e.arr(np.zeros((2, 4), np.float32)), backend=e.name))
for k, (r, c) in {"rows=8.0": (8.0, 2), "cols=str": (8, "2"), "rows=True": (True, 2), "rows=0": (0, 2),
                  "cols=None": (8, None), "rows=np.float32": (np.float32(8), 2)}.items():
    case("unswizzle_scales", k, ParameterError,
         lambda e, r=r, c=c: qc.unswizzle_scales(e.arr(np.zeros((128, 4), np.uint8)), r, c, backend=e.name))
case("unswizzle_scales", "swz=list", DTypeError, lambda e: qc.unswizzle_scales([1], 8, 2, backend=e.name))
case("unswizzle_scales", "swz-wrong-shape", ShapeError,
     lambda e: qc.unswizzle_scales(e.arr(np.zeros((128, 8), np.uint8)), 8, 2, backend=e.name))

# scaled_fp4_mm (a = b = nv_c [8, 32], K = 64)
case("scaled_fp4_mm", "bias=list", DTypeError,
     lambda e: qc.scaled_fp4_mm(e.nv_c, e.nv_c, e.nv_s, e.nv_s, 1.0, [0.0] * 8, backend=e.name))
case("scaled_fp4_mm", "bias=float32", DTypeError,
     lambda e: qc.scaled_fp4_mm(e.nv_c, e.nv_c, e.nv_s, e.nv_s, 1.0, e.arr(np.zeros(8, np.float32)), backend=e.name))
case("scaled_fp4_mm", "bias-wrong-shape", ShapeError,
     lambda e: qc.scaled_fp4_mm(e.nv_c, e.nv_c, e.nv_s, e.nv_s, 1.0,
                                e.arr(np.zeros(7, np.float32).astype(BF16)), backend=e.name))
for k, al in {"str": "x", "None": None, "nan": math.nan, "np.float32-inf": np.float32("inf"),
              "np.float32-nan": np.float32("nan"), "bool": True}.items():
    case("scaled_fp4_mm", f"alpha={k}", ParameterError,
         lambda e, al=al: qc.scaled_fp4_mm(e.nv_c, e.nv_c, e.nv_s, e.nv_s, al, backend=e.name))
case("scaled_fp4_mm", "alpha=float64-array", DTypeError,
     lambda e: qc.scaled_fp4_mm(e.nv_c, e.nv_c, e.nv_s, e.nv_s, e.arr(np.ones(1)), backend=e.name))
case("scaled_fp4_mm", "a=list", DTypeError, lambda e: qc.scaled_fp4_mm([1], e.nv_c, e.nv_s, e.nv_s, backend=e.name))
case("scaled_fp4_mm", "scale_a=None", DTypeError, lambda e: qc.scaled_fp4_mm(e.nv_c, e.nv_c, None, e.nv_s, backend=e.name))
case("scaled_fp4_mm", "fmt=mxfp8", ParameterError,
     lambda e: qc.scaled_fp4_mm(e.nv_c, e.nv_c, e.nv_s, e.nv_s, fmt="mxfp8", backend=e.name))
case("scaled_fp4_mm", "K-mismatch", ShapeError,
     lambda e: qc.scaled_fp4_mm(e.nv_c, e.arr(np.zeros((8, 16), np.uint8)), e.nv_s, e.nv_s, backend=e.name))

# functions without a backend (run on each backend's parametrization all the same)
for k, a in {"str": "x", "None": None, "0.0": 0.0, "-1.0": -1.0, "inf": math.inf, "nan": math.nan, "True": True,
             "np.float32-inf": np.float32("inf"), "np.float32-nan": np.float32("nan"), "tiny": 1e-40,
             "complex": 1j, "list": [1.0], "2-element-array": np.ones(2), "1e39": 1e39}.items():
    case("nvfp4_global_scale", f"amax={k}", ParameterError, lambda e, a=a: qc.nvfp4_global_scale(a))
for fn in ("as_torch_fp4", "as_torch_float8_e4m3", "as_torch_float8_e8m0"):
    case(fn, "None", DTypeError, lambda e, fn=fn: (_torch(), getattr(qc, fn)(None))[1])
    case(fn, "float32", DTypeError, lambda e, fn=fn: (_torch(), getattr(qc, fn)(np.zeros(4, np.float32)))[1])

#: every public function of quantcore.api and quantcore.api_mx has cases
PUBLIC = sorted(n for n in qc.__all__ if getattr(getattr(qc, n), "__module__", "") in ("quantcore.api", "quantcore.api_mx")
                and n != "torch_has_mx_dtypes")


def test_every_public_function_has_cases():
    covered = {fn for fn, *_ in CASES}
    assert len(PUBLIC) == 33  # linear_mx_grouped is the 33rd
    assert set(PUBLIC) - covered == set()


def _run(call: Call, e: Env) -> BaseException | None:
    try:
        call(e)
    except BaseException as exc:  # noqa: BLE001 - the type is what the test checks
        return exc
    return None


@pytest.mark.parametrize("fn,name,call,expected", CASES, ids=[f"{fn}-{name}" for fn, name, *_ in CASES])
def test_invalid_input(env, fn, name, call, expected):
    exc = _run(call, env)
    assert exc is not None, f"{fn}({name}) was accepted on {env.name}"
    if isinstance(exc, pytest.skip.Exception):
        raise exc
    assert type(exc) is expected and isinstance(exc, QuantcoreError), (
        f"{fn}({name}) on {env.name} raised {type(exc).__name__}: {exc}; expected {expected.__name__}")
    if env.name != "cpu":  # the same message as the cpu reference
        ref = _run(call, _ENVS.get("cpu") or Env("cpu"))
        assert type(ref) is type(exc) and str(ref) == str(exc), (str(ref), str(exc))


# -- numpy scalars are accepted like Python numbers, with the same results --------------------------------
def _same(env: Env, a: Any, b: Any) -> None:
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        if isinstance(x, qc.QuantState):
            assert x.blocksize == y.blocksize and type(x.blocksize) is int
            x, y = x.absmax, y.absmax
        hx, hy = env.host(x), env.host(y)
        assert hx.dtype == hy.dtype and hx.shape == hy.shape
        assert np.array_equal(hx.view(np.uint8), hy.view(np.uint8))


def test_numpy_integer_scalars_accepted(env):
    """``blocksize=np.int64(64)`` worked on cpu and failed at launch on sycl (KernelError)."""
    e = env
    for ity in (np.int64, np.int32, np.uint16):
        _same(e, qc.quantize_4bit(e.x, ity(64), "nf4", False, backend=e.name),
              qc.quantize_4bit(e.x, 64, "nf4", False, backend=e.name))
        _same(e, qc.quantize_4bit(e.x, ity(128), "fp4", np.bool_(True), backend=e.name),
              qc.quantize_4bit(e.x, 128, "fp4", True, backend=e.name))
        _same(e, qc.quantize_blockwise(e.x, ity(256), backend=e.name), qc.quantize_blockwise(e.x, 256, backend=e.name))
        _same(e, qc.gemm_q4_0_q8_1(e.wq, e.aq, ity(8), ity(3), ity(64), backend=e.name),
              qc.gemm_q4_0_q8_1(e.wq, e.aq, 8, 3, 64, backend=e.name))
        xa = e.arr(e.x_np[:3])
        _same(e, qc.gemm_w4a8(e.wq, xa, ity(8), ity(3), ity(64), backend=e.name),
              qc.gemm_w4a8(e.wq, xa, 8, 3, 64, backend=e.name))
        _same(e, qc.unswizzle_scales(e.nv_s, ity(8), ity(4), backend=e.name),
              qc.unswizzle_scales(e.nv_s, 8, 4, backend=e.name))
    # a state whose blocksize / shape hold numpy integers decodes like the plain one
    st = dataclasses.replace(e.state, blocksize=np.int64(64), shape=tuple(np.int64(s) for s in e.state.shape))
    _same(e, qc.dequantize_4bit(e.packed, st, backend=e.name), qc.dequantize_4bit(e.packed, e.state, backend=e.name))
    a = e.arr(e.x_np[:2])
    _same(e, qc.gemv_4bit(a, e.packed, st, backend=e.name), qc.gemv_4bit(a, e.packed, e.state, backend=e.name))


def test_numpy_float_scalars_accepted(env):
    e = env
    for fty in (np.float32, np.float64, float, int):
        g = fty(100)
        _same(e, qc.scaled_nvfp4_quant(e.x, g, backend=e.name), qc.scaled_nvfp4_quant(e.x, 100.0, backend=e.name))
        _same(e, qc.dequantize_nvfp4(e.nv_c, e.nv_s, g, backend=e.name),
              qc.dequantize_nvfp4(e.nv_c, e.nv_s, 100.0, backend=e.name))
        _same(e, qc.scaled_fp4_mm(e.nv_c, e.nv_c, e.nv_s, e.nv_s, fty(2), backend=e.name),
              qc.scaled_fp4_mm(e.nv_c, e.nv_c, e.nv_s, e.nv_s, 2.0, backend=e.name))


def test_global_scale_array_is_not_read(env):
    """A one-element float32 array is used as it is, on its device (no host round trip): its
    value is the caller's responsibility, the same on every backend."""
    e = env
    got = qc.scaled_nvfp4_quant(e.x, e.arr(np.array([100.0], np.float32)), backend=e.name)
    _same(e, got, qc.scaled_nvfp4_quant(e.x, 100.0, backend=e.name))


# -- NaN / Inf rules -------------------------------------------------------------------------------------------
def test_nvfp4_global_scale_rule():
    assert qc.nvfp4_global_scale(6.0) == np.float32(448.0)
    assert qc.nvfp4_global_scale(np.float16(6.0)) == np.float32(448.0)
    assert qc.nvfp4_global_scale(np.array([6.0], np.float32)) == np.float32(448.0)
    assert qc.nvfp4_global_scale(2688) == np.float32(1.0)
    for bad in (math.inf, -math.inf, math.nan, 0.0, -0.0, -1.0):
        with pytest.raises(ParameterError, match="finite positive amax"):
            qc.nvfp4_global_scale(bad)
    with pytest.raises(ParameterError, match="too small"):
        qc.nvfp4_global_scale(1e-37)  # 2688 / amax overflows fp32
    assert np.isfinite(qc.nvfp4_global_scale(8e-36))


def test_nvfp4_conversion_of_tensor_with_inf_is_an_error():
    """The issue's case: converting a tensor holding one Inf set the global scale to 0 and made
    every value non-finite; now the global scale is refused."""
    from quantcore import convert

    x = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    x[1, 5] = np.inf
    with pytest.raises(ParameterError, match="finite positive amax"):
        convert._quantize_nvfp4("w.weight", x, convert._Mover("cpu"))


# -- gguf-py parity on blocks whose 1/d overflows fp32 -----------------------------------------------------------
def _tiny_blocks(dtype: Any) -> np.ndarray:
    rng = np.random.default_rng(5)
    rows = []
    for e in range(-149, -115):  # fp32 subnormals and the smallest normals (Q8's d = amax/127 underflows)
        rows.append(rng.standard_normal(32) * 2.0**e)
        rows.append(np.full(32, 2.0**e))
        b = rng.standard_normal(32) * 2.0**e
        b[:7] = 0.0
        b[9] = -(2.0**e) * 3
        rows.append(b)
    x = np.array(rows).astype(np.float32).reshape(-1, 64)
    return x.astype(dtype)


def test_tiny_blocks_write_zero_codes():
    """A block whose ``1/d`` overflows fp32 writes code 0 everywhere (ggml's C reference on x86
    and gguf-py do; the saturated codes written before are gone)."""
    x = np.full((1, 32), 1e-40, np.float32)
    x[0, 3] = -3e-40
    x[0, 5] = 0.0
    q4 = ggml.quantize_q4_0(x)
    assert not q4.any()  # fp16 d = 0 and every nibble 0
    for q8 in (ggml.quantize_q8_0(x), ggml.quantize_q8_1(x)):
        assert not q8.any()
    # through the public API (the cpu backend)
    assert not np.asarray(qc.quantize_q4_0(x, backend="cpu")).any()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gguf_parity_tiny_blocks(dtype):
    gguf = pytest.importorskip("gguf", reason="gguf-py is not installed")
    from gguf import quants

    x = _tiny_blocks(as_dtype(dtype))
    x32 = x.astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for qtype, ours in ((gguf.GGMLQuantizationType.Q4_0, qc.quantize_q4_0),
                            (gguf.GGMLQuantizationType.Q8_0, qc.quantize_q8_0)):
            ref = quants.quantize(x32, qtype).reshape(-1, 34 if qtype.name == "Q8_0" else 18)
            got = np.asarray(ours(x, backend="cpu")).reshape(ref.shape)
            if qtype.name == "Q4_0":  # blocks of zeros only: d = -0.0 as llama.cpp's C writes (gguf-py +0.0 when x[0] is -0.0)
                zero = ~np.any(x32.reshape(-1, 32) != 0, axis=1)
                assert (got[zero, :2] == [0x00, 0x80]).all()
                ref[zero, :2] = [0x00, 0x80]
            assert np.array_equal(got, ref), f"{qtype.name}: {int((got != ref).any(axis=1).sum())} blocks differ"
