"""The ``maca`` backend: MetaX MACA kernels (``kernels_maca/*.maca``) behind a C ABI.

On a MetaX machine the sources build with the SDK's mxcc against the MACA runtime; on an NVIDIA
machine they build with nvcc through the CUDA compatibility header (``kernels_maca/compat``), so
the MACA kernels are validated for real there (availability reports that mode). See
:mod:`quantcore.backends.maca.build` and docs/maca.md.

Native arrays are torch "cuda" tensors (MetaX's PyTorch also calls its device "cuda"); CuPy
arrays are accepted through DLPack. Kernels launch on torch's current stream of the tensor's
device. Every launcher returns an mcError_t; a non-zero one becomes a
:class:`~quantcore.errors.KernelError` carrying the runtime's message.
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
import threading
from typing import Any

import numpy as np

from quantcore import ops
from quantcore.arrays import array_kind, as_dtype, device_of, dtype_name
from quantcore.backend import Availability, Backend, Nested, grouped_run_end, grouped_run_padded
from quantcore.errors import BackendUnavailableError, DeviceError, KernelError
from quantcore.formats import ggml, kernel_interface, mx
from quantcore.formats.kernel_defines import DTYPE_CODE, GGML_FORMAT_CODE, QUANT_TYPE_CODE, TILED_MIN_ROWS
from quantcore.formats.kernel_interface import GEMV_TC_GROUPS

from . import build

COMPAT_MODE = "validated through the CUDA compatibility header"
MXCC_MODE = "MetaX MACA (mxcc)"

def _torch():
    import torch

    return torch


def _torch_installed() -> bool:
    return "torch" in sys.modules or importlib.util.find_spec("torch") is not None


def _dtype_code(t) -> int:
    return DTYPE_CODE[dtype_name(t.dtype)]


def _nested_args(nested: Nested | None) -> tuple:
    return (None, None, None) if nested is None else (nested.absmax2, nested.code2, nested.offset)


def _load_library(path: str, toolchain: build.Toolchain) -> ctypes.CDLL:
    if toolchain.mode == build.MODE_MXCC:  # make the MACA runtime resolvable without LD_LIBRARY_PATH
        ctypes.CDLL(f"{toolchain.maca_path}/lib/libmcruntime.so", mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(path)
    # every launcher's result and argument types, from the one declaration of the kernel interface
    for name, (res, args) in kernel_interface.ctypes_signatures(kernel_interface.MACA).items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


class MacaBackend(Backend):
    name = "maca"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._availability: Availability | None = None
        self._toolchain: build.Toolchain | None = None
        self._lib: ctypes.CDLL | None = None
        self.library_path: str | None = None
        self._caps = frozenset(ops.bnb_capabilities() + ops.ggml_capabilities() + ops.mx_capabilities())

    # -- discovery -----------------------------------------------------------------------------
    def availability(self) -> Availability:
        if self._availability is None:
            self._availability, self._toolchain = self._detect()
        return self._availability

    def _detect(self) -> tuple[Availability, build.Toolchain | None]:
        # Driver-level checks only: importing quantcore (and asking every backend whether it is
        # available) must not import torch.
        torch_hint = "" if _torch_installed() else (
            "; PyTorch is not installed, and the maca backend's arrays are torch 'cuda' tensors")
        maca_path = build.find_maca_path()
        if maca_path is not None:
            if build.metax_gpu_count(maca_path) == 0:
                return Availability(False, f"the MetaX SDK is at {maca_path}, but the MACA runtime "
                                    "reports no MetaX device (mcGetDeviceCount)"), None
            if torch_hint:
                return Availability(False, f"MetaX SDK at {maca_path}{torch_hint} (use MetaX's "
                                    "PyTorch build)"), None
            tc = build.Toolchain(build.MODE_MXCC, build.mxcc_path(maca_path), maca_path=maca_path)
            return Availability(True, f"MetaX SDK at {maca_path}", MXCC_MODE), tc
        gpus = build.nvidia_gpus()
        if not gpus:
            hint = " (mx-smi found: set MACA_PATH to the MetaX SDK)" if build.metax_driver_present() else ""
            return Availability(False, "no MetaX SDK (MACA_PATH) and no NVIDIA GPU for the "
                                f"compatibility mode{hint}"), None
        nvcc = build.find_nvcc()
        if nvcc is None:
            return Availability(False, "no MetaX SDK (MACA_PATH), and no nvcc for the compatibility "
                                f"mode on the {gpus[0].name}: install the CUDA toolkit or set "
                                "CUDA_HOME"), None
        if torch_hint:
            return Availability(False, f"compatibility mode on the {gpus[0].name}{torch_hint}"), None
        archs = tuple(sorted({g.arch for g in gpus}))
        tc = build.Toolchain(build.MODE_NVCC_COMPAT, nvcc, archs=archs)
        return Availability(True, f"no MetaX SDK; the MACA sources build with {nvcc} for the "
                            f"{gpus[0].name} ({', '.join(archs)})", COMPAT_MODE), tc

    def devices(self) -> list[str]:
        if not self.availability():
            return []
        return [f"cuda:{i}" for i in range(_torch().cuda.device_count())]

    def capabilities(self):
        return self._caps  # built once, in __init__: the core asks supports() on every call

    # -- the library ---------------------------------------------------------------------------
    def library(self) -> ctypes.CDLL:
        """The built and loaded ``libqc_maca.so`` (built at first use, cached on disk)."""
        if self._lib is None:
            with self._lock:
                if self._lib is None:
                    avail = self.availability()
                    if not avail:
                        raise BackendUnavailableError(f"maca backend unavailable: {avail.reason}")
                    if not _torch().cuda.is_available():
                        raise BackendUnavailableError(
                            "maca backend unavailable: this PyTorch build sees no GPU (its 'cuda' "
                            "tensors are the backend's arrays); install a CUDA or MetaX build of PyTorch")
                    path = str(build.build_library(self._toolchain))
                    lib = _load_library(path, self._toolchain)
                    self._check_wave_size(lib)
                    self.library_path, self._lib = path, lib
        return self._lib

    def _check_wave_size(self, lib: ctypes.CDLL) -> None:
        compiled = lib.qc_maca_wave_size()
        for dev in range(_torch().cuda.device_count()):
            reported = ctypes.c_int(0)
            self._check(lib, "device_wave_size", lib.qc_maca_device_wave_size(dev, ctypes.byref(reported)))
            if reported.value != compiled:
                raise KernelError(f"maca: the kernels were compiled for {compiled}-lane waves but "
                                  f"device {dev} reports {reported.value}")

    @staticmethod
    def _check(lib: ctypes.CDLL, op: str, rc: int) -> None:
        if rc != 0:
            msg = lib.qc_maca_error_string(rc).decode(errors="replace")
            raise KernelError(f"maca {op} failed: {msg} (mcError_t {rc})")

    def _launch(self, op: str, like, *args) -> None:
        """Call ``qc_maca_<op>(*args, stream)`` on ``like``'s device and current stream."""
        lib = self.library()
        torch = _torch()
        dev = like.device
        c_args = [a.data_ptr() if hasattr(a, "data_ptr") else a for a in args]
        with torch.cuda.device(dev):
            self._check(lib, "set_device", lib.qc_maca_set_device(dev.index))
            stream = torch.cuda.current_stream(dev).cuda_stream
            rc = getattr(lib, f"qc_maca_{op}")(*c_args, stream)
        self._check(lib, op, rc)

    # -- arrays --------------------------------------------------------------------------------
    def _device(self, like: Any = None):
        torch = _torch()
        if array_kind(like) == "torch" and like.device.type == "cuda":
            return like.device
        return torch.device("cuda", torch.cuda.current_device())

    @staticmethod
    def _torch_dtype(dtype):
        return getattr(_torch(), dtype_name(as_dtype(dtype)))

    def prepare(self, x: Any):
        kind = array_kind(x)
        if kind == "torch" and x.device.type == "cuda":
            return x.contiguous()
        if kind == "cupy":
            return _torch().from_dlpack(x).contiguous()
        raise DeviceError(f"the maca backend takes device arrays (torch 'cuda' tensors or CuPy); this "
                          f"{kind} array is on {device_of(x)}. Move it to the device (.cuda()) or "
                          "select the cpu backend")

    def finish(self, native, like: Any):
        if array_kind(like) == "cupy":
            import cupy

            return cupy.from_dlpack(native)
        return native

    def empty(self, shape, dtype, like=None):
        return _torch().empty(tuple(shape), dtype=self._torch_dtype(dtype), device=self._device(like))

    def from_numpy(self, a: np.ndarray, like=None):
        torch = _torch()
        a = np.ascontiguousarray(a)
        if a.size == 0:
            return torch.empty(a.shape, dtype=self._torch_dtype(a.dtype), device=self._device(like))
        host = torch.from_numpy(a.reshape(-1).view(np.uint8).copy()).view(self._torch_dtype(a.dtype))
        return host.reshape(a.shape).to(self._device(like))

    def to_numpy(self, x) -> np.ndarray:
        t = x.detach().contiguous().cpu()
        npdt = as_dtype(t.dtype)
        raw = t.reshape(-1).view(_torch().uint8).numpy()
        return raw.view(npdt).reshape(tuple(t.shape)).copy()

    def view(self, buf, byte_offset, shape, dtype):
        nbytes = int(np.prod(shape)) * np.dtype(as_dtype(dtype)).itemsize
        return buf[byte_offset: byte_offset + nbytes].view(self._torch_dtype(dtype)).view(tuple(shape))

    def synchronize(self) -> None:
        if "torch" in sys.modules and self.availability():
            _torch().cuda.synchronize()

    # -- bitsandbytes --------------------------------------------------------------------------
    def quantize_4bit(self, x, packed, absmax, *, blocksize, quant_type):
        self._launch("quantize_4bit", x, x, _dtype_code(x), packed, absmax, x.numel(), blocksize,
                     QUANT_TYPE_CODE[quant_type])

    def dequantize_4bit(self, packed, absmax, out, *, blocksize, quant_type, nested):
        self._launch("dequantize_4bit", out, packed, absmax, *_nested_args(nested), out,
                     _dtype_code(out), out.numel(), blocksize, QUANT_TYPE_CODE[quant_type])

    def double_quantize(self, absmax, qabsmax, absmax2, offset):
        self._launch("double_quantize", absmax, absmax, qabsmax, absmax2, offset, absmax.numel())

    def quantize_blockwise(self, x, thresholds, codes, absmax, *, blocksize):
        self._launch("quantize_blockwise", x, x, _dtype_code(x), thresholds, codes, absmax,
                     x.numel(), blocksize)

    def dequantize_blockwise(self, codes, absmax, code, out, *, blocksize):
        self._launch("dequantize_blockwise", out, codes, absmax, code, out, _dtype_code(out),
                     out.numel(), blocksize)

    def gemv_4bit(self, a, packed, absmax, out, *, n, k, blocksize, quant_type, nested):
        rows = out.numel() // n
        # many rows: output tiles (tiled.maca), the weight read once per tile; else one wave per row
        op = "gemv_4bit_tiled" if rows >= TILED_MIN_ROWS else "gemv_4bit"
        self._launch(op, out, a, _dtype_code(a), packed, absmax, *_nested_args(nested), out,
                     rows, n, k, blocksize, QUANT_TYPE_CODE[quant_type])

    def gemv_4bit_grouped(self, a, groups, out, *, k):
        """Below TILED_MIN_ROWS rows one launch per run of up to GEMV_TC_GROUPS weights of one quant
        type, blocksize and nesting (a wave per row of all of them, each weight into its columns);
        with more rows each weight's tiled gemv into its columns' copy."""
        rows = out.numel() // out.shape[-1]
        ntot = out.shape[-1]
        col, i = 0, 0
        while i < len(groups):
            p, am, nst, n, bs, qt = groups[i]
            if rows >= TILED_MIN_ROWS:
                tmp = self.empty((rows, n), dtype_name(out.dtype), like=out)
                self.gemv_4bit(a, p, am, tmp, n=n, k=k, blocksize=bs, quant_type=qt, nested=nst)
                out[:, col:col + n] = tmp
                col, i = col + n, i + 1
                continue
            j = grouped_run_end(groups, i, GEMV_TC_GROUPS, lambda g, nested=nst is None: (g[2] is None) == nested)
            weights = []
            for g in grouped_run_padded(groups, i, j, GEMV_TC_GROUPS):
                weights += [g[0], g[1], *_nested_args(g[2]), g[3]]
            self._launch("gemv_4bit_grouped", out, a, _dtype_code(a), *weights, out[:, col:] if col else out, ntot,
                         rows, j - i, k, bs, QUANT_TYPE_CODE[qt])
            col, i = col + sum(g[3] for g in groups[i:j]), j

    # -- ggml ----------------------------------------------------------------------------------
    def quantize_q4_0(self, w, out):
        self._launch("quantize_q4_0", out, w, _dtype_code(w), out, w.numel() // ggml.QK)

    def quantize_q8_0(self, a, out):
        self._launch("quantize_q8_0", out, a, _dtype_code(a), out, a.numel() // ggml.QK)

    def quantize_q8_1(self, a, out):
        self._launch("quantize_q8_1", out, a, _dtype_code(a), out, a.numel() // ggml.QK)

    def dequantize_ggml(self, q, out, *, fmt):
        self._launch("dequantize_ggml", out, q, GGML_FORMAT_CODE[fmt], out, _dtype_code(out),
                     out.numel() // ggml.QK)

    def _gemm(self, wq, act, out, quantized: bool) -> None:
        """The W4A8 GEMMs' one dispatch point. N < TILED_MIN_ROWS: the few-rows kernel (the
        activation quantized inside for gemm_w4a8). Many rows: a float activation is quantized to
        Q8_1 once (quantize_q8_1's kernel: the same bytes), then the tiled kernel (tiled.maca)."""
        m, n = out.shape
        k = wq.numel() // (m * ggml.Q4_0_BLOCK_BYTES) * ggml.QK
        if n < TILED_MIN_ROWS:
            if quantized:
                self._launch("gemm_q4_0_q8_1", out, wq, act, out, m, n, k)
            else:
                self._launch("gemm_w4a8", out, wq, act, _dtype_code(act), out, m, n, k)
            return
        if not quantized:  # torch's stream-ordered allocator keeps the temporary until the GEMM ran
            aq = self.empty((n * (k // ggml.QK) * ggml.Q8_1_BLOCK_BYTES,), np.uint8, like=out)
            self._launch("quantize_q8_1", out, act, _dtype_code(act), aq, n * (k // ggml.QK))
            act = aq
        self._launch("gemm_q4_0_q8_1_tiled", out, wq, act, out, m, n, k)

    def gemm_q4_0_q8_1(self, wq, aq, out):
        self._gemm(wq, aq, out, quantized=True)

    def gemm_w4a8(self, wq, a, out):
        self._gemm(wq, a, out, quantized=False)

    # -- MX (NVFP4, MXFP4, MXFP8) --------------------------------------------------------------
    # Formats and scale modes go to the launchers as mx.MX_FORMAT_CODE / SCALE_MODE_CODE; the
    # global scale and alpha stay fp32 [1] device arrays (None is a null pointer).
    def mx_quantize(self, x, codes, scales, *, rows, cols, fmt, scale_mode, swizzled, global_scale=None):
        self._launch("mx_quantize", x, x, _dtype_code(x), codes, scales, rows, cols, mx.MX_FORMAT_CODE[fmt],
                     mx.SCALE_MODE_CODE[scale_mode or "floor"], int(swizzled), global_scale)

    def mx_dequantize(self, codes, scales, out, *, rows, cols, fmt, swizzled, global_scale=None):
        self._launch("mx_dequantize", out, codes, scales, out, _dtype_code(out), rows, cols,
                     mx.MX_FORMAT_CODE[fmt], int(swizzled), global_scale)

    def swizzle_scales(self, scales, out, *, rows, cols):
        self._launch("swizzle_scales", out, scales, out, rows, cols)

    def unswizzle_scales(self, swz, out, *, rows, cols):
        self._launch("unswizzle_scales", out, swz, out, rows, cols)

    def scaled_fp4_mm(self, a, b, scale_a, scale_b, alpha, bias, out, *, m, n, k, fmt):
        self._launch("scaled_fp4_mm", out, a, b, scale_a, scale_b, alpha, bias, out, m, n, k,
                     mx.MX_FORMAT_CODE[fmt])

    def linear_mx(self, x, codes, scales, out, *, n, k, fmt, swizzled, global_scale=None):
        self._launch("linear_mx", out, x, _dtype_code(x), codes, scales, global_scale, out, x.numel() // k, n, k,
                     mx.MX_FORMAT_CODE[fmt], int(swizzled))


def create() -> MacaBackend:
    return MacaBackend()
