"""quantcore.torch (custom ops) and quantcore.nn (modules) on torch tensors.

CPU tests run on the cpu backend with torch CPU tensors (in CI); the GPU tests at the end run the
same checks on CUDA tensors (the cuda backend), under torch.compile and CUDA graphs, on the device
machine through the same pytest command.
"""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: the PyTorch layer needs it")

import quantcore as qc  # noqa: E402
import quantcore.nn as qnn  # noqa: E402
import quantcore.torch as qct  # noqa: E402

OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device: the cuda-backend checks run on the GPU machine")


@pytest.fixture
def gen(request):
    g = torch.Generator().manual_seed(int.from_bytes(request.node.name.encode()[:4].ljust(4, b"\0"), "little"))
    return g


def _randn(gen, *shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)


def _linear(gen, k, n, dtype=torch.bfloat16, bias=True, device="cpu"):
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(_randn(gen, n, k) * 0.05)
        if bias:
            lin.bias.copy_(_randn(gen, n) * 0.1)
    return lin.to(device=device, dtype=dtype)


def _state_args(packed, st):
    nested = st.state2 is not None
    return (packed, st.absmax, st.state2.absmax if nested else None, None, st.offset if nested else None)


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


# -- ops -------------------------------------------------------------------------------------------------
def _op_cases(gen, device):
    x = _randn(gen, 64, 128, device=device)
    packed, st = qct.quantize_4bit(x, 64, "nf4", True)
    sa = _state_args(packed, st)
    p2, st2 = qct.quantize_4bit(x.half(), 128, "fp4", False)
    sa2 = _state_args(p2, st2)
    wq = torch.ops.quantcore.quantize_q4_0(x)
    gs = torch.tensor([float(qc.nvfp4_global_scale(float(x.abs().max())))], dtype=torch.float32, device=device)
    codes, scales = torch.ops.quantcore.quantize_mx(x, "nvfp4", "floor", gs, False)
    a4, sa4 = torch.ops.quantcore.quantize_mx(_randn(gen, 16, 128, device=device), "nvfp4", "floor", gs, True)
    b4, sb4 = torch.ops.quantcore.quantize_mx(x, "nvfp4", "floor", gs, True)
    alpha = (1.0 / (gs * gs)).float()
    xb = _randn(gen, 3, 128, dtype=torch.bfloat16, device=device)
    bias = _randn(gen, 64, device=device).requires_grad_()
    return [
        ("quantize_4bit", (x, 64, "nf4", True)),
        ("quantize_4bit", (x.bfloat16(), 256, "fp4", False)),
        ("dequantize_4bit", (*sa, [64, 128], 64, "nf4", torch.bfloat16)),
        ("dequantize_4bit", (*sa2, [64, 128], 128, "fp4", torch.float32)),
        ("gemv_4bit", (xb, *sa, 64, 128, 64, "nf4")),
        ("gemv_4bit_grouped", (xb, [sa[0], sa[0]], [sa[1], sa[1]], [sa[2], sa[2]], [sa[3], sa[3]], [sa[4], sa[4]],
                               [64, 64], 128, 64, "nf4")),
        ("linear_4bit", (xb.clone().requires_grad_(), *sa, 64, 128, 64, "nf4", bias)),
        ("linear_4bit", (_randn(gen, 2, 20, 128, device=device).requires_grad_(), *sa2, 64, 128, 128, "fp4", None)),
        ("quantize_q4_0", (x,)),
        ("dequantize_q4_0", (wq, torch.float16)),
        ("gemm_w4a8", (wq, _randn(gen, 4, 128, device=device), 64, 4, 128)),
        ("linear_q4_0", (xb.clone().requires_grad_(), wq, bias)),
        ("linear_q4_0", (_randn(gen, 24, 128, device=device).requires_grad_(), wq, None)),
        ("linear_q4_0", (_randn(gen, 5, 128, device=device), wq, None)),  # fp32 through W4A8: output strides
        ("quantize_mx", (x, "mxfp4", "floor", None, True)),
        ("quantize_mx", (x.bfloat16(), "mxfp8", "rceil", None, False)),
        ("quantize_mx", (x, "nvfp4", "floor", gs, False)),
        ("dequantize_mx", (codes, scales, "nvfp4", torch.bfloat16, gs, False)),
        ("scaled_fp4_mm", (a4, b4, sa4, sb4, alpha, None, "nvfp4")),
        ("linear_mx", (xb, codes, scales, "nvfp4", gs, False)),
        ("linear_mx", (_randn(gen, 2, 3, 128, device=device), b4, sb4, "nvfp4", gs, True)),
        ("linear_mx_grouped", (xb, [codes, codes[:40]], [scales, scales[:40]], [gs, gs], "nvfp4")),
        ("linear_mx_grouped", (_randn(gen, 2, 3, 128, device=device), [codes], [scales], [gs], "nvfp4")),
        ("linear_fp4", (xb.clone().requires_grad_(), codes, scales, gs, "nvfp4", bias)),
        ("linear_fp4", (_randn(gen, 20, 128, device=device).requires_grad_(), codes, scales, gs, "nvfp4", None)),
    ]


def _opcheck_all(gen, device):
    for name, args in _op_cases(gen, device):
        torch.library.opcheck(getattr(torch.ops.quantcore, name), args, test_utils=OPCHECK_TESTS)


def test_every_op_is_registered():
    for name in qct.OPS:
        assert hasattr(torch.ops.quantcore, name), name
    assert {name for name, _ in _op_cases(torch.Generator().manual_seed(0), "cpu")} == set(qct.OPS)


def test_opcheck_cpu(gen):
    _opcheck_all(gen, "cpu")


def test_ops_equal_the_functional_api(gen):
    """The ops run the public API on the routed backend: the same bytes and values."""
    x = _randn(gen, 64, 128, dtype=torch.bfloat16)
    packed, st = qct.quantize_4bit(x, 64, "nf4", True)
    ref_p, ref_st = qc.quantize_4bit(x, 64, "nf4", True)
    assert torch.equal(packed, ref_p) and torch.equal(st.absmax, ref_st.absmax)
    w = torch.ops.quantcore.dequantize_4bit(*_state_args(packed, st), [64, 128], 64, "nf4", torch.bfloat16)
    assert torch.equal(w, qc.dequantize_4bit(ref_p, ref_st))
    a = _randn(gen, 2, 128, dtype=torch.bfloat16)
    y = torch.ops.quantcore.gemv_4bit(a, *_state_args(packed, st), 64, 128, 64, "nf4")
    assert torch.equal(y, qc.gemv_4bit(a, ref_p, ref_st))


