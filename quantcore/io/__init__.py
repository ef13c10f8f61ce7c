"""Checkpoint files without torch: a safetensors reader/writer (bf16 and fp8 through ml_dtypes).

safetensors' own numpy API cannot hold bf16 (numpy has no bfloat16), and quantcore's core must
not need torch, so the format (8-byte little-endian header length, JSON header, raw bytes) is
read and written here directly.

The reader checks the whole header before any tensor is read: a header length past the file or
above :data:`MAX_HEADER_BYTES`, a header that is not a JSON object, an unknown dtype, a shape that
is not a list of non-negative integers, offsets that are negative, reversed, outside the data, or
overlapping another tensor's, and ``prod(shape) * itemsize != end - start`` are each a
:class:`quantcore.errors.CheckpointError` naming the file and the tensor. Tensors come back as
read-only memory maps of their own byte range only (a process maps one tensor at a time, not the
file).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import sys
import threading
from collections.abc import Iterable
from typing import Any, BinaryIO

import numpy as np

from ..arrays import BF16, as_dtype
from ..errors import CheckpointError, DTypeError

_ST_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": BF16, "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
    "U16": np.dtype(np.uint16), "U32": np.dtype(np.uint32), "U64": np.dtype(np.uint64),
    "F8_E4M3": as_dtype("float8_e4m3fn"), "F8_E8M0": as_dtype("float8_e8m0fnu"),
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
#: safetensors' own limit on the JSON header (100 MB); a larger length is a corrupt file
MAX_HEADER_BYTES = 100_000_000
_COPY_CHUNK = 16 << 20


class TensorInfo:
    """One tensor of a safetensors file: dtype name, numpy dtype, shape, absolute byte range."""

    __slots__ = ("dtype_name", "dtype", "shape", "start", "end")

    def __init__(self, dtype_name: str, dtype: np.dtype, shape: tuple[int, ...], start: int, end: int):
        self.dtype_name, self.dtype, self.shape, self.start, self.end = dtype_name, dtype, shape, start, end

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def _bad(path: Any, what: str) -> CheckpointError:
    return CheckpointError(f"{os.fspath(path)}: not a valid safetensors file: {what}")


class SafetensorsFile:
    """A safetensors file whose header has been read and checked (see the module docstring).

    ``names`` (in file order), ``info(name)``, ``get(name)`` (a read-only memory map of that tensor
    only), ``copy_to(name, f)`` (the raw bytes, read in chunks without mapping), ``metadata``.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) != 8:
                    raise _bad(path, f"{size} bytes, shorter than the 8-byte header length")
                (hlen,) = struct.unpack("<Q", head)
                if hlen > MAX_HEADER_BYTES:
                    raise _bad(path, f"header length {hlen} is above the {MAX_HEADER_BYTES}-byte limit")
                if 8 + hlen > size:
                    raise _bad(path, f"header length {hlen} runs past the end of the file ({size} bytes): "
                                     "the file is truncated or not safetensors")
                raw = f.read(hlen)
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot read: {exc.strerror or exc}") from exc
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _bad(path, f"the header is not JSON ({exc})") from exc
        if not isinstance(header, dict):
            raise _bad(path, f"the header is a JSON {type(header).__name__}, not an object")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise _bad(path, "__metadata__ must map strings to strings")
        self.metadata: dict[str, str] = meta
        self.data_start = base = 8 + hlen
        data_len = size - base
        infos: dict[str, TensorInfo] = {}
        for name, info in header.items():
            infos[name] = self._check(name, info, base, data_len)
        spans = sorted((i.start, i.end, n) for n, i in infos.items() if i.end > i.start)
        for (s0, e0, n0), (s1, _e1, n1) in zip(spans, spans[1:]):
            if s1 < e0:
                raise _bad(path, f"tensors {n0!r} and {n1!r} overlap (bytes {s0 - base}-{e0 - base} and "
                                 f"{s1 - base}-...)")
        self._infos = infos
        self.names = [n for _s, _e, n in spans] + [n for n, i in infos.items() if i.end == i.start]

    def _check(self, name: str, info: Any, base: int, data_len: int) -> TensorInfo:
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise _bad(self.path, f"tensor {name!r}: entry must have dtype, shape and data_offsets, got {info!r}")
        dt = _ST_DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
        if dt is None:
            raise DTypeError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']!r}")
        shape, offs = info["shape"], info["data_offsets"]
        ints = lambda v: isinstance(v, list) and all(type(x) is int for x in v)  # noqa: E731
        if not ints(shape) or any(x < 0 for x in shape):
            raise _bad(self.path, f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
        if not ints(offs) or len(offs) != 2:
            raise _bad(self.path, f"tensor {name!r}: data_offsets {offs!r} is not two integers")
        start, end = offs
        if start < 0 or end < start or end > data_len:
            raise _bad(self.path, f"tensor {name!r}: data_offsets [{start}, {end}] are outside the "
                                  f"{data_len} data bytes (or reversed): the file is truncated or corrupt")
        want = math.prod(shape) * dt.itemsize
        if want != end - start:
            raise _bad(self.path, f"tensor {name!r}: shape {shape} of {info['dtype']} is {want} bytes but "
                                  f"data_offsets span {end - start}")
        return TensorInfo(info["dtype"], dt, tuple(shape), base + start, base + end)

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def info(self, name: str) -> TensorInfo:
        return self._infos[name]

    def get(self, name: str, *, whole: bool = False) -> np.ndarray:
        """Read-only memory map of one tensor (a zero-size tensor: an empty array). ``whole``: the
        caller reads all of it (a conversion), so its pages are mapped in one request up front
        (``MADV_POPULATE_READ``) instead of one page fault each: on the 2-core VM a first read of a
        mapped tensor ran 2.0-3.9 GB/s against 0.5-1.3 GB/s. Leave it off where a caller reads a
        slice (``load_sharded``)."""
        i = self._infos[name]
        if i.nbytes == 0:
            return np.zeros(i.shape, i.dtype)
        m = np.memmap(self.path, dtype=np.uint8, mode="r", offset=i.start, shape=(i.nbytes,))
        if whole:
            _populate(m)
        return m.view(i.dtype).reshape(i.shape)

    def copy_to(self, name: str, out: BinaryIO) -> int:
        """Write the tensor's raw bytes to ``out`` in chunks (no mapping); returns the byte count."""
        i = self._infos[name]
        left = i.nbytes
        with open(self.path, "rb") as f:
            f.seek(i.start)
            while left:
                chunk = f.read(min(left, _COPY_CHUNK))
                if not chunk:
                    raise CheckpointError(f"{self.path}: tensor {name!r} ends early: the file shrank while read")
                out.write(chunk)
                left -= len(chunk)
        return i.nbytes


#: madvise(MADV_POPULATE_READ) (Linux 5.14+; Python's mmap module names it from 3.13): map a file
#: range's pages ahead of reading them
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform.startswith("linux") else None)


