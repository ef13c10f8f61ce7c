"""QuantState hardening (issue 22): every field validated with a StateError naming it, the same on
every array kind and backend (numpy and torch CPU on the cpu backend, SYCL USM on the sycl backend
where it is available); 4-bit code tables checked against quant_type on and off the host, a device
table read back once per table; from_dict / as_dict raise StateError naming the key for any
malformed dict and never merge keys of two layers."""

from __future__ import annotations

import json

import numpy as np
import pytest

import quantcore as qc
import quantcore.state as qstate
from quantcore.formats import bnb

torch = pytest.importorskip("torch", reason="the torch cases need torch")

_SYCL = qc.available_backends()["sycl"]
KINDS = ["numpy", "torch", pytest.param("sycl", marks=pytest.mark.skipif(
    not _SYCL.ok, reason=f"sycl backend unavailable: {_SYCL.reason}"))]
SHAPE = (8, 128)


def conv(kind: str):
    """numpy -> the array kind ``kind``."""
    if kind == "numpy":
        return lambda a: np.array(a)
    if kind == "torch":
        return lambda a: torch.from_numpy(np.array(a))
    be = qc.get_backend("sycl")
    return lambda a: be.from_numpy(np.ascontiguousarray(a))


def backend(kind: str) -> str:
    return "sycl" if kind == "sycl" else "cpu"


def make(kind: str, nested: bool = True, qt: str = "nf4"):
    """(packed, state) of a fixed weight, the state's arrays (and packed) in ``kind``."""
    w = np.linspace(-1, 1, SHAPE[0] * SHAPE[1], dtype=np.float32).reshape(SHAPE)
    packed, st = qc.quantize_4bit(w, 64, qt, nested)
    c = conv(kind)
    state = qc.QuantState(absmax=c(st.absmax), shape=st.shape, code=c(st.code), blocksize=st.blocksize,
                          quant_type=st.quant_type, dtype=st.dtype)
    if nested:
        state.offset = c(st.offset)
        state.state2 = qc.QuantState(absmax=c(st.state2.absmax), code=c(st.state2.code), blocksize=256,
                                     dtype="float32")
    return c(packed), state


def host(kind: str, a):
    if kind == "torch":
        return a.numpy()
    if kind == "sycl":
        return a.to_numpy()
    return np.asarray(a)


# -- every field of QuantState -----------------------------------------------------------------------
NF4_REVERSED = bnb.NF4_CODE[::-1].copy()

