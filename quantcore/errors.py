"""One exception hierarchy for every backend.

Every invalid input is rejected in the core, before any kernel launch, with one of these
types, so a caller sees the same exception on every backend. Each subclass also derives
from the builtin a Python user would expect (``ValueError``, ``TypeError`` ...), so
``except ValueError`` keeps working.
"""


class QuantcoreError(Exception):
    """Base class of every error quantcore raises on purpose."""


class ShapeError(QuantcoreError, ValueError):
    """An array has the wrong shape or size (for example K not a multiple of 32 for ggml)."""


class DTypeError(QuantcoreError, TypeError):
    """An array has a dtype the operation does not accept."""


class ParameterError(QuantcoreError, ValueError):
    """A scalar parameter is out of range (blocksize, quant_type, scale_mode ...)."""


class StateError(QuantcoreError, ValueError):
    """A quantization state is inconsistent with itself or with the data it describes."""


class UnsupportedError(QuantcoreError, NotImplementedError):
    """The selected backend does not implement this (op, format, dtype, blocksize)."""


class DeviceError(QuantcoreError, TypeError):
    """An array lives where the selected backend cannot use it (a host array on a GPU backend)."""


class BackendUnavailableError(QuantcoreError, RuntimeError):
    """The requested backend cannot run here; the message says why and how to fix it."""


class KernelError(QuantcoreError, RuntimeError):
    """A backend's kernel failed to build or to run (the compiler or runtime log is attached)."""


class CheckpointError(QuantcoreError, ValueError):
    """A checkpoint file or folder is malformed, or cannot be read or written where asked."""
