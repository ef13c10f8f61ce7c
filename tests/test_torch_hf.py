"""quantcore.hf, the transformers quantizer: quantize on load, save / load back, and checkpoints that
transformers + bitsandbytes saved, on CPU with a tiny random Llama made here (no hub access).
"""

from __future__ import annotations

import importlib
import json
import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # everything loads from tmp dirs; never reach for the hub

torch = pytest.importorskip("torch", reason="torch is not installed: quantcore.hf needs it")
transformers = pytest.importorskip("transformers", reason="transformers is not installed: quantcore.hf plugs into it")
if tuple(int(p) for p in transformers.__version__.split(".")[:2]) < (5, 17):
    pytest.skip(f"quantcore.hf needs transformers>=5.17, found {transformers.__version__}", allow_module_level=True)

from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

import quantcore as qc  # noqa: E402
import quantcore.hf as qh  # noqa: E402
import quantcore.nn as qnn  # noqa: E402
from quantcore.hf import QuantcoreConfig  # noqa: E402

MODULE_OF = {"nf4": qnn.Linear4bit, "fp4": qnn.Linear4bit, "q4_0": qnn.LinearQ4_0, "nvfp4": qnn.LinearFP4,
             "mxfp4": qnn.LinearFP4}
BNB_STATS = ("weight", "weight.absmax", "weight.quant_map", "weight.nested_absmax", "weight.nested_quant_map",
             "weight.quant_state.bitsandbytes__nf4")
#: the 7 linear layers of each decoder layer
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _tiny_llama(path, intermediate_size=128, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=intermediate_size, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    _tiny_llama(path)
    return path


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _layers(model):
    return {n: m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in LINEAR_NAMES}


@pytest.fixture(scope="module")
def bnb():
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed: its checkpoints are made with it")
    return bnb


def _bnb_exact_cpu_path(model):
    # bitsandbytes on a CPU with AVX512-BF16 repacks the weight on the first forward and runs its own
    # bf16 kernel; off, its forward is dequantize + matmul, the path quantcore is compared with
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False


def _save_bnb(float_dir, path, **kw):
    from transformers import BitsAndBytesConfig

    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32, **kw)
    # on the CPU also where a GPU is (the same reference on every machine; quantcore loads to the CPU)
    model = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=cfg, device_map="cpu")
    model.save_pretrained(path)
    _bnb_exact_cpu_path(model)
    return model