# (case id, the field its message names, mutate(state, c) with c: numpy -> the kind)
TAMPER = [
    ("shape-negative", "shape", lambda s, c: setattr(s, "shape", (-8, -128))),
    ("shape-float", "shape", lambda s, c: setattr(s, "shape", (8.0, 128.0))),
    ("shape-bool", "shape", lambda s, c: setattr(s, "shape", (True, 1024))),
    ("shape-none", "shape", lambda s, c: setattr(s, "shape", None)),
    ("shape-string", "shape", lambda s, c: setattr(s, "shape", "8,128")),
    ("shape-array", "shape", lambda s, c: setattr(s, "shape", np.array(SHAPE))),
    ("dtype-garbage", "dtype", lambda s, c: setattr(s, "dtype", "garbage")),
    ("dtype-int8", "dtype", lambda s, c: setattr(s, "dtype", "int8")),
    ("dtype-none", "dtype", lambda s, c: setattr(s, "dtype", None)),
    ("dtype-list", "dtype", lambda s, c: setattr(s, "dtype", ["float32"])),
    ("blocksize-64.5", "blocksize", lambda s, c: setattr(s, "blocksize", 64.5)),
    ("blocksize-64.0", "blocksize", lambda s, c: setattr(s, "blocksize", 64.0)),
    ("blocksize-bool", "blocksize", lambda s, c: setattr(s, "blocksize", True)),
    ("blocksize-str", "blocksize", lambda s, c: setattr(s, "blocksize", "64")),
    ("blocksize-48", "blocksize", lambda s, c: setattr(s, "blocksize", 48)),
    ("quant-type-int4", "quant_type", lambda s, c: setattr(s, "quant_type", "int4")),
    ("quant-type-list", "quant_type", lambda s, c: setattr(s, "quant_type", ["nf4"])),
    ("absmax-list", "absmax", lambda s, c: setattr(s, "absmax", [1.0] * 16)),
    ("absmax-dict", "absmax", lambda s, c: setattr(s, "absmax", {"a": 1})),
    ("absmax-none", "absmax", lambda s, c: setattr(s, "absmax", None)),
    ("absmax-scalar", "absmax", lambda s, c: setattr(s, "absmax", np.float32(1))),
    ("absmax-float32-when-nested", "absmax", lambda s, c: setattr(s, "absmax", c(np.ones(16, np.float32)))),
    ("absmax-short", "absmax", lambda s, c: setattr(s, "absmax", c(np.ones(15, np.uint8)))),
    ("state2-dict", "state2", lambda s, c: setattr(s, "state2", {"absmax": c(np.ones(1, np.float32))})),
    ("state2-list", "state2", lambda s, c: setattr(s, "state2", [1, 2])),
    ("offset-float64", "offset", lambda s, c: setattr(s, "offset", c(np.array([0.1], np.float64)))),
    ("offset-float16", "offset", lambda s, c: setattr(s, "offset", c(np.array([0.1], np.float16)))),
    ("offset-int32", "offset", lambda s, c: setattr(s, "offset", c(np.array([1], np.int32)))),
    ("offset-two", "offset", lambda s, c: setattr(s, "offset", c(np.zeros(2, np.float32)))),
    ("offset-none", "offset", lambda s, c: setattr(s, "offset", None)),
    ("offset-float", "offset", lambda s, c: setattr(s, "offset", 0.1)),
    ("nested-code-float64", "state2.code",
     lambda s, c: setattr(s.state2, "code", c(bnb.DYNAMIC_MAP.astype(np.float64)))),
    ("nested-code-128", "state2.code", lambda s, c: setattr(s.state2, "code", c(bnb.DYNAMIC_MAP[:128]))),
    ("nested-code-none", "state2.code", lambda s, c: setattr(s.state2, "code", None)),
    ("nested-absmax-float16", "state2.absmax",
     lambda s, c: setattr(s.state2, "absmax", c(np.ones(1, np.float16)))),
    ("nested-absmax-long", "state2.absmax", lambda s, c: setattr(s.state2, "absmax", c(np.ones(2, np.float32)))),
    ("nested-blocksize-128", "state2.blocksize", lambda s, c: setattr(s.state2, "blocksize", 128)),
    ("nested-blocksize-float", "state2.blocksize", lambda s, c: setattr(s.state2, "blocksize", 256.0)),
    ("nested-dtype-float16", "state2.dtype", lambda s, c: setattr(s.state2, "dtype", "float16")),
    ("nested-quant-type", "state2.quant_type", lambda s, c: setattr(s.state2, "quant_type", "nf4")),
    ("nested-nested", "state2.state2", lambda s, c: setattr(s.state2, "state2", s.state2)),
    ("code-reversed-nf4", "code", lambda s, c: setattr(s, "code", c(NF4_REVERSED))),
    ("code-fp4-type-on-nf4", "code", lambda s, c: setattr(s, "quant_type", "fp4")),
    ("code-float64", "code", lambda s, c: setattr(s, "code", c(bnb.NF4_CODE.astype(np.float64)))),
    ("code-15", "code", lambda s, c: setattr(s, "code", c(bnb.NF4_CODE[:15]))),
    ("code-list", "code", lambda s, c: setattr(s, "code", list(bnb.NF4_CODE))),
]


