"""ggml family: Q4_0 / Q8_0 / Q8_1 quantize and dequantize (bit-exact), gemm_q4_0_q8_1 and
gemm_w4a8 (tolerance against the fp64 reference), invalid inputs through the public API.

Besides random data, the quantizer cases include values built to expose the classic ways of
getting ggml's rounding wrong (see :func:`sensitive_blocks`): a fused multiply-add in
``x*id + 8.5``, dividing ``x / d`` instead of multiplying by ``id = 1/d``, taking ``id`` from the
fp16-rounded d, and round-half-even instead of C's ``roundf``.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import numpy as np

from ... import api
from ...backend import Backend, Capability
from ...formats import ggml
from .. import bounds
from ..harness import (
    BIT_EXACT,
    DTYPES,
    TOLERANCE,
    U8,
    Case,
    Out,
    Verdict,
    cast,
    check_op_bits,
    compare_bits,
    finfo,
    neighbours,
    run_op,
    scaled_normal,
    subnormals,
)
from ..invalid import Invalid, host_array_case, same_error_cases

FAMILY = "ggml"
FORMATS = ("q4_0", "q8_0", "q8_1")
QK = ggml.QK

QUANTIZE_KINDS = {
    "random": "[3, 96], per-block scales over 16 octaves",
    "rows-7-K256": "[7, 256]",
    "one-block": "[1, 32]",
    "1d": "a 1-D [64] input (the public API passes [K] as is)",
    "zero-blocks": "+0.0, -0.0 and mixed-sign zero blocks",
    "ties": "exact rounding ties: x*id + 8.5 an integer (Q4_0), x*id = k + 0.5 (Q8); equal +-max",
    "sensitive": "values where an FMA, x/d, an fp16-rounded d or round-half-even change the code",
    "nonfinite": "NaN, +Inf, -Inf, an all-NaN block, NaN in first position",
    "subnormal": "subnormal values of the input dtype",
    "huge": "values at the top of the dtype's range (d overflows fp16)",
}
QUANTIZE_KINDS_FULL = {"large": "[64, 4096]", "random-2": "a second random draw"}
DEQUANTIZE_KINDS = {
    "random-bytes": "[3, 4] random blocks: every code, any fp16 d including NaN / Inf",
    "roundtrip": "the reference's quantization of normal data",
    "special-d": "d = +-0, +-Inf, NaN, fp16 subnormals and 65504",
    "2d": "a 2-D [nb, bytes] input (one row), as the public API passes it",
    "one-block": "[1, 1, bytes]",
}


def _f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64)


def _targets(fmt: str, scale: float) -> tuple[np.float32, np.ndarray]:
    """The block scale ``d`` for a block whose largest element is ``scale``, and the exact
    products ``x * id`` where the code changes (Q4_0: x*id + 8.5 an integer; Q8: k + 0.5)."""
    if fmt == "q4_0":
        return np.float32(np.float32(scale) / np.float32(-8)), np.arange(0, 17) - 8.5
    return np.float32(np.float32(abs(scale)) / np.float32(127)), np.arange(-127, 127) + 0.5


def _codes_and_wrong(fmt: str, x: np.ndarray, d: np.float32) -> tuple[np.ndarray, list[np.ndarray]]:
    """Reference codes of ``x`` for scale ``d`` and the codes of the wrong implementations."""
    idv = np.float64(np.float32(1) / d)
    d64 = np.float64(d)
    id16 = np.float64(np.float32(1) / np.float32(np.float16(d)))
    if fmt == "q4_0":
        def q(v):
            return np.minimum(15, np.trunc(v))
        ref = q(_f32(_f32(x * idv) + 8.5))
        return ref, [q(_f32(x * idv + 8.5)), q(_f32(_f32(x / d64) + 8.5)), q(_f32(_f32(x * id16) + 8.5))]

    def roundf(v):
        return np.sign(v) * np.floor(np.abs(v) + 0.5)
    s = _f32(x * idv)
    return roundf(s), [roundf(_f32(x / d64)), roundf(_f32(x * id16)), np.rint(s)]


def sensitive_blocks(rng: np.random.Generator, fmt: str, dtype: str, nblocks: int) -> np.ndarray:
    """``nblocks`` blocks [nblocks, 32] (values of ``dtype``, as fp64) whose element 0 sets the
    scale and whose other elements are values where the reference code differs from at least one
    wrong implementation: FMA contraction of ``x*id + 8.5`` (Q4_0), ``x / d`` instead of
    ``x * id``, ``id`` from the fp16-rounded ``d``, round-half-even instead of ``roundf`` (Q8).
    Such values are plentiful in fp32 and rare on the fp16 / bf16 grids: of 64 random scales the
    one with the most is kept, and the block is topped up with values next to the boundaries."""
    T = DTYPES[dtype]
    blocks = []
    for _ in range(nblocks):
        best: tuple[int, float, np.ndarray, np.ndarray] | None = None
        for _trial in range(64):
            scale = float(cast(rng.uniform(1, 100) * rng.choice([-1.0, 1.0]), T).astype(np.float64))
            d, t = _targets(fmt, scale)
            x = np.unique(neighbours(t * np.float64(d), T).astype(np.float64))
            x = x[np.isfinite(x) & (np.abs(x) < abs(scale))]
            ref, wrong = _codes_and_wrong(fmt, x, d)
            hits = x[np.logical_or.reduce([w != ref for w in wrong])]
            if best is None or hits.size > best[0]:
                best = (hits.size, scale, hits, x)
            if hits.size >= 31:
                break
        _, scale, hits, near = best
        vals = hits[:31] if hits.size else np.zeros(0)
        if vals.size < 31:
            vals = np.concatenate([vals, rng.choice(near, 31 - vals.size)])
        blocks.append(np.concatenate([[scale], rng.permutation(vals)]))
    return np.array(blocks, dtype=np.float64)


def quantize_input(kind: str, fmt: str, rng: np.random.Generator, dtype: str) -> np.ndarray:
    """The float input of one ggml quantizer case, in ``dtype``."""
    T = DTYPES[dtype]
    info = finfo(T)
    if kind in ("random", "random-2"):
        return cast(scaled_normal(rng, 3 * 96, QK).reshape(3, 96), T)
    if kind == "large":
        return cast(scaled_normal(rng, 64 * 4096, QK).reshape(64, 4096), T)
    if kind == "rows-7-K256":
        return cast(scaled_normal(rng, 7 * 256, QK).reshape(7, 256), T)
    if kind == "one-block":
        return cast(rng.standard_normal((1, 32)), T)
    if kind == "1d":
        return cast(scaled_normal(rng, 64, QK), T)
    if kind == "zero-blocks":
        x = scaled_normal(rng, 2 * 128, QK).reshape(2, 128)
        x[0, 32:64] = 0.0
        x[0, 96:128] = 0.0
        x[0, 96] = -0.0  # llama.cpp's max starts at +0.0: d = -0.0 here too
        x[1, 0:32] = -0.0
        x[1, 96:] = 0.0
        return cast(x, T)
    if kind == "ties":
        blocks = []
        if fmt == "q4_0":
            half = np.arange(-8, 8) + 0.5  # x*id + 8.5 is an integer when d = +-1
            for sign in (1.0, -1.0):  # max -8 gives d = 1; max +8 gives d = -1
                v = rng.permutation(np.concatenate([half, half]))[:31]
                blocks.append(np.concatenate([[-8.0 * sign], v * sign]))
            v = neighbours(half, T).astype(np.float64)
            blocks.append(np.concatenate([[-8.0], rng.choice(v[np.abs(v) < 8], 31)]))
            eq = rng.standard_normal(32)  # +8 and -8: the first of equal magnitude sets d
            eq[3], eq[17] = 8.0, -8.0
            blocks.append(eq)
            eq2 = eq.copy()
            eq2[3], eq2[17] = -8.0, 8.0
            blocks.append(eq2)
        else:
            for amax, scale in ((127.0, 1.0), (63.5, 0.5)):  # d = 1 and d = 0.5 exactly
                k = rng.integers(-126, 126, 31) + 0.5
                blocks.append(np.concatenate([[amax], k * scale]))
            v = neighbours((np.arange(-126, 126) + 0.5), T).astype(np.float64)
            blocks.append(np.concatenate([[-127.0], rng.choice(v[np.abs(v) < 127], 31)]))
        return cast(np.array(blocks).reshape(1, -1), T)
    if kind == "sensitive":
        return cast(sensitive_blocks(rng, fmt, dtype, 4).reshape(2, -1), T)
    if kind == "nonfinite":
        x = scaled_normal(rng, 2 * 160, QK).reshape(2, 160)
        x[0, 3] = np.nan
        x[0, 40] = np.inf
        x[0, 70] = -np.inf
        x[0, 75] = np.inf
        x[0, 96:128] = np.nan
        x[1, 0] = np.nan
        x[1, 32] = -np.inf
        x[1, 140] = np.nan
        return cast(x, T)
    if kind == "subnormal":
        x = cast(scaled_normal(rng, 128, QK), T).reshape(1, 128)
        x[0, :32] = subnormals(rng, 32, T)
        x[0, 32:64] = subnormals(rng, 32, T)
        x[0, 40] = T.type(1.0)
        x[0, 64:96] = T.type(0.0)
        x[0, 70] = info.smallest_subnormal
        return x
    if kind == "huge":
        big = float(info.max)
        x = rng.uniform(0.5, 1.0, 128) * rng.choice([-1.0, 1.0], 128) * big
        x[32:64] = rng.standard_normal(32) * 1e-3
        x[40] = -big
        x[96:] = rng.standard_normal(32)
        return cast(x.reshape(1, 128), T)
    raise KeyError(kind)


def _reference_quantize(fmt: str, x: np.ndarray) -> np.ndarray:
    return getattr(ggml, f"quantize_{fmt}")(x.reshape(-1, x.shape[-1]))


def _quantize(cap: Capability, kind: str, be: Backend, rng: np.random.Generator) -> Verdict:
    fmt = cap.fmt
    x = quantize_input(kind, fmt, rng, cap.dtype)
    ref = _reference_quantize(fmt, x)

    def call(i, o):
        getattr(be, f"quantize_{fmt}")(i["x"], o["out"])

    return check_op_bits(be, call, {"x": x}, [Out("out", ref.shape, U8)], {"out": ref})


def _blocks_for(fmt: str, rng: np.random.Generator, rows: int, nb: int) -> np.ndarray:
    return _reference_quantize(fmt, scaled_normal(rng, rows * nb * QK, QK).reshape(rows, nb * QK)
                               .astype(np.float32)).reshape(rows, nb, ggml.BLOCK_BYTES[fmt])


def _dequantize(cap: Capability, kind: str, be: Backend, rng: np.random.Generator) -> Verdict:
    fmt, T = cap.fmt, DTYPES[cap.dtype]
    nbytes = ggml.BLOCK_BYTES[fmt]
    q = rng.integers(0, 256, (3, 4, nbytes), dtype=np.uint8)
    if kind == "roundtrip":
        q = _blocks_for(fmt, rng, 3, 4)
    elif kind == "special-d":
        q = _blocks_for(fmt, rng, 2, 8)
        specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 6e-8, -3e-5, 65504.0], dtype=np.float16)
        q[0, :, 0:2] = specials.view(np.uint8).reshape(8, 2)
        q[1, :, 0:2] = np.ascontiguousarray(specials[::-1]).view(np.uint8).reshape(8, 2)
    elif kind == "2d":
        q = q[0]
    elif kind == "one-block":
        q = q[:1, :1]
    rows = q.shape[0] if q.ndim == 3 else 1
    k = q.shape[-2] * QK
    flat = q.reshape(rows, -1, nbytes)
    vals = ggml.dequantize_q4_0(flat) if fmt == "q4_0" else ggml.dequantize_q8(flat, fmt)
    ref = vals.astype(T).reshape(rows, k)

    def call(i, o):
        be.dequantize_ggml(i["q"], o["out"], fmt=fmt)

    return check_op_bits(be, call, {"q": q}, [Out("out", (rows, k), T)], {"out": ref})


# -- tolerance: the W4A8 GEMMs -------------------------------------------------------------------------
def gemm_shapes(level: str) -> list[tuple[int, int, int]]:
    """(M, N, K): M off every tile multiple, N = 1..8 (the mmvq path), 9, 16, 17, 33, 64, 100 and
    512 (the tensor-core / tiled paths, partial tiles, tiles of up to 128 x 128), K from one block to
    4096 (14336 at full level), K a multiple of 256 (whole 8-block stages) or not, K off the tiled
    kernels' step of two blocks."""
    quick = [(33, 1, 32), (64, 8, 96), (7, 9, 256), (130, 3, 1024), (1, 33, 4096), (16, 64, 128),
             (67, 2, 224), (5, 5, 160), (100, 100, 224), (130, 16, 288), (150, 100, 512)]
    if level == "quick":
        return quick
    return quick + [(67, n, 224) for n in (1, 3, 4, 6, 7)] + [
        (1, 1, 32), (257, 2, 4096), (31, 512, 256), (64, 64, 4096), (200, 17, 512),
        (96, 4, 14336), (129, 33, 1056), (257, 512, 1024), (300, 100, 1056), (140, 64, 2080),
        (131, 17, 2048)]


