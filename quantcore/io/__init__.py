"""Checkpoint files without torch: a small safetensors reader/writer (bf16 through ml_dtypes).

safetensors' own numpy API cannot hold bf16 (numpy has no bfloat16), and quantcore's core must
not need torch, so the format (8-byte little-endian header length, JSON header, raw bytes) is
read and written here directly. Arrays come back as read-only memory maps.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import numpy as np

from ..arrays import BF16, as_dtype
from ..errors import DTypeError, ShapeError

_ST_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": BF16, "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
    "F8_E4M3": as_dtype("float8_e4m3fn"), "F8_E8M0": as_dtype("float8_e8m0fnu"),
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def load_safetensors(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Read a safetensors file: ``(name -> array, metadata)``; arrays are read-only memory maps."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ShapeError(f"{path}: not a safetensors file (too short)")
        (hlen,) = struct.unpack("<Q", head)
        header = json.loads(f.read(hlen).decode("utf-8"))
    base = 8 + hlen
    data = np.memmap(path, dtype=np.uint8, mode="r") if os.path.getsize(path) > base else np.zeros(0, np.uint8)
    meta = header.pop("__metadata__", {}) or {}
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        dt = _ST_DTYPES.get(info["dtype"])
        if dt is None:
            raise DTypeError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        out[name] = data[base + start: base + end].view(dt).reshape(info["shape"])
    return out, meta


def save_safetensors(path: str | os.PathLike, tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> None:
    """Write ``name -> array`` (numpy, or torch CPU tensors) as safetensors, atomically."""
    from ..arrays import host_numpy

    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    arrays = []
    offset = 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(host_numpy(tensors[name]))
        if a.dtype not in _ST_NAMES:
            raise DTypeError(f"cannot store dtype {a.dtype} of {name!r} in safetensors")
        header[name] = {"dtype": _ST_NAMES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for a in arrays:
            f.write(a.view(np.uint8).reshape(-1).tobytes() if a.size else b"")
    os.replace(tmp, path)
