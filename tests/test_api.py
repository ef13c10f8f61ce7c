"""Public API, registry, validation and interop on the embedded cpu backend."""

import os
import subprocess
import sys

import numpy as np
import pytest

import quantcore as qc
from quantcore.formats import bnb, ggml

from .conftest import FLOAT_DTYPES, bits, needs_install


def test_import_pulls_no_vendor_package():
    # importing (and selecting the default backend) must not touch vendor packages; probing
    # availability of the device backends may, by design
    code = ("import sys, quantcore; quantcore.get_backend(); quantcore.quantize_q4_0(__import__('numpy').ones((1, 32), 'f4')); "
            "bad = [m for m in ('torch', 'cupy', 'dpctl', 'dpnp') if m in sys.modules]; "
            "print(','.join(bad)); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, f"importing quantcore imported {r.stdout.strip()}"


def test_registry_lists_builtins_with_reasons():
    av = qc.available_backends()
    assert {"cpu", "cuda", "sycl", "maca"} <= set(av)
    assert av["cpu"].ok
    for name, a in av.items():
        assert a.ok or a.reason, f"{name} unavailable without a reason"


def test_cpu_is_default_and_env_var_selects(monkeypatch):
    assert qc.get_backend().name == "cpu"
    monkeypatch.setenv("QUANTCORE_BACKEND", "nonexistent")
    with pytest.raises(qc.BackendUnavailableError, match="nonexistent"):
        qc.get_backend()


def test_use_backend_is_scoped_and_unavailable_says_why():
    class Broken(qc.Backend):
        name = "broken"

        def availability(self):
            return qc.Availability(False, "no such hardware here; install the driver")

    qc.register_backend("broken", Broken)
    try:
        with pytest.raises(qc.BackendUnavailableError, match="install the driver"):
            qc.set_backend("broken")
        with qc.use_backend("cpu") as be:
            assert qc.get_backend() is be
        assert qc.get_backend().name == "cpu"
    finally:
        qc.unregister_backend("broken")


@needs_install
def test_entry_point_registers_cpu():
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group="quantcore.backends")}
    assert "cpu" in names, "pip install the package: the entry points come from its metadata"