def _weights(rng: np.random.Generator, m: int, k: int, random_codes: bool) -> np.ndarray:
    w = rng.standard_normal((m, k)) * np.exp2(rng.uniform(-3, 3, (m, 1)))
    wq = ggml.quantize_q4_0(w.astype(np.float32))
    if random_codes:
        wq[..., 2:] = rng.integers(0, 256, wq[..., 2:].shape, dtype=np.uint8)
    return wq


def _gemm_reference(wq: np.ndarray, aq: np.ndarray):
    d4, q4 = ggml.unpack_q4_0(wq)
    d8, q8, s8 = ggml.unpack_q8(aq, "q8_1")
    return bounds.gemm_q4_0_q8_1(d4, q4, d8, q8, s8)


def _gemm_check(be: Backend, call, inputs: dict, m: int, n: int, ref, bound) -> Verdict:
    from ..harness import compare_tolerance

    v = Verdict()
    r = run_op(be, call, inputs, [Out("out", (m, n), np.dtype(np.float32))], v, TOLERANCE)
    if r.error is None:
        compare_tolerance("out", r.outputs, ref, bound, r.unwritten.get("out"), v)
    return v


def _gemm_q4_0_q8_1(cap: Capability, shape, random_codes: bool, be: Backend, rng: np.random.Generator
                    ) -> Verdict:
    m, n, k = shape
    wq = _weights(rng, m, k, random_codes)
    a = rng.standard_normal((n, k)).astype(np.float32)
    aq = ggml.quantize_q8_1(a)
    if random_codes:
        aq[..., 2:4] = np.float16(rng.uniform(-40, 40, aq.shape[:2])).view(np.uint8).reshape(*aq.shape[:2], 2)
        aq[..., 4:] = rng.integers(0, 256, aq[..., 4:].shape, dtype=np.uint8)
    ref, bound = _gemm_reference(wq, aq)

    def call(i, o):
        be.gemm_q4_0_q8_1(i["wq"], i["aq"], o["out"])

    return _gemm_check(be, call, {"wq": wq, "aq": aq}, m, n, ref, bound)


