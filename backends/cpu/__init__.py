"""The ``cpu`` backend: compiled host kernels (C++17, OpenMP, SIMD), the numpy reference behind them.

The kernels (``kernels_cpu/qc_cpu.cpp``) are built at first use by the system C++ compiler and
cached (:mod:`quantcore.backends.cpu.build`, docs/cpu.md). Every op the library does not cover
(an unusual layout; linear_mx above its batch limit) runs the numpy reference of the ``reference`` backend, which
this class extends; without a compiler, or when the build fails, every op does, and
``quantcore info`` says so. Native arrays are numpy arrays; torch CPU tensors are accepted and
returned zero-copy.

Threads: ``QUANTCORE_NUM_THREADS`` (read when the backend is created) or :func:`set_num_threads`;
unset, OpenMP's default (``OMP_NUM_THREADS``, else one thread per core).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

from quantcore.backend import Availability, Nested
from quantcore.errors import ParameterError, QuantcoreError
from quantcore.formats import bnb, ggml, mx
from quantcore.formats.kernel_defines import DTYPE_CODE, GGML_FORMAT_CODE, LAUNCH_GEOMETRY, QUANT_TYPE_CODE

from ..reference import ReferenceBackend, _direct, _flat

#: Environment variable: the number of threads of the compiled kernels.
ENV_THREADS = "QUANTCORE_NUM_THREADS"

#: Ops the compiled library runs (for supported layouts); the others run the numpy reference.
COMPILED_OPS = ("quantize_4bit", "dequantize_4bit", "double_quantize", "gemv_4bit",
                "quantize_blockwise", "dequantize_blockwise", "quantize_q4_0", "quantize_q8_0",
                "quantize_q8_1", "dequantize_ggml", "gemm_q4_0_q8_1", "gemm_w4a8", "mx_quantize",
                "mx_dequantize", "swizzle_scales", "unswizzle_scales", "scaled_fp4_mm", "linear_mx")
NUMPY_OPS: tuple[str, ...] = ()
#: linear_mx's compiled kernel (decode: the weight decoded once for all rows) takes up to this many
#: input rows; more rows run the reference (the weight dequantized in panels, then a BLAS matmul)
MX_BATCH = LAUNCH_GEOMETRY["QC_CPU_MX_BATCH"]



def _ptr(a: np.ndarray | None) -> int | None:
    """The data address of ``a`` (None for None: a null pointer for ctypes)."""
    return None if a is None else a.__array_interface__["data"][0]


def _dtype_code(a: np.ndarray) -> int | None:
    return DTYPE_CODE.get(a.dtype.name)


def _f32_scalar(v) -> np.ndarray | None:
    """A scalar array argument (global scale, alpha) as one contiguous fp32 value, or None."""
    return None if v is None else np.ascontiguousarray(_flat(v)[:1], dtype=np.float32)


def _threads_from_env() -> int:
    raw = os.environ.get(ENV_THREADS, "").strip()
    if not raw:
        return 0
    try:
        n = int(raw)
    except ValueError:
        raise ParameterError(f"{ENV_THREADS}={raw!r} is not an integer") from None
    if n < 0:
        raise ParameterError(f"{ENV_THREADS}={raw!r} must be >= 0 (0: the OpenMP default)")
    return n


class CpuBackend(ReferenceBackend):
    name = "cpu"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lib: Any = None
        self._tried = False
        self._why_not = ""
        self._path = ""
        self._threads = _threads_from_env()
        self._scratch = threading.local()

    # -- the library ---------------------------------------------------------------------------
    def library(self) -> Any:
        """The loaded kernel library, built at the first call; None when it cannot be (see
        :meth:`availability` for why)."""
        if self._tried:
            return self._lib
        with self._lock:
            if not self._tried:
                from . import build

                try:
                    path = build.build()
                    self._lib = build.load(path)
                    self._path = str(path)
                except (QuantcoreError, OSError) as exc:
                    self._why_not = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
                    self._lib = None
                self._tried = True
        return self._lib

    @property
    def compiled(self) -> bool:
        return self.library() is not None

    def set_num_threads(self, n: int) -> None:
        """Threads of the compiled kernels; 0 restores the OpenMP default."""
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
            raise ParameterError(f"the number of threads must be an integer >= 0, got {n!r}")
        self._threads = int(n)

    def num_threads(self) -> int:
        """The threads the compiled kernels use (the OpenMP default when none was set)."""
        lib = self.library()
        if self._threads:
            return self._threads
        return int(lib.qc_cpu_max_threads()) if lib is not None else 1

    def availability(self) -> Availability:
        lib = self.library()
        if lib is None:
            return Availability(True, "numpy reference (always available)",
                                mode=f"numpy fallback, no compiled kernels: {self._why_not}")
        info = lib.qc_cpu_build_info().decode()
        return Availability(True, "compiled host kernels",
                            mode=f"compiled host kernels ({info}, {self.num_threads()} threads)"
                                 + (f"; numpy reference for {', '.join(NUMPY_OPS)}" if NUMPY_OPS else ""))

    # -- bitsandbytes --------------------------------------------------------------------------
    def quantize_4bit(self, x, packed, absmax, *, blocksize, quant_type):
        lib, dt = self.library(), _dtype_code(x)
        pd, ad = _direct(packed, np.uint8), _direct(absmax, np.float32)
        n = x.size
        if (lib is None or dt is None or pd is None or ad is None or pd.size != (n + 1) // 2
                or ad.size != bnb.nblocks(n, blocksize)):
            return super().quantize_4bit(x, packed, absmax, blocksize=blocksize, quant_type=quant_type)
        lib.qc_quantize_4bit(_ptr(x), dt, _ptr(pd), _ptr(ad), n, blocksize, QUANT_TYPE_CODE[quant_type],
                             self._threads)

    def _nested_args(self, absmax, nested: Nested | None, nblocks: int):
        """(absmax, absmax2, code2, offset) pointers for the library, or None."""
        if nested is None:
            if absmax.dtype != np.float32 or absmax.size < nblocks:
                return None
            return (_ptr(absmax), None, None, None)
        a2, c2, off = nested.absmax2, nested.code2, nested.offset
        if (absmax.dtype != np.uint8 or absmax.size < nblocks or a2.dtype != np.float32
                or a2.size < bnb.nblocks(nblocks, bnb.NESTED_BLOCKSIZE) or c2.dtype != np.float32
                or c2.size != bnb.DYNAMIC_MAP.size or off.dtype != np.float32 or off.size < 1):
            return None
        return (_ptr(absmax), _ptr(a2), _ptr(c2), _ptr(off))

    def dequantize_4bit(self, packed, absmax, out, *, blocksize, quant_type, nested):
        lib, od = self.library(), _direct(out)
        n = out.size
        args = None if lib is None else self._nested_args(absmax, nested, bnb.nblocks(n, blocksize))
        if (args is None or od is None or _dtype_code(od) is None or packed.dtype != np.uint8
                or 2 * packed.size < n):
            return super().dequantize_4bit(packed, absmax, out, blocksize=blocksize,
                                           quant_type=quant_type, nested=nested)
        lib.qc_dequantize_4bit(_ptr(packed), *args, _ptr(od), _dtype_code(od), n, blocksize,
                               QUANT_TYPE_CODE[quant_type], self._threads)

    def double_quantize(self, absmax, qabsmax, absmax2, offset):
        lib = self.library()
        qd, a2d, od = _direct(qabsmax, np.uint8), _direct(absmax2, np.float32), _direct(offset, np.float32)
        nb = absmax.size
        if (lib is None or absmax.dtype != np.float32 or qd is None or a2d is None or od is None
                or qd.size != nb or a2d.size != bnb.nblocks(nb, bnb.NESTED_BLOCKSIZE) or od.size != 1):
            return super().double_quantize(absmax, qabsmax, absmax2, offset)
        lib.qc_double_quantize(_ptr(absmax), _ptr(qd), _ptr(a2d), _ptr(od), nb, self._threads)

    def quantize_blockwise(self, x, thresholds, codes, absmax, *, blocksize):
        lib, dt = self.library(), _dtype_code(x)
        cd, ad = _direct(codes, np.uint8), _direct(absmax, np.float32)
        th = np.ascontiguousarray(_flat(thresholds), dtype=np.float32)
        n = x.size
        if (lib is None or dt is None or cd is None or ad is None or cd.size != n
                or ad.size != bnb.nblocks(n, blocksize) or th.size != bnb.DYNAMIC_THRESHOLDS.size):
            return super().quantize_blockwise(x, thresholds, codes, absmax, blocksize=blocksize)
        lib.qc_quantize_blockwise(_ptr(x), dt, _ptr(th), _ptr(cd), _ptr(ad), n, blocksize, self._threads)

    def dequantize_blockwise(self, codes, absmax, code, out, *, blocksize):
        lib, od = self.library(), _direct(out)
        cf = np.ascontiguousarray(_flat(code), dtype=np.float32)
        n = out.size
        if (lib is None or od is None or _dtype_code(od) is None or codes.dtype != np.uint8
                or codes.size != n or absmax.dtype != np.float32
                or absmax.size < bnb.nblocks(n, blocksize) or cf.size != bnb.DYNAMIC_MAP.size):
            return super().dequantize_blockwise(codes, absmax, code, out, blocksize=blocksize)
        lib.qc_dequantize_blockwise(_ptr(codes), _ptr(absmax), _ptr(cf), _ptr(od), _dtype_code(od), n,
                                    blocksize, self._threads)

    def gemv_4bit(self, a, packed, absmax, out, *, n, k, blocksize, quant_type, nested):
        lib, dt, od = self.library(), _dtype_code(a), _direct(out)
        rows = a.size // k if k else 0
        args = None if lib is None else self._nested_args(absmax, nested, bnb.nblocks(n * k, blocksize))
        if (args is None or dt is None or od is None or od.dtype != a.dtype or k == 0
                or a.size != rows * k or od.size != rows * n or packed.dtype != np.uint8
                or 2 * packed.size < n * k):
            return super().gemv_4bit(a, packed, absmax, out, n=n, k=k, blocksize=blocksize,
                                     quant_type=quant_type, nested=nested)
        lib.qc_gemv_4bit(_ptr(a), dt, _ptr(packed), *args, _ptr(od), rows, n, k, blocksize,
                         QUANT_TYPE_CODE[quant_type], self._threads)

    # -- ggml ----------------------------------------------------------------------------------
    def _ggml_quantize(self, x, out, fmt: str) -> bool:
        lib, dt, od = self.library(), _dtype_code(x), _direct(out, np.uint8)
        if (lib is None or dt is None or od is None or x.ndim == 0 or x.shape[-1] % ggml.QK
                or od.size != x.size // ggml.QK * ggml.BLOCK_BYTES[fmt]):
            return False
        getattr(lib, f"qc_quantize_{fmt}")(_ptr(x), dt, _ptr(od), x.size // ggml.QK, self._threads)
        return True

    def quantize_q4_0(self, w, out):
        if not self._ggml_quantize(w, out, "q4_0"):
            super().quantize_q4_0(w, out)

    def quantize_q8_0(self, a, out):
        if not self._ggml_quantize(a, out, "q8_0"):
            super().quantize_q8_0(a, out)

    def quantize_q8_1(self, a, out):
        if not self._ggml_quantize(a, out, "q8_1"):
            super().quantize_q8_1(a, out)

    def dequantize_ggml(self, q, out, *, fmt):
        lib, od = self.library(), _direct(out)
        width = ggml.BLOCK_BYTES[fmt]
        if (lib is None or od is None or _dtype_code(od) is None or q.dtype != np.uint8 or q.ndim < 2
                or q.shape[-1] != width or od.size != q.size // width * ggml.QK):
            return super().dequantize_ggml(q, out, fmt=fmt)
        lib.qc_dequantize_ggml(_ptr(q), GGML_FORMAT_CODE[fmt], _ptr(od), _dtype_code(od), q.size // width,
                               self._threads)

    def _gemm_ok(self, wq, aq, out) -> np.ndarray | None:
        od = _direct(out, np.float32)
        if (self.library() is None or od is None or wq.dtype != np.uint8 or aq.dtype != np.uint8
                or wq.ndim != 3 or aq.ndim != 3 or wq.shape[2] != ggml.Q4_0_BLOCK_BYTES
                or aq.shape[2] != ggml.Q8_1_BLOCK_BYTES or wq.shape[1] != aq.shape[1]
                or od.size != wq.shape[0] * aq.shape[0]):
            return None
        return od

    def gemm_q4_0_q8_1(self, wq, aq, out):
        od = self._gemm_ok(wq, aq, out)
        if od is None:
            return super().gemm_q4_0_q8_1(wq, aq, out)
        self._lib.qc_gemm_q4_0_q8_1(_ptr(wq), _ptr(aq), _ptr(od), wq.shape[0], aq.shape[0],
                                    wq.shape[1] * ggml.QK, self._threads)

    def _q8_scratch(self, rows: int, nb: int) -> np.ndarray:
        """A per-thread buffer for the Q8_1 activation of gemm_w4a8, kept between calls."""
        buf = getattr(self._scratch, "q8", None)
        need = rows * nb * ggml.Q8_1_BLOCK_BYTES
        if buf is None or buf.size < need:
            buf = np.empty(need, np.uint8)
            self._scratch.q8 = buf
        return buf[:need].reshape(rows, nb, ggml.Q8_1_BLOCK_BYTES)

    def gemm_w4a8(self, wq, a, out):
        lib, dt = self.library(), _dtype_code(a)
        if lib is None or dt is None or a.ndim == 0 or a.shape[-1] % ggml.QK or wq.ndim != 3:
            return super().gemm_w4a8(wq, a, out)
        rows, nb = a.size // a.shape[-1], a.shape[-1] // ggml.QK
        aq = self._q8_scratch(rows, nb)
        lib.qc_quantize_q8_1(_ptr(a), dt, _ptr(aq), rows * nb, self._threads)
        self.gemm_q4_0_q8_1(wq, aq, out)

    # -- MX family: quantize, dequantize, the scale layout, scaled_fp4_mm and linear_mx compiled
    def _mx_scales_size(self, rows: int, cols: int, fmt: str, swizzled: bool) -> int:
        ncols = cols // mx.block_size(fmt)
        return int(np.prod(mx.swizzled_shape(rows, ncols))) if swizzled else rows * ncols

    def mx_quantize(self, x, codes, scales, *, rows, cols, fmt, scale_mode, swizzled,
                    global_scale=None):
        lib, dt = self.library(), _dtype_code(x)
        oc, osc = _direct(codes, np.uint8), _direct(scales, np.uint8)
        mode = scale_mode or "floor"
        if (lib is None or dt is None or oc is None or osc is None or x.size != rows * cols
                or not x.flags.c_contiguous
                or cols % mx.block_size(fmt) or oc.size != rows * mx.codes_cols(fmt, cols)
                or osc.size != self._mx_scales_size(rows, cols, fmt, swizzled)
                or mode not in mx.SCALE_MODE_CODE or (fmt == "nvfp4") != (global_scale is not None)):
            return super().mx_quantize(x, codes, scales, rows=rows, cols=cols, fmt=fmt,
                                       scale_mode=scale_mode, swizzled=swizzled,
                                       global_scale=global_scale)
        g = _f32_scalar(global_scale)
        lib.qc_mx_quantize(_ptr(x), dt, _ptr(oc), _ptr(osc), rows, cols, mx.MX_FORMAT_CODE[fmt],
                           mx.SCALE_MODE_CODE[mode], int(bool(swizzled)), _ptr(g),
                           self._threads)

    def scaled_fp4_mm(self, a, b, scale_a, scale_b, alpha, bias, out, *, m, n, k, fmt):
        lib, od = self.library(), _direct(out)
        blk = mx.block_size(fmt)
        if (lib is None or od is None or od.dtype.name != "bfloat16" or od.size != m * n
                or fmt not in mx.FP4_FORMATS or k % blk or a.dtype != np.uint8 or b.dtype != np.uint8
                or a.size != m * k // 2 or b.size != n * k // 2 or scale_a.dtype != np.uint8
                or scale_b.dtype != np.uint8
                or scale_a.size != int(np.prod(mx.swizzled_shape(m, k // blk)))
                or scale_b.size != int(np.prod(mx.swizzled_shape(n, k // blk)))
                or (bias is not None and np.asarray(bias).size != n)):
            return super().scaled_fp4_mm(a, b, scale_a, scale_b, alpha, bias, out, m=m, n=n, k=k,
                                         fmt=fmt)
        bias16 = None if bias is None else np.ascontiguousarray(_flat(bias))  # bfloat16 (the core checked)
        lib.qc_scaled_fp4_mm(_ptr(np.ascontiguousarray(a)), _ptr(np.ascontiguousarray(b)),
                             _ptr(np.ascontiguousarray(scale_a)), _ptr(np.ascontiguousarray(scale_b)),
                             _ptr(_f32_scalar(alpha)), _ptr(bias16), _ptr(od), m, n, k,
                             mx.MX_FORMAT_CODE[fmt], self._threads)

    def linear_mx(self, x, codes, scales, out, *, n, k, fmt, swizzled, global_scale=None):
        lib, od, xd = self.library(), _direct(out), _direct(x)
        blk = mx.block_size(fmt)
        batch = x.size // k if k else 0
        nscales = int(np.prod(mx.swizzled_shape(n, k // blk))) if swizzled else n * (k // blk)
        if (lib is None or od is None or xd is None or _dtype_code(xd) is None or od.dtype != xd.dtype
                or od.size != batch * n or fmt not in mx.FP4_FORMATS or k % blk or codes.dtype != np.uint8
                or not codes.flags.c_contiguous or codes.size != n * k // 2 or scales.dtype != np.uint8
                or not scales.flags.c_contiguous or scales.size != nscales
                or (fmt == "nvfp4") != (global_scale is not None) or not 0 < batch <= MX_BATCH):
            return super().linear_mx(x, codes, scales, out, n=n, k=k, fmt=fmt, swizzled=swizzled,
                                     global_scale=global_scale)
        g = _f32_scalar(global_scale)
        lib.qc_linear_mx(_ptr(xd), _dtype_code(xd), _ptr(codes), _ptr(scales), _ptr(g),
                         _ptr(od), batch, n, k, mx.MX_FORMAT_CODE[fmt], int(bool(swizzled)), self._threads)

    def mx_dequantize(self, codes, scales, out, *, rows, cols, fmt, swizzled, global_scale=None):
        lib, od = self.library(), _direct(out)
        blk = mx.block_size(fmt)
        nscales = (int(np.prod(mx.swizzled_shape(rows, cols // blk))) if swizzled
                   else rows * (cols // blk))
        g = _f32_scalar(global_scale)
        if (lib is None or od is None or _dtype_code(od) is None or od.size != rows * cols
                or codes.dtype != np.uint8 or codes.size != rows * mx.codes_cols(fmt, cols)
                or scales.dtype != np.uint8 or scales.size != nscales
                or (fmt == "nvfp4") != (global_scale is not None)):
            return super().mx_dequantize(codes, scales, out, rows=rows, cols=cols, fmt=fmt,
                                         swizzled=swizzled, global_scale=global_scale)
        lib.qc_mx_dequantize(_ptr(codes), _ptr(scales), _ptr(od), _dtype_code(od), rows, cols,
                             mx.MX_FORMAT_CODE[fmt], int(bool(swizzled)), _ptr(g),
                             self._threads)

    def swizzle_scales(self, scales, out, *, rows, cols):
        lib, od = self.library(), _direct(out, np.uint8)
        if (lib is None or od is None or scales.dtype != np.uint8 or scales.size != rows * cols
                or od.size != int(np.prod(mx.swizzled_shape(rows, cols)))):
            return super().swizzle_scales(scales, out, rows=rows, cols=cols)
        lib.qc_swizzle_scales(_ptr(scales), _ptr(od), rows, cols, self._threads)

    def unswizzle_scales(self, swz, out, *, rows, cols):
        lib, od = self.library(), _direct(out, np.uint8)
        if (lib is None or od is None or swz.dtype != np.uint8 or od.size != rows * cols
                or swz.size != int(np.prod(mx.swizzled_shape(rows, cols)))):
            return super().unswizzle_scales(swz, out, rows=rows, cols=cols)
        lib.qc_unswizzle_scales(_ptr(swz), _ptr(od), rows, cols, self._threads)


def create() -> CpuBackend:
    return CpuBackend()


def set_num_threads(n: int) -> None:
    """Threads of the registered ``cpu`` backend's compiled kernels (0: the OpenMP default)."""
    from quantcore.registry import get_backend

    be = get_backend("cpu")
    be.set_num_threads(n)


def get_num_threads() -> int:
    """Threads the registered ``cpu`` backend's compiled kernels use."""
    from quantcore.registry import get_backend

    return get_backend("cpu").num_threads()