def _message(kind: str, mutate) -> tuple[type, str]:
    packed, state = make(kind)
    mutate(state, conv(kind))
    with pytest.raises(qc.QuantcoreError) as info:
        state.validate()
    return type(info.value), str(info.value)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case, field, mutate", TAMPER, ids=[t[0] for t in TAMPER])
def test_tampered_state_is_a_state_error_naming_the_field(kind, case, field, mutate):
    packed, state = make(kind)
    mutate(state, conv(kind))
    with pytest.raises(qc.StateError) as info:
        state.validate()
    assert info.value.field == field
    assert f"QuantState.{field} " in str(info.value)
    # the same through the public API on the kind's backend, before any work
    for call in (lambda: qc.dequantize_4bit(packed, state, backend=backend(kind)),
                 lambda: qc.gemv_4bit(conv(kind)(np.ones((1, SHAPE[1]), np.float32)), packed, state,
                                      backend=backend(kind))):
        with pytest.raises(qc.StateError) as info2:
            call()
        assert str(info2.value) == str(info.value)
    # and the same type and message as with numpy arrays
    if kind != "numpy":
        assert _message("numpy", mutate) == (qc.StateError, str(info.value))


def test_torch_only_array_kinds_are_state_errors():
    for field, value in (("absmax", torch.ones(16, dtype=torch.complex64)),
                         ("absmax", torch.ones(16, dtype=torch.float32).to_sparse()),
                         ("offset", torch.ones(1, dtype=torch.float8_e5m2)),
                         ("code", torch.ones(16, dtype=torch.uint16))):
        _, state = make("torch")
        setattr(state, field, value)
        with pytest.raises(qc.StateError, match=f"QuantState.{field} "):
            state.validate()


@pytest.mark.parametrize("kind", KINDS)
def test_non_nested_state_fields(kind):
    packed, state = make(kind, nested=False)
    state.validate()
    state.absmax = conv(kind)(np.ones(16, np.uint8))
    with pytest.raises(qc.StateError, match="QuantState.absmax must be float32"):
        state.validate()
    _, state = make(kind, nested=False)
    state.offset = conv(kind)(np.zeros(1, np.float32))  # an offset without state2: a half-built state
    with pytest.raises(qc.StateError, match="QuantState.offset "):
        qc.dequantize_4bit(packed, state, backend=backend(kind))


@pytest.mark.parametrize("kind", KINDS)
def test_8bit_state_fields(kind):
    c = conv(kind)
    x = np.linspace(-1, 1, 256, dtype=np.float32)
    codes, st = qc.quantize_blockwise(x, 64)
    for field, over in (("code", {"code": None}), ("code", {"code": c(bnb.DYNAMIC_MAP[:128])}),
                        ("code", {"code": c(bnb.DYNAMIC_MAP.astype(np.float16))}),
                        ("blocksize", {"blocksize": 32}), ("shape", {"shape": (-256,)}),
                        ("state2", {"state2": qc.QuantState(absmax=c(np.ones(1, np.float32)),
                                                            code=c(bnb.DYNAMIC_MAP), blocksize=256)})):
        fields = dict(absmax=c(st.absmax), shape=st.shape, code=c(st.code), blocksize=64, dtype="float32")
        fields.update(over)
        state = qc.QuantState(**fields)
        with pytest.raises(qc.StateError, match=f"QuantState.{field} "):
            qc.dequantize_blockwise(c(codes), state, backend=backend(kind))


@pytest.mark.parametrize("kind", KINDS)
def test_numpy_integers_are_python_ints_on_every_backend(kind):
    packed, state = make(kind)
    ref = host(kind, qc.dequantize_4bit(packed, state, backend=backend(kind)))
    gref = host(kind, qc.gemv_4bit(conv(kind)(np.ones((1, SHAPE[1]), np.float32)), packed, state,
                                   backend=backend(kind)))
    _, state = make(kind)
    state.blocksize = np.int64(64)
    state.shape = [np.int32(SHAPE[0]), np.uint64(SHAPE[1])]
    state.quant_type = np.str_("nf4")
    state.state2.blocksize = np.int16(256)
    out = host(kind, qc.dequantize_4bit(packed, state, backend=backend(kind)))
    assert np.array_equal(out, ref)
    assert type(state.blocksize) is int and state.shape == SHAPE and type(state.shape[0]) is int
    assert type(state.quant_type) is str and type(state.state2.blocksize) is int
    g = host(kind, qc.gemv_4bit(conv(kind)(np.ones((1, SHAPE[1]), np.float32)), packed, state,
                                backend=backend(kind)))
    assert np.array_equal(g, gref)


