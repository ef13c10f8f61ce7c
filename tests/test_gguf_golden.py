"""requantize_gguf against what llama.cpp's llama-quantize wrote (tests/golden/gguf_golden.json,
made by tools/make_golden_gguf.py with llama-cpp-python). The fast tests need no llama.cpp; the slow
one runs llama.cpp itself when llama_cpp is importable."""

from __future__ import annotations

import ctypes
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from quantcore.errors import ParameterError, UnsupportedError
from quantcore.io import gguf as qg

GOLDEN = Path(__file__).parent / "golden"
TINY = GOLDEN / "tiny_llama.gguf"
META = json.loads((GOLDEN / "gguf_golden.json").read_text())
CASES = META["outputs"]  # key -> fmt, pure, allow_requantize, sha256, size, types


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def derive_tied(src, dst) -> None:
    """``src`` without output.weight (token_embd.weight is then the output). Shared with
    tools/make_golden_gguf.py, which recorded the sha256 of the result."""
    g = qg.read_gguf(src)
    qg.write_gguf(dst, list(g.kv.values()),
                  [(n, ti.ne, ti.type, g.raw(n)) for n, ti in g.tensors.items() if n != "output.weight"])


def derive_edge(src, dst) -> None:
    """``src`` plus tensors at the edges of llama-quantize's rules (llama.cpp quantizes this file
    but cannot run it: the extra tensors are not the model's) and an old quantization_version key
    in the middle of the metadata."""
    g = qg.read_gguf(src)
    rng = np.random.default_rng(7)

    def r(*shape, dtype=np.float32):
        return (rng.standard_normal(shape) * 0.1).astype(dtype)

    kvs = list(g.kv.values())
    kvs.insert(2, qg.KV("general.quantization_version", qg.ValueType.UINT32, 1))
    extra = [
        ("abcde", (256, 8), qg.F16, r(8, 256, dtype=np.float16)),  # 5-byte name: quantized
        ("blk.0.x.weight", (40, 8), qg.F32, r(8, 40)),  # rows of 40: F32 -> F16 fallback
        ("blk.0.zz_norm.weight", (256, 4), qg.F32, r(4, 256)),  # 2-D norm: kept
        ("blk.1.ffn_gate_inp.weight", (256, 4), qg.F32, r(4, 256)),  # expert router: kept
        ("blk.10.y.weight", (288, 4), qg.F16, r(4, 288, dtype=np.float16)),  # after blk.1, Q4_0
        ("blk.0.w.weight", (256, 1), qg.F16, r(1, 256, dtype=np.float16)),  # ggml_n_dims 1: kept, 1-D
        ("blk.0.e3.weight", (256, 4, 2), qg.F32, r(2, 4, 256)),  # 3-D: quantized
        ("blk.0.attn_q.bias", (256, 2), qg.F32, r(2, 256)),  # not a weight: kept
    ]
    tensors = [(n, ti.ne, ti.type, g.raw(n)) for n, ti in g.tensors.items()]
    qg.write_gguf(dst, kvs, tensors[:3] + extra + tensors[3:])


def _input(key: str, tmp_path: Path) -> Path:
    if key.startswith("tied_"):
        derive_tied(TINY, tmp_path / "tied.gguf")
        assert _sha(tmp_path / "tied.gguf") == META["tied_input"]["sha256"]
        return tmp_path / "tied.gguf"
    if key.startswith("edge_"):
        derive_edge(TINY, tmp_path / "edge.gguf")
        assert _sha(tmp_path / "edge.gguf") == META["edge_input"]["sha256"]
        return tmp_path / "edge.gguf"
    if key.startswith("from_"):  # llama.cpp's own Q8_0 / Q4_0 output, remade (and checked) by quantcore
        fmt = key.split("_")[1] + "_" + key.split("_")[2]
        prev = tmp_path / f"{fmt}.gguf"
        qg.requantize_gguf(TINY, prev, fmt, progress=False)
        assert _sha(prev) == META["outputs"][fmt]["sha256"]
        return prev
    return TINY


