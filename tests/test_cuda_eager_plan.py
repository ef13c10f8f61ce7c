"""Eager launch plans of the public API (quantcore.api.EAGER_PLANS; the cuda backend's gemv_4bit
and dequantize_4bit).

CPU part (runs in CI): the plan slot on QuantState (dropped when a field is assigned, never
copied or pickled); the core's protocol with a planning backend built on the cpu reference (a
plan is asked for after a validated call, reused, replaced, bypassed for arguments it does not
recognise, and errors stay those of the full path); the cuda plan's matching rules on torch CPU
tensors (every change of the input's geometry, dtype, contiguity or alignment, of the packed
weight, of the state's arrays or of QUANTCORE_CUDA_TUNE makes it step aside); the launch
argument buffer with a fake driver.

GPU part (skipped with the reason where the cuda backend is unavailable): planned results are
bitwise those of the full path for every kernel path and dtype, plans are reused (hits counted)
and rebuilt when the state, the input geometry / dtype / alignment or the tuning change, the
launch follows the caller's current stream, errors are identical, and a planned call captures in
a CUDA graph.
"""

from __future__ import annotations

import copy
import pickle
import types

import numpy as np
import pytest
from quantcore.backends.cpu import CpuBackend
from quantcore.backends.cuda import plans as cuda_plans
from quantcore.backends.cuda import runtime as rt

import quantcore as qc
from quantcore import api
from quantcore.errors import KernelError, QuantcoreError
from quantcore.formats import kernel_interface as qc_interface

from .cuda_arrays import TUNE, needs_cuda


# -- CPU: the plan slot on QuantState ------------------------------------------------------------------
def _np_state(rng, n=32, k=128, nested=True):
    w = rng.standard_normal((n, k)).astype(np.float32)
    packed, state = qc.quantize_4bit(w, 64, "nf4", nested, backend="cpu")
    return w, packed, state


def test_state_plans_are_dropped_on_field_assignment(rng):
    _, _, st = _np_state(rng)
    st._plans = {"gemv_4bit": (None, "plan")}
    st.blocksize = 64  # any field, even to the same value
    assert st._plans is None
    st._plans = {"gemv_4bit": (None, "plan")}
    st.absmax = st.absmax.copy()
    assert st._plans is None


def test_state_plans_are_not_copied_or_pickled(rng):
    _, _, st = _np_state(rng)
    st._plans = {"gemv_4bit": (None, lambda: None)}  # a lambda cannot be pickled: it must not be tried
    for other in (copy.copy(st), copy.deepcopy(st), pickle.loads(pickle.dumps(st))):
        assert other._plans is None and "_plans" not in other.__dict__
        assert other.shape == st.shape and np.array_equal(other.absmax, st.absmax)
    assert st._plans is not None


# -- CPU: the core's protocol with a planning backend ----------------------------------------------------
class _Plan:
    """Recognises one input object (by identity) and runs the kernel-level op without the checks."""

    def __init__(self, be, A, packed, state, n, k):
        self.be, self.A, self.packed, self.n, self.k = be, A, packed, n, k
        self.hits = 0
        self.calls = 0

    def __call__(self, A, packed, state):
        self.calls += 1
        if A is not self.A or packed is not self.packed:
            return None
        self.hits += 1
        out = np.empty(A.shape[:-1] + (self.n,), A.dtype)
        self.be.gemv_4bit(A.reshape(-1, self.k), packed, state.absmax, out.reshape(-1, self.n), n=self.n,
                          k=self.k, blocksize=state.blocksize, quant_type=state.quant_type,
                          nested=api._nested(self.be, state))
        return out


class _DequantPlanCpu:
    """Recognises one packed object (by identity) and one out_dtype; runs the kernel-level op."""

    def __init__(self, be, packed, out_dtype, dtype):
        self.be, self.packed, self.out_dtype, self.dtype = be, packed, out_dtype, dtype
        self.hits = 0

    def __call__(self, packed, state, out_dtype=None):
        if packed is not self.packed or out_dtype != self.out_dtype:
            return None
        self.hits += 1
        out = np.empty(state.shape, self.dtype)
        self.be.dequantize_4bit(packed, state.absmax, out, blocksize=state.blocksize, quant_type=state.quant_type,
                                nested=api._nested(self.be, state))
        return out


class _PlanningCpu(CpuBackend):
    name = "cpu-planning"

    def __init__(self):
        super().__init__()
        self.asked = []

    def plan_gemv_4bit(self, A, packed, state, *, previous, n, k):
        self.asked.append((previous, n, k))
        return _Plan(self, A, packed, state, n, k)

    def plan_dequantize_4bit(self, packed, state, out_dtype, *, previous, dtype):
        self.asked.append((previous, out_dtype, dtype))
        return _DequantPlanCpu(self, packed, out_dtype, np.dtype(np.float16) if dtype == "float16" else np.float32)


