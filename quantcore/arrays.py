"""Array interop without importing any vendor package.

The core reads shape and dtype from numpy arrays, torch tensors, CuPy arrays and SYCL USM arrays
by duck typing, and converts torch CPU tensors to numpy and back (zero-copy) when torch is
already imported by the caller. Dtypes are numpy dtypes throughout the core (bfloat16 and the
fp8 / fp4 types from ml_dtypes).
"""

from __future__ import annotations

import sys
from typing import Any

import ml_dtypes
import numpy as np

from .errors import DTypeError

BF16 = np.dtype(ml_dtypes.bfloat16)
FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), BF16)
_BY_NAME = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": BF16,
    "uint8": np.dtype(np.uint8),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "float64": np.dtype(np.float64),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e8m0fnu": np.dtype(ml_dtypes.float8_e8m0fnu),
    "bool": np.dtype(np.bool_),
}


_DTYPES: dict[Any, np.dtype] = {}


def as_dtype(d: Any) -> np.dtype:
    """numpy dtype of a dtype-like: numpy, ml_dtypes, a torch dtype or a name ("bfloat16")."""
    if isinstance(d, np.dtype):
        return d
    try:
        return _DTYPES[d]  # torch dtypes and names: cached (the public API asks on every call)
    except (KeyError, TypeError):
        pass
    dt = _as_dtype(d)
    try:
        _DTYPES[d] = dt
    except TypeError:
        pass
    return dt


def _as_dtype(d: Any) -> np.dtype:
    if isinstance(d, str):
        name = d
    elif isinstance(d, np.dtype):
        return d
    elif type(d).__module__.startswith("torch"):
        name = str(d).rsplit(".", 1)[-1]
    else:
        return np.dtype(d)
    if name not in _BY_NAME:
        raise DTypeError(f"unknown dtype {d!r}: quantcore knows {', '.join(_BY_NAME)}")
    return _BY_NAME[name]


_NAMES: dict[Any, str] = {}


def dtype_name(d: Any) -> str:
    """Canonical name ("float32", "bfloat16", ...) of a numpy / torch / cupy dtype (cached: the
    public API asks on every call)."""
    try:
        return _NAMES[d]
    except (KeyError, TypeError):  # TypeError: an unhashable dtype-like
        pass
    dt = as_dtype(d)
    name = "bfloat16" if dt == BF16 else dt.name
    try:
        _NAMES[d] = name
    except TypeError:
        pass
    return name


def is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


def is_cupy(x: Any) -> bool:
    return type(x).__module__.startswith("cupy")


def array_kind(x: Any) -> str:
    """'numpy', 'torch', 'cupy', 'usm' or 'other'."""
    if isinstance(x, np.ndarray):
        return "numpy"
    if is_torch(x):
        return "torch"
    if is_cupy(x):
        return "cupy"
    if hasattr(x, "__sycl_usm_array_interface__"):
        return "usm"
    return "other"


def device_of(x: Any) -> str:
    """'cpu' for host memory, else a device string such as 'cuda:0'."""
    kind = array_kind(x)
    if kind == "numpy":
        return "cpu"
    if kind == "torch":
        return str(x.device)
    if kind == "cupy":
        return f"cuda:{x.device.id}"
    if kind == "usm":
        return "sycl"
    return "cpu"


def meta(x: Any) -> tuple[tuple[int, ...], np.dtype]:
    """``(shape, numpy dtype)`` of any supported array without moving it (DTypeError, a TypeError,
    for anything else; :func:`quantcore.validate.array` adds the checks of the public API)."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise DTypeError(f"expected an array (numpy, torch, cupy or USM), got {type(x).__name__}")
    return tuple(int(s) for s in x.shape), as_dtype(x.dtype)


def torch_to_numpy(t: Any) -> np.ndarray:
    """Zero-copy numpy view of a contiguous torch CPU tensor (bf16 through an int16 view)."""
    t = t.detach()
    if str(t.dtype) == "torch.bfloat16":
        return t.contiguous().view(_torch().int16).numpy().view(BF16)
    return t.contiguous().numpy()


def numpy_to_torch(a: np.ndarray) -> Any:
    """torch tensor sharing memory with ``a`` (bf16 through an int16 view)."""
    torch = _torch()
    a = np.ascontiguousarray(a)
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _torch():
    # Only reached when the caller passed a torch tensor, so torch is already imported.
    return sys.modules["torch"]


def host_numpy(x: Any) -> np.ndarray:
    """numpy array of a host array (numpy, torch CPU tensor, lists); no device copies here."""
    if isinstance(x, np.ndarray):
        return x
    if is_torch(x):
        if x.device.type != "cpu":
            raise TypeError("host_numpy takes host arrays only")
        return torch_to_numpy(x)
    return np.asarray(x)
