"""Format definitions: constants, layout math and the numpy reference, one module per family.

- :mod:`quantcore.formats.bnb`  bitsandbytes NF4 / FP4 4-bit, blockwise 8-bit, double quantization
- :mod:`quantcore.formats.ggml` ggml Q4_0 / Q8_0 / Q8_1 and the W4A8 dot product
- :mod:`quantcore.formats.mx`   NVFP4, MXFP4 / MXFP8 and the swizzled scale layout

Every constant of a format is defined once, here; kernel sources receive them from
:func:`quantcore.formats.kernel_defines`.
"""

from . import bnb as _bnb
from . import mx as _mx

#: the weight formats a linear layer or a checkpoint holds (quantcore.nn, quantcore.hf, quantcore quantize)
WEIGHT_FORMATS = (*_bnb.QUANT_TYPES, "q4_0", *_mx.FP4_FORMATS)
#: the formats ``quantcore quantize`` writes into a GGUF file (from a GGUF input only)
GGUF_FORMATS = ("q4_0", "q8_0")
#: every ``--format`` of ``quantcore quantize``
QUANTIZE_FORMATS = tuple(dict.fromkeys((*WEIGHT_FORMATS, *GGUF_FORMATS)))
