"""The transformers quantizer behind :class:`~quantcore.hf.QuantcoreConfig`.

Quantize on load (``pre_quantized`` False): the model is built with its ``nn.Linear`` layers;
transformers' loader hands each target layer's float weight to :class:`QuantizeOnLoad`, which
replaces the layer by its quantcore module on the weight's device, one layer at a time (the float
model never exists whole).

Load a quantized checkpoint (``pre_quantized`` True): q4_0 / nvfp4 / mxfp4 layers become empty
quantcore modules whose tensors are plain parameters that load by name. nf4 / fp4 tensors use
bitsandbytes' keys (``weight`` and ``weight.absmax``, ``weight.quant_state.bitsandbytes__nf4`` ...),
which name no parameter: the layers stay ``nn.Linear`` while loading, and a weight converter
collects each layer's keys for :class:`Deserialize4bit`, which replaces the layer by the
:class:`quantcore.nn.Linear4bit` they make. The checkpoint decides: a layer with statistics becomes
a Linear4bit, one stored in float stays an ``nn.Linear``, so a bitsandbytes save loads layer for
layer whatever skip list made it.

The hooks used are transformers' quantizer interface (``_process_model_before/after_weight_loading``,
``param_needs_quantization``, ``get_quantize_ops``, ``get_weight_conversions``); the loading ops
subclass ``transformers.core_model_loading.ConversionOps`` and are called as transformers 5.17 to
5.24 call them. Where an op did not run, the after-load hook quantizes what is left.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch import nn
from transformers.quantizers import HfQuantizer
from transformers.utils import logging

from .. import nn as qnn
from ..errors import ShapeError, StateError, UnsupportedError
from ..formats import ggml, mx
from ..state import QuantState
from .config import FIXED_BLOCKSIZE, FORMATS_4BIT, QuantcoreConfig

try:  # transformers 5.x's loading pipeline
    from transformers.core_model_loading import ConversionOps, WeightConverter
except ImportError:  # pragma: no cover - without it, quantize-on-load falls back to after loading
    ConversionOps, WeightConverter = object, None

logger = logging.get_logger(__name__)

#: bitsandbytes' 4-bit keys beside ``weight``. Longest first: transformers 5.17 takes the first
#: pattern that matches, and "weight" alone would also match "weight.absmax"
_BNB_KEYS = ("weight.quant_state.bitsandbytes__nf4", "weight.quant_state.bitsandbytes__fp4",
             "weight.nested_quant_map", "weight.nested_absmax", "weight.quant_map", "weight.absmax")

_QUANTCORE_MODULES = (qnn.Linear4bit, qnn.LinearQ4_0, qnn.LinearFP4)


def matches(name: str, pattern: str) -> bool:
    """True when ``pattern`` equals a run of ``name``'s dotted parts or matches it as a glob."""
    return f".{pattern}." in f".{name}." or fnmatch.fnmatchcase(name, pattern)


def _bytes_per_weight(fmt: str, blocksize: int) -> float:
    if fmt in FORMATS_4BIT:
        return 0.5 + 1 / blocksize  # an 8-bit (nested) or 32-bit absmax per block, ~1 byte
    if fmt == "q4_0":
        return ggml.BLOCK_BYTES["q4_0"] / ggml.QK
    return 0.5 + 1 / mx.block_size(fmt)


class _LoaderOp(ConversionOps):
    def __init__(self, hf_quantizer: QuantcoreHfQuantizer):
        # the attribute's presence also tells transformers 5.24 (get_new_dtype) that this op reads
        # the tensors as they are stored
        self.hf_quantizer = hf_quantizer

    def __deepcopy__(self, memo: dict) -> _LoaderOp:
        # the loader deep-copies a converter for each layer; the quantizer the copies report to
        # (and that collects the layers' statistics) must stay the one
        return type(self)(self.hf_quantizer)


class QuantizeOnLoad(_LoaderOp):
    """Loader op: a target layer's float weight -> its quantcore module (replacing the layer)."""

    def convert(self, input_dict: dict, model=None, missing_keys=None, **kwargs) -> dict:
        out = {}
        for name, value in input_dict.items():
            value = value[0] if isinstance(value, list) else value
            out.update(self.hf_quantizer.quantize_weight(model, name, value, missing_keys))
        return out


class Deserialize4bit(_LoaderOp):
    """Loader op: one layer's ``weight`` and bitsandbytes statistics -> a Linear4bit (replacing
    the layer); a ``weight`` without statistics passes through."""

    def convert(self, input_dict: dict, model=None, full_layer_name: str | None = None, **kwargs) -> dict:
        tensors = {k: v[0] if isinstance(v, list) else v for k, v in input_dict.items()}
        weight = tensors.pop("weight", None)
        if weight is None:
            raise StateError(f"{full_layer_name}: the checkpoint has 4-bit statistics but no weight")
        return {full_layer_name: self.hf_quantizer.load_weight(model, full_layer_name, weight, tensors)}