def test_valid_states_are_left_alone():
    packed, state = make("numpy")
    before = dict(state.__dict__)
    state._plans = {"x": 1}
    state.validate()
    assert state._plans == {"x": 1}  # nothing assigned: a plan kept on the state survives validation
    assert all(state.__dict__[k] is v for k, v in before.items())
    # bitsandbytes' fp4 quant_map holds +0.0 where quantcore's table holds -0.0: equal by value
    _, st = make("numpy", qt="fp4")
    st.code = np.abs(bnb.FP4_CODE) * np.sign(bnb.FP4_CODE + 0.0)
    st.code = st.code.astype(np.float32)
    st.validate()
    # 0-d and [1, 1] offsets hold one element too
    _, st = make("torch")
    st.offset = st.offset.reshape(())
    st.validate()


# -- the code table of a device-resident state ----------------------------------------------------------
def _count_host(monkeypatch) -> list:
    calls = []
    real = qstate._host

    def counting(v):
        calls.append(type(v).__name__)
        return real(v)

    monkeypatch.setattr(qstate, "_host", counting)
    return calls


def test_torch_table_is_read_once_and_in_place_writes_are_seen(monkeypatch):
    calls = _count_host(monkeypatch)
    packed, state = make("torch")
    ref = qc.dequantize_4bit(packed, state)
    for _ in range(50):
        state.validate()
    qc.dequantize_4bit(packed, state)
    assert len(calls) == 1, "the table must be read back once, not on every call"
    # switching quant_type on the same table needs no second read: the answer is the table's type
    state.quant_type = "fp4"
    with pytest.raises(qc.StateError, match="holds the nf4 table, but quant_type is 'fp4'"):
        state.validate()
    state.quant_type = "nf4"
    assert len(calls) == 1
    # an in-place write (through the tensor or any view of it) is caught on the next call
    state.code.copy_(torch.from_numpy(NF4_REVERSED))
    with pytest.raises(qc.StateError, match="neither the nf4 nor the fp4 table"):
        qc.dequantize_4bit(packed, state)
    assert len(calls) == 2
    with pytest.raises(qc.StateError, match="quant_map"):
        state.validate()
    assert len(calls) == 2  # the bad answer is remembered too
    state.code[:8].copy_(torch.from_numpy(bnb.NF4_CODE[:8].copy()))
    state.code[8:].copy_(torch.from_numpy(bnb.NF4_CODE[8:].copy()))
    assert torch.equal(qc.dequantize_4bit(packed, state), ref)
    # a new table object is read once
    state.code = torch.from_numpy(bnb.FP4_CODE.copy())
    with pytest.raises(qc.StateError, match="holds the fp4 table, but quant_type is 'nf4'"):
        state.validate()
    n = len(calls)
    with pytest.raises(qc.StateError):
        state.validate()
    assert len(calls) == n
    # tables made by quantize_4bit are shared: one read for every state
    x = torch.from_numpy(np.ones((4, 64), np.float32))
    states = [qc.quantize_4bit(x * i, 64, "nf4")[1] for i in range(1, 5)]
    for st in states:
        st.validate()
    before = len(calls)
    for st in states:
        st.validate()
    assert len(calls) == before


