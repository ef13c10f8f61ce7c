"""NVFP4, MXFP4 / MXFP8 and the swizzled scale layout (docs/formats-mx.md).

The numpy reference every backend reproduces bit for bit (quantize, dequantize, swizzle) and
the fp64 reference of ``scaled_fp4_mm`` (a tolerance-tier op). Everything works along the last
dimension, which must be a multiple of the block size; all work is vectorized.

Element formats
    E2M1 (fp4): ``+-{0, .5, 1, 1.5, 2, 3, 4, 6}``, bit 3 the sign. Rounding is round-to-nearest-
    even with saturation (``cvt.rn.satfinite``): +-Inf -> +-6, fp32 denormals -> +-0, the sign of
    zero is kept (-0.0 -> 0x8). E2M1 has no NaN: **NaN -> 0x7 (+6)**, whatever its sign bit, as
    CUDA's ``__nv_cvt_float_to_fp4`` does.
    E4M3 ("fn", fp8): RNE, saturating to +-448, NaN -> 0x7F (one canonical NaN byte).
    E8M0 (MX scale): byte b means ``2^(b-127)``; 0xFF is NaN.

Packing: element 2i is the LOW nibble of byte i (``[0, .5, 4, -0] -> 0x10, 0x86``), the opposite
of bitsandbytes.

MX (block 32, one E8M0 scale per block), ``scale_mode``:
    floor  ``e = floor(log2(amax)) - emax_elem`` from amax's fp32 exponent bits, clamped to
           [-127, 128]: fp32-denormal or zero amax -> byte 0.
    rceil  ``e = ceil(log2(amax / max_elem))`` in exact arithmetic, i.e. floor's ``e`` plus one
           exactly when amax's mantissa exceeds the element's largest mantissa (1.5 for E2M1,
           1.75 for E4M3), clamped to [-127, 127].
    In both modes a block whose amax is NaN or Inf (amax propagates NaN) gets scale 0xFF.
    Elements: ``q = cvt(f32(x * 2^-e))`` (an exact power-of-two scaling); a 0xFF block scales by
    NaN, so every code of it is the element's NaN code (0x7 for E2M1, 0x7F for E4M3).

NVFP4 (block 16, E4M3 scale, fp32 global scale ``g = 2688 / amax(tensor)``), in this order::

    amax_b = max |x| over the block (NaN propagates)
    s8 = e4m3_rne_satfinite(f32(g * f32(amax_b * f32(1/6))))
    s  = float(s8)
    os = f32(g * f32(1/s)) if s != 0 else 0
    q  = e2m1_rne_satfinite(f32(x * os))

    Dequantize: ``x = f32(f32(e2m1(q) * s) / g)`` (the product is exact; one IEEE division).

Swizzled scales (cuBLAS / CUTLASS block-scaled layout): the [M, C] scale matrix padded with
zeros to (ceil(M/128)*128, ceil(C/4)*4), tiles of 128 x 4 bytes stored row-tile-major, inside a
tile element (r, c) at ``(r % 32) * 16 + (r // 32) * 4 + c``.
"""

from __future__ import annotations

import math

import numpy as np

from ..arrays import BF16, as_dtype
from ..errors import ParameterError

F32 = np.float32
F64 = np.float64

# -- element formats ---------------------------------------------------------------------------
#: E2M1 decode table, index = 4-bit code (bit 3 = sign).
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=F32
)
E2M1_MAX = 6.0
E2M1_SIGN_BIT = 0x8
#: E2M1 has no NaN; a NaN input converts to this code (+6), as CUDA's conversion does.
E2M1_NAN_CODE = 0x7
#: Rounding midpoints between consecutive E2M1 magnitudes (ties go to the even code).
E2M1_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=F32)

E4M3_MAX = 448.0
#: The one NaN byte quantcore writes for E4M3 (0xFF decodes as NaN too).
E4M3_NAN_CODE = 0x7F
E4M3 = np.dtype("float8_e4m3fn")

