"""``QuantcoreConfig``: the ``quantization_config`` of quantcore's transformers quantizer.

Importable without torch (transformers' config classes do not need it); the quantizer that acts on
it is :mod:`quantcore.hf.quantizer`.
"""

from __future__ import annotations

from typing import Any

from ..errors import DTypeError, ParameterError
from ..formats import WEIGHT_FORMATS, bnb, ggml, mx

try:
    from transformers.utils.quantization_config import QuantizationConfigMixin
except ImportError as exc:  # pragma: no cover - the package's import guard tells the user
    raise ImportError("quantcore.hf needs transformers>=5.17 (pip install 'transformers>=5.17')") from exc

#: the ``quant_method`` quantcore registers with transformers (and writes into config.json)
QUANT_METHOD = "quantcore"
FORMATS = WEIGHT_FORMATS
FORMATS_4BIT = bnb.QUANT_TYPES
#: the block size of the formats that fix theirs (nf4 / fp4 take any of bnb.BLOCKSIZES_4BIT)
FIXED_BLOCKSIZE = {"q4_0": ggml.QK, "nvfp4": mx.block_size("nvfp4"), "mxfp4": mx.block_size("mxfp4")}
COMPUTE_DTYPES = ("float32", "float16", "bfloat16")
DEFAULT_BLOCKSIZE = 64  # transformers' bitsandbytes path always uses 64


def _dtype_name(value: Any) -> str | None:
    """``None``, a dtype name or a torch dtype -> its name (checked)."""
    if value is None:
        return None
    # a torch.dtype prints as "torch.bfloat16"; reading it so keeps torch out of this module
    name = str(value).removeprefix("torch.") if type(value).__name__ == "dtype" else value
    if not isinstance(name, str) or name not in COMPUTE_DTYPES:
        raise DTypeError(f"compute_dtype must be None or one of {COMPUTE_DTYPES} (a name or a torch dtype), "
                         f"got {value!r}")
    return name


def _patterns(value: Any, what: str) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(p, str) and p for p in value):
        raise ParameterError(f"{what} must be None or a list of non-empty strings, got {value!r}")
    return list(value)


