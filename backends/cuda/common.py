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


# -- the one-shot all-reduce of tensor-parallel decode (kernels_cuda/allreduce.cu) --------------------
_FA = "allreduce.cu"
#: bytes of flag words before the two slots of a rank's symmetric buffer (the kernel's layout)
AR_FLAG_BYTES = _G["QC_AR_FLAG_BYTES"]


def _ar_launch(expr: str, x: Any, buffers: list[int], round_: Any, rank: int, **args: Any) -> None:
    world = len(buffers)
    nbytes = rt.numel(x) * as_dtype(dtype_name(x.dtype)).itemsize
    bufs = {f"buf{i}": (buffers[i] if i < world else None) for i in range(_G["QC_AR_MAX_RANKS"])}
    rt.Launcher(x)(_FA, expr, (1,), _G["QC_AR_THREADS"],
                   rt.kernel_args(expr, x=x, **args, **bufs, round=round_, rank=rank, world=world,
                                  units=nbytes // 16, slot_bytes=nbytes,
                                  mode=rt.tune("ar_mode", 2) | (_G["QC_AR_EARLY"] if rt.tune("ar_early", 1) else 0)),
                   pdl=rt.tune("ar_pdl", 1) == 1)


def all_reduce_oneshot(x: Any, out: Any, buffers: list[int], round_: Any, rank: int) -> None:
    """``out`` = the sum over ranks of each rank's ``x`` (contiguous, the same shape and fp32 / fp16 /
    bf16 dtype on every rank, a multiple of 16 bytes), by the one-shot kernel on one CTA: ``buffers``
    the ranks' symmetric buffers as mapped on this device (:func:`ar_buffer_bytes` each, as
    :func:`ar_buffer_init` leaves them), ``round_`` this buffer's round counter (one int32 on the device,
    zero at first). Launched as a programmatic dependent where possible (the CTA waits for the kernel
    that writes ``x``). ``QUANTCORE_CUDA_TUNE=ar_mode=1`` exchanges by fence and flags instead of
    sentinels, ``ar_mode=0`` also reads the peers' slots over NVLink instead of writing into theirs,
    ``ar_pdl=0`` launches plainly (timing comparisons; every rank must use the same mode)."""
    _ar_launch(f"qc::all_reduce_oneshot_kernel<{_tag(x)}>", x, buffers, round_, rank, out=out)


def all_reduce_add_rms_norm(x: Any, res: Any, w: Any, res_out: Any, norm_out: Any, eps: float, buffers: list[int],
                            round_: Any, rank: int) -> None:
    """The one-shot all-reduce of ``x`` ([rows, n], as :func:`all_reduce_oneshot`, on the same buffers
    and round counter), then ``res_out`` = res + the sum and ``norm_out`` = RMSNorm(res_out) * ``w``
    ([n], rows of at most QC_AR_NORM_UNITS x QC_AR_THREADS x 16 bytes), each rounded to the dtype as the
    unfused ops round (kernels_cuda/allreduce.cu). ``res_out`` may be ``res``."""
    rows = rt.numel(x) // rt.numel(w)
    _ar_launch(f"qc::all_reduce_add_rms_norm_kernel<{_tag(x)}>", x, buffers, round_, rank, res=res, w=w,
               res_out=res_out, norm_out=norm_out, rows=rows, eps=float(eps))


def ar_buffer_bytes(nbytes: int, world: int) -> int:
    """Bytes of one rank's symmetric buffer for the one-shot all-reduce of ``nbytes`` over ``world``
    ranks: the flags, then a slot per rank for each of QC_AR_ROUNDS rounds."""
    return AR_FLAG_BYTES + _G["QC_AR_ROUNDS"] * world * nbytes


def ar_buffer_init(buf: Any, itemsize: int) -> None:
    """Make a new buffer (a uint8 torch tensor of :func:`ar_buffer_bytes`) ready: no round announced (the
    flags zero), every slot free (the sentinel word of ``itemsize``-byte elements)."""
    buf[:AR_FLAG_BYTES].zero_()
    word = _G["QC_AR_SENTINEL_32"] if itemsize == 4 else _G["QC_AR_SENTINEL_16"]
    buf[AR_FLAG_BYTES:].view(_torch().int32).fill_(word - (1 << 32) if word >= 1 << 31 else word)


def ar_instances() -> list[tuple[str, str]]:
    """The one-shot all-reduce kernels' (source file, name expression) per element type."""
    return [(_FA, f"qc::{k}<{tag}>") for k in ("all_reduce_oneshot_kernel", "all_reduce_add_rms_norm_kernel")
            for tag in TYPE_TAG.values()]
