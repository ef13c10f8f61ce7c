"""Eager launch plans of the cuda backend (``quantcore.api`` keeps them on the QuantState): a
repeated public gemv_4bit / dequantize_4bit call on the same weight skips the launch choice and the
argument conversion."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from quantcore.arrays import as_dtype
from quantcore.backend import LAUNCH_CONTEXT, Nested
from quantcore.errors import KernelError

from . import runtime as rt
from .bnb import _DEQUANT_SLOTS, _dequantize_launch, _gemv_launch
from .common import _FV, TYPE_TAG, _torch_dtype
from .ggml import w4_launch

# -- eager launch plans (quantcore.api keeps them on the QuantState) ---------------------------------
_TENSOR: Any = None  # torch.Tensor, set when the first plan is made (torch is imported by then)
_MAX_GEOMETRIES = 8  # input geometries one plan keeps


def _tfp(t: Any) -> Any:
    """What the core's checks, the adapters and a launch read from an array: pointer, shape,
    strides, dtype and device of a torch tensor; None for None; False for anything else (never
    equal to a tensor's)."""
    if isinstance(t, _TENSOR):
        return t.data_ptr(), t.shape, t.stride(), t.dtype, t.get_device()
    return None if t is None else False


def _state_fp(s: Any) -> tuple:
    """The state's arrays and its nested state's fields. The state's own scalar fields are not
    read: assigning any field drops the state's plans (QuantState.__setattr__), and a plan is
    made only while they are immutable (a tuple shape)."""
    s2 = s.state2
    return (_tfp(s.absmax), _tfp(s.code), _tfp(s.offset),
            None if s2 is None else (s2.blocksize, _tfp(s2.absmax), _tfp(s2.code)))


class _StatePlan:
    """Launches of one op for one state and one packed weight on one device under one tuning
    setting, one per call geometry: ``entries`` maps a call's key (what the core's checks and the
    kernel choice read from the arguments besides the state, the packed weight and the devices)
    to what the call needs (output shape, dtype, launch). Subclasses say what the key is."""

    __slots__ = ("device", "ctx", "tune", "packed_fp", "state_fp", "entries", "hits", "_stream", "_ctx_now")

    def __init__(self, device: int, ctx: int, packed: Any, state: Any, tune: Any, stream: Any, ctx_now: Any):
        global _TENSOR
        _TENSOR = rt.torch_module().Tensor
        self.device, self.ctx, self.tune = device, ctx, tune
        self.packed_fp, self.state_fp = _tfp(packed), _state_fp(state)
        self.entries: dict[tuple, tuple] = {}
        self.hits = 0
        self._stream, self._ctx_now = stream, ctx_now

    def same(self, device: int, packed: Any, state: Any, tune: Any) -> bool:
        return (device == self.device and tune == self.tune and _tfp(packed) == self.packed_fp
                and _state_fp(state) == self.state_fp)

    def _entry(self, key: Any, packed: Any, state: Any) -> Any:
        """The entry of ``key`` while the packed weight, the state's arrays and the tuning are
        those the plan was made for, else None."""
        entry = self.entries.get(key)
        if (entry is None or _tfp(packed) != self.packed_fp or _state_fp(state) != self.state_fp
                or rt.tune_spec() != self.tune):
            return None
        return entry

    def _launch(self, launch: Any, first: Any, out: Any, plain: bool = False) -> Any:
        """Run a matched entry's launch on the caller's stream with these two arrays (``plain``: never as a
        programmatic dependent); None (the full path runs) when the thread's current context is another
        device's."""
        if self._ctx_now() != self.ctx:
            return None
        launch(self._stream(self.device), first.data_ptr(), out.data_ptr(), plain=plain)
        self.hits += 1
        return out

    def add(self, key: Any, value: tuple) -> None:
        if len(self.entries) >= _MAX_GEOMETRIES and key not in self.entries:
            self.entries.clear()
        self.entries[key] = value


class _GemvPlan(_StatePlan):
    """gemv_4bit's plan; a call's key is the input's (shape, dtype, 16-byte alignment), all that
    the core's checks and the kernel choice read from the input besides its device and contiguity."""

    __slots__ = ()

    @staticmethod
    def key(A: Any) -> tuple:
        return A.shape, A.dtype, not A.data_ptr() & 15

    def match(self, A: Any, packed: Any, state: Any) -> Any:
        """The (output shape, launch) for these arguments, or None."""
        if type(A) is not _TENSOR or not A.is_contiguous() or A.get_device() != self.device:
            return None
        return self._entry(self.key(A), packed, state)

    def __call__(self, A: Any, packed: Any, state: Any) -> Any:
        entry = self.match(A, packed, state)
        if entry is None:
            return None
        return self._launch(entry[1], A, A.new_empty(entry[0]))

    def bind(self, A: Any, packed: Any, state: Any) -> _BoundGemv | None:
        """This plan's launch for A's geometry bound to these tensors (see :class:`_BoundGemv`), or
        None where the plan does not match them or a tensor counts no versions (inference tensors)."""
        entry = self.match(A, packed, state)
        if entry is None:
            return None
        try:
            return _BoundGemv(self, self.key(A), entry, _bound_tensors(packed, state))
        except RuntimeError:  # "Inference tensors do not track version counter"
            return None


def _bound_tensors(packed: Any, state: Any) -> tuple:
    """The tensors a bound launch reads besides its input and output: the packed weight and the
    state's arrays (those present)."""
    s2 = state.state2
    arrays = (packed, state.absmax, state.code, state.offset) + ((s2.absmax, s2.code) if s2 is not None else ())
    return tuple(t for t in arrays if t is not None)


class _Stamped:
    """Tensors bound as they are now: their pointers and version counters (every in-place change,
    set_ / resize_ included, bumps a version; ``.data =`` gives another pointer)."""

    __slots__ = ("tensors", "stamps")

    def __init__(self, tensors: tuple):
        self.tensors = tensors
        self.stamps = tuple((t.data_ptr(), t._version) for t in tensors)  # RuntimeError on inference tensors

    def _unchanged(self) -> bool:
        """Do the bound tensors keep the pointers and version counters they had when bound?"""
        for t, (ptr, version) in zip(self.tensors, self.stamps):
            if t.data_ptr() != ptr or t._version != version:
                return False
        return True


class _Bound(_Stamped):
    """A launch bound to one input geometry and to tensors as they are now, for a caller that
    repeats the same call (a module's eager forward). :meth:`_holds` checks the input (exact tensor
    type, shape, dtype, device, contiguity, 16-byte alignment), that the bound tensors keep their
    pointers and version counters (every in-place change, set_ / resize_ included, bumps a version;
    ``.data =`` gives another pointer) and the tuning; a call that fails them returns None and the
    caller takes the public path."""

    __slots__ = ("shape", "dtype", "align", "device", "out_shape", "launch")

    def __init__(self, key: tuple, device: int, out_shape: tuple, launch: Any, tensors: tuple):
        super().__init__(tensors)
        self.shape, self.dtype, self.align = key
        self.device, self.out_shape, self.launch = device, out_shape, launch

    def _holds(self, A: Any, tune: Any) -> bool:
        if (type(A) is not _TENSOR or A.shape != self.shape or A.dtype != self.dtype
                or (not A.data_ptr() & 15) != self.align or not A.is_contiguous()
                or A.get_device() != self.device):
            return False
        return self._unchanged() and rt.tune_spec() == tune


class _BoundGemv(_Bound):
    """One gemv plan entry bound to the weight's and the state's tensors (see :class:`_Bound`); the
    plan's launch checks the thread's context."""

    __slots__ = ("plan", "plain")

    def __init__(self, plan: Any, key: tuple, entry: tuple, tensors: tuple):
        super().__init__(key, plan.device, entry[0], entry[1], tensors)
        self.plan = plan
        # bound from the torch layer (behind torch's kernels): never a programmatic dependent, though the
        # plan's launch may be one (a plan made by a public API call) and the module calls this outside
        # the layer's after_foreign_work
        self.plain = LAUNCH_CONTEXT.after_foreign

    def __call__(self, A: Any) -> Any:
        if not self._holds(A, self.plan.tune):
            return None
        return self.plan._launch(self.launch, A, A.new_empty(self.out_shape), self.plain)


class _DequantPlan(_StatePlan):
    """dequantize_4bit's plan; a call's key is its ``out_dtype`` argument as given (the output's
    shape is the state's, its 16-byte alignment is checked per call)."""

    __slots__ = ()

    def match(self, packed: Any, state: Any, out_dtype: Any) -> Any:
        """The (output shape, torch dtype, launch) for these arguments, or None."""
        try:
            return self._entry(out_dtype, packed, state)
        except TypeError:  # an unhashable out_dtype: the full path reports it
            return None

    def __call__(self, packed: Any, state: Any, out_dtype: Any = None) -> Any:
        entry = self.match(packed, state, out_dtype)
        if entry is None:
            return None
        return self._run(entry, packed)

    def _run(self, entry: tuple, packed: Any) -> Any:
        out = packed.new_empty(entry[0], dtype=entry[1])
        if out.data_ptr() & 15:  # the launch was set up for 16-byte stores
            return None
        return self._launch(entry[2], packed, out)

    def bind(self, packed: Any, state: Any, out_dtype: Any = None) -> _BoundDequant | None:
        """This plan's launch for ``out_dtype`` bound to these tensors (see :class:`_BoundDequant`),
        or None where the plan does not match them or a tensor counts no versions."""
        entry = self.match(packed, state, out_dtype)
        if entry is None:
            return None
        try:
            return _BoundDequant(self, entry, packed, _bound_tensors(packed, state))
        except RuntimeError:  # "Inference tensors do not track version counter"
            return None


class _BoundDequant(_Stamped):
    """One dequantize plan entry bound to the weight's and the state's tensors as they are now: a
    call (no arguments) checks their pointers and version counters and the tuning (see
    :class:`_Bound`), then launches into a new output; None where a check fails."""

    __slots__ = ("plan", "entry", "packed")

    def __init__(self, plan: _DequantPlan, entry: tuple, packed: Any, tensors: tuple):
        super().__init__(tensors)
        self.plan, self.entry, self.packed = plan, entry, packed

    def __call__(self) -> Any:
        if not self._unchanged() or rt.tune_spec() != self.plan.tune:
            return None
        return self.plan._run(self.entry, self.packed)


def _plannable(torch: Any, state: Any, arrays: tuple) -> bool:
    """May a call on these arrays and this state be planned? Only where prepare() hands the arrays
    through as they are (contiguous CUDA tensors) and the checks read nothing that can change
    without a field assignment or a new pointer: a host code table is compared by value on every
    call, a list shape can change in place."""
    s2 = state.state2
    need = arrays + (state.absmax,) + ((state.offset, s2.absmax, s2.code) if s2 is not None else ())
    if not all(isinstance(t, torch.Tensor) and t.is_cuda and t.is_contiguous() for t in need):
        return False
    if state.code is not None and not (isinstance(state.code, torch.Tensor) and state.code.is_cuda):
        return False
    return type(state.shape) is tuple and all(isinstance(d, (int, np.integer)) for d in state.shape)


def _plan_for(cls: type, previous: Any, device: int, packed: Any, state: Any) -> Any:
    """``previous`` when it was made for the same weight, state and tuning, else a new plan."""
    tune = rt.tune_spec()
    if isinstance(previous, cls) and previous.same(device, packed, state, tune):
        return previous
    return cls(device, rt.device_context(device), packed, state, tune, rt.raw_stream_getter(),
               rt.cupy().cuda.driver.ctxGetCurrent)


def _state_nested(state: Any) -> Nested | None:
    s2 = state.state2
    return Nested(absmax2=s2.absmax, code2=s2.code, offset=state.offset) if s2 is not None else None


def _plan_gemv_4bit(A: Any, packed: Any, state: Any, previous: Any, n: int, k: int) -> _GemvPlan | None:
    torch = rt.torch_module()
    if torch is None or type(A) is not torch.Tensor or n == 0 or not _plannable(torch, state, (A, packed)):
        return None
    rows = A.numel() // k
    if rows == 0:
        return None
    device = A.get_device()
    plan = _plan_for(_GemvPlan, previous, device, packed, state)
    if _GemvPlan.key(A) in plan.entries:
        return plan  # it had this call: the thread's current context was another device's
    spec = _gemv_launch(device, A, packed, state.absmax, None, rows=rows, n=n, k=k, blocksize=state.blocksize,
                        quant_type=state.quant_type, nested=_state_nested(state))
    launch = rt.PlannedLaunch(device, *spec[:5], shared_mem=spec[5], slots=spec[6], pdl=spec[0] == _FV,
                              maps=spec[7] if len(spec) > 7 else ())
    plan.add(_GemvPlan.key(A), (tuple(A.shape[:-1]) + (n,), launch))
    return plan


def _plan_dequantize_4bit(packed: Any, state: Any, out_dtype: Any, previous: Any, dtype: str) -> _DequantPlan | None:
    torch = rt.torch_module()
    if torch is None or not isinstance(packed, torch.Tensor) or not _plannable(torch, state, (packed,)):
        return None
    n = math.prod(state.shape)
    if n == 0:
        return None
    try:
        hash(out_dtype)
    except TypeError:
        return None
    device = packed.get_device()
    plan = _plan_for(_DequantPlan, previous, device, packed, state)
    if out_dtype in plan.entries:
        return plan  # it had this call: the thread's current context was another device's
    spec = _dequantize_launch(device, packed, state.absmax, None, n=n, tag=TYPE_TAG[dtype], out_aligned=True,
                              blocksize=state.blocksize, quant_type=state.quant_type, nested=_state_nested(state))
    launch = rt.PlannedLaunch(device, *spec, slots=_DEQUANT_SLOTS)
    plan.add(out_dtype, (tuple(state.shape), _torch_dtype(as_dtype(dtype)), launch))
    return plan


# -- gemm_w4a8 bound to a module's Q4_0 weight ----------------------------------------------------------
class _BoundW4a8:
    """The W4A8 stream kernel's launch for one call geometry (backends/cuda/ggml.py keeps one per
    geometry and tuning) bound to one Q4_0 weight tensor as it is now, for ``quantcore.nn.LinearQ4_0``'s
    eager forward: its own argument buffer with the weight's pointer written in. A call checks what
    :class:`_Bound` checks (the input's exact type, shape, dtype, 16-byte alignment, contiguity and
    device; the weight's pointer and version counter; the tuning) and the thread's context,
    allocates the output and launches; None where a check fails. The output: ``linear`` a linear
    layer's ``y`` (the input's leading shape + ``(M,)``, the input's dtype (``out_dtype`` None:
    new_empty without a dtype is the cheaper call), written by the kernel), else gemm_w4a8's fp32
    ``[M, N]``. The module's whole hot path, so the checks are written out here (not
    :meth:`_Bound._holds`) and the launch goes to the driver from the PlannedLaunch's parts (two
    slot writes, no argument loop; the stream kernel is never a PDL launch)."""

    __slots__ = ("shape", "dtype", "align", "device", "out_shape", "out_dtype", "launch", "weight", "wptr",
                 "wversion", "ctx", "tune", "hits", "_stream", "_ctx_now", "_lock", "_act", "_out", "_head",
                 "_params", "_driver")

    def __init__(self, a: Any, wq: Any, out_shape: tuple, out_dtype: Any, entry: Any, yt: int, tune: Any):
        self.shape, self.dtype, self.align = _GemvPlan.key(a)
        self.device, self.out_shape, self.out_dtype = a.get_device(), out_shape, out_dtype
        self.weight, self.wptr, self.wversion = wq, wq.data_ptr(), wq._version  # RuntimeError on inference tensors
        self.ctx, self.tune, self.hits = rt.device_context(self.device), tune, 0
        self._stream, self._ctx_now = rt.raw_stream_getter(), rt.cupy().cuda.driver.ctxGetCurrent
        launch = self.launch = entry.planned(self.device, yt, self.wptr)  # kept: it owns the buffers
        self._lock, (self._act, self._out) = launch._lock, launch._slots
        self._head = (launch._fn, *launch.grid, launch.block, 1, 1, launch.shared_mem)
        self._params, self._driver = launch._params_ptr, launch._launch

    def __call__(self, a: Any) -> Any:
        if type(a) is not _TENSOR or a.shape != self.shape or a.dtype != self.dtype:
            return None
        p = a.data_ptr()
        w = self.weight
        if ((not p & 15) != self.align or not a.is_contiguous() or a.get_device() != self.device
                or w.data_ptr() != self.wptr or w._version != self.wversion or rt.tune_spec() != self.tune
                or self._ctx_now() != self.ctx):
            return None
        out = a.new_empty(self.out_shape) if self.out_dtype is None else a.new_empty(self.out_shape,
                                                                                    dtype=self.out_dtype)
        with self._lock:
            self._act.value = p
            self._out.value = out.data_ptr()
            try:
                self._driver(*self._head, self._stream(self.device), self._params, 0)
            except Exception as exc:  # noqa: BLE001 - PlannedLaunch's report
                raise KernelError(f"launch of {self.launch.expr} failed: {type(exc).__name__}: {exc}") from exc
        self.hits += 1
        return out


def bind_gemm_w4a8(wq: Any, a: Any, m: int, n: int, k: int, linear: bool = False) -> _BoundW4a8 | None:
    """The stream kernel's launch of a ``gemm_w4a8(wq, a)`` call made before with this geometry,
    bound to ``wq`` (see :class:`_BoundW4a8`), or None: not torch CUDA tensors, another path (the
    tensor-core kernel above 8 rows), no launch kept for the geometry, an inference tensor."""
    global _TENSOR
    torch = rt.torch_module()
    # the weight is a module's nn.Parameter (a Tensor subclass); the input a plain tensor
    if (torch is None or type(a) is not torch.Tensor or not isinstance(wq, torch.Tensor) or not a.is_cuda
            or not a.is_contiguous() or not wq.is_contiguous() or a.get_device() != wq.get_device()):
        return None
    _TENSOR = torch.Tensor
    tune = rt.tune_spec()
    entry = w4_launch(a.get_device(), wq, a, n, k)
    if entry is None:
        return None
    out_shape, out_dtype = (tuple(a.shape[:-1]) + (m,), None) if linear else ((m, n), torch.float32)
    try:
        return _BoundW4a8(a, wq, out_shape, out_dtype, entry, int(linear), tune)
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None
