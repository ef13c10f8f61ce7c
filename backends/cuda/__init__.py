"""The ``cuda`` backend: kernels_cuda/*.cu compiled at run time by NVRTC, launched through CuPy.

- Native arrays are the caller's own: torch CUDA tensors or CuPy arrays, used zero-copy (pointers
  are passed to the kernels); results come back as the same kind. A host array raises
  :class:`~quantcore.errors.DeviceError`.
- Every op launches on the caller's current stream (torch's current stream for torch tensors,
  CuPy's for CuPy arrays), does no host synchronization and allocates nothing beyond the outputs
  it is given (one exception: the W4A8 GEMM above the stream kernel's rows takes a workspace for
  the quantized activation from the caller's own allocator, stream-ordered), so it can be
  captured in a CUDA graph.
- Kernels are compiled on first use (one cubin per template instantiation, cached on disk under
  ``$QUANTCORE_CACHE_DIR`` or ``~/.cache/quantcore/cuda``); no nvcc is needed.

Each op has one launcher: the dtype and format select a template instantiation by name
(``qc::dequantize_4bit_kernel<qc::BF16, 0, true>``), not a branch per combination.

The double-quantization offset needs a reduction across the whole absmax array, done in a few
launches without any workspace: the fp64 partial sums of the first launches are kept in the
``qabsmax`` output itself (nb bytes; the partials need about nb/256), which the final launch then
overwrites with the codes. All scratch lives in the op's own outputs, so concurrent ops on
different streams never share memory.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from quantcore import ops
from quantcore.arrays import as_dtype
from quantcore.backend import Availability, Backend
from quantcore.errors import DeviceError

from . import bnb as _bnb
from . import common as _common
from . import ggml as _ggml
from . import mx as _mx
from . import runtime as rt
from .bnb import BnbOps
from .common import _cupy_dtype, _torch, _torch_cuda, _torch_dtype, default_kind, empty, upload_torch
from .ggml import GgmlOps
from .plans import _plan_dequantize_4bit, _plan_gemv_4bit
from .plans import bind_gemm_w4a8 as _bind_gemm_w4a8

__all__ = ["CudaBackend", "create", "kernel_instances"]


def kernel_instances() -> list[tuple[str, str]]:
    """Every (source file, name expression) the backend can launch."""
    return _bnb.instances() + _ggml.instances() + _common.ar_instances()


class CudaBackend(BnbOps, GgmlOps, Backend):
    name = "cuda"

    def __init__(self) -> None:
        self._avail: Availability | None = None
        self._lock = threading.Lock()

    # -- discovery -----------------------------------------------------------------------------------
    def availability(self) -> Availability:
        if self._avail is None:
            with self._lock:
                self._avail = self._probe()
        return self._avail

    @staticmethod
    def _probe() -> Availability:
        try:
            cp = rt.cupy()
        except ImportError:
            return Availability(False, "cupy is not installed: pip install quantcore[cuda]")
        try:
            count = cp.cuda.runtime.getDeviceCount()
        except Exception as exc:  # noqa: BLE001 - no driver, no device: all mean unavailable
            return Availability(False, f"no CUDA device ({type(exc).__name__}: {exc})")
        if count < 1:
            return Availability(False, "no CUDA device")
        try:
            comp = rt.nvrtc()
        except Exception as exc:  # noqa: BLE001
            return Availability(False, str(exc))
        names = ", ".join(rt.device_name(i) for i in range(count))
        return Availability(True, f"{count} device(s): {names}; NVRTC {comp.version[0]}.{comp.version[1]}")

    def devices(self) -> list[str]:
        if not self.availability():
            return []
        return [f"cuda:{i}" for i in range(rt.cupy().cuda.runtime.getDeviceCount())]

    def use_device(self, index: int) -> None:
        """The calling thread's current GPU, for CuPy and, where it has CUDA, torch (both keep it
        per thread): new arrays (``from_numpy``, ``empty``) and launches go there."""
        rt.cupy().cuda.Device(int(index)).use()
        if _torch_cuda():
            _torch().cuda.set_device(int(index))

    _GEMM4_RULE: dict[int, _bnb.LinearRule] = {}

    def gemm_4bit_rows(self, device: Any, n: int = 0, k: int = 0, rows: int = 0, eager: bool = False) -> int:
        """Up to how many input rows ``quantcore.torch``'s linear_4bit takes gemv_4bit for an [n, k]
        weight on ``device`` (a torch device or an index; None: the current one): its many-row GEMM's
        crossover with dequantize + matmul (kernels_cuda/bnb_gemm.cu: the wgmma GEMM on compute
        capability 9.0 for weights of ``LINEAR_WGMMA_MIN_WEIGHT`` elements or more, else the mma.sync
        GEMM: sm_80+ with 227 KiB of shared memory per CTA), 0 where no many-row GEMM runs (more than
        16 rows would take 16-row passes of the batch kernels: the linear path dequantizes instead).
        With ``rows`` (a call's), the answer for that call: above 512 rows the wgmma GEMM takes row
        counts that fill its waves (``bnb.gemm4_linear_rows``). ``eager``: for a call that is not being
        captured in a CUDA graph, whose host time counts: the wgmma GEMM's 512 rows for smaller weights
        too (one bound launch against dequantize + matmul's two launches, allocation and F.linear). The
        device's rule is worked out once (a linear call asks for every call)."""
        index = device.index if hasattr(device, "type") else device  # a torch.device, else an index
        if index is None:
            index = rt.cupy().cuda.runtime.getDevice()
        rule = self._GEMM4_RULE.get(int(index))
        if rule is None:
            rule = self._GEMM4_RULE[int(index)] = _bnb.gemm4_linear_rule(int(index))
        return _bnb.gemm4_linear_rows(rule, n, k, rows, eager)

    _CAPS: frozenset | None = None

    def capabilities(self):
        if CudaBackend._CAPS is None:  # built once: the core checks it on every call
            CudaBackend._CAPS = frozenset(ops.bnb_capabilities() + ops.ggml_capabilities()
                                          + _mx.capabilities())  # MX family: see backends/cuda/mx.py
        return CudaBackend._CAPS

    # -- arrays --------------------------------------------------------------------------------------
    def prepare(self, x: Any) -> Any:
        rt.check_device_array(x)
        if rt.kind(x) == "torch":
            return x if x.is_contiguous() else x.contiguous()
        return rt.cupy().ascontiguousarray(x)

    def finish(self, native: Any, like: Any) -> Any:
        kn, kl = rt.kind(native), rt.kind(like)
        if kn == kl or kl not in ("torch", "cupy"):
            return native
        if kl == "torch":
            return rt.torch_module().from_dlpack(native)
        return rt.cupy().from_dlpack(native)

    def _default_kind(self, like: Any) -> str:
        return default_kind(like)

    def empty(self, shape, dtype, like=None) -> Any:
        return empty(shape, dtype, like)

    def from_numpy(self, a: np.ndarray, like: Any = None) -> Any:
        a = np.ascontiguousarray(a)
        if self._default_kind(like) == "torch":
            torch = _torch()
            device = like.device if rt.kind(like) == "torch" else torch.device("cuda", torch.cuda.current_device())
            return upload_torch(a, device)
        cp = rt.cupy()
        dev = like.device if rt.kind(like) == "cupy" else cp.cuda.Device()
        with dev:
            return cp.asarray(a.astype(_cupy_dtype(a.dtype), copy=False))

    def to_numpy(self, x: Any) -> np.ndarray:
        if rt.kind(x) == "torch":
            t = x.detach()
            if str(t.dtype) == "torch.bfloat16":
                return t.view(_torch().int16).cpu().numpy().view(as_dtype("bfloat16"))
            return t.cpu().numpy()
        if rt.kind(x) == "cupy":
            return rt.cupy().asnumpy(x)
        raise DeviceError(f"to_numpy takes a torch CUDA tensor or a CuPy array, got {type(x).__name__}")

    def view(self, buf: Any, byte_offset: int, shape, dtype) -> Any:
        dt = as_dtype(dtype)
        nbytes = int(np.prod(shape)) * dt.itemsize
        part = buf.reshape(-1)[byte_offset: byte_offset + nbytes]
        if rt.kind(buf) == "torch":
            return part.view(_torch_dtype(dt)).view(tuple(shape))
        return part.view(_cupy_dtype(dt)).reshape(tuple(shape))

    def synchronize(self) -> None:
        if self.availability():
            rt.cupy().cuda.runtime.deviceSynchronize()

    # -- eager launch plans (backends/cuda/plans.py) ------------------------------------------------
    def plan_dequantize_4bit(self, packed, state, out_dtype, *, previous, dtype):
        """A launch plan for repeated public ``dequantize_4bit`` calls (see
        ``quantcore.api.EAGER_PLANS``): torch CUDA tensors only; None where the call is not planned."""
        return _plan_dequantize_4bit(packed, state, out_dtype, previous, dtype)

    def bind_gemm_w4a8(self, wq, a, *, m, n, k, linear=False):
        """A repeated ``gemm_w4a8(wq, a)`` call's launch bound to ``wq`` (see
        ``quantcore.api.bind_gemm_w4a8``), or None."""
        return _bind_gemm_w4a8(wq, a, m, n, k, linear)

    def plan_gemv_4bit(self, A, packed, state, *, previous, n, k):
        """A launch plan for repeated public ``gemv_4bit`` calls (see ``quantcore.api.EAGER_PLANS``):
        torch CUDA tensors only; None where the call is not planned (the full path runs)."""
        return _plan_gemv_4bit(A, packed, state, previous, n, k)

    # -- MX family (NVFP4, MXFP4, MXFP8): launchers in backends/cuda/mx.py ----------------------------
    def mx_quantize(self, x, codes, scales, *, rows, cols, fmt, scale_mode, swizzled, global_scale=None):
        _mx.mx_quantize(self, x, codes, scales, rows=rows, cols=cols, fmt=fmt, scale_mode=scale_mode,
                        swizzled=swizzled, global_scale=global_scale)

    def mx_dequantize(self, codes, scales, out, *, rows, cols, fmt, swizzled, global_scale=None):
        _mx.mx_dequantize(self, codes, scales, out, rows=rows, cols=cols, fmt=fmt, swizzled=swizzled,
                          global_scale=global_scale)

    def swizzle_scales(self, scales, out, *, rows, cols):
        _mx.swizzle_scales(self, scales, out, rows=rows, cols=cols)

    def unswizzle_scales(self, swz, out, *, rows, cols):
        _mx.unswizzle_scales(self, swz, out, rows=rows, cols=cols)

    def scaled_fp4_mm(self, a, b, scale_a, scale_b, alpha, bias, out, *, m, n, k, fmt):
        _mx.scaled_fp4_mm(self, a, b, scale_a, scale_b, alpha, bias, out, m=m, n=n, k=k, fmt=fmt)

    def linear_mx(self, x, codes, scales, out, *, n, k, fmt, swizzled, global_scale=None):
        _mx.linear_mx(self, x, codes, scales, out, n=n, k=k, fmt=fmt, swizzled=swizzled, global_scale=global_scale)

    def linear_mx_grouped(self, x, groups, out, *, k):
        _mx.linear_mx_grouped(self, x, groups, out, k=k)


def create() -> CudaBackend:
    return CudaBackend()


