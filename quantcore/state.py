"""``QuantState``: bitsandbytes-compatible 4-bit / 8-bit quantization state.

Same fields and the same ``as_dict`` / ``from_dict`` keys as ``bitsandbytes.functional.QuantState``,
so a state round-trips through a safetensors file in bitsandbytes' (and transformers') layout:
``<p>.weight.absmax``, ``<p>.weight.quant_map``, ``<p>.weight.nested_absmax``,
``<p>.weight.nested_quant_map`` and ``<p>.weight.quant_state.bitsandbytes__<type>`` (JSON bytes).
Arrays stay in whatever kind they were made in (numpy, torch, cupy ...).

Every field is checked by :meth:`QuantState.validate` (which the public API calls): a bad field is
a :class:`~quantcore.StateError` whose message names it, the same on every backend. A 4-bit code
table is compared with the table of ``quant_type`` by value; one in device memory is read back once
and the answer remembered while it is the same object at the same address, unmodified (for torch
tensors: the same ``_version``), so a repeated call costs no host round trip.
"""

from __future__ import annotations

import json
import math
import sys
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .arrays import FLOAT_DTYPES, array_kind, as_dtype, dtype_name, meta
from .arrays import is_torch as _is_torch
from .errors import DeviceError, StateError
from .formats import bnb
from .validate import describe

_PACKED_KEY_PREFIX = "quant_state.bitsandbytes__"
VALID_QS_KEYS = {
    "absmax", "quant_map", "nested_absmax", "nested_quant_map", "quant_state", "quant_type",
    "blocksize", "dtype", "shape", "nested_blocksize", "nested_dtype", "nested_offset",
}
#: The keys a packed ``quant_state.bitsandbytes__<type>`` entry's JSON may hold (bitsandbytes'
#: non-tensor entries).
_JSON_KEYS = ("quant_type", "blocksize", "dtype", "shape", "nested_blocksize", "nested_dtype",
              "nested_offset")
_NESTED_KEYS = ("nested_absmax", "nested_quant_map", "nested_blocksize", "nested_offset")
#: The ``as_dict`` key of each field ``validate`` names (so from_dict's errors name the key).
_FIELD_KEYS = {
    "absmax": "absmax", "code": "quant_map", "shape": "shape", "dtype": "dtype", "blocksize": "blocksize",
    "quant_type": "quant_type", "offset": "nested_offset", "state2": "nested_absmax",
    "state2.absmax": "nested_absmax", "state2.code": "nested_quant_map",
    "state2.blocksize": "nested_blocksize", "state2.dtype": "nested_dtype",
    "state2.quant_type": "nested_absmax", "state2.shape": "nested_absmax", "state2.offset": "nested_absmax",
    "state2.state2": "nested_absmax",
}
_FLOAT_NAMES = tuple(dtype_name(d) for d in FLOAT_DTYPES)
_F32 = np.dtype(np.float32)
_U8 = np.dtype(np.uint8)
_ARRAY_KINDS = "numpy, torch, CuPy or SYCL USM"