def test_core_keeps_and_reuses_a_plan(rng):
    be = _PlanningCpu()
    w, packed, st = _np_state(rng)
    a = rng.standard_normal((1, 128)).astype(np.float32)
    ref = qc.gemv_4bit(a, packed, st, backend="cpu")
    first = qc.gemv_4bit(a, packed, st, backend=be)
    assert len(be.asked) == 1 and be.asked[0][1:] == (32, 128) and be.asked[0][0] is None
    owner, plan = st._plans["gemv_4bit"]
    assert owner is be and plan.hits == 0
    for _ in range(3):
        assert np.array_equal(qc.gemv_4bit(a, packed, st, backend=be), ref)
    assert plan.hits == 3 and len(be.asked) == 1  # no new plan asked for
    assert np.array_equal(first, ref)
    # an argument the plan does not recognise: the full path runs, and the planner sees the old plan
    b = a.copy()
    assert np.array_equal(qc.gemv_4bit(b, packed, st, backend=be), ref)
    assert len(be.asked) == 2 and be.asked[1][0] is plan and plan.hits == 3
    # another backend does not use this backend's plan
    assert np.array_equal(qc.gemv_4bit(b, packed, st, backend="cpu"), ref)
    assert st._plans["gemv_4bit"][0] is be


def test_core_drops_plans_with_the_state_fields(rng):
    be = _PlanningCpu()
    _, packed, st = _np_state(rng)
    a = rng.standard_normal((2, 128)).astype(np.float32)
    qc.gemv_4bit(a, packed, st, backend=be)
    st.absmax = st.absmax.copy()
    assert st._plans is None
    qc.gemv_4bit(a, packed, st, backend=be)
    assert len(be.asked) == 2 and be.asked[1][0] is None


def test_core_without_plans(rng, monkeypatch):
    monkeypatch.setattr(api, "EAGER_PLANS", False)
    be = _PlanningCpu()
    _, packed, st = _np_state(rng)
    a = rng.standard_normal((1, 128)).astype(np.float32)
    qc.gemv_4bit(a, packed, st, backend=be)
    qc.gemv_4bit(a, packed, st, backend=be)
    assert be.asked == [] and st._plans is None


