"""quantcore.io.gguf: the reader against gguf-py, malformed files, llama-quantize's rules, Q6_K."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from quantcore.errors import ParameterError, QuantcoreError, ShapeError, UnsupportedError
from quantcore.formats import ggml
from quantcore.io import gguf as qg

GOLDEN = Path(__file__).parent / "golden"
TINY = GOLDEN / "tiny_llama.gguf"


# -- small files built by hand -------------------------------------------------------------------


def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def _tinfo(name: str, ne: tuple[int, ...], ttype: int, off: int) -> bytes:
    return _s(name) + struct.pack(f"<I{len(ne)}qiQ", len(ne), *ne, ttype, off)


def _file(kvs: list[bytes], infos: list[bytes], data: bytes, *, version: int = 3, n_kv=None, n_tensors=None,
          align: int = 32) -> bytes:
    head = b"GGUF" + struct.pack("<Iqq", version, len(infos) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    head += b"".join(kvs) + b"".join(infos)
    head += b"\0" * (-len(head) % align)
    return head + data


def _valid() -> tuple[bytes, np.ndarray, np.ndarray]:
    a = np.arange(64, dtype=np.float32).reshape(2, 32)
    b = np.linspace(-1, 1, 32).astype(np.float16)
    kvs = [_kv("general.architecture", 8, _s("llama")), _kv("x.arr", 9, struct.pack("<IQ", 5, 3) + np.array([1, -2, 3], "<i4").tobytes())]
    infos = [_tinfo("a", (32, 2), 0, 0), _tinfo("b", (32,), 1, 256)]
    data = a.tobytes() + b"\0" * (256 - a.nbytes) + b.tobytes()
    return _file(kvs, infos, data), a, b


def _write(tmp_path: Path, raw: bytes, name: str = "t.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(raw)
    return p


def test_hand_built_file_reads(tmp_path):
    raw, a, b = _valid()
    g = qg.read_gguf(_write(tmp_path, raw))
    assert qg.is_gguf(tmp_path / "t.gguf") and not qg.is_gguf(_write(tmp_path, b"{}", "x.json"))
    assert not qg.is_gguf(tmp_path / "missing.gguf")
    assert g.version == 3 and g.alignment == 32
    assert g.metadata["general.architecture"] == "llama"
    assert g.kv["x.arr"].item_type == qg.ValueType.INT32 and list(g.metadata["x.arr"]) == [1, -2, 3]
    assert np.array_equal(g.tensor("a"), a) and g.tensor("a").shape == (2, 32)
    assert np.array_equal(g.tensor("b"), b)
    assert isinstance(g.raw("a"), np.memmap) and not g.raw("a").flags.writeable
    with pytest.raises(ValueError):
        g.tensor("a")[0, 0] = 1.0
    assert np.array_equal(g.dequantize("b"), b.astype(np.float32))
    g.release("a")  # pages dropped from memory, read again from the file on use
    assert np.array_equal(g.tensor("a"), a)
    with pytest.raises(ParameterError, match="no tensor named"):
        g.tensor("zzz")


@pytest.mark.parametrize("case, exc, match", [
    ("magic", qg.GGUFFormatError, "not a GGUF file"),
    ("version1", UnsupportedError, "version 1"),
    ("bigendian", UnsupportedError, "big-endian"),
    ("huge_n_kv", qg.GGUFFormatError, "metadata count"),
    ("negative_n_kv", qg.GGUFFormatError, "metadata count"),
    ("huge_n_tensors", qg.GGUFFormatError, "tensor count"),
    ("huge_string", qg.GGUFFormatError, "string length"),
    ("huge_array", qg.GGUFFormatError, "array: count"),
    ("bad_value_type", qg.GGUFFormatError, "unknown value type 13"),
    ("bad_item_type", qg.GGUFFormatError, "unknown array item type 99"),
    ("dup_key", qg.GGUFFormatError, "duplicate metadata key"),
    ("dup_tensor", qg.GGUFFormatError, "duplicate tensor name"),
    ("offset_outside", qg.GGUFFormatError, "outside the file"),
    ("offset_huge", qg.GGUFFormatError, "outside the file"),
    ("misaligned", qg.GGUFFormatError, "not a multiple of the alignment"),
    ("overlap", qg.GGUFFormatError, "overlap"),
    ("unknown_type", UnsupportedError, "unknown ggml type id 31"),
    ("too_many_dims", qg.GGUFFormatError, "5 dimensions"),
    ("negative_dim", qg.GGUFFormatError, "negative dimension"),
    ("row_not_blocks", qg.GGUFFormatError, "multiple of 32"),
    ("align_not_pow2", qg.GGUFFormatError, "not a power of 2"),
    ("align_wrong_type", qg.GGUFFormatError, "must be a UINT32"),
    ("nesting", qg.GGUFFormatError, "nested deeper"),
])
def test_malformed_files_are_clear_errors(tmp_path, case, exc, match):
    arch = _kv("general.architecture", 8, _s("llama"))
    data = b"\0" * 512
    t_a = _tinfo("a", (32, 2), 0, 0)
    files = {
        "magic": b"GGUX" + _valid()[0][4:],
        "version1": _file([arch], [t_a], data, version=1),
        "bigendian": b"GGUF" + struct.pack(">I", 3) + _valid()[0][8:],
        "huge_n_kv": _file([arch], [t_a], data, n_kv=1 << 60),
        "negative_n_kv": _file([arch], [t_a], data, n_kv=-1),
        "huge_n_tensors": _file([arch], [t_a], data, n_tensors=1 << 62),
        "huge_string": _file([struct.pack("<Q", 1 << 62) + b"k"], [], data),
        "huge_array": _file([_kv("k", 9, struct.pack("<IQ", 8, 1 << 61))], [], data),
        "bad_value_type": _file([_kv("k", 13, b"\0" * 8)], [], data),
        "bad_item_type": _file([_kv("k", 9, struct.pack("<IQ", 99, 1))], [], data),
        "dup_key": _file([arch, arch], [], data),
        "dup_tensor": _file([arch], [t_a, _tinfo("a", (32,), 0, 256)], data),
        "offset_outside": _file([arch], [_tinfo("a", (32, 2), 0, 1 << 20)], data),
        "offset_huge": _file([arch], [_tinfo("a", (32, 2), 0, (1 << 64) - 32)], data),
        "misaligned": _file([arch], [_tinfo("a", (32, 2), 0, 4)], data),
        "overlap": _file([arch], [t_a, _tinfo("b", (32,), 0, 128)], data),
        "unknown_type": _file([arch], [_tinfo("a", (32, 2), 31, 0)], data),
        "too_many_dims": _file([arch], [_tinfo("a", (32, 1, 1, 1, 1), 0, 0)], data),
        "negative_dim": _file([arch], [_tinfo("a", (32, -2), 0, 0)], data),
        "row_not_blocks": _file([arch], [_tinfo("a", (48, 2), 2, 0)], data),
        "align_not_pow2": _file([_kv("general.alignment", 4, struct.pack("<I", 48))], [t_a], data),
        "align_wrong_type": _file([_kv("general.alignment", 10, struct.pack("<Q", 32))], [t_a], data),
        "nesting": _file([_kv("k", 9, struct.pack("<IQ", 9, 1) * 12 + struct.pack("<IQ", 0, 0))], [], data),
    }
    with pytest.raises(exc, match=match):
        qg.read_gguf(_write(tmp_path, files[case]))


def test_every_truncation_is_a_clear_error(tmp_path):
    raw = TINY.read_bytes()[:4096] if TINY.exists() else _valid()[0]
    small, _, _ = _valid()
    for blob in (small, raw):
        for n in list(range(len(blob) - 1)) if blob is small else range(0, len(blob), 7):
            p = _write(tmp_path, blob[:n])
            with pytest.raises(QuantcoreError):
                qg.read_gguf(p)


def test_random_corruption_never_escapes_as_another_error(tmp_path):
    """Bytes of a valid file flipped at random: parsed, or a quantcore error, never anything else."""
    small, _, _ = _valid()
    rng = np.random.default_rng(0)
    for i in range(400):
        b = bytearray(small)
        for pos in rng.integers(0, len(b), size=int(rng.integers(1, 4))):
            b[pos] = int(rng.integers(0, 256))
        p = _write(tmp_path, bytes(b), f"c{i % 4}.gguf")
        try:
            g = qg.read_gguf(p)
            for name in g.tensors:
                g.raw(name)
        except QuantcoreError:
            pass


def test_version2_and_alignment_key(tmp_path):
    a = np.ones((1, 32), np.float32)
    raw = _file([_kv("general.alignment", 4, struct.pack("<I", 64))], [_tinfo("a", (32, 1), 0, 0)],
                a.tobytes(), version=2, align=64)
    g = qg.read_gguf(_write(tmp_path, raw))
    assert g.version == 2 and g.alignment == 64 and g.data_offset % 64 == 0
    assert np.array_equal(g.tensor("a"), a)


# -- the reader against gguf-py -------------------------------------------------------------------


def test_reader_matches_gguf_py():
    gguf = pytest.importorskip("gguf")
    g = qg.read_gguf(TINY)
    r = gguf.GGUFReader(str(TINY))
    fields = {k: f for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert list(fields) == list(g.kv)
    for key, f in fields.items():
        kv = g.kv[key]
        assert int(f.types[0]) == int(kv.type), key
        if kv.type == qg.ValueType.ARRAY:
            assert int(f.types[1]) == int(kv.item_type), key
            assert list(f.contents()) == list(kv.value), key
        else:
            assert f.contents() == kv.value, key
    assert [t.name for t in r.tensors] == list(g.tensors)
    for t in r.tensors:
        ti = g.tensors[t.name]
        assert tuple(int(d) for d in t.shape) == ti.ne and int(t.tensor_type) == ti.type.id
        assert int(t.data_offset) == g.data_offset + ti.offset and int(t.n_bytes) == ti.nbytes
        assert np.array_equal(np.asarray(t.data).view(np.uint8).reshape(-1), g.raw(t.name))
        if ti.type.name in ("F32", "F16", "BF16"):
            ref = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
            assert np.array_equal(g.dequantize(t.name), ref.reshape(ti.shape))


def test_dequantize_quantized_types_matches_gguf_py(tmp_path):
    gguf = pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as QT

    x = np.random.default_rng(3).standard_normal((4, 512)).astype(np.float32)
    tensors = [("q4", (512, 4), qg.Q4_0, ggml.quantize_q4_0(x)), ("q8", (512, 4), qg.Q8_0, ggml.quantize_q8_0(x)),
               ("q6", (512, 4), qg.Q6_K, ggml.quantize_q6_k(x))]
    p = tmp_path / "q.gguf"
    qg.write_gguf(p, [qg.KV("general.architecture", qg.ValueType.STRING, "x")], tensors)
    g = qg.read_gguf(p)
    for name, _, t, q in tensors:
        assert g.tensor(name).shape == (4, 512 // t.block_size, t.type_size)
        ref = gguf.quants.dequantize(q.reshape(4, -1), QT[t.name])
        assert np.array_equal(g.dequantize(name).view(np.uint32), ref.view(np.uint32))
    with pytest.raises(UnsupportedError, match="Q4_1"):
        qg._to_float(qg.ggml_type("Q4_1"), np.zeros(20, np.uint8), (32,))


# -- Q6_K -----------------------------------------------------------------------------------------


def test_q6_k_matches_ggml_c_reference():
    """Bytes ggml's quantize_row_q6_K_ref / dequantize_row_q6_K wrote (tools/make_golden_gguf.py):
    every magnitude, zeros, subnormals, NaN, Inf, ties."""
    g = np.load(GOLDEN / "q6k_golden.npz")
    x = g["x"]
    assert np.array_equal(ggml.quantize_q6_k(x).reshape(x.shape[0], -1), g["q"])
    deq = ggml.dequantize_q6_k(g["q"].reshape(x.shape[0], -1, ggml.Q6_K_BLOCK_BYTES))
    assert np.array_equal(deq.view(np.uint32), g["deq"].view(np.uint32))


def test_q6_k_chunking_and_shapes(monkeypatch):
    x = np.random.default_rng(1).standard_normal((3, 4, 512)).astype(np.float32)
    whole = ggml.quantize_q6_k(x)
    assert whole.shape == (3, 4, 2, 210)
    monkeypatch.setattr(ggml, "CHUNK_SUPERBLOCKS", 3)
    assert np.array_equal(ggml.quantize_q6_k(x), whole)
    out = np.empty_like(whole)
    assert ggml.quantize_q6_k(x, out=out) is out and np.array_equal(out, whole)
    assert ggml.dequantize_q6_k(whole).shape == (3, 4, 512)
    with pytest.raises(ShapeError, match="multiple of 256"):
        ggml.quantize_q6_k(np.zeros((2, 128), np.float32))
    with pytest.raises(ShapeError):
        ggml.dequantize_q6_k(np.zeros((2, 209), np.uint8))


def test_nearest_int_is_ggml_bit_trick():
    v = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 3.49, -7.5, 4194303.0], np.float32)
    assert ggml.nearest_int(v).tolist() == [0, 2, 2, 0, -2, 3, -8, 4194303]
    # out of range: the same low 23 bits the C code keeps
    assert ggml.nearest_int(np.array([np.nan], np.float32)).tolist() == [0]


# -- llama-quantize's rules -----------------------------------------------------------------------


def _ti(name, ne, t=qg.F16):
    n = int(np.prod(ne))
    return qg.TensorInfo(name, tuple(ne), t, 0, n // t.block_size * t.type_size)


def _m(arch="llama", n_expert=0, n_layer=2, tied=False):
    return qg._Model(arch, n_expert, n_layer, tied)


@pytest.mark.parametrize("name, ne, fmt, pure, model, expect", [
    ("output.weight", (256, 10), "q4_0", False, _m(), "Q6_K"),
    ("output.weight", (256, 10), "q8_0", False, _m(), "Q8_0"),
    ("output.weight", (256, 10), "q4_0", True, _m(), "Q4_0"),
    ("output.weight", (288, 10), "q4_0", False, _m(), "Q8_0"),  # Q6_K does not fit 288: fallback Q8_0
    ("output.weight", (80, 10), "q4_0", False, _m(), "F16"),  # neither Q6_K nor Q8_0 fit
    ("output.weight", (256, 10), "q4_0", False, _m("falcon"), "Q8_0"),
    ("token_embd.weight", (256, 10), "q4_0", False, _m(tied=True), "Q6_K"),
    ("token_embd.weight", (256, 10), "q4_0", False, _m(), "Q4_0"),
    ("token_embd.weight", (256, 10), "q4_0", True, _m(tied=True), "Q4_0"),
    ("blk.0.attn_v.weight", (256, 10), "q4_0", False, _m(n_expert=8), "Q8_0"),
    ("blk.0.attn_k.weight", (256, 10), "q4_0", False, _m(n_expert=8), "Q8_0"),
    ("blk.0.attn_q.weight", (256, 10), "q4_0", False, _m(n_expert=8), "Q4_0"),
    ("blk.0.attn_v.weight", (256, 10), "q4_0", True, _m(n_expert=8), "Q4_0"),
    ("blk.0.ffn_down.weight", (112, 10), "q4_0", False, _m(), "F16"),
    ("blk.0.ffn_down.weight", (112, 10), "q8_0", True, _m(), "F16"),
    ("blk.0.attn_norm.weight", (256,), "q4_0", False, _m(), "F16"),
    ("blk.0.attn_q.weight", (256, 1), "q4_0", False, _m(), "F16"),  # ggml_n_dims 1
    ("blk.0.ffn_gate_inp.weight", (256, 8), "q4_0", False, _m(), "F16"),
    ("blk.0.attn_q.bias", (256, 8), "q4_0", False, _m(), "F16"),
    ("position_embd.weight", (256, 8), "q4_0", False, _m(), "F16"),
    ("abcde", (256, 8), "q4_0", False, _m(), "Q4_0"),  # llama.cpp's rfind check passes 5-byte names
    ("abcdef", (256, 8), "q4_0", False, _m(), "F16"),
    ("blk.0.ffn_up_exps.weight", (256, 8, 4), "q4_0", False, _m(n_expert=4), "Q4_0"),
])
def test_target_types(name, ne, fmt, pure, model, expect):
    default = qg.Q4_0 if fmt == "q4_0" else qg.Q8_0
    t, reason = qg._target_type(_ti(name, ne), default, pure, model)
    assert t.name == expect, reason


def test_moe_layer_checks_like_llama_quantize():
    with pytest.raises(ParameterError, match="cannot determine the layer"):
        qg._target_type(_ti("ffn_down_exps.weight", (256, 8, 4)), qg.Q4_0, False, _m(n_expert=4))
    with pytest.raises(ParameterError, match="bad layer 5"):
        qg._target_type(_ti("blk.5.ffn_down_exps.weight", (256, 8, 4)), qg.Q4_0, False, _m(n_expert=4))


def test_tensor_order_is_llama_cpp_weights_map():
    names = ["blk.10.a", "output.weight", "blk.2.b", "blk.2.a", "token_embd.weight", "blk.0.z", "blk.x.y",
             "Zeta", "blk.-1.q", "blk. 3.q"]
    assert qg.tensor_order(names) == ["Zeta", "blk.-1.q", "blk.x.y", "output.weight", "token_embd.weight",
                                      "blk.0.z", "blk.2.a", "blk.2.b", "blk. 3.q", "blk.10.a"]