@dataclass
class QuantState:
    """State of a 4-bit (or, as ``state2``, an 8-bit blockwise) quantization.

    Attributes mirror bitsandbytes: ``absmax`` (fp32 [nblocks], or uint8 codes when nested),
    ``shape`` (the original tensor's shape), ``code`` (decode table), ``dtype`` (original dtype
    name), ``blocksize``, ``quant_type``, ``offset`` (fp32 [1] array, nested only), ``state2``
    (the nested 8-bit state: its ``absmax`` and 256-entry ``code``).
    """

    absmax: Any
    shape: tuple[int, ...] | None = None
    code: Any = None
    blocksize: int = 64
    quant_type: str | None = None
    dtype: str = "float32"
    offset: Any = None
    state2: QuantState | None = None

    #: Launch plans of the public API's eager calls (quantcore.api): op -> (backend, plan). Not a
    #: field: dropped whenever a field is assigned, and never copied or pickled (a plan holds
    #: device handles and the pointers of this state's arrays).
    _plans = None

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name != "_plans" and self.__dict__.get("_plans") is not None:
            object.__setattr__(self, "_plans", None)

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.pop("_plans", None)
        return d

    @property
    def nested(self) -> bool:
        return self.state2 is not None

    @property
    def n(self) -> int:
        return math.prod(self.shape) if self.shape is not None else 0

    # -- validation ------------------------------------------------------------------------
    def validate(self) -> QuantState:
        """Check every field, alone and against the others; raise :class:`StateError` naming the
        field on any problem (the exception's ``field`` attribute holds its name, e.g.
        ``"state2.code"``).

        numpy integers in ``shape`` / ``blocksize`` and ``str`` subclasses in ``quant_type`` are
        replaced by Python ``int`` / ``str`` (so every backend gets the same types); nothing else
        is changed. A 4-bit ``code`` must hold the table of ``quant_type`` (custom maps are not
        supported): a host table is compared on every call, a device table once per table (see
        the module's notes)."""
        qt = self.quant_type
        if qt is not None:
            if not isinstance(qt, str) or qt not in bnb.QUANT_TYPES:
                raise _fail("quant_type", f"must be one of {bnb.QUANT_TYPES} (4-bit) or None (8-bit "
                                          f"blockwise), got {_show(qt)}")
            if type(qt) is not str:
                self.quant_type = qt = str(qt)
        bs = _int_field(self, "blocksize", self.blocksize)
        sizes = bnb.BLOCKSIZES_4BIT if qt else bnb.BLOCKSIZES_8BIT
        if bs not in sizes:
            raise _fail("blocksize", f"{bs} is not a supported {'4-bit' if qt else '8-bit'} block size; "
                                     f"use one of {sizes}")
        shape = _shape_field(self, "shape", self.shape)
        _float_dtype(self.dtype, "dtype")
        n = math.prod(shape)
        nb = bnb.nblocks(n, bs)
        ashape, adt = _array(self.absmax, "absmax")
        if ashape != (nb,):
            raise _fail("absmax", f"has shape {ashape}, expected ({nb},) for {n} elements in blocks of {bs}")
        s2 = self.state2
        if s2 is not None:
            if not isinstance(s2, QuantState):
                raise _fail("state2", f"must be a QuantState (the nested 8-bit state of absmax) or None, "
                                      f"got {type(s2).__name__}")
            if qt is None:
                raise _fail("state2", "nested (double-quantized) 8-bit blockwise states are not supported; "
                                      "dequantize the absmax first or quantize without nesting")
            if adt != _U8:
                raise _fail("absmax", f"a nested state's absmax must hold uint8 codes, got {dtype_name(adt)}")
            self._validate_nested(s2, nb)
            oshape, odt = _array(self.offset, "offset", "a nested state needs its offset: ")
            if odt != _F32 or math.prod(oshape) != 1:
                raise _fail("offset", f"must be a float32 array of one element, got {dtype_name(odt)} "
                                      f"{oshape}")
        else:
            if adt != _F32:
                raise _fail("absmax", f"must be float32 (uint8 codes when nested), got {dtype_name(adt)}")
            if self.offset is not None:
                raise _fail("offset", "is set but the state is not nested (state2 is None): an offset "
                                      "belongs to a double-quantized absmax only; set it to None")
        code = self.code
        if qt is None:
            if code is None:
                raise _fail("code", "an 8-bit blockwise state needs its float32 [256] code table")
            cshape, cdt = _array(code, "code")
            if cshape != (256,) or cdt != _F32:
                raise _fail("code", f"an 8-bit blockwise state's code must be float32 [256], got "
                                    f"{dtype_name(cdt)} {cshape}")
        elif code is not None:
            cshape, cdt = _array(code, "code")
            if cshape != (16,) or cdt != _F32:
                raise _fail("code", f"a 4-bit quant_map must be float32 [16], got {dtype_name(cdt)} {cshape}")
            found = _table_type(code)
            if found is not None and found != qt:
                what = f"the {found} table" if found in bnb.QUANT_TYPES else "neither the nf4 nor the fp4 table"
                raise _fail("code", f"(quant_map) holds {what}, but quant_type is {qt!r}; custom 4-bit maps "
                                    "are not supported (use bnb.code_4bit(quant_type))")
        return self

    @staticmethod
    def _validate_nested(s2: QuantState, nb: int) -> None:
        bs2 = _int_field(s2, "state2.blocksize", s2.blocksize)
        if bs2 != bnb.NESTED_BLOCKSIZE:
            raise _fail("state2.blocksize", f"nested blocksize must be {bnb.NESTED_BLOCKSIZE}, got {bs2}")
        if s2.quant_type is not None:
            raise _fail("state2.quant_type", f"the nested state is 8-bit: its quant_type must be None, "
                                             f"got {_show(s2.quant_type)}")
        if s2.state2 is not None or s2.offset is not None:
            raise _fail("state2.state2" if s2.state2 is not None else "state2.offset",
                        "the nested state cannot itself be nested (its state2 and offset must be None)")
        if s2.shape is not None and _shape_field(s2, "state2.shape", s2.shape) != (nb,):
            raise _fail("state2.shape", f"must be None or ({nb},) (the absmax it quantizes), got {s2.shape}")
        if _float_dtype(s2.dtype, "state2.dtype") != "float32":
            raise _fail("state2.dtype", f"the nested state quantizes float32 absmax: its dtype must be "
                                        f"float32, got {dtype_name(s2.dtype)}")
        nb2 = bnb.nblocks(nb, bs2)
        shape2, dt2 = _array(s2.absmax, "state2.absmax")
        if shape2 != (nb2,) or dt2 != _F32:
            raise _fail("state2.absmax", f"nested absmax must be float32 [{nb2}] ({nb} absmax in blocks of "
                                         f"{bs2}), got {dtype_name(dt2)} {shape2}")
        cshape, cdt = _array(s2.code, "state2.code", "the nested state needs its code table: ")
        if cshape != (256,) or cdt != _F32:
            raise _fail("state2.code", f"nested code must be float32 [256], got {dtype_name(cdt)} {cshape}")

    # -- serialization ---------------------------------------------------------------------
    def as_dict(self, packed: bool = False) -> dict[str, Any]:
        """bitsandbytes' ``QuantState.as_dict``; ``packed=True`` gives the safetensors layout.

        The state is validated first: any problem is a :class:`StateError`."""
        self.validate()
        d: dict[str, Any] = {
            "quant_type": self.quant_type,
            "absmax": self.absmax,
            "blocksize": self.blocksize,
            "quant_map": self.code,
            "dtype": dtype_name(self.dtype),
            "shape": tuple(self.shape),
        }
        if self.nested:
            try:
                offset = float(_host(self.offset).reshape(-1)[0])
            except Exception as exc:  # an array kind that cannot be read back
                raise _fail("offset", f"could not be read back to the host ({type(exc).__name__}: {exc})") from exc
            if not math.isfinite(offset):
                raise _fail("offset", f"is {offset}: a state with a non-finite offset decodes to non-finite "
                                      "values; quantize again")
            d.update({
                "nested_absmax": self.state2.absmax,
                "nested_blocksize": self.state2.blocksize,
                "nested_quant_map": self.state2.code,
                "nested_dtype": "float32",
                "nested_offset": offset,
            })
        if not packed:
            return d
        if self.quant_type is None:  # the key names the 4-bit type; bitsandbytes has no 8-bit packed form
            raise StateError("as_dict(packed=True) is the layout of 4-bit states (nf4 / fp4); "
                             "this 8-bit state has no quant_type: use as_dict()")
        arrays = {k: v for k, v in d.items() if _is_array(v)}
        rest = {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items() if not _is_array(v)}
        raw = np.frombuffer(json.dumps(rest).encode("utf-8"), dtype=np.uint8).copy()
        like = self.absmax
        if array_kind(like) == "torch":
            import torch  # the state already holds torch tensors

            raw = torch.from_numpy(raw)
        arrays[_PACKED_KEY_PREFIX + self.quant_type] = raw
        return arrays

    @classmethod
    def from_dict(cls, qs_dict: dict[str, Any], device: Any = None) -> QuantState:
        """Rebuild a state from ``as_dict`` output, bitsandbytes' or transformers' dicts alike.

        Keys may carry a layer prefix (``model.layers.0.weight.absmax``), the same for every key:
        a dict holding keys of two layers is refused. Tensors keep their kind; with torch tensors,
        ``device`` moves them as bitsandbytes does. Any malformed dict is a :class:`StateError`
        naming the key."""
        fields, where = _fields_of(qs_dict)

        def key(name: str) -> str:
            return where.get(name, repr(name))

        def need(name: str, why: str = "") -> Any:
            if name not in fields:
                raise StateError(f"the quant state dict has no {name!r} entry{why}")
            return fields[name]

        def move(name: str) -> Any:
            v = fields[name]
            if not _is_array(v):
                raise StateError(f"quant state dict entry {key(name)} must be an array ({_ARRAY_KINDS}), "
                                 f"got {type(v).__name__}")
            if device is None or array_kind(v) != "torch":
                return v
            try:
                return v.to(device)
            except Exception as exc:  # torch's RuntimeError / TypeError for a device it does not know
                raise DeviceError(f"could not move the quant state's {name} to device {device!r}: {exc}") from exc

        if "quant_type" not in fields:
            raise StateError("expected a packed quant_state entry or a 'quant_type' key; the quant state "
                             "dict has neither")
        need("absmax")
        qt = fields["quant_type"]
        if qt is not None and (not isinstance(qt, str) or qt not in bnb.QUANT_TYPES):
            raise StateError(f"quant state dict entry {key('quant_type')} must be one of {bnb.QUANT_TYPES} "
                             f"or None, got {_show(qt)}")
        blocksize = _int_entry(need("blocksize"), key("blocksize"))
        shape = need("shape")
        if shape is None:
            raise StateError(f"quant state dict entry {key('shape')} is None: the original tensor's shape "
                             "is needed")
        shape = _shape_entry(shape, key("shape"))
        dtype = _dtype_from_name(fields.get("dtype", "float32"), key("dtype"))
        state2 = offset = None
        if any(k in fields for k in _NESTED_KEYS + ("nested_dtype",)):
            for k in _NESTED_KEYS:
                need(k, " (a nested state needs nested_absmax, nested_quant_map, nested_blocksize and "
                        "nested_offset)")
            absmax2 = move("nested_absmax")
            off = _offset_entry(fields["nested_offset"], key("nested_offset"))
            offset = _offset_like(off, absmax2)
            dt2 = _dtype_from_name(fields.get("nested_dtype", "float32"), key("nested_dtype"))
            state2 = cls(absmax=absmax2, shape=None, code=move("nested_quant_map"),
                         blocksize=_int_entry(fields["nested_blocksize"], key("nested_blocksize")), dtype=dt2)
        state = cls(
            absmax=move("absmax"),
            shape=shape,
            code=move("quant_map") if "quant_map" in fields else None,
            blocksize=blocksize,
            quant_type=qt,
            dtype=dtype,
            offset=offset,
            state2=state2,
        )
        try:
            state.validate()
        except StateError as exc:
            name = _FIELD_KEYS.get(getattr(exc, "field", None))
            if name is None:
                raise
            err = StateError(f"quant state dict entry {key(name)}: {exc}")
            err.field = exc.field
            raise err from None
        return state