def _error(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the type and message are what is compared
        return type(exc), str(exc)
    return None


def test_core_errors_are_those_of_the_full_path(rng):
    be = _PlanningCpu()
    _, packed, st = _np_state(rng)
    a = rng.standard_normal((1, 128)).astype(np.float32)
    bad = {"K": lambda A, P, S: qc.gemv_4bit(A[:, :64], P, S, backend=be),
           "dtype": lambda A, P, S: qc.gemv_4bit(A.astype(np.int32), P, S, backend=be),
           "packed": lambda A, P, S: qc.gemv_4bit(A, P[:-1], S, backend=be),
           "state": lambda A, P, S: qc.gemv_4bit(A, P, {"absmax": S.absmax}, backend=be)}
    cold = {name: _error(lambda f=f: f(a, packed, copy.copy(st))) for name, f in bad.items()}
    qc.gemv_4bit(a, packed, st, backend=be)
    qc.gemv_4bit(a, packed, st, backend=be)
    assert st._plans["gemv_4bit"][1].hits == 1
    for name, f in bad.items():
        assert cold[name] is not None and _error(lambda f=f: f(a, packed, st)) == cold[name], name
    # a state made inconsistent by a field assignment is validated again
    st.blocksize = 128
    with pytest.raises(QuantcoreError):
        qc.gemv_4bit(a, packed, st, backend=be)


def test_core_plans_only_quantstates_themselves(rng):
    class MyState(qc.QuantState):
        pass

    be = _PlanningCpu()
    _, packed, st = _np_state(rng, nested=False)
    mine = MyState(absmax=st.absmax, shape=st.shape, code=st.code, blocksize=st.blocksize,
                   quant_type=st.quant_type, dtype=st.dtype)
    a = rng.standard_normal((1, 128)).astype(np.float32)
    qc.gemv_4bit(a, packed, mine, backend=be)
    assert be.asked == [] and mine._plans is None


def test_core_plans_dequantize(rng):
    be = _PlanningCpu()
    _, packed, st = _np_state(rng)
    ref = qc.dequantize_4bit(packed, st, backend="cpu")
    ref16 = qc.dequantize_4bit(packed, st, "float16", backend="cpu")
    assert np.array_equal(qc.dequantize_4bit(packed, st, backend=be), ref)
    assert be.asked == [(None, None, "float32")]
    plan = st._plans["dequantize_4bit"][1]
    for _ in range(2):
        assert np.array_equal(qc.dequantize_4bit(packed, st, backend=be), ref)
    assert plan.hits == 2 and len(be.asked) == 1
    # another out_dtype: the full path runs and the planner is asked again with the old plan
    assert np.array_equal(qc.dequantize_4bit(packed, st, "float16", backend=be), ref16)
    assert be.asked[1] == (plan, "float16", "float16")
    # errors are those of the full path (the plan is not consulted for what it does not recognise)
    bad = {"out_dtype": lambda P, S: qc.dequantize_4bit(P, S, "int8", backend=be),
           "packed": lambda P, S: qc.dequantize_4bit(P[:-1], S, backend=be),
           "state": lambda P, S: qc.dequantize_4bit(P, {"absmax": S.absmax}, backend=be)}
    cold = {name: _error(lambda f=f: f(packed, copy.copy(st))) for name, f in bad.items()}
    for name, f in bad.items():
        assert cold[name] is not None and _error(lambda f=f: f(packed, st)) == cold[name], name


# -- CPU: the cuda plan's matching rules (torch CPU tensors stand for the device's) -------------------
def _torch():
    return pytest.importorskip("torch")


def _cpu_plan(torch, nested=True, n=32, k=256):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, k)).astype(np.float32)
    packed, st = qc.quantize_4bit(torch.from_numpy(w), 64, "nf4", nested, backend="cpu")
    # own copies of the code tables (the state shares them with every state made here): the
    # tests below change this state's arrays in place
    st.code = st.code.clone()
    if nested:
        st.state2.code = st.state2.code.clone()
    a = torch.randn(1, k, dtype=torch.bfloat16)
    plan = cuda_plans._GemvPlan(a.get_device(), 0, packed, st, rt.tune_spec(), lambda device: 0, lambda: 0)
    entry = ((1, n), "launch")
    plan.entries[(a.shape, a.dtype, not a.data_ptr() & 15)] = entry
    return plan, entry, a, packed, st


def test_cuda_plan_matches_only_what_it_was_made_for(monkeypatch):
    torch = _torch()
    plan, entry, a, packed, st = _cpu_plan(torch)
    assert plan.match(a, packed, st) is entry
    assert plan.match(a.clone(), packed, st) is entry  # another tensor of the same geometry
    assert plan.match(a.reshape(-1), packed, st) is None  # another shape
    assert plan.match(a.float(), packed, st) is None  # another dtype
    assert plan.match(a.float().numpy(), packed, st) is None  # another array kind
    wide = torch.randn(2, a.shape[1], dtype=a.dtype)
    assert plan.match(wide.t().contiguous().t()[:1], packed, st) is None  # not contiguous
    flat = torch.randn(a.shape[1] + 8, dtype=a.dtype)
    misaligned = flat[1:1 + a.shape[1]].view(1, -1)  # contiguous, 2 bytes off 16
    assert misaligned.is_contiguous() and misaligned.data_ptr() % 16
    assert plan.match(misaligned, packed, st) is None
    assert plan.match(torch.nn.Parameter(a), packed, st) is None  # only plain tensors as the input
    assert plan.match(a, packed.clone(), st) is None  # another weight buffer
    monkeypatch.setenv(TUNE, "gemv_ksplit=2")
    assert plan.match(a, packed, st) is None  # another tuning: another kernel choice
    monkeypatch.delenv(TUNE)
    assert plan.match(a, packed, st) is entry


@pytest.mark.parametrize("change", ["absmax set_", "absmax unsqueeze_", "code resize_", "offset set_",
                                    "absmax2 set_", "code2 resize_", "state2 blocksize", "state2 absmax"])
def test_cuda_plan_sees_changes_to_the_state_arrays(change):
    torch = _torch()
    plan, entry, a, packed, st = _cpu_plan(torch)
    assert plan.match(a, packed, st) is entry
    s2 = st.state2
    if change == "absmax set_":
        st.absmax.set_(st.absmax.clone())  # in place: no field assignment
    elif change == "absmax unsqueeze_":
        st.absmax.unsqueeze_(0)
    elif change == "code resize_":
        st.code.resize_(8)
    elif change == "offset set_":
        st.offset.set_(st.offset.clone())
    elif change == "absmax2 set_":
        s2.absmax.set_(s2.absmax.clone())
    elif change == "code2 resize_":
        s2.code.resize_(128)
    elif change == "state2 blocksize":
        s2.blocksize = 128  # a field of the nested state: the outer state's plan is not dropped
    elif change == "state2 absmax":
        s2.absmax = s2.absmax.clone()
    assert plan.match(a, packed, st) is None, change