def _populate(m: np.memmap) -> None:
    """Ask the kernel to map all of ``m``'s pages now (best effort: an older kernel or another OS
    declines, and the pages fault in as they are read)."""
    mm = getattr(m, "_mmap", None)
    if mm is None or _POPULATE_READ is None or not hasattr(mm, "madvise"):
        return
    try:
        mm.madvise(_POPULATE_READ)
    except (OSError, ValueError):
        pass


def load_safetensors(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Read a safetensors file: ``(name -> array, metadata)``; arrays are read-only memory maps.
    A malformed file raises :class:`quantcore.errors.CheckpointError`."""
    st = SafetensorsFile(path)
    return {n: st.get(n) for n in st.names}, dict(st.metadata)


def st_dtype_name(dtype: Any) -> str:
    """The safetensors dtype name of a numpy dtype (DTypeError when it has none)."""
    dt = np.dtype(dtype)
    if dt not in _ST_NAMES:
        raise DTypeError(f"safetensors cannot store dtype {dt}")
    return _ST_NAMES[dt]


def _write_array(f: BinaryIO, a: np.ndarray) -> None:
    if a.size:
        flat = a.reshape(-1).view(np.uint8)
        for s in range(0, flat.size, _COPY_CHUNK):
            f.write(memoryview(flat[s:s + _COPY_CHUNK]))


class ShardWriter:
    """Write one safetensors file tensor by tensor without knowing the tensors up front.

    With ``reserve`` (bytes for the JSON header, e.g. an estimate from the tensors' names) the data
    goes straight into ``path`` after that much room, and :meth:`close` writes the header into it,
    padded with spaces (which the format allows): the data is written once. Without it, or when the
    header outgrows the room, the data goes to ``<path>.data`` (or is moved there) and :meth:`close`
    writes the header into ``path`` and appends the data. While it writes, the data written so far
    is flushed to the disk in the background (``fdatasync`` in a thread, every ``SYNC_BYTES``), so
    that :meth:`close`'s final ``fsync`` has only the tail left. The files are the caller's to
    remove on failure (:meth:`abort`; the convert module writes into a temporary folder).
    """

    #: bytes written between two background flushes to the disk
    SYNC_BYTES = 256 << 20

    def __init__(self, path: str, metadata: dict[str, str] | None = None, reserve: int = 0):
        self.path, self.metadata = path, dict(metadata or {})
        self._data_path = path + ".data"
        self.reserve = -(-max(0, int(reserve)) // 8) * 8  # the data 8-byte aligned, as safetensors writes it
        self._f = open(path if self.reserve else self._data_path, "wb")
        if self.reserve:
            self._f.seek(8 + self.reserve)
        self.entries: dict[str, dict[str, Any]] = {}
        self.size = 0
        self._unsynced = 0
        self._sync: threading.Thread | None = None

    def add(self, name: str, a: Any) -> None:
        from ..arrays import host_numpy

        if name in self.entries:
            raise CheckpointError(f"tensor {name!r} written twice")
        a = np.ascontiguousarray(host_numpy(a))
        self.entries[name] = {"dtype": st_dtype_name(a.dtype), "shape": list(a.shape),
                              "data_offsets": [self.size, self.size + a.nbytes]}
        _write_array(self._f, a)
        self._wrote(a.nbytes)

    def add_raw(self, name: str, dtype_name: str, shape: Iterable[int], src: SafetensorsFile, src_name: str) -> None:
        """Copy a tensor's bytes from another safetensors file as they are."""
        if name in self.entries:
            raise CheckpointError(f"tensor {name!r} written twice")
        n = src.copy_to(src_name, self._f)
        self.entries[name] = {"dtype": dtype_name, "shape": list(shape), "data_offsets": [self.size, self.size + n]}
        self._wrote(n)

    def _wrote(self, n: int) -> None:
        self.size += n
        self._unsynced += n
        if self._unsynced >= self.SYNC_BYTES:  # flush what is written so far while the caller goes on
            self._unsynced = 0
            self._f.flush()
            self._join()
            self._sync = threading.Thread(target=os.fdatasync, args=(self._f.fileno(),), daemon=True,
                                          name="quantcore-fdatasync")
            self._sync.start()

    def _join(self) -> None:
        if self._sync is not None:
            self._sync.join()
            self._sync = None

    def _header(self) -> bytes:
        header: dict[str, Any] = {}
        if self.metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in self.metadata.items()}
        header.update(self.entries)
        return json.dumps(header, separators=(",", ":")).encode("utf-8")

    def close(self) -> None:
        raw = self._header()
        if self.reserve and len(raw) <= self.reserve:  # the header in its room: the data stays where it is
            self._f.seek(0)
            self._f.write(struct.pack("<Q", self.reserve))
            self._f.write(raw + b" " * (self.reserve - len(raw)))
            self._f.flush()
            self._join()
            os.fsync(self._f.fileno())
            self._f.close()
            return
        self._f.flush()
        self._join()
        self._f.close()
        if self.reserve:  # the header outgrew its room: the data moves behind a header of its own size
            os.replace(self.path, self._data_path)
        raw += b" " * (-len(raw) % 8)
        with open(self.path, "wb") as out, open(self._data_path, "rb") as data:
            data.seek(8 + self.reserve if self.reserve else 0)
            out.write(struct.pack("<Q", len(raw)))
            out.write(raw)
            while chunk := data.read(_COPY_CHUNK):
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.remove(self._data_path)

    def abort(self) -> None:
        self._join()
        self._f.close()
        for p in (self._data_path, self.path):
            if os.path.exists(p):
                os.remove(p)


def save_safetensors(path: str | os.PathLike, tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> None:
    """Write ``name -> array`` (numpy, or torch CPU tensors) as safetensors, atomically."""
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    w = ShardWriter(tmp, metadata)
    try:
        for name in sorted(tensors):
            w.add(name, tensors[name])
        w.close()
        os.replace(tmp, path)
    except BaseException:
        w.abort()
        raise


__all__ = ["MAX_HEADER_BYTES", "SafetensorsFile", "ShardWriter", "TensorInfo", "load_safetensors",
           "save_safetensors", "st_dtype_name"]