def _gemm_w4a8(cap: Capability, shape, a_1d: bool, be: Backend, rng: np.random.Generator) -> Verdict:
    m, n, k = shape
    wq = _weights(rng, m, k, False)
    a = cast(rng.standard_normal((n, k)) * np.exp2(rng.uniform(-2, 2, (n, 1))), DTYPES[cap.dtype])
    ref, bound = _gemm_reference(wq, ggml.quantize_q8_1(a))
    if a_1d:
        a = a.reshape(k)

    def call(i, o):
        be.gemm_w4a8(i["wq"], i["a"], o["out"])

    return _gemm_check(be, call, {"wq": wq, "a": a}, m, n, ref, bound)


# -- the public API end to end ---------------------------------------------------------------------------
def _api_roundtrip(cap: Capability, be: Backend, rng: np.random.Generator) -> Verdict:
    """quantize_<fmt> then dequantize_<fmt> through the public API with 2-D and 1-D inputs,
    compared bit for bit with the reference backend on numpy arrays."""
    from ...backends.reference import ReferenceBackend

    v = Verdict()
    fmt = cap.fmt
    x = cast(scaled_normal(rng, 3 * 64, QK).reshape(3, 64), DTYPES[cap.dtype])
    quant = getattr(api, f"quantize_{fmt}")
    dequant = getattr(api, f"dequantize_{fmt}")
    res = []
    for backend, arr, back in ((ReferenceBackend(), lambda t: t, np.asarray),
                               (be, be.from_numpy, lambda t: np.asarray(be.to_numpy(t)))):
        q2 = quant(arr(x), backend=backend)
        q1 = quant(arr(x[1]), backend=backend)
        res.append({"q-2d": back(q2), "q-1d": back(q1),
                    "x-2d": back(dequant(q2, cap.dtype, backend=backend)),
                    "x-1d": back(dequant(q1, cap.dtype, backend=backend))})
    for name, ref in res[0].items():
        if res[1][name].shape != ref.shape:
            v.fail(BIT_EXACT, f"{name}: shape {res[1][name].shape}, the reference backend gives {ref.shape}")
            continue
        compare_bits(name, [res[1]], ref, None, v)
    return v