def test_cuda_plan_non_nested_state():
    torch = _torch()
    plan, entry, a, packed, st = _cpu_plan(torch, nested=False)
    assert plan.match(a, packed, st) is entry
    st.state2 = types.SimpleNamespace(blocksize=256, absmax=None, code=None)  # assigned: fingerprint differs too
    assert plan.match(a, packed, st) is None


def test_cuda_planner_declines_what_it_cannot_plan():
    """torch CPU tensors (and anything but contiguous CUDA tensors) get no plan: the full path runs."""
    torch = _torch()
    _, _, a, packed, st = _cpu_plan(torch)
    assert cuda_plans._plan_gemv_4bit(a, packed, st, None, 32, 256) is None
    assert cuda_plans._plan_gemv_4bit(a.float().numpy(), packed, st, None, 32, 256) is None


def _cpu_dequant_plan(torch):
    _, _, a, packed, st = _cpu_plan(torch)
    plan = cuda_plans._DequantPlan(packed.get_device(), 0, packed, st, rt.tune_spec(), lambda device: 0, lambda: 0)
    entry = (tuple(st.shape), torch.bfloat16, "launch")
    plan.entries[None] = entry
    return plan, entry, packed, st


def test_cuda_dequant_plan_matches_only_what_it_was_made_for(monkeypatch):
    torch = _torch()
    plan, entry, packed, st = _cpu_dequant_plan(torch)
    assert plan.match(packed, st, None) is entry
    assert plan.match(packed, st, torch.float16) is None  # another out_dtype (its own entry)
    assert plan.match(packed, st, [1]) is None  # unhashable: the full path reports it
    assert plan.match(packed.clone(), st, None) is None  # another weight buffer
    assert plan.match(packed.numpy(), st, None) is None  # another array kind
    assert plan.match(packed.view(-1), st, None) is None  # another shape
    monkeypatch.setenv(TUNE, "gemv_kernel=1")
    assert plan.match(packed, st, None) is None  # another tuning
    monkeypatch.delenv(TUNE)
    st.absmax.set_(st.absmax.clone())  # in place: no field assignment
    assert plan.match(packed, st, None) is None


def test_cuda_dequant_planner_declines_what_it_cannot_plan():
    torch = _torch()
    _, _, _, packed, st = _cpu_plan(torch)
    assert cuda_plans._plan_dequantize_4bit(packed, st, None, None, "float32") is None  # a CPU tensor
    assert cuda_plans._plan_dequantize_4bit(packed.numpy(), st, None, None, "float32") is None


# -- CPU: the launch argument buffer, with a fake driver ------------------------------------------------
def test_planned_launch_buffer_and_slots(monkeypatch):
    launched = []

    def launch_kernel(*args):
        import ctypes

        params = args[9]
        n = 6
        ptrs = (ctypes.c_void_p * n).from_address(params)
        # each parameter is read from its slot: 8 bytes for pointers and i64, 4 for i32
        vals = [ctypes.c_uint64.from_address(ptrs[i]).value for i in (0, 1, 2, 3)]
        vals.append(ctypes.c_int32.from_address(ptrs[4]).value)
        vals.append(ctypes.c_int64.from_address(ptrs[5]).value)
        launched.append((args[:9], vals))
        if args[8] == 666:
            raise RuntimeError("CUDA_ERROR_INVALID_VALUE")

    fake_fn = types.SimpleNamespace(ptr=0xF00)
    fake_cp = types.SimpleNamespace(cuda=types.SimpleNamespace(driver=types.SimpleNamespace(launchKernel=launch_kernel)))
    monkeypatch.setattr(rt.KERNELS, "function", lambda device, filename, expr: fake_fn)
    monkeypatch.setattr(rt, "cupy", lambda: fake_cp)
    args = (rt.NULL, np.uint64(0x1000), np.uint64(0x2000), rt.NULL, np.int32(-3), np.int64(1 << 40))
    pl = rt.PlannedLaunch(0, "bnb_gemv.cu", "qc::k", (7, 2), 512, args, shared_mem=0, slots=(0, 3))
    assert pl.args() == (0, 0x1000, 0x2000, 0, (1 << 32) - 3, 1 << 40)
    pl(0xABC, 0x5000, 0x6000)
    pl(0xABD, 0x5100, 0x6100)
    assert launched[0][0] == (0xF00, 7, 2, 1, 512, 1, 1, 0, 0xABC)
    assert launched[0][1] == [0x5000, 0x1000, 0x2000, 0x6000, -3, 1 << 40]
    assert launched[1][0][8] == 0xABD and launched[1][1][:4] == [0x5100, 0x1000, 0x2000, 0x6100]
    with pytest.raises(KernelError, match=r"launch of qc::k \(grid \(7, 2, 1\), block 512"):
        pl(666, 1, 2)
    with pytest.raises(TypeError):
        rt.PlannedLaunch(0, "f.cu", "qc::k", (1,), 32, (5,))  # a Python int: its width is unknown