@pytest.fixture(scope="module")
def bnb_dir(bnb, float_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("bnb_nf4")
    model = _save_bnb(float_dir, path, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    return path, model


# -- registration and config -------------------------------------------------------------------------------
def test_registered_on_import_and_again():
    from transformers.quantizers import auto

    assert auto.AUTO_QUANTIZATION_CONFIG_MAPPING["quantcore"] is QuantcoreConfig
    assert auto.AUTO_QUANTIZER_MAPPING["quantcore"] is qh.QuantcoreHfQuantizer
    qh.register()
    importlib.reload(qh)  # a re-import runs the registration again
    qh.register()
    assert auto.AUTO_QUANTIZATION_CONFIG_MAPPING["quantcore"] is qh.QuantcoreConfig


def test_another_package_owning_the_name_is_an_error(monkeypatch):
    from transformers.quantizers import auto
    from transformers.utils.quantization_config import QuantizationConfigMixin

    class Other(QuantizationConfigMixin):
        pass

    monkeypatch.setitem(auto.AUTO_QUANTIZATION_CONFIG_MAPPING, "quantcore", Other)
    with pytest.raises(qc.UnsupportedError, match="Other"):
        qh.register()


def test_config_defaults_and_dict_round_trip():
    cfg = QuantcoreConfig()
    assert (cfg.fmt, cfg.blocksize, cfg.compress_statistics, cfg.compute_dtype) == ("nf4", 64, True, None)
    assert QuantcoreConfig("q4_0").blocksize == 32 and QuantcoreConfig("NVFP4").blocksize == 16
    assert QuantcoreConfig("mxfp4").compress_statistics is None
    cfg = QuantcoreConfig("fp4", blocksize=128, compress_statistics=False, compute_dtype=torch.bfloat16, skip="mlp")
    d = cfg.to_dict()
    assert d == {"quant_method": "quantcore", "fmt": "fp4", "blocksize": 128, "compress_statistics": False,
                 "compute_dtype": "bfloat16", "modules_to_not_convert": ["mlp"]}
    assert json.loads(json.dumps(d)) == d
    assert QuantcoreConfig.from_dict(d) == cfg
    assert cfg.torch_compute_dtype is torch.bfloat16


@pytest.mark.parametrize("kw, err", [
    ({"fmt": "int3"}, qc.ParameterError),
    ({"fmt": 4}, qc.ParameterError),
    ({"blocksize": 100}, qc.ParameterError),
    ({"blocksize": 64.0}, qc.ParameterError),
    ({"fmt": "q4_0", "blocksize": 64}, qc.ParameterError),
    ({"fmt": "nvfp4", "compress_statistics": True}, qc.ParameterError),
    ({"fmt": "q4_0", "compute_dtype": "float16"}, qc.ParameterError),
    ({"compress_statistics": "yes"}, qc.ParameterError),
    ({"compute_dtype": "int8"}, qc.DTypeError),
    ({"compute_dtype": torch.int8}, qc.DTypeError),
    ({"modules_to_not_convert": [1]}, qc.ParameterError),
    ({"modules_to_not_convert": ["mlp"], "skip": ["mlp"]}, qc.ParameterError),
    ({"block_size": 64}, qc.ParameterError),
    ({"quant_method": "bitsandbytes"}, qc.ParameterError),
])
def test_bad_config_values_raise_quantcore_errors(kw, err):
    with pytest.raises(err):
        QuantcoreConfig(**kw)


def test_a_value_changed_after_construction_is_checked_on_load(float_dir):
    cfg = QuantcoreConfig("nf4")
    cfg.blocksize = 48
    with pytest.raises(qc.ParameterError, match="blocksize"):
        AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=cfg)


def test_offloading_device_map_is_refused(float_dir):
    with pytest.raises(qc.UnsupportedError, match="offload"):
        AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=QuantcoreConfig("nf4"),
                                             device_map={"model": "cpu", "lm_head": "disk"})


# -- quantize on load ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", qh.FORMATS)
def test_quantize_on_load(float_dir, ids, fmt):
    ref = AutoModelForCausalLM.from_pretrained(float_dir)
    model = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=QuantcoreConfig(fmt))
    layers = _layers(model)
    assert len(layers) == 14 and all(type(m) is MODULE_OF[fmt] for m in layers.values())
    assert type(model.lm_head) is torch.nn.Linear  # the output layer stays float, as with bitsandbytes
    assert isinstance(model.config.quantization_config, QuantcoreConfig) and model.is_quantized
    out = _logits(model, ids)
    assert _rel(out, _logits(ref, ids)) < 0.2
    # the same modules as quantcore.nn.quantize_model makes from the float model
    qnn.quantize_model(ref, fmt, progress=False)
    assert torch.equal(out, _logits(ref, ids))


def test_quantize_on_load_bf16(float_dir, ids, tmp_path):
    cfg = QuantcoreConfig("nf4", blocksize=128, compress_statistics=False, compute_dtype="bfloat16")
    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.bfloat16, quantization_config=cfg)
    q = model.model.layers[0].mlp.down_proj
    assert (q.blocksize, q.compress_statistics, q.weight_dtype) == (128, False, "bfloat16")
    assert q.absmax.dtype == torch.float32 and model.model.norm.weight.dtype == torch.bfloat16
    out = _logits(model, ids)
    assert out.dtype == torch.bfloat16
    ref = _logits(AutoModelForCausalLM.from_pretrained(float_dir), ids)
    assert _rel(out, ref) < 0.2
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert again.model.layers[0].mlp.down_proj.blocksize == 128
    assert torch.equal(_logits(again, ids), out)