def _api_gemm(cap: Capability, be: Backend, rng: np.random.Generator) -> Verdict:
    """gemm_q4_0_q8_1 and gemm_w4a8 through the public API (N = 1 with a 1-D activation)."""
    from ..harness import compare_tolerance

    v = Verdict()
    m, k = 9, 128
    wq = _weights(rng, m, k, False)
    for n in (1, 4):
        a = cast(rng.standard_normal((n, k)), DTYPES[cap.dtype])
        aq = ggml.quantize_q8_1(a)
        ref, bound = _gemm_reference(wq, aq)
        if cap.op == "gemm_w4a8":
            out = api.gemm_w4a8(be.from_numpy(wq), be.from_numpy(a.reshape(k) if n == 1 else a), m, n, k,
                                backend=be)
        else:
            out = api.gemm_q4_0_q8_1(be.from_numpy(wq), be.from_numpy(aq), m, n, k, backend=be)
        got = np.asarray(be.to_numpy(out))
        if got.shape != (m, n) or got.dtype != np.float32:
            v.fail(TOLERANCE, f"{cap.op} returned {got.dtype} {got.shape}, expected float32 {(m, n)}")
            continue
        compare_tolerance(f"out-N{n}", [{f"out-N{n}": got}], ref, bound, None, v)
    return v


