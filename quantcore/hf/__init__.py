"""transformers integration: quantize a model's linear layers on load, save it, load it back, and
load checkpoints that transformers + bitsandbytes saved.

Importing this module registers ``quant_method="quantcore"`` with transformers' quantizer plugin
API (``register_quantization_config`` / ``register_quantizer``); importing it again is harmless::

    from transformers import AutoModelForCausalLM
    import quantcore.hf
    from quantcore.hf import QuantcoreConfig

    # quantize on load: nn.Linear -> quantcore.nn modules, one layer at a time (lm_head stays float)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=QuantcoreConfig(fmt="nf4"))
    model.save_pretrained(out)              # config.json carries quant_method "quantcore"
    model = AutoModelForCausalLM.from_pretrained(out)   # after `import quantcore.hf`

    # a checkpoint saved by transformers + bitsandbytes (load_in_4bit, nf4 / fp4), bit for bit
    model = quantcore.hf.from_bnb_pretrained(bnb_dir)

fmt "nf4" / "fp4" give :class:`quantcore.nn.Linear4bit`, whose tensors use bitsandbytes' keys
(``weight``, ``weight.absmax``, ``weight.quant_map``, ``weight.nested_absmax``,
``weight.nested_quant_map``, ``weight.quant_state.bitsandbytes__nf4``); "q4_0" gives
:class:`quantcore.nn.LinearQ4_0` and "nvfp4" / "mxfp4" :class:`quantcore.nn.LinearFP4`.

transformers keeps a checkpoint's own quantization config: ``from_pretrained(bnb_dir,
quantization_config=QuantcoreConfig(...))`` is refused by transformers ("The model is quantized
with BitsAndBytesConfig but you are passing a QuantcoreConfig"), hence :func:`from_bnb_pretrained`,
which swaps the config before loading. Needs torch and transformers >= 5.17.
"""

from __future__ import annotations

import copy
from typing import Any

from ..errors import ParameterError, StateError, UnsupportedError
from .config import FORMATS, QUANT_METHOD, QuantcoreConfig
from .quantizer import QuantcoreHfQuantizer

#: from_pretrained's keyword arguments that also locate the config
_CONFIG_KWARGS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder", "token",
                  "trust_remote_code")


def register() -> None:
    """Register ``quant_method="quantcore"`` with transformers (done on import; safe to repeat)."""
    from transformers.quantizers import auto, register_quantization_config, register_quantizer

    for table, register_fn, cls in (
        (getattr(auto, "AUTO_QUANTIZATION_CONFIG_MAPPING", {}), register_quantization_config, QuantcoreConfig),
        (getattr(auto, "AUTO_QUANTIZER_MAPPING", {}), register_quantizer, QuantcoreHfQuantizer),
    ):
        current = table.get(QUANT_METHOD)
        if current is None:
            register_fn(QUANT_METHOD)(cls)
        elif current is not cls:
            if (current.__module__, current.__qualname__) != (cls.__module__, cls.__qualname__):
                raise UnsupportedError(f"transformers already has quant_method {QUANT_METHOD!r} from "
                                       f"{current.__module__}.{current.__qualname__}")
            # this module was imported again (importlib.reload): its classes replace the old ones
            table[QUANT_METHOD] = cls