def test_skip_patterns(float_dir):
    cfg = QuantcoreConfig("nf4", modules_to_not_convert=["mlp", "layers.1.self_attn.q_proj", "*.o_proj"])
    model = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=cfg)
    kept = {n for n, m in _layers(model).items() if type(m) is torch.nn.Linear}
    assert kept == {f"model.layers.{i}.mlp.{p}" for i in (0, 1) for p in ("gate_proj", "up_proj", "down_proj")} | {
        "model.layers.1.self_attn.q_proj", "model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"}
    # a list replaces transformers' default skips, as llm_int8_skip_modules does
    assert isinstance(model.lm_head, qnn.Linear4bit)


def test_layers_the_format_cannot_block_stay_float(tmp_path, ids, caplog):
    _tiny_llama(tmp_path, intermediate_size=80)  # down_proj's in_features: a multiple of 16, not of 32
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=QuantcoreConfig("q4_0"))
    assert type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear
    assert type(model.model.layers[0].mlp.up_proj) is qnn.LinearQ4_0
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=QuantcoreConfig("nvfp4"))
    assert type(model.model.layers[0].mlp.down_proj) is qnn.LinearFP4
    assert torch.isfinite(_logits(model, ids)).all()


def test_quantizes_after_loading_where_the_loader_did_not(float_dir, ids, monkeypatch):
    expected = _logits(AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=QuantcoreConfig("nf4")), ids)
    monkeypatch.setattr(qh.QuantcoreHfQuantizer, "param_needs_quantization", lambda *a, **k: False)
    model = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=QuantcoreConfig("nf4"))
    assert isinstance(model.model.layers[1].mlp.up_proj, qnn.Linear4bit)
    assert torch.equal(_logits(model, ids), expected)


def test_dequantize(float_dir, ids):
    model = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=QuantcoreConfig("q4_0"))
    out = _logits(model, ids)
    model.dequantize()
    assert all(type(m) is torch.nn.Linear for m in _layers(model).values())
    assert not getattr(model.config, "quantization_config", None)
    assert torch.allclose(_logits(model, ids), out, rtol=1e-4, atol=1e-4)


# -- save and load back ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", qh.FORMATS)
def test_save_load_round_trip_is_exact(float_dir, ids, tmp_path, fmt, capfd):
    model = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=QuantcoreConfig(fmt))
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert saved == QuantcoreConfig(fmt).to_dict()
    tensors = load_file(tmp_path / "model.safetensors")
    if fmt in ("nf4", "fp4"):
        stats = {k.removeprefix("model.layers.0.self_attn.q_proj.") for k in tensors
                 if k.startswith("model.layers.0.self_attn.q_proj.")}
        assert stats == {s.replace("nf4", fmt) for s in BNB_STATS}
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert "LOAD REPORT" not in capfd.readouterr().err  # transformers' list of missing / unexpected keys
    assert all(type(m) is MODULE_OF[fmt] for m in _layers(again).values())
    assert torch.equal(_logits(again, ids), _logits(model, ids))
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- checkpoints saved by transformers + bitsandbytes ----------------------------------------------------------
def test_bnb_checkpoint_loads_bit_exactly(bnb, bnb_dir, ids, tmp_path, capfd):
    path, ref = bnb_dir
    model = qh.from_bnb_pretrained(path)
    assert "LOAD REPORT" not in capfd.readouterr().err
    bnb_layers, layers = _layers(ref), _layers(model)
    assert layers.keys() == bnb_layers.keys() and type(model.lm_head) is torch.nn.Linear
    for name, m in layers.items():
        w = bnb_layers[name].weight
        st = w.quant_state
        assert isinstance(m, qnn.Linear4bit) and m.quant_type == "nf4" and m.compress_statistics
        assert torch.equal(m.weight, w.data), name
        assert torch.equal(m.absmax, st.absmax) and torch.equal(m.nested_absmax, st.state2.absmax)
        assert torch.equal(m.offset.reshape(()), st.offset.reshape(()))
        assert torch.equal(m.quant_map, st.code) and torch.equal(m.nested_quant_map, st.state2.code)
        assert torch.equal(m.dequantize(), bnb.functional.dequantize_4bit(w.data, st)), name
    cfg = model.config.quantization_config
    assert (cfg.fmt, cfg.compress_statistics, cfg.compute_dtype) == ("nf4", True, "float32")
    out = _logits(model, ids)
    torch.testing.assert_close(out, _logits(ref, ids), rtol=1e-5, atol=1e-5)
    # saved again, it is a quantcore checkpoint with the same tensors
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["quant_method"] == "quantcore"
    ours, theirs = load_file(tmp_path / "model.safetensors"), load_file(path / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for k in ours:
        if k.endswith("bitsandbytes__nf4"):
            assert json.loads(bytes(ours[k].tolist())) == json.loads(bytes(theirs[k].tolist())), k
        else:
            assert torch.equal(ours[k], theirs[k]), k
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(tmp_path), ids), out)


