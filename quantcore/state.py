"""``QuantState``: bitsandbytes-compatible 4-bit / 8-bit quantization state.

Same fields and the same ``as_dict`` / ``from_dict`` keys as ``bitsandbytes.functional.QuantState``,
so a state round-trips through a safetensors file in bitsandbytes' (and transformers') layout:
``<p>.weight.absmax``, ``<p>.weight.quant_map``, ``<p>.weight.nested_absmax``,
``<p>.weight.nested_quant_map`` and ``<p>.weight.quant_state.bitsandbytes__<type>`` (JSON bytes).
Arrays stay in whatever kind they were made in (numpy, torch, cupy ...).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .arrays import array_kind, as_dtype, dtype_name, meta
from .errors import DTypeError, StateError
from .formats import bnb

_PACKED_KEY_PREFIX = "quant_state.bitsandbytes__"
VALID_QS_KEYS = {
    "absmax", "quant_map", "nested_absmax", "nested_quant_map", "quant_state", "quant_type",
    "blocksize", "dtype", "shape", "nested_blocksize", "nested_dtype", "nested_offset",
}


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
        """Check the state against itself; raise :class:`StateError` on any inconsistency."""
        if self.quant_type is not None and self.quant_type not in bnb.QUANT_TYPES:
            raise StateError(f"quant_type must be one of {bnb.QUANT_TYPES}, got {self.quant_type!r}")
        sizes = bnb.BLOCKSIZES_4BIT if self.quant_type else bnb.BLOCKSIZES_8BIT
        if self.blocksize not in sizes:
            raise StateError(f"blocksize {self.blocksize} is not one of {sizes}")
        if self.shape is None:
            raise StateError("QuantState.shape is missing")
        if dtype_name(self.dtype) not in ("float32", "float16", "bfloat16"):
            raise StateError(f"QuantState.dtype must be float32, float16 or bfloat16, got {self.dtype}")
        shape, dt = meta(self.absmax)
        nb = bnb.nblocks(self.n, self.blocksize)
        if shape != (nb,):
            raise StateError(f"absmax has shape {shape}, expected ({nb},) for {self.n} elements "
                             f"in blocks of {self.blocksize}")
        if self.nested:
            if dt != np.uint8:
                raise StateError("a nested state's absmax must hold uint8 codes")
            s2 = self.state2
            shape2, dt2 = meta(s2.absmax)
            if s2.blocksize != bnb.NESTED_BLOCKSIZE:
                raise StateError(f"nested blocksize must be {bnb.NESTED_BLOCKSIZE}, got {s2.blocksize}")
            if shape2 != (bnb.nblocks(nb, s2.blocksize),) or dt2 != np.float32:
                raise StateError(f"nested absmax must be float32 [{bnb.nblocks(nb, s2.blocksize)}], "
                                 f"got {dt2} {shape2}")
            if s2.code is None or meta(s2.code) != ((256,), np.dtype(np.float32)):
                raise StateError("nested code must be float32 [256]")
            if self.offset is None or math.prod(meta(self.offset)[0]) != 1:
                raise StateError("a nested state needs a scalar offset")
        elif dt != np.float32:
            raise StateError(f"absmax must be float32 (or uint8 when nested), got {dt}")
        if self.quant_type is not None and self.code is not None:
            if meta(self.code)[0] != (16,):
                raise StateError(f"quant_map must have 16 entries, got shape {meta(self.code)[0]}")
            # The values are compared only for host tables: reading a device table back would
            # synchronize on every call and break graph capture. from_dict checks loaded maps.
            if _on_host(self.code) and not _code_matches(_host(self.code), self.quant_type):
                raise StateError(f"quant_map does not match the {self.quant_type} table; "
                                 "custom 4-bit maps are not supported")
        return self

    # -- serialization ---------------------------------------------------------------------
    def as_dict(self, packed: bool = False) -> dict[str, Any]:
        """bitsandbytes' ``QuantState.as_dict``; ``packed=True`` gives the safetensors layout."""
        d: dict[str, Any] = {
            "quant_type": self.quant_type,
            "absmax": self.absmax,
            "blocksize": self.blocksize,
            "quant_map": self.code,
            "dtype": dtype_name(self.dtype),
            "shape": tuple(self.shape),
        }
        if self.nested:
            d.update({
                "nested_absmax": self.state2.absmax,
                "nested_blocksize": self.state2.blocksize,
                "nested_quant_map": self.state2.code,
                "nested_dtype": "float32",
                "nested_offset": float(_host(self.offset).reshape(-1)[0]),
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

        Keys may carry a layer prefix (``model.layers.0.weight.absmax``). Tensors keep their kind;
        with torch tensors, ``device`` moves them as bitsandbytes does.
        """
        qs = dict(qs_dict)
        packed_keys = [k for k, v in qs.items() if "quant_state" in k and _is_array(v)]
        if not packed_keys and "quant_type" not in qs:
            raise StateError("expected a packed quant_state entry or a 'quant_type' key")
        if len(packed_keys) > 1:
            raise StateError(f"more than one quant_state entry: {packed_keys}")
        if packed_keys:
            raw = _host(qs.pop(packed_keys[0]))
            qs.update(json.loads(bytes(np.asarray(raw, dtype=np.uint8)).decode("utf-8")))
        qs = {k.split(".")[-1]: v for k, v in qs.items()}
        unknown = set(qs) - VALID_QS_KEYS
        if unknown:
            raise StateError(f"unexpected keys in quant state dict: {sorted(unknown)}")

        def move(v):
            return v.to(device) if device is not None and array_kind(v) == "torch" else v

        state2 = offset = None
        if "nested_absmax" in qs:
            absmax2 = move(qs["nested_absmax"])
            offset = np.array([qs["nested_offset"]], dtype=np.float32)
            if array_kind(absmax2) == "torch":
                import torch

                offset = torch.tensor([float(qs["nested_offset"])], dtype=torch.float32,
                                      device=absmax2.device)
            state2 = cls(absmax=absmax2, shape=None, code=move(qs["nested_quant_map"]),
                         blocksize=int(qs["nested_blocksize"]), dtype=qs.get("nested_dtype", "float32"))
        shape = qs.get("shape")
        state = cls(
            absmax=move(qs["absmax"]),
            shape=tuple(int(s) for s in shape) if shape is not None else None,
            code=move(qs["quant_map"]) if "quant_map" in qs else None,
            blocksize=int(qs["blocksize"]),
            quant_type=qs["quant_type"],
            dtype=_dtype_from_name(qs.get("dtype", "float32")),
            offset=offset,
            state2=state2,
        )
        state.validate()
        # validate() checks host maps; a map loaded onto a device is read back once, here
        if (state.quant_type is not None and state.code is not None and not _on_host(state.code)
                and not _code_matches(_host(state.code), state.quant_type)):
            raise StateError(f"quant_map does not match the {state.quant_type} table; "
                             "custom 4-bit maps are not supported")
        return state


def _on_host(v: Any) -> bool:
    kind = array_kind(v)
    return kind == "numpy" or (kind == "torch" and v.device.type == "cpu")


def _code_matches(host: np.ndarray, quant_type: str) -> bool:
    # by value: bitsandbytes' fp4 quant_map holds +0.0 where its kernel decodes -0.0
    return np.array_equal(host.astype(np.float32), bnb.code_4bit(quant_type))


def _dtype_from_name(name: str) -> str:
    try:
        return dtype_name(as_dtype(str(name).replace("torch.", "")))
    except TypeError as exc:
        raise DTypeError(f"unsupported dtype in quant state: {name!r}") from exc


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