def test_remembered_tables_are_forgotten_with_them(monkeypatch):
    _, state = make("torch")
    state.code = torch.from_numpy(bnb.NF4_CODE.copy())
    state.validate()
    key = id(state.code)
    assert key in qstate._TABLES
    state.code = None
    import gc

    gc.collect()
    assert key not in qstate._TABLES  # forgotten with the table (no id reused for a stale answer)


@pytest.mark.skipif(not _SYCL.ok, reason=f"sycl backend unavailable: {_SYCL.reason}")
def test_sycl_table_is_read_once_and_checked(monkeypatch):
    calls = _count_host(monkeypatch)
    packed, state = make("sycl")
    for _ in range(20):
        qc.dequantize_4bit(packed, state, backend="sycl")
    assert len(calls) == 1
    state.quant_type = "fp4"  # fp4 on NF4 data: decoded as the wrong table before the fix
    with pytest.raises(qc.StateError, match="holds the nf4 table"):
        qc.dequantize_4bit(packed, state, backend="sycl")
    _, bad = make("sycl")
    bad.code = conv("sycl")(NF4_REVERSED)
    with pytest.raises(qc.StateError, match="quant_map"):
        qc.gemv_4bit(conv("sycl")(np.ones((1, SHAPE[1]), np.float32)), packed, bad, backend="sycl")
    assert len(calls) == 2


# -- from_dict -------------------------------------------------------------------------------------------
def _packed_dict(kind: str = "numpy", nested: bool = True, prefix: str = "") -> dict:
    _, state = make(kind, nested)
    return {prefix + k: v for k, v in state.as_dict(packed=True).items()}


def _json_key(d: dict) -> str:
    return next(k for k in d if "quant_state" in k)


def _with_json(d: dict, raw: bytes) -> dict:
    d = dict(d)
    d[_json_key(d)] = np.frombuffer(raw, np.uint8).copy()
    return d


def _edit_json(d: dict, **changes) -> dict:
    obj = json.loads(bytes(np.asarray(d[_json_key(d)])).decode())
    for k, v in changes.items():
        if v is _DROP:
            obj.pop(k)
        else:
            obj[k] = v
    return _with_json(d, json.dumps(obj).encode())


_DROP = object()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("prefix", ["", "model.layers.0.mlp.weight."])
def test_from_dict_round_trips(kind, prefix):
    packed, state = make(kind)
    for d in (state.as_dict(packed=True), state.as_dict()):
        back = qc.QuantState.from_dict({prefix + k: v for k, v in d.items()})
        assert back.shape == SHAPE and back.blocksize == 64 and back.quant_type == "nf4"
        assert np.array_equal(host(kind, qc.dequantize_4bit(packed, back, backend=backend(kind))),
                              host(kind, qc.dequantize_4bit(packed, state, backend=backend(kind))))


def _raises_naming(d, key, match: str | None = None):
    """from_dict(d) raises a StateError that names ``key`` (quoted) and says it is the dict's."""
    with pytest.raises(qc.StateError) as info:
        qc.QuantState.from_dict(d)
    assert repr(key) in str(info.value) and "quant state dict" in str(info.value), str(info.value)
    if match is not None:
        assert match in str(info.value), str(info.value)
    return info.value


@pytest.mark.parametrize("key", ["absmax", "quant_map", "nested_absmax", "nested_quant_map"])
def test_from_dict_missing_array_keys(key):
    d = _packed_dict()
    d.pop(key)
    if key == "quant_map":  # optional for 4-bit states (the kernels use quant_type); present: checked
        qc.QuantState.from_dict(d)
        return
    _raises_naming(d, key)


@pytest.mark.parametrize("key", ["quant_type", "blocksize", "shape", "nested_blocksize", "nested_offset"])
def test_from_dict_missing_keys_unpacked(key):
    _, state = make("numpy")
    d = state.as_dict()
    d.pop(key)
    _raises_naming(d, key)


@pytest.mark.parametrize("key", ["blocksize", "shape", "nested_blocksize", "nested_offset"])
def test_from_dict_missing_keys_in_json(key):
    _raises_naming(_edit_json(_packed_dict(), **{key: _DROP}), key)