def test_input_is_the_file_llama_cpp_quantized():
    assert _sha(TINY) == META["input"]["sha256"]


@pytest.mark.parametrize("key", sorted(CASES))
def test_requantize_is_byte_equal_to_llama_quantize(tmp_path, key):
    case = CASES[key]
    src = _input(key, tmp_path)
    out = tmp_path / "out.gguf"
    summary = qg.requantize_gguf(src, out, case["fmt"], pure=case["pure"], progress=False,
                                 allow_requantize=case["allow_requantize"])
    assert {t["name"]: t["to"] for t in summary["tensors"]} == META["outputs"][key]["types"]
    assert out.stat().st_size == META["outputs"][key]["size"] == summary["bytes_out"]
    assert _sha(out) == META["outputs"][key]["sha256"]


def test_requantized_file_reads_back(tmp_path):
    out = tmp_path / "q4.gguf"
    summary = qg.requantize_gguf(TINY, out, "q4_0", progress=False)
    g, src = qg.read_gguf(out), qg.read_gguf(TINY)
    kv = list(g.kv)
    assert kv[-2:] == ["general.quantization_version", "general.file_type"]
    assert g.metadata["general.file_type"] == 2 and g.metadata["general.quantization_version"] == 2
    assert [k for k in src.kv if k != "general.file_type"] == kv[:-2]
    assert list(g.tensors) == qg.tensor_order(src.tensors)
    assert g.tensors["output.weight"].type.name == "Q6_K"
    assert [(d["name"], d["type"]) for d in summary["higher_precision"]] == [("output.weight", "Q6_K")]
    # norms stay F32; ffn_down's rows of 112 are no whole Q4_0 blocks: F16 (blk.1's from BF16)
    unq = {d["name"]: d["type"] for d in summary["unquantized"]}
    assert unq == {n: ("F32" if "norm" in n else "F16") for n in g.tensors if "norm" in n or "ffn_down" in n}
    for name, ti in g.tensors.items():
        x, y = src.dequantize(name), g.dequantize(name)
        assert y.shape == x.shape
        err = np.abs(x - y).max() / max(1e-30, np.abs(x).max())
        assert err < (0.1 if ti.type.quantized else 1e-3), (name, ti.type.name, err)


def test_requantize_refusals(tmp_path):
    q8 = tmp_path / "q8.gguf"
    qg.requantize_gguf(TINY, q8, "q8_0", progress=False)
    with pytest.raises(ParameterError, match="allow_requantize"):
        qg.requantize_gguf(q8, tmp_path / "x.gguf", "q4_0", progress=False)
    with pytest.raises(ParameterError, match="is the input file"):
        qg.requantize_gguf(q8, q8, "q4_0", progress=False)
    assert _sha(q8) == META["outputs"]["q8_0"]["sha256"]
    with pytest.raises(ParameterError, match="q4_0 and q8_0"):
        qg.requantize_gguf(TINY, tmp_path / "x.gguf", "nf4", progress=False)
    # same type: Q8_0 tensors are copied, no requantization needed
    qg.requantize_gguf(q8, tmp_path / "same.gguf", "q8_0", progress=False)
    assert _sha(tmp_path / "same.gguf") == _sha(q8)
    # NaN in a tensor: llama-quantize refuses the data ("tensor has invalid data")
    g = qg.read_gguf(TINY)
    bad = tmp_path / "nan.gguf"
    tensors = []
    for n, ti in g.tensors.items():
        data = np.array(g.raw(n))
        if n == "blk.0.attn_q.weight":
            data.view(np.float16)[5] = np.float16(np.nan)
        tensors.append((n, ti.ne, ti.type, data))
    qg.write_gguf(bad, list(g.kv.values()), tensors)
    with pytest.raises(ParameterError, match="NaN or Inf"):
        qg.requantize_gguf(bad, tmp_path / "x.gguf", "q4_0", progress=False)
    odd = tmp_path / "align64.gguf"
    kvs = list(g.kv.values()) + [qg.KV("general.alignment", qg.ValueType.UINT32, 64)]
    qg.write_gguf(odd, kvs, [(n, ti.ne, ti.type, g.raw(n)) for n, ti in g.tensors.items()], alignment=64)
    assert qg.read_gguf(odd).alignment == 64
    with pytest.raises(UnsupportedError, match="alignment"):
        qg.requantize_gguf(odd, tmp_path / "x.gguf", "q4_0", progress=False)