# -- field checks ------------------------------------------------------------------------------------
def _fail(field: str, msg: str) -> StateError:
    err = StateError(f"QuantState.{field} {msg}")
    err.field = field
    return err


def _show(v: Any) -> str:
    if hasattr(v, "shape") and hasattr(v, "dtype"):
        return describe(v)  # an array: the same words for every array kind (every backend's message)
    r = repr(v)
    return (r if len(r) <= 80 else r[:77] + "...") + f" ({type(v).__name__})"


def _is_int(v: Any) -> bool:
    return (type(v) is int or isinstance(v, (int, np.integer))) and not isinstance(v, (bool, np.bool_))


def _int_field(state: QuantState, field: str, v: Any) -> int:
    if type(v) is int:
        return v
    if not _is_int(v):
        raise _fail(field, f"must be an integer (a Python int or numpy integer), got {_show(v)}")
    v = int(v)
    object.__setattr__(state, field.rpartition(".")[2], v)  # numpy integer -> int; same value, plans kept
    return v


def _shape_field(state: QuantState, field: str, shape: Any) -> tuple[int, ...]:
    if shape is None:
        raise _fail(field, "is missing (None): a state needs the original tensor's shape")
    if type(shape) is tuple and all(type(s) is int and s >= 0 for s in shape):
        return shape
    if not isinstance(shape, (tuple, list)):
        raise _fail(field, f"must be a tuple of non-negative integers, got {_show(shape)}")
    for s in shape:
        if not _is_int(s) or s < 0:
            raise _fail(field, f"must be a tuple of non-negative integers, got {shape!r} (element {_show(s)})")
    shape = tuple(int(s) for s in shape)
    object.__setattr__(state, field.rpartition(".")[2], shape)  # same values as Python ints
    return shape


