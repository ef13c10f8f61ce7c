"""The machinery every conformance case uses: cases and verdicts, guarded poisoned outputs, the
bit-exact and tolerance comparisons, seeds and test data.

How one kernel-level op is run (:func:`run_op`):

1. Inputs are copied to the backend with ``be.from_numpy``: the op sees the backend's own arrays,
   on its device.
2. Every output is a typed view ``be.view(buf, GUARD, shape, dtype)`` into a 1-D uint8 native
   buffer of ``GUARD + nbytes + GUARD`` bytes. The two guard zones hold a sentinel pattern; the
   payload holds a poison pattern (a NaN with a recognisable payload for float outputs, ``0xA5``
   for bytes).
3. The op runs twice, each time on fresh buffers with a *different* poison and sentinel (run 0:
   ``0x7FA5A5A5`` / ``0xA5`` and ``DE AD BE EF``; run 1: ``0xFFDA5A5A`` / ``0x5A`` and
   ``21 52 41 10``). After ``be.synchronize()`` the buffers come back with ``be.to_numpy``.
4. Checks, in this order, each reported under its tier:

   - safety: a guard byte changed (an out-of-bounds write, before or after the output);
   - safety: an input changed (an op must not write its inputs);
   - safety: an element unwritten: it holds run 0's poison after run 0 *and* run 1's poison after
     run 1. A written element holds the same value in both runs, which cannot equal both poisons,
     so this test has no false positives, whatever the correct value is;
   - bit-exact or tolerance: the written elements against the reference, in both runs (so a
     nondeterministic bit-exact op fails too).

Bit-exact comparison (:func:`compare_bits`) compares the bit patterns (unsigned-integer views), so
``-0.0`` differs from ``+0.0``. NaN is the one exception: where the reference is NaN the output
must be NaN, of any sign and payload (IEEE 754 leaves NaN payload propagation unspecified and
GPUs return their own canonical NaN), and where the reference is not NaN the bits must be equal.
"""

from __future__ import annotations

import contextvars
import hashlib
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from ..arrays import BF16
from ..backend import Backend, Capability

GUARD = 256  #: guard bytes on each side of every output buffer

BIT_EXACT = "bit-exact"
TOLERANCE = "tolerance"
SAFETY = "safety"
TIERS = (BIT_EXACT, TOLERANCE, SAFETY)

F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
U8 = np.dtype(np.uint8)

#: dtype names of the catalogue, in table order
DTYPES = {"float32": F32, "float16": F16, "bfloat16": BF16}


# -- cases and verdicts --------------------------------------------------------------------------
@dataclass(frozen=True)
class Failure:
    """One failed check: the tier it belongs to and what was wrong."""

    tier: str
    message: str