def test_progress_without_tqdm(tmp_path, monkeypatch, capsys):
    import builtins

    real = builtins.__import__

    def no_tqdm(name, *a, **k):
        if name == "tqdm":
            raise ImportError("no tqdm")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    qg.requantize_gguf(TINY, tmp_path / "p.gguf", "q8_0", progress=True)
    err = capsys.readouterr().err.splitlines()
    n = len(qg.read_gguf(TINY).tensors)
    assert 1 <= len(err) <= n and err[-1].endswith("blk.1.ffn_up.weight")  # at most one line per tensor
    assert "100.0%" in err[-1] and f"{n}/{n} tensors" in err[-1]


def test_streams_in_slabs(tmp_path, monkeypatch):
    """Slabs of a few rows give the same bytes (the memory bound does not change the result), and
    the explicit cpu backend too."""
    monkeypatch.setattr(qg, "SLAB_BYTES", 3 * 256 * 4)
    out = tmp_path / "slab.gguf"
    qg.requantize_gguf(TINY, out, "q4_0", progress=False, backend="cpu")
    assert _sha(out) == META["outputs"]["q4_0"]["sha256"]


@pytest.mark.slow
def test_llama_cpp_runs_quantcore_output(tmp_path):
    """llama.cpp (llama-cpp-python) quantizes the input itself, loads both outputs and gives equal logits."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (see docs/gguf.md)")
    for fmt, ftype, pure in (("q4_0", 2, False), ("q8_0", 7, True)):
        ref, out = tmp_path / f"{fmt}.llama.gguf", tmp_path / f"{fmt}.qc.gguf"
        p = llama_cpp.llama_model_quantize_default_params()
        p.ftype, p.pure, p.nthread = ftype, pure, 2
        assert llama_cpp.llama_model_quantize(str(TINY).encode(), str(ref).encode(), ctypes.byref(p)) == 0
        qg.requantize_gguf(TINY, out, fmt, pure=pure, progress=False)
        assert ref.read_bytes() == out.read_bytes()
        logits = []
        for path in (ref, out):
            llm = llama_cpp.Llama(model_path=str(path), n_ctx=32, n_threads=2, logits_all=True, verbose=False)
            llm.eval([1, 262, 263, 264])
            logits.append(np.array(llm.scores[:4], dtype=np.float32))
            del llm
        assert np.isfinite(logits[0]).all() and np.array_equal(logits[0], logits[1])


def test_cli_requantizes_a_gguf_like_llama_quantize(tmp_path):
    """`quantcore quantize IN.gguf -o OUT.gguf --format q4_0|q8_0 [--pure]`: the command line gives
    llama.cpp's bytes (the CLI's atomic output around quantcore.io.gguf.requantize_gguf), and leaves
    no temporary file."""
    from quantcore.cli import main

    golden = json.loads((GOLDEN / "gguf_golden.json").read_text())
    src = GOLDEN / golden["input"]["file"]
    written = []
    for key in ("q4_0", "q8_0_pure"):
        case = golden["outputs"][key]
        out = tmp_path / f"{key}.gguf"
        argv = ["quantize", str(src), "-o", str(out), "--format", case["fmt"], "-q"] + (["--pure"] if case["pure"] else [])
        assert main(argv) == 0
        assert hashlib.sha256(out.read_bytes()).hexdigest() == case["sha256"], key
        written.append(out.name)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(written)
    assert main(["quantize", str(src), "-o", str(tmp_path / "q4_0.gguf"), "--format", "q4_0", "-q"]) == 2  # exists
