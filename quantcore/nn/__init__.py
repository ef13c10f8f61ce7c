"""``torch.nn`` modules with quantcore weights: :class:`Linear4bit` (bitsandbytes NF4 / FP4),
:class:`LinearQ4_0` (ggml Q4_0, W4A8) and :class:`LinearFP4` (NVFP4 / MXFP4 weights, float
activations), and :func:`quantize_model`, which puts them into a model in place.

The modules hold plain tensors (parameters and buffers), so ``.to()``, ``.cuda()``, ``state_dict``
and ``torch.compile`` treat them as any module; their forward calls the custom ops of
:mod:`quantcore.torch` (what ``torch.compile`` and CUDA graphs see), or, for an eager call that builds
no autograd graph, the same implementation directly (no dispatcher on the hot path). Gradients flow
to the input and the bias (the quantized weight is frozen: QLoRA trains adapters on top).

State dicts use the keys the formats' ecosystems already have: :class:`Linear4bit` bitsandbytes'
(``weight``, ``weight.absmax``, ``weight.quant_map``, ``weight.nested_absmax``,
``weight.nested_quant_map``, ``weight.quant_state.bitsandbytes__nf4``), so a checkpoint of
``bnb.nn.Linear4bit`` loads into it and one it saves loads into bitsandbytes.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

import torch
from torch import nn

from .. import torch as qct
from .. import validate as v
from ..arrays import dtype_name
from ..errors import ParameterError, ShapeError, StateError, UnsupportedError
from ..formats import WEIGHT_FORMATS, bnb, ggml, mx
from ..progress import iterate
from ..state import QuantState

FORMATS_4BIT = bnb.QUANT_TYPES  # ("fp4", "nf4")
FORMATS = WEIGHT_FORMATS  # every fmt quantize_model takes
_QS_PREFIX = "weight."


def _eager(x: torch.Tensor, *params: torch.Tensor | None) -> bool:
    """True for a call that can skip the dispatcher: not traced by torch.compile, and no autograd
    graph to build."""
    if torch.compiler.is_compiling():
        return False
    if not torch.is_grad_enabled():
        return True
    return not (x.requires_grad or any(p is not None and p.requires_grad for p in params))


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _new_bias(bias: bool, n: int, device, dtype) -> nn.Parameter | None:
    return nn.Parameter(torch.zeros(n, device=device, dtype=dtype or torch.float32)) if bias else None


def _check_features(in_features: int, out_features: int) -> tuple[int, int]:
    return v.positive_int(in_features, "in_features"), v.positive_int(out_features, "out_features")


def _check_linear(linear: nn.Module) -> None:
    if not isinstance(linear, nn.Linear):
        raise ParameterError(f"from_linear takes a torch.nn.Linear, got {type(linear).__name__}")


# -- bitsandbytes 4-bit ---------------------------------------------------------------------------------
class Linear4bit(nn.Module):
    """``y = x @ W.T + b`` with W stored as bitsandbytes 4-bit (NF4 / FP4, blocks of ``blocksize``,
    absmax double-quantized when ``compress_statistics``).

    The signature follows ``bnb.nn.Linear4bit``, but ``quant_type`` defaults to "nf4" (bitsandbytes'
    module defaults to "fp4"; pass it explicitly when porting). ``weight`` is a frozen uint8
    parameter ``[(N*K+1)//2, 1]`` (bitsandbytes' packed layout); the statistics are buffers;
    :attr:`quant_state` gives them as a :class:`quantcore.QuantState`. ``compute_dtype`` (None: the
    input's) is the dtype the product runs in; the output has the input's dtype.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, compute_dtype=None,
                 compress_statistics: bool = True, quant_type: str = "nf4", blocksize: int = 64,
                 device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = _check_features(in_features, out_features)
        self.quant_type, self.blocksize = v.quant_type(quant_type), v.blocksize_4bit(blocksize)
        self.compute_dtype = compute_dtype
        self.weight_dtype = dtype_name(dtype or torch.float32)  # the dtype W had (bitsandbytes' "dtype")
        n = self.in_features * self.out_features
        self.weight = _frozen(torch.empty(((n + 1) // 2, 1), dtype=torch.uint8, device=device))
        self._empty_statistics(compress_statistics, device)
        self.bias = _new_bias(bias, self.out_features, device, dtype)

    def _empty_statistics(self, nested: bool, device) -> None:
        nb = bnb.nblocks(self.in_features * self.out_features, self.blocksize)
        f32 = torch.float32
        self.register_buffer("absmax", torch.empty(nb, dtype=torch.uint8 if nested else f32, device=device),
                             persistent=False)
        self.register_buffer("quant_map", torch.tensor(bnb.code_4bit(self.quant_type), device=device),
                             persistent=False)
        two = (torch.empty(bnb.nblocks(nb, bnb.NESTED_BLOCKSIZE), dtype=f32, device=device),
               torch.tensor(bnb.DYNAMIC_MAP, device=device), torch.zeros(1, dtype=f32, device=device))
        for name, t in zip(("nested_absmax", "nested_quant_map", "offset"), two):
            self.register_buffer(name, t if nested else None, persistent=False)

    @property
    def compress_statistics(self) -> bool:
        return self.nested_absmax is not None

    def _set_state(self, state: QuantState, device=None) -> None:
        """Take ``state``'s arrays (torch tensors) as this module's statistics, on ``device``
        (default the weight's)."""
        dev = self.weight.device if device is None else device
        if tuple(state.shape) != (self.out_features, self.in_features):
            raise ShapeError(f"the quant state is for a weight of shape {tuple(state.shape)}; this module's "
                             f"is ({self.out_features}, {self.in_features})")
        self.quant_type, self.blocksize, self.weight_dtype = state.quant_type, state.blocksize, state.dtype
        self.absmax = state.absmax.to(dev)
        self.quant_map = torch.tensor(bnb.code_4bit(state.quant_type), device=dev)
        if state.nested:
            self.nested_absmax = state.state2.absmax.to(dev)
            # a copy per module: the quantizer's table is shared, and checkpoint writers refuse
            # tensors that alias each other
            self.nested_quant_map = state.state2.code.to(dev, torch.float32, copy=True)
            self.offset = state.offset.reshape(1).to(dev, torch.float32)
        else:
            self.nested_absmax = self.nested_quant_map = self.offset = None

    @property
    def quant_state(self) -> QuantState:
        """This weight's :class:`QuantState` (torch tensors on the module's device; the same object
        while the tensors are, so the backend's launch plans kept on it are reused)."""
        return self._state_and_tensors()[0]

    def _state_and_tensors(self) -> tuple[QuantState, tuple]:
        tensors = self._state_args()
        key = (tuple(map(id, tensors)), self.blocksize, self.quant_type, self.weight_dtype)
        cached = self.__dict__.get("_state_cache")
        if cached is not None and cached[0] == key:
            return cached[1], tensors
        state = qct.state_of(*tensors, (self.out_features, self.in_features), self.blocksize, self.quant_type,
                             self.weight_dtype)
        # no tensor is kept in the key (ids only); the state holds the statistics, not the weight
        self.__dict__["_state_cache"] = (key, state)
        return state, tensors

    @classmethod
    def from_linear(cls, linear: nn.Linear, quant_type: str = "nf4", blocksize: int = 64,
                    compress_statistics: bool = True, compute_dtype=None) -> Linear4bit:
        """Quantize ``linear`` (on its device) into a new module; the bias is kept as it is."""
        _check_linear(linear)
        w = linear.weight.detach()
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None, compute_dtype,
                  compress_statistics, quant_type, blocksize, device="meta", dtype=w.dtype)
        packed, state = qct.quantize_4bit(w.contiguous(), blocksize, quant_type, compress_statistics)
        mod.weight = _frozen(packed)
        mod._set_state(state)
        if linear.bias is not None:
            mod.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
        return mod

    def dequantize(self, dtype=None) -> torch.Tensor:
        """The weight ``[out_features, in_features]`` in ``dtype`` (default the dtype it had)."""
        dt = dtype or getattr(torch, self.weight_dtype)
        return torch.ops.quantcore.dequantize_4bit(*self._state_args(), [self.out_features, self.in_features],
                                                   self.blocksize, self.quant_type, dt)

    def _state_args(self) -> tuple:
        # the dicts directly: nn.Module.__getattr__ costs ~0.4 us a name on the eager hot path
        p, b = self._parameters, self._buffers
        return p["weight"], b["absmax"], b["nested_absmax"], b["nested_quant_map"], b["offset"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.__dict__.get("_qc_group")  # quantcore.nn.group_linears
        if group is not None:
            y = group.forward(self, x)
            if y is not None:
                return y
        inp = x if self.compute_dtype is None else x.to(self.compute_dtype)
        bias = self._parameters.get("bias")  # absent when built without a bias
        if _eager(x, bias):
            bound = self.__dict__.get("_bound")  # the last eager gemv's launch, bound to this module
            y = bound(inp) if bound is not None else None
            if y is not None:
                y = qct.add_bias(y, bias)  # as linear_4bit_eager's gemv path adds it
            else:
                state, tensors = self._state_and_tensors()
                y = qct.linear_4bit_eager(inp, *tensors, self.out_features, self.in_features, self.blocksize,
                                          self.quant_type, bias, state=state)
                self.__dict__["_bound"] = qct.bind_linear_4bit(inp, tensors[0], state)
        else:
            y = torch.ops.quantcore.linear_4bit(inp, *self._state_args(), self.out_features, self.in_features,
                                                self.blocksize, self.quant_type, bias)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    # bitsandbytes' checkpoint keys
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        entries = self.quant_state.as_dict(packed=True)
        entries["quant_map"] = self.quant_map  # the module's own table (the state's is shared)
        for key, t in entries.items():
            destination[prefix + _QS_PREFIX + key] = t if keep_vars else t.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        mine = {k[len(prefix) + len(_QS_PREFIX):]: v for k, v in state_dict.items()
                if k.startswith(prefix + _QS_PREFIX)}
        if mine:
            try:
                state = QuantState.from_dict(mine)
                # the statistics go where the weight will be: the incoming weight's device when it
                # is assigned (load_state_dict(assign=True), as from a meta-device module)
                incoming = state_dict.get(prefix + "weight")
                assign = local_metadata.get("assign_to_params_buffers", False)
                self._set_state(state, incoming.device if assign and incoming is not None else None)
            except (StateError, ShapeError, UnsupportedError, ParameterError) as exc:
                error_msgs.append(f"{prefix}weight: {exc}")
        elif strict and prefix + "weight" in state_dict:
            missing_keys.append(prefix + _QS_PREFIX + "quant_state.bitsandbytes__" + self.quant_type)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        extra = {prefix + _QS_PREFIX + k for k in mine}
        unexpected_keys[:] = [k for k in unexpected_keys if k not in extra]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"quant_type={self.quant_type}, blocksize={self.blocksize}, "
                f"compress_statistics={self.compress_statistics}")


# -- ggml Q4_0 --------------------------------------------------------------------------------------------
class LinearQ4_0(nn.Module):
    """``y = x @ W.T + b`` with W stored as ggml Q4_0 blocks: ``weight`` uint8 ``[N, K/32, 18]``
    (ggml's bytes, as in a GGUF file). Up to 8 rows the activation is quantized to Q8_1 inside the
    W4A8 kernel (llama.cpp's arithmetic); more rows dequantize W and use torch's matmul."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__()
        _check_features(in_features, out_features)
        if in_features % ggml.QK:
            raise ShapeError(f"Q4_0 needs in_features to be a multiple of {ggml.QK}, got {in_features}")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.weight = _frozen(torch.empty((self.out_features, self.in_features // ggml.QK,
                                           ggml.BLOCK_BYTES["q4_0"]), dtype=torch.uint8, device=device))
        self.bias = _new_bias(bias, self.out_features, device, dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> LinearQ4_0:
        """Quantize ``linear`` (on its device) to Q4_0 exactly as ggml's reference does."""
        _check_linear(linear)
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None, device="meta")
        mod.weight = _frozen(torch.ops.quantcore.quantize_q4_0(linear.weight.detach().contiguous()))
        if linear.bias is not None:
            mod.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
        return mod

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return torch.ops.quantcore.dequantize_q4_0(self.weight, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self._parameters.get("bias")
        if _eager(x, bias):
            bound = self.__dict__.get("_bound")  # the last eager W4A8 launch, bound to this weight
            y = bound(x) if bound is not None else None
            if y is not None:
                return y if bias is None else qct.add_bias(y, bias)
            weight = self._parameters["weight"]
            y = qct.linear_q4_0_eager(x, weight, bias)
            self.__dict__["_bound"] = qct.bind_linear_q4_0(x, weight)
            return y
        return torch.ops.quantcore.linear_q4_0(x, self.weight, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


# -- NVFP4 / MXFP4 ------------------------------------------------------------------------------------------
class LinearFP4(nn.Module):
    """``y = x @ W.T + b`` with W stored as NVFP4 or MXFP4 and float activations (weight-only).

    Tensors, named as compressed-tensors names them: ``weight_packed`` uint8 ``[N, K/2]`` (E2M1
    codes, element 2i in the low nibble), ``weight_scale`` uint8 ``[N, K/blk]`` (row-major E4M3
    bytes for nvfp4, blk 16; E8M0 for mxfp4, blk 32), ``weight_global_scale`` float32 ``[1]``
    (nvfp4: ``2688 / amax(W)``; W = e2m1 * scale / global_scale)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, fmt: str = "nvfp4",
                 device=None, dtype=None):
        super().__init__()
        _check_features(in_features, out_features)
        fmt = v.mx_format(fmt, mx.FP4_FORMATS)
        blk = mx.block_size(fmt)
        if in_features % blk:
            raise ShapeError(f"{fmt} needs in_features to be a multiple of {blk}, got {in_features}")
        self.in_features, self.out_features, self.fmt = int(in_features), int(out_features), fmt
        u8 = torch.uint8
        self.weight_packed = _frozen(torch.empty((self.out_features, self.in_features // 2), dtype=u8,
                                                 device=device))
        self.weight_scale = _frozen(torch.empty((self.out_features, self.in_features // blk), dtype=u8,
                                                device=device))
        gs = torch.ones(1, dtype=torch.float32, device=device) if fmt == "nvfp4" else None
        self.weight_global_scale = None if gs is None else _frozen(gs)
        self.bias = _new_bias(bias, self.out_features, device, dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The packed codes (``weight_packed``), for code that asks a layer for its weight's device."""
        return self.weight_packed

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str = "nvfp4") -> LinearFP4:
        """Quantize ``linear`` (on its device): NVFP4 with the global scale ``2688 / amax(W)``, MXFP4
        with floor scales (OCP, torchao's default)."""
        _check_linear(linear)
        w = linear.weight.detach().contiguous()
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None, fmt, device="meta")
        gs = None
        if fmt == "nvfp4":
            # ParameterError for a weight holding Inf / NaN or only zeros (no NVFP4 global scale)
            gs = torch.tensor([float(mx.nvfp4_global_scale(float(w.abs().max())))], dtype=torch.float32,
                              device=w.device)
        codes, scales = torch.ops.quantcore.quantize_mx(w, fmt, "floor", gs, False)
        mod.weight_packed, mod.weight_scale = _frozen(codes), _frozen(scales)
        mod.weight_global_scale = None if gs is None else _frozen(gs)
        if linear.bias is not None:
            mod.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
        return mod

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return torch.ops.quantcore.dequantize_mx(self.weight_packed, self.weight_scale, self.fmt, dtype,
                                                 self.weight_global_scale, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.__dict__.get("_qc_group")  # quantcore.nn.group_linears
        if group is not None:
            y = group.forward(self, x)
            if y is not None:
                return y
        args = (x, self.weight_packed, self.weight_scale, self.weight_global_scale, self.fmt, self.bias)
        if _eager(x, self.bias):
            return qct.linear_fp4_eager(*args)
        return torch.ops.quantcore.linear_fp4(*args)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"fmt={self.fmt}")


# -- putting them into a model -----------------------------------------------------------------------------
def _skipped(name: str, skip: Iterable[str]) -> bool:
    parts = name.split(".")
    return any(p in parts or fnmatch.fnmatchcase(name, p) for p in skip)


def _convert(linear: nn.Linear, fmt: str, blocksize: int, compress_statistics: bool, compute_dtype) -> nn.Module:
    if fmt in FORMATS_4BIT:
        return Linear4bit.from_linear(linear, fmt, blocksize, compress_statistics, compute_dtype)
    if fmt == "q4_0":
        return LinearQ4_0.from_linear(linear)
    return LinearFP4.from_linear(linear, fmt)


def _empty(linear: nn.Linear, fmt: str, blocksize: int, compress_statistics: bool, compute_dtype,
           device) -> nn.Module:
    args = (linear.in_features, linear.out_features, linear.bias is not None)
    dt = linear.weight.dtype
    if fmt in FORMATS_4BIT:
        return Linear4bit(*args, compute_dtype, compress_statistics, fmt, blocksize, device=device, dtype=dt)
    if fmt == "q4_0":
        return LinearQ4_0(*args, device=device, dtype=dt)
    return LinearFP4(*args, fmt, device=device, dtype=dt)


def _targets(model: nn.Module, skip: Iterable[str]) -> list[tuple[nn.Module, str, str, nn.Linear]]:
    out = []
    for pname, parent in model.named_modules():
        for cname, child in parent.named_children():
            full = f"{pname}.{cname}" if pname else cname
            if type(child) is nn.Linear and not _skipped(full, skip):
                out.append((parent, cname, full, child))
    return out


def _check_fmt(fmt: str, skip) -> tuple[str, ...]:
    v.choice(fmt, FORMATS, "fmt")
    if isinstance(skip, str):
        skip = (skip,)
    return tuple(skip or ())


def quantize_model(model: nn.Module, fmt: str = "nf4", skip: Iterable[str] = ("lm_head",), *,
                   blocksize: int = 64, compress_statistics: bool = True, compute_dtype=None,
                   progress: bool = True) -> nn.Module:
    """Replace every ``torch.nn.Linear`` of ``model`` in place by its quantcore module, quantized on
    the layer's device: :class:`Linear4bit` for "nf4" / "fp4", :class:`LinearQ4_0` for "q4_0",
    :class:`LinearFP4` for "nvfp4" / "mxfp4". Layers whose qualified name has a component equal to a
    ``skip`` entry, or matches it as a glob (``"*.mlp.*"``), stay as they are (default: ``lm_head``,
    as transformers' bitsandbytes path keeps the output layer). Shows a progress bar (tqdm where
    installed) unless ``progress=False``. Returns ``model``."""
    skip = _check_fmt(fmt, skip)
    targets = _targets(model, skip)
    for parent, cname, _full, child in iterate(targets, f"quantcore {fmt}", progress, unit="layer"):
        setattr(parent, cname, _convert(child, fmt, blocksize, compress_statistics, compute_dtype))
        del child
    return model


def replace_linear(model: nn.Module, fmt: str = "nf4", skip: Iterable[str] = ("lm_head",), *,
                   blocksize: int = 64, compress_statistics: bool = True, compute_dtype=None,
                   device=None) -> nn.Module:
    """Like :func:`quantize_model`, but with empty modules (on ``device``, default each layer's own,
    which may be "meta"), for loading quantized weights into afterwards. Returns ``model``."""
    skip = _check_fmt(fmt, skip)
    for parent, cname, _full, child in _targets(model, skip):
        dev = device if device is not None else child.weight.device
        setattr(parent, cname, _empty(child, fmt, blocksize, compress_statistics, compute_dtype, dev))
    return model


def quantized_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The (name, module) pairs of ``model``'s quantcore modules."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (Linear4bit, LinearQ4_0, LinearFP4))]


__all__ = ["FORMATS", "Linear4bit", "LinearFP4", "LinearGroup", "LinearQ4_0", "group_linears", "quantize_model",
           "quantized_modules", "ungroup_linears",
           "replace_linear"]

from .grouped import LinearGroup, group_linears, ungroup_linears  # noqa: E402
