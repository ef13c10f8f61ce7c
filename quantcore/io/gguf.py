"""GGUF files (llama.cpp's model format): a reader and a requantizer equal to ``llama-quantize``.

Reader (numpy only): :func:`read_gguf` parses the header (magic, version 2 or 3), the metadata
key/values of every type in file order (arrays, strings, nested arrays), the tensor infos and the
alignment (``general.alignment``, default 32), and gives each tensor's bytes as a read-only view
of one ``np.memmap`` of the file (no copy). :meth:`GGUFFile.dequantize` decodes F32, F16, BF16,
Q4_0, Q8_0 and Q6_K through :mod:`quantcore.formats.ggml`.

Every length and offset in the file is checked against the file before it is used: a truncated
file, a count or string length larger than the bytes left, a tensor outside the file, overlapping
or misaligned tensors, an unknown value or tensor type raise :class:`GGUFFormatError` (a
``ValueError``) or :class:`quantcore.errors.UnsupportedError` naming the file and the field; the
reader never allocates more than the file could hold.

Requantizer: :func:`requantize_gguf` writes what ``llama-quantize IN OUT Q4_0|Q8_0 [--pure]``
writes, byte for byte (metadata, tensor types, order, alignment and padding); see docs/gguf.md
for the rules and how they were checked against llama.cpp.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, BinaryIO

import numpy as np

from ..errors import ParameterError, QuantcoreError, UnsupportedError
from ..formats import ggml
from ..progress import Progress
from .atomic import _same_file

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3  #: the version written; versions 2 and 3 are read (same layout, 64-bit counts)
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"
MAX_DIMS = 4  #: GGML_MAX_DIMS
MAX_NAME_BYTES = 63  #: GGML_MAX_NAME - 1: longest tensor name ggml accepts
_MAX_NESTING = 8  #: deepest array of arrays read


class GGUFFormatError(QuantcoreError, ValueError):
    """A GGUF file is malformed: truncated, a length or offset that does not fit the file, ..."""


class ValueType(IntEnum):
    """GGUF metadata value types (gguf.h ``gguf_type``)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_NUMERIC = {
    ValueType.UINT8: np.dtype("<u1"), ValueType.INT8: np.dtype("<i1"),
    ValueType.UINT16: np.dtype("<u2"), ValueType.INT16: np.dtype("<i2"),
    ValueType.UINT32: np.dtype("<u4"), ValueType.INT32: np.dtype("<i4"),
    ValueType.FLOAT32: np.dtype("<f4"), ValueType.UINT64: np.dtype("<u8"),
    ValueType.INT64: np.dtype("<i8"), ValueType.FLOAT64: np.dtype("<f8"),
    ValueType.BOOL: np.dtype("<u1"),
}
#: fewest bytes one value of each type takes (a string: its 8-byte length)
_MIN_BYTES = {**{t: d.itemsize for t, d in _NUMERIC.items()}, ValueType.STRING: 8, ValueType.ARRAY: 12}


@dataclass(frozen=True)
class GGMLType:
    """One ggml tensor type: ``block_size`` elements take ``type_size`` bytes."""

    id: int
    name: str
    block_size: int
    type_size: int

    @property
    def quantized(self) -> bool:
        return self.block_size > 1

    def row_bytes(self, ne0: int) -> int:
        return ne0 // self.block_size * self.type_size


#: the types quantcore encodes take their sizes from quantcore.formats.ggml; the others are ggml's
_TYPE_TABLE = [
    (0, "F32", 1, 4), (1, "F16", 1, 2), (2, "Q4_0", ggml.QK, ggml.Q4_0_BLOCK_BYTES), (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22), (7, "Q5_1", 32, 24), (8, "Q8_0", ggml.QK, ggml.Q8_0_BLOCK_BYTES),
    (9, "Q8_1", ggml.QK, ggml.Q8_1_BLOCK_BYTES),
    (10, "Q2_K", 256, 84), (11, "Q3_K", 256, 110), (12, "Q4_K", 256, 144), (13, "Q5_K", 256, 176),
    (14, "Q6_K", ggml.QK_K, ggml.Q6_K_BLOCK_BYTES), (15, "Q8_K", 256, 292), (16, "IQ2_XXS", 256, 66), (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98), (19, "IQ1_S", 256, 50), (20, "IQ4_NL", 32, 18), (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82), (23, "IQ4_XS", 256, 136), (24, "I8", 1, 1), (25, "I16", 1, 2),
    (26, "I32", 1, 4), (27, "I64", 1, 8), (28, "F64", 1, 8), (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2), (34, "TQ1_0", 256, 54), (35, "TQ2_0", 256, 66), (39, "MXFP4", 32, 17),
    (40, "NVFP4", 64, 36), (41, "Q1_0", 128, 18), (42, "Q2_0", 64, 18),
]
#: ggml tensor types by id (ggml.h ``ggml_type``; sizes from ggml's type traits)
GGML_TYPES = {t[0]: GGMLType(*t) for t in _TYPE_TABLE}
_BY_NAME = {t.name: t for t in GGML_TYPES.values()}
F32, F16, BF16 = _BY_NAME["F32"], _BY_NAME["F16"], _BY_NAME["BF16"]
Q4_0, Q8_0, Q6_K = _BY_NAME["Q4_0"], _BY_NAME["Q8_0"], _BY_NAME["Q6_K"]