def _float_dtype(d: Any, field: str) -> str:
    try:
        name = dtype_name(d)
    except Exception:  # TypeError / ValueError from numpy for anything that is no dtype
        name = None
    if name not in _FLOAT_NAMES:
        raise _fail(field, f"must name float32, float16 or bfloat16 (the original tensor's dtype), got "
                           f"{_show(d)}")
    return name


def _array(v: Any, field: str, missing: str = "") -> tuple[tuple[int, ...], np.dtype]:
    """``(shape, dtype)`` of a state array; a StateError for anything that is not one."""
    if type(v) is np.ndarray:  # the common cases first: validate runs on every call
        return v.shape, v.dtype
    if _is_torch(v):
        if v.layout is not sys.modules["torch"].strided:
            raise _fail(field, f"must be a dense (strided) tensor, got layout {v.layout}; use .to_dense()")
        try:
            return tuple(v.shape), as_dtype(v.dtype)
        except TypeError:
            raise _fail(field, f"has a dtype quantcore does not know: {v.dtype}") from None
    if v is None:
        raise _fail(field, f"is missing (None); {missing}it must be an array ({_ARRAY_KINDS})")
    if not _is_array(v) or isinstance(v, np.generic):
        raise _fail(field, f"must be an array ({_ARRAY_KINDS}), got {type(v).__name__}")
    try:
        shape, dt = meta(v)
    except Exception:
        raise _fail(field, f"has a dtype quantcore does not know: {v.dtype}") from None
    return shape, dt