@dataclass
class Verdict:
    """Outcome of one case: the failed checks (none means passed) and informative notes."""

    failures: list[Failure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def tiers(self) -> set[str]:
        """The tiers with at least one failed check."""
        return {f.tier for f in self.failures}

    def fail(self, tier: str, message: str) -> None:
        assert tier in TIERS, tier
        self.failures.append(Failure(tier, message))

    def note(self, message: str) -> None:
        self.notes.append(message)

    def detail(self) -> str:
        lines = [f"[{f.tier}] {f.message}" for f in self.failures]
        return "\n".join(lines + self.notes)


@dataclass(frozen=True)
class Case:
    """One conformance case.

    ``id`` is unique and stable (it seeds the case's data, see :func:`case_seed`); ``tier`` is the
    tier the case is about (a case can still fail another tier, for example a bit-exact case whose
    op writes out of bounds fails ``safety``); ``capability`` is the catalogue entry it certifies;
    ``requires`` lists any further capabilities it needs (it runs only when the backend declares
    ``capability`` and all of ``requires``); ``run(backend, rng)`` runs it and returns a Verdict.
    """

    id: str
    tier: str
    capability: Capability
    run: Callable[[Backend, np.random.Generator], Verdict]
    requires: tuple[Capability, ...] = ()

    @property
    def op(self) -> str:
        return self.capability.op

    def needs(self) -> tuple[Capability, ...]:
        return (self.capability,) + tuple(self.requires)


def case_seed(base_seed: int, case_id: str) -> int:
    """The seed of one case: a hash of the base seed and the case id.

    Independent of which other cases run, so ``-k CASE_ID`` reproduces a failure exactly.
    """
    digest = hashlib.sha256(f"{int(base_seed)}:{case_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def pick_blocksizes(declared: Iterable[Capability], op: str, fmt: str, dtype: str, level: str) -> list[int]:
    """Block sizes to test for (op, fmt, dtype) among those the backend declares.

    ``full``: every declared one. ``quick``: the smallest, 64 (the default) and the largest
    declared, so a backend declaring any subset is still tested at the quick level.
    """
    sizes = sorted({c.blocksize for c in declared if (c.op, c.fmt, c.dtype) == (op, fmt, dtype)})
    if level == "full" or len(sizes) <= 2:
        return sizes
    keep = {sizes[0], sizes[-1]}
    if 64 in sizes:
        keep.add(64)
    return sorted(keep)


def declared_group(declared: Iterable[Capability], op: str) -> list[Capability]:
    """The declared capabilities of one op, sorted (used to pick a baseline for API cases)."""
    return sorted((c for c in declared if c.op == op),
                  key=lambda c: (c.fmt, list(DTYPES).index(c.dtype) if c.dtype in DTYPES else 9,
                                 c.blocksize))


# -- poison and guards ---------------------------------------------------------------------------
_SENTINELS = (bytes([0xDE, 0xAD, 0xBE, 0xEF]), bytes([0x21, 0x52, 0x41, 0x10]))
_FLOAT_POISON = {
    4: (0x7FA5A5A5, 0xFFDA5A5A),  # fp32 NaNs
    2: (0x7DA5, 0xFE5A),  # fp16 NaNs; as bf16 0x7DA5 is a number, so bf16 has its own pair
}
_BF16_POISON = (0x7FA5, 0xFFDA)  # bf16 NaNs
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _poison_word(dtype: np.dtype, run: int) -> int:
    dtype = np.dtype(dtype)
    if dtype == BF16:
        return _BF16_POISON[run]
    if dtype.kind == "f" and dtype.itemsize in _FLOAT_POISON:
        return _FLOAT_POISON[dtype.itemsize][run]
    byte = (0xA5, 0x5A)[run]
    return int.from_bytes(bytes([byte]) * dtype.itemsize, "little")


def _uview(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(_UINT[a.dtype.itemsize])


def guarded_buffer(shape: tuple[int, ...], dtype: np.dtype, run: int) -> np.ndarray:
    """Host bytes of one output buffer: sentinel guard, poisoned payload, sentinel guard."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    nbytes = count * dtype.itemsize
    sentinel = np.frombuffer(_SENTINELS[run] * (GUARD // 4), dtype=np.uint8)
    payload = np.full(count, _poison_word(dtype, run), dtype=_UINT[dtype.itemsize]).view(np.uint8)
    return np.concatenate([sentinel, payload, sentinel]).astype(np.uint8)[: 2 * GUARD + nbytes]


@dataclass(frozen=True)
class Out:
    """An output of an op: its name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype


@dataclass
class Perf:
    """Perf mode (``quantcore check --perf``): while a case runs with this recorder current
    (:data:`PERF`), :func:`run_op` times its op once it has been checked, with ``timer`` (a timer
    of :mod:`quantcore.bench`), and appends (microseconds, bytes: inputs read once plus outputs
    written once) to ``records``."""

    timer: Any
    reps: int = 20
    records: list[tuple[float, int]] = field(default_factory=list)


#: The recorder of the case running now (None: not in perf mode).
PERF: contextvars.ContextVar[Perf | None] = contextvars.ContextVar("quantcore_conformance_perf", default=None)


@dataclass
class OpRun:
    """What :func:`run_op` saw: the outputs of each run and any safety findings."""

    outputs: list[dict[str, np.ndarray]] = field(default_factory=list)  #: per run, by name
    unwritten: dict[str, np.ndarray] = field(default_factory=dict)  #: bool masks by output name
    error: str | None = None  #: the op (or an adapter) raised: type, message, where


def _describe_exception(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def run_op(
    be: Backend,
    call: Callable[[dict[str, Any], dict[str, Any]], None],
    inputs: dict[str, np.ndarray],
    outs: list[Out],
    verdict: Verdict,
    tier: str,
    runs: int = 2,
) -> OpRun:
    """Run a kernel-level op on guarded, poisoned outputs and record safety failures.

    ``call(native_inputs, native_outputs)`` calls the op; both dicts map names to the backend's
    native arrays. If the op raises, the case fails in ``tier`` and ``OpRun.error`` is set.
    """
    res = OpRun()
    native_in = {k: be.from_numpy(np.ascontiguousarray(v)) for k, v in inputs.items()}
    for run in range(runs):
        bufs, views = {}, {}
        for o in outs:
            bufs[o.name] = be.from_numpy(guarded_buffer(o.shape, o.dtype, run))
            views[o.name] = be.view(bufs[o.name], GUARD, tuple(o.shape), np.dtype(o.dtype))
        try:
            call(native_in, views)
            be.synchronize()
        except Exception as exc:  # noqa: BLE001 - any failure of the op is the finding
            res.error = _describe_exception(exc)
            verdict.fail(tier, f"the op raised {res.error}")
            return res
        got = {}
        for o in outs:
            raw = np.asarray(be.to_numpy(bufs[o.name])).view(np.uint8).reshape(-1)
            _check_guards(raw, o, run, verdict)
            nbytes = int(np.prod(o.shape)) * np.dtype(o.dtype).itemsize
            got[o.name] = raw[GUARD: GUARD + nbytes].copy().view(np.dtype(o.dtype)).reshape(o.shape)
        res.outputs.append(got)
    for name, original in inputs.items():
        now = np.asarray(be.to_numpy(native_in[name]))
        if now.tobytes() != np.ascontiguousarray(original).tobytes():
            verdict.fail(SAFETY, f"the op wrote into its input {name!r}")
    if runs >= 2:
        for o in outs:
            marks = [_uview(r[o.name]) == _poison_word(o.dtype, i) for i, r in enumerate(res.outputs)]
            mask = np.logical_and.reduce(marks)
            res.unwritten[o.name] = mask
            if mask.any():
                idx = np.argwhere(mask)
                verdict.fail(SAFETY, f"{int(mask.sum())} of {mask.size} elements of output {o.name!r} "
                                     f"were never written (first at index {tuple(int(i) for i in idx[0])}, "
                                     f"last at {tuple(int(i) for i in idx[-1])})")
    perf = PERF.get()
    if perf is not None:  # timed after the checks, on the same native arrays
        nbytes = sum(np.asarray(v).nbytes for v in inputs.values())
        nbytes += sum(int(np.prod(o.shape)) * np.dtype(o.dtype).itemsize for o in outs)
        perf.records.append((perf.timer.kernel([lambda: call(native_in, views)], perf.reps, 1), nbytes))
    return res


def _check_guards(raw: np.ndarray, o: Out, run: int, verdict: Verdict) -> None:
    nbytes = int(np.prod(o.shape)) * np.dtype(o.dtype).itemsize
    expect = guarded_buffer((0,), U8, run)[:GUARD]
    if raw.size != 2 * GUARD + nbytes:
        verdict.fail(SAFETY, f"buffer of output {o.name!r} came back with {raw.size} bytes, "
                             f"expected {2 * GUARD + nbytes}")
        return
    before = np.flatnonzero(raw[:GUARD] != expect)
    after = np.flatnonzero(raw[GUARD + nbytes:] != expect)
    if before.size:
        verdict.fail(SAFETY, f"out-of-bounds write before output {o.name!r}: {before.size} guard "
                             f"bytes changed, nearest at byte {int(before[-1]) - GUARD} (run {run})")
    if after.size:
        verdict.fail(SAFETY, f"out-of-bounds write after output {o.name!r}: {after.size} guard "
                             f"bytes changed, nearest at byte {nbytes + int(after[0])} of a "
                             f"{nbytes}-byte output (run {run})")


# -- comparisons -----------------------------------------------------------------------------------
def _fmt_value(v: np.ndarray) -> str:
    bits = int(_uview(np.asarray(v).reshape(1))[0])
    width = np.asarray(v).dtype.itemsize * 2
    if np.asarray(v).dtype.kind in "ui":
        return f"0x{bits:0{width}x}"
    return f"{float(np.asarray(v).astype(np.float64))!r} (0x{bits:0{width}x})"


def compare_bits(
    name: str, runs: list[dict[str, np.ndarray]], ref: np.ndarray, unwritten: np.ndarray | None,
    verdict: Verdict, tier: str = BIT_EXACT,
) -> None:
    """Every written element of output ``name``, in every run, equals ``ref`` bit for bit.

    NaN rule: a NaN reference element needs a NaN output element (any sign and payload).
    Unwritten elements are skipped here (they are already a safety failure).
    """
    for run, outputs in enumerate(runs):
        got = outputs[name]
        if got.size != np.size(ref):
            verdict.fail(tier, f"output {name!r} has {got.size} elements {got.shape}, the reference "
                               f"{np.size(ref)} {np.shape(ref)}")
            return
        if got.shape != ref.shape:
            ref = ref.reshape(got.shape)
        refc = np.ascontiguousarray(ref).astype(got.dtype, copy=False)
        diff = _uview(got) != _uview(refc)
        if got.dtype.kind == "f" or got.dtype == BF16:
            gnan = np.isnan(got.astype(np.float32))
            rnan = np.isnan(refc.astype(np.float32))
            diff = np.where(rnan, ~gnan, diff)
        if unwritten is not None:
            diff &= ~unwritten.reshape(diff.shape)
        if diff.any():
            idx = np.argwhere(diff)
            shown = ", ".join(
                f"{tuple(int(i) for i in ix)}: got {_fmt_value(got[tuple(ix)])}, "
                f"expected {_fmt_value(refc[tuple(ix)])}" for ix in idx[:4]
            )
            verdict.fail(tier, f"output {name!r}: {int(diff.sum())} of {diff.size} elements differ "
                               f"from the reference (run {run}); {shown}")
            return


#: unit roundoff (half an ulp of 1.0, relative) of each float dtype
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
#: largest absolute error of one rounding into the subnormal range (half the smallest subnormal)
UNDERFLOW_ERROR = {"float32": 2.0 ** -150, "float16": 2.0 ** -25, "bfloat16": 2.0 ** -134}


@dataclass
class Bound:
    """Per-element max-abs bound and an NMSE bound for one tolerance comparison."""

    max_abs: np.ndarray  #: fp64, the shape of the output
    nmse: float
    derivation: str


def compare_grouped(op: str, got: np.ndarray, rows: int, refs: list[tuple[int, tuple[np.ndarray, Bound]]],
                    verdict: Verdict, dtype: Any = None) -> None:
    """A grouped op's output ``[rows, sum n]`` (gemv_4bit_grouped, linear_mx_grouped): its shape (and
    ``dtype`` when given), then weight i's columns against its own (ref, bound), ``refs`` [(n_i, (ref_i,
    bound_i))] in column order."""
    want = (rows, sum(n for n, _ in refs))
    if got.shape != want or (dtype is not None and got.dtype != dtype):
        expected = f"{want}" if dtype is None else f"{np.dtype(dtype)} {want}"
        verdict.fail(TOLERANCE, f"{op} returned {got.dtype} {got.shape}, expected {expected}")
        return
    col = 0
    for i, (n, (ref, bound)) in enumerate(refs):
        name = f"out[:, weight {i}]"
        compare_tolerance(name, [{name: got[:, col:col + n]}], ref, bound, None, verdict)
        col += n


def compare_tolerance(
    name: str, runs: list[dict[str, np.ndarray]], ref: np.ndarray, bound: Bound,
    unwritten: np.ndarray | None, verdict: Verdict,
) -> None:
    """Written elements within ``bound.max_abs`` of the fp64 ``ref``, NMSE within ``bound.nmse``,
    and no NaN or Inf where the reference is finite (which it always is in the tolerance tier)."""
    ref = np.asarray(ref, dtype=np.float64)
    for run, outputs in enumerate(runs):
        got = outputs[name].astype(np.float64).reshape(ref.shape)
        written = np.ones(ref.shape, bool) if unwritten is None else ~unwritten.reshape(ref.shape)
        bad = ~np.isfinite(got) & np.isfinite(ref) & written
        if bad.any():
            ix = tuple(int(i) for i in np.argwhere(bad)[0])
            verdict.fail(TOLERANCE, f"output {name!r}: {int(bad.sum())} NaN/Inf values where the "
                                    f"reference is finite (first at {ix}: {got[ix]!r}; run {run})")
            return
        err = np.abs(got - ref)
        over = (err > bound.max_abs) & written
        if over.any():
            ratio = np.where(written, err / np.maximum(bound.max_abs, np.finfo(np.float64).tiny), 0)
            ix = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
            verdict.fail(TOLERANCE, f"output {name!r}: {int(over.sum())} of {over.size} elements exceed "
                                    f"the max-abs bound; worst at {tuple(int(i) for i in ix)}: got "
                                    f"{got[ix]!r}, reference {ref[ix]!r}, |error| {err[ix]:.3e} > bound "
                                    f"{bound.max_abs[ix]:.3e} (run {run}). {bound.derivation}")
            return
        denom = float(np.sum(ref[written] ** 2))
        nmse = float(np.sum(err[written] ** 2)) / denom if denom > 0 else 0.0
        if nmse > bound.nmse:
            verdict.fail(TOLERANCE, f"output {name!r}: NMSE {nmse:.3e} exceeds the bound "
                                    f"{bound.nmse:.3e} (run {run}). {bound.derivation}")
            return
        if run == 0:
            worst = float(np.max(np.where(written, err / np.maximum(bound.max_abs, 1e-300), 0)))
            verdict.note(f"{name}: NMSE {nmse:.2e} (bound {bound.nmse:.2e}), worst error "
                         f"{worst:.2f} of its max-abs bound")


# -- test data -------------------------------------------------------------------------------------
def finfo(dtype: np.dtype):
    return ml_dtypes.finfo(dtype) if np.dtype(dtype) == BF16 else np.finfo(dtype)


def cast(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``x`` rounded to nearest-even into ``dtype`` (through fp64, one rounding for fp32 data)."""
    x = np.asarray(x)
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(np.dtype(dtype))


def scaled_normal(rng: np.random.Generator, n: int, group: int, spread: float = 8.0) -> np.ndarray:
    """fp64 normal values whose scale changes every ``group`` elements (log-uniform,
    ``2**U(-spread, spread)``), so blocks see very different absmax values."""
    ngroups = max(1, -(-n // group))
    scales = np.exp2(rng.uniform(-spread, spread, ngroups))
    return rng.standard_normal(n) * np.repeat(scales, group)[:n]


def neighbours(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Each value rounded into ``dtype`` plus the representable values just below and above it:
    the inputs that sit on (or next to) a threshold."""
    v = cast(np.asarray(values, dtype=np.float64), dtype)
    up = np.nextafter(v, np.array(np.inf, dtype=v.dtype))
    down = np.nextafter(v, np.array(-np.inf, dtype=v.dtype))
    return np.concatenate([v, up, down])


def subnormals(rng: np.random.Generator, n: int, dtype: np.dtype) -> np.ndarray:
    """``n`` random subnormal numbers of ``dtype`` (both signs, never zero)."""
    dtype = np.dtype(dtype)
    mant_bits = {4: 23, 2: 7 if dtype == BF16 else 10}[dtype.itemsize]
    uint = _UINT[dtype.itemsize]
    mant = rng.integers(1, 1 << mant_bits, n, dtype=np.uint64)
    sign = rng.integers(0, 2, n, dtype=np.uint64) << np.uint64(8 * dtype.itemsize - 1)
    return (mant | sign).astype(uint).view(dtype)


# -- whole cases -----------------------------------------------------------------------------------
def check_op_bits(
    be: Backend, call: Callable[[dict[str, Any], dict[str, Any]], None],
    inputs: dict[str, np.ndarray], outs: list[Out], refs: dict[str, np.ndarray],
) -> Verdict:
    """Bit-exact case body: run the op guarded and poisoned, compare every output with ``refs``."""
    v = Verdict()
    r = run_op(be, call, inputs, outs, v, BIT_EXACT)
    if r.error is None:
        for o in outs:
            compare_bits(o.name, r.outputs, refs[o.name], r.unwritten.get(o.name), v)
    return v


def check_op_tolerance(
    be: Backend, call: Callable[[dict[str, Any], dict[str, Any]], None],
    inputs: dict[str, np.ndarray], out: Out, ref: np.ndarray, bound: Bound,
) -> Verdict:
    """Tolerance case body: run the op guarded and poisoned, compare its one output with the fp64
    ``ref`` under ``bound``."""
    v = Verdict()
    r = run_op(be, call, inputs, [out], v, TOLERANCE)
    if r.error is None:
        compare_tolerance(out.name, r.outputs, ref, bound, r.unwritten.get(out.name), v)
    return v
