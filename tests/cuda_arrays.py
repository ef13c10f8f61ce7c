"""numpy <-> torch CUDA helpers shared by the GPU test files (torch is imported on first use, so
the module imports on a machine without it)."""

from __future__ import annotations

import numpy as np
import pytest
from quantcore.backends.cuda.runtime import ENV_TUNE as TUNE  # noqa: F401  (the launch-tuning variable)

import quantcore as qc
from quantcore.arrays import BF16

CUDA = qc.available_backends()["cuda"]
#: The GPU test files' mark: skipped with the backend's stated reason where it is unavailable.
needs_cuda = pytest.mark.skipif(not CUDA, reason=f"cuda backend unavailable: {CUDA.reason}")


def _torch_dtype(dtype):
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    return {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16, BF16: torch.bfloat16,
            np.dtype(np.uint8): torch.uint8, np.dtype(np.int8): torch.int8, np.dtype(np.int16): torch.int16,
            np.dtype(np.int32): torch.int32}[np.dtype(dtype)]


def to_cuda(a: np.ndarray, offset: int = 0):
    """numpy -> 1-D torch CUDA tensor whose data starts ``offset`` elements into a larger buffer
    (unaligned pointers); the bytes copied as they are (bf16 included)."""
    import torch

    flat = np.ascontiguousarray(a).reshape(-1)
    buf = torch.empty(flat.size + offset, dtype=_torch_dtype(flat.dtype), device="cuda")
    buf[offset:].view(torch.uint8).copy_(torch.from_numpy(flat.view(np.uint8).copy()).cuda())
    return buf[offset:]


def to_host(t) -> np.ndarray:
    """A CUDA tensor's values as numpy (the cuda backend's copy: bf16 as quantcore's BF16)."""
    return qc.get_backend("cuda").to_numpy(t)


def filled(n: int, dtype, offset: int = 0, byte: int = 0x5A):
    """An output of n elements starting ``offset`` elements into a buffer, prefilled so that an
    element the kernel misses shows: ``byte`` for uint8, NaN for floats."""
    import torch

    tdt = _torch_dtype(dtype)
    fill = byte if tdt == torch.uint8 else float("nan")
    return torch.full((n + offset,), fill, dtype=tdt, device="cuda")[offset:]