# -- the 4-bit table check ---------------------------------------------------------------------------
#: id(table) -> (reference to it, (address, version), "nf4" / "fp4" / None) for tables off the host.
_TABLES: dict[int, tuple] = {}
#: How many tables without weak references (held strongly here) are remembered at most.
_STRONG_LIMIT = 1024
_strong: list[int] = []


def _table_type(code: Any) -> str | None:
    """"nf4" / "fp4" for a 16-entry float32 table holding that table's values, "" for neither, None
    for a table that cannot be read (a torch "meta" tensor: it holds no values).

    A numpy table is compared on every call (its bytes first: ~0.3 us). Any other (torch tensors on
    any device, CuPy, SYCL USM ...) is read back once and the answer remembered for this object
    while its address and, for torch, its version counter (bumped by every in-place torch op on it
    or a view of it: copy_, mul_ ...) stay the same. Writes torch does not count (through ``.data``,
    a numpy view or DLPack) are not seen; assign a new table instead."""
    if isinstance(code, np.ndarray):
        return _match(code)
    stamp = (_address(code), _version(code))
    entry = _TABLES.get(id(code))
    if entry is not None and entry[0]() is code and entry[1] == stamp:
        return entry[2]
    if array_kind(code) == "torch" and code.device.type == "meta":
        return None
    try:
        host = _host(code)
    except Exception as exc:
        raise _fail("code", f"could not be read back once to check it ({type(exc).__name__}: {exc})") from exc
    found = _match(host)
    _remember(code, stamp, found)
    return found


_TABLE_BYTES = {bnb.code_4bit(qt).tobytes(): qt for qt in bnb.QUANT_TYPES}


def _match(host: np.ndarray) -> str:
    found = _TABLE_BYTES.get(host.tobytes())
    if found is not None:
        return found
    # by value: bitsandbytes' fp4 quant_map holds +0.0 where its kernel decodes -0.0
    host = host.reshape(-1)
    for qt in bnb.QUANT_TYPES:
        if np.array_equal(host, bnb.code_4bit(qt)):
            return qt
    return ""


def _address(v: Any) -> int | None:
    try:
        if array_kind(v) == "torch":
            return v.data_ptr()
        if array_kind(v) == "cupy":
            return v.data.ptr
        for name in ("__cuda_array_interface__", "__sycl_usm_array_interface__", "__array_interface__"):
            iface = getattr(v, name, None)
            if iface is not None:
                return int(iface["data"][0]) + int(iface.get("offset", 0) or 0)
    except Exception:
        return None
    return None


def _version(v: Any) -> int | None:
    """torch's in-place modification counter (bumped by copy_, mul_ ... through any view)."""
    try:
        return v._version if array_kind(v) == "torch" else None
    except RuntimeError:  # inference tensors keep no version counter
        return None