def config_from_bnb(bnb_config: Any, quantization_config: QuantcoreConfig | None = None) -> QuantcoreConfig:
    """The :class:`QuantcoreConfig` that loads a checkpoint made with ``bnb_config`` (a
    ``BitsAndBytesConfig`` or its dict, as in config.json): fmt = ``bnb_4bit_quant_type``,
    compute_dtype = ``bnb_4bit_compute_dtype``, compress_statistics =
    ``bnb_4bit_use_double_quant``, modules_to_not_convert = ``llm_int8_skip_modules``.

    ``quantization_config`` (optional) overrides compute_dtype and modules_to_not_convert where it
    sets them; its fmt must be the checkpoint's. Raises :class:`quantcore.StateError` when
    ``bnb_config`` is not bitsandbytes', :class:`quantcore.UnsupportedError` for 8-bit or a
    ``bnb_4bit_quant_storage`` other than uint8.
    """
    d = bnb_config.to_dict() if hasattr(bnb_config, "to_dict") else bnb_config
    if not isinstance(d, dict) or str(getattr(d.get("quant_method"), "value", d.get("quant_method"))) != "bitsandbytes":
        raise StateError(f"not a bitsandbytes quantization_config: {bnb_config!r}")
    if not d.get("load_in_4bit", d.get("_load_in_4bit", False)):
        raise UnsupportedError("only bitsandbytes 4-bit checkpoints (load_in_4bit) load into quantcore modules; "
                               "this one is 8-bit")
    storage = str(d.get("bnb_4bit_quant_storage") or "uint8").removeprefix("torch.")
    if storage != "uint8":
        raise UnsupportedError(f"quantcore packs 4-bit weights in uint8; this checkpoint has "
                               f"bnb_4bit_quant_storage={storage}")
    fmt = d.get("bnb_4bit_quant_type", "fp4")
    compute = d.get("bnb_4bit_compute_dtype")
    skip = d.get("llm_int8_skip_modules")
    if quantization_config is not None:
        if not isinstance(quantization_config, QuantcoreConfig):
            raise ParameterError(f"quantization_config must be a QuantcoreConfig, got {type(quantization_config).__name__}")
        if quantization_config.fmt != fmt:
            raise ParameterError(f"the checkpoint is bitsandbytes {fmt}; quantization_config asks for "
                                 f"{quantization_config.fmt}")
        compute = quantization_config.compute_dtype or compute
        skip = quantization_config.modules_to_not_convert if quantization_config.modules_to_not_convert is not None \
            else skip
    compute = None if compute is None else str(compute).removeprefix("torch.")
    return QuantcoreConfig(fmt=fmt, compress_statistics=bool(d.get("bnb_4bit_use_double_quant", False)),
                           compute_dtype=compute, modules_to_not_convert=skip)


def from_bnb_pretrained(pretrained_model_name_or_path, *model_args: Any, model_class: Any = None,
                        quantization_config: QuantcoreConfig | None = None, **kwargs: Any):
    """Load a model that transformers + bitsandbytes saved in 4-bit (nf4 / fp4) onto quantcore
    modules, bit for bit: each :class:`quantcore.nn.Linear4bit` holds the checkpoint's packed
    weight and statistics as they are, so it dequantizes to bitsandbytes' values exactly.

    ``model_class``: the transformers class to load with (default ``AutoModelForCausalLM``);
    ``quantization_config``: see :func:`config_from_bnb`; the other arguments go to
    ``model_class.from_pretrained``. A directory that quantcore saved loads as it is. The model's
    config then has the quantcore quantization_config, so ``save_pretrained`` writes a checkpoint
    that ``from_pretrained`` loads (bitsandbytes' tensor keys, quant_method "quantcore").
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = kwargs.pop("config", None)
    if config is None:
        config = AutoConfig.from_pretrained(pretrained_model_name_or_path,
                                            **{k: kwargs[k] for k in _CONFIG_KWARGS if k in kwargs})
    else:
        config = copy.deepcopy(config)
    found = getattr(config, "quantization_config", None)
    found_dict = found.to_dict() if hasattr(found, "to_dict") else found
    if isinstance(found_dict, dict) and found_dict.get("quant_method") == QUANT_METHOD:
        if quantization_config is not None:
            kwargs["quantization_config"] = quantization_config
    else:
        if found is None:
            raise StateError(f"{pretrained_model_name_or_path} has no quantization_config: not a bitsandbytes "
                             "checkpoint (load a float model with from_pretrained(..., quantization_config=...))")
        config.quantization_config = config_from_bnb(found, quantization_config).to_dict()
    cls = model_class if model_class is not None else AutoModelForCausalLM
    return cls.from_pretrained(pretrained_model_name_or_path, *model_args, config=config, **kwargs)


register()

__all__ = ["FORMATS", "QUANT_METHOD", "QuantcoreConfig", "QuantcoreHfQuantizer", "config_from_bnb",
           "from_bnb_pretrained", "register"]