# -- invalid inputs ------------------------------------------------------------------------------------------
def _invalid() -> list[Invalid]:
    w = np.linspace(-1, 1, 4 * 64, dtype=np.float32).reshape(4, 64)
    wq = ggml.quantize_q4_0(w)
    aq = ggml.quantize_q8_1(w[:2])
    a8 = ggml.quantize_q8_0(w[:2])
    g = "gemm_q4_0_q8_1"
    return [
        Invalid("K-48", "quantize_q4_0", lambda arr, be: lambda: api.quantize_q4_0(
            arr(np.ones((2, 48), np.float32)), backend=be)),
        Invalid("3d-input", "quantize_q4_0", lambda arr, be: lambda: api.quantize_q4_0(
            arr(np.ones((2, 2, 32), np.float32)), backend=be)),
        Invalid("int8-input", "quantize_q4_0", lambda arr, be: lambda: api.quantize_q4_0(
            arr(np.ones((2, 32), np.int8)), backend=be)),
        Invalid("empty-input", "quantize_q8_0", lambda arr, be: lambda: api.quantize_q8_0(
            arr(np.ones((0, 32), np.float32)), backend=be)),
        Invalid("K-31", "quantize_q8_1", lambda arr, be: lambda: api.quantize_q8_1(
            arr(np.ones((2, 31), np.float32)), backend=be)),
        Invalid("17-byte-blocks", "dequantize_ggml", lambda arr, be: lambda: api.dequantize_q4_0(
            arr(np.zeros((2, 2, 17), np.uint8)), backend=be)),
        Invalid("float-blocks", "dequantize_ggml", lambda arr, be: lambda: api.dequantize_q8_0(
            arr(np.zeros((2, 2, 34), np.float32)), backend=be)),
        Invalid("out-dtype-float64", "dequantize_ggml", lambda arr, be: lambda: api.dequantize_q8_1(
            arr(aq), "float64", backend=be)),
        Invalid("empty-blocks", "dequantize_ggml", lambda arr, be: lambda: api.dequantize_q4_0(
            arr(np.zeros((0, 4, 18), np.uint8)), backend=be)),
        Invalid("list-input", "quantize_q4_0", lambda arr, be: lambda: api.quantize_q4_0(
            [[0.5] * 64], backend=be)),
        Invalid("M-numpy-int", g, lambda arr, be: lambda: api.gemm_q4_0_q8_1(  # valid: numpy ints are ints
            arr(wq), arr(aq), np.int64(4), np.int32(2), np.int64(64), backend=be)),
        Invalid("M-0", g, lambda arr, be: lambda: api.gemm_q4_0_q8_1(arr(wq), arr(aq), 0, 2, 64, backend=be)),
        Invalid("M-float", g, lambda arr, be: lambda: api.gemm_q4_0_q8_1(arr(wq), arr(aq), 4.0, 2, 64,
                                                                          backend=be)),
        Invalid("K-48", g, lambda arr, be: lambda: api.gemm_q4_0_q8_1(arr(wq), arr(aq), 4, 2, 48, backend=be)),
        Invalid("wq-wrong-rows", g, lambda arr, be: lambda: api.gemm_q4_0_q8_1(arr(wq[:3]), arr(aq), 4, 2, 64,
                                                                               backend=be)),
        Invalid("aq-is-q8_0", g, lambda arr, be: lambda: api.gemm_q4_0_q8_1(arr(wq), arr(a8), 4, 2, 64,
                                                                            backend=be)),
        Invalid("valid-call", g, lambda arr, be: lambda: api.gemm_q4_0_q8_1(arr(wq), arr(aq), 4, 2, 64,
                                                                            backend=be)),
        Invalid("a-wrong-shape", "gemm_w4a8", lambda arr, be: lambda: api.gemm_w4a8(
            arr(wq), arr(np.ones((3, 64), np.float32)), 4, 2, 64, backend=be)),
        Invalid("a-int32", "gemm_w4a8", lambda arr, be: lambda: api.gemm_w4a8(
            arr(wq), arr(np.ones((2, 64), np.int32)), 4, 2, 64, backend=be)),
    ]


