"""``quantcore quantize`` on transformers model folders: what transformers + bitsandbytes,
compressed-tensors' schema and transformers' gpt-oss MXFP4 path read, checked on CPU with tiny
random models made here (no hub access).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

torch = pytest.importorskip("torch", reason="torch is not installed: model folders are read with transformers")
transformers = pytest.importorskip("transformers", reason="transformers is not installed: it decides the layers")

from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

from quantcore import CheckpointError, UnsupportedError  # noqa: E402
from quantcore.cli import main  # noqa: E402
from quantcore.convert import bnb_quantization_config, quantize_checkpoint, read_quantized  # noqa: E402
from quantcore.formats import bnb as bnb_fmt  # noqa: E402

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _tiny_llama(path, *, tie=False, dtype=torch.float32, seed=0, hidden=64):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=tie)
    model = LlamaForCausalLM(cfg).to(dtype)
    model.save_pretrained(path)
    (path / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    (path / "extra").mkdir()
    (path / "extra" / "notes.txt").write_text("copied")
    return model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    _tiny_llama(path)
    return path


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def bnb():
    return pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed: the reference is its output")


def _cuda_double_quant(monkeypatch, bnb):
    """bitsandbytes' quantize_4bit with its CPU 4-bit step (codes and fp32 absmax) and the double
    quantization of the absmax done by bitsandbytes' CUDA rules, as quantcore's reference computes
    them (checked against bitsandbytes' CUDA output in tests/test_golden_bnb.py): bitsandbytes' CPU
    path takes the offset as a float32 torch mean (a few ulps away) and rounds a value within ~1e-6
    of the middle between two dynamic-map codes the other way (see
    test_plain_bitsandbytes_cpu_differs_only_in_the_double_quantization)."""
    F = bnb.functional
    orig = F.quantize_4bit

    def quantize_4bit(A, absmax=None, out=None, blocksize=64, compress_statistics=False, quant_type="fp4",
                      quant_storage=torch.uint8):
        packed, st = orig(A, blocksize=blocksize, compress_statistics=False, quant_type=quant_type,
                          quant_storage=quant_storage)
        if not compress_statistics:
            return packed, st
        q, a2, offset = bnb_fmt.double_quantize(st.absmax.numpy())
        state2 = F.QuantState(absmax=torch.from_numpy(a2), code=F.create_dynamic_map().to(torch.float32),
                              blocksize=bnb_fmt.NESTED_BLOCKSIZE, dtype=torch.float32)
        return packed, F.QuantState(absmax=torch.from_numpy(q), shape=st.shape, dtype=st.dtype, blocksize=blocksize,
                                    code=st.code, quant_type=quant_type, offset=torch.tensor(float(offset)),
                                    state2=state2)

    monkeypatch.setattr(F, "quantize_4bit", quantize_4bit)


def _same_fp4(x, y):
    """Equal 4-bit codes, except that bitsandbytes' CPU path gives a value that rounds to zero the
    other zero code (0 / 8: +0 / -0, both decode to 0) than its CUDA path and quantcore do."""
    nib = lambda t: torch.stack([t >> 4, t & 15], -1).reshape(-1)  # noqa: E731
    x, y = nib(x), nib(y)
    zero = lambda t: (t == 0) | (t == 8)  # noqa: E731
    return bool(((x == y) | (zero(x) & zero(y))).all())


def _bnb_reference(src, out, fmt, **kw):
    from transformers import BitsAndBytesConfig

    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=fmt, bnb_4bit_use_double_quant=True, **kw)
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=cfg, device_map="cpu")
    model.save_pretrained(out)
    return model


def _loaded(path):
    model = AutoModelForCausalLM.from_pretrained(path, device_map="cpu")
    for m in model.modules():  # bitsandbytes' plain dequantize + matmul path, on every CPU
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    return model


@pytest.mark.parametrize("fmt", ["nf4", "fp4"])
def test_folder_equals_transformers_bitsandbytes_bit_for_bit(bnb, llama_dir, ids, tmp_path, monkeypatch, fmt):
    ours = tmp_path / "ours"
    assert main(["quantize", str(llama_dir), "-o", str(ours), "--format", fmt, "-q"]) == 0
    with monkeypatch.context() as mp:
        _cuda_double_quant(mp, bnb)
        _bnb_reference(llama_dir, tmp_path / "theirs", fmt)
    theirs = tmp_path / "theirs"
    # the same config.json, quantization_config included, and the same tensors, byte for byte
    assert json.loads((ours / "config.json").read_text()) == json.loads((theirs / "config.json").read_text())
    a, b = load_file(ours / "model.safetensors"), load_file(theirs / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        if k.endswith(f"bitsandbytes__{fmt}"):
            assert json.loads(bytes(a[k].tolist())) == json.loads(bytes(b[k].tolist())), k
        elif fmt == "fp4" and k.endswith(".weight") and a[k].dtype == torch.uint8:
            assert _same_fp4(a[k], b[k]), k
        else:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert (ours / "tokenizer_config.json").read_text() == '{"model_max_length": 64}'
    assert (ours / "extra" / "notes.txt").read_text() == "copied"
    # loaded by transformers + bitsandbytes: the same modules and the same logits, bit for bit
    m_ours, m_theirs = _loaded(ours), _loaded(theirs)
    kinds = lambda m: {n: type(x).__name__ for n, x in m.named_modules()}  # noqa: E731
    assert kinds(m_ours) == kinds(m_theirs)
    assert type(m_ours.lm_head) is torch.nn.Linear
    assert type(m_ours.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    assert torch.equal(_logits(m_ours, ids), _logits(m_theirs, ids))


def test_plain_bitsandbytes_cpu_differs_only_in_the_double_quantization(bnb, llama_dir, ids, tmp_path):
    # unpatched, bitsandbytes' CPU path gives the same 4-bit codes; its double quantization's offset
    # is a few float32 ulps away and a few absmax codes are one step away (near-ties)
    quantize_checkpoint(llama_dir, tmp_path / "ours", "nf4", progress=False)
    _bnb_reference(llama_dir, tmp_path / "theirs", "nf4")
    a, b = load_file(tmp_path / "ours" / "model.safetensors"), load_file(tmp_path / "theirs" / "model.safetensors")
    n_codes = n_diff = 0
    for k in a:
        if k.endswith("bitsandbytes__nf4"):
            x, y = (json.loads(bytes(t[k].tolist()))["nested_offset"] for t in (a, b))
            assert abs(x - y) <= 8 * np.spacing(np.float32(y)), k
        elif k.endswith(".absmax"):
            d = (a[k].int() - b[k].int()).abs()
            assert int(d.max()) <= 1, k
            n_codes, n_diff = n_codes + d.numel(), n_diff + int((d > 0).sum())
        elif k.endswith(".weight") and a[k].dtype == torch.uint8:
            assert torch.equal(a[k], b[k]), k
    assert n_diff <= n_codes // 50
    torch.testing.assert_close(_logits(_loaded(tmp_path / "ours"), ids), _logits(_loaded(tmp_path / "theirs"), ids),
                               rtol=1e-4, atol=1e-4)


def test_quantcore_nn_loads_the_folder(llama_dir, ids, tmp_path):
    import quantcore.hf as qh
    import quantcore.nn as qnn

    out = tmp_path / "q"
    quantize_checkpoint(llama_dir, out, "nf4", progress=False)
    model = qh.from_bnb_pretrained(out)
    layers = {n: m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in LINEAR}
    assert len(layers) == 14 and all(isinstance(m, qnn.Linear4bit) for m in layers.values())
    assert type(model.lm_head) is torch.nn.Linear
    deq = read_quantized(str(out))
    for n, m in layers.items():
        assert np.array_equal(m.dequantize().numpy(), deq[f"{n}.weight"]), n
    ref = AutoModelForCausalLM.from_pretrained(llama_dir)
    with torch.no_grad():
        for n in layers:
            ref.get_submodule(n).weight.copy_(torch.from_numpy(deq[f"{n}.weight"]))
    torch.testing.assert_close(_logits(model, ids), _logits(ref, ids), rtol=1e-5, atol=1e-5)


def test_config_is_what_transformers_writes():
    from transformers import BitsAndBytesConfig

    for fmt in bnb_fmt.QUANT_TYPES:
        for skip in (None, ["lm_head", "mlp"]):
            want = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=fmt, bnb_4bit_use_double_quant=True,
                                      llm_int8_skip_modules=skip).to_dict()
            assert bnb_quantization_config(fmt, skip) == want


def test_skip_keeps_more_and_transformers_agrees(bnb, llama_dir, ids, tmp_path):
    out = tmp_path / "q"
    quantize_checkpoint(llama_dir, out, "nf4", skip=["mlp.down_proj", "model.layers.1.self_attn"], progress=False)
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["llm_int8_skip_modules"] == ["lm_head", "mlp.down_proj", "model.layers.1.self_attn"]
    t = load_file(out / "model.safetensors")
    assert t["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32
    assert t["model.layers.1.self_attn.q_proj.weight"].dtype == torch.float32
    assert t["model.layers.0.self_attn.q_proj.weight"].dtype == torch.uint8
    model = _loaded(out)
    for n, m in model.named_modules():
        if n.rsplit(".", 1)[-1] in LINEAR:
            want = "Linear" if ("down_proj" in n or "layers.1.self_attn" in n) else "Linear4bit"
            assert type(m).__name__ == want, n
    assert torch.isfinite(_logits(model, ids)).all()
    with pytest.raises(CheckpointError, match="matches no linear layer"):
        quantize_checkpoint(llama_dir, tmp_path / "q2", "nf4", skip=["layers.1.self_attn"], progress=False)


def test_tied_embeddings_and_bf16(bnb, tmp_path, ids, monkeypatch):
    src = tmp_path / "tied"
    src.mkdir()
    _tiny_llama(src, tie=True, dtype=torch.bfloat16, seed=3)
    quantize_checkpoint(src, tmp_path / "ours", "nf4", progress=False)
    with monkeypatch.context() as mp:
        _cuda_double_quant(mp, bnb)
        _bnb_reference(src, tmp_path / "theirs", "nf4")
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("ours", "theirs"))
    assert a.keys() == b.keys() and "lm_head.weight" not in a
    assert all(torch.equal(a[k], b[k]) for k in a if "quant_state" not in k)
    assert torch.equal(_logits(_loaded(tmp_path / "ours"), ids), _logits(_loaded(tmp_path / "theirs"), ids))


def test_sharded_input_and_output(bnb, llama_dir, ids, tmp_path):
    src = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(llama_dir).save_pretrained(src, max_shard_size="100KB")
    assert (src / "model.safetensors.index.json").exists()
    out = tmp_path / "q"
    assert main(["quantize", str(src), "-o", str(out), "--format", "nf4", "--max-shard-size", "60KB", "-q"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    total = 0
    for s in shards:
        part = load_file(out / s)
        assert {k for k, v in index["weight_map"].items() if v == s} == part.keys()
        total += sum(t.numel() * t.element_size() for t in part.values())
    assert index["metadata"]["total_size"] == total
    single = tmp_path / "single"
    quantize_checkpoint(llama_dir, single, "nf4", progress=False)
    assert torch.equal(_logits(_loaded(out), ids), _logits(_loaded(single), ids))


def test_nvfp4_folder_in_compressed_tensors_layout(llama_dir, tmp_path):
    from quantcore import api_mx
    from quantcore.io import load_safetensors

    out = tmp_path / "nv"
    quantize_checkpoint(llama_dir, out, "nvfp4", progress=False)
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "nvfp4-pack-quantized"
    assert cfg["ignore"] == ["lm_head"]
    w = cfg["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["type"], w["strategy"], w["group_size"]) == (4, "float", "tensor_group", 16)
    t, _ = load_safetensors(out / "model.safetensors")
    src, _ = load_safetensors(llama_dir / "model.safetensors")
    p = "model.layers.0.self_attn.q_proj."
    assert {k for k in t if k.startswith(p)} == {p + "weight_packed", p + "weight_scale", p + "weight_global_scale"}
    assert t[p + "weight_packed"].dtype == np.uint8 and t[p + "weight_packed"].shape == (64, 32)
    assert str(t[p + "weight_scale"].dtype) == "float8_e4m3fn" and t[p + "weight_scale"].shape == (64, 4)
    w0 = np.asarray(src[p + "weight"])
    g = np.float32(2688.0 / np.abs(w0).max())
    assert t[p + "weight_global_scale"].tolist() == [g]
    codes, scales = api_mx.scaled_nvfp4_quant(w0, np.array([g], np.float32), swizzle=False)
    assert np.array_equal(t[p + "weight_packed"], codes) and np.array_equal(t[p + "weight_scale"].view(np.uint8), scales)
    # read back: quantcore's own dequantize; and compressed-tensors' formula (e2m1 * scale / global)
    deq = read_quantized(str(out))[p + "weight"]
    assert np.array_equal(deq, api_mx.dequantize_nvfp4(codes, scales, np.array([g], np.float32), swizzled=False))
    lo, hi = t[p + "weight_packed"] & 15, t[p + "weight_packed"] >> 4
    e2m1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    vals = np.stack([e2m1[lo], e2m1[hi]], -1).reshape(64, 64)
    s = np.repeat(t[p + "weight_scale"].astype(np.float32), 16, axis=1)
    np.testing.assert_allclose(vals * (s / g), deq, rtol=1e-6, atol=0)


def test_mxfp4_folder_loads_in_transformers_gpt_oss(tmp_path):
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    cfg = GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, vocab_size=256,
                       max_position_embeddings=64)
    src = tmp_path / "gptoss"
    model = GptOssForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(src)
    out = tmp_path / "mx"
    quantize_checkpoint(src, out, "mxfp4", progress=False)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    t = load_file(out / "model.safetensors")
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert t[name + "_blocks"].shape == (4, 128, 2, 16) and t[name + "_scales"].shape == (4, 128, 2)
    assert t[name + "_blocks"].dtype == torch.uint8 and t[name + "_scales"].dtype == torch.uint8
    assert t["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    # transformers on CPU (no triton) dequantizes with its own gpt-oss code: equal to quantcore's
    loaded = AutoModelForCausalLM.from_pretrained(out, device_map="cpu")
    ours = read_quantized(str(out), out_dtype="bfloat16")
    for i in range(2):
        for p in ("gate_up_proj", "down_proj"):
            full = f"model.layers.{i}.mlp.experts.{p}"
            got = getattr(loaded.model.layers[i].mlp.experts, p).detach()
            want = torch.from_numpy(ours[full].view(np.uint16).astype(np.int32)).to(torch.int16).view(torch.bfloat16)
            assert got.dtype == torch.bfloat16 and torch.equal(got, want), full


def test_mxfp4_folder_other_than_gpt_oss_refused(llama_dir, tmp_path):
    with pytest.raises(UnsupportedError, match="gpt-oss"):
        quantize_checkpoint(llama_dir, tmp_path / "mx", "mxfp4", progress=False)
    assert not (tmp_path / "mx").exists()


def test_already_quantized_folder_refused(llama_dir, tmp_path):
    out = tmp_path / "q"
    quantize_checkpoint(llama_dir, out, "nf4", progress=False)
    with pytest.raises(CheckpointError, match="already quantized"):
        quantize_checkpoint(out, tmp_path / "q2", "nf4", progress=False)


def test_nvfp4_folder_decompressed_by_compressed_tensors(llama_dir, tmp_path):
    ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed: its own "
                             "decompressor is the reference here")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig

    out = tmp_path / "nv"
    quantize_checkpoint(llama_dir, out, "nvfp4", progress=False)
    cfg = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    assert cfg.format == "nvfp4-pack-quantized" and cfg.ignore == ["lm_head"], ct.__version__
    scheme = cfg.config_groups["group_0"]
    t = load_file(out / "model.safetensors")
    ours = read_quantized(str(out), out_dtype="bfloat16")
    names = [k[: -len(".weight_packed")] for k in t if k.endswith(".weight_packed")]
    assert len(names) == 14
    for p in names:
        sd = {k[len(p) + 1:]: v for k, v in t.items() if k.startswith(p + ".")}
        got = NVFP4PackedCompressor.decompress(sd, scheme)["weight"]
        want = torch.from_numpy(ours[p + ".weight"].view(np.uint16).astype(np.int32)).to(torch.int16)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.view(torch.bfloat16)), p


def test_nvfp4_folder_runs_in_transformers_with_compressed_tensors(llama_dir, ids, tmp_path):
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed: transformers needs it "
                        "to load this layout")
    out = tmp_path / "nv"
    quantize_checkpoint(llama_dir, out, "nvfp4", progress=False)
    model = AutoModelForCausalLM.from_pretrained(out, device_map="cpu", dtype=torch.bfloat16)
    got = _logits(model, ids)  # decompresses the NVFP4 layers on the first call
    ours = read_quantized(str(out), out_dtype="bfloat16")
    ref = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, w in ours.items():
            bf = torch.from_numpy(w.view(np.uint16).astype(np.int32)).to(torch.int16).view(torch.bfloat16)
            assert torch.equal(model.get_submodule(name.removesuffix(".weight")).weight, bf), name
            ref.get_submodule(name.removesuffix(".weight")).weight.copy_(bf)
    assert torch.equal(got, _logits(ref, ids))