@pytest.mark.parametrize("dname", list(FLOAT_DTYPES))
@pytest.mark.parametrize("nested", [False, True])
def test_4bit_round_trip_through_api(rng, dname, nested):
    x = rng.standard_normal((33, 65)).astype(FLOAT_DTYPES[dname])  # odd element count
    packed, state = qc.quantize_4bit(x, 128, "fp4", nested)
    assert packed.shape == ((x.size + 1) // 2, 1) and packed.dtype == np.uint8
    assert state.nested == nested and state.shape == x.shape and state.dtype == dname
    out = qc.dequantize_4bit(packed, state)
    assert out.shape == x.shape and out.dtype == x.dtype
    ref_p, ref_a = bnb.quantize_4bit(x, 128, "fp4")
    assert np.array_equal(packed, ref_p)
    assert np.abs(out.astype(np.float32) - x.astype(np.float32)).max() <= 0.35 * np.abs(x.astype(np.float32)).max()


def test_state_dict_round_trip_and_bad_states(rng):
    x = rng.standard_normal((64, 128)).astype(np.float32)
    packed, state = qc.quantize_4bit(x, 64, "nf4", True)
    d = state.as_dict(packed=True)
    assert set(d) == {"absmax", "quant_map", "nested_absmax", "nested_quant_map",
                      "quant_state.bitsandbytes__nf4"}
    back = qc.QuantState.from_dict({f"model.w.{k}": v for k, v in d.items()})
    assert np.array_equal(qc.dequantize_4bit(packed, back), qc.dequantize_4bit(packed, state))
    bad = dict(d)
    bad["absmax"] = d["absmax"][:-1]
    with pytest.raises(qc.StateError, match="absmax"):
        qc.QuantState.from_dict(bad)
    with pytest.raises(qc.StateError, match="quant_type"):
        qc.QuantState.from_dict({"absmax": d["absmax"]})
    wrong_map = dict(d)
    wrong_map["quant_map"] = bnb.FP4_CODE
    with pytest.raises(qc.StateError, match="quant_map"):
        qc.QuantState.from_dict(wrong_map)


def test_8bit_state_dicts():
    codes, state = qc.quantize_blockwise(np.linspace(-1, 1, 256, dtype=np.float32), 64)
    assert state.quant_type is None
    # the packed layout's key names the 4-bit type: an 8-bit state gets a StateError, not a TypeError
    with pytest.raises(qc.StateError, match="8-bit"):
        state.as_dict(packed=True)
    d = state.as_dict()
    # an 8-bit state's 256-entry map is never compared with a 4-bit table (quant_type None)
    back = qc.QuantState.from_dict(d)
    assert np.array_equal(qc.dequantize_blockwise(codes, back), qc.dequantize_blockwise(codes, state))
    _, state4 = qc.quantize_4bit(np.ones((4, 64), np.float32), 64, "nf4")
    wrong_map = state4.as_dict()
    wrong_map["quant_map"] = bnb.FP4_CODE  # a 4-bit map off the host is still checked
    with pytest.raises(qc.StateError, match="quant_map"):
        qc.QuantState.from_dict(wrong_map)


def test_safetensors_round_trip(tmp_path, rng):
    from quantcore.io import load_safetensors, save_safetensors

    x = rng.standard_normal((32, 64)).astype(FLOAT_DTYPES["bfloat16"])
    packed, state = qc.quantize_4bit(x, 64, "nf4", True)
    tensors = {"l.weight": packed, **{f"l.weight.{k}": v for k, v in state.as_dict(packed=True).items()}}
    save_safetensors(tmp_path / "q.safetensors", tensors)
    loaded, _ = load_safetensors(tmp_path / "q.safetensors")
    st = qc.QuantState.from_dict({k: np.array(v) for k, v in loaded.items() if k != "l.weight"})
    assert np.array_equal(bits(qc.dequantize_4bit(np.array(loaded["l.weight"]), st)),
                          bits(qc.dequantize_4bit(packed, state)))


BAD_CALLS = [
    (lambda: qc.quantize_4bit(np.zeros((0, 4), np.float32)), qc.ShapeError),
    (lambda: qc.quantize_4bit(np.ones(64, np.int32)), qc.DTypeError),
    (lambda: qc.quantize_4bit(np.ones(64, np.float32), blocksize=48), qc.ParameterError),
    (lambda: qc.quantize_4bit(np.ones(64, np.float32), quant_type="int4"), qc.ParameterError),
    (lambda: qc.quantize_blockwise(np.ones(64, np.float32), blocksize=32), qc.ParameterError),
    (lambda: qc.quantize_q4_0(np.ones((2, 40), np.float32)), qc.ShapeError),
    (lambda: qc.gemm_q4_0_q8_1(np.zeros((4, 1, 18), np.uint8), np.zeros((1, 1, 36), np.uint8), 4, 1, 64),
     qc.ShapeError),
    (lambda: qc.gemm_w4a8(np.zeros((4, 1, 18), np.uint8), np.zeros((2, 32), np.float32), 4, 1, 32),
     qc.ShapeError),
    (lambda: qc.gemm_w4a8(np.zeros((4, 1, 18), np.uint8), np.zeros((1, 32), np.float32), 0, 1, 32),
     qc.ParameterError),
]


@pytest.mark.parametrize("call,exc", BAD_CALLS)
def test_bad_input_raises_clear_error(call, exc):
    with pytest.raises(exc) as info:
        call()
    assert len(str(info.value)) > 20  # says what was wrong


def test_gemv_checks_a_and_state(rng):
    w = rng.standard_normal((16, 64)).astype(np.float32)
    packed, state = qc.quantize_4bit(w, 64, "nf4", False)
    with pytest.raises(qc.ShapeError, match="K = 64"):
        qc.gemv_4bit(np.ones((1, 63), np.float32), packed, state)
    with pytest.raises(qc.ShapeError, match="packed"):
        qc.gemv_4bit(np.ones((1, 64), np.float32), packed[:-1], state)
    a = rng.standard_normal((3, 1, 64)).astype(np.float32)
    y = qc.gemv_4bit(a, packed, state)
    assert y.shape == (3, 1, 16)
    wd = qc.dequantize_4bit(packed, state).astype(np.float64)
    assert np.allclose(y, a.astype(np.float64) @ wd.T, rtol=1e-5, atol=1e-5)


def test_bad_input_changes_nothing(rng):
    x = rng.standard_normal(64).astype(np.float32)
    packed, state = qc.quantize_4bit(x, 64, "nf4", False)
    before = (packed.copy(), state.absmax.copy())
    with pytest.raises(qc.DTypeError):
        qc.dequantize_4bit(packed, state, out_dtype="int8")
    assert np.array_equal(before[0], packed) and np.array_equal(before[1], state.absmax)


def test_ggml_api_shapes_and_bytes(rng):
    w = rng.standard_normal((8, 96)).astype(np.float32)
    a = rng.standard_normal((3, 96)).astype(np.float32)
    wq = qc.quantize_q4_0(w)
    assert wq.shape == (8, 3, 18) and np.array_equal(wq, ggml.quantize_q4_0(w))
    aq = qc.quantize_q8_1(a)
    assert aq.shape == (3, 3, 36)
    assert np.array_equal(qc.gemm_w4a8(wq, a, 8, 3, 96), qc.gemm_q4_0_q8_1(wq, aq, 8, 3, 96))
    assert qc.dequantize_q4_0(wq, "bfloat16").dtype == FLOAT_DTYPES["bfloat16"]
    assert qc.quantize_q8_0(a[0]).shape == (3, 34)


def test_torch_in_torch_out(rng):
    torch = pytest.importorskip("torch", reason="torch interop needs torch")
    x = torch.from_numpy(rng.standard_normal((16, 64)).astype(np.float32)).to(torch.bfloat16)
    packed, state = qc.quantize_4bit(x, 64, "nf4", True)
    assert isinstance(packed, torch.Tensor) and isinstance(state.absmax, torch.Tensor)
    out = qc.dequantize_4bit(packed, state)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == x.shape
    ref = qc.dequantize_4bit(*qc.quantize_4bit(x.view(torch.int16).numpy().view(FLOAT_DTYPES["bfloat16"]), 64, "nf4", True))
    assert np.array_equal(out.view(torch.int16).numpy(), ref.view(np.int16))
    d = state.as_dict(packed=True)
    assert isinstance(d["quant_state.bitsandbytes__nf4"], torch.Tensor)
    back = qc.QuantState.from_dict(d)
    assert torch.equal(qc.dequantize_4bit(packed, back), out)
    y = qc.gemv_4bit(torch.ones(1, 64, dtype=torch.bfloat16), packed, state)
    assert isinstance(y, torch.Tensor) and y.shape == (1, 16)


def test_cli_info_and_demo_run():
    env = dict(os.environ, QUANTCORE_BACKEND="cpu")
    r = subprocess.run([sys.executable, "-m", "quantcore.cli", "info"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "cpu" in r.stdout and "available" in r.stdout
    r = subprocess.run([sys.executable, "-m", "quantcore.cli", "demo", "--backend", "cpu", "--rows", "256",
                        "--cols", "512"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert "gemm_w4a8" in r.stdout and "nan" not in r.stdout.lower()


def test_cli_quantize_nf4_loads_back(tmp_path, rng):
    from quantcore.cli import main
    from quantcore.io import load_safetensors, save_safetensors

    w = (rng.standard_normal((128, 256)) * 0.02).astype(FLOAT_DTYPES["bfloat16"])
    save_safetensors(tmp_path / "in.safetensors", {"l.weight": w, "l.bias": np.ones(128, np.float32)})
    assert main(["quantize", str(tmp_path / "in.safetensors"), "-o", str(tmp_path / "o.safetensors"),
                 "--format", "nf4"]) == 0
    t, meta = load_safetensors(tmp_path / "o.safetensors")
    assert meta["quantcore.format"] == "nf4" and np.array_equal(t["l.bias"], np.ones(128))
    st = qc.QuantState.from_dict({k[len("l.weight."):]: np.array(v) for k, v in t.items() if k.startswith("l.weight.")})
    out = qc.dequantize_4bit(np.array(t["l.weight"]), st)
    assert out.shape == w.shape and out.dtype == w.dtype


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_cli_quantize_gguf_formats_need_a_gguf_input(tmp_path, rng, capsys, fmt):
    # a GGUF made from safetensors alone has no architecture llama.cpp can run: refused, pointing
    # at llama.cpp's converter (docs/checkpoints.md)
    from quantcore.cli import main
    from quantcore.io import save_safetensors

    save_safetensors(tmp_path / "in.safetensors", {"l.weight": rng.standard_normal((64, 128)).astype(np.float32)})
    assert main(["quantize", str(tmp_path / "in.safetensors"), "-o", str(tmp_path / "o.gguf"),
                 "--format", fmt, "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("quantcore: error: ")
    assert "convert_hf_to_gguf.py" in err[0] and f"quantcore quantize IN.gguf -o OUT.gguf --format {fmt}" in err[0]
    assert not (tmp_path / "o.gguf").exists()


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_cli_quantize_mx_dequantizes_back(tmp_path, rng, fmt):
    # the loaders' layouts: gpt-oss *_blocks / *_scales (mxfp4), compressed-tensors weight_packed /
    # weight_scale / weight_global_scale (nvfp4); row-major scales (docs/checkpoints.md)
    from quantcore.cli import main
    from quantcore.io import load_safetensors, save_safetensors

    w = (rng.standard_normal((128, 256)) * 0.02).astype(np.float32)
    save_safetensors(tmp_path / "in.safetensors", {"l.weight": w})
    assert main(["quantize", str(tmp_path / "in.safetensors"), "-o", str(tmp_path / "o.safetensors"),
                 "--format", fmt]) == 0
    t, meta = load_safetensors(tmp_path / "o.safetensors")
    assert meta["quantcore.blocksize"] == {"mxfp4": "32", "nvfp4": "16"}[fmt]
    if fmt == "mxfp4":
        assert set(t) == {"l.weight_blocks", "l.weight_scales"} and t["l.weight_blocks"].shape == (128, 8, 16)
        codes, scales = np.array(t["l.weight_blocks"]).reshape(128, 128), np.array(t["l.weight_scales"])
        back = qc.dequantize_mxfp4(codes, scales, swizzled=False)
        ref_codes, ref_scales = qc.scaled_mxfp4_quant(w, swizzle=False)
    else:
        assert set(t) == {"l.weight_packed", "l.weight_scale", "l.weight_global_scale"}
        codes, scales = np.array(t["l.weight_packed"]), np.array(t["l.weight_scale"]).view(np.uint8)
        g = np.array(t["l.weight_global_scale"])
        back = qc.dequantize_nvfp4(codes, scales, g, swizzled=False)
        ref_codes, ref_scales = qc.scaled_nvfp4_quant(w, g, swizzle=False)
    assert np.array_equal(codes, ref_codes) and np.array_equal(scales, ref_scales)
    assert back.shape == w.shape
    assert np.abs(back - w).max() <= 0.25 * np.abs(w).max()


def test_use_device_of_a_one_device_backend():
    """Backend.use_device (what `quantize --devices` threads call): a backend with one device takes
    index 0 and refuses any other with an UnsupportedError naming it."""
    be = qc.get_backend("cpu")
    be.use_device(0)
    with pytest.raises(qc.UnsupportedError, match="'cpu' has no device 1"):
        be.use_device(1)


def test_grouped_run_end_takes_like_weights_up_to_the_limit():
    """quantcore.backend.grouped_run_end: the weights one grouped launch takes (the cuda and sycl glue)."""
    from quantcore.backend import grouped_run_end

    g = [(None, None, None, 8, 64, "nf4")] * 5 + [(None, None, None, 8, 128, "nf4"), (None, None, None, 8, 64, "fp4")]
    assert grouped_run_end(g, 0, 4) == 4
    assert grouped_run_end(g, 4, 4) == 5  # the next weight has another blocksize
    assert grouped_run_end(g, 5, 4) == 6 and grouped_run_end(g, 6, 4) == 7
    assert grouped_run_end(g, 0, 4, lambda w: False) == 1


def test_grouped_run_padded_fills_the_launch_with_empty_weights():
    """quantcore.backend.grouped_run_padded: a run padded to the grouped launch's fixed weight count."""
    from quantcore.backend import grouped_run_padded

    g = [("p0", "a0", None, 8, 64, "nf4"), ("p1", "a1", None, 16, 64, "nf4"), ("p2", "a2", None, 8, 128, "fp4")]
    assert grouped_run_padded(g, 0, 2, 4) == g[:2] + [(None, None, None, 0, 64, "nf4")] * 2
    assert grouped_run_padded(g, 2, 3, 4) == g[2:] + [(None, None, None, 0, 128, "fp4")] * 3
