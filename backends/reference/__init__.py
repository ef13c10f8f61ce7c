"""The ``reference`` backend: the numpy reference of :mod:`quantcore.formats`, always available.

This is the semantics every backend reproduces (the conformance suite compares against the same
functions). The ``cpu`` backend (:mod:`quantcore.backends.cpu`) runs compiled host kernels and
falls back to these methods for anything it does not compile. Native arrays are numpy arrays;
torch CPU tensors are accepted and returned zero-copy.

Memory: the reference functions work in chunks of whole blocks and write straight into the
outputs the core allocated, so an op's temporaries are a few tens of MB whatever the tensor's size
(tests/test_cpu_memory.py); gemv_4bit dequantizes the weight a panel of rows at a time.
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


def _direct(out: np.ndarray, dtype=None) -> np.ndarray | None:
    """``out`` when the reference can write into it (contiguous, and of ``dtype`` if given)."""
    if out.flags.c_contiguous and (dtype is None or out.dtype == np.dtype(dtype)):
        return out
    return None


class ReferenceBackend(Backend):
    name = "reference"

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
            raise DeviceError(f"the {self.name} backend takes host arrays; this one is on {device_of(x)}. "
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
        pd, ad = _direct(packed, np.uint8), _direct(absmax, np.float32)
        p, a = bnb.quantize_4bit(_flat(x), blocksize, quant_type, packed=pd, absmax=ad)
        if pd is None:
            _store(packed, p)
        if ad is None:
            _store(absmax, a)

    def _absmax(self, absmax, nested: Nested | None) -> np.ndarray:
        if nested is None:
            return _flat(absmax)
        return bnb.dequantize_absmax(_flat(absmax), _flat(nested.absmax2), _flat(nested.offset)[0],
                                     _flat(nested.code2))

    def dequantize_4bit(self, packed, absmax, out, *, blocksize, quant_type, nested):
        od = _direct(out)
        vals = bnb.dequantize_4bit(packed, self._absmax(absmax, nested), out.size, blocksize,
                                   quant_type, out.dtype, out=od)
        if od is None:
            _store(out, vals)

    def double_quantize(self, absmax, qabsmax, absmax2, offset):
        qd, a2d = _direct(qabsmax, np.uint8), _direct(absmax2, np.float32)
        q, a2, off = bnb.double_quantize(_flat(absmax), qabsmax=qd, absmax2=a2d)
        if qd is None:
            _store(qabsmax, q)
        if a2d is None:
            _store(absmax2, a2)
        _store(offset, np.array([off], dtype=np.float32))

    def quantize_blockwise(self, x, thresholds, codes, absmax, *, blocksize):
        cd, ad = _direct(codes, np.uint8), _direct(absmax, np.float32)
        q, a = bnb.quantize_blockwise(_flat(x), blocksize, _flat(thresholds), codes=cd, absmax=ad)
        if cd is None:
            _store(codes, q)
        if ad is None:
            _store(absmax, a)

    def dequantize_blockwise(self, codes, absmax, code, out, *, blocksize):
        od = _direct(out)
        vals = bnb.dequantize_blockwise(codes, absmax, blocksize, out.dtype, _flat(code), out=od)
        if od is None:
            _store(out, vals)

    def gemv_4bit(self, a, packed, absmax, out, *, n, k, blocksize, quant_type, nested):
        # The weight is dequantized a panel of whole rows at a time (about bnb.CHUNK_ELEMS
        # elements), each output column computed by one fp32 matmul over all of K; only a row
        # longer than the chunk is split along K, its partial products summed in fp32.
        p = np.asarray(packed, dtype=np.uint8).reshape(-1)
        am = np.asarray(self._absmax(absmax, nested), dtype=np.float32).reshape(-1)
        code = bnb.code_4bit(quant_type)
        a32 = a.reshape(-1, k).astype(np.float32)
        direct = _direct(out, np.float32)
        shape = (a32.shape[0], n)
        res = np.empty(shape, np.float32) if direct is None else direct.reshape(shape)
        step = max(1, bnb.CHUNK_ELEMS)
        if k <= step:
            rows = max(1, step // max(k, 1))
            for r0 in range(0, n, rows):
                r1 = min(n, r0 + rows)
                w = bnb.dequantize_range_4bit(p, am, r0 * k, r1 * k, blocksize, code).reshape(r1 - r0, k)
                res[:, r0:r1] = a32 @ w.T
        else:
            for r in range(n):
                acc = np.zeros(a32.shape[0], np.float32)
                for k0 in range(0, k, step):
                    k1 = min(k, k0 + step)
                    w = bnb.dequantize_range_4bit(p, am, r * k + k0, r * k + k1, blocksize, code)
                    acc += a32[:, k0:k1] @ w
                res[:, r] = acc
        if direct is None:
            _store(out, res)

    # -- ggml ----------------------------------------------------------------------------------
    def _quantize_ggml(self, fn, x, out, width):
        x2 = x.reshape(-1, x.shape[-1])
        od = _direct(out, np.uint8)
        if od is not None and od.size == x2.size // ggml.QK * width:
            fn(x2, out=od.reshape(x2.shape[0], x2.shape[1] // ggml.QK, width))
        else:
            _store(out, fn(x2))

    def quantize_q4_0(self, w, out):
        self._quantize_ggml(ggml.quantize_q4_0, w, out, ggml.Q4_0_BLOCK_BYTES)

    def quantize_q8_0(self, a, out):
        self._quantize_ggml(ggml.quantize_q8_0, a, out, ggml.Q8_0_BLOCK_BYTES)

    def quantize_q8_1(self, a, out):
        self._quantize_ggml(ggml.quantize_q8_1, a, out, ggml.Q8_1_BLOCK_BYTES)

    def dequantize_ggml(self, q, out, *, fmt):
        width = ggml.BLOCK_BYTES[fmt]
        od = _direct(out)
        if q.ndim >= 2 and q.shape[-1] == width and q.size and od is not None \
                and od.size == q.size // width * ggml.QK:
            target = od.reshape(q.shape[:-2] + (q.shape[-2] * ggml.QK,))
        else:
            target = None
        if fmt == "q4_0":
            vals = ggml.dequantize_q4_0(q, out=target)
        else:
            vals = ggml.dequantize_q8(q, fmt, out=target)
        if target is None:
            _store(out, vals)

    def gemm_q4_0_q8_1(self, wq, aq, out):
        # The fp64 reference holds M x N x K/32 partial sums: computed in [mc, nc] output tiles
        # of about bnb.CHUNK_ELEMS of them (each output element is the same sum either way).
        m, n, nb = wq.shape[0], aq.shape[0], wq.shape[1]
        budget = max(1, bnb.CHUNK_ELEMS // max(nb, 1))
        nc = max(1, min(n, budget))
        mc = max(1, budget // nc)
        direct = _direct(out, np.float32)
        res = np.empty((m, n), np.float32) if direct is None else direct.reshape(m, n)
        for m0 in range(0, m, mc):
            for n0 in range(0, n, nc):
                res[m0 : m0 + mc, n0 : n0 + nc] = ggml.gemm_q4_0_q8_1(wq[m0 : m0 + mc], aq[n0 : n0 + nc])
        if direct is None:
            _store(out, res)

    def gemm_w4a8(self, wq, a, out):
        self.gemm_q4_0_q8_1(wq, ggml.quantize_q8_1(a.reshape(-1, a.shape[-1])), out)

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

    def linear_mx(self, x, codes, scales, out, *, n, k, fmt, swizzled, global_scale=None):
        g = None if global_scale is None else _flat(global_scale)[0]
        s = self._row_major_scales(scales, n, k, fmt, swizzled)
        direct = _direct(out)
        res = mx.linear_mx(x.reshape(-1, k), codes.reshape(n, k // 2), s, fmt, global_scale=g,
                           out_dtype=out.dtype)
        if direct is not None:
            direct.reshape(res.shape)[...] = res
        else:
            _store(out, res)


def create() -> ReferenceBackend:
    return ReferenceBackend()