def test_planned_launch_by_value_structs_and_their_maps(monkeypatch):
    """A by-value struct argument (two tensor maps) sits at a 64-byte boundary of the buffer with its
    bytes; a call re-points the map at byte 0 of it at the pointer of its slot before launching."""
    import ctypes

    launched, replaced = [], []

    def launch_kernel(*args):
        ptrs = (ctypes.c_void_p * 3).from_address(args[9])
        launched.append([ptrs[i] for i in range(3)])

    monkeypatch.setattr(rt.KERNELS, "function", lambda device, filename, expr: types.SimpleNamespace(ptr=1))
    monkeypatch.setattr(rt, "cupy", lambda: types.SimpleNamespace(
        cuda=types.SimpleNamespace(driver=types.SimpleNamespace(launchKernel=launch_kernel))))
    monkeypatch.setattr(rt, "replace_tensor_map_address", lambda addr, p: replaced.append((addr, p)))
    maps = rt._by_value_converter("k", qc_interface.Arg("maps", "tmap2"))(bytes(range(256)))
    pl = rt.PlannedLaunch(0, "f.cu", "qc::k", (1,), 32, (np.uint64(0x10), np.int32(7), maps), slots=(0,),
                          maps=((2, 0, 0),))
    pl(0, 0x5000)
    (p0, p1, p2), = launched
    assert p2 % 64 == 0 and ctypes.string_at(p2, 256) == bytes(range(256))
    assert replaced == [(p2, 0x5000)] and ctypes.c_uint64.from_address(p0).value == 0x5000
    assert ctypes.c_int32.from_address(p1).value == 7
    with pytest.raises(TypeError):
        rt._by_value_converter("k", qc_interface.Arg("maps", "tmap2"))(bytes(128))  # not the struct's size


def test_launch_once_sets_a_launch_up_once_and_gives_it_each_calls_arguments(monkeypatch):
    """rt.launch_once (Launcher's programmatic dependent launches and by-value struct launches) sets a
    planned launch up once per kernel, geometry and argument types and writes each call's arguments
    into it: a second call with other values launches them without a new set-up; other argument types
    or another grid get their own."""
    import ctypes

    launched, made = [], []

    def launch_kernel(*args):
        ptrs = (ctypes.c_void_p * 2).from_address(args[9])
        launched.append((args[1:4], ctypes.c_uint64.from_address(ptrs[0]).value,
                         ctypes.c_int32.from_address(ptrs[1]).value))

    init = rt.PlannedLaunch.__init__

    def counting_init(self, *a, **kw):
        made.append(a[2])
        init(self, *a, **kw)

    monkeypatch.setattr(rt.KERNELS, "function", lambda device, filename, expr: types.SimpleNamespace(ptr=1))
    monkeypatch.setattr(rt, "cupy", lambda: types.SimpleNamespace(
        cuda=types.SimpleNamespace(driver=types.SimpleNamespace(launchKernel=launch_kernel))))
    monkeypatch.setattr(rt.PlannedLaunch, "__init__", counting_init)
    monkeypatch.setattr(rt, "_ONCE", {})
    rt.launch_once(0, "f.cu", "qc::k", (3,), 64, (np.uint64(0x1000), np.int32(5)), 0, False, 0)
    rt.launch_once(0, "f.cu", "qc::k", (3,), 64, (np.uint64(0x2000), np.int32(-7)), 0, False, 0)
    assert made == ["qc::k"] and launched == [((3, 1, 1), 0x1000, 5), ((3, 1, 1), 0x2000, -7)]
    rt.launch_once(0, "f.cu", "qc::k", (4,), 64, (np.uint64(0x3000), np.int32(1)), 0, False, 0)  # another grid
    rt.launch_once(0, "f.cu", "qc::k", (3,), 64, (np.uint64(0x3000), np.int64(1)), 0, False, 0)  # another type
    assert made == ["qc::k"] * 3 and launched[2] == ((4, 1, 1), 0x3000, 1)