def test_transformers_keeps_the_checkpoints_own_config(bnb_dir):
    # why from_bnb_pretrained exists: from_pretrained refuses a second quantization method
    with pytest.raises(ValueError, match="BitsAndBytesConfig"):
        AutoModelForCausalLM.from_pretrained(bnb_dir[0], quantization_config=QuantcoreConfig("nf4"))


@pytest.fixture(scope="module")
def bnb_skip_dir(bnb, float_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("bnb_fp4_skip")
    model = _save_bnb(float_dir, path, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=False,
                      llm_int8_skip_modules=["up_proj", "lm_head"])
    return path, model


def test_bnb_checkpoint_decides_which_layers_are_4bit(bnb_skip_dir, ids):
    path, ref = bnb_skip_dir
    # a skip list that disagrees with the checkpoint's: the checkpoint wins, layer by layer
    cfg = QuantcoreConfig("fp4", modules_to_not_convert=["lm_head", "down_proj"])
    model = qh.from_bnb_pretrained(path, quantization_config=cfg)
    for name, m in _layers(model).items():
        assert type(m) is (torch.nn.Linear if name.endswith("up_proj") else qnn.Linear4bit), name
    up = model.model.layers[0].mlp.up_proj
    assert up.weight.dtype == torch.float32 and torch.equal(up.weight, ref.model.layers[0].mlp.up_proj.weight)
    assert not model.model.layers[0].mlp.down_proj.compress_statistics
    torch.testing.assert_close(_logits(model, ids), _logits(ref, ids), rtol=1e-5, atol=1e-5)


def test_bnb_checkpoint_float_layers_follow_the_dtype_plan(bnb_skip_dir):
    class KeepUpProj(LlamaForCausalLM):
        _keep_in_fp32_modules_strict = ["up_proj"]

    model = qh.from_bnb_pretrained(bnb_skip_dir[0], model_class=KeepUpProj, dtype=torch.bfloat16)
    mlp = model.model.layers[1].mlp
    assert mlp.up_proj.weight.dtype == torch.float32 and model.model.norm.weight.dtype == torch.bfloat16
    assert isinstance(mlp.gate_proj, qnn.Linear4bit) and mlp.gate_proj.absmax.dtype == torch.float32


def test_from_bnb_pretrained_errors(bnb_dir, float_dir):
    with pytest.raises(qc.StateError, match="no quantization_config"):
        qh.from_bnb_pretrained(float_dir)
    with pytest.raises(qc.ParameterError, match="fp4"):
        qh.from_bnb_pretrained(bnb_dir[0], quantization_config=QuantcoreConfig("fp4"))
    with pytest.raises(qc.UnsupportedError, match="8-bit"):
        qh.config_from_bnb({"quant_method": "bitsandbytes", "load_in_8bit": True})
    with pytest.raises(qc.UnsupportedError, match="uint8"):
        qh.config_from_bnb({"quant_method": "bitsandbytes", "load_in_4bit": True,
                            "bnb_4bit_quant_storage": "bfloat16"})
    with pytest.raises(qc.StateError):
        qh.config_from_bnb({"quant_method": "gptq"})


def test_from_bnb_pretrained_takes_a_quantcore_checkpoint(float_dir, ids, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=QuantcoreConfig("nf4"))
    model.save_pretrained(tmp_path)
    assert torch.equal(_logits(qh.from_bnb_pretrained(tmp_path), ids), _logits(model, ids))