@pytest.mark.parametrize("rows", [1, 5, 16, 17])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_linear_fp4_paths_agree_with_linear_mx(gen, fmt, rows):
    """linear_fp4 takes linear_mx up to GEMV_MAX_ROWS rows (then adds the bias in x's dtype) and
    dequantize + matmul above; both agree with the functional linear_mx within bf16 rounding."""
    w = _randn(gen, 48, 128)
    gs = torch.tensor([float(qc.nvfp4_global_scale(float(w.abs().max())))]) if fmt == "nvfp4" else None
    codes, scales = torch.ops.quantcore.quantize_mx(w, fmt, "floor", gs, False)
    x = _randn(gen, rows, 128, dtype=torch.bfloat16)
    bias = _randn(gen, 48, dtype=torch.bfloat16)
    y = torch.ops.quantcore.linear_fp4(x, codes, scales, gs, fmt, bias)
    ref = qc.linear_mx(x, codes, scales, fmt, global_scale=gs, swizzled=False)
    if rows <= qct.GEMV_MAX_ROWS:
        assert torch.equal(y, ref + bias)
    else:  # the weight rounded to bf16 and a bf16 matmul: within a few bf16 ulps of sum |x w|
        wd = qc.dequantize_mx(codes, scales, fmt, global_scale=gs, swizzled=False)
        scale = (x.float().abs() @ wd.abs().T).max()
        assert float((y.float() - (ref + bias).float()).abs().max()) <= 2 ** -6 * float(scale)


def test_linear_path_by_rows(monkeypatch, capsys):
    assert qct.linear_path(1) == "gemv" and qct.linear_path(qct.GEMV_MAX_ROWS) == "gemv"
    assert qct.linear_path(qct.GEMV_MAX_ROWS + 1) == "dequantize+matmul"
    assert qct.linear_path(9, "linear_q4_0") == "dequantize+matmul"
    assert qct.linear_path(16, "linear_fp4") == "gemv" and qct.linear_path(17, "linear_fp4") == "dequantize+matmul"
    assert qct.linear_path(9, "linear_q4_0", "cpu") == "dequantize+matmul"
    assert qct.linear_path(qct.W4A8_MAX_ROWS_CUDA, "linear_q4_0", "cuda") == "gemv"
    assert qct.linear_path(qct.W4A8_MAX_ROWS_CUDA + 1, "linear_q4_0", "cuda") == "dequantize+matmul"
    monkeypatch.setattr(qct, "DEBUG", True)
    qct.linear_path(3)
    assert "linear_4bit rows=3 -> gemv" in capsys.readouterr().err


def test_linear_path_fused_gemm_by_rows():
    """A backend with the many-row 4-bit GEMM (FUSED_4BIT_MAX_ROWS) takes it up to its row limit at
    any K; any other backend keeps the batch kernels' row limit."""

    class Named:
        def __init__(self, name):
            self.name = name

    cuda, cpu = Named("cuda"), Named("cpu")
    limit = qct.FUSED_4BIT_MAX_ROWS["cuda"]
    for k in (4096, 14336):
        assert qct.linear_path(limit, backend=cuda, k=k) == "gemv"
        assert qct.linear_path(limit + 1, backend=cuda, k=k) == "dequantize+matmul"
        assert qct.linear_path(limit, backend=cpu, k=k) == "dequantize+matmul"
    assert qct.linear_path(qct.GEMV_MAX_ROWS, backend=cuda, k=1 << 30) == "gemv"  # the decode kernels' rows
    assert qct.linear_path(qct.GEMV_MAX_ROWS + 1, backend=cpu, k=64) == "dequantize+matmul"
    assert qct.linear_path(qct.W4A8_MAX_ROWS_CUDA + 1, "linear_q4_0", backend=cuda, k=64) == "dequantize+matmul"


def test_linear_path_by_the_device_gemm():
    """With a device, the backend's many-row GEMM on it sets linear_4bit's gemv rows for the weight's
    shape (cuda: 512 with the wgmma GEMM for large weights, 128 with the mma.sync one, 0 where none runs,
    e.g. an A100): the batch kernels' rows always, dequantize + matmul above."""

    class Cuda:
        name = "cuda"

        def __init__(self, rows):
            self.rows, self.asked = rows, []

        def gemm_4bit_rows(self, device, n=0, k=0, rows=0, eager=False):
            self.asked.append((device, n, k) + ((eager,) if eager else ()))
            return self.rows

    wgmma, without = Cuda(512), Cuda(0)
    assert qct.linear_path(512, backend=wgmma, device="cuda:1", k=4096, n=14336) == "gemv"
    assert wgmma.asked == [("cuda:1", 14336, 4096)]
    assert qct.linear_path(513, backend=wgmma, device="cuda:1") == "dequantize+matmul"
    assert qct.linear_path(qct.FUSED_4BIT_MAX_ROWS["cuda"], backend=without, device="cuda:0") == "dequantize+matmul"
    assert qct.linear_path(qct.GEMV_MAX_ROWS, backend=without, device="cuda:0") == "gemv"
    assert qct.linear_path(qct.FUSED_4BIT_MAX_ROWS["cuda"], backend=without) == "gemv"  # no device: the backend's rule


def test_linear_path_eager_or_captured(monkeypatch):
    """Above a weight's rows for calls captured in a CUDA graph, the backend's rows for eager calls
    (cuda: the wgmma GEMM's 512 for small weights too) apply where the stream is not being captured;
    the eager rows are asked only then."""

    class Cuda:
        name = "cuda"

        def __init__(self):
            self.asked = []

        def gemm_4bit_rows(self, device, n=0, k=0, rows=0, eager=False):
            self.asked.append(eager)
            return 512 if eager else 128

    be = Cuda()
    capturing = [False]
    monkeypatch.setattr(qct, "_capturing", lambda: capturing[0])
    assert qct.linear_path(128, backend=be, device="cuda:0", k=4096, n=1024) == "gemv" and be.asked == [False]
    assert qct.linear_path(512, backend=be, device="cuda:0", k=4096, n=1024) == "gemv"
    assert qct.linear_path(513, backend=be, device="cuda:0", k=4096, n=1024) == "dequantize+matmul"
    capturing[0] = True
    assert qct.linear_path(512, backend=be, device="cuda:0", k=4096, n=1024) == "dequantize+matmul"
    assert qct._capturing() is True  # (the patched probe)
    monkeypatch.undo()
    assert qct._capturing() in (False, True)  # a torch without CUDA answers False


