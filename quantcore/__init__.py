"""quantcore: low-bit LLM weight formats that run the same on every accelerator vendor.

The core (this package) defines the formats and their numpy reference; backends (``cpu``,
``cuda``, ``sycl``, ``maca`` and any registered through the ``quantcore.backends`` entry-point
group) run them. Importing quantcore imports no vendor package.
"""

import os as _os

# Running from a source checkout (PYTHONPATH=repo, no install): the backends and kernel folders
# sit beside this package and install as quantcore.backends / quantcore.kernels_*; extending the
# package path makes the same names resolve here. An installed wheel has them inside already.
_here = _os.path.dirname(_os.path.abspath(__file__))
if not _os.path.isdir(_os.path.join(_here, "backends")) and _os.path.isfile(
    _os.path.join(_here, _os.pardir, "backends", "cpu", "__init__.py")
):
    __path__.append(_os.path.normpath(_os.path.join(_here, _os.pardir)))

from .api import (  # noqa: E402
    dequantize_4bit,
    dequantize_blockwise,
    dequantize_ggml,
    dequantize_q4_0,
    dequantize_q8_0,
    dequantize_q8_1,
    gemm_q4_0_q8_1,
    gemm_w4a8,
    gemv_4bit,
    gemv_4bit_grouped,
    quantize_4bit,
    quantize_blockwise,
    quantize_ggml,
    quantize_q4_0,
    quantize_q8_0,
    quantize_q8_1,
)
from .backend import Availability, Backend, Capability, Nested
from .errors import (
    BackendUnavailableError,
    CheckpointError,
    DeviceError,
    DTypeError,
    KernelError,
    ParameterError,
    QuantcoreError,
    ShapeError,
    StateError,
    UnsupportedError,
)
from .registry import (
    available_backends,
    backend_names,
    get_backend,
    register_backend,
    set_backend,
    unregister_backend,
    use_backend,
)
from .state import QuantState

__version__ = "0.1.0"

__all__ = [
    "Availability", "Backend", "BackendUnavailableError", "Capability", "CheckpointError", "DTypeError", "DeviceError",
    "KernelError", "Nested", "ParameterError", "QuantState", "QuantcoreError", "ShapeError",
    "StateError", "UnsupportedError", "available_backends", "backend_names", "dequantize_4bit",
    "dequantize_blockwise", "dequantize_ggml", "dequantize_q4_0", "dequantize_q8_0", "dequantize_q8_1",
    "gemm_q4_0_q8_1", "gemm_w4a8", "gemv_4bit", "gemv_4bit_grouped", "get_backend", "quantize_4bit",
    "quantize_blockwise", "quantize_ggml", "quantize_q4_0", "quantize_q8_0", "quantize_q8_1", "register_backend",
    "set_backend", "unregister_backend", "use_backend", "__version__",
]

# -- MX family (NVFP4, MXFP4, MXFP8): quantcore/api_mx.py ------------------------------------------
from .api_mx import (  # noqa: E402
    as_torch_float8_e4m3,
    as_torch_float8_e8m0,
    as_torch_fp4,
    dequantize_mx,
    dequantize_mxfp4,
    dequantize_mxfp8,
    dequantize_nvfp4,
    linear_mx,
    linear_mx_grouped,
    nvfp4_global_scale,
    quantize_mx,
    scaled_fp4_mm,
    scaled_mxfp4_quant,
    scaled_mxfp8_quant,
    scaled_nvfp4_quant,
    swizzle_scales,
    unswizzle_scales,
)

__all__ += [
    "as_torch_float8_e4m3", "as_torch_float8_e8m0", "as_torch_fp4", "dequantize_mx",
    "dequantize_mxfp4", "dequantize_mxfp8", "dequantize_nvfp4", "linear_mx", "linear_mx_grouped", "nvfp4_global_scale",
    "quantize_mx",
    "scaled_fp4_mm", "scaled_mxfp4_quant", "scaled_mxfp8_quant", "scaled_nvfp4_quant",
    "swizzle_scales", "unswizzle_scales",
]