def test_tune_spec_follows_the_environment(monkeypatch):
    monkeypatch.delenv(TUNE, raising=False)
    assert rt.tune_spec() is None
    monkeypatch.setenv(TUNE, "gemv_kernel=1")
    first = rt.tune_spec()
    monkeypatch.setenv(TUNE, "gemv_kernel=0")
    assert first is not None and rt.tune_spec() != first


# -- GPU ---------------------------------------------------------------------------------------------------
gpu = needs_cuda


@pytest.fixture
def torch_cuda():
    torch = pytest.importorskip("torch", reason="torch with CUDA is needed for the planned path")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch


def _bits(t):
    torch = rt.torch_module()
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16).cpu()


def _unplanned(monkeypatch, op, *args):
    """The full path's result of ``op(*args)`` on cuda (plans off for this call)."""
    monkeypatch.setattr(api, "EAGER_PLANS", False)
    try:
        return op(*args, backend="cuda")
    finally:
        monkeypatch.setattr(api, "EAGER_PLANS", True)


def _full(A, packed, st, monkeypatch):
    return _unplanned(monkeypatch, qc.gemv_4bit, A, packed, st)


def _gpu_case(torch, n, k, bs, nested, dtype):
    g = torch.Generator(device="cuda").manual_seed(n * 7 + k)
    w = torch.randn(n, k, device="cuda", dtype=torch.float32, generator=g).to(dtype)
    packed, st = qc.quantize_4bit(w, bs, "nf4", nested, backend="cuda")
    return packed, st


def _plan_of(st):
    return st._plans["gemv_4bit"][1]


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("nested", [False, True])
def test_planned_equals_full_path_and_is_reused(torch_cuda, monkeypatch, dtype, nested):
    torch = torch_cuda
    dt = getattr(torch, dtype)
    # 4096^2 (streaming kernel on sm_90), a 16-byte-unaligned input (mma or simple kernel), K not a
    # multiple of 64 (4-byte lanes), a batch over 8 (a second grid row), a 1-D input
    # ... and 300 rows (the many-row GEMM; on sm_90 its input's TMA map follows each call's input)
    for rows, n, k, bs in [(1, 4096, 4096, 64), (3, 100, 512, 128), (2, 48, 64 * 5 + 32, 32), (11, 70, 1024, 64),
                           (300, 520, 1024, 64)]:
        packed, st = _gpu_case(torch, n, k, bs, nested, dt)
        A = torch.randn(rows, k, device="cuda", dtype=dt)
        ref = _full(A, packed, st, monkeypatch)
        assert st._plans is None  # the full path alone makes no plan
        first = qc.gemv_4bit(A, packed, st, backend="cuda")
        plan = _plan_of(st)
        assert plan.hits == 0 and len(plan.entries) == 1
        for i in range(3):
            A2 = torch.randn(rows, k, device="cuda", dtype=dt)
            got = qc.gemv_4bit(A2, packed, st, backend="cuda")
            assert plan.hits == i + 1
            assert got.shape == (rows, n) and got.dtype == dt and got.device == A2.device
            assert torch.equal(_bits(got), _bits(_full(A2, packed, st, monkeypatch))), (rows, n, k, bs)
        assert torch.equal(_bits(first), _bits(ref))
        # a 1-D input and a 16-byte-misaligned input: new geometries of the same plan
        flat = torch.randn(k + 8, device="cuda", dtype=dt)
        for A3 in (flat[:k], flat[1:k + 1].view(1, k)):
            ref3 = _full(A3, packed, st, monkeypatch)
            qc.gemv_4bit(A3, packed, st, backend="cuda")
            hits = plan.hits
            got3 = qc.gemv_4bit(A3, packed, st, backend="cuda")
            assert plan.hits == hits + 1 and _plan_of(st) is plan
            assert got3.shape == ref3.shape and torch.equal(_bits(got3), _bits(ref3))
        assert len(plan.entries) == 3