def _host_quantize(be: Backend, cap: Capability):
    return api.quantize_q4_0(cast(np.linspace(-1, 1, 64).reshape(1, 64), DTYPES[cap.dtype]), backend=be)


# -- the family's cases ------------------------------------------------------------------------------------
def cases(level: str, declared: frozenset[Capability]) -> Iterable[Case]:
    """Every ggml case for the declared capabilities at ``level``."""
    kinds = list(QUANTIZE_KINDS) + (list(QUANTIZE_KINDS_FULL) if level == "full" else [])
    for fmt in FORMATS:
        for dtype in DTYPES:
            cap = Capability(f"quantize_{fmt}", fmt, dtype, QK)
            if cap in declared:
                for kind in kinds:
                    yield Case(f"ggml/quantize_{fmt}/{fmt}/{dtype}/bs32/{kind}", BIT_EXACT, cap,
                               partial(_quantize, cap, kind))
                need = (Capability("dequantize_ggml", fmt, dtype, QK),)
                if all(c in declared for c in need):
                    yield Case(f"ggml/quantize_{fmt}/{fmt}/{dtype}/bs32/api-roundtrip", BIT_EXACT, cap,
                               partial(_api_roundtrip, cap), requires=need)
            cap = Capability("dequantize_ggml", fmt, dtype, QK)
            if cap in declared:
                for kind in DEQUANTIZE_KINDS:
                    yield Case(f"ggml/dequantize_ggml/{fmt}/{dtype}/bs32/{kind}", BIT_EXACT, cap,
                               partial(_dequantize, cap, kind))
    cap = Capability("gemm_q4_0_q8_1", "q4_0", "float32", QK)
    if cap in declared:
        for shape in gemm_shapes(level):
            m, n, k = shape
            yield Case(f"ggml/gemm_q4_0_q8_1/q4_0/float32/bs32/M{m}-N{n}-K{k}", TOLERANCE, cap,
                       partial(_gemm_q4_0_q8_1, cap, shape, False))
        yield Case("ggml/gemm_q4_0_q8_1/q4_0/float32/bs32/M19-N6-K160-random-codes", TOLERANCE, cap,
                   partial(_gemm_q4_0_q8_1, cap, (19, 6, 160), True))
        yield Case("ggml/gemm_q4_0_q8_1/q4_0/float32/bs32/api", TOLERANCE, cap, partial(_api_gemm, cap))
    for dtype in DTYPES:
        cap = Capability("gemm_w4a8", "q4_0", dtype, QK)
        if cap not in declared:
            continue
        for shape in gemm_shapes(level):
            m, n, k = shape
            yield Case(f"ggml/gemm_w4a8/q4_0/{dtype}/bs32/M{m}-N{n}-K{k}", TOLERANCE, cap,
                       partial(_gemm_w4a8, cap, shape, False))
        yield Case(f"ggml/gemm_w4a8/q4_0/{dtype}/bs32/M33-N1-K256-a-1d", TOLERANCE, cap,
                   partial(_gemm_w4a8, cap, (33, 1, 256), True))
        yield Case(f"ggml/gemm_w4a8/q4_0/{dtype}/bs32/api", TOLERANCE, cap, partial(_api_gemm, cap))
    yield from same_error_cases(FAMILY, _invalid(), declared)
    yield from host_array_case(FAMILY, "quantize_q4_0", declared, _host_quantize)