class QuantcoreHfQuantizer(HfQuantizer):
    """transformers quantizer for ``quant_method="quantcore"`` (see the module docstring)."""

    requires_calibration = False
    quantization_config: QuantcoreConfig

    def __init__(self, quantization_config: QuantcoreConfig, **kwargs: Any):
        super().__init__(quantization_config, **kwargs)
        self.modules_to_not_convert: list[str] = []
        self.targets: set[str] = set()  # qualified names of the nn.Linear layers to quantize
        self.fp32_modules: list[str] = []
        # Linear4bit statistics by layer, in bitsandbytes' keys ("weight.absmax" ...): transformers
        # empties every non-persistent buffer after loading, and these are put back after that
        self._stats: dict[str, dict[str, torch.Tensor]] = {}

    # -- checks ---------------------------------------------------------------------------------
    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        self.quantization_config.post_init()
        device_map = kwargs.get("device_map")
        places = set(device_map.values()) if isinstance(device_map, dict) else set()
        if places - {"cpu"} and places & {"cpu", "disk"}:
            raise UnsupportedError(f"device_map offloads layers to {sorted(places & {'cpu', 'disk'})}: accelerate "
                                   "offloads parameters only, and a Linear4bit's statistics are buffers")

    def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return True  # adapters (LoRA) train on top: gradients reach the input and the bias

    def param_element_size(self, model, param_name: str, param: torch.Tensor) -> float:
        if self.param_needs_quantization(model, param_name):
            cfg = self.quantization_config
            return _bytes_per_weight(cfg.fmt, cfg.blocksize)
        return super().param_element_size(model, param_name, param)

    # -- which layers -----------------------------------------------------------------------------
    def _choose_targets(self, model) -> set[str]:
        cfg = self.quantization_config
        loose = list(getattr(model, "_keep_in_fp32_modules", None) or [])
        strict = list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
        self.modules_to_not_convert = self.get_modules_to_not_convert(model, cfg.modules_to_not_convert,
                                                                      loose + strict)
        # transformers' dtype plan: the layers it loads in float32 although the model loads in
        # 16 bits (the model is still on the meta device, in the dtype it loads in)
        dtype = model.dtype
        self.fp32_modules = (strict if dtype in (torch.float16, torch.bfloat16) else []) + \
            (loose if dtype == torch.float16 else [])
        blk = FIXED_BLOCKSIZE.get(cfg.fmt, 1)
        targets, unfit = set(), []
        for name, module in model.named_modules():
            if type(module) is not nn.Linear or any(matches(name, p) for p in self.modules_to_not_convert):
                continue
            if module.in_features % blk:
                unfit.append(name)
            else:
                targets.add(name)
        if unfit:
            shown = ", ".join(unfit[:4]) + (", ..." if len(unfit) > 4 else "")
            logger.warning(f"quantcore {cfg.fmt} needs in_features to be a multiple of {blk}: "
                           f"{len(unfit)} layer(s) stay in float ({shown})")
        return targets

    def param_needs_quantization(self, model, param_name: str, **kwargs: Any) -> bool:
        module_name, _, attr = param_name.rpartition(".")
        return not self.pre_quantized and attr == "weight" and module_name in self.targets

    # -- before loading -------------------------------------------------------------------------
    def _process_model_before_weight_loading(self, model, **kwargs: Any):
        self.targets = self._choose_targets(model)
        if self.pre_quantized and self.quantization_config.fmt not in FORMATS_4BIT:
            for name in self.targets:
                model.set_submodule(name, self._empty(model.get_submodule(name)))
        return model

    def _empty(self, linear: nn.Linear) -> nn.Module:
        cfg = self.quantization_config
        args = (linear.in_features, linear.out_features, linear.bias is not None)
        if cfg.fmt == "q4_0":
            return qnn.LinearQ4_0(*args, device="meta", dtype=linear.weight.dtype)
        return qnn.LinearFP4(*args, fmt=cfg.fmt, device="meta", dtype=linear.weight.dtype)

    # -- loading ops -------------------------------------------------------------------------------
    def get_quantize_ops(self) -> QuantizeOnLoad:
        return QuantizeOnLoad(self)

    def get_weight_conversions(self) -> list:
        if not self.pre_quantized or self.quantization_config.fmt not in FORMATS_4BIT or WeightConverter is None:
            return []
        return [WeightConverter(source_patterns=[*_BNB_KEYS, "weight"], target_patterns="weight",
                                operations=[Deserialize4bit(self)])]

    def _from_linear(self, linear: nn.Linear) -> nn.Module:
        cfg = self.quantization_config
        if cfg.fmt in FORMATS_4BIT:
            return qnn.Linear4bit.from_linear(linear, quant_type=cfg.fmt, blocksize=cfg.blocksize,
                                              compress_statistics=cfg.compress_statistics,
                                              compute_dtype=cfg.torch_compute_dtype)
        if cfg.fmt == "q4_0":
            return qnn.LinearQ4_0.from_linear(linear)
        return qnn.LinearFP4.from_linear(linear, fmt=cfg.fmt)

    def _replace(self, model, module_name: str, old: nn.Module, new: nn.Module) -> nn.Module:
        if getattr(old, "bias", None) is not None:
            # loaded already, or (still on meta) loaded onto the new module afterwards
            new.bias = old.bias
        new._is_hf_initialized = True  # keeps transformers' weight init away from it
        model.set_submodule(module_name, new)
        return new

    def quantize_weight(self, model, name: str, value: torch.Tensor, missing_keys=None) -> dict:
        """Quantize the float ``value`` of ``name`` ("<layer>.weight"): the layer becomes its
        quantcore module; returns that module's tensors by qualified name, for the loader."""
        module_name = name.rpartition(".")[0]
        old = model.get_submodule(module_name)
        with torch.device("meta"):
            linear = nn.Linear(old.in_features, old.out_features, bias=False)
        linear.weight = nn.Parameter(value, requires_grad=False)
        new = self._replace(model, module_name, old, self._from_linear(linear))
        if isinstance(new, qnn.Linear4bit):
            self._stats[module_name] = {k: v for k, v in new.state_dict().items() if k.startswith("weight.")}
        if missing_keys is not None:
            missing_keys.discard(name)  # LinearFP4 names its codes weight_packed
        return {f"{module_name}.{p}": t for p, t in new.named_parameters(recurse=False) if p != "bias"}

    def load_weight(self, model, name: str, weight: torch.Tensor, stats: dict) -> torch.Tensor:
        """The tensor the loader should set as ``name``: with bitsandbytes ``stats`` (keys
        "weight.absmax" ...) the ``nn.Linear`` that ``name`` is the weight of becomes a Linear4bit
        holding them and the packed ``weight``; without, ``weight`` is a float tensor of the model's."""
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        if not stats:
            ref = getattr(module, attr, None)
            if isinstance(ref, torch.Tensor) and ref.is_floating_point() and weight.is_floating_point():
                # transformers 5.24 leaves the tensors of a quantizer's converter in their stored dtype
                keep32 = any(matches(module_name, p) for p in self.fp32_modules)
                return weight.to(torch.float32 if keep32 else ref.dtype)
            return weight
        if type(module) is not nn.Linear:
            raise StateError(f"{module_name}: the checkpoint has 4-bit statistics for a "
                             f"{type(module).__name__}, not a torch.nn.Linear")
        state = QuantState.from_dict(stats)
        if tuple(state.shape) != (module.out_features, module.in_features):
            raise ShapeError(f"{module_name}: the checkpoint's 4-bit weight has shape {tuple(state.shape)}, "
                             f"the model's layer ({module.out_features}, {module.in_features})")
        new = qnn.Linear4bit(module.in_features, module.out_features, module.bias is not None,
                             compute_dtype=self.quantization_config.torch_compute_dtype,
                             compress_statistics=state.nested, quant_type=state.quant_type,
                             blocksize=state.blocksize, device="meta", dtype=module.weight.dtype)
        sd = {"weight": weight, **stats}
        if module.bias is not None and not module.bias.is_meta:
            sd["bias"] = module.bias
        result = new.load_state_dict(sd, strict=False, assign=True)
        if result.unexpected_keys:
            raise StateError(f"{module_name}: unexpected 4-bit keys {result.unexpected_keys}")
        self._replace(model, module_name, module, new)
        self._stats[module_name] = stats
        return new.weight

    # -- after loading ----------------------------------------------------------------------------
    def _process_model_after_weight_loading(self, model, **kwargs: Any):
        for name in sorted(self.targets) if not self.pre_quantized else ():
            module = model.get_submodule(name)
            if type(module) is nn.Linear:  # the loader did not call the quantize op (another transformers)
                self._replace(model, name, module, self._from_linear(module))
        for name, stats in self._stats.items():
            module = model.get_submodule(name)
            module.load_state_dict({"weight": module.weight, **stats}, strict=False)
        self._stats.clear()
        # transformers would reverse the weight converter when saving (and fail: it has no reverse);
        # the modules' state dicts already have bitsandbytes' keys
        conversions = getattr(model, "_weight_conversions", None)
        if conversions:
            model._weight_conversions = [c for c in conversions if not any(
                isinstance(op, Deserialize4bit) for op in getattr(c, "operations", ()))]
        return model

    def _dequantize(self, model, dtype=None):
        if isinstance(dtype, str):  # transformers passes config.dtype, which may be a name
            dtype = getattr(torch, dtype)
        for name, module in list(model.named_modules()):
            if not isinstance(module, _QUANTCORE_MODULES):
                continue
            w = module.dequantize(dtype) if dtype is not None else module.dequantize()
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                               device=w.device, dtype=w.dtype)
            with torch.no_grad():
                linear.weight.copy_(w)
                if module.bias is not None:
                    linear.bias.copy_(module.bias)
            model.set_submodule(name, linear)
        return model


__all__ = ["Deserialize4bit", "QuantcoreHfQuantizer", "QuantizeOnLoad", "matches"]