@gpu
def test_plan_rebuilt_when_state_or_tuning_changes(torch_cuda, monkeypatch):
    torch = torch_cuda
    packed, st = _gpu_case(torch, 512, 1024, 64, True, torch.bfloat16)
    A = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    qc.gemv_4bit(A, packed, st, backend="cuda")
    plan = _plan_of(st)
    qc.gemv_4bit(A, packed, st, backend="cuda")
    assert plan.hits == 1
    # a field replaced: the plan is dropped and made again for the new arrays
    st.state2.absmax = st.state2.absmax.clone()
    ref = _full(A, packed, st, monkeypatch)
    got = qc.gemv_4bit(A, packed, st, backend="cuda")
    assert _plan_of(st) is not plan and torch.equal(_bits(got), _bits(ref))
    st.absmax = st.absmax.clone()
    assert st._plans is None
    qc.gemv_4bit(A, packed, st, backend="cuda")
    plan = _plan_of(st)
    # another packed buffer holding the same weight: another plan (the pointer is in the launch)
    qc.gemv_4bit(A, packed.clone(), st, backend="cuda")
    assert _plan_of(st) is not plan
    plan = _plan_of(st)
    # the tuning: each setting gets its own kernel choice, bitwise that of the full path
    exprs = set()
    for spec in ("gemv_kernel=1", "gemv_kernel=1,gemv_ksplit=2", ""):
        monkeypatch.setenv(TUNE, spec)
        P = packed.clone()
        ref = _full(A, P, st, monkeypatch)
        qc.gemv_4bit(A, P, st, backend="cuda")
        got = qc.gemv_4bit(A, P, st, backend="cuda")
        plan = _plan_of(st)
        assert plan.hits == 1 and torch.equal(_bits(got), _bits(ref)), spec
        exprs.add(next(iter(plan.entries.values()))[1].expr)
    assert len(exprs) == 2  # the register-fed mma kernel and the default one


def _on_side_stream(torch, dst, src, call):
    """``call()`` on a side stream right after that stream sleeps and then copies src into dst:
    only a launch on that stream sees the copied values."""
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)
        dst.copy_(src)
        got = call()
    s.synchronize()
    return got


@gpu
def test_planned_launch_follows_the_current_stream(torch_cuda, monkeypatch):
    """A hot plan, then the input written on a side stream after a long sleep: only a launch on
    that stream (read at the call, not when the plan was made) sees it."""
    torch = torch_cuda
    packed, st = _gpu_case(torch, 4096, 4096, 64, True, torch.bfloat16)
    A = torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16)
    src = torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16)
    ref = _full(src, packed, st, monkeypatch)
    qc.gemv_4bit(A, packed, st, backend="cuda")
    qc.gemv_4bit(A, packed, st, backend="cuda")
    plan = _plan_of(st)
    hits = plan.hits
    got = _on_side_stream(torch, A, src, lambda: qc.gemv_4bit(A, packed, st, backend="cuda"))
    assert plan.hits == hits + 1
    assert torch.equal(_bits(got), _bits(ref))


@gpu
def test_planned_errors_are_those_of_the_full_path(torch_cuda, monkeypatch):
    torch = torch_cuda
    packed, st = _gpu_case(torch, 256, 512, 64, True, torch.bfloat16)
    A = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    bad = {"K": lambda: qc.gemv_4bit(A[:, :256].contiguous(), packed, st, backend="cuda"),
           "dtype": lambda: qc.gemv_4bit(A.to(torch.int32), packed, st, backend="cuda"),
           "host input": lambda: qc.gemv_4bit(A.cpu(), packed, st, backend="cuda"),
           "host packed": lambda: qc.gemv_4bit(A, packed.cpu(), st, backend="cuda"),
           "packed size": lambda: qc.gemv_4bit(A, packed[:-1], st, backend="cuda"),
           "state type": lambda: qc.gemv_4bit(A, packed, {"absmax": st.absmax}, backend="cuda")}
    monkeypatch.setattr(api, "EAGER_PLANS", False)
    cold = {name: _error(f) for name, f in bad.items()}
    monkeypatch.setattr(api, "EAGER_PLANS", True)
    qc.gemv_4bit(A, packed, st, backend="cuda")
    qc.gemv_4bit(A, packed, st, backend="cuda")
    assert _plan_of(st).hits == 1
    for name, f in bad.items():
        assert cold[name] is not None and _error(f) == cold[name], name
    # a state made invalid in place (a resized array, no field assignment) is validated again
    st.state2.absmax.resize_(1)
    with pytest.raises(QuantcoreError):
        qc.gemv_4bit(A, packed, st, backend="cuda")


@gpu
def test_planned_call_captures_in_a_cuda_graph(torch_cuda):
    torch = torch_cuda
    packed, st = _gpu_case(torch, 1024, 2048, 64, True, torch.bfloat16)
    A = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        qc.gemv_4bit(A, packed, st, backend="cuda")
    plan = _plan_of(st)
    hits = plan.hits
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = qc.gemv_4bit(A, packed, st, backend="cuda")
    assert plan.hits == hits + 1
    A.copy_(torch.randn_like(A))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, qc.gemv_4bit(A, packed, st, backend="cuda"))



