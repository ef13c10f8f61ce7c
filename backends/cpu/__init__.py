"""The ``cpu`` backend: the numpy reference of :mod:`quantcore.formats`, always available.

Native arrays are numpy arrays. torch CPU tensors are accepted and returned zero-copy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from quantcore import ops
from quantcore.arrays import array_kind, device_of, numpy_to_torch, torch_to_numpy
from quantcore.backend import Availability, Backend, Nested
from quantcore.errors import DeviceError
from quantcore.formats import bnb, ggml, mx


def _flat(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1)


def _store(out: np.ndarray, values: np.ndarray) -> None:
    out.reshape(-1)[...] = values.reshape(-1).astype(out.dtype, copy=False)


class CpuBackend(Backend):
    name = "cpu"

    def availability(self) -> Availability:
        return Availability(True, "numpy reference (always available)")

    def devices(self) -> list[str]:
        return ["cpu"]

    def capabilities(self):
        return ops.ALL_CAPABILITIES

    # -- arrays --------------------------------------------------------------------------------
    def prepare(self, x: Any) -> np.ndarray:
        kind = array_kind(x)
        if kind == "numpy":
            return np.ascontiguousarray(x)
        if kind == "torch" and x.device.type == "cpu":
            return torch_to_numpy(x)
        if kind in ("torch", "cupy", "usm"):
            raise DeviceError(f"the cpu backend takes host arrays; this one is on {device_of(x)}. "
                              "Move it to the host (.cpu()) or select the matching backend")
        return np.ascontiguousarray(np.asarray(x))

    def finish(self, native: np.ndarray, like: Any) -> Any:
        return numpy_to_torch(native) if array_kind(like) == "torch" else native

    def empty(self, shape, dtype, like=None) -> np.ndarray:
        return np.empty(shape, dtype=dtype)

    def from_numpy(self, a, like=None) -> np.ndarray:
        return np.array(a, copy=True)

    def to_numpy(self, x) -> np.ndarray:
        return np.array(x, copy=True)

    def view(self, buf, byte_offset, shape, dtype) -> np.ndarray:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return buf[byte_offset: byte_offset + nbytes].view(dtype).reshape(shape)

    # -- bitsandbytes --------------------------------------------------------------------------
    def quantize_4bit(self, x, packed, absmax, *, blocksize, quant_type):
        p, a = bnb.quantize_4bit(_flat(x), blocksize, quant_type)
        _store(packed, p)
        _store(absmax, a)

    def _absmax(self, absmax, nested: Nested | None) -> np.ndarray:
        if nested is None:
            return _flat(absmax)
        return bnb.dequantize_absmax(_flat(absmax), _flat(nested.absmax2), _flat(nested.offset)[0],
                                     _flat(nested.code2))

    def dequantize_4bit(self, packed, absmax, out, *, blocksize, quant_type, nested):
        vals = bnb.dequantize_4bit(packed, self._absmax(absmax, nested), out.size, blocksize,
                                   quant_type, out.dtype)
        _store(out, vals)

    def double_quantize(self, absmax, qabsmax, absmax2, offset):
        q, a2, off = bnb.double_quantize(_flat(absmax))
        _store(qabsmax, q)
        _store(absmax2, a2)
        _store(offset, np.array([off], dtype=np.float32))

    def quantize_blockwise(self, x, thresholds, codes, absmax, *, blocksize):
        q, a = bnb.quantize_blockwise(_flat(x), blocksize, _flat(thresholds))
        _store(codes, q)
        _store(absmax, a)

    def dequantize_blockwise(self, codes, absmax, code, out, *, blocksize):
        _store(out, bnb.dequantize_blockwise(codes, absmax, blocksize, out.dtype, _flat(code)))

    def gemv_4bit(self, a, packed, absmax, out, *, n, k, blocksize, quant_type, nested):
        w = bnb.dequantize_4bit(packed, self._absmax(absmax, nested), n * k, blocksize, quant_type,
                                np.float32).reshape(n, k)
        res = a.reshape(-1, k).astype(np.float32) @ w.T
        _store(out, res)

    # -- ggml ----------------------------------------------------------------------------------
    def quantize_q4_0(self, w, out):
        _store(out, ggml.quantize_q4_0(w.reshape(-1, w.shape[-1])))

    def quantize_q8_0(self, a, out):
        _store(out, ggml.quantize_q8_0(a.reshape(-1, a.shape[-1])))

    def quantize_q8_1(self, a, out):
        _store(out, ggml.quantize_q8_1(a.reshape(-1, a.shape[-1])))

    def dequantize_ggml(self, q, out, *, fmt):
        if fmt == "q4_0":
            vals = ggml.dequantize_q4_0(q)
        else:
            vals = ggml.dequantize_q8(q, fmt)
        _store(out, vals)

    def gemm_q4_0_q8_1(self, wq, aq, out):
        _store(out, ggml.gemm_q4_0_q8_1(wq, aq).astype(np.float32))

    def gemm_w4a8(self, wq, a, out):
        aq = ggml.quantize_q8_1(a.reshape(-1, a.shape[-1]))
        _store(out, ggml.gemm_q4_0_q8_1(wq, aq).astype(np.float32))

    # -- MX family (NVFP4, MXFP4, MXFP8) -------------------------------------------------------
    def mx_quantize(self, x, codes, scales, *, rows, cols, fmt, scale_mode, swizzled,
                    global_scale=None):
        g = None if global_scale is None else _flat(global_scale)[0]
        c, s = mx.quantize(x.reshape(rows, cols), fmt, scale_mode=scale_mode or "floor",
                           global_scale=g)
        _store(codes, c)
        _store(scales, mx.swizzle(s) if swizzled else s)

    def _row_major_scales(self, scales, rows, cols, fmt, swizzled):
        ncols = cols // mx.block_size(fmt)
        return mx.unswizzle(scales, rows, ncols) if swizzled else scales.reshape(rows, ncols)

    def mx_dequantize(self, codes, scales, out, *, rows, cols, fmt, swizzled, global_scale=None):
        g = None if global_scale is None else _flat(global_scale)[0]
        s = self._row_major_scales(scales, rows, cols, fmt, swizzled)
        q = codes.reshape(rows, mx.codes_cols(fmt, cols))
        _store(out, mx.dequantize(q, s, fmt, global_scale=g, out_dtype=out.dtype))

    def swizzle_scales(self, scales, out, *, rows, cols):
        _store(out, mx.swizzle(scales.reshape(rows, cols)))

    def unswizzle_scales(self, swz, out, *, rows, cols):
        _store(out, mx.unswizzle(swz, rows, cols))

    def scaled_fp4_mm(self, a, b, scale_a, scale_b, alpha, bias, out, *, m, n, k, fmt):
        bias_v = None if bias is None else _flat(bias)
        _store(out, mx.scaled_fp4_mm(a.reshape(m, k // 2), b.reshape(n, k // 2), scale_a, scale_b,
                                     _flat(alpha)[0], bias_v, fmt))


def create() -> CpuBackend:
    return CpuBackend()
