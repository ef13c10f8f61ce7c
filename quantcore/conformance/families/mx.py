"""MX family: NVFP4, MXFP4, MXFP8 quantize / dequantize and the swizzled scale layout (bit-exact),
scaled_fp4_mm and linear_mx (tolerance against an fp64 reference), invalid inputs through the
public API.

linear_mx (weight-only fp4: ``out = T(x @ W^T)``) is held to
:func:`quantcore.conformance.bounds.linear_mx`; its cases run with row-major and with swizzled
scales (garbage in the swizzle padding), B in {1, 5, 16}, N off the 128-row tiles and K a
multiple of the block only (:data:`LINEAR_KINDS`).

Bit-exact against :mod:`quantcore.formats.mx`. Every quantize / dequantize case runs the op with
row-major scales and with swizzled scales (the 128x4 tile layout, whose padding the op must write
as zeros); MX quantize cases run in both scale modes (floor and rceil). The adversarial inputs
are listed in :data:`QUANTIZE_KINDS` / :data:`DEQUANTIZE_KINDS`.

scaled_fp4_mm bound (``out = bf16(alpha * sum_k A[m,k] B[n,k] + bias[n])``): the operands
``A = e2m1 * scale`` are exact in fp64, the reference is exact (fp64). Allowed arithmetic: each
product term formed with at most ``c = 4`` fp32 roundings (for example a per-block partial sum
times the block scales; dequantizing to bf16 tiles is exact and costs none), the K terms added in
fp32 in any order, alpha and bias applied with one fp32 rounding each, one rounding to bf16. With
``S = |alpha| sum_k |A B|`` and ``u`` the unit roundoffs (harness.UNIT_ROUNDOFF):

    |out - ref| <= 1.05 * (u_bf16 |ref| + (c + K + 1) u32 (S + |bias|)) + c K eta_32 + eta_bf16

and, with ``Q = alpha^2 sum_k (A B)^2`` and the statistical argument of :mod:`..bounds`,
``NMSE <= 16 * sum (u_bf16^2 ref^2 + (c + K) u32^2 Q) / sum ref^2``.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import numpy as np

from ... import api_mx
from ...arrays import BF16
from ...backend import Backend, Capability
from ...formats import mx
from ..harness import (
    BIT_EXACT,
    DTYPES,
    TOLERANCE,
    U8,
    UNDERFLOW_ERROR,
    UNIT_ROUNDOFF,
    Bound,
    Case,
    Out,
    Verdict,
    cast,
    check_op_bits,
    check_op_tolerance,
    compare_bits,
    finfo,
    neighbours,
    scaled_normal,
    subnormals,
)
from ..invalid import Invalid, host_array_case, same_error_cases

FAMILY = "mx"
SWZ = ("scales128x4", "uint8", mx.SWIZZLE_TILE_BYTES)

QUANTIZE_KINDS = {
    "random": "[5, 8 blocks], per-block scales over 16 octaves",
    "partial-tiles": "[130, 6 blocks]: 130 rows and 6 scale columns fill neither a 128-row nor a "
                     "4-column swizzle tile",
    "one-block": "[1, one block]",
    "3d": "a [2, 3, K] input (rows = 6)",
    "zero-blocks": "+0.0 and -0.0 blocks, and blocks so small their scale is zero",
    "ties": "element rounding ties (E2M1 / E4M3 midpoints) and one ulp either side; for nvfp4 "
            "also block amax values whose scale g * amax / 6 sits on an E4M3 tie",
    "scale-boundaries": "block amax max_elem * 2^e and one ulp either side, e over the dtype's "
                        "range (where floor and rceil part; fp32 log2 arithmetic gets rceil wrong)",
    "nonfinite": "NaN, +Inf, -Inf (MX: scale 0xFF; nvfp4: NaN scale or saturated scale)",
    "subnormal": "subnormal values of the input dtype, alone and beside normal ones",
    "huge": "values at the top of the dtype's range beside tiny ones",
}
QUANTIZE_KINDS_FULL = {"large": "[64, 4096]", "random-2": "a second random draw"}
#: extra nvfp4 kinds: the global scale is a free parameter of the op
NVFP4_KINDS = {
    "g-saturates": "g ten times 2688 / amax: the largest block scales saturate at 448",
    "g-one": "g = 1 (no global scaling): scales are amax / 6 rounded to E4M3",
    "sensitive": "values where another operation order changes a code or a scale: x * (g / s), "
                 "(x * g) / s, x / (s / g) for the elements; (g * amax) / 6, (g * amax) * (1/6) "
                 "for the scale",
}
SENSITIVE_G = np.float32(2688.0 / 97.0)
DEQUANTIZE_KINDS = {
    "random-bytes": "[5, 8 blocks] of random codes and random scale bytes (every value: E8M0 0 "
                    "and 0xFF, E4M3 NaN, negative and subnormal scales)",
    "roundtrip": "the reference's quantization of normal data",
    "special-scales": "each special scale byte in turn (E8M0: 0, 1, 127, 253, 254, 255; E4M3: "
                      "+-0, the smallest subnormal, 2^-6, 448, NaN)",
    "partial-tiles": "[130, 6 blocks]; the swizzled input has garbage in its padding",
    "3d": "codes [2, 3, K/2] (the public API passes the caller's leading dimensions)",
}


def _blk(fmt: str) -> int:
    return mx.block_size(fmt)


def _modes(fmt: str) -> tuple[str | None, ...]:
    return (None,) if fmt == "nvfp4" else mx.SCALE_MODES


def _elem_midpoints(fmt: str) -> np.ndarray:
    """Rounding midpoints of the element format (positive)."""
    if mx.element_format(fmt) == "e2m1":
        return mx.E2M1_MIDPOINTS.astype(np.float64)
    vals = mx.e4m3_decode(np.arange(0x7F, dtype=np.uint8)).astype(np.float64)
    return (vals[:-1] + vals[1:]) / 2


def _global_scale(x: np.ndarray) -> np.float32:
    a = np.abs(np.asarray(x, dtype=np.float64))
    a = a[np.isfinite(a)]
    amax = float(a.max()) if a.size and a.max() > 0 else 1.0
    return mx.nvfp4_global_scale(amax)


def quantize_input(kind: str, fmt: str, rng: np.random.Generator, dtype: str) -> np.ndarray:
    """The float input of one quantizer case, in ``dtype``."""
    T = DTYPES[dtype]
    blk = _blk(fmt)
    info = finfo(T)
    if kind in ("random", "random-2", "g-saturates", "g-one"):
        return cast(scaled_normal(rng, 5 * 8 * blk, blk).reshape(5, 8 * blk), T)
    if kind == "large":
        return cast(scaled_normal(rng, 64 * 4096, blk).reshape(64, 4096), T)
    if kind == "partial-tiles":
        return cast(scaled_normal(rng, 130 * 6 * blk, blk).reshape(130, 6 * blk), T)
    if kind == "one-block":
        return cast(rng.standard_normal((1, blk)), T)
    if kind == "3d":
        return cast(scaled_normal(rng, 6 * 2 * blk, blk).reshape(2, 3, 2 * blk), T)
    if kind == "zero-blocks":
        x = scaled_normal(rng, 2 * 4 * blk, blk, spread=2.0).reshape(2, 4 * blk)
        x[0, :blk] = 0.0
        x[1, :blk] = -0.0
        x[1, 2 * blk:3 * blk] = 0.0
        x[0, 3 * blk:] = rng.standard_normal(blk) * 1e-6  # nvfp4: scale rounds to zero
        return cast(x, T)
    if kind == "ties":
        return cast(_ties(fmt, rng, T), T)
    if kind == "sensitive":
        return cast(_sensitive_nvfp4(rng, T), T)
    if kind == "scale-boundaries":
        top = mx.MAX_ELEM[mx.element_format(fmt)]
        lo, hi = np.log2(float(info.tiny)) + 12, np.log2(float(info.max) / top) - 1
        amax = neighbours(top * np.exp2(np.round(np.linspace(lo, hi, 8))), T).astype(np.float64)
        x = rng.uniform(-1, 1, (amax.size, blk)) * amax[:, None]
        x[:, 0] = amax * rng.choice([-1.0, 1.0], amax.size)
        return cast(x.reshape(1, -1), T)
    if kind == "nonfinite":
        x = scaled_normal(rng, 2 * 5 * blk, blk, spread=4.0).reshape(2, 5 * blk)
        x[0, 3] = np.nan
        x[0, blk + 1] = np.inf
        x[0, 2 * blk + 2] = -np.inf
        x[0, 2 * blk + 5] = np.nan
        x[1, blk:2 * blk] = np.nan
        x[1, 3 * blk] = np.inf
        x[1, 3 * blk + 1] = -np.inf
        return cast(x, T)
    if kind == "subnormal":
        x = cast(scaled_normal(rng, 4 * blk, blk, spread=2.0), T).reshape(1, 4 * blk)
        x[0, :blk] = subnormals(rng, blk, T)
        x[0, blk:2 * blk] = subnormals(rng, blk, T)
        x[0, blk + 3] = T.type(1e-3)
        x[0, 2 * blk + 1] = info.smallest_subnormal
        return x
    if kind == "huge":
        big = float(info.max)
        x = rng.uniform(0.5, 1.0, 4 * blk) * rng.choice([-1.0, 1.0], 4 * blk) * big
        x[blk:2 * blk] = rng.standard_normal(blk) * 1e-3
        x[blk + 2] = -big
        x[3 * blk:] = rng.standard_normal(blk)
        return cast(x.reshape(1, 4 * blk), T)
    raise KeyError(kind)


def _ties(fmt: str, rng: np.random.Generator, T: np.dtype) -> np.ndarray:
    """Blocks whose elements (scaled) land on the element format's rounding midpoints, or next to
    them; for nvfp4, also blocks whose scale value sits on an E4M3 midpoint."""
    blk = _blk(fmt)
    mids = _elem_midpoints(fmt)
    top = mx.MAX_ELEM[mx.element_format(fmt)]
    rows = []
    if fmt != "nvfp4":
        for e in (-3, 0, 2):  # block amax top * 2^e gives the block exponent e in both modes
            cand = neighbours(mids * 2.0**e, T).astype(np.float64)
            cand = cand[np.isfinite(cand) & (np.abs(cand) < top * 2.0**e)]
            vals = rng.choice(cand, blk - 1) * rng.choice([-1.0, 1.0], blk - 1)
            rows.append(np.concatenate([[top * 2.0**e], vals]))
        return np.concatenate(rows).reshape(1, -1)
    g = np.float32(2688.0 / 100.0)
    for amax_b in (6.0, 30.0, 99.0):
        s8 = mx.nvfp4_block_scales(np.array([amax_b], np.float32), g)
        s = float(mx.e4m3_decode(s8)[0])
        os = float(np.float32(g * (np.float32(1) / np.float32(s))))
        cand = neighbours(mids / os, T).astype(np.float64)
        cand = cand[np.isfinite(cand) & (np.abs(cand) < amax_b)]
        vals = rng.choice(cand, blk - 1) * rng.choice([-1.0, 1.0], blk - 1)
        rows.append(np.concatenate([[amax_b], vals]))
    # block amax whose g * amax * (1/6) is an E4M3 midpoint, or next to one
    e4 = _elem_midpoints("mxfp8")
    scale_mids = neighbours(e4[(e4 > 2.0**-6) & (e4 < 400)] * 6.0 / float(g), T).astype(np.float64)
    for amax_b in rng.choice(scale_mids[scale_mids < 100.0], 3):
        vals = rng.uniform(-1, 1, blk - 1) * amax_b
        rows.append(np.concatenate([[amax_b], vals]))
    rows.append(np.concatenate([[100.0], rng.uniform(-100, 100, blk - 1)]))  # sets g's amax
    return np.concatenate(rows).reshape(1, -1)


def _f(v) -> np.ndarray:
    return np.asarray(v, dtype=np.float32)


def _sensitive_nvfp4(rng: np.random.Generator, T: np.dtype, nblocks: int = 6) -> np.ndarray:
    """Blocks (values of T, as fp64) that tell quantcore's NVFP4 order from the usual other ones.

    Elements: for a block amax, the values of T next to each E2M1 midpoint / os; those where
    ``x * (g / s)``, ``(x * g) / s`` or ``x / (s / g)`` give another code are kept (of 64 random
    block amax values, the one with the most). Scales: block amax values of T next to
    E4M3 midpoint * 6 / g where ``(g * amax) / 6`` or ``(g * amax) * (1/6)`` round differently."""
    g = SENSITIVE_G
    inv6 = mx.NVFP4_INV_E2M1_MAX
    mids = mx.E2M1_MIDPOINTS.astype(np.float64)
    blocks = []
    with np.errstate(all="ignore"):
        for _ in range(nblocks - 2):
            best: tuple[int, float, np.ndarray, np.ndarray] | None = None
            for _trial in range(64):
                amax = float(cast(rng.uniform(1.0, 96.0), T).astype(np.float64))
                s = mx.e4m3_decode(mx.nvfp4_block_scales(_f([amax]), g))[0]
                os = _f(g * _f(np.float32(1) / s))
                c = np.unique(neighbours(mids / float(os), T).astype(np.float64))
                c = c[np.isfinite(c) & (c < amax)]
                c32 = _f(c)
                ref = mx.e2m1_round_codes(_f(c32 * os))
                wrong = [mx.e2m1_round_codes(_f(c32 * _f(g / s))),
                         mx.e2m1_round_codes(_f(_f(c32 * g) / s)),
                         mx.e2m1_round_codes(_f(c32 / _f(s / g)))]
                hits = c[np.logical_or.reduce([w != ref for w in wrong])]
                if best is None or hits.size > best[0]:
                    best = (hits.size, amax, hits, c)
            _, amax, hits, near = best
            vals = hits[:15] if hits.size else np.zeros(0)
            if vals.size < 15:
                vals = np.concatenate([vals, rng.choice(near, 15 - vals.size)])
            blocks.append(np.concatenate([[amax], rng.permutation(vals) * rng.choice([-1.0, 1.0], 15)]))
        e4 = _elem_midpoints("mxfp8")
        cand = np.unique(neighbours(e4[(e4 > 2.0**-6) & (e4 < 440)] * 6.0 / float(g), T).astype(np.float64))
        cand = cand[np.isfinite(cand) & (cand > 0)]
        ref = mx.nvfp4_block_scales(_f(cand), g)
        wrong = [mx.e4m3_round_codes(_f(_f(g * _f(cand)) / np.float32(6))),
                 mx.e4m3_round_codes(_f(_f(g * _f(cand)) * inv6))]
        hits = cand[np.logical_or.reduce([w != ref for w in wrong])]
        pick = rng.choice(hits if hits.size else cand, 2 * 16)
        for j in range(2):  # blocks made of sensitive amax values: each sets its own block scale
            row = pick[16 * j: 16 * (j + 1)].copy()
            row[1:] = rng.uniform(-1, 1, 15) * row[0]
            blocks.append(row)
    return np.concatenate(blocks).reshape(1, -1)


def _nvfp4_g(kind: str, x: np.ndarray) -> np.float32:
    if kind == "sensitive":
        return SENSITIVE_G
    if kind == "ties":
        return np.float32(2688.0 / 100.0)
    if kind == "g-one":
        return np.float32(1.0)
    g = _global_scale(x)
    return np.float32(g * np.float32(10)) if kind == "g-saturates" else g


def _layouts(be: Backend, run_one) -> Verdict:
    """Run a case body for row-major and swizzled scales; one verdict with both outcomes."""
    v = Verdict()
    for swizzled in (False, True):
        part = run_one(swizzled)
        layout = "swizzled" if swizzled else "row-major"
        v.failures += [type(f)(f.tier, f"[{layout} scales] {f.message}") for f in part.failures]
        v.notes += [f"[{layout}] {n}" for n in part.notes]
    return v


def _quantize(cap: Capability, kind: str, mode: str | None, be: Backend, rng: np.random.Generator
              ) -> Verdict:
    fmt = cap.fmt
    x = quantize_input(kind, fmt, rng, cap.dtype)
    k = x.shape[-1]
    rows = x.size // k
    g = _nvfp4_g(kind, x) if fmt == "nvfp4" else None
    codes, scales = mx.quantize(x.reshape(rows, k), fmt, scale_mode=mode or "floor", global_scale=g)
    lead = x.shape[:-1]
    inputs = {"x": x}
    if g is not None:
        inputs["g"] = np.array([g], dtype=np.float32)

    def run_one(swizzled: bool) -> Verdict:
        sref = mx.swizzle(scales) if swizzled else scales.reshape(lead + scales.shape[-1:])

        def call(i, o):
            be.mx_quantize(i["x"], o["codes"], o["scales"], rows=rows, cols=k, fmt=fmt,
                           scale_mode=mode, swizzled=swizzled, global_scale=i.get("g"))

        outs = [Out("codes", lead + codes.shape[-1:], U8), Out("scales", sref.shape, U8)]
        return check_op_bits(be, call, inputs, outs,
                             {"codes": codes.reshape(lead + codes.shape[-1:]), "scales": sref})

    return _layouts(be, run_one)


def _random_scale_bytes(fmt: str, rng: np.random.Generator, shape) -> np.ndarray:
    if fmt == "nvfp4":
        return rng.integers(0, 256, shape, dtype=np.uint8)
    # keep most E8M0 bytes in the range where fp16 / bf16 outputs are not all 0 or Inf
    s = rng.integers(100, 150, shape).astype(np.uint8)
    wild = rng.random(shape) < 0.2
    s[wild] = rng.integers(0, 256, int(wild.sum())).astype(np.uint8)
    return s


def _dequantize(cap: Capability, kind: str, be: Backend, rng: np.random.Generator) -> Verdict:
    fmt, T = cap.fmt, DTYPES[cap.dtype]
    blk = _blk(fmt)
    rows, nbk, lead = 5, 8, (5,)
    g = np.float32(1.0)
    if kind == "partial-tiles":
        rows, nbk, lead = 130, 6, (130,)
    elif kind == "3d":
        rows, nbk, lead = 6, 2, (2, 3)
    k = nbk * blk
    cc = mx.codes_cols(fmt, k)
    codes = rng.integers(0, 256, (rows, cc), dtype=np.uint8)
    scales = _random_scale_bytes(fmt, rng, (rows, nbk))
    if fmt == "nvfp4":
        g = np.float32(np.exp2(rng.uniform(-8, 8)))
    if kind == "roundtrip":
        x = scaled_normal(rng, rows * k, blk).reshape(rows, k).astype(np.float32)
        g = _global_scale(x) if fmt == "nvfp4" else None
        codes, scales = mx.quantize(x, fmt, global_scale=g)
    elif kind == "special-scales":
        special = ([0x00, 0x01, 0x07, 0x08, 0x7E, 0x7F, 0x80, 0xFE] if fmt == "nvfp4"
                   else [0, 1, 127, 253, 254, 255, 126, 128])
        scales = np.array(special * rows, dtype=np.uint8).reshape(rows, nbk)
        if fmt == "nvfp4":
            g = np.float32([1.0, 2688.0 / 3.0, 1e-30, 1e30, 0.75][int(rng.integers(0, 5))])
    gs = None if fmt != "nvfp4" else np.float32(g)
    ref = mx.dequantize(codes, scales, fmt, global_scale=gs, out_dtype=T).reshape(lead + (k,))
    inputs_base = {"codes": codes.reshape(lead + (cc,))}
    if gs is not None:
        inputs_base["g"] = np.array([gs], np.float32)

    def run_one(swizzled: bool) -> Verdict:
        s_in = mx.swizzle(scales) if swizzled else scales.reshape(lead + (nbk,))
        if swizzled and kind == "partial-tiles":  # the op must not read the padding
            pad = np.ones(s_in.size, bool)
            pad[mx.swizzle_offsets(rows, nbk).reshape(-1)] = False
            s_in = s_in.copy().reshape(-1)
            s_in[pad] = rng.integers(0, 256, int(pad.sum())).astype(np.uint8)
            s_in = s_in.reshape(mx.swizzled_shape(rows, nbk))

        def call(i, o):
            be.mx_dequantize(i["codes"], i["scales"], o["out"], rows=rows, cols=k, fmt=fmt,
                             swizzled=swizzled, global_scale=i.get("g"))

        return check_op_bits(be, call, {**inputs_base, "scales": s_in}, [Out("out", ref.shape, T)],
                             {"out": ref})

    return _layouts(be, run_one)


SWIZZLE_SHAPES = [(1, 1), (128, 4), (130, 5), (257, 9), (64, 12), (33, 3)]


def _swizzle(cap: Capability, shape: tuple[int, int], be: Backend, rng: np.random.Generator) -> Verdict:
    rows, cols = shape
    s = rng.integers(0, 256, shape, dtype=np.uint8)
    ref = mx.swizzle(s)
    if cap.op == "swizzle_scales":
        def call(i, o):
            be.swizzle_scales(i["s"], o["out"], rows=rows, cols=cols)

        return check_op_bits(be, call, {"s": s}, [Out("out", ref.shape, U8)], {"out": ref})
    swz = ref.copy().reshape(-1)  # garbage in the padding: the op must read only real scales
    pad = np.ones(swz.size, bool)
    pad[mx.swizzle_offsets(rows, cols).reshape(-1)] = False
    swz[pad] = rng.integers(0, 256, int(pad.sum())).astype(np.uint8)

    def call(i, o):
        be.unswizzle_scales(i["swz"], o["out"], rows=rows, cols=cols)

    return check_op_bits(be, call, {"swz": swz.reshape(ref.shape)}, [Out("out", shape, U8)], {"out": s})


# -- tolerance: scaled_fp4_mm ----------------------------------------------------------------------
def mm_shapes(level: str) -> list[tuple[int, int, int]]:
    """(M, N, K): rows off the 128-row scale tiles, K/blk off the 4-column tiles, one block,
    thin and square shapes; larger ones at the full level."""
    quick = [(1, 1, 64), (33, 17, 128), (130, 70, 192), (7, 129, 512), (64, 64, 1024), (200, 9, 96)]
    if level == "quick":
        return quick
    return quick + [(256, 256, 2048), (1, 300, 4096), (129, 1, 8192), (96, 160, 320)]


def mm_bound(A: np.ndarray, B: np.ndarray, alpha: float, bias: np.ndarray | None
             ) -> tuple[np.ndarray, Bound]:
    """fp64 reference and bound of ``bf16(alpha * A @ B^T + bias)`` (see the module docstring)."""
    k = A.shape[1]
    c = 4
    u32, ub = UNIT_ROUNDOFF["float32"], UNIT_ROUNDOFF["bfloat16"]
    b = np.zeros(B.shape[0]) if bias is None else np.asarray(bias, np.float64)
    ref = alpha * (A @ B.T) + b[None, :]
    s = abs(alpha) * (np.abs(A) @ np.abs(B).T)
    q = alpha**2 * ((A * A) @ (B * B).T)
    max_abs = (1.05 * (ub * np.abs(ref) + (c + k + 1) * u32 * (s + np.abs(b)[None, :]))
               + c * k * UNDERFLOW_ERROR["float32"] + UNDERFLOW_ERROR["bfloat16"])
    denom = float(np.sum(ref**2))
    nmse = 16.0 * float(np.sum(ub**2 * ref**2 + (c + k) * u32**2 * q)) / denom if denom else 0.0
    return ref, Bound(max_abs, nmse, "bound: fp32 accumulation of exact operands, one bf16 rounding "
                                     "(quantcore/conformance/families/mx.py)")


def _mm_operand(fmt: str, rng: np.random.Generator, rows: int, k: int, random_codes: bool):
    x = rng.standard_normal((rows, k)) * np.exp2(rng.uniform(-3, 3, (rows, 1)))
    g = _global_scale(x) if fmt == "nvfp4" else None
    codes, scales = mx.quantize(x.astype(np.float32), fmt, global_scale=g)
    if random_codes:
        codes = rng.integers(0, 256, codes.shape, dtype=np.uint8)
    return codes, mx.swizzle(scales), g


def _mm(cap: Capability, shape, with_bias: bool, random_codes: bool, be: Backend,
        rng: np.random.Generator) -> Verdict:
    fmt = cap.fmt
    m, n, k = shape
    a, sa, ga = _mm_operand(fmt, rng, m, k, random_codes)
    b, sb, gb = _mm_operand(fmt, rng, n, k, random_codes)
    alpha = np.float32(1.0) / (ga * gb) if fmt == "nvfp4" else np.float32(rng.uniform(0.5, 2))
    bias = cast(rng.standard_normal(n), BF16) if with_bias else None
    A, B = mx.fp4_operand(a, sa, fmt), mx.fp4_operand(b, sb, fmt)
    ref, bound = mm_bound(A, B, float(alpha), None if bias is None else bias.astype(np.float64))
    inputs = {"a": a, "b": b, "sa": sa, "sb": sb, "alpha": np.array([alpha], np.float32)}
    if bias is not None:
        inputs["bias"] = bias

    def call(i, o):
        be.scaled_fp4_mm(i["a"], i["b"], i["sa"], i["sb"], i["alpha"], i.get("bias"), o["out"],
                         m=m, n=n, k=k, fmt=fmt)

    return check_op_tolerance(be, call, inputs, Out("out", (m, n), BF16), ref, bound)


# -- tolerance: linear_mx --------------------------------------------------------------------------
LINEAR_KINDS = {
    "quantized": "the reference's quantization of a weight whose rows span 8 octaves; activations "
                 "over 4 octaves",
    "random-codes": "random code bytes and random finite scale bytes (NVFP4: every E4M3 byte but "
                    "NaN, sign and subnormals included; MX: 110..133, so fp16 outputs stay finite)",
    "special-scales": "scale bytes at the edges: E8M0 0 (2^-127, an fp32 subnormal), 1, 20, 127, "
                      "128, 133; E4M3 +-0, the subnormals 0x01 / 0x07, 2^-6, 448, -448",
}


def linear_shapes(level: str) -> list[tuple[int, int, int]]:
    """(B, N, K in blocks): B in {1, 5, 16}, N off the 128-row scale tiles and the kernels' row
    tiles, K a multiple of the block size only (an odd number of blocks)."""
    quick = [(1, 1, 1), (1, 33, 3), (5, 130, 6), (16, 257, 9), (5, 64, 64), (16, 7, 35)]
    if level == "quick":
        return quick
    return quick + [(1, 300, 128), (16, 129, 256), (8, 1000, 33)]


def _linear_weight(kind: str, fmt: str, rng: np.random.Generator, n: int, nbk: int):
    """(codes [n, K/2], row-major scales [n, nbk], global scale or None) of one case."""
    blk = _blk(fmt)
    k = nbk * blk
    g = None
    if kind == "quantized":
        w = rng.standard_normal((n, k)) * np.exp2(rng.uniform(-4, 4, (n, 1)))
        g = _global_scale(w) if fmt == "nvfp4" else None
        codes, scales = mx.quantize(w.astype(np.float32), fmt, global_scale=g)
        return codes, scales, g
    codes = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    if kind == "random-codes":
        if fmt == "nvfp4":
            scales = rng.integers(0, 256, (n, nbk), dtype=np.uint8)
            scales[(scales & 0x7F) == 0x7F] = 0x38  # no NaN scales: the tolerance tier is finite
            g = np.float32(np.exp2(rng.uniform(-4, 4)))
        else:
            scales = rng.integers(110, 134, (n, nbk)).astype(np.uint8)
        return codes, scales, g
    special = [0x00, 0x01, 0x07, 0x08, 0x7E, 0x80, 0xFE, 0x38] if fmt == "nvfp4" else [0, 1, 20, 127, 128, 133]
    scales = np.array(special, np.uint8)[rng.integers(0, len(special), (n, nbk))]
    g = np.float32(16.0) if fmt == "nvfp4" else None
    return codes, scales, g


def _linear_values(codes: np.ndarray, scales: np.ndarray, fmt: str, g) -> np.ndarray:
    """The exact (fp64) weight values; NVFP4's division by g in fp64."""
    q = mx.unpack_fp4(codes)
    n, k = q.shape
    blk = _blk(fmt)
    sc = mx.e4m3_decode(scales) if fmt == "nvfp4" else mx.e8m0_decode(scales)
    vals = mx.e2m1_decode(q).astype(np.float64).reshape(n, k // blk, blk) * sc.astype(np.float64)[..., None]
    vals = vals.reshape(n, k)
    return vals / np.float64(g) if fmt == "nvfp4" else vals


def _linear(cap: Capability, shape: tuple[int, int, int], kind: str, x_shape: tuple[int, ...] | None,
            be: Backend, rng: np.random.Generator) -> Verdict:
    from .. import bounds

    fmt, T = cap.fmt, DTYPES[cap.dtype]
    b, n, nbk = shape
    k = nbk * _blk(fmt)
    codes, scales, g = _linear_weight(kind, fmt, rng, n, nbk)
    spread = 1.0 if kind == "special-scales" else 2.0
    x = cast(rng.standard_normal((b, k)) * np.exp2(rng.uniform(-spread, spread, (b, 1))) / 4, T)
    ref, bound = bounds.linear_mx(x.astype(np.float64), _linear_values(codes, scales, fmt, g), cap.dtype)
    inputs_base = {"x": x if x_shape is None else x.reshape(x_shape), "codes": codes}
    if g is not None:
        inputs_base["g"] = np.array([g], np.float32)

    def run_one(swizzled: bool) -> Verdict:
        s_in = scales
        if swizzled:  # garbage in the padding: the op must read only real scales
            s_in = mx.swizzle(scales).reshape(-1)
            pad = np.ones(s_in.size, bool)
            pad[mx.swizzle_offsets(n, nbk).reshape(-1)] = False
            s_in[pad] = rng.integers(0, 256, int(pad.sum())).astype(np.uint8)
            s_in = s_in.reshape(mx.swizzled_shape(n, nbk))

        def call(i, o):
            be.linear_mx(i["x"], i["codes"], i["scales"], o["out"], n=n, k=k, fmt=fmt, swizzled=swizzled,
                         global_scale=i.get("g"))

        return check_op_tolerance(be, call, {**inputs_base, "scales": s_in}, Out("out", (b, n), T), ref, bound)

    return _layouts(be, run_one)


def _api_linear(cap: Capability, be: Backend, rng: np.random.Generator) -> Verdict:
    """Quantize a weight and apply it through the public API: x [2, 3, K] (batch 6), default
    swizzled scales, the NVFP4 global scale as a number; against the bound of the codes returned."""
    from .. import bounds
    from ..harness import compare_tolerance

    v = Verdict()
    fmt, T = cap.fmt, DTYPES[cap.dtype]
    n, k = 45, 5 * _blk(fmt)
    w = (rng.standard_normal((n, k)) * np.exp2(rng.uniform(-3, 3, (n, 1)))).astype(np.float32)
    x = cast(rng.standard_normal((2, 3, k)), T)
    if fmt == "nvfp4":
        g = float(_global_scale(w))
        c, s = api_mx.scaled_nvfp4_quant(be.from_numpy(w), g, backend=be)
    else:
        g = None
        c, s = api_mx.scaled_mxfp4_quant(be.from_numpy(w), backend=be)
    out = api_mx.linear_mx(be.from_numpy(x), c, s, fmt, global_scale=g, backend=be)
    got = np.asarray(be.to_numpy(out))
    if got.shape != (2, 3, n) or got.dtype != T:
        v.fail(TOLERANCE, f"linear_mx returned {got.dtype} {got.shape}, expected {np.dtype(T)} {(2, 3, n)}")
        return v
    codes = np.asarray(be.to_numpy(c))
    scales = mx.unswizzle(np.asarray(be.to_numpy(s)), n, k // _blk(fmt))
    ref, bound = bounds.linear_mx(x.reshape(6, k).astype(np.float64),
                                  _linear_values(codes, scales, fmt, np.float32(g) if g else None), cap.dtype)
    compare_tolerance("out", [{"out": got.reshape(6, n)}], ref, bound, None, v)
    return v


def _api_linear_grouped(cap: Capability, rows: int, nweights: int, nbk: int, swizzled: bool, be: Backend,
                        rng: np.random.Generator) -> Verdict:
    """linear_mx_grouped through the public API: ``nweights`` quantized weights of one K (N 33, 9, 17
    ...: partial tiles; six: more than one cuda launch takes), NVFP4 global scales as numbers, row-major
    or swizzled scales (zero padding); each column block against its own weight's bound."""
    from .. import bounds
    from ..harness import compare_grouped

    v = Verdict()
    fmt, T = cap.fmt, DTYPES[cap.dtype]
    k = nbk * _blk(fmt)
    ns = (33, 9, 17, 40, 8, 12)[:nweights]
    x = cast(rng.standard_normal((rows, k)) / 4, T)
    items, refs = [], []
    for n in ns:
        codes, scales, g = _linear_weight("quantized", fmt, rng, n, nbk)
        refs.append(bounds.linear_mx(x.astype(np.float64), _linear_values(codes, scales, fmt, g), cap.dtype))
        s_in = mx.swizzle(scales) if swizzled else scales
        items.append((be.from_numpy(codes), be.from_numpy(s_in), fmt, g))
    out = api_mx.linear_mx_grouped(be.from_numpy(x), items, swizzled=swizzled, backend=be)
    compare_grouped("linear_mx_grouped", np.asarray(be.to_numpy(out)), rows, list(zip(ns, refs)), v, dtype=T)
    return v


# -- the public API end to end ---------------------------------------------------------------------
def _api_roundtrip(cap: Capability, be: Backend, rng: np.random.Generator) -> Verdict:
    """quantize / dequantize / swizzle through the public API on the backend's arrays, compared
    bit for bit with the reference backend on numpy arrays (default swizzled scales and row-major)."""
    from ...backends.reference import ReferenceBackend

    v = Verdict()
    fmt = cap.fmt
    x = cast(scaled_normal(rng, 3 * 50 * 2 * _blk(fmt), _blk(fmt)).reshape(3, 50, 2 * _blk(fmt)),
             DTYPES[cap.dtype])
    kw = {"global_scale": float(_global_scale(x))} if fmt == "nvfp4" else {"scale_mode": "rceil"}
    g = kw.get("global_scale")
    res = []
    for backend, arr, back in ((ReferenceBackend(), lambda t: t, np.asarray),
                               (be, be.from_numpy, lambda t: np.asarray(be.to_numpy(t)))):
        c, s = api_mx.quantize_mx(arr(x), fmt, backend=backend, **kw)
        c2, s2 = api_mx.quantize_mx(arr(x), fmt, swizzle=False, backend=backend, **kw)
        y = api_mx.dequantize_mx(c, s, fmt, cap.dtype, global_scale=g, backend=backend)
        y2 = api_mx.dequantize_mx(c2, s2, fmt, cap.dtype, global_scale=g, swizzled=False, backend=backend)
        res.append({"codes": back(c), "scales-swizzled": back(s), "scales": back(s2),
                    "x-swizzled": back(y), "x": back(y2)})
    for name, ref in res[0].items():
        if res[1][name].shape != ref.shape or res[1][name].dtype != ref.dtype:
            v.fail(BIT_EXACT, f"{name}: {res[1][name].dtype} {res[1][name].shape}, the reference backend "
                              f"gives {ref.dtype} {ref.shape}")
            continue
        compare_bits(name, [res[1]], ref, None, v)
    return v


def _api_mm(cap: Capability, be: Backend, rng: np.random.Generator) -> Verdict:
    """quantize both operands and multiply through the public API (alpha as a number, bias [1, N])."""
    from ..harness import compare_tolerance

    v = Verdict()
    fmt = cap.fmt
    m, n, k = 20, 12, 4 * _blk(fmt)
    xa = rng.standard_normal((m, k)).astype(np.float32)
    xb = rng.standard_normal((n, k)).astype(np.float32)
    bias = cast(rng.standard_normal((1, n)), BF16)
    if fmt == "nvfp4":
        ga, gb = _global_scale(xa), _global_scale(xb)
        ca, sa = api_mx.scaled_nvfp4_quant(be.from_numpy(xa), float(ga), backend=be)
        cb, sb = api_mx.scaled_nvfp4_quant(be.from_numpy(xb), float(gb), backend=be)
        alpha = float(np.float32(1.0) / (ga * gb))
    else:
        ca, sa = api_mx.scaled_mxfp4_quant(be.from_numpy(xa), backend=be)
        cb, sb = api_mx.scaled_mxfp4_quant(be.from_numpy(xb), backend=be)
        alpha = 1.0
    out = api_mx.scaled_fp4_mm(ca, cb, sa, sb, alpha, be.from_numpy(bias), fmt=fmt, backend=be)
    got = np.asarray(be.to_numpy(out))
    if got.shape != (m, n) or got.dtype != BF16:
        v.fail(TOLERANCE, f"scaled_fp4_mm returned {got.dtype} {got.shape}, expected bfloat16 {(m, n)}")
        return v
    A = mx.fp4_operand(np.asarray(be.to_numpy(ca)), np.asarray(be.to_numpy(sa)), fmt)
    B = mx.fp4_operand(np.asarray(be.to_numpy(cb)), np.asarray(be.to_numpy(sb)), fmt)
    ref, bound = mm_bound(A, B, alpha, bias.reshape(n).astype(np.float64))
    compare_tolerance("out", [{"out": got}], ref, bound, None, v)
    return v


# -- invalid inputs ----------------------------------------------------------------------------------
def _invalid() -> list[Invalid]:
    x = np.linspace(-1, 1, 4 * 64, dtype=np.float32).reshape(4, 64)
    c4, s4 = mx.quantize_nvfp4(x, np.float32(1.0))
    s4z = mx.swizzle(s4)
    q, d = api_mx, "mx_dequantize"
    return [
        Invalid("K-48", "mx_quantize", lambda arr, be: lambda: q.scaled_mxfp4_quant(
            arr(np.ones((2, 48), np.float32)), backend=be)),
        Invalid("K-24-nvfp4", "mx_quantize", lambda arr, be: lambda: q.scaled_nvfp4_quant(
            arr(np.ones((2, 24), np.float32)), 1.0, backend=be)),
        Invalid("fmt-mxfp6", "mx_quantize", lambda arr, be: lambda: q.quantize_mx(
            arr(x), "mxfp6", backend=be)),
        Invalid("scale-mode-even", "mx_quantize", lambda arr, be: lambda: q.scaled_mxfp8_quant(
            arr(x), scale_mode="even", backend=be)),
        Invalid("int32-input", "mx_quantize", lambda arr, be: lambda: q.scaled_mxfp4_quant(
            arr(np.ones((2, 32), np.int32)), backend=be)),
        Invalid("empty-input", "mx_quantize", lambda arr, be: lambda: q.scaled_mxfp4_quant(
            arr(np.ones((0, 32), np.float32)), backend=be)),
        Invalid("no-global-scale", "mx_quantize", lambda arr, be: lambda: q.quantize_mx(
            arr(x), "nvfp4", backend=be)),
        Invalid("global-scale-0", "mx_quantize", lambda arr, be: lambda: q.scaled_nvfp4_quant(
            arr(x), 0.0, backend=be)),
        Invalid("global-scale-float64", "mx_quantize", lambda arr, be: lambda: q.scaled_nvfp4_quant(
            arr(x), arr(np.ones(1, np.float64)), backend=be)),
        Invalid("global-scale-2-elements", "mx_quantize", lambda arr, be: lambda: q.scaled_nvfp4_quant(
            arr(x), arr(np.ones(2, np.float32)), backend=be)),
        Invalid("valid-call", "mx_quantize", lambda arr, be: lambda: q.scaled_nvfp4_quant(
            arr(x), arr(np.ones(1, np.float32)), backend=be)),
        Invalid("global-scale-numpy-nan", "mx_quantize", lambda arr, be: lambda: q.scaled_nvfp4_quant(
            arr(x), np.float32(np.nan), backend=be)),
        Invalid("global-scale-numpy-inf", "mx_quantize", lambda arr, be: lambda: q.scaled_nvfp4_quant(
            arr(x), np.float32(np.inf), backend=be)),
        Invalid("global-scale-numpy-0", "mx_quantize", lambda arr, be: lambda: q.scaled_nvfp4_quant(
            arr(x), np.float32(0.0), backend=be)),
        Invalid("scales-wrong-shape", d, lambda arr, be: lambda: q.dequantize_nvfp4(
            arr(c4), arr(s4z[:, :2]), 1.0, backend=be)),
        Invalid("row-major-scales-as-swizzled", d, lambda arr, be: lambda: q.dequantize_nvfp4(
            arr(c4), arr(s4), 1.0, backend=be)),
        Invalid("float-codes", d, lambda arr, be: lambda: q.dequantize_mxfp4(
            arr(np.zeros((4, 32), np.float32)), arr(s4z), backend=be)),
        Invalid("out-dtype-float64", d, lambda arr, be: lambda: q.dequantize_nvfp4(
            arr(c4), arr(s4z), 1.0, "float64", backend=be)),
        Invalid("swizzle-3d", "swizzle_scales", lambda arr, be: lambda: q.swizzle_scales(
            arr(np.zeros((2, 3, 4), np.uint8)), backend=be)),
        Invalid("unswizzle-wrong-rows", "unswizzle_scales", lambda arr, be: lambda: q.unswizzle_scales(
            arr(s4z), 129, 4, backend=be)),
        Invalid("K-mismatch", "scaled_fp4_mm", lambda arr, be: lambda: q.scaled_fp4_mm(
            arr(c4), arr(c4[:, :16]), arr(s4z), arr(s4z), 1.0, backend=be)),
        Invalid("fmt-mxfp8", "scaled_fp4_mm", lambda arr, be: lambda: q.scaled_fp4_mm(
            arr(c4), arr(c4), arr(s4z), arr(s4z), 1.0, fmt="mxfp8", backend=be)),
        Invalid("bias-list", "scaled_fp4_mm", lambda arr, be: lambda: q.scaled_fp4_mm(
            arr(c4), arr(c4), arr(s4z), arr(s4z), 1.0, [0.0] * 4, backend=be)),
        Invalid("bias-float32", "scaled_fp4_mm", lambda arr, be: lambda: q.scaled_fp4_mm(
            arr(c4), arr(c4), arr(s4z), arr(s4z), 1.0, arr(np.zeros(4, np.float32)), backend=be)),
        Invalid("row-major-scales", "scaled_fp4_mm", lambda arr, be: lambda: q.scaled_fp4_mm(
            arr(c4), arr(c4), arr(s4), arr(s4z), 1.0, backend=be)),
        Invalid("K-mismatch", "linear_mx", lambda arr, be: lambda: q.linear_mx(
            arr(np.ones((2, 48), np.float32)), arr(c4), arr(s4z), "nvfp4", global_scale=1.0, backend=be)),
        Invalid("fmt-mxfp8", "linear_mx", lambda arr, be: lambda: q.linear_mx(
            arr(x), arr(c4), arr(s4z), "mxfp8", backend=be)),
        Invalid("codes-1d", "linear_mx", lambda arr, be: lambda: q.linear_mx(
            arr(x[0]), arr(c4[0]), arr(s4z), "nvfp4", global_scale=1.0, backend=be)),
        Invalid("codes-float", "linear_mx", lambda arr, be: lambda: q.linear_mx(
            arr(x), arr(np.zeros((4, 32), np.float32)), arr(s4z), "nvfp4", global_scale=1.0, backend=be)),
        Invalid("x-int32", "linear_mx", lambda arr, be: lambda: q.linear_mx(
            arr(np.ones((2, 64), np.int32)), arr(c4), arr(s4z), "nvfp4", global_scale=1.0, backend=be)),
        Invalid("x-float64", "linear_mx", lambda arr, be: lambda: q.linear_mx(
            arr(np.ones((2, 64), np.float64)), arr(c4), arr(s4z), "nvfp4", global_scale=1.0, backend=be)),
        Invalid("scales-wrong-shape", "linear_mx", lambda arr, be: lambda: q.linear_mx(
            arr(x), arr(c4), arr(s4z[:, :2]), "nvfp4", global_scale=1.0, backend=be)),
        Invalid("row-major-scales-as-swizzled", "linear_mx", lambda arr, be: lambda: q.linear_mx(
            arr(x), arr(c4), arr(s4), "nvfp4", global_scale=1.0, backend=be)),
        Invalid("no-global-scale", "linear_mx", lambda arr, be: lambda: q.linear_mx(
            arr(x), arr(c4), arr(s4z), "nvfp4", backend=be)),
        Invalid("mxfp4-global-scale", "linear_mx", lambda arr, be: lambda: q.linear_mx(
            arr(x), arr(c4), arr(s4z[:, :4]), "mxfp4", global_scale=1.0, backend=be)),
        Invalid("global-scale-numpy-nan", "linear_mx", lambda arr, be: lambda: q.linear_mx(
            arr(x), arr(c4), arr(s4z), "nvfp4", global_scale=np.float32(np.nan), backend=be)),
        Invalid("valid-call", "linear_mx", lambda arr, be: lambda: q.linear_mx(
            arr(x), arr(c4), arr(s4), "nvfp4", global_scale=arr(np.ones(1, np.float32)), swizzled=False,
            backend=be)),
        Invalid("valid-call", "scaled_fp4_mm", lambda arr, be: lambda: q.scaled_fp4_mm(
            arr(c4), arr(c4), arr(s4z), arr(s4z), arr(np.ones(1, np.float32)), backend=be)),
    ]


def _host_quantize(be: Backend, cap: Capability):
    return api_mx.scaled_mxfp4_quant(np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64), backend=be)


# -- the family's cases ----------------------------------------------------------------------------
def cases(level: str, declared: frozenset[Capability]) -> Iterable[Case]:
    """Every MX case for the declared capabilities at ``level``."""
    kinds = list(QUANTIZE_KINDS) + (list(QUANTIZE_KINDS_FULL) if level == "full" else [])
    for fmt in mx.MX_FORMATS:
        blk = _blk(fmt)
        for dtype in DTYPES:
            cap = Capability("mx_quantize", fmt, dtype, blk)
            if cap in declared:
                extra = list(NVFP4_KINDS) if fmt == "nvfp4" else []
                for mode in _modes(fmt):
                    for kind in kinds + extra:
                        name = kind if mode is None else f"{mode}-{kind}"
                        yield Case(f"mx/mx_quantize/{fmt}/{dtype}/bs{blk}/{name}", BIT_EXACT, cap,
                                   partial(_quantize, cap, kind, mode))
                need = (Capability("mx_dequantize", fmt, dtype, blk),)
                if all(c in declared for c in need):
                    yield Case(f"mx/mx_quantize/{fmt}/{dtype}/bs{blk}/api-roundtrip", BIT_EXACT, cap,
                               partial(_api_roundtrip, cap), requires=need)
            cap = Capability("mx_dequantize", fmt, dtype, blk)
            if cap in declared:
                for kind in DEQUANTIZE_KINDS:
                    yield Case(f"mx/mx_dequantize/{fmt}/{dtype}/bs{blk}/{kind}", BIT_EXACT, cap,
                               partial(_dequantize, cap, kind))
    for op in ("swizzle_scales", "unswizzle_scales"):
        cap = Capability(op, *SWZ)
        if cap in declared:
            for shape in SWIZZLE_SHAPES:
                yield Case(f"mx/{op}/{SWZ[0]}/uint8/bs{SWZ[2]}/{shape[0]}x{shape[1]}", BIT_EXACT, cap,
                           partial(_swizzle, cap, shape))
    for fmt in mx.FP4_FORMATS:
        blk = _blk(fmt)
        cap = Capability("scaled_fp4_mm", fmt, "bfloat16", blk)
        if cap not in declared:
            continue
        for j, shape in enumerate(mm_shapes(level)):
            m, n, k = shape
            yield Case(f"mx/scaled_fp4_mm/{fmt}/bfloat16/bs{blk}/M{m}-N{n}-K{k}", TOLERANCE, cap,
                       partial(_mm, cap, shape, j % 2 == 1, False))
        yield Case(f"mx/scaled_fp4_mm/{fmt}/bfloat16/bs{blk}/M40-N24-K256-random-codes", TOLERANCE, cap,
                   partial(_mm, cap, (40, 24, 256), True, True))
        need = (Capability("mx_quantize", fmt, "float32", blk),)
        if all(c in declared for c in need):
            yield Case(f"mx/scaled_fp4_mm/{fmt}/bfloat16/bs{blk}/api", TOLERANCE, cap,
                       partial(_api_mm, cap), requires=need)
    for fmt in mx.FP4_FORMATS:
        blk = _blk(fmt)
        for dtype in DTYPES:
            cap = Capability("linear_mx", fmt, dtype, blk)
            if cap not in declared:
                continue
            for b, n, nbk in linear_shapes(level):
                yield Case(f"mx/linear_mx/{fmt}/{dtype}/bs{blk}/B{b}-N{n}-K{nbk * blk}", TOLERANCE, cap,
                           partial(_linear, cap, (b, n, nbk), "quantized", None))
            for kind in ("random-codes", "special-scales"):
                yield Case(f"mx/linear_mx/{fmt}/{dtype}/bs{blk}/B5-N70-K{10 * blk}-{kind}", TOLERANCE, cap,
                           partial(_linear, cap, (5, 70, 10), kind, None))
            yield Case(f"mx/linear_mx/{fmt}/{dtype}/bs{blk}/x-1d-N9-K{4 * blk}", TOLERANCE, cap,
                       partial(_linear, cap, (1, 9, 4), "quantized", (4 * blk,)))
            yield Case(f"mx/linear_mx/{fmt}/{dtype}/bs{blk}/x-3d-2x3-N9-K{4 * blk}", TOLERANCE, cap,
                       partial(_linear, cap, (6, 9, 4), "quantized", (2, 3, 4 * blk)))
            need = (Capability("mx_quantize", fmt, "float32", blk),)
            if all(c in declared for c in need):
                yield Case(f"mx/linear_mx/{fmt}/{dtype}/bs{blk}/api-x-3d", TOLERANCE, cap,
                           partial(_api_linear, cap), requires=need)
            # linear_mx_grouped: K a multiple of 64 (cuda's grouped launches) and not (its per-weight path)
            for rows, nw, nbk, swz in ((1, 3, 256 // blk, False), (5, 6, 256 // blk, True), (16, 3, 512 // blk, False),
                                       (3, 3, 5, True)):
                yield Case(f"mx/linear_mx/{fmt}/{dtype}/bs{blk}/api-grouped-B{rows}-W{nw}-K{nbk * blk}"
                           f"{'-swizzled' if swz else ''}", TOLERANCE, cap,
                           partial(_api_linear_grouped, cap, rows, nw, nbk, swz))
    yield from same_error_cases(FAMILY, _invalid(), declared)
    yield from host_array_case(FAMILY, "mx_quantize", declared, _host_quantize)

