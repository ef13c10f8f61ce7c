"""What the cuda backend's family modules share: kernel element tags, kernel source names, the
launch geometry the kernels compile with, small integer helpers."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from quantcore.arrays import as_dtype, dtype_name
from quantcore.errors import DTypeError
from quantcore.formats.kernel_defines import GGML_FORMAT_CODE, LAUNCH_GEOMETRY

from . import runtime as rt

#: dtype name -> kernel element tag
TYPE_TAG = {"float32": "qc::F32", "float16": "qc::F16", "bfloat16": "qc::BF16"}
GGML_FMT = GGML_FORMAT_CODE  # QC_FMT_* of the generated header (kernels_cuda/ggml.cu)
_F4 = "bnb_4bit.cu"
_F8 = "bnb_8bit.cu"
_FG = "ggml.cu"
_FV = "bnb_gemv.cu"
_FM = "bnb_gemm.cu"

# launch geometry the kernels compile with (the generated header; quantcore.formats.kernel_defines)
_G = LAUNCH_GEOMETRY


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _log2(v: int) -> int:
    return int(v).bit_length() - 1


def _tag(x: Any) -> str:
    return TYPE_TAG[dtype_name(x.dtype)]


def _b(flag: bool) -> str:
    return "true" if flag else "false"


def _resident(device: int, ctas: int, per_sm: int) -> int:
    """Grid of a persistent kernel: ``ctas`` pieces of work, at most what the device holds at once
    (``per_sm`` CTAs per multiprocessor: the kernel's launch bounds, or 2048 threads' worth), so
    per-CTA set-up is paid once per CTA and every CTA is in the one wave."""
    return max(1, min(ctas, rt.sm_count(device) * per_sm))


# -- dtype maps ------------------------------------------------------------------------------------------
def _torch():
    torch = rt.torch_module()
    if torch is None:
        import torch  # noqa: PLC0415 - only reached when the caller works with torch or has it
    return torch


def _torch_cuda() -> bool:
    try:
        return bool(_torch().cuda.is_available())
    except ImportError:
        return False


def _torch_dtype(dt: np.dtype):
    torch = _torch()
    name = dtype_name(dt)
    if not hasattr(torch, name):
        raise DTypeError(f"no torch dtype for {name}")
    return getattr(torch, name)


def _cupy_dtype(dt: np.dtype) -> np.dtype:
    dt = as_dtype(dt)
    if dtype_name(dt) == "bfloat16":
        try:
            rt.cupy().empty((0,), dtype=dt)
        except Exception as exc:  # noqa: BLE001
            raise DTypeError("this CuPy has no bfloat16 arrays; pass torch tensors for bfloat16 "
                             f"({type(exc).__name__}: {exc})") from exc
    return dt


def default_kind(like: Any) -> str:
    """The array kind new arrays take: ``like``'s (torch or CuPy), else torch where it has CUDA."""
    k = rt.kind(like) if like is not None else None
    if k in ("torch", "cupy"):
        return k
    return "torch" if _torch_cuda() else "cupy"


#: host arrays from this size up go to the GPU through two pinned staging buffers of this size per
#: thread (:func:`upload_torch`)
STAGE_BYTES = 32 << 20
_stage = threading.local()


def upload_torch(a: np.ndarray, device: Any) -> Any:
    """A torch CUDA tensor on ``device`` with the contents of the contiguous host array ``a``.
    Large arrays (a memory-mapped checkpoint tensor in a conversion) are read once, piece by piece,
    into two pinned buffers kept per thread, each piece's DMA running while the next is copied on
    the host (the interpreter's lock released in both); small ones take torch's pageable copy."""
    torch = _torch()
    tdt = _torch_dtype(a.dtype)
    if a.nbytes < STAGE_BYTES:
        host = a.view(np.int16) if dtype_name(a.dtype) == "bfloat16" else a
        return torch.from_numpy(host.copy()).view(tdt).to(device)
    with torch.cuda.device(device):
        out = torch.empty(a.nbytes, dtype=torch.uint8, device=device)
        bufs = getattr(_stage, "bufs", None)
        if bufs is None:  # [pinned buffer, its numpy view, event of its last DMA]
            bufs = _stage.bufs = []
            for _ in range(2):
                b = torch.empty(STAGE_BYTES, dtype=torch.uint8, pin_memory=True)
                bufs.append([b, b.numpy(), None])
        src = a.reshape(-1).view(np.uint8)
        for i, off in enumerate(range(0, a.nbytes, STAGE_BYTES)):
            slot = bufs[i % 2]
            if slot[2] is not None:
                slot[2].synchronize()  # its previous piece has reached the GPU
            n = min(STAGE_BYTES, a.nbytes - off)
            np.copyto(slot[1][:n], src[off:off + n])
            out[off:off + n].copy_(slot[0][:n], non_blocking=True)
            slot[2] = torch.cuda.Event()
            slot[2].record()
    return out.view(tdt).view(a.shape)


def empty(shape, dtype, like: Any = None) -> Any:
    """An uninitialized device array of the kind and on the device of ``like`` (from its allocator:
    torch's caching allocator or CuPy's pool, stream-ordered)."""
    dt = as_dtype(dtype)
    if default_kind(like) == "torch":
        torch = _torch()
        device = like.device if rt.kind(like) == "torch" else torch.device("cuda", torch.cuda.current_device())
        return torch.empty(tuple(shape), dtype=_torch_dtype(dt), device=device)
    cp = rt.cupy()
    dev = like.device if rt.kind(like) == "cupy" else cp.cuda.Device()
    with dev:
        return cp.empty(tuple(shape), dtype=_cupy_dtype(dt))
