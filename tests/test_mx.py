"""NVFP4 / MXFP4 / MXFP8 reference (quantcore.formats.mx) and its public API (quantcore.api_mx).

Three kinds of checks:
- the rules themselves, against independent scalar oracles written here (exact rational
  rounding for E4M3, the threshold rule for E2M1, exact ceil / floor of log2 for E8M0) on seeded
  and adversarial data: the reference's codes are exact against quantcore's own operation order;
- the peers: golden vectors made with torchao 0.18 on CPU (tools/make_golden_mx.py), compared
  by the rules of docs/formats-mx.md (MX: scales and codes identical; NVFP4: scale bytes identical
  except the counted cases explained below, codes one step apart only at rounding boundaries);
- the API: shapes, layouts (swizzle), validation errors, array kinds, torch dtype views, and
  scaled_fp4_mm.
"""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import quantcore as qc
from quantcore import ops
from quantcore.arrays import BF16
from quantcore.errors import DTypeError, ParameterError, ShapeError
from quantcore.formats import kernel_defines, mx

from .conftest import FLOAT_DTYPES, bits

GOLDEN = Path(__file__).parent / "golden" / "mx_golden.npz"
G = np.load(GOLDEN)
DTYPES = ("float32", "bfloat16")

# -- independent scalar oracles ------------------------------------------------------------------
_E4M3_POS = [Fraction(float(v)) for v in np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)]


def e4m3_oracle(v: float) -> int:
    """Exact RNE onto the 127 non-negative E4M3 values (tie -> even byte), saturating, NaN -> 0x7F."""
    if math.isnan(v):
        return 0x7F
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    if a >= 448:
        return sign | 0x7E
    f = Fraction(a)
    hi = next(i for i, e in enumerate(_E4M3_POS) if e >= f)
    if _E4M3_POS[hi] == f or hi == 0:
        return sign | hi
    lo = hi - 1
    d_lo, d_hi = f - _E4M3_POS[lo], _E4M3_POS[hi] - f
    pick = lo if d_lo < d_hi else hi if d_hi < d_lo else (lo if lo % 2 == 0 else hi)
    return sign | pick


_MIDS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def e2m1_oracle(v: float) -> int:
    """Threshold rule: ties go to the even magnitude index; NaN -> 0x7."""
    if math.isnan(v):
        return 0x7
    a = abs(v)
    idx = sum((a >= t) if (i + 1) % 2 == 0 else (a > t) for i, t in enumerate(_MIDS))
    return idx | (0x8 if math.copysign(1.0, v) < 0 else 0)


def e8m0_oracle(amax: float, elem: str, mode: str) -> int:
    """Exact floor(log2(amax)) - emax or ceil(log2(amax / max_elem)), clamped; NaN / Inf -> 0xFF."""
    if not math.isfinite(amax):
        return 0xFF
    if amax == 0:
        return 0
    if mode == "floor":
        e = math.frexp(amax)[1] - 1 - mx.EMAX_ELEM[elem]
        return min(max(e, -127), 128) + 127
    ratio = Fraction(amax) / Fraction(mx.MAX_ELEM[elem])
    c = math.frexp(float(ratio))[1] - 1  # a first guess, then fixed exactly
    while Fraction(2) ** c < ratio:
        c += 1
    while Fraction(2) ** (c - 1) >= ratio:
        c -= 1
    return min(max(c, -127), 127) + 127