E8M0_BIAS = 127
E8M0_NAN = 0xFF

#: Largest exponent of each element format (``floor(log2(max_elem))``), the OCP spec's emax.
EMAX_ELEM = {"e2m1": 2, "e2m3": 2, "e3m2": 4, "e4m3": 8, "e5m2": 15}
#: Largest finite value of each element format.
MAX_ELEM = {"e2m1": E2M1_MAX, "e2m3": 7.5, "e3m2": 28.0, "e4m3": E4M3_MAX, "e5m2": 57344.0}
#: fp32 mantissa field (23 bits) of each format's largest value: rceil adds one to floor's
#: exponent exactly when amax's mantissa field is larger than this.
MAX_MANTISSA_BITS = {"e2m1": 0x400000, "e2m3": 0x700000, "e3m2": 0x600000, "e4m3": 0x600000,
                     "e5m2": 0x600000}

# -- block formats -----------------------------------------------------------------------------
MX_BLOCK = 32
NVFP4_BLOCK = 16
#: fmt -> (element format, block size, scale format)
FORMATS = {
    "mxfp4": ("e2m1", MX_BLOCK, "e8m0"),
    "mxfp8": ("e4m3", MX_BLOCK, "e8m0"),
    "nvfp4": ("e2m1", NVFP4_BLOCK, "e4m3"),
}
MX_FORMATS = tuple(FORMATS)
FP4_FORMATS = ("mxfp4", "nvfp4")
SCALE_MODES = ("floor", "rceil")
BLOCK_SIZE = {fmt: spec[1] for fmt, spec in FORMATS.items()}

#: NVFP4's global-scale numerator: ``g = 2688 / amax`` (6 * 448, so a block holding the tensor's
#: amax gets the largest E4M3 scale).
NVFP4_GLOBAL_NUMERATOR = E2M1_MAX * E4M3_MAX
#: f32(1/6), the multiplier of NVFP4's block amax (a multiplication, not a division).
NVFP4_INV_E2M1_MAX = F32(1.0) / F32(E2M1_MAX)

# -- swizzled scale layout ---------------------------------------------------------------------
SWIZZLE_ROWS = 128
SWIZZLE_COLS = 4
SWIZZLE_ROW_GROUP = 32
SWIZZLE_TILE_BYTES = SWIZZLE_ROWS * SWIZZLE_COLS

#: Integer codes the launchers receive (one definition for every dialect).
MX_FORMAT_CODE = {"mxfp4": 0, "mxfp8": 1, "nvfp4": 2}
SCALE_MODE_CODE = {"floor": 0, "rceil": 1}


def block_size(fmt: str) -> int:
    return BLOCK_SIZE[fmt]


def element_format(fmt: str) -> str:
    return FORMATS[fmt][0]


def codes_cols(fmt: str, k: int) -> int:
    """Bytes per row of packed codes for K elements: K/2 for fp4, K for fp8."""
    return k // 2 if FORMATS[fmt][0] == "e2m1" else k


def swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    """Shape of the swizzled form of a [rows, cols] scale matrix (padded to 128 x 4 tiles)."""
    return (-(-rows // SWIZZLE_ROWS) * SWIZZLE_ROWS, -(-cols // SWIZZLE_COLS) * SWIZZLE_COLS)


# -- E2M1 ----------------------------------------------------------------------------------------
def e2m1_round_codes(v: np.ndarray) -> np.ndarray:
    """fp32 -> E2M1 codes (uint8 0..15), RNE with saturation; NaN -> 0x7.

    Rounds to the grid of each binade range with ``rint`` after an exact power-of-two scaling:
    spacing 0.5 on [0, 2), 1 on [2, 4), 2 on [4, inf). (The threshold rule in the tests is an
    independent formulation; both agree on all 2^32 fp32 inputs.)
    """
    v = np.asarray(v, dtype=F32)
    a = np.abs(v)
    with np.errstate(invalid="ignore", over="ignore"):
        low = np.rint(a * F32(2.0))  # index = 2a on [0, 2): values 0, .5, 1, 1.5, (2)
        mid = np.rint(a) + F32(2.0)  # 2, 3, (4) -> 4, 5, (6)
        high = np.minimum(np.rint(a * F32(0.5)) + F32(4.0), F32(7.0))  # 4, 6 -> 6, 7; saturate
        idx = np.where(a < F32(2.0), low, np.where(a < F32(4.0), mid, high))
    idx = np.where(np.isnan(v), F32(E2M1_NAN_CODE), idx).astype(np.uint8)
    sign = (np.signbit(v) & ~np.isnan(v)).astype(np.uint8) << 3
    return idx | sign


def e2m1_decode(codes: np.ndarray) -> np.ndarray:
    """E2M1 codes (low 4 bits) -> fp32 values."""
    return E2M1_VALUES[np.asarray(codes, dtype=np.uint8) & 0x0F]


def pack_fp4(codes: np.ndarray) -> np.ndarray:
    """[..., K] codes (K even) -> [..., K/2] bytes, element 2i in the low nibble."""
    c = np.asarray(codes, dtype=np.uint8)
    return (c[..., 0::2] & 0x0F) | ((c[..., 1::2] & 0x0F) << 4)


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """[..., K/2] bytes -> [..., K] codes (inverse of :func:`pack_fp4`)."""
    p = np.asarray(packed, dtype=np.uint8)
    out = np.empty(p.shape[:-1] + (p.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = p & 0x0F
    out[..., 1::2] = p >> 4
    return out


# -- E4M3 ----------------------------------------------------------------------------------------
def e4m3_round_codes(v: np.ndarray) -> np.ndarray:
    """fp32 -> E4M3 ("fn") bytes: RNE, saturating to +-448 (+-Inf too), NaN -> 0x7F."""
    v = np.asarray(v, dtype=F32)
    # saturation after rounding equals clamping before it, because 448 is representable
    clipped = np.clip(v, F32(-E4M3_MAX), F32(E4M3_MAX))
    with np.errstate(invalid="ignore"):
        codes = clipped.astype(E4M3).view(np.uint8)
    return np.where(np.isnan(v), np.uint8(E4M3_NAN_CODE), codes).astype(np.uint8)


def e4m3_decode(codes: np.ndarray) -> np.ndarray:
    """E4M3 bytes -> fp32 (0x7F / 0xFF -> NaN)."""
    return np.ascontiguousarray(codes, dtype=np.uint8).view(E4M3).astype(F32)


# -- E8M0 ----------------------------------------------------------------------------------------
def e8m0_decode(scales: np.ndarray) -> np.ndarray:
    """E8M0 bytes -> fp32 ``2^(b-127)`` (byte 0 is the fp32 denormal 2^-127; 0xFF -> NaN)."""
    b = np.asarray(scales, dtype=np.uint8).astype(np.int32)
    val = np.ldexp(F64(1.0), np.minimum(b, E8M0_NAN - 1) - E8M0_BIAS).astype(F32)
    return np.where(b == E8M0_NAN, F32(np.nan), val).astype(F32)


def _f32_fields(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    bits = np.ascontiguousarray(a, dtype=F32).view(np.uint32)
    return ((bits >> 23) & 0xFF).astype(np.int32), (bits & 0x7FFFFF).astype(np.int32)


def e8m0_scale(amax: np.ndarray, elem: str, scale_mode: str) -> np.ndarray:
    """Block amax (fp32, >= 0 or NaN / Inf) -> E8M0 scale bytes, ``scale_mode`` floor or rceil."""
    amax = np.asarray(amax, dtype=F32)
    exp_field, mant = _f32_fields(amax)
    e = exp_field - 127 - EMAX_ELEM[elem]  # floor(log2(amax)) - emax for normal amax
    if scale_mode == "rceil":
        e = e + (mant > MAX_MANTISSA_BITS[elem]).astype(np.int32)
        hi = E8M0_BIAS  # a finite amax never needs more; 0xFE stays unused
    elif scale_mode == "floor":
        hi = E8M0_BIAS + 1
    else:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    # denormal and zero amax: exponent field 0 gives e <= -129 -> clamped to byte 0
    byte = np.clip(e, -E8M0_BIAS, hi) + E8M0_BIAS
    return np.where(~np.isfinite(amax), E8M0_NAN, byte).astype(np.uint8)


def e8m0_element_multiplier(scales: np.ndarray) -> np.ndarray:
    """The exact fp32 factor ``2^(127-b)`` that maps a block into its element range; NaN for 0xFF."""
    b = np.asarray(scales, dtype=np.uint8).astype(np.int32)
    val = np.ldexp(F64(1.0), E8M0_BIAS - b).astype(F32)
    return np.where(b == E8M0_NAN, F32(np.nan), val).astype(F32)


# -- block helpers -------------------------------------------------------------------------------
def _blocks(x: np.ndarray, blk: int) -> np.ndarray:
    x = np.asarray(x)
    if x.shape[-1] % blk:
        raise ValueError(f"the last dimension ({x.shape[-1]}) must be a multiple of {blk}")
    return x.astype(F32).reshape(*x.shape[:-1], x.shape[-1] // blk, blk)


def block_amax(b: np.ndarray) -> np.ndarray:
    """max |x| over the last axis, NaN propagating (a NaN anywhere makes the block's amax NaN)."""
    return np.max(np.abs(b), axis=-1).astype(F32)


def _encode_elements(v: np.ndarray, elem: str) -> np.ndarray:
    return e2m1_round_codes(v) if elem == "e2m1" else e4m3_round_codes(v)


def _decode_elements(codes: np.ndarray, elem: str) -> np.ndarray:
    return e2m1_decode(codes) if elem == "e2m1" else e4m3_decode(codes)


# -- MX ------------------------------------------------------------------------------------------
def quantize_mx(x: np.ndarray, fmt: str, scale_mode: str = "floor") -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 / MXFP8 of ``x [..., K]`` (K % 32 == 0), any float dtype.

    Returns ``(codes uint8 [..., K/2] (mxfp4, packed) or [..., K] (mxfp8, E4M3 bytes),
    scales uint8 [..., K/32] (E8M0, row-major))``.
    """
    elem, blk, _ = FORMATS[fmt]
    b = _blocks(x, blk)
    scales = e8m0_scale(block_amax(b), elem, scale_mode)
    with np.errstate(invalid="ignore", over="ignore"):
        scaled = (b * e8m0_element_multiplier(scales)[..., None]).astype(F32)
    codes = _encode_elements(scaled, elem).reshape(*b.shape[:-2], -1)
    return (pack_fp4(codes) if elem == "e2m1" else codes), scales


def dequantize_mx(codes: np.ndarray, scales: np.ndarray, fmt: str, out_dtype=F32) -> np.ndarray:
    """Inverse of :func:`quantize_mx`: ``f32(elem(q) * 2^(b-127))`` then rounded to ``out_dtype``."""
    elem, blk, _ = FORMATS[fmt]
    q = unpack_fp4(codes) if elem == "e2m1" else np.asarray(codes, dtype=np.uint8)
    vals = _decode_elements(q, elem).reshape(*q.shape[:-1], q.shape[-1] // blk, blk)
    with np.errstate(invalid="ignore", over="ignore"):
        out = (vals * e8m0_decode(scales)[..., None]).astype(F32)
    return out.reshape(q.shape).astype(out_dtype)


# -- NVFP4 ---------------------------------------------------------------------------------------
def _amax_value(amax) -> float:
    """A host number (Python or numpy int / float, or a one-element real array) as a float."""
    if isinstance(amax, (bool, np.bool_)):
        raise ParameterError(f"amax must be a number, got {amax!r}")
    if isinstance(amax, (int, float, np.integer, np.floating)):
        try:
            return float(amax)
        except OverflowError:  # a Python int beyond any float
            return float("inf")
    if hasattr(amax, "shape") and hasattr(amax, "dtype") and not isinstance(amax, np.generic):
        try:
            kind = as_dtype(amax.dtype).kind
            size = int(np.prod(tuple(int(s) for s in amax.shape)))
        except (TypeError, ValueError):
            kind, size = "", 0
        if kind in "fiu" and kind and size == 1:
            return float(amax.reshape(-1)[0])
        raise ParameterError(f"amax must be a number or a real array of one element, got "
                             f"{type(amax).__name__} of dtype {amax.dtype} and shape {tuple(amax.shape)}")
    raise ParameterError(f"amax must be a number (the tensor's max |x|), got {type(amax).__name__} {amax!r:.40}")


def nvfp4_global_scale(amax) -> np.float32:
    """``f32(2688 / amax)``: the global scale that maps the tensor's amax to E4M3 max x E2M1 max.

    NaN / Inf rule: ``amax`` (a Python or numpy number, or a real array of one element) must be
    finite and > 0 once rounded to fp32, and ``2688 / amax`` must be a finite fp32 (amax >= about
    7.9e-36); anything else is a :class:`~quantcore.errors.ParameterError`. A tensor holding an Inf
    or a NaN, or only zeros, has no NVFP4 global scale: its global scale would be 0, NaN or Inf and
    every dequantized value non-finite. Replace the non-finite values first, or pass a global scale
    of your choice to ``scaled_nvfp4_quant``.
    """
    a = _amax_value(amax)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        a32 = F32(a)
        g = F32(F32(NVFP4_GLOBAL_NUMERATOR) / a32)
    if math.isfinite(a) and a > 0 and not np.isfinite(a32):
        raise ParameterError(f"amax {a!r} overflows float32; nvfp4_global_scale needs a finite "
                             "positive float32 amax (the tensor's max |x|)")
    if not (np.isfinite(a32) and a32 > 0):
        raise ParameterError(
            f"nvfp4_global_scale needs a finite positive amax (the tensor's max |x|), got {a!r}: "
            "a tensor holding Inf or NaN, or only zeros, has no NVFP4 global scale; replace the "
            "non-finite values or pass a global_scale of your choice")
    if not np.isfinite(g):
        raise ParameterError(f"amax {a!r} is too small: {NVFP4_GLOBAL_NUMERATOR:g} / amax overflows float32 (amax must be "
                             f">= {float(F32(NVFP4_GLOBAL_NUMERATOR) / F32(np.finfo(F32).max)):.3g})")
    return g


def nvfp4_block_scales(amax_b: np.ndarray, g) -> np.ndarray:
    """Block amax (fp32) and global scale -> E4M3 scale bytes (``s8`` of the module docstring)."""
    g = F32(g)
    with np.errstate(invalid="ignore", over="ignore"):
        v = (g * (np.asarray(amax_b, dtype=F32) * NVFP4_INV_E2M1_MAX).astype(F32)).astype(F32)
    return e4m3_round_codes(v)


def quantize_nvfp4(x: np.ndarray, global_scale) -> tuple[np.ndarray, np.ndarray]:
    """NVFP4 of ``x [..., K]`` (K % 16 == 0) with fp32 global scale ``g``.

    Returns ``(codes uint8 [..., K/2] (packed E2M1), scales uint8 [..., K/16] (E4M3, row-major))``.
    """
    g = F32(global_scale)
    b = _blocks(x, NVFP4_BLOCK)
    s8 = nvfp4_block_scales(block_amax(b), g)
    s = e4m3_decode(s8)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        rcp = (F32(1.0) / np.where(s != 0, s, F32(1.0))).astype(F32)
        os = np.where(s != 0, (g * rcp).astype(F32), F32(0.0)).astype(F32)
        scaled = (b * os[..., None]).astype(F32)
    codes = e2m1_round_codes(scaled).reshape(*b.shape[:-2], -1)
    return pack_fp4(codes), s8


def dequantize_nvfp4(codes: np.ndarray, scales: np.ndarray, global_scale, out_dtype=F32) -> np.ndarray:
    """Inverse of :func:`quantize_nvfp4`: ``f32(f32(e2m1(q) * s) / g)``, then ``out_dtype``."""
    g = F32(global_scale)
    q = unpack_fp4(codes)
    vals = e2m1_decode(q).reshape(*q.shape[:-1], q.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        prod = (vals * e4m3_decode(scales)[..., None]).astype(F32)
        out = (prod / g).astype(F32)
    return out.reshape(q.shape).astype(out_dtype)


# -- one entry point per direction (the cpu backend and the conformance suite use these) ----------
def quantize(x: np.ndarray, fmt: str, *, scale_mode: str = "floor", global_scale=None):
    """``(codes, row-major scales)`` of ``x [..., K]`` in ``fmt`` (see the functions above)."""
    if fmt == "nvfp4":
        return quantize_nvfp4(x, global_scale)
    return quantize_mx(x, fmt, scale_mode)


def dequantize(codes: np.ndarray, scales: np.ndarray, fmt: str, *, global_scale=None, out_dtype=F32):
    """Values ``[..., K]`` in ``out_dtype`` of row-major ``codes`` / ``scales`` in ``fmt``."""
    if fmt == "nvfp4":
        return dequantize_nvfp4(codes, scales, global_scale, out_dtype)
    return dequantize_mx(codes, scales, fmt, out_dtype)


# -- swizzled scale layout -----------------------------------------------------------------------
def swizzle_offsets(rows: int, cols: int) -> np.ndarray:
    """int64 [rows, cols]: the byte offset of scale (r, c) inside the swizzled buffer."""
    _, pc = swizzled_shape(rows, cols)
    r = np.arange(rows, dtype=np.int64)[:, None]
    c = np.arange(cols, dtype=np.int64)[None, :]
    tile = (r // SWIZZLE_ROWS) * (pc // SWIZZLE_COLS) + c // SWIZZLE_COLS
    inner = (r % SWIZZLE_ROW_GROUP) * 16 + ((r % SWIZZLE_ROWS) // SWIZZLE_ROW_GROUP) * 4 + c % SWIZZLE_COLS
    return tile * SWIZZLE_TILE_BYTES + inner


def swizzle(scales: np.ndarray) -> np.ndarray:
    """uint8 [M, C] -> uint8 [ceil(M/128)*128, ceil(C/4)*4] in the 128x4 tile layout, padding 0."""
    s = np.asarray(scales, dtype=np.uint8)
    rows, cols = s.shape
    pr, pc = swizzled_shape(rows, cols)
    out = np.zeros(pr * pc, dtype=np.uint8)
    out[swizzle_offsets(rows, cols)] = s
    return out.reshape(pr, pc)


def unswizzle(swz: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Inverse of :func:`swizzle`: the [rows, cols] scales out of a swizzled buffer."""
    flat = np.asarray(swz, dtype=np.uint8).reshape(-1)
    return flat[swizzle_offsets(rows, cols)]


# -- scaled_fp4_mm ---------------------------------------------------------------------------------
def fp4_operand(codes: np.ndarray, scales_swizzled: np.ndarray, fmt: str) -> np.ndarray:
    """fp64 [R, K] of a packed fp4 operand with swizzled scales: ``e2m1(q) * scale`` exactly
    (the NVFP4 global scale is not applied: it belongs to ``alpha``)."""
    q = unpack_fp4(codes)
    rows, k = q.shape
    blk = BLOCK_SIZE[fmt]
    sc = unswizzle(scales_swizzled, rows, k // blk)
    scale = e4m3_decode(sc) if fmt == "nvfp4" else e8m0_decode(sc)
    vals = e2m1_decode(q).astype(F64).reshape(rows, k // blk, blk)
    return (vals * scale.astype(F64)[..., None]).reshape(rows, k)


def scaled_fp4_mm(a, b, scale_a, scale_b, alpha, bias=None, fmt: str = "nvfp4") -> np.ndarray:
    """``D = alpha * A @ B^T + bias`` -> bfloat16 [M, N].

    ``a`` uint8 [M, K/2], ``b`` uint8 [N, K/2] (packed E2M1), ``scale_a`` / ``scale_b`` swizzled
    (E4M3 for nvfp4, E8M0 for mxfp4), ``alpha`` fp32, ``bias`` [N] or None. The operands are
    exact in fp64, the product is accumulated in fp64 and ``alpha * acc + bias`` is rounded to
    fp32, then to bfloat16.
    """
    A = fp4_operand(a, scale_a, fmt)
    B = fp4_operand(b, scale_b, fmt)
    with np.errstate(invalid="ignore", over="ignore"):
        d = F64(F32(alpha)) * (A @ B.T)
        if bias is not None:
            d = d + np.asarray(bias).astype(F32).astype(F64).reshape(1, -1)
        return d.astype(F32).astype(BF16)


# -- linear_mx (weight-only MX: fp4 weight, float activations) ------------------------------------
#: Rows of the weight dequantized at a time by :func:`linear_mx` (about 1M elements).
LINEAR_CHUNK_ELEMS = 1 << 20


def linear_mx(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, fmt: str, *, global_scale=None,
              out_dtype=None) -> np.ndarray:
    """``y = x @ W^T`` for an fp4 weight ``W [N, K]`` given as packed codes ``[N, K/2]`` and
    ROW-MAJOR scales ``[N, K/blk]`` (unswizzle swizzled scales first), ``fmt`` "mxfp4" | "nvfp4".

    Semantics (the reference of the tolerance-tier op ``linear_mx``):

    1. ``W = dequantize(codes, scales, fmt, global_scale=g)`` in fp32 exactly as
       :func:`dequantize` gives it (MXFP4: ``f32(e2m1(q) * 2^(b-127))``; NVFP4:
       ``f32(f32(e2m1(q) * s) / g)``);
    2. ``acc = f32(x) @ W^T``, an fp32 matrix product (summation order unspecified);
    3. ``y = out_dtype(acc)``: ONE rounding into the output dtype (default: x's dtype).

    ``x`` is [B, K] (fp32 / fp16 / bf16). The weight is dequantized a panel of whole rows at a time
    (:data:`LINEAR_CHUNK_ELEMS`), so temporaries stay small whatever N and K are.
    """
    x2 = np.asarray(x)
    out_dtype = x2.dtype if out_dtype is None else as_dtype(out_dtype)
    k = x2.shape[-1]
    n = codes.shape[0]
    a32 = x2.reshape(-1, k).astype(F32)
    acc = np.empty((a32.shape[0], n), F32)
    step = max(1, LINEAR_CHUNK_ELEMS // max(k, 1))
    with np.errstate(invalid="ignore", over="ignore"):
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            w = dequantize(codes[r0:r1], scales[r0:r1], fmt, global_scale=global_scale, out_dtype=F32)
            acc[:, r0:r1] = a32 @ w.T
        return acc.astype(out_dtype)


# -- what a complete backend covers, and what the kernels are told -----------------------------
def capabilities():
    """The MX family's entries of :data:`quantcore.ops.ALL_CAPABILITIES`."""
    from ..backend import Capability

    caps = []
    for fmt in MX_FORMATS:
        for dt in ("float32", "float16", "bfloat16"):
            caps.append(Capability("mx_quantize", fmt, dt, BLOCK_SIZE[fmt]))
            caps.append(Capability("mx_dequantize", fmt, dt, BLOCK_SIZE[fmt]))
    caps.append(Capability("swizzle_scales", "scales128x4", "uint8", SWIZZLE_TILE_BYTES))
    caps.append(Capability("unswizzle_scales", "scales128x4", "uint8", SWIZZLE_TILE_BYTES))
    for fmt in FP4_FORMATS:
        caps.append(Capability("scaled_fp4_mm", fmt, "bfloat16", BLOCK_SIZE[fmt]))
        for dt in ("float32", "float16", "bfloat16"):
            caps.append(Capability("linear_mx", fmt, dt, BLOCK_SIZE[fmt]))
    return caps


def _f32(v: float) -> str:
    s = f"{float(F32(v)):.9g}"
    return s + ("f" if ("." in s or "e" in s) else ".0f")


def kernel_constants() -> list[tuple[str, str]]:
    """(macro, value) pairs for ``quantcore_constants.h`` (see :mod:`.kernel_defines`)."""
    vals = "{" + ", ".join(_f32(v) for v in E2M1_VALUES) + "}"
    mids = "{" + ", ".join(_f32(v) for v in E2M1_MIDPOINTS) + "}"
    e = [
        ("QC_E2M1_VALUES_INIT", vals),
        ("QC_E2M1_MIDPOINTS_INIT", mids),
        ("QC_E2M1_MAX", _f32(E2M1_MAX)),
        ("QC_E2M1_SIGN_BIT", str(E2M1_SIGN_BIT)),
        ("QC_E2M1_NAN_CODE", str(E2M1_NAN_CODE)),
        ("QC_E4M3_MAX", _f32(E4M3_MAX)),
        ("QC_E4M3_NAN_CODE", str(E4M3_NAN_CODE)),
        ("QC_E8M0_BIAS", str(E8M0_BIAS)),
        ("QC_E8M0_NAN", str(E8M0_NAN)),
        ("QC_MX_BLOCK", str(MX_BLOCK)),
        ("QC_NVFP4_BLOCK", str(NVFP4_BLOCK)),
        ("QC_NVFP4_GLOBAL_NUMERATOR", _f32(NVFP4_GLOBAL_NUMERATOR)),
        ("QC_NVFP4_INV_E2M1_MAX", _f32(NVFP4_INV_E2M1_MAX)),
        ("QC_SWIZZLE_ROWS", str(SWIZZLE_ROWS)),
        ("QC_SWIZZLE_COLS", str(SWIZZLE_COLS)),
        ("QC_SWIZZLE_ROW_GROUP", str(SWIZZLE_ROW_GROUP)),
        ("QC_SWIZZLE_TILE_BYTES", str(SWIZZLE_TILE_BYTES)),
        ("QC_SCALE_MODE_FLOOR", str(SCALE_MODE_CODE["floor"])),
        ("QC_SCALE_MODE_RCEIL", str(SCALE_MODE_CODE["rceil"])),
    ]
    for fmt, code in MX_FORMAT_CODE.items():
        e.append((f"QC_FMT_{fmt.upper()}", str(code)))
    # byte tables of the E2M1 magnitudes (codes 0..7) in fp16 / bf16, four bytes per word (a prmt
    # table: word 0 holds codes 0..3, word 1 codes 4..7): the fp16 values' high bytes (their low
    # bytes are zero), the bf16 values' high and low bytes
    mags = E2M1_VALUES[:8]
    f16 = mags.astype(np.float16).view(np.uint16).astype(np.uint32)
    bf16 = mags.astype(np.float32).view(np.uint32) >> 16
    for name, b in (("F16_HI", f16 >> 8), ("BF16_HI", bf16 >> 8), ("BF16_LO", bf16 & 0xFF)):
        for w in range(2):
            word = sum(int(b[4 * w + i]) << (8 * i) for i in range(4))
            e.append((f"QC_E2M1_{name}{w}", f"0x{word:08X}u"))
    for elem in ("e2m1", "e4m3"):
        e.append((f"QC_EMAX_{elem.upper()}", str(EMAX_ELEM[elem])))
        e.append((f"QC_MAX_MANTISSA_BITS_{elem.upper()}", hex(MAX_MANTISSA_BITS[elem])))
    return e