# -- modules ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", qnn.FORMATS)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_module_matches_its_dequantized_weight(gen, fmt, rows):
    lin = _linear(gen, 256, 96)
    mod = qnn.quantize_model(torch.nn.Sequential(copy.deepcopy(lin)), fmt=fmt, skip=(), progress=False)[0]
    assert type(mod).__name__ == {"q4_0": "LinearQ4_0", "nvfp4": "LinearFP4", "mxfp4": "LinearFP4"}.get(fmt, "Linear4bit")
    x = _randn(gen, rows, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        y = mod(x)
        ref = x.double() @ mod.dequantize(torch.float32).double().T + lin.bias.double()
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 96)
    # bf16 output; q4_0 also rounds the activation to 8 bits (W4A8)
    assert _rel(y, ref) < (2e-2 if fmt == "q4_0" else 8e-3)
    # and the quantization error against the float layer is what the format gives
    full = x.double() @ lin.weight.double().T + lin.bias.double()
    assert _rel(y, full) < 0.2


def test_eager_path_equals_the_op(gen):
    lin = _linear(gen, 128, 64)
    mod = qnn.Linear4bit.from_linear(lin)
    x = _randn(gen, 4, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        eager = mod(x)
        op = torch.ops.quantcore.linear_4bit(x, *mod._state_args(), 64, 128, 64, "nf4", mod.bias)
    assert torch.equal(eager, op)


def test_quantize_model_skips_and_reports(gen, capsys):
    model = torch.nn.Sequential()
    model.add_module("proj", _linear(gen, 64, 64))
    model.add_module("lm_head", _linear(gen, 64, 32))
    inner = torch.nn.Module()
    inner.gate = _linear(gen, 64, 64)
    model.add_module("mlp", inner)
    qnn.quantize_model(model, "nf4", skip=("lm_head", "*.gate"), progress=True)
    assert isinstance(model.proj, qnn.Linear4bit)
    assert type(model.lm_head) is torch.nn.Linear and type(model.mlp.gate) is torch.nn.Linear
    assert [n for n, _ in qnn.quantized_modules(model)] == ["proj"]
    with pytest.raises(qc.ParameterError, match="fmt"):
        qnn.quantize_model(model, "int3")


def test_module_bad_input_is_a_quantcore_error(gen):
    mod = qnn.Linear4bit.from_linear(_linear(gen, 128, 64))
    with pytest.raises(qc.ShapeError, match="last dimension"):
        mod(_randn(gen, 2, 100))
    with pytest.raises(qc.DTypeError):
        mod(torch.ones(2, 128, dtype=torch.int32))
    with pytest.raises(qc.ParameterError):
        qnn.Linear4bit(128, 64, quant_type="int4")
    with pytest.raises(qc.ParameterError):
        qnn.Linear4bit(0, 64)
    with pytest.raises(qc.ShapeError):
        qnn.LinearQ4_0(100, 64)
    with pytest.raises(qc.ParameterError):
        qnn.Linear4bit.from_linear(torch.nn.Conv1d(4, 4, 1))


def test_module_moves_and_copies(gen):
    mod = qnn.Linear4bit.from_linear(_linear(gen, 128, 64))
    x = _randn(gen, 2, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        y = mod(x)
        twin = copy.deepcopy(mod)
        assert torch.equal(twin(x), y)
        assert torch.equal(mod.to("cpu")(x), y)


# -- checkpoints: bitsandbytes' keys both ways --------------------------------------------------------------
BNB_KEYS = {"weight", "bias", "weight.absmax", "weight.quant_map", "weight.nested_absmax",
            "weight.nested_quant_map", "weight.quant_state.bitsandbytes__nf4"}


def test_state_dict_round_trip(gen):
    mod = qnn.Linear4bit.from_linear(_linear(gen, 128, 64))
    sd = mod.state_dict()
    assert set(sd) == BNB_KEYS
    fresh = qnn.Linear4bit(128, 64, quant_type="fp4", compress_statistics=False, dtype=torch.bfloat16)
    fresh.load_state_dict(sd)  # the checkpoint's type and nesting win
    assert fresh.quant_type == "nf4" and fresh.compress_statistics
    x = _randn(gen, 3, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(fresh(x), mod(x))
    # from the meta device with assign=True (how loaders build models)
    meta = qnn.Linear4bit(128, 64, device="meta", dtype=torch.bfloat16)
    meta.load_state_dict(sd, assign=True)
    with torch.no_grad():
        assert torch.equal(meta(x), mod(x))


def test_state_dicts_hold_no_shared_tensors(gen, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is not installed")
    model = qnn.quantize_model(torch.nn.Sequential(_linear(gen, 64, 64), _linear(gen, 64, 64)), "nf4", skip=(),
                               progress=False)
    sd = model.state_dict()
    ptrs = [t.data_ptr() for t in sd.values() if t.numel()]
    assert len(set(ptrs)) == len(ptrs)
    safetensors_torch.save_file(sd, str(tmp_path / "m.safetensors"))  # refuses aliasing tensors
    back = safetensors_torch.load_file(str(tmp_path / "m.safetensors"))
    fresh = torch.nn.Sequential(qnn.Linear4bit(64, 64), qnn.Linear4bit(64, 64))
    fresh.load_state_dict(back)
    x = _randn(gen, 2, 64)
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))


def test_state_dict_errors_name_the_layer(gen):
    sd = qnn.Linear4bit.from_linear(_linear(gen, 128, 64)).state_dict()
    with pytest.raises(RuntimeError, match="quant state is for a weight of shape"):
        qnn.Linear4bit(64, 128).load_state_dict(sd)
    bad = dict(sd)
    del bad["weight.quant_state.bitsandbytes__nf4"]
    with pytest.raises(RuntimeError, match="weight"):
        qnn.Linear4bit(128, 64).load_state_dict(bad)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_bitsandbytes_checkpoints_both_ways(gen, quant_type):
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    lin = _linear(gen, 256, 64)
    # bitsandbytes quantizes (CPU): its checkpoint loads into quantcore's module
    b = bnb.nn.Linear4bit(256, 64, quant_type=quant_type, compute_dtype=torch.bfloat16)
    b.load_state_dict(lin.state_dict())
    b = b.to("cpu")
    ours = qnn.Linear4bit(256, 64, quant_type=quant_type)
    ours.load_state_dict(b.state_dict())
    ref_w = bnb.functional.dequantize_4bit(b.weight.data, b.weight.quant_state).to(torch.bfloat16)
    assert torch.equal(ours.dequantize(torch.bfloat16), ref_w)
    # quantcore quantizes: the checkpoint loads into bitsandbytes as transformers loads it
    mine = qnn.Linear4bit.from_linear(lin, quant_type=quant_type)
    sd = mine.state_dict()
    stats = {k[len("weight."):]: v for k, v in sd.items() if k.startswith("weight.")}
    b2 = bnb.nn.Linear4bit(256, 64, quant_type=quant_type, compute_dtype=torch.bfloat16)
    b2.weight = bnb.nn.Params4bit.from_prequantized(sd["weight"], stats, requires_grad=False, device="cpu")
    got = bnb.functional.dequantize_4bit(b2.weight.data, b2.weight.quant_state).to(torch.bfloat16)
    assert torch.equal(got, mine.dequantize(torch.bfloat16))


# -- training through the frozen weight (QLoRA) ---------------------------------------------------------------
class _LoRA(torch.nn.Module):
    def __init__(self, base: torch.nn.Module, r: int, gen):
        super().__init__()
        self.base = base
        self.a = torch.nn.Parameter(_randn(gen, r, base.in_features) * 0.01)
        self.b = torch.nn.Parameter(torch.zeros(base.out_features, r, dtype=torch.float32))

    def forward(self, x):
        return self.base(x) + (x @ self.a.T) @ self.b.T


@pytest.mark.parametrize("fmt", ["nf4", "q4_0", "nvfp4"])
def test_lora_trains_through_the_quantized_layer(gen, fmt):
    teacher = _linear(gen, 128, 32, dtype=torch.float32)
    student = qnn.quantize_model(torch.nn.Sequential(_linear(gen, 128, 32, dtype=torch.float32)), fmt,
                                 skip=(), progress=False)[0]
    student.bias.requires_grad_(False)
    model = _LoRA(student, 8, gen)
    opt = torch.optim.Adam([model.a, model.b], lr=1e-2)
    x = _randn(gen, 64, 128)
    with torch.no_grad():
        target = teacher(x)
    losses = []
    for _ in range(25):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert model.a.grad is not None and student.weight.grad is None
    assert losses[-1] < 0.7 * losses[0], losses


def test_input_gradient_is_the_dequantized_weights(gen):
    mod = qnn.Linear4bit.from_linear(_linear(gen, 128, 64, dtype=torch.float32))
    x = _randn(gen, 3, 128).requires_grad_()
    g = _randn(gen, 3, 64)
    mod(x).backward(g)
    ref = g.double() @ mod.dequantize(torch.float32).double()
    assert _rel(x.grad, ref) < 1e-6
    assert torch.allclose(mod.bias.grad, g.sum(0))


# -- torch.compile ---------------------------------------------------------------------------------------------
def _tiny_mlp(gen, fmt, dtype=torch.float32, device="cpu"):
    model = torch.nn.Sequential(_linear(gen, 128, 256, dtype, device=device), torch.nn.SiLU(),
                                _linear(gen, 256, 128, dtype, device=device))
    return qnn.quantize_model(model, fmt, skip=(), progress=False)


@pytest.mark.parametrize("fmt", ["nf4", "q4_0", "mxfp4"])
def test_compile_fullgraph_aot_eager(gen, fmt):
    model = _tiny_mlp(gen, fmt)
    x = _randn(gen, 2, 128)
    with torch.no_grad():
        ref = model(x)
        got = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(got, ref)


def test_compile_fullgraph_inductor_cpu(gen):
    model = _tiny_mlp(gen, "nf4")
    x = _randn(gen, 2, 128)
    with torch.no_grad():
        ref = model(x)
        try:
            compiled = torch.compile(model, fullgraph=True)
            got = compiled(x)
        except Exception as exc:  # noqa: BLE001 - inductor needs a working C++ toolchain on CPU
            if "CppCompileError" in type(exc).__name__ or "InvalidCxxCompiler" in type(exc).__name__:
                pytest.skip(f"the CPU inductor cannot compile here: {type(exc).__name__}")
            raise
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)


# -- routing ------------------------------------------------------------------------------------------------------
def test_routing(monkeypatch):
    assert qct.backend_for("cpu").name == "cpu"
    with pytest.raises(qc.ParameterError, match="set_backend_for"):
        qct.backend_for("mps")
    with pytest.raises(qc.QuantcoreError):
        qct.set_backend_for("cpu", "no-such-backend")
    assert qct.backend_for("cpu").name == "cpu"


def test_sycl_route_for_cpu_tensors(gen):
    if not qc.available_backends()["sycl"].ok:
        pytest.skip("the sycl backend is not available here (pip install 'quantcore[sycl]')")
    mod = qnn.Linear4bit.from_linear(_linear(gen, 128, 64))
    x = _randn(gen, 3, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = mod(x)
        qct.set_backend_for("cpu", "sycl")
        try:
            got = mod(x)
        finally:
            qct.set_backend_for("cpu", None)
    assert qct.backend_for("cpu").name == "cpu"
    assert _rel(got, ref) < 1e-2


# -- on the GPU --------------------------------------------------------------------------------------------------
@needs_cuda
def test_opcheck_cuda(gen):
    _opcheck_all(gen, "cuda")


@needs_cuda
@pytest.mark.parametrize("fmt", qnn.FORMATS)
def test_cuda_module_matches_cpu_module(gen, fmt):
    lin = _linear(gen, 512, 256)
    cpu = qnn.quantize_model(torch.nn.Sequential(copy.deepcopy(lin)), fmt, skip=(), progress=False)[0]
    gpu = qnn.quantize_model(torch.nn.Sequential(copy.deepcopy(lin).cuda()), fmt, skip=(), progress=False)[0]
    for (name, a), (_, b) in zip(cpu.state_dict().items(), gpu.state_dict().items()):
        assert torch.equal(a, b.cpu()), f"{fmt}: {name} differs between the cpu and cuda backends"
    for rows in (1, 8, 40):
        x = _randn(gen, rows, 512, dtype=torch.bfloat16)
        with torch.no_grad():
            assert _rel(gpu(x.cuda()).cpu(), cpu(x)) < 1e-2


@needs_cuda
@pytest.mark.parametrize("fmt", ["nf4", "q4_0", "nvfp4"])
def test_cuda_compile_reduce_overhead(gen, fmt):
    model = _tiny_mlp(gen, fmt, torch.bfloat16, "cuda")
    x = _randn(gen, 1, 128, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        ref = model(x)
        compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
        for _ in range(3):  # warm-up, record, replay
            got = compiled(x)
        torch.cuda.synchronize()
    assert torch.equal(got, ref)


def test_the_torch_layer_runs_its_calls_after_foreign_work(gen, monkeypatch):
    """The torch layer's calls reach the backend inside after_foreign_work (a model's kernels run between
    them): LAUNCH_CONTEXT.after_foreign is set there, restored afterwards and when the call raises."""
    from quantcore import api
    from quantcore.backend import LAUNCH_CONTEXT, after_foreign_work

    seen = []
    real = api.gemv_4bit

    def spy(*args, **kw):
        seen.append(LAUNCH_CONTEXT.after_foreign)
        return real(*args, **kw)

    monkeypatch.setattr(api, "gemv_4bit", spy)
    mod = qnn.Linear4bit.from_linear(_linear(gen, 128, 64))
    x = _randn(gen, 1, 128, dtype=torch.bfloat16)
    assert not LAUNCH_CONTEXT.after_foreign
    with torch.no_grad():
        torch.ops.quantcore.linear_4bit(x, *mod._state_args(), 64, 128, 64, "nf4", None)
    assert seen == [True] and not LAUNCH_CONTEXT.after_foreign

    def boom(*args, **kw):
        assert LAUNCH_CONTEXT.after_foreign
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        qct._run(x.device, boom, (x,))
    assert not LAUNCH_CONTEXT.after_foreign
    with after_foreign_work():  # nested: the outer setting comes back
        with after_foreign_work():
            assert LAUNCH_CONTEXT.after_foreign
        assert LAUNCH_CONTEXT.after_foreign
    assert not LAUNCH_CONTEXT.after_foreign


@needs_cuda
def test_cuda_torch_layer_launches_no_programmatic_dependents(gen, monkeypatch):
    """The cuda backend launches its decode gemv as a programmatic dependent when called through the
    public API (a chain of quantcore's own kernels), and plainly from the torch layer (behind torch's
    kernels): the op, the eager module's bound launch and the grouped op; the same results either way."""
    from quantcore.backends.cuda import runtime as rt

    calls = []
    real = rt.launch_pdl
    monkeypatch.setattr(rt, "launch_pdl", lambda *a: (calls.append(a[1]), real(*a))[1])
    mod = qnn.Linear4bit.from_linear(_linear(gen, 1024, 512, bias=False, device="cuda"))
    x = _randn(gen, 1, 1024, dtype=torch.bfloat16, device="cuda")
    packed, st = mod.weight, mod.quant_state
    with torch.no_grad():
        via_api = qc.gemv_4bit(x, packed, st, backend="cuda")
        api_pdl = len(calls)
        assert api_pdl >= 1 or not rt.pdl_available()
        y_op = torch.ops.quantcore.linear_4bit(x, *mod._state_args(), 512, 1024, 64, "nf4", None)
        for _ in range(3):
            y_mod = mod(x)  # the eager path, then its bound launch
        sa = mod._state_args()
        y_grp = torch.ops.quantcore.gemv_4bit_grouped(x, *([t] * 2 for t in sa), [512, 512], 1024, 64, "nf4")
        torch.cuda.synchronize()
    assert len(calls) == api_pdl, f"the torch layer launched {len(calls) - api_pdl} programmatic dependents"
    assert torch.equal(y_op, via_api) and torch.equal(y_mod, via_api)
    # (the grouped launch may split K otherwise than the single weight's: close, not equal)
    assert _rel(y_grp, torch.cat([via_api, via_api], -1)) < 1e-2


@needs_cuda
def test_cuda_eager_calls_reuse_the_launch_plan(gen):
    mod = qnn.Linear4bit.from_linear(_linear(gen, 1024, 512, device="cuda"))
    x = _randn(gen, 1, 1024, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        first = mod(x)
        for _ in range(3):
            assert torch.equal(mod(x), first)
    plan = mod.quant_state._plans["gemv_4bit"][1]
    assert plan.hits >= 3


@needs_cuda
def test_cuda_eager_forward_binds_its_launch(gen):
    """After one eager call the module keeps the gemv launch bound to its tensors; later calls of the
    same geometry run it (bitwise the op's result) and anything changed falls back and rebinds."""
    mod = qnn.Linear4bit.from_linear(_linear(gen, 1024, 512, device="cuda"))
    x = _randn(gen, 1, 1024, dtype=torch.bfloat16, device="cuda")
    op = torch.ops.quantcore.linear_4bit
    with torch.no_grad():
        first = mod(x)
        bound = mod._bound
        assert bound is not None
        hits = bound.plan.hits
        for _ in range(3):
            assert torch.equal(mod(x), first)
        assert bound.plan.hits == hits + 3 and mod._bound is bound
        assert torch.equal(first, op(x, *mod._state_args(), 512, 1024, 64, "nf4", mod.bias))
        # another geometry: the full path, then a new binding
        x2 = _randn(gen, 3, 1024, dtype=torch.bfloat16, device="cuda")
        assert torch.equal(mod(x2), op(x2, *mod._state_args(), 512, 1024, 64, "nf4", mod.bias))
        assert mod._bound is not bound
        # the statistics changed in place: the bound launch declines, the result follows the change
        mod(x2)
        mod.absmax.copy_(torch.roll(mod.absmax, 1))
        assert torch.equal(mod(x2), op(x2, *mod._state_args(), 512, 1024, 64, "nf4", mod.bias))
        # a float32 input and an input with grad take their own paths
        assert mod(x2.float()).dtype == torch.float32
    y = mod(x2.clone().requires_grad_())
    assert y.requires_grad


@needs_cuda
def test_cuda_eager_forward_binds_the_dequantize_path(gen):
    """Above the gemv path's rows the module keeps the dequantize + matmul path bound to its tensors
    (bind_dequantize_4bit, then F.linear, the bias added after): later calls of any such row count
    run it, bitwise the op's result; rows the gemv path takes, another dtype or changed statistics
    fall back (and the result follows the change)."""
    mod = qnn.Linear4bit.from_linear(_linear(gen, 1024, 512, device="cuda"))
    op = torch.ops.quantcore.linear_4bit
    # (the most rows the gemv path takes for this weight in an eager call: asked for a call of many rows)
    rows = qct._gemv_rows("linear_4bit", qct.backend_for(torch.device("cuda")), 1024, torch.device("cuda"), 512, 1 << 20)
    assert qct.linear_path(rows + 44, backend=qct.backend_for(torch.device("cuda")), k=1024, device=torch.device("cuda"),
                           n=512) == "dequantize+matmul"
    x = _randn(gen, rows + 44, 1024, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        first = mod(x)
        bound = mod._bound
        assert isinstance(bound, qct._BoundDequantLinear)
        assert torch.equal(first, op(x, *mod._state_args(), 512, 1024, 64, "nf4", mod.bias))
        for _ in range(3):
            assert torch.equal(mod(x), first) and mod._bound is bound
        x3 = _randn(gen, 3, rows + 1, 1024, dtype=torch.bfloat16, device="cuda")  # another shape, still bound
        assert bound(x3) is not None
        assert torch.equal(mod(x3), op(x3, *mod._state_args(), 512, 1024, 64, "nf4", mod.bias))
        assert bound(x[:rows]) is None and bound(x.float()) is None  # the gemv path's rows; another dtype
        mod.absmax.copy_(torch.roll(mod.absmax, 1))
        assert bound(x) is None  # the statistics changed: declined
        assert torch.equal(mod(x), op(x, *mod._state_args(), 512, 1024, 64, "nf4", mod.bias))


@needs_cuda
def test_cuda_eager_q4_0_forward_binds_its_launch(gen):
    """LinearQ4_0 keeps the W4A8 stream kernel's launch bound to its weight after one eager call (on
    sm_90, where that kernel runs up to 8 rows): later calls of the same geometry run it, bitwise the
    op's result; another geometry and an in-place change of the weight fall back and rebind."""
    from quantcore.backends.cuda import runtime as rt

    mod = qnn.LinearQ4_0.from_linear(_linear(gen, 1024, 512, device="cuda"))
    x = _randn(gen, 1, 1024, dtype=torch.bfloat16, device="cuda")
    op = torch.ops.quantcore.linear_q4_0
    with torch.no_grad():
        first = mod(x)
        assert torch.equal(first, op(x, mod.weight, mod.bias))
        bound = mod._bound
        if rt.device_arch(torch.cuda.current_device()) < 90:
            assert bound is None  # the tensor-core kernel keeps no launch
            return
        assert bound is not None
        for _ in range(3):
            assert torch.equal(mod(x), first)
        assert bound.hits == 3 and mod._bound is bound
        x2 = _randn(gen, 2, 3, 1024, dtype=torch.bfloat16, device="cuda")  # 6 rows
        y2 = mod(x2)
        assert torch.equal(y2, op(x2, mod.weight, mod.bias)) and y2.shape == (2, 3, 512)
        assert mod._bound is not bound
        assert torch.equal(mod(x2), y2) and mod._bound.hits == 1
        mod.weight[0, 0, 2:].copy_(mod.weight[1, 0, 2:])  # in place: the bound launch declines
        want = op(x2, mod.weight, mod.bias)
        assert not torch.equal(want, y2) and torch.equal(mod(x2), want)
        xf = x2.float()
        assert torch.equal(mod(xf), op(xf, mod.weight, mod.bias))
        assert mod(xf).is_contiguous()


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_q4_0_bound_launch_writes_y_bitwise_as_the_fp32_path(gen, dtype):
    """The bound launch's kernel writes y [rows, M] in x's dtype itself: bit for bit what the public
    gemm_w4a8's fp32 [M, rows] gives transposed and converted (the op's path), for 1-8 rows, M not a
    multiple of the kernel's 16-row tile, cluster sizes 1 / 2 / 4 (K up to 20480), 1-D to 3-D
    inputs, with and without a bias; each call's output a new contiguous tensor."""
    from quantcore.backends.cuda import runtime as rt

    if rt.device_arch(torch.cuda.current_device()) < 90:
        pytest.skip("the W4A8 stream kernel (the bound launch) is sm_90 only")
    op = torch.ops.quantcore.linear_q4_0
    cases = [(1024, 512, ()), (1024, 512, (1,)), (1024, 512, (1, 1)), (4096, 1000, (1, 3)), (2048, 77, (8,)),
             (14336, 300, (2, 2, 2)), (20480, 40, (5,)), (256, 4099, (1, 2))]
    with torch.no_grad():
        for k, m, lead in cases:
            for bias in (False, True):
                mod = qnn.LinearQ4_0.from_linear(_linear(gen, k, m, dtype=dtype, bias=bias, device="cuda"))
                x = _randn(gen, *lead, k, dtype=dtype, device="cuda")
                rows = x.numel() // k
                mod(x)  # the public path, which binds
                bound = mod._bound
                assert bound is not None, (k, m, lead)
                ys = [mod(x), mod(x)]
                assert bound.hits == 2 and mod._bound is bound
                fp32 = qc.gemm_w4a8(mod.weight, x.reshape(rows, k), m, rows, k, backend="cuda")  # [m, rows]
                want = fp32.t().to(dtype).reshape(*lead, m)
                if bias:
                    want = want + mod.bias.to(dtype)
                for y in ys:
                    assert y.dtype == dtype and y.shape == (*lead, m) and y.is_contiguous()
                    assert torch.equal(y.view(_int_view(dtype)), want.view(_int_view(dtype))), (k, m, lead, bias)
                assert ys[0].data_ptr() != ys[1].data_ptr()
                assert torch.equal(ys[0].view(_int_view(dtype)), op(x, mod.weight, mod.bias).view(_int_view(dtype)))


def _int_view(dtype):
    return torch.int16 if dtype.itemsize == 2 else torch.int32


# -- grouped gemv (quantcore.nn.group_linears) ---------------------------------------------------------
def _tiny_llama(fmt="nf4"):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=100)
    model = transformers.LlamaForCausalLM(cfg).eval()
    qnn.quantize_model(model, fmt, progress=False)
    return model


@contextlib.contextmanager
def _spied(op, record):
    """torch.ops.quantcore.<op> replaced (as quantcore.nn.grouped sees it) by a wrapper that appends
    ``record(args)`` to the yielded list before calling the real op."""
    real, calls = getattr(torch.ops.quantcore, op), []

    class Spy:
        def __call__(self, *a):
            calls.append(record(a))
            return real(*a)

    import quantcore.nn.grouped as grouped

    saved = getattr(grouped.torch.ops.quantcore, op)
    try:
        setattr(torch.ops.quantcore, op, Spy())
        yield calls
    finally:
        setattr(torch.ops.quantcore, op, saved)


def test_group_linears_keeps_results_and_checkpoint_keys():
    model = _tiny_llama()
    ids = torch.tensor([[1, 5, 7, 9]])
    keys = set(model.state_dict())
    with torch.no_grad():
        ref_prefill, ref_decode = model(ids).logits, model(ids[:, :1]).logits
        assert qnn.group_linears(model) == 4  # q/k/v and gate/up in 2 layers
        assert set(model.state_dict()) == keys
        with _spied("gemv_4bit_grouped", lambda a: a[6]) as calls:
            got_decode = model(ids[:, :1]).logits
        assert calls == [[128, 64, 64], [256, 256]] * 2  # one grouped call per group and layer
        assert torch.equal(model(ids).logits, ref_prefill)  # 4 rows: the same gemv path per member
        # the cpu backend computes each block as its own gemv_4bit: the same bits
        assert torch.equal(got_decode, ref_decode)
        qnn.ungroup_linears(model)
        assert torch.equal(model(ids[:, :1]).logits, ref_decode)


def test_grouped_members_run_alone_above_the_batch_kernels_rows(monkeypatch):
    """Above GEMV_MAX_ROWS rows a group's members run alone even where linear_4bit keeps the gemv path
    (a backend whose many-row GEMM sits behind gemv_4bit: one launch per weight either way, and the
    member's own call is bound to its tensors); at GEMV_MAX_ROWS rows the grouped op runs."""
    model = _tiny_llama()
    qnn.group_linears(model)
    monkeypatch.setattr(qct, "linear_path", lambda *a, **k: "gemv")  # (as the cuda backend on Hopper)
    with torch.no_grad():
        for rows, grouped in ((qct.GEMV_MAX_ROWS, True), (qct.GEMV_MAX_ROWS + 1, False)):
            ids = torch.randint(0, 100, (1, rows))
            with _spied("gemv_4bit_grouped", lambda a: a[6]) as calls:
                got = model(ids).logits
            assert (calls == [[128, 64, 64], [256, 256]] * 2) == grouped, (rows, calls)
            qnn.ungroup_linears(model)
            assert torch.equal(got, model(ids).logits)
            qnn.group_linears(model)


def test_grouped_member_called_alone_or_twice_gives_its_own_result():
    model = _tiny_llama()
    qnn.group_linears(model)
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, 128)
    with torch.no_grad():
        alone = [m(x) for m in (attn.v_proj, attn.v_proj, attn.q_proj)]  # out of order, repeated
        qnn.ungroup_linears(model)
        ref = [m(x) for m in (attn.v_proj, attn.v_proj, attn.q_proj)]
    for a, r in zip(alone, ref):
        assert torch.equal(a, r)


def test_grouped_decode_compiles_fullgraph_with_the_grouped_op():
    model = _tiny_llama()
    qnn.group_linears(model)
    ids = torch.tensor([[3]])
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model, backend=backend, fullgraph=True)(ids).logits
    assert torch.equal(eager, compiled)
    assert seen.count("quantcore.gemv_4bit_grouped") == 4


def test_gemv_4bit_grouped_api_checks():
    w = torch.randn(40, 128)
    p1, s1 = qc.quantize_4bit(w.numpy(), 64, "nf4", True)
    p2, s2 = qc.quantize_4bit(torch.randn(8, 64).numpy(), 64, "nf4", True)
    a = torch.randn(2, 128).numpy()
    with pytest.raises(qc.ParameterError, match="non-empty sequence"):
        qc.gemv_4bit_grouped(a, [])
    with pytest.raises(qc.ParameterError, match="pair"):
        qc.gemv_4bit_grouped(a, [(p1, s1, 3)])
    with pytest.raises(qc.ShapeError, match="share K"):
        qc.gemv_4bit_grouped(a, [(p1, s1), (p2, s2)])
    with pytest.raises(qc.ShapeError, match=r"\[\.\.\., K\]"):
        qc.gemv_4bit_grouped(a[:, :64], [(p1, s1)])
    y = qc.gemv_4bit_grouped(a.reshape(1, 2, 128), [(p1, s1), (p1, s1)])
    assert y.shape == (1, 2, 80)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_group_linears_fp4_keeps_results_and_compiles(fmt):
    """LinearFP4 siblings grouped: one linear_mx_grouped call per group and layer at decode, the same
    bits as ungrouped on the cpu backend (it runs linear_mx per weight), the checkpoint keys unchanged,
    the grouped op in a fullgraph torch.compile."""
    model = _tiny_llama(fmt)
    assert isinstance(model.model.layers[0].self_attn.q_proj, qnn.LinearFP4)
    ids = torch.tensor([[1, 5, 7, 9]])
    keys = set(model.state_dict())
    with torch.no_grad():
        ref_prefill, ref_decode = model(ids).logits, model(ids[:, :1]).logits
        assert qnn.group_linears(model) == 4
        assert set(model.state_dict()) == keys
        with _spied("linear_mx_grouped", lambda a: [int(c.shape[0]) for c in a[1]]) as calls:
            got_decode = model(ids[:, :1]).logits
        assert calls == [[128, 64, 64], [256, 256]] * 2
        assert torch.equal(got_decode, ref_decode)
        assert torch.equal(model(ids).logits, ref_prefill)
        seen = []

        def backend(gm, example_inputs):
            seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return gm

        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend, fullgraph=True)(ids[:, :1]).logits
        assert torch.equal(compiled, ref_decode)
        assert seen.count("quantcore.linear_mx_grouped") == 4
        qnn.ungroup_linears(model)
        assert torch.equal(model(ids[:, :1]).logits, ref_decode)


def test_group_linears_leaves_mixed_kinds_alone():
    model = _tiny_llama("nvfp4")
    attn = model.model.layers[0].self_attn
    attn.k_proj = qnn.Linear4bit.from_linear(torch.nn.Linear(128, 64), quant_type="nf4")
    assert qnn.group_linears(model) == 3  # layer 0's q / k / v (LinearFP4 and Linear4bit) left out
    assert "_qc_group" not in attn.q_proj.__dict__ and "_qc_group" not in attn.k_proj.__dict__
    assert "_qc_group" in model.model.layers[1].self_attn.q_proj.__dict__


def test_linear_mx_grouped_api_checks():
    rng = np.random.default_rng(3)
    w1, w2 = rng.standard_normal((40, 128)).astype(np.float32), rng.standard_normal((8, 64)).astype(np.float32)
    g1 = qc.nvfp4_global_scale(float(np.abs(w1).max()))
    c1, s1 = qc.scaled_nvfp4_quant(w1, g1)
    c2, s2 = qc.scaled_mxfp4_quant(w2)
    a = rng.standard_normal((2, 128)).astype(np.float32)
    with pytest.raises(qc.ParameterError, match="non-empty sequence"):
        qc.linear_mx_grouped(a, [])
    with pytest.raises(qc.ParameterError, match="tuple"):
        qc.linear_mx_grouped(a, [(c1, s1, "nvfp4")])
    with pytest.raises(qc.ShapeError, match=r"weights\[1\]"):
        qc.linear_mx_grouped(a, [(c1, s1, "nvfp4", g1), (c2, s2, "mxfp4", None)])
    with pytest.raises(qc.ParameterError, match="global_scale"):
        qc.linear_mx_grouped(a, [(c1, s1, "nvfp4", None)])
    c3, s3 = qc.scaled_mxfp4_quant(w1)
    y = qc.linear_mx_grouped(a.reshape(1, 2, 128), [(c1, s1, "nvfp4", g1), (c3, s3, "mxfp4", None)])
    want = np.concatenate([qc.linear_mx(a, c1, s1, "nvfp4", global_scale=g1),
                           qc.linear_mx(a, c3, s3, "mxfp4")], axis=-1)
    assert y.shape == (1, 2, 80) and np.array_equal(y.reshape(2, 80), want)


@needs_cuda
@pytest.mark.parametrize("swizzled", [False, True])
def test_cuda_linear_mx_grouped_matches_single_within_the_bound(swizzled):
    """linear_mx_grouped on cuda: runs of up to 4 weights of one format in one decode-gemv launch
    (6 weights of two formats, K % 64 == 0), and the per-weight path (K % 64 != 0); each column block
    within linear_mx's bound of its own weight; 1, 9 and 20 input rows."""
    from quantcore.conformance import bounds
    from quantcore.conformance.families.mx import _linear_values

    gen = torch.Generator().manual_seed(7)
    for k in (512, 544):
        fmts = ("nvfp4", "nvfp4", "mxfp4", "nvfp4", "nvfp4", "nvfp4")
        ws = [_randn(gen, n, k, device="cuda") * 0.05 for n in (48, 16, 33, 100, 7, 20)]
        items, vals = [], []
        for w, fmt in zip(ws, fmts):
            g = qc.nvfp4_global_scale(float(w.abs().max())) if fmt == "nvfp4" else None
            c, s = qc.quantize_mx(w, fmt, global_scale=g, swizzle=False, backend="cuda")
            vals.append(_linear_values(c.cpu().numpy(), s.cpu().numpy(), fmt, None if g is None else np.float32(g)))
            items.append((c, qc.swizzle_scales(s, backend="cuda") if swizzled else s, fmt, g))
        for rows, dtype in ((1, torch.bfloat16), (9, torch.bfloat16), (20, torch.bfloat16), (3, torch.float16)):
            if dtype == torch.float16 and k == 512:
                continue  # fp16 runs at K 544 only here (the decode kernel's fp16 MXFP4: tests/test_cuda_mx.py)
            a = _randn(gen, rows, k, dtype=dtype, device="cuda")
            y = qc.linear_mx_grouped(a, items, swizzled=swizzled, backend="cuda")
            assert y.shape == (rows, sum(w.shape[0] for w in ws))
            col = 0
            for v in vals:
                n = v.shape[0]
                ref, bound = bounds.linear_mx(a.double().cpu().numpy(), v, str(dtype).split(".")[1])
                err = y[:, col:col + n].double().cpu().numpy() - ref
                assert (abs(err) <= bound.max_abs).all(), (k, rows, dtype, col)
                col += n


@needs_cuda
def test_cuda_grouped_linear4bit_runs_alone_eagerly_and_grouped_when_captured(gen):
    """On a CUDA device an eager grouped Linear4bit call runs each member alone (its launch bound to its
    tensors: less host time than the grouped op), with the ungrouped members' bits; calls captured in
    a CUDA graph run the grouped op (its kernel may split K otherwise: close, not equal)."""
    parent = torch.nn.Module()
    for name, n in (("q_proj", 256), ("k_proj", 64), ("v_proj", 64)):
        lin = _linear(gen, 512, n, dtype=torch.bfloat16, bias=False, device="cuda")
        setattr(parent, name, qnn.Linear4bit.from_linear(lin))
    members = (parent.q_proj, parent.k_proj, parent.v_proj)
    x = _randn(gen, 1, 512, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        ref = [m(x) for m in members]
        assert qnn.group_linears(parent) == 1
        with _spied("gemv_4bit_grouped", lambda a: a[6]) as calls:
            eager = [m(x) for m in members]
        assert calls == [] and all(torch.equal(e, r) for e, r in zip(eager, ref))
        parent.q_proj._qc_group._compute(x)  # (the grouped kernel loaded outside the capture)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with _spied("gemv_4bit_grouped", lambda a: a[6]) as calls, torch.cuda.graph(graph):
            captured = [m(x) for m in members]
        graph.replay()
        torch.cuda.synchronize()
    assert calls == [[256, 64, 64]]
    for c, r in zip(captured, ref):
        assert torch.allclose(c.float(), r.float(), rtol=2e-2, atol=2e-2)


@needs_cuda
def test_cuda_grouped_gemv_matches_single_gemvs_within_the_bound():
    from quantcore.conformance import bounds

    gen = torch.Generator().manual_seed(5)
    for rows, dtype in ((1, torch.bfloat16), (9, torch.float16), (20, torch.bfloat16)):
        ws = [_randn(gen, n, 512, device="cuda") * 0.05 for n in (48, 16, 33, 100, 7)]  # 5 weights: 2 launches
        qs = [qct.quantize_4bit(w, 64, "nf4", True) for w in ws]
        a = _randn(gen, rows, 512, dtype=dtype, device="cuda")
        y = qc.gemv_4bit_grouped(a, qs, backend="cuda")
        col = 0
        for (p, st), w in zip(qs, ws):
            n = w.shape[0]
            wdq = qc.dequantize_4bit(p, st, "float32", backend="cuda").double().cpu().numpy()
            ref, bound = bounds.gemv_4bit(a.double().cpu().numpy(), wdq, str(dtype).split(".")[1])
            err = (y[:, col:col + n].double().cpu().numpy() - ref)
            assert (abs(err) <= bound.max_abs).all()
            col += n



@needs_cuda
def test_cuda_linear_path_in_a_graph_capture(gen):
    """On the wgmma GEMM's device, a small weight's 512-row call takes the GEMM eagerly and dequantize +
    matmul while the stream is being captured; the captured op's replay gives what its eager run of the
    same path gives (dequantize + matmul: the same kernels)."""
    from quantcore.backends.cuda import runtime as rt

    if rt.device_arch(torch.cuda.current_device()) != 90:
        pytest.skip("the eager rule differs from the captured one only with the wgmma GEMM (compute capability 9.0)")
    be = qc.get_backend("cuda")
    dev = torch.device("cuda", torch.cuda.current_device())
    assert qct.linear_path(512, backend=be, device=dev, k=4096, n=1024) == "gemv"
    mod = qnn.Linear4bit.from_linear(_linear(gen, 4096, 1024, dtype=torch.bfloat16, device="cuda"))
    x = _randn(gen, 512, 4096, dtype=torch.bfloat16, device="cuda")
    op = torch.ops.quantcore.linear_4bit
    args = (*mod._state_args(), 1024, 4096, mod.blocksize, mod.quant_type, None)
    with torch.no_grad():
        want = torch.nn.functional.linear(x, mod.dequantize())  # the dequantize + matmul path's bits
        op(x, *args)  # warm-up outside the capture (kernels loaded, plans made)
        torch.cuda.synchronize()
        graph, paths = torch.cuda.CUDAGraph(), []
        with torch.cuda.graph(graph):
            paths.append(qct.linear_path(512, backend=be, device=dev, k=4096, n=1024))
            y = op(x, *args)
        graph.replay()
        torch.cuda.synchronize()
    assert paths == ["dequantize+matmul"] and torch.equal(y, want)