def mx_oracle(x: np.ndarray, fmt: str, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """Scalar MX quantizer of a [rows, K] fp32 array: (codes unpacked, scales)."""
    elem, blk, _ = mx.FORMATS[fmt]
    rows, k = x.shape
    codes = np.zeros((rows, k), dtype=np.uint8)
    scales = np.zeros((rows, k // blk), dtype=np.uint8)
    for r in range(rows):
        for b in range(k // blk):
            block = [float(t) for t in x[r, b * blk:(b + 1) * blk]]
            amax = max(abs(t) for t in block) if not any(math.isnan(t) for t in block) else math.nan
            sb = e8m0_oracle(amax, elem, mode)
            scales[r, b] = sb
            for j, t in enumerate(block):
                y = math.nan if sb == 0xFF else math.ldexp(t, 127 - sb)  # exact in fp64
                codes[r, b * blk + j] = e2m1_oracle(y) if elem == "e2m1" else e4m3_oracle(y)
    return codes, scales


def nvfp4_oracle(x: np.ndarray, g: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """Scalar NVFP4 quantizer following docs/formats-mx.md's order with numpy fp32 scalars."""
    f = np.float32
    rows, k = x.shape
    codes = np.zeros((rows, k), dtype=np.uint8)
    scales = np.zeros((rows, k // 16), dtype=np.uint8)
    inv6 = f(1) / f(6)
    with np.errstate(all="ignore"):
        for r in range(rows):
            for b in range(k // 16):
                block = x[r, b * 16:(b + 1) * 16].astype(np.float32)
                amax = f(np.nan) if np.isnan(block).any() else f(np.abs(block).max())
                s8 = e4m3_oracle(float(f(g * f(amax * inv6))))
                scales[r, b] = s8
                s = f(np.array([s8], np.uint8).view(ml_dtypes.float8_e4m3fn)[0])
                os = f(g * f(f(1) / s)) if s != 0 else f(0)
                for j in range(16):
                    codes[r, b * 16 + j] = e2m1_oracle(float(f(block[j] * os)))
    return codes, scales


# -- element formats -----------------------------------------------------------------------------
def test_pack_vectors():
    for vals, expect in (([0, 0.5, 4, -0.0], [0x10, 0x86]), ([-0.0, 1, -6, 3], [0x28, 0x5F])):
        codes = mx.e2m1_round_codes(np.array(vals, dtype=np.float32))
        assert mx.pack_fp4(codes).tolist() == expect
        assert (bits(mx.e2m1_decode(mx.unpack_fp4(np.array(expect, np.uint8))))
                == bits(np.array(vals, np.float32))).all()


def test_e2m1_ties_saturation_and_specials():
    x = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.0001, 6.5, 1e30, np.inf, -np.inf,
                  1e-45, -1e-45, -0.0, 0.2500001], dtype=np.float32)
    expect = [0, 1, 1, 2, 2, 4, 4, 6, 6, 6, 6, -6, 0, -0.0, -0.0, 0.5]
    got = mx.e2m1_decode(mx.e2m1_round_codes(x))
    assert (bits(got) == bits(np.array(expect, np.float32))).all()
    nans = np.array([np.nan, np.copysign(np.nan, -1.0)], np.float32)
    assert np.signbit(nans[1])
    assert mx.e2m1_round_codes(nans).tolist() == [mx.E2M1_NAN_CODE] * 2


def test_e2m1_matches_oracle_on_random_and_boundary_values(rng):
    mids = np.array(_MIDS, np.float32)
    near = np.concatenate([np.nextafter(mids, np.float32(0)), mids, np.nextafter(mids, np.float32(9))])
    x = np.concatenate([near, -near, rng.standard_normal(4000).astype(np.float32) * 3])
    assert mx.e2m1_round_codes(x).tolist() == [e2m1_oracle(float(t)) for t in x]


def test_e4m3_rounding_matches_exact_oracle(rng):
    x = np.concatenate([
        np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(BF16).astype(np.float32),
        (rng.standard_normal(20000) * np.exp2(rng.integers(-12, 10, 20000))).astype(np.float32),
        np.array([448, 449, 463.9, 464, 480, 1e9, np.inf, -np.inf, 2.0**-10, 3 * 2.0**-10,
                  2.0**-10 * 1.0000001, 1.0625, 1.1875], np.float32),
    ])
    ours = mx.e4m3_round_codes(x)
    ref = np.array([e4m3_oracle(float(t)) for t in x], dtype=np.uint8)
    bad = np.flatnonzero(ours != ref)
    assert bad.size == 0, f"E4M3 mismatch at {x[bad[:5]]}: {ours[bad[:5]]} vs {ref[bad[:5]]}"


def test_e4m3_saturates_and_has_one_nan():
    x = np.array([448, 460, 464, 1e9, np.inf, -1e9, -np.inf, np.nan], np.float32)
    assert mx.e4m3_round_codes(x).tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0x7F]
    assert mx.e4m3_decode(np.array([0x7E, 0x08, 0x01], np.uint8)).tolist() == [448, 2.0**-6, 2.0**-9]


def test_e8m0_floor_and_rceil(rng):
    amax = np.concatenate([
        (rng.random(3000) * 2 + 0.001) * np.exp2(rng.integers(-140, 128, 3000)),
        [0.0, 1e-45, 2.0**-126, 1.5 * 2.0**-125, 1.75 * 2.0**-124, 6.0, 6.0000005, 7.0, 448.0, 449.0,
         3.4e38, np.inf, np.nan],
    ]).astype(np.float32)
    amax = amax[np.isnan(amax) | (amax < np.inf) | np.isinf(amax)]
    for elem in ("e2m1", "e4m3"):
        floor = mx.e8m0_scale(amax, elem, "floor")
        rceil = mx.e8m0_scale(amax, elem, "rceil")
        assert floor.tolist() == [e8m0_oracle(float(a), elem, "floor") for a in amax]
        assert rceil.tolist() == [e8m0_oracle(float(a), elem, "rceil") for a in amax]
        # FORMATS-MX: rceil = floor + 1 exactly when amax's mantissa exceeds the element's
        # largest mantissa (where floor is not clamped at byte 0); NaN / Inf -> 0xFF in both
        normal = np.isfinite(amax) & (floor > 0)
        mant = amax.view(np.uint32) & 0x7FFFFF
        bump = (mant > mx.MAX_MANTISSA_BITS[elem]).astype(int)
        assert (rceil[normal].astype(int) == floor[normal].astype(int) + bump[normal]).all()
        assert (floor[~np.isfinite(amax)] == 0xFF).all() and (rceil[~np.isfinite(amax)] == 0xFF).all()
    assert mx.e8m0_decode(np.array([0, 127, 254, 255], np.uint8)).tolist()[:3] == [2.0**-127, 1.0, 2.0**127]
    assert np.isnan(mx.e8m0_decode(np.array([255], np.uint8))[0])


# -- MX and NVFP4 against the oracles -------------------------------------------------------------
def _adversarial(rng, rows: int, k: int) -> np.ndarray:
    x = (rng.standard_normal((rows, k)) * np.exp2(rng.integers(-30, 30, (rows, 1)))).astype(np.float32)
    x[0, :32] = 0.0
    x[1, :32] = -0.0
    x[1, 40] = np.nan
    x[2, 3] = np.inf
    x[2, 40] = -np.inf
    x[3, :32] = np.float32(2.0**-140) * np.arange(32)  # fp32 denormals
    x[3, 32:64] = np.float32(1.5 * 2.0**-126)
    x[4, :32] = 3e38
    x[4, 32:64] = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4) * 2.0**-3
    return x


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
@pytest.mark.parametrize("mode", mx.SCALE_MODES)
def test_mx_matches_scalar_oracle(rng, fmt, mode):
    x = _adversarial(rng, 6, 96)
    codes, scales = mx.quantize_mx(x, fmt, mode)
    oc, os_ = mx_oracle(x, fmt, mode)
    assert (scales == os_).all()
    got = mx.unpack_fp4(codes) if fmt == "mxfp4" else codes
    assert (got == oc).all()


def test_nvfp4_matches_scalar_oracle(rng):
    x = _adversarial(rng, 6, 96)
    x[5] = rng.standard_normal(96).astype(np.float32)
    x[5, :16] = 1e-12  # scale rounds to zero
    x[4, :32] = 0.5  # (3e38 would make every other block's scale zero)
    g = mx.nvfp4_global_scale(100.0)
    codes, scales = mx.quantize_nvfp4(x, g)
    oc, os_ = nvfp4_oracle(x, g)
    assert (scales == os_).all()
    assert (mx.unpack_fp4(codes) == oc).all()


def test_zero_blocks_give_zero_scales_and_codes():
    x = np.zeros((2, 64), np.float32)
    x[1, 32:] = 1.0
    for fmt in ("mxfp4", "mxfp8"):
        for mode in mx.SCALE_MODES:
            codes, scales = mx.quantize_mx(x, fmt, mode)
            assert scales[0].tolist() == [0, 0] and scales[1, 0] == 0
            assert not codes[0].any()
            assert not mx.dequantize_mx(codes, scales, fmt)[0].any()
    codes, scales = mx.quantize_nvfp4(x, mx.nvfp4_global_scale(1.0))
    assert not scales[0].any() and not codes[0].any()
    # -0.0 keeps its sign: code 0x8, which decodes to -0.0
    codes, _ = mx.quantize_mx(-x[:1], "mxfp4")
    assert (codes == 0x88).all()


def test_nan_and_inf_blocks():
    x = np.ones((1, 96), np.float32)
    x[0, 5] = np.nan
    x[0, 40] = np.inf
    for fmt, nan_byte in (("mxfp4", 0x77), ("mxfp8", 0x7F)):
        codes, scales = mx.quantize_mx(x, fmt)
        assert scales.tolist() == [[0xFF, 0xFF, 127 - mx.EMAX_ELEM[mx.element_format(fmt)]]]
        per_block = codes.shape[1] // 3
        assert (codes[0, : 2 * per_block] == nan_byte).all()
        y = mx.dequantize_mx(codes, scales, fmt)
        assert np.isnan(y[0, :64]).all() and (y[0, 64:] == 1.0).all()
    codes, scales = mx.quantize_nvfp4(x, mx.nvfp4_global_scale(1.0))
    assert scales[0, 0] == 0x7F and (codes[0, :8] == 0x77).all()  # NaN block
    assert scales[0, 2] == 0x7E  # an Inf block saturates its scale to 448
    assert mx.unpack_fp4(codes)[0, 40] == 0x7  # and Inf itself to +6


def test_mx_dequantize_is_exact_product(rng):
    x = (rng.standard_normal((4, 64)) * 1000).astype(np.float32)
    for fmt in ("mxfp4", "mxfp8"):
        codes, scales = mx.quantize_mx(x, fmt)
        q = mx.unpack_fp4(codes) if fmt == "mxfp4" else codes
        elem = mx.e2m1_decode(q) if fmt == "mxfp4" else mx.e4m3_decode(q)
        expect = elem.astype(np.float64) * np.repeat(np.exp2(scales.astype(np.float64) - 127), 32, 1)
        assert (mx.dequantize_mx(codes, scales, fmt) == expect.astype(np.float32)).all()


def test_huge_values_overflow_only_where_the_math_does():
    x = np.full((1, 32), 3.4e38, np.float32)
    codes, scales = mx.quantize_mx(x, "mxfp4", "floor")
    assert scales[0, 0] == 252 and np.isfinite(mx.dequantize_mx(codes, scales, "mxfp4")).all()
    codes, scales = mx.quantize_mx(x, "mxfp4", "rceil")
    assert scales[0, 0] == 253  # 4 * 2^126 = 2^128 is past fp32: decodes to +Inf
    assert np.isposinf(mx.dequantize_mx(codes, scales, "mxfp4")).all()


# -- swizzle -------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 1), (128, 4), (130, 5), (200, 7), (256, 16), (77, 12)])
def test_swizzle_round_trip_and_padding(rng, shape):
    s = rng.integers(1, 256, size=shape, dtype=np.uint8)
    w = mx.swizzle(s)
    assert w.shape == mx.swizzled_shape(*shape)
    assert (mx.unswizzle(w, *shape) == s).all()
    assert int((w != 0).sum()) == s.size  # every padding byte is zero
    m, k = shape[0] - 1, shape[1] - 1  # LightX2V's offset formula
    nk = w.shape[1] // 4
    off = (m // 128) * (nk * 512) + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4
    assert w.reshape(-1)[off] == s[m, k]


def test_swizzle_matches_torchao():
    assert (mx.swizzle(G["swz_in"]).reshape(-1) == G["swz_out"]).all()
    assert (mx.unswizzle(G["swz_out"], 200, 7) == G["swz_in"]).all()


# -- goldens: torchao 0.18 -------------------------------------------------------------------------
def _x(name: str, dname: str) -> np.ndarray:
    return G[f"{name}_{dname}"].view(FLOAT_DTYPES[dname])


@pytest.mark.parametrize("dname", DTYPES)
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
@pytest.mark.parametrize("mode", mx.SCALE_MODES)
def test_golden_mx_bytes_equal_torchao(dname, fmt, mode):
    codes, scales = mx.quantize_mx(_x("x", dname), fmt, mode)
    assert (scales == G[f"{fmt}_{mode}_scales_{dname}"]).all()
    # power-of-two scaling is exact, so the element codes are identical too
    assert (codes == G[f"{fmt}_{mode}_codes_{dname}"]).all()


@pytest.mark.parametrize("dname", DTYPES)
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_golden_mx_dequantize_equals_torchao(dname, fmt):
    c, s = G[f"{fmt}_floor_codes_{dname}"][:8], G[f"{fmt}_floor_scales_{dname}"][:8]
    assert (bits(mx.dequantize_mx(c, s, fmt)) == bits(G[f"{fmt}_dequant_{dname}"])).all()


def _e4m3_tie_distance(ratio: Fraction) -> Fraction:
    """Relative distance from ``ratio`` to the nearest midpoint of two adjacent E4M3 values."""
    mids = [(a + b) / 2 for a, b in zip(_E4M3_POS[:-1], _E4M3_POS[1:])]
    return min(abs(ratio - m) / m for m in mids)


@pytest.mark.parametrize("dname", DTYPES)
def test_golden_nvfp4_against_torchao(dname):
    """Scale bytes equal torchao's except (a) blocks whose scale is below E4M3's smallest normal,
    which torchao clamps to 2^-6 (byte 0x08: zero blocks included) and quantcore keeps
    (subnormal or 0), and (b) one-step differences where the exact block ratio
    448 * amax_b / amax is an E4M3 tie (bf16 inputs hit ties; the two fp32 orders fall on
    opposite sides). Codes in blocks with equal scales differ by one step only where x * g / s is
    a rounding tie of E2M1 (same cause), in about 1e-3 of the elements with bf16 input."""
    x = _x("xn", dname).astype(np.float32)
    amax = float(G[f"nvfp4_amax_{dname}"][0])
    g = mx.nvfp4_global_scale(amax)
    codes, scales = mx.quantize_nvfp4(x, g)
    tc, ts = G[f"nvfp4_codes_{dname}"], G[f"nvfp4_scales_{dname}"]

    clamped = (ts == 0x08) & (scales < 0x08)
    assert clamped[0, 0] and scales[0, 0] == 0  # the all-zero block: torchao 0x08, quantcore 0x00
    assert clamped.sum() == 4  # the zero block and the three subnormal-scale blocks of row 3
    ties = (scales != ts) & ~clamped
    assert (np.abs(scales[ties].astype(int) - ts[ties].astype(int)) == 1).all()
    amax_b = np.abs(x.reshape(x.shape[0], -1, 16)).max(-1)
    for r, b in np.argwhere(ties):
        ratio = Fraction(float(amax_b[r, b])) * 448 / Fraction(amax)
        assert _e4m3_tie_distance(ratio) < Fraction(1, 1 << 21), (r, b, float(ratio))
    limit = {"float32": 2, "bfloat16": 40}[dname]  # measured: 0 and 20 of 1024 blocks
    assert ties.sum() <= limit

    same = np.repeat(scales == ts, 16, axis=1)
    q, tq = mx.unpack_fp4(codes), mx.unpack_fp4(tc)
    diff = (q != tq) & same
    idx = lambda c: (c & 7).astype(int) * np.where(c & 8, -1, 1)  # noqa: E731
    assert (np.abs(idx(q[diff]) - idx(tq[diff])) == 1).all()
    with np.errstate(divide="ignore", invalid="ignore"):
        exact = x.astype(np.float64) * float(g) / np.repeat(mx.e4m3_decode(scales), 16, 1).astype(np.float64)
    for v in np.abs(exact[diff]):
        assert min(abs(v - m) / m for m in _MIDS) < 2.0**-21, v
    # measured: 0 (fp32) and 9 of 16000 (bf16) here; 0 and 1.06e-3 on [1024, 4096] (docs/formats-mx.md)
    assert diff.sum() <= 2e-3 * same.sum()


@pytest.mark.parametrize("dname", DTYPES)
def test_golden_nvfp4_codes_exact_against_our_order(dname):
    x = _x("xn", dname).astype(np.float32)[:16]
    g = mx.nvfp4_global_scale(float(G[f"nvfp4_amax_{dname}"][0]))
    codes, scales = mx.quantize_nvfp4(x, g)
    oc, os_ = nvfp4_oracle(x, g)
    assert (scales == os_).all() and (mx.unpack_fp4(codes) == oc).all()


@pytest.mark.parametrize("dname", DTYPES)
def test_golden_nvfp4_dequantize_close_to_torchao(dname):
    """torchao decodes e2m1 * (amax / 2688 * s); quantcore (e2m1 * s) / g: a few ulps apart."""
    amax = float(G[f"nvfp4_amax_{dname}"][0])
    c, s = G[f"nvfp4_codes_{dname}"][:8], G[f"nvfp4_scales_{dname}"][:8]
    ours = mx.dequantize_nvfp4(c, s, mx.nvfp4_global_scale(amax))
    theirs = G[f"nvfp4_dequant_{dname}"]
    assert ((ours == 0) == (theirs == 0)).all()
    nz = theirs != 0
    assert (np.abs(ours[nz] / theirs[nz] - 1) <= 4 * 2.0**-24).all()


# -- public API ----------------------------------------------------------------------------------
def test_api_quantize_layouts_and_round_trip(rng):
    x = rng.standard_normal((3, 50, 64)).astype(np.float32)
    g = qc.nvfp4_global_scale(float(np.abs(x).max()))
    for fmt, kw in (("nvfp4", {"global_scale": g}), ("mxfp4", {"scale_mode": "rceil"}), ("mxfp8", {})):
        codes, swz = qc.quantize_mx(x, fmt, **kw)
        codes2, rm = qc.quantize_mx(x, fmt, swizzle=False, **kw)
        blk = mx.block_size(fmt)
        assert (codes == codes2).all() and rm.shape == (3, 50, 64 // blk)
        assert swz.shape == mx.swizzled_shape(150, 64 // blk)
        assert (swz == mx.swizzle(rm.reshape(150, -1))).all()
        y1 = qc.dequantize_mx(codes, swz, fmt, "float32", global_scale=kw.get("global_scale"))
        y2 = qc.dequantize_mx(codes, rm, fmt, "float32", global_scale=kw.get("global_scale"),
                              swizzled=False)
        assert y1.shape == x.shape and (bits(y1) == bits(y2)).all()
        rel = np.abs(y1 - x).max() / np.abs(x).max()
        # worst cases: half an E2M1 step at the top (1/6 of the block amax) for nvfp4; values in
        # (6, 8) * 2^e saturating to 6 for mxfp4; (448, 512) * 2^e saturating to 448 for mxfp8
        assert rel < {"nvfp4": 0.18, "mxfp4": 0.26, "mxfp8": 0.13}[fmt]


@pytest.mark.parametrize("dname", ["float32", "float16", "bfloat16"])
def test_api_dtypes(rng, dname):
    x = rng.standard_normal((4, 64)).astype(FLOAT_DTYPES[dname])
    codes, scales = qc.scaled_mxfp4_quant(x, swizzle=False)
    ref_c, ref_s = mx.quantize_mx(x.astype(np.float32), "mxfp4")
    assert (codes == ref_c).all() and (scales == ref_s).all()
    y = qc.dequantize_mxfp4(codes, scales, dname, swizzled=False)
    assert y.dtype == FLOAT_DTYPES[dname]
    assert (bits(y) == bits(mx.dequantize_mx(codes, scales, "mxfp4").astype(FLOAT_DTYPES[dname]))).all()


def test_api_swizzle_functions(rng):
    s = rng.integers(0, 256, (130, 6), dtype=np.uint8)
    w = qc.swizzle_scales(s)
    assert w.shape == (256, 8) and (qc.unswizzle_scales(w, 130, 6) == s).all()
    with pytest.raises(ShapeError):
        qc.unswizzle_scales(w, 129, 9)


def test_api_validation_errors():
    x = np.ones((4, 48), np.float32)
    with pytest.raises(ShapeError):
        qc.scaled_mxfp4_quant(x)  # 48 is not a multiple of 32
    with pytest.raises(ParameterError):
        qc.quantize_mx(x[:, :32], "mxfp6")
    with pytest.raises(ParameterError):
        qc.scaled_mxfp4_quant(x[:, :32], scale_mode="even")
    with pytest.raises(ParameterError):
        qc.scaled_nvfp4_quant(x, 0.0)
    with pytest.raises(ParameterError):
        qc.quantize_mx(x, "nvfp4")
    with pytest.raises(ParameterError):
        qc.quantize_mx(x[:, :32], "mxfp4", global_scale=1.0)
    with pytest.raises(DTypeError):
        qc.scaled_nvfp4_quant(x, np.ones(1, np.float64))
    with pytest.raises(DTypeError):
        qc.scaled_mxfp8_quant(np.ones((2, 32), np.int32))
    codes, scales = qc.scaled_nvfp4_quant(x, 1.0)
    with pytest.raises(ShapeError):
        qc.dequantize_nvfp4(codes, scales[:, :2], 1.0)
    with pytest.raises(ShapeError):
        qc.dequantize_nvfp4(codes, scales, 1.0, swizzled=False)
    with pytest.raises(ShapeError):
        qc.scaled_fp4_mm(codes, codes[:, :8], scales, scales, 1.0)
    with pytest.raises(DTypeError):
        qc.scaled_fp4_mm(codes, codes, scales, scales, 1.0, bias=np.zeros(4, np.float32))


def test_api_global_scale_as_array_equals_number(rng):
    x = rng.standard_normal((5, 32)).astype(np.float32)
    g = qc.nvfp4_global_scale(float(np.abs(x).max()))
    a = qc.scaled_nvfp4_quant(x, g)
    b = qc.scaled_nvfp4_quant(x, np.array([g], np.float32))
    assert all((u == w).all() for u, w in zip(a, b))


def test_scaled_fp4_mm(rng):
    m, n, k = 70, 40, 128
    a = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(BF16)
    for fmt in ("nvfp4", "mxfp4"):
        if fmt == "nvfp4":
            ga, gw = (qc.nvfp4_global_scale(float(np.abs(t).max())) for t in (a, w))
            ca, sa = qc.scaled_nvfp4_quant(a, ga)
            cw, sw = qc.scaled_nvfp4_quant(w, gw)
            alpha = np.float32(1.0) / (ga * gw)
            da = qc.dequantize_nvfp4(ca, sa, 1.0).astype(np.float64)  # e2m1 * s, exact
            dw = qc.dequantize_nvfp4(cw, sw, 1.0).astype(np.float64)
        else:
            ca, sa = qc.scaled_mxfp4_quant(a)
            cw, sw = qc.scaled_mxfp4_quant(w)
            alpha = 1.0
            da = qc.dequantize_mxfp4(ca, sa).astype(np.float64)
            dw = qc.dequantize_mxfp4(cw, sw).astype(np.float64)
        d = qc.scaled_fp4_mm(ca, cw, sa, sw, alpha, bias.reshape(1, n), fmt=fmt)
        assert d.dtype == BF16 and d.shape == (m, n)
        expect = (float(np.float32(alpha)) * (da @ dw.T) + bias.astype(np.float64)).astype(np.float32)
        assert (bits(d) == bits(expect.astype(BF16))).all()
        true = a.astype(np.float64) @ w.T.astype(np.float64) + bias.astype(np.float64)
        nmse = ((d.astype(np.float64) - true) ** 2).mean() / (true**2).mean()
        # 4-bit operands, seeds 0-4 measured: nvfp4 0.0175-0.0185, mxfp4 (floor) 0.025-0.0285
        assert nmse < {"nvfp4": 0.03, "mxfp4": 0.05}[fmt], (fmt, nmse)
        d2 = qc.scaled_fp4_mm(ca, cw, sa, sw, np.array([alpha], np.float32), fmt=fmt)
        assert (bits(d2) == bits((float(np.float32(alpha)) * (da @ dw.T)).astype(np.float32)
                                 .astype(BF16))).all()


def _torch():
    return pytest.importorskip("torch", reason="torch is not installed")


def test_torch_in_torch_out_and_dtype_views(rng):
    t = _torch()
    x = t.from_numpy(rng.standard_normal((4, 64)).astype(np.float32)).to(t.bfloat16)
    codes, scales = qc.scaled_mxfp4_quant(x)
    assert isinstance(codes, t.Tensor) and codes.dtype == t.uint8
    if not qc.api_mx.torch_has_mx_dtypes():
        pytest.skip("this torch lacks float4_e2m1fn_x2 / float8_e8m0fnu")
    v4, v8 = qc.as_torch_fp4(codes), qc.as_torch_float8_e8m0(scales)
    assert v4.dtype == t.float4_e2m1fn_x2 and v8.dtype == t.float8_e8m0fnu
    assert v4.data_ptr() == codes.data_ptr()  # zero-copy
    y = qc.dequantize_mxfp4(v4, v8, "bfloat16")  # the views are accepted back
    assert y.dtype == t.bfloat16 and y.shape == x.shape
    assert qc.as_torch_float8_e4m3(np.zeros(3, np.uint8)).dtype == t.float8_e4m3fn


# -- the op catalogue and the kernel constants ------------------------------------------------------
def test_capabilities_are_declared_and_covered_by_cpu():
    caps = set(mx.capabilities())
    assert caps <= ops.ALL_CAPABILITIES
    assert {c.op for c in caps} == {"mx_quantize", "mx_dequantize", "swizzle_scales",
                                    "unswizzle_scales", "scaled_fp4_mm", "linear_mx"}
    assert caps <= qc.get_backend("cpu").capabilities()


def test_kernel_constants_reach_the_header():
    header = kernel_defines.constants_header()
    consts = dict(mx.kernel_constants())
    for name, value in consts.items():
        assert f"#define {name} {value}" in header
    vals = [float(v.rstrip("f")) for v in consts["QC_E2M1_VALUES_INIT"].strip("{}").split(", ")]
    assert (bits(np.array(vals, np.float32)) == bits(mx.E2M1_VALUES)).all()
    # a C compiler reads the 9-digit literal as the nearest fp32: the exact f32(1/6)
    assert np.float32(consts["QC_NVFP4_INV_E2M1_MAX"].rstrip("f")) == np.float32(1) / np.float32(6)
    assert consts["QC_NVFP4_GLOBAL_NUMERATOR"] == "2688.0f"
