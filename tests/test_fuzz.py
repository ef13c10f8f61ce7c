"""Property-based fuzzing of the public API (hypothesis), on every backend available here.

For every public op, hypothesis draws argument sets (mostly valid ones with one argument
replaced by something odd: another dtype, shape, kind of object, a float or numpy scalar where an
int is expected, a tampered QuantState field ...) and checks:
- the cpu backend returns a result or raises a ``QuantcoreError`` subclass, nothing else;
- every other available backend (sycl on CI) given the same arguments as its own arrays raises
  the same exception type with the same message, or returns the same result (bit for bit for
  quantize / dequantize, within the tolerance tier's bounds for the products).
The budget is fixed (``derandomize=True``: the same examples on every run) so CI time stays
bounded; ``QC_FUZZ_EXAMPLES`` raises it for a longer hunt.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed (pip install hypothesis)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import quantcore as qc  # noqa: E402
from quantcore.arrays import BF16  # noqa: E402

EXAMPLES = int(os.environ.get("QC_FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

DTYPES = [np.float32, np.float16, BF16, np.float64, np.int8, np.uint8, np.int32, np.bool_, np.complex64]


def _other_backends() -> list[str]:
    ok = qc.available_backends()
    # device backends need a device; the fuzz compares host-reachable ones (sycl's CPU device here)
    return [n for n in ("sycl",) if n in ok and ok[n].ok]


OTHERS = _other_backends()


# -- strategies -------------------------------------------------------------------------------------------
def _dims(draw, ndim: int) -> tuple[int, ...]:
    return tuple(draw(st.sampled_from([0, 1, 2, 3, 16, 31, 32, 48, 64, 65, 96, 128])) for _ in range(ndim))


@st.composite
def arrays(draw, dtype=None, shape=None):
    dt = np.dtype(draw(st.sampled_from(DTYPES))) if dtype is None else np.dtype(dtype)
    shp = _dims(draw, draw(st.integers(0, 3))) if shape is None else shape
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    raw = rng.standard_normal(shp) * draw(st.sampled_from([1e-3, 1.0, 1e4]))
    if draw(st.booleans()) and raw.size:
        flat = raw.reshape(-1)
        flat[rng.integers(0, flat.size)] = draw(st.sampled_from([np.nan, np.inf, -np.inf, 0.0, 1e-40]))
    if dt.kind == "c":
        return raw.astype(dt)
    if dt.kind in "iub":
        return np.clip(raw * 50, -100, 100).astype(dt) if dt.kind != "b" else raw > 0
    return raw.astype(np.float32).astype(dt)


def oddities():
    """Things that are not what an argument should be."""
    return st.one_of(st.none(), st.text(max_size=3), st.floats(allow_nan=True), st.booleans(),
                     st.lists(st.floats(-2, 2), max_size=4), st.integers(-3, 3), arrays(),
                     st.builds(np.int64, st.integers(-2, 300)), st.builds(np.float32, st.floats(-1e3, 1e3)))


def scalar_ints(valid: list[int]):
    return st.one_of(st.sampled_from(valid), st.sampled_from(valid).map(np.int64),
                     st.sampled_from(valid).map(float), st.integers(-5, 5000), oddities())


def maybe(strategy, odd_rate: int = 4):
    """``strategy`` most of the time, an oddity sometimes."""
    return st.one_of(*([strategy] * odd_rate), oddities())


def float_arrays(shapes):
    return st.sampled_from(shapes).flatmap(lambda s: st.sampled_from([np.float32, np.float16, BF16]).flatmap(
        lambda d: arrays(d, s)))


# -- running one call everywhere -----------------------------------------------------------------------------
def _to_backend(be, obj):
    """``obj`` in ``be``'s own kind: arrays and numpy scalars become its arrays (a device backend
    takes no host data), QuantStates have their arrays converted."""
    if isinstance(obj, (np.ndarray, np.generic)):
        return be.from_numpy(np.asarray(obj))
    if isinstance(obj, qc.QuantState):
        fields = {f.name: _to_backend(be, getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return qc.QuantState(**fields)
    if isinstance(obj, tuple):
        return tuple(_to_backend(be, o) for o in obj)
    return obj


def _outcome(fn, args, kwargs, backend):
    try:
        return "ok", fn(*args, **kwargs, backend=backend)
    except qc.QuantcoreError as exc:
        return "error", exc
    except Exception as exc:  # noqa: BLE001 - the property under test
        pytest.fail(f"{fn.__name__} on {backend} raised {type(exc).__name__}: {exc} (not a QuantcoreError)")


def _host(be, res):
    if isinstance(res, tuple):
        return tuple(_host(be, r) for r in res)
    if isinstance(res, qc.QuantState):
        return res
    return be.to_numpy(res)


def _same(a, b, tolerance: bool) -> bool:
    if isinstance(a, tuple):
        return all(_same(x, y, tolerance) for x, y in zip(a, b) if not isinstance(x, qc.QuantState))
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not tolerance:
        return np.array_equal(a.view(np.uint8), b.view(np.uint8)) or np.array_equal(a, b, equal_nan=True)
    fa, fb = a.astype(np.float64), b.astype(np.float64)
    if np.isnan(fa).any() or np.isnan(fb).any():
        return bool(np.array_equal(np.isnan(fa), np.isnan(fb)))
    scale = max(np.abs(fa).max(initial=0.0), 1.0)
    return bool(np.abs(fa - fb).max(initial=0.0) <= 2e-2 * scale)


def check(fn, *args, tolerance: bool = False, arrays=(0,), **kwargs):
    """Call ``fn`` on cpu and on every other backend; ``arrays``: the positions (ints) and keyword
    names of the array arguments, given to another backend as its own arrays (whatever was drawn
    there); every other argument is passed as it is, also an array drawn where a number belongs."""
    kind, res = _outcome(fn, args, kwargs, "cpu")
    for name in OTHERS:
        be = qc.get_backend(name)
        oargs = tuple(_to_backend(be, a) if i in arrays or isinstance(a, qc.QuantState) else a
                      for i, a in enumerate(args))
        okw = {k: _to_backend(be, v) if k in arrays else v for k, v in kwargs.items()}
        okind, ores = _outcome(fn, oargs, okw, name)
        if kind == "error":
            assert okind == "error", f"{name} accepted what cpu rejects: {type(res).__name__}: {res}"
            assert type(ores) is type(res) and str(ores) == str(res), (
                f"{name} raised {type(ores).__name__}: {ores}; cpu raised {type(res).__name__}: {res}")
        else:
            assert okind == "ok", f"{name} raised {type(ores).__name__}: {ores}; cpu returned a result"
            assert _same(_host(qc.get_backend("cpu"), res), _host(be, ores), tolerance), f"{name} differs from cpu"


# -- bitsandbytes family ---------------------------------------------------------------------------------------
BLOCKS4 = [64, 128, 256, 32, 4096]


@FUZZ
@given(x=maybe(float_arrays([(64,), (2, 64), (3, 96), (1,), (5, 7)])), bs=scalar_ints(BLOCKS4),
       qt=maybe(st.sampled_from(["nf4", "fp4"])), cs=maybe(st.booleans()))
def test_quantize_4bit(x, bs, qt, cs):
    check(qc.quantize_4bit, x, bs, qt, cs)


def _tamper(state: qc.QuantState, field: str, value):
    d = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    d[field] = value
    return qc.QuantState(**d)


STATE_FIELDS = ["absmax", "shape", "code", "blocksize", "quant_type", "dtype", "offset", "state2"]


@st.composite
def quantized(draw):
    rng = np.random.default_rng(draw(st.integers(0, 999)))
    n, k = draw(st.sampled_from([(2, 64), (4, 128), (3, 96)]))
    w = rng.standard_normal((n, k)).astype(np.float32)
    packed, state = qc.quantize_4bit(w, draw(st.sampled_from([64, 32])), draw(st.sampled_from(["nf4", "fp4"])),
                                     draw(st.booleans()))
    if draw(st.integers(0, 2)) == 0:
        field = draw(st.sampled_from(STATE_FIELDS))
        value = draw(st.one_of(oddities(), st.just(state.absmax.astype(np.float64)), st.just((-n, k)),
                               st.just((float(n), float(k))), st.just("garbage"), st.just(64.5),
                               st.just(np.array([0.5], np.float64)), st.just({"absmax": 1})))
        state = _tamper(state, field, value)
    if draw(st.integers(0, 5)) == 0:
        packed = draw(oddities())
    return packed, state, k


@FUZZ
@given(q=quantized(), out=maybe(st.sampled_from([None, "float32", "float16", "bfloat16"])))
def test_dequantize_4bit(q, out):
    packed, state, _ = q
    check(qc.dequantize_4bit, packed, state, out, arrays=(0,))


@FUZZ
@given(q=quantized(), rows=st.sampled_from([1, 3, 9]), dt=st.sampled_from([np.float32, np.float16, BF16]),
       odd=st.integers(0, 4), junk=oddities())
def test_gemv_4bit(q, rows, dt, odd, junk):
    packed, state, k = q
    A = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32).astype(dt)
    check(qc.gemv_4bit, junk if odd == 0 else A, packed, state, tolerance=True, arrays=(0, 1))


@FUZZ
@given(x=maybe(float_arrays([(4096,), (2, 300), (1,)])), bs=scalar_ints([4096, 2048, 256, 64]))
def test_blockwise_round_trip(x, bs):
    check(qc.quantize_blockwise, x, bs)
    try:
        codes, state = qc.quantize_blockwise(x, bs)
    except qc.QuantcoreError:
        return
    check(qc.dequantize_blockwise, codes, state, arrays=(0,))


# -- ggml family -------------------------------------------------------------------------------------------------
@FUZZ
@given(x=maybe(float_arrays([(64,), (2, 64), (3, 96), (0, 64), (2, 48)])),
       fmt=st.sampled_from(["q4_0", "q8_0", "q8_1"]))
def test_ggml_quantize_round_trip(x, fmt):
    quant = getattr(qc, f"quantize_{fmt}")
    check(quant, x)
    try:
        q = quant(x)
    except qc.QuantcoreError:
        return
    check(getattr(qc, f"dequantize_{fmt}"), q, "float32", arrays=(0,))


@FUZZ
@given(q=maybe(st.sampled_from([(2, 2, 18), (0, 4, 18), (2, 0, 18), (2, 2, 17), (2, 2, 34), (2, 18)]).flatmap(
    lambda s: arrays(np.uint8, s))), out=maybe(st.sampled_from(["float32", "bfloat16"])))
def test_dequantize_ggml_odd_blocks(q, out):
    check(qc.dequantize_q4_0, q, out)


@FUZZ
@given(m=scalar_ints([4]), n=scalar_ints([2, 1]), k=scalar_ints([64]), odd=st.integers(0, 3), junk=oddities(),
       dt=st.sampled_from([np.float32, np.float16, BF16]))
def test_gemm_w4a8(m, n, k, odd, junk, dt):
    rng = np.random.default_rng(0)
    wq = qc.quantize_q4_0(rng.standard_normal((4, 64)).astype(np.float32))
    a = rng.standard_normal((2, 64)).astype(np.float32).astype(dt)
    check(qc.gemm_w4a8, junk if odd == 0 else wq, a, m, n, k, tolerance=True, arrays=(0, 1))
    aq = qc.quantize_q8_1(rng.standard_normal((2, 64)).astype(np.float32))
    check(qc.gemm_q4_0_q8_1, wq, junk if odd == 1 else aq, m, n, k, tolerance=True, arrays=(0, 1))


# -- MX family --------------------------------------------------------------------------------------------------
@FUZZ
@given(x=maybe(float_arrays([(2, 64), (1, 32), (3, 48), (2, 16)])),
       fmt=maybe(st.sampled_from(["mxfp4", "mxfp8", "nvfp4"])),
       mode=maybe(st.sampled_from(["floor", "rceil"])), gs=maybe(st.sampled_from([None, 1.0, 448.0, 0.0, np.inf])),
       swz=st.booleans())
def test_quantize_mx(x, fmt, mode, gs, swz):
    check(qc.quantize_mx, x, fmt, scale_mode=mode, global_scale=gs, swizzle=swz)


@FUZZ
@given(amax=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.none(), st.text(max_size=2),
                      st.builds(np.float32, st.floats(-10, 10)), st.integers(-3, 3)))
def test_nvfp4_global_scale(amax):
    try:
        g = qc.nvfp4_global_scale(amax)
    except qc.QuantcoreError:
        return
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"nvfp4_global_scale({amax!r}) raised {type(exc).__name__}: {exc}")
    assert np.isfinite(g) and g > 0, f"nvfp4_global_scale({amax!r}) returned {g}"


@FUZZ
@given(fmt=st.sampled_from(["mxfp4", "nvfp4", "mxfp8"]), swz=st.booleans(), odd=st.integers(0, 3),
       junk=oddities(), out=maybe(st.sampled_from(["float32", "bfloat16"])))
def test_dequantize_mx(fmt, swz, odd, junk, out):
    x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    gs = 448.0 if fmt == "nvfp4" else None
    codes, scales = qc.quantize_mx(x, fmt, global_scale=gs, swizzle=swz)
    check(qc.dequantize_mx, junk if odd == 0 else codes, junk if odd == 1 else scales, fmt, out,
          global_scale=junk if odd == 2 else gs, swizzled=swz, arrays=(0, 1))


@FUZZ
@given(odd=st.integers(0, 5), junk=oddities(), fmt=st.sampled_from(["nvfp4", "mxfp4"]))
def test_scaled_fp4_mm(odd, junk, fmt):
    rng = np.random.default_rng(2)
    gs = 448.0 if fmt == "nvfp4" else None
    a, sa = qc.quantize_mx(rng.standard_normal((3, 64)).astype(np.float32), fmt, global_scale=gs)
    b, sb = qc.quantize_mx(rng.standard_normal((5, 64)).astype(np.float32), fmt, global_scale=gs)
    args = [a, b, sa, sb, 1.0, None]
    if odd < len(args):
        args[odd] = junk
    check(qc.scaled_fp4_mm, *args, fmt=fmt, tolerance=True, arrays=(0, 1, 2, 3))


@FUZZ
@given(s=maybe(arrays(np.uint8)), rows=scalar_ints([2, 130]), cols=scalar_ints([3, 4]))
def test_swizzle_round_trip(s, rows, cols):
    check(qc.swizzle_scales, s)
    check(qc.unswizzle_scales, s, rows, cols)
