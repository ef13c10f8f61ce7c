"""Make the GGUF golden files with llama.cpp itself (through llama-cpp-python's bindings).

    python -m venv /tmp/venv_llama
    /tmp/venv_llama/bin/pip install llama-cpp-python==0.3.36 numpy gguf ml_dtypes pytest   # builds llama.cpp
    PYTHONPATH=. /tmp/venv_llama/bin/python tools/make_golden_gguf.py tests/golden

Writes into the given folder:

- ``tiny_llama.gguf``: a 2-layer llama (n_embd 256, 2 heads of 64, 1 KV head, n_ff 112, a
  286-token SPM vocabulary llama.cpp loads) written with gguf-py's GGUFWriter: F16 / BF16 / F32
  weights, F32 norms, extra metadata of every value type, tensors stored out of llama.cpp's order,
  edge rows (zeros, tiny, constant, large) in output.weight;
- ``gguf_golden.json``: sha256, size and tensor types of what llama.cpp's ``llama_model_quantize``
  (the code of ``llama-quantize``) writes for Q4_0 and Q8_0, with and without ``pure``, for that
  input, its tied variant (no output.weight) and its edge variant (tensors at the edges of the
  type rules), both derived by ``tests/test_gguf_golden.py`` (their sha256 recorded too), and for
  llama.cpp's own Q8_0 output requantized to Q4_0 and its Q4_0 output to Q8_0
  (``allow_requantize``); with the versions used;
- ``q6k_golden.npz``: fp32 inputs (random, every magnitude, zeros, subnormals, NaN, Inf) and the
  bytes of ggml's ``quantize_row_q6_K_ref`` and ``dequantize_row_q6_K`` for them, called through
  ctypes in llama.cpp's libggml-base.

It then checks quantcore against all of it (byte for byte) and runs the outputs of both with
``llama_cpp.Llama`` (logits of a few tokens), printing a report.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys
import tempfile

import numpy as np

N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM, N_FF, N_LAYER, N_CTX = 256, 2, 1, 64, 112, 2, 128
CASES = [("q4_0", False), ("q4_0", True), ("q8_0", False), ("q8_0", True)]
FTYPE = {"q4_0": 2, "q8_0": 7}


def vocab() -> tuple[list[str], list[float], list[int]]:
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    words = ["\u2581"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    toks += words
    types += [1] * len(words)
    scores = [0.0] * 259 + [-float(i + 1) for i in range(len(words))]
    return toks, scores, types


def weights(seed: int = 21) -> dict[str, tuple[np.ndarray, str]]:
    """name -> (numpy array [rows, cols] fp32 values, storage type)."""
    rng = np.random.default_rng(seed)
    n_vocab = len(vocab()[0])

    def w(rows, cols, scale=0.05):
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    out = w(n_vocab, N_EMBD)
    out[0] = 0.0  # an all-zero row: Q6_K's zero super-block
    out[1] *= 1e-6  # tiny: sub-block scales near fp16's subnormals
    out[2] = 0.125  # constant row
    out[3, :16] = 0.0  # one all-zero Q6_K sub-block in an otherwise normal super-block
    out[4] *= 400.0  # large values (still finite in F16 / BF16)
    t: dict[str, tuple[np.ndarray, str]] = {}
    # stored out of llama.cpp's order on purpose: blk.1 first, token_embd last
    for i in (1, 0):
        kind = "F16" if i == 0 else "BF16"
        t[f"blk.{i}.ffn_down.weight"] = (w(N_EMBD, N_FF), kind)  # ne[0] = 112: F16 fallback
        t[f"blk.{i}.attn_q.weight"] = (w(N_HEAD * HEAD_DIM, N_EMBD), kind)
        t[f"blk.{i}.attn_k.weight"] = (w(N_HEAD_KV * HEAD_DIM, N_EMBD), "F32" if i == 1 else kind)
        t[f"blk.{i}.attn_v.weight"] = (w(N_HEAD_KV * HEAD_DIM, N_EMBD), kind)
        t[f"blk.{i}.attn_output.weight"] = (w(N_EMBD, N_HEAD * HEAD_DIM), kind)
        t[f"blk.{i}.ffn_gate.weight"] = (w(N_FF, N_EMBD), kind)
        t[f"blk.{i}.ffn_up.weight"] = (w(N_FF, N_EMBD), kind)
        t[f"blk.{i}.attn_norm.weight"] = ((1.0 + 0.1 * rng.standard_normal(N_EMBD)).astype(np.float32), "F32")
        t[f"blk.{i}.ffn_norm.weight"] = ((1.0 + 0.1 * rng.standard_normal(N_EMBD)).astype(np.float32), "F32")
    t["output.weight"] = (out, "BF16")
    t["output_norm.weight"] = (np.ones(N_EMBD, np.float32), "F32")
    t["token_embd.weight"] = (w(n_vocab, N_EMBD, 0.5), "F16")
    return t


def make_input(path: str) -> None:
    import gguf
    from gguf import GGMLQuantizationType as QT
    from gguf import GGUFValueType as VT

    toks, scores, types = vocab()
    wr = gguf.GGUFWriter(path, "llama")
    wr.add_name("quantcore tiny llama")
    wr.add_file_type(1)  # MOSTLY_F16: llama-quantize replaces it and moves it to the end
    wr.add_context_length(N_CTX)
    wr.add_embedding_length(N_EMBD)
    wr.add_block_count(N_LAYER)
    wr.add_feed_forward_length(N_FF)
    wr.add_head_count(N_HEAD)
    wr.add_head_count_kv(N_HEAD_KV)
    wr.add_key_length(HEAD_DIM)
    wr.add_value_length(HEAD_DIM)
    wr.add_rope_dimension_count(HEAD_DIM)
    wr.add_rope_freq_base(10000.0)
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_vocab_size(len(toks))
    wr.add_tokenizer_model("llama")
    wr.add_tokenizer_pre("default")
    wr.add_token_list(toks)
    wr.add_token_scores(scores)
    wr.add_token_types(types)
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(2)
    wr.add_unk_token_id(0)
    wr.add_add_bos_token(True)
    # one key of every other value type (llama.cpp copies unknown keys unchanged)
    for key, val, vt in [("test.u8", 200, VT.UINT8), ("test.i8", -100, VT.INT8), ("test.u16", 60000, VT.UINT16),
                         ("test.i16", -30000, VT.INT16), ("test.i32", -5, VT.INT32), ("test.u64", 2**40 + 3, VT.UINT64),
                         ("test.i64", -(2**40), VT.INT64), ("test.f64", 1.0 / 3.0, VT.FLOAT64),
                         ("test.bool", False, VT.BOOL), ("test.str_utf8", "\u00e9t\u00e9 \u2581\U0001f600", VT.STRING)]:
        wr.add_key_value(key, val, vt)
    wr.add_array("test.bools", [True, False, True])
    wr.add_array("test.empty_strings", [])
    for name, (a, kind) in weights().items():
        if kind == "F32":
            wr.add_tensor(name, a)
        elif kind == "F16":
            wr.add_tensor(name, a.astype(np.float16))
        else:  # BF16: round to nearest even from fp32
            u = a.view(np.uint32).astype(np.uint64)
            b = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
            wr.add_tensor(name, b, raw_shape=a.shape, raw_dtype=QT.BF16)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def llama_quantize(src: str, dst: str, fmt: str, pure: bool, allow_requantize: bool = False) -> None:
    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = FTYPE[fmt]
    p.pure = pure
    p.allow_requantize = allow_requantize
    p.nthread = 2
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src}, {fmt}, pure={pure}) returned {rc}")


def first_difference(a: str, b: str) -> str:
    from quantcore.io import gguf as qg

    x, y = open(a, "rb").read(), open(b, "rb").read()
    n = next((i for i in range(min(len(x), len(y))) if x[i] != y[i]), min(len(x), len(y)))
    g = qg.read_gguf(a)
    where = "header/metadata"
    for name, ti in g.tensors.items():
        s = g.data_offset + ti.offset
        if s <= n < s + ti.nbytes:
            where = f"tensor {name} ({ti.type.name}) byte {n - s}"
    return f"sizes {len(x)} / {len(y)}, first difference at byte {n}: {where}"


def ggml_base() -> ctypes.CDLL:
    import llama_cpp

    libdir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    for name in sorted(os.listdir(libdir)):
        if name.startswith("libggml-base"):
            lib = ctypes.CDLL(os.path.join(libdir, name))
            lib.quantize_row_q6_K_ref.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
            lib.dequantize_row_q6_K.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
            return lib
    raise FileNotFoundError(f"no libggml-base in {libdir}")


def c_q6_k(lib, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = np.ascontiguousarray(x, dtype=np.float32)
    q = np.zeros(x.size // 256 * 210, np.uint8)
    lib.quantize_row_q6_K_ref(x.ctypes.data, q.ctypes.data, x.size)
    d = np.zeros(x.size, np.float32)
    lib.dequantize_row_q6_K(q.ctypes.data, d.ctypes.data, x.size)
    return q, d


def q6k_inputs(seed: int, rows: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 512)).astype(np.float32)
    x *= np.exp2(rng.uniform(-140, 120, (rows, 1))).astype(np.float32)  # every magnitude, subnormal to huge
    x[0] = 0.0
    x[1, :16] = 0.0
    x[2] = rng.uniform(-1, 1, 512).astype(np.float32) * np.float32(1e-45)  # subnormal min
    x[3, 5] = np.nan
    x[4, 300] = np.inf
    x[5, 7] = -np.inf
    x[6] = np.float32(3e38) * np.sign(rng.standard_normal(512)).astype(np.float32)
    x[7] = 1.0  # constant
    x[8, ::16] = 5.0  # one spike per sub-block
    x[9] = np.float32(1e-15) * rng.standard_normal(512).astype(np.float32)  # near GROUP_MAX_EPS
    x[10] = np.round(rng.standard_normal(512) * 4).astype(np.float32)  # ties in the rounding
    return x


def main(outdir: str) -> int:
    import gguf
    import llama_cpp

    from quantcore.formats import ggml
    from quantcore.io import gguf as qg

    ok = True
    # -- Q6_K against ggml's C reference
    lib = ggml_base()
    x = q6k_inputs(6, 48)
    cq, cd = c_q6_k(lib, x)
    np.savez_compressed(os.path.join(outdir, "q6k_golden.npz"), x=x, q=cq.reshape(48, -1), deq=cd.reshape(48, -1))
    mine = ggml.quantize_q6_k(x).reshape(-1)
    same = np.array_equal(mine, cq)
    print(f"Q6_K vs ggml quantize_row_q6_K_ref, golden set {x.size} values: {'equal' if same else 'DIFFERENT'}")
    ok &= same
    for seed in range(1, 9):
        big = q6k_inputs(100 + seed, 512)
        cq2, cd2 = c_q6_k(lib, big)
        m2 = ggml.quantize_q6_k(big).reshape(-1)
        d2 = ggml.dequantize_q6_k(cq2.reshape(-1, 210))
        eq = np.array_equal(m2, cq2) and np.array_equal(d2.view(np.uint32), cd2.view(np.uint32))
        ok &= eq
        print(f"  seed {100 + seed}: {big.size} values: quantize+dequantize {'equal' if eq else 'DIFFERENT'}")

    # -- requantization
    src = os.path.join(outdir, "tiny_llama.gguf")
    make_input(src)
    meta = {"llama_cpp_python": llama_cpp.__version__, "input": {"file": "tiny_llama.gguf", "sha256": sha256(src),
            "size": os.path.getsize(src)}, "outputs": {}}
    from importlib.metadata import version

    meta["gguf_py"] = version("gguf")
    libdir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    meta["ggml_libs"] = sorted(n for n in os.listdir(libdir) if n.startswith(("libggml-base.so.", "libllama.so.")))
    with tempfile.TemporaryDirectory() as tmp:
        from tests.test_gguf_golden import derive_edge, derive_tied

        tied = os.path.join(tmp, "tiny_llama_tied.gguf")
        derive_tied(src, tied)
        meta["tied_input"] = {"sha256": sha256(tied), "size": os.path.getsize(tied)}
        edge = os.path.join(tmp, "tiny_llama_edge.gguf")
        derive_edge(src, edge)
        meta["edge_input"] = {"sha256": sha256(edge), "size": os.path.getsize(edge)}
        # the last cases requantize llama.cpp's own Q8_0 output to Q4_0 and its Q4_0 output (with
        # its Q6_K output tensor) to Q8_0 (--allow-requantize)
        runs = [(label, inp, fmt, pure) for label, inp in (("", src), ("tied_", tied), ("edge_", edge))
                for fmt, pure in CASES]
        runs.append(("from_q8_0_", os.path.join(tmp, "q8_0.llama.gguf"), "q4_0", False))
        runs.append(("from_q4_0_", os.path.join(tmp, "q4_0.llama.gguf"), "q8_0", False))
        for label, inp, fmt, pure in runs:
            key = f"{label}{fmt}{'_pure' if pure else ''}"
            ref = os.path.join(tmp, f"{key}.llama.gguf")
            out = os.path.join(tmp, f"{key}.quantcore.gguf")
            requant = label.startswith("from_")
            llama_quantize(inp, ref, fmt, pure, allow_requantize=requant)
            qg.requantize_gguf(inp, out, fmt, pure=pure, progress=False, allow_requantize=requant)
            meta["outputs"][key] = {"fmt": fmt, "pure": pure, "allow_requantize": requant,
                                    "sha256": sha256(ref), "size": os.path.getsize(ref),
                                    # read from llama.cpp's file with gguf-py's reader
                                    "types": {t.name: t.tensor_type.name for t in gguf.GGUFReader(ref).tensors}}
            eq = sha256(ref) == sha256(out)
            ok &= eq
            print(f"{key:16s} llama.cpp {os.path.getsize(ref):8d} B  quantcore "
                  f"{'byte-equal' if eq else 'DIFFERENT: ' + first_difference(ref, out)}")
            if not eq or label == "edge_":  # the edge file is not a model llama.cpp can run
                continue
            logits = []
            for path in (ref, out, inp):
                llm = llama_cpp.Llama(model_path=path, n_ctx=32, n_threads=2, logits_all=True, verbose=False)
                llm.eval([1, 262, 263, 264, 265])
                logits.append(np.array(llm.scores[:5], dtype=np.float32))
                del llm
            same_logits = np.array_equal(logits[0], logits[1])
            ok &= same_logits
            print(f"{'':16s} llama_cpp.Llama logits (5 tokens x {logits[0].shape[1]}): "
                  f"{'equal' if same_logits else 'DIFFERENT'}; vs the input's: max |diff| / max |logit| = "
                  f"{float(np.abs(logits[0] - logits[2]).max() / np.abs(logits[2]).max()):.3g}")
    with open(os.path.join(outdir, "gguf_golden.json"), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
        f.write("\n")
    print("all equal" if ok else "SOME DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "tests/golden"))