# -- GPU: dequantize_4bit's plans ----------------------------------------------------------------------------
def _dq_plan_of(st):
    return st._plans["dequantize_4bit"][1]


def _full_dq(packed, st, out_dtype, monkeypatch):
    return _unplanned(monkeypatch, qc.dequantize_4bit, packed, st, out_dtype)


@gpu
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True])
def test_planned_dequantize_equals_full_path_and_is_reused(torch_cuda, monkeypatch, quant_type, nested):
    torch = torch_cuda
    # 4096^2 (the vector stores), an odd element count (a half-filled last byte, scalar stores),
    # blocksize 4096 with fp32 (one block per row and more)
    for shape, bs, dtype in [((4096, 4096), 64, torch.bfloat16), ((37, 51), 32, torch.float16),
                             ((3, 5000), 4096, torch.float32)]:
        g = torch.Generator(device="cuda").manual_seed(shape[1])
        w = torch.randn(shape, device="cuda", generator=g).to(dtype)
        packed, st = qc.quantize_4bit(w, bs, quant_type, nested, backend="cuda")
        plan = None
        for out_dtype in (None, "float32", torch.float16, "bfloat16"):
            ref = _full_dq(packed, st, out_dtype, monkeypatch)
            first = qc.dequantize_4bit(packed, st, out_dtype, backend="cuda")
            plan = _dq_plan_of(st)
            hits = plan.hits
            got = qc.dequantize_4bit(packed, st, out_dtype, backend="cuda")
            assert plan.hits == hits + 1, (shape, out_dtype)
            assert got.shape == ref.shape == shape and got.dtype == ref.dtype and got.device == packed.device
            assert torch.equal(_bits(got), _bits(ref)) and torch.equal(_bits(first), _bits(ref)), (shape, out_dtype)
        assert len(plan.entries) == 4


@gpu
def test_planned_dequantize_rebuilt_errors_stream_and_graph(torch_cuda, monkeypatch):
    torch = torch_cuda
    w = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16)
    packed, st = qc.quantize_4bit(w, 64, "nf4", True, backend="cuda")
    ref = _full_dq(packed, st, None, monkeypatch)
    for _ in range(2):
        qc.dequantize_4bit(packed, st, backend="cuda")
    plan = _dq_plan_of(st)
    assert plan.hits == 1
    # a field replaced: the plan is dropped and made again for the new arrays
    st.state2.absmax = st.state2.absmax.clone()
    assert torch.equal(qc.dequantize_4bit(packed, st, backend="cuda"), ref) and _dq_plan_of(st) is not plan
    # another packed buffer holding the same codes: another plan
    plan = _dq_plan_of(st)
    assert torch.equal(qc.dequantize_4bit(packed.clone(), st, backend="cuda"), ref) and _dq_plan_of(st) is not plan
    # errors are those of the full path
    bad = {"out_dtype": lambda: qc.dequantize_4bit(packed, st, torch.int8, backend="cuda"),
           "host packed": lambda: qc.dequantize_4bit(packed.cpu(), st, backend="cuda"),
           "packed size": lambda: qc.dequantize_4bit(packed[:-1], st, backend="cuda"),
           "state type": lambda: qc.dequantize_4bit(packed, {"absmax": st.absmax}, backend="cuda")}
    monkeypatch.setattr(api, "EAGER_PLANS", False)
    cold = {name: _error(f) for name, f in bad.items()}
    monkeypatch.setattr(api, "EAGER_PLANS", True)
    for name, f in bad.items():
        assert cold[name] is not None and _error(f) == cold[name], name
    # the caller's current stream, read at the call: the packed codes written on a side stream after
    # a long sleep are seen only by a launch on that stream
    P = torch.zeros_like(packed)
    src = packed.clone()
    zeros = _full_dq(P, st, None, monkeypatch)
    for _ in range(2):
        qc.dequantize_4bit(P, st, backend="cuda")
    plan = _dq_plan_of(st)
    hits = plan.hits
    got = _on_side_stream(torch, P, src, lambda: qc.dequantize_4bit(P, st, backend="cuda"))
    assert plan.hits == hits + 1 and torch.equal(got, ref) and not torch.equal(zeros, ref)
    # a planned call captures in a CUDA graph
    P.zero_()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = qc.dequantize_4bit(P, st, backend="cuda")
    assert plan.hits == hits + 2
    P.copy_(src)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
    # a state made invalid in place (no field assignment) is validated again
    st.absmax.resize_(1)
    with pytest.raises(QuantcoreError):
        qc.dequantize_4bit(packed, st, backend="cuda")