_PLAIN_DTYPES = {
    "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "F64": np.dtype("<f8"), "I8": np.dtype("i1"),
    "I16": np.dtype("<i2"), "I32": np.dtype("<i4"), "I64": np.dtype("<i8"),
}
#: types :meth:`GGUFFile.dequantize` decodes
DEQUANTIZABLE = ("F32", "F16", "BF16", "Q4_0", "Q8_0", "Q6_K")


def ggml_type(name_or_id: str | int) -> GGMLType:
    """The :class:`GGMLType` of a name ("Q4_0", case-insensitive) or id."""
    t = GGML_TYPES.get(name_or_id) if isinstance(name_or_id, int) else _BY_NAME.get(str(name_or_id).upper())
    if t is None:
        raise UnsupportedError(f"unknown ggml tensor type {name_or_id!r}")
    return t


@dataclass
class KV:
    """One metadata entry. ``value``: int / float / bool / str for scalars; for arrays a numpy
    array (numeric or bool items), a list of str, or a list of nested :class:`KV` values
    (``item_type`` ARRAY, each with its own ``item_type``)."""

    key: str
    type: ValueType
    value: Any
    item_type: ValueType | None = None


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: ``ne`` in ggml order (``ne[0]`` is the contiguous dimension), its type, its
    offset from the start of the data section and its size in bytes."""

    name: str
    ne: tuple[int, ...]
    type: GGMLType
    offset: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The numpy (row-major) shape: ``ne`` reversed."""
        return tuple(reversed(self.ne))

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n

    @property
    def n_dims(self) -> int:
        """ggml_n_dims: dimensions up to the last one larger than 1 (at least 1)."""
        n = 1
        for i, d in enumerate(self.ne):
            if d > 1:
                n = i + 1
        return n


class _Cursor:
    """Bounds-checked little-endian reads from a bytes-like buffer."""

    def __init__(self, buf, size: int, path: str):
        self.buf, self.size, self.pos, self.path = buf, size, 0, path

    def fail(self, what: str) -> GGUFFormatError:
        return GGUFFormatError(f"{self.path}: {what}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"truncated: {what} needs {n} bytes at offset {self.pos}, "
                            f"the file has {self.size - self.pos} left")

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v[0] if len(v) == 1 else v

    def string(self, what: str) -> str:
        n = self.unpack("<Q", f"the length of {what}")
        if n > self.size - self.pos:
            raise self.fail(f"{what}: string length {n} is larger than the {self.size - self.pos} "
                            f"bytes left in the file (offset {self.pos})")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="surrogateescape")

    def count(self, n: int, min_bytes: int, what: str) -> int:
        """Check that ``n`` items of at least ``min_bytes`` each can fit in what is left."""
        left = self.size - self.pos
        if n < 0 or n * min_bytes > left:
            raise self.fail(f"{what}: count {n} cannot fit in the {left} bytes left in the file")
        return n


def _read_value(cur: _Cursor, vtype: int, what: str, depth: int = 0) -> tuple[ValueType, Any, ValueType | None]:
    try:
        t = ValueType(vtype)
    except ValueError:
        raise cur.fail(f"{what}: unknown value type {vtype}") from None
    if t == ValueType.STRING:
        return t, cur.string(what), None
    if t == ValueType.ARRAY:
        if depth >= _MAX_NESTING:
            raise cur.fail(f"{what}: arrays nested deeper than {_MAX_NESTING}")
        it = cur.unpack("<I", f"{what} item type")
        try:
            item = ValueType(it)
        except ValueError:
            raise cur.fail(f"{what}: unknown array item type {it}") from None
        n = cur.count(cur.unpack("<Q", f"{what} array length"), _MIN_BYTES[item], f"{what} array")
        if item == ValueType.STRING:
            return t, [cur.string(f"{what}[{i}]") for i in range(n)], item
        if item == ValueType.ARRAY:
            vals = []
            for i in range(n):
                _, v, sub = _read_value(cur, ValueType.ARRAY, f"{what}[{i}]", depth + 1)
                vals.append(KV("", ValueType.ARRAY, v, sub))
            return t, vals, item
        dt = _NUMERIC[item]
        cur.need(n * dt.itemsize, what)
        arr = np.frombuffer(cur.buf, dtype=dt, count=n, offset=cur.pos).copy()
        cur.pos += n * dt.itemsize
        if item == ValueType.BOOL:
            arr = arr != 0
        arr.flags.writeable = False
        return t, arr, item
    dt = _NUMERIC[t]
    cur.need(dt.itemsize, what)
    v = np.frombuffer(cur.buf, dtype=dt, count=1, offset=cur.pos)[0]
    cur.pos += dt.itemsize
    if t == ValueType.BOOL:
        return t, bool(v), None
    return t, (float(v) if dt.kind == "f" else int(v)), None