class QuantcoreConfig(QuantizationConfigMixin):
    """Quantize a transformers model's ``nn.Linear`` layers to quantcore modules on load::

        import quantcore.hf
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quantcore.hf.QuantcoreConfig("nf4"))

    Args:
        fmt: "nf4" / "fp4" (bitsandbytes 4-bit, :class:`quantcore.nn.Linear4bit`), "q4_0" (ggml,
            :class:`quantcore.nn.LinearQ4_0`), "nvfp4" / "mxfp4" (:class:`quantcore.nn.LinearFP4`).
        blocksize: nf4 / fp4: weights per absmax block, one of ``bnb.BLOCKSIZES_4BIT`` (default
            64, transformers' bitsandbytes value). The other formats fix theirs (q4_0 32, nvfp4 16,
            mxfp4 32): leave it None or give that value.
        compress_statistics: nf4 / fp4: double-quantize the absmax (bitsandbytes'
            ``bnb_4bit_use_double_quant``); default True.
        compute_dtype: nf4 / fp4: the dtype the product runs in, "float32" / "float16" /
            "bfloat16" or a torch dtype (stored as its name); None: the input's.
        modules_to_not_convert: patterns of ``nn.Linear`` layers to keep in float. None (default):
            transformers' default, the output embedding (``lm_head``) and tied / last layers, as for
            bitsandbytes; a list replaces that default, as ``llm_int8_skip_modules`` does (add
            "lm_head" to keep it). A pattern matches a layer's qualified name when it equals a run of
            its dotted parts ("lm_head", "mlp", "layers.0", "mlp.down_proj") or as a glob
            ("*.down_proj"). The model's ``_keep_in_fp32_modules`` are always kept.
        skip: another name for ``modules_to_not_convert`` (:func:`quantcore.nn.quantize_model`'s).

    Layers whose in_features the format cannot block (q4_0 and mxfp4: a multiple of 32, nvfp4: of
    16) stay in float, with a warning. Bad values raise :class:`quantcore.ParameterError` /
    :class:`quantcore.DTypeError` here, before any weight is read.
    """

    def __init__(self, fmt: str = "nf4", blocksize: int | None = None, compress_statistics: bool | None = None,
                 compute_dtype: Any = None, modules_to_not_convert: list[str] | None = None,
                 skip: list[str] | None = None, **kwargs: Any):
        method = kwargs.pop("quant_method", QUANT_METHOD)
        if str(getattr(method, "value", method)) != QUANT_METHOD:
            raise ParameterError(f"QuantcoreConfig's quant_method is {QUANT_METHOD!r}, got {method!r}")
        if kwargs:
            raise ParameterError(f"unknown QuantcoreConfig option(s) {sorted(kwargs)}; the options are fmt, "
                                 "blocksize, compress_statistics, compute_dtype, modules_to_not_convert (skip)")
        if skip is not None and modules_to_not_convert is not None:
            raise ParameterError("give modules_to_not_convert or its other name skip, not both")
        self.quant_method = QUANT_METHOD
        self.fmt = fmt
        self.blocksize = blocksize
        self.compress_statistics = compress_statistics
        self.compute_dtype = compute_dtype
        self.modules_to_not_convert = modules_to_not_convert if skip is None else skip
        self.post_init()

    def post_init(self) -> None:
        """Check the values and fill the format's defaults (run again by the quantizer, so values set
        after construction are checked too)."""
        fmt = self.fmt
        if not isinstance(fmt, str) or fmt.lower() not in FORMATS:
            raise ParameterError(f"fmt must be one of {FORMATS}, got {fmt!r}")
        self.fmt = fmt = fmt.lower()
        bs = self.blocksize
        if bs is not None and (isinstance(bs, bool) or not isinstance(bs, int)):
            raise ParameterError(f"blocksize must be an integer, got {bs!r}")
        if fmt in FORMATS_4BIT:
            bs = DEFAULT_BLOCKSIZE if bs is None else bs
            if bs not in bnb.BLOCKSIZES_4BIT:
                raise ParameterError(f"{fmt} blocksize must be one of {bnb.BLOCKSIZES_4BIT}, got {bs}")
            cs = True if self.compress_statistics is None else self.compress_statistics
            if not isinstance(cs, bool):
                raise ParameterError(f"compress_statistics must be True or False, got {cs!r}")
            self.compress_statistics = cs
            self.compute_dtype = _dtype_name(self.compute_dtype)
        else:
            fixed = FIXED_BLOCKSIZE[fmt]
            if bs not in (None, fixed):
                raise ParameterError(f"{fmt} has a fixed block size of {fixed}, got blocksize={bs}")
            bs = fixed
            for name in ("compress_statistics", "compute_dtype"):
                if getattr(self, name) is not None:
                    raise ParameterError(f"{name} is an option of nf4 / fp4 only, not of {fmt}")
        self.blocksize = bs
        self.modules_to_not_convert = _patterns(self.modules_to_not_convert, "modules_to_not_convert")

    @property
    def torch_compute_dtype(self):
        """``compute_dtype`` as a torch dtype (None when unset)."""
        if self.compute_dtype is None:
            return None
        import torch

        return getattr(torch, self.compute_dtype)

    def to_dict(self) -> dict[str, Any]:
        return {
            "quant_method": QUANT_METHOD, "fmt": self.fmt, "blocksize": self.blocksize,
            "compress_statistics": self.compress_statistics, "compute_dtype": _dtype_name(self.compute_dtype),
            "modules_to_not_convert": None if self.modules_to_not_convert is None
            else list(self.modules_to_not_convert),
        }

    def __eq__(self, other: object) -> bool:
        return isinstance(other, QuantcoreConfig) and self.to_dict() == other.to_dict()

    __hash__ = None  # mutable, compared by value