def _remember(code: Any, stamp: tuple, found: str) -> None:
    key = id(code)

    def forget(ref: Any, key: int = key) -> None:
        entry = _TABLES.get(key)
        if entry is not None and entry[0] is ref:
            del _TABLES[key]

    try:
        ref = weakref.ref(code, forget)
    except TypeError:  # no weak references (SyclArray has __slots__): hold it, a bounded number
        ref = _Strong(code)
        _strong.append(key)
        while len(_strong) > _STRONG_LIMIT:
            old = _strong.pop(0)
            if isinstance(_TABLES.get(old, (None,))[0], _Strong):
                del _TABLES[old]
    _TABLES[key] = (ref, stamp, found)


class _Strong:
    """A strong reference with weakref's call interface (keeps the table, and so its id, alive)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __call__(self) -> Any:
        return self.obj


# -- from_dict's entries -------------------------------------------------------------------------------
def _fields_of(qs_dict: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """The dict's entries by field name (layer prefix removed, the packed JSON unpacked) and, for
    each field, how to name where it came from in an error."""
    if not isinstance(qs_dict, Mapping):
        raise StateError(f"a quant state dict must be a mapping of keys to arrays / values, got "
                         f"{type(qs_dict).__name__}")
    fields: dict[str, Any] = {}
    where: dict[str, str] = {}
    prefixes: dict[str, str] = {}  # prefix -> first key seen with it
    packed: list[tuple[str, str, Any]] = []
    unknown = []
    for k, v in qs_dict.items():
        if not isinstance(k, str):
            raise StateError(f"quant state dict keys must be strings, got {_show(k)}")
        prefix, field = _split_key(k)
        if field.startswith(_PACKED_KEY_PREFIX):
            packed.append((k, field[len(_PACKED_KEY_PREFIX):], v))
        elif field in VALID_QS_KEYS and field != "quant_state":
            fields[field] = v
            where[field] = repr(k)
        else:
            unknown.append(k)
            continue
        prefixes.setdefault(prefix, k)
    if unknown:
        raise StateError(f"unexpected keys in quant state dict: {sorted(unknown)}; expected "
                         f"[<prefix>]{{{', '.join(sorted(VALID_QS_KEYS - {'quant_state'}))}}} or "
                         f"[<prefix>]{_PACKED_KEY_PREFIX}<nf4|fp4>")
    if len(prefixes) > 1:
        (p1, k1), (p2, k2) = list(prefixes.items())[:2]
        raise StateError(f"the quant state dict mixes keys of different layers: prefix {p1!r} ({k1!r}) and "
                         f"prefix {p2!r} ({k2!r}); pass the entries of one layer only")
    if len(packed) > 1:
        raise StateError(f"the quant state dict has more than one quant_state entry: {[p[0] for p in packed]}; "
                         "pass the entries of one layer only")
    if packed:
        k, suffix, raw = packed[0]
        if suffix not in bnb.QUANT_TYPES:
            raise StateError(f"quant state dict entry {k!r}: the packed entry must be named "
                             f"{_PACKED_KEY_PREFIX}<nf4|fp4>, got type {suffix!r}")
        for name, value in _unpack(raw, k).items():
            if name in fields:
                raise StateError(f"quant state dict entry {where[name]} is also given in the packed entry "
                                 f"{k!r}; give it once")
            fields[name] = value
            where[name] = f"{name!r} (in the JSON of {k!r})"
        if fields.get("quant_type") != suffix:
            raise StateError(f"quant state dict entry {k!r} names quant type {suffix!r} but its JSON says "
                             f"quant_type {_show(fields.get('quant_type'))}")
    return fields, where


def _split_key(k: str) -> tuple[str, str]:
    i = k.rfind(_PACKED_KEY_PREFIX)
    if i >= 0 and (i == 0 or k[i - 1] == ".") and "." not in k[i + len(_PACKED_KEY_PREFIX):]:
        return k[:i], k[i:]
    prefix, dot, field = k.rpartition(".")
    return prefix + dot, field


def _unpack(raw: Any, k: str) -> dict[str, Any]:
    """The JSON object a packed ``quant_state.bitsandbytes__<type>`` entry holds."""
    if isinstance(raw, (bytes, bytearray)):
        data = bytes(raw)
    else:
        if not _is_array(raw) or isinstance(raw, np.generic):
            raise StateError(f"quant state dict entry {k!r} must be a uint8 array of JSON bytes, got "
                             f"{type(raw).__name__}")
        try:
            dt = meta(raw)[1]
        except Exception:
            dt = None
        if dt != _U8:
            raise StateError(f"quant state dict entry {k!r} must be a uint8 array of JSON bytes, got dtype "
                             f"{raw.dtype}")
        try:
            data = np.ascontiguousarray(_host(raw)).reshape(-1).tobytes()
        except Exception as exc:
            raise StateError(f"quant state dict entry {k!r} could not be read back to the host "
                             f"({type(exc).__name__}: {exc})") from exc
    try:
        obj = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise StateError(f"quant state dict entry {k!r} is not UTF-8 text ({exc})") from None
    except RecursionError:
        raise StateError(f"quant state dict entry {k!r} holds JSON nested too deeply") from None
    except ValueError as exc:  # json.JSONDecodeError
        raise StateError(f"quant state dict entry {k!r} is not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise StateError(f"quant state dict entry {k!r} must hold a JSON object, got a JSON "
                         f"{type(obj).__name__}")
    bad = sorted(set(obj) - set(_JSON_KEYS))
    if bad:
        raise StateError(f"quant state dict entry {k!r}: unexpected keys {bad} in its JSON; expected some "
                         f"of {list(_JSON_KEYS)}")
    return obj


def _int_entry(v: Any, where: str) -> int:
    if not _is_int(v):
        raise StateError(f"quant state dict entry {where} must be an integer, got {_show(v)}")
    return int(v)


def _shape_entry(v: Any, where: str) -> tuple[int, ...]:
    if not isinstance(v, (tuple, list)) or not all(_is_int(s) and s >= 0 for s in v):
        raise StateError(f"quant state dict entry {where} must be a list of non-negative integers, got "
                         f"{_show(v)}")
    return tuple(int(s) for s in v)


def _offset_entry(v: Any, where: str) -> float:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise StateError(f"quant state dict entry {where} must be a finite number, got {_show(v)}")
    try:
        with np.errstate(over="ignore"):
            f = float(np.float32(float(v)))
    except OverflowError:  # a Python int beyond float's range
        f = math.inf
    if not math.isfinite(f):
        raise StateError(f"quant state dict entry {where} must be a finite float32 number, got {v!r}: "
                         "every value would decode as non-finite")
    return f


def _offset_like(off: float, like: Any) -> Any:
    """The offset as a float32 [1] array of ``like``'s kind and device (the kernels read it there)."""
    host = np.array([off], dtype=np.float32)
    kind = array_kind(like)
    if kind == "torch":
        return sys.modules["torch"].tensor(host, device=like.device)
    if kind == "cupy":
        cp = sys.modules["cupy"]
        with cp.cuda.Device(like.device.id):
            return cp.asarray(host)
    if kind == "usm":
        from .registry import get_backend

        return get_backend("sycl").from_numpy(host, like=like)
    return host


def _dtype_from_name(name: Any, where: str = "'dtype'") -> str:
    try:
        dt = dtype_name(as_dtype(name.replace("torch.", "") if isinstance(name, str) else name))
    except Exception:  # TypeError / ValueError: not a dtype
        dt = None
    if dt not in _FLOAT_NAMES:
        raise StateError(f"quant state dict entry {where} must name float32, float16 or bfloat16, got "
                         f"{_show(name)}")
    return dt


# -- array helpers -------------------------------------------------------------------------------------

def _is_array(v: Any) -> bool:
    return hasattr(v, "shape") and hasattr(v, "dtype")


def _host(v: Any) -> np.ndarray:
    """Small state arrays (code tables, offsets) to numpy, from any array kind."""
    kind = array_kind(v)
    if kind == "torch":
        from .arrays import torch_to_numpy

        return torch_to_numpy(v.detach().cpu())
    if kind == "cupy":
        return v.get()
    if hasattr(v, "to_numpy"):  # backend array types without __array__ (the SYCL USM array)
        return np.asarray(v.to_numpy())
    if hasattr(v, "asnumpy"):  # dpnp arrays
        return np.asarray(v.asnumpy())
    return np.asarray(v)