class GGUFFile:
    """A parsed GGUF file; tensor data stays in a read-only memory map of the file.

    Attributes: ``path``, ``version``, ``alignment``, ``data_offset`` (absolute offset of the
    data section), ``kv`` (key -> :class:`KV`, file order), ``tensors`` (name -> :class:`TensorInfo`,
    file order), ``file_size``.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.file_size = os.path.getsize(self.path)
        if self.file_size < 24:
            raise GGUFFormatError(f"{self.path}: not a GGUF file ({self.file_size} bytes, a header needs 24)")
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        cur = _Cursor(self._mm, self.file_size, self.path)
        magic = bytes(self._mm[:4])
        if magic != GGUF_MAGIC:
            raise GGUFFormatError(f"{self.path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
        cur.pos = 4
        self.version = cur.unpack("<I", "version")
        if self.version not in (2, 3):
            swapped = struct.unpack("<I", struct.pack(">I", self.version))[0]
            hint = " (a big-endian file; only little-endian GGUF is read)" if swapped in (2, 3) else ""
            raise UnsupportedError(f"{self.path}: GGUF version {self.version} is not supported "
                                   f"(versions 2 and 3 are){hint}")
        n_tensors = cur.unpack("<q", "tensor count")
        n_kv = cur.unpack("<q", "metadata count")
        cur.count(n_kv, 8 + 4 + 1, "metadata count")
        self.kv: dict[str, KV] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key {i}")
            if key in self.kv:
                raise GGUFFormatError(f"{self.path}: duplicate metadata key {key!r}")
            vtype = cur.unpack("<I", f"type of {key!r}")
            t, val, item = _read_value(cur, vtype, f"metadata {key!r}")
            self.kv[key] = KV(key, t, val, item)
        cur.count(n_tensors, 8 + 4 + 4 + 8, "tensor count")
        self.alignment = self._alignment()
        infos = []
        seen = set()
        for i in range(n_tensors):
            name = cur.string(f"tensor name {i}")
            if name in seen:
                raise GGUFFormatError(f"{self.path}: duplicate tensor name {name!r}")
            seen.add(name)
            n_dims = cur.unpack("<I", f"dimension count of {name!r}")
            if n_dims > MAX_DIMS:
                raise GGUFFormatError(f"{self.path}: tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})")
            ne = tuple(cur.unpack("<q", f"shape of {name!r}") for _ in range(n_dims))
            tid = cur.unpack("<i", f"type of {name!r}")
            off = cur.unpack("<Q", f"offset of {name!r}")
            infos.append((name, ne, tid, off))
        self.data_offset = _pad(cur.pos, self.alignment) if n_tensors else cur.pos
        self.tensors: dict[str, TensorInfo] = {}
        for name, ne, tid, off in infos:
            self.tensors[name] = self._check_tensor(name, ne, tid, off)
        self._check_overlaps()

    def _alignment(self) -> int:
        kv = self.kv.get(ALIGNMENT_KEY)
        if kv is None:
            return DEFAULT_ALIGNMENT
        if kv.type != ValueType.UINT32:
            raise GGUFFormatError(f"{self.path}: {ALIGNMENT_KEY} must be a UINT32, it is a {kv.type.name}")
        a = kv.value
        if a <= 0 or a & (a - 1):
            raise GGUFFormatError(f"{self.path}: {ALIGNMENT_KEY} = {a} is not a power of 2")
        return a

    def _check_tensor(self, name: str, ne: tuple, tid: int, off: int) -> TensorInfo:
        where = f"{self.path}: tensor {name!r}"
        ne = ne or (1,)  # a 0-d tensor is one element (ggml: ne = [1, 1, 1, 1])
        t = GGML_TYPES.get(tid)
        if t is None:
            raise UnsupportedError(f"{where} has unknown ggml type id {tid}")
        if any(d < 0 for d in ne):
            raise GGUFFormatError(f"{where} has a negative dimension {ne}")
        n = 1
        for d in ne:
            n *= d
        if ne and ne[0] % t.block_size:
            raise GGUFFormatError(f"{where}: {t.name} needs rows of a multiple of {t.block_size} elements, ne[0] = {ne[0]}")
        nbytes = n // t.block_size * t.type_size
        if off % self.alignment:
            raise GGUFFormatError(f"{where}: offset {off} is not a multiple of the alignment {self.alignment}")
        end = self.data_offset + off + nbytes
        if end > self.file_size:
            raise GGUFFormatError(f"{where}: data [{self.data_offset + off}, {end}) lies outside the file "
                                  f"({self.file_size} bytes; truncated or a wrong offset/shape)")
        return TensorInfo(name, tuple(int(d) for d in ne), t, int(off), int(nbytes))

    def _check_overlaps(self) -> None:
        spans = sorted((ti.offset, ti.offset + ti.nbytes, ti.name) for ti in self.tensors.values() if ti.nbytes)
        for (_, e0, n0), (s1, _, n1) in zip(spans, spans[1:]):
            if s1 < e0:
                raise GGUFFormatError(f"{self.path}: tensors {n0!r} and {n1!r} overlap in the data section")

    # -- access ------------------------------------------------------------------------------

    @property
    def metadata(self) -> dict[str, Any]:
        """key -> value (file order)."""
        return {k: kv.value for k, kv in self.kv.items()}

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ParameterError(f"{self.path}: no tensor named {name!r}") from None

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes: a read-only uint8 view of the memory map (no copy)."""
        ti = self.info(name)
        start = self.data_offset + ti.offset
        return self._mm[start : start + ti.nbytes]

    def tensor(self, name: str) -> np.ndarray:
        """A typed read-only view: F32/F16/F64/I8..I64 with the numpy shape, BF16 as ml_dtypes'
        bfloat16, a block type as uint8 ``[*shape[:-1], ne[0]/block, type_size]``."""
        ti = self.info(name)
        raw = self.raw(name)
        if ti.type.name in _PLAIN_DTYPES:
            return raw.view(_PLAIN_DTYPES[ti.type.name]).reshape(ti.shape)
        if ti.type.name == "BF16":
            from ..arrays import BF16 as _bf16

            return raw.view(_bf16).reshape(ti.shape)
        shape = ti.shape
        return raw.reshape(*shape[:-1], shape[-1] // ti.type.block_size if shape else 0, ti.type.type_size)

    def dequantize(self, name: str, out_dtype: Any = np.float32) -> np.ndarray:
        """The tensor as floats (numpy shape): F32, F16, BF16, Q4_0, Q8_0 and Q6_K."""
        ti = self.info(name)
        return _to_float(ti.type, self.raw(name), ti.shape).astype(out_dtype, copy=False)

    def release(self, name: str) -> None:
        """Drop the tensor's pages from this process's resident memory (``MADV_DONTNEED`` on the
        read-only map; they are read again from the file if used again). No-op where unsupported."""
        ti = self.info(name)
        mm = getattr(self._mm, "_mmap", None)
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if mm is None or advice is None or not hasattr(mm, "madvise"):
            return
        start = (self.data_offset + ti.offset) // mmap.PAGESIZE * mmap.PAGESIZE
        end = self.data_offset + ti.offset + ti.nbytes
        if end > start:
            mm.madvise(advice, start, end - start)

    def close(self) -> None:
        mm = getattr(self._mm, "_mmap", None)
        self._mm = None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # views still alive keep it open until they go
                pass

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({self.path!r}, version={self.version}, {len(self.kv)} keys, {len(self.tensors)} tensors)"


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether the file starts with the GGUF magic (cheap: reads 4 bytes)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse a GGUF file (see :class:`GGUFFile`)."""
    return GGUFFile(path)


def _to_float(t: GGMLType, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """fp32 values of ``raw`` (bytes of whole rows of type ``t``), numpy ``shape``."""
    if t.name == "F32":
        return raw.view("<f4").reshape(shape)
    if t.name == "F16":
        return raw.view("<f2").astype(np.float32).reshape(shape)
    if t.name == "BF16":
        u = raw.view("<u2").astype(np.uint32) << 16
        return u.view(np.float32).reshape(shape)
    blocks = raw.reshape(-1, t.type_size)
    if t.name == "Q4_0":
        v = ggml.dequantize_q4_0(blocks[None])
    elif t.name == "Q8_0":
        v = ggml.dequantize_q8(blocks[None], "q8_0")
    elif t.name == "Q6_K":
        v = ggml.dequantize_q6_k(blocks[None])
    else:
        raise UnsupportedError(f"dequantizing ggml type {t.name} is not supported (supported: {', '.join(DEQUANTIZABLE)})")
    return v.reshape(shape)


def _pad(n: int, align: int) -> int:
    return (n + align - 1) // align * align


# -- writing --------------------------------------------------------------------------------------


def _pack_string(s: str) -> bytes:
    raw = s.encode("utf-8", errors="surrogateescape")
    return struct.pack("<Q", len(raw)) + raw


def _pack_value(t: ValueType, value: Any, item: ValueType | None) -> bytes:
    if t == ValueType.STRING:
        return _pack_string(value)
    if t == ValueType.BOOL:
        return b"\x01" if value else b"\x00"
    if t == ValueType.ARRAY:
        head = struct.pack("<IQ", int(item), len(value))
        if item == ValueType.STRING:
            return head + b"".join(_pack_string(s) for s in value)
        if item == ValueType.ARRAY:
            return head + b"".join(_pack_value(ValueType.ARRAY, v.value, v.item_type) for v in value)
        if item == ValueType.BOOL:
            return head + np.asarray(value, dtype=bool).astype(np.uint8).tobytes()
        return head + np.asarray(value, dtype=_NUMERIC[item]).tobytes()
    return np.asarray(value, dtype=_NUMERIC[t]).tobytes()


def pack_kv(kv: KV) -> bytes:
    """One metadata entry as GGUF bytes (key, type, value)."""
    return _pack_string(kv.key) + struct.pack("<I", int(kv.type)) + _pack_value(kv.type, kv.value, kv.item_type)


def pack_header(kvs: Iterable[KV], tensors: Iterable[tuple[str, tuple[int, ...], GGMLType, int]],
                alignment: int = DEFAULT_ALIGNMENT) -> bytes:
    """Header, metadata and tensor infos ``(name, ne, type, offset)`` padded to ``alignment``,
    as ggml's gguf writer lays them out (version 3; each tensor's ne written up to ggml_n_dims)."""
    kvs, tensors = list(kvs), list(tensors)
    parts = [GGUF_MAGIC, struct.pack("<Iqq", GGUF_VERSION, len(tensors), len(kvs))]
    parts += [pack_kv(kv) for kv in kvs]
    for name, ne, t, off in tensors:
        n_dims = TensorInfo(name, ne, t, off, 0).n_dims
        parts.append(_pack_string(name) + struct.pack(f"<I{n_dims}qiQ", n_dims, *ne[:n_dims], t.id, off))
    head = b"".join(parts)
    return head + b"\x00" * (_pad(len(head), alignment) - len(head))


def write_gguf(dst: str | os.PathLike, kvs: Iterable[KV], tensors: Iterable[tuple[str, tuple[int, ...], GGMLType, Any]],
               alignment: int = DEFAULT_ALIGNMENT) -> None:
    """Write a GGUF file: ``kvs`` in order, then ``(name, ne, type, data)`` tensors (data: bytes or
    an array of exactly the tensor's size) in order, each padded to ``alignment``. ``kvs`` must
    hold ``general.alignment`` (UINT32) when ``alignment`` is not 32."""
    kvs = list(kvs)
    items = []
    off = 0
    for name, ne, t, data in tensors:
        buf = memoryview(np.ascontiguousarray(data).view(np.uint8).reshape(-1)) if not isinstance(data, bytes) else memoryview(data)
        n = 1
        for d in ne:
            n *= d
        if len(buf) != n // t.block_size * t.type_size:
            raise ParameterError(f"tensor {name!r}: {len(buf)} bytes of data for a {t.name} tensor of ne {ne}")
        items.append((name, tuple(ne), t, off, buf))
        off = _pad(off + len(buf), alignment)
    with open(dst, "wb") as f:
        f.write(pack_header(kvs, [(n, ne, t, o) for n, ne, t, o, _ in items], alignment))
        for _, _, _, _, buf in items:
            f.write(buf)
            f.write(b"\x00" * (_pad(len(buf), alignment) - len(buf)))


# -- llama-quantize's rules -----------------------------------------------------------------------

#: llama_ftype values written to general.file_type
LLAMA_FTYPE = {"q4_0": 2, "q8_0": 7}
QUANTIZATION_VERSION = 2  #: GGML_QNT_VERSION
_SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
_LAYER_RE = re.compile(rb"blk\.[ \t\n\v\f\r]*([+-]?[0-9]+)")

# substrings that keep a 2-D "...weight" tensor out of quantization (llama-quant.cpp's
# tensor_allows_quantization), besides "_norm.weight"
_NEVER_QUANTIZED = (
    "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj",
    "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight",
    "time_mix_first.weight", "time_mix_w0.weight", "time_mix_w1.weight", "time_mix_w2.weight",
    "time_mix_v0.weight", "time_mix_v1.weight", "time_mix_v2.weight", "time_mix_a0.weight",
    "time_mix_a1.weight", "time_mix_a2.weight", "time_mix_g1.weight", "time_mix_g2.weight",
    "time_mix_decay_w1.weight", "time_mix_decay_w2.weight", "time_mix_lerp_fused.weight",
    "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.", "sam.net_", ".rel_pos",
    ".patch_embd", ".patch_merger", "a.rvq.codebook", "mm.a.code_embd",
)
_GLM5_NEXT_KEPT = (
    "hc_", "indexer.attn_q_b", "indexer.attn_k", "indexer.proj", "indexer_compressor_gate",
    "indexer_compressor_ape", "ssm_f_a.weight", "ssm_f_b.weight", "ssm_g_a.weight", "ssm_g_b.weight",
    "ssm_beta.weight", "attn_kv_a_mqa.weight", "attn_k_b.weight", "attn_v_b.weight",
)


def layer_of(name: str) -> int:
    """``sscanf(name, "blk.%d.", &layer)``: the block number, or -1 when the name has none."""
    m = _LAYER_RE.match(name.encode("utf-8", errors="surrogateescape"))
    if not m:
        return -1
    v = int(m.group(1))
    return v if -(1 << 31) <= v < (1 << 31) else -1


def tensor_order(names: Iterable[str]) -> list[str]:
    """llama.cpp's weights_map order: by block number (-1 for names outside ``blk.N``), then by
    name (bytewise)."""
    return sorted(names, key=lambda n: (layer_of(n), n.encode("utf-8", errors="surrogateescape")))


def _category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for sub, cat in (("attn_qkv.weight", "attn_v"), ("attn_kv_b.weight", "attn_v"), ("attn_v.weight", "attn_v"),
                     ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"),
                     ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"),
                     ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down")):
        if sub in name:
            return cat
    return "other"


def _quantization_refusal(name: str, n_dims: int, arch: str) -> str | None:
    """Why llama-quantize leaves this tensor's type alone, or None when it may quantize it."""
    if n_dims < 2:
        return "1-D"
    # llama.cpp tests `name.rfind("weight") == name.size() - 6`, which a 5-byte name also passes
    # (npos == size_t(5 - 6)); reproduced so such files quantize as llama-quantize does
    if not name.endswith("weight") and len(name.encode("utf-8", errors="surrogateescape")) != 5:
        return "not a weight"
    if "_norm.weight" in name:
        return "norm"
    if name in ("position_embd.weight", "token_types.weight"):
        return "position / token-type embedding"
    for sub in _NEVER_QUANTIZED:
        if sub in name:
            return f"llama.cpp keeps {sub!r} tensors"
    if arch == "glm5-next":
        for sub in _GLM5_NEXT_KEPT:
            if sub in name:
                return f"llama.cpp keeps {sub!r} tensors of glm5-next"
    return None


@dataclass(frozen=True)
class _Model:
    arch: str
    n_expert: int
    n_layer: int
    tied: bool  #: no output.weight: token_embd.weight is the output


def _target_type(ti: TensorInfo, default: GGMLType, pure: bool, m: _Model) -> tuple[GGMLType, str]:
    """llama_tensor_get_type for ftype Q4_0 / Q8_0 without imatrix or overrides: (type, reason)."""
    why = _quantization_refusal(ti.name, ti.n_dims, m.arch)
    if why is not None:
        return ti.type, f"kept {ti.type.name}: {why}"
    new, reason = default, "default"
    if not pure:
        cat = _category(ti.name)
        if m.arch == "glm5-next" and any(s in ti.name for s in ("attn_q_a", "attn_q_b", "nextn.eh_proj")):
            new, reason = Q8_0, "glm5-next keeps it at Q8_0"
        elif cat == "output" or (m.tied and cat == "token_embd"):
            what = "output" if cat == "output" else "token embedding tied to the output"
            if m.arch == "falcon" or ti.ne[0] % default.block_size:
                new, reason = Q8_0, f"{what} (falcon or ne[0] % {default.block_size}): Q8_0"
            elif default is not Q8_0:
                new, reason = Q6_K, f"{what}: Q6_K"
        elif cat in ("attn_v", "attn_k") and m.n_expert == 8:
            new, reason = Q8_0, "8-expert model: attention K/V at Q8_0"
        elif cat in ("ffn_down", "ffn_gate", "ffn_up") and m.n_expert > 1:
            layer = layer_of(ti.name)
            if layer == -1:
                raise ParameterError(f"cannot determine the layer of {ti.name!r} (llama-quantize refuses it too)")
            if not 0 <= layer < m.n_layer:
                raise ParameterError(f"bad layer {layer} for {ti.name!r}: must be in [0, {m.n_layer})")
    if ti.ne[0] % new.block_size:  # tensor_type_fallback
        fb = Q8_0 if new is Q6_K else new
        if ti.ne[0] % fb.block_size:
            fb = F16
        new, reason = fb, f"ne[0] = {ti.ne[0]} not a multiple of {new.block_size}: {fb.name}"
    return new, reason


# -- requantization -------------------------------------------------------------------------------


#: bytes of fp32 values converted and quantized at a time (a slab of whole rows)
SLAB_BYTES = 64 << 20


def _slabs(ti: TensorInfo) -> Iterator[tuple[int, int]]:
    rows = ti.n_elements // ti.ne[0] if ti.ne and ti.ne[0] else 0
    per = max(1, SLAB_BYTES // max(1, 4 * ti.ne[0])) if rows else 1
    for r in range(0, rows, per):
        yield r, min(rows, r + per)


def _check_finite(values: np.ndarray, what: str) -> None:
    if not np.isfinite(values).all():
        raise ParameterError(f"{what} holds NaN or Inf (llama-quantize refuses such data: 'tensor has invalid data')")


def _block_scales_finite(t: GGMLType, out: np.ndarray) -> bool:
    blocks = out.reshape(-1, t.type_size)
    at = t.type_size - 2 if t is Q6_K else 0
    d = np.ascontiguousarray(blocks[:, at : at + 2]).view(np.float16)
    return bool(np.isfinite(d).all())


def _quantize_rows(t: GGMLType, x: np.ndarray, backend) -> np.ndarray:
    """fp32 rows ``x [R, K]`` -> the bytes of ``R`` rows of type ``t``."""
    if t is Q4_0 or t is Q8_0:
        from .. import api
        from ..arrays import host_numpy

        fn = api.quantize_q4_0 if t is Q4_0 else api.quantize_q8_0
        return np.ascontiguousarray(host_numpy(fn(x, backend=backend))).view(np.uint8).reshape(-1)
    if t is Q6_K:
        return ggml.quantize_q6_k(x).reshape(-1)
    if t is F16:
        with np.errstate(over="ignore"):
            return x.astype("<f2").view(np.uint8).reshape(-1)
    raise UnsupportedError(f"cannot quantize to {t.name}")  # unreachable for q4_0 / q8_0 files


def requantize_gguf(src: str | os.PathLike, dst: str | os.PathLike, fmt: str, *, pure: bool = False,
                    backend: Any = None, progress: bool = True, allow_requantize: bool = False) -> dict:
    """Write ``dst`` as ``llama-quantize src dst Q4_0|Q8_0 [--pure]`` would, byte for byte.

    ``fmt``: "q4_0" or "q8_0". Q4_0 / Q8_0 tensors are quantized through :mod:`quantcore.api`
    on ``backend``; Q6_K (the output of a Q4_0 file) through :func:`quantcore.formats.ggml.quantize_q6_k`.
    Inputs may hold F32, F16 and BF16 tensors; Q4_0 / Q8_0 / Q6_K tensors that must change type
    are dequantized first only with ``allow_requantize`` (llama-quantize's ``--allow-requantize``).
    Tensors stream one slab of rows at a time from the memory-mapped input; ``dst`` is written
    directly (the caller handles temporary names). Returns a summary dict (see docs/gguf.md).
    """
    fmt = str(fmt).lower()
    if fmt not in LLAMA_FTYPE:
        raise ParameterError(f"GGUF requantization supports q4_0 and q8_0, not {fmt!r}")
    default = Q4_0 if fmt == "q4_0" else Q8_0
    if _same_file(src, dst):
        raise ParameterError(f"the output {os.fspath(dst)!r} is the input file; write to another path")
    g = read_gguf(src)
    bar = None
    try:
        plan, kvs = _plan(g, default, pure)
        total_in = sum(ti.nbytes for ti, _, _ in plan)
        offsets, off = [], 0
        for ti, t, _ in plan:
            offsets.append(off)
            off += _pad(t.row_bytes(ti.ne[0]) * (ti.n_elements // ti.ne[0] if ti.ne[0] else 0), DEFAULT_ALIGNMENT)
        header = pack_header(kvs, [(ti.name, ti.ne, t, o) for (ti, t, _), o in zip(plan, offsets)])
        bar = Progress(total_in, f"requantize {os.path.basename(os.fspath(src))} -> {fmt}", progress,
                       pieces=len(plan))
        tensors = []
        with open(dst, "wb") as f:
            f.write(header)
            for (ti, t, reason), o in zip(plan, offsets):
                if f.tell() != len(header) + o:  # the offsets written in the header
                    raise AssertionError(f"{ti.name}: at byte {f.tell()}, expected {len(header) + o}")
                written = _write_tensor(f, g, ti, t, backend, allow_requantize)
                f.write(b"\x00" * (_pad(written, DEFAULT_ALIGNMENT) - written))
                tensors.append({"name": ti.name, "shape": list(ti.shape), "from": ti.type.name,
                                "to": t.name, "reason": reason, "bytes": written})
                g.release(ti.name)  # as llama-quantize unmaps each weight once written
                bar.step(ti.nbytes, ti.name)
            size = f.tell()
            if size != len(header) + off:
                raise AssertionError(f"wrote {size} bytes, expected {len(header) + off}")
    finally:
        if bar is not None:
            bar.close()
        g.close()
    def brief(rows):
        return [{"name": d["name"], "type": d["to"], "reason": d["reason"]} for d in rows]

    return {
        "src": os.fspath(src), "dst": os.fspath(dst), "format": fmt, "pure": pure,
        "file_type": LLAMA_FTYPE[fmt], "n_tensors": len(tensors), "bytes_in": g.file_size, "bytes_out": size,
        "tensors": tensors,
        # tensors left in a float / integer type, and those in a block type other than fmt's
        "unquantized": brief(d for d in tensors if not _BY_NAME[d["to"]].quantized),
        "higher_precision": brief(d for d in tensors if _BY_NAME[d["to"]].quantized and d["to"] != default.name),
    }


def _plan(g: GGUFFile, default: GGMLType, pure: bool) -> tuple[list[tuple[TensorInfo, GGMLType, str]], list[KV]]:
    if g.alignment != DEFAULT_ALIGNMENT:
        raise UnsupportedError(
            f"{g.path}: general.alignment = {g.alignment}; llama-quantize copies that key but pads the "
            f"output to {DEFAULT_ALIGNMENT}, so its output would be unreadable: not reproduced")
    for kv in g.kv.values():
        if kv.item_type == ValueType.ARRAY:
            raise UnsupportedError(f"{g.path}: metadata {kv.key!r} is an array of arrays, which llama.cpp cannot read")
    arch_kv = g.kv.get("general.architecture")
    arch = arch_kv.value if arch_kv is not None and arch_kv.type == ValueType.STRING else ""

    def _int(key: str, default_value: int) -> int:
        kv = g.kv.get(f"{arch}.{key}")
        return int(kv.value) if kv is not None and kv.type not in (ValueType.STRING, ValueType.ARRAY) else default_value

    model = _Model(arch, _int("expert_count", 0), _int("block_count", 0), "output.weight" not in g.tensors)
    plan = []
    for name in tensor_order(g.tensors):
        ti = g.tensors[name]
        if len(name.encode("utf-8", errors="surrogateescape")) > MAX_NAME_BYTES:
            raise UnsupportedError(f"{g.path}: tensor name {name!r} is longer than ggml's {MAX_NAME_BYTES} bytes")
        t, reason = _target_type(ti, default, pure, model)
        if t is not ti.type and ti.n_dims > 3:
            raise UnsupportedError(f"{g.path}: tensor {name!r} has 4 dimensions; llama-quantize converts at most 3")
        plan.append((ti, t, reason))
    kvs = [kv for kv in g.kv.values() if kv.key not in _SPLIT_KEYS
           and kv.key not in ("general.quantization_version", "general.file_type")]
    kvs.append(KV("general.quantization_version", ValueType.UINT32, QUANTIZATION_VERSION))
    kvs.append(KV("general.file_type", ValueType.UINT32, LLAMA_FTYPE["q4_0" if default is Q4_0 else "q8_0"]))
    return plan, kvs


def _write_tensor(f: BinaryIO, g: GGUFFile, ti: TensorInfo, t: GGMLType, backend, allow_requantize: bool) -> int:
    raw = g.raw(ti.name)
    where = f"{g.path}: tensor {ti.name!r}"
    row_in = ti.type.row_bytes(ti.ne[0]) if ti.ne else 0
    if t is ti.type:  # copied unchanged (llama-quantize validates the bytes it reads)
        if ti.type.name in ("F32", "F16", "BF16") or ti.type in (Q4_0, Q8_0, Q6_K):
            for r0, r1 in _slabs(ti):
                chunk = raw[r0 * row_in : r1 * row_in]
                if ti.type.quantized:
                    if not _block_scales_finite(ti.type, chunk):
                        raise ParameterError(f"{where} has a NaN or Inf block scale (llama-quantize refuses it)")
                else:
                    _check_finite(_to_float(ti.type, chunk, (-1,)), where)
        f.write(memoryview(raw))
        return ti.nbytes
    if ti.type.quantized and not allow_requantize:
        raise ParameterError(f"{where} is {ti.type.name}; requantizing it to {t.name} needs allow_requantize=True "
                             f"(llama-quantize: --allow-requantize)")
    if ti.type.name not in DEQUANTIZABLE:
        raise UnsupportedError(f"{where}: cannot convert ggml type {ti.type.name} to {t.name}")
    written = 0
    k = ti.ne[0]
    for r0, r1 in _slabs(ti):
        x = _to_float(ti.type, raw[r0 * row_in : r1 * row_in], (r1 - r0, k))
        if ti.type.quantized:
            if not _block_scales_finite(ti.type, raw[r0 * row_in : r1 * row_in]):
                raise ParameterError(f"{where} has a NaN or Inf block scale (llama-quantize refuses it)")
        else:
            _check_finite(x, where)
        out = _quantize_rows(t, np.ascontiguousarray(x, dtype=np.float32), backend)
        ok = _block_scales_finite(t, out) if t.quantized else bool(np.isfinite(out.view("<f2")).all())
        if not ok:
            raise ParameterError(f"{where}: a {t.name} {'scale' if t.quantized else 'value'} overflows fp16 "
                                 f"(llama-quantize fails too: 'quantized data validation failed')")
        f.write(memoryview(out))
        written += out.nbytes
    return written