def test_from_dict_nested_keys_without_nested_absmax():
    d = _packed_dict()
    d.pop("nested_absmax")
    d.pop("nested_quant_map")
    _raises_naming(d, "nested_absmax")


@pytest.mark.parametrize("raw, match", [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe\x00garbage", "not UTF-8"),
    (b"[" * 200000 + b"]" * 200000, "nested too deeply"),
    (b"[1, 2]", "JSON object"),
    (b'"nf4"', "JSON object"),
    (b"", "not valid JSON"),
])
def test_from_dict_bad_json(raw, match):
    d = _with_json(_packed_dict(), raw)
    _raises_naming(d, "quant_state.bitsandbytes__nf4", match)


def test_from_dict_bad_packed_entries():
    d = _packed_dict()
    k = _json_key(d)
    for bad in (d[k].astype(np.int32), list(d[k]), d[k].tobytes().decode()):
        _raises_naming({**d, k: bad}, k)
    # bytes are taken as the JSON bytes themselves
    assert qc.QuantState.from_dict({**d, k: d[k].tobytes()}).shape == SHAPE
    _raises_naming(_edit_json(d, extra=1), "extra")
    _raises_naming(_edit_json(d, quant_type="fp4"), "quant_state.bitsandbytes__nf4", "'fp4'")
    # a field given both as a key and in the JSON
    _raises_naming({**d, "blocksize": 64}, "blocksize", "also given")
    # two packed entries, or a packed entry of an unknown type
    _raises_naming({**d, "quant_state.bitsandbytes__fp4": d[k]}, "quant_state.bitsandbytes__fp4")
    d2 = dict(d)
    d2["quant_state.bitsandbytes__int4"] = d2.pop(k)
    _raises_naming(d2, "quant_state.bitsandbytes__int4", "int4")


@pytest.mark.parametrize("value", [None, "0.5", float("nan"), float("inf"), 1e39, True, [0.5], 10**400])
def test_from_dict_nested_offset(value):
    d = _packed_dict()
    if isinstance(value, float) and not np.isfinite(value):  # json.dumps writes NaN / Infinity
        d = _edit_json(d, nested_offset=value)
    else:
        d = _edit_json(d, nested_offset=value)
    _raises_naming(d, "nested_offset")
    _, state = make("numpy")
    u = state.as_dict()
    u["nested_offset"] = value
    _raises_naming(u, "nested_offset")


@pytest.mark.parametrize("key, value", [
    ("blocksize", 64.5), ("blocksize", 64.0), ("blocksize", "64"), ("blocksize", True), ("blocksize", None),
    ("blocksize", 48), ("nested_blocksize", 256.0), ("nested_blocksize", 128),
    ("shape", [-8, -128]), ("shape", [8.0, 128.0]), ("shape", "8,128"), ("shape", None), ("shape", 1024),
    ("dtype", "garbage"), ("dtype", "int8"), ("dtype", 3), ("dtype", None),
    ("nested_dtype", "float16"), ("nested_dtype", "garbage"), ("quant_type", "int4"), ("quant_type", 4),
])
def test_from_dict_bad_values(key, value):
    _, state = make("numpy")
    d = state.as_dict()
    d[key] = value
    _raises_naming(d, key)
    if key != "quant_type":  # in the packed JSON too (quant_type there must match the key's)
        _raises_naming(_edit_json(_packed_dict(), **{key: value}), key)


def test_from_dict_blocksize_is_not_truncated():
    _, state = make("numpy")
    d = state.as_dict()
    d["blocksize"] = 64.5
    err = _raises_naming(d, "blocksize", "64.5")
    assert "integer" in str(err)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("key, value", [
    ("absmax", lambda c: [1.0] * 16), ("absmax", lambda c: {"x": 1}), ("absmax", lambda c: c(np.ones(16, np.float32))),
    ("absmax", lambda c: c(np.ones(3, np.uint8))), ("quant_map", lambda c: c(NF4_REVERSED)),
    ("quant_map", lambda c: c(bnb.FP4_CODE)), ("quant_map", lambda c: c(bnb.NF4_CODE.astype(np.float64))),
    ("quant_map", lambda c: list(bnb.NF4_CODE)), ("nested_absmax", lambda c: c(np.ones(1, np.float64))),
    ("nested_absmax", lambda c: {"absmax": 1}), ("nested_quant_map", lambda c: c(bnb.DYNAMIC_MAP[:128])),
    ("nested_quant_map", lambda c: c(bnb.DYNAMIC_MAP.astype(np.float16))),
])
def test_from_dict_bad_arrays(kind, key, value):
    d = _packed_dict(kind)
    d[key] = value(conv(kind))
    _raises_naming(d, key)


def test_from_dict_refuses_keys_of_two_layers():
    a = _packed_dict(prefix="a.weight.")
    b = _packed_dict(prefix="b.weight.")
    merged = {k: v for k, v in a.items() if not k.endswith("absmax")}
    merged.update({k: v for k, v in b.items() if k.endswith("absmax")})
    err = _raises_naming(merged, "a.weight.")
    assert "'b.weight.'" in str(err)
    both = {**a, **b}
    err = _raises_naming(both, "a.weight.")
    assert "'b.weight.'" in str(err)
    # prefixed and unprefixed keys are two layers too
    mixed = dict(a)
    mixed["absmax"] = mixed.pop("a.weight.absmax")
    err = _raises_naming(mixed, "a.weight.")
    assert "''" in str(err)


def test_from_dict_bad_containers_and_keys():
    for bad in (None, [("absmax", np.ones(16, np.float32))], "absmax"):
        with pytest.raises(qc.StateError, match="mapping"):
            qc.QuantState.from_dict(bad)
    d = _packed_dict()
    _raises_naming({**d, 3: np.ones(1)}, 3)
    _raises_naming({**d, "a.weight.unknown": 1}, "a.weight.unknown")
    _raises_naming({**d, "quant_state": np.ones(1, np.uint8)}, "quant_state")


def test_from_dict_bad_device():
    d = _packed_dict("torch")
    with pytest.raises(qc.DeviceError, match="device"):
        qc.QuantState.from_dict(d, device="no-such-device")


def test_from_dict_does_not_change_its_input():
    d = _packed_dict(prefix="l.weight.")
    keys = dict(d)
    qc.QuantState.from_dict(d)
    assert d.keys() == keys.keys() and all(d[k] is keys[k] for k in d)


# -- as_dict -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case, field, mutate", [t for t in TAMPER if t[0] in (
    "shape-none", "shape-negative", "dtype-garbage", "state2-dict", "offset-none", "offset-float64",
    "absmax-list", "blocksize-64.5", "code-reversed-nf4", "nested-code-128")], ids=lambda t: str(t)[:30])
def test_as_dict_failures_are_state_errors(kind, case, field, mutate):
    _, state = make(kind)
    mutate(state, conv(kind))
    for packed in (False, True):
        with pytest.raises(qc.StateError, match=f"QuantState.{field} "):
            state.as_dict(packed=packed)


@pytest.mark.parametrize("kind", KINDS)
def test_as_dict_non_finite_offset(kind):
    _, state = make(kind)
    state.offset = conv(kind)(np.array([np.nan], np.float32))
    with pytest.raises(qc.StateError, match="QuantState.offset is nan"):
        state.as_dict(packed=True)


def test_as_dict_writes_python_numbers():
    _, state = make("numpy")
    state.blocksize = np.int64(64)
    state.shape = (np.int64(8), np.int64(128))
    d = state.as_dict(packed=True)
    obj = json.loads(bytes(d[_json_key(d)]).decode())
    assert obj["blocksize"] == 64 and obj["shape"] == [8, 128]
