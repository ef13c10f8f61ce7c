// Element and scale conversions of the MX family (NVFP4, MXFP4, MXFP8), bit for bit with
// quantcore.formats.mx, and the swizzled scale layout.
//
// Software conversions only, in integer arithmetic and comparisons: no conversion instruction
// (MetaX documents none for E2M1 / E4M3 / E8M0, and sm_90 has no E2M1 one), no arithmetic whose
// result depends on FMA contraction or on the device's rounding of special cases. They are
// __host__ __device__ so that tests/test_maca.py can check them on the host against the numpy
// reference, with the same code the kernels run.
//
// The values the core owns (E2M1 values and midpoints, E4M3 max and NaN byte, E8M0 bias and NaN
// byte, the swizzle geometry) come from quantcore_constants.h. The bit layouts below (fp32's
// 8/23 split, E4M3's 4 exponent bits with bias 7 and 3 mantissa bits) are the formats'
// definitions, not tables.
#pragma once

#include "qc_maca.h"

#define QC_F32_MANT_BITS 23
#define QC_F32_BIAS 127
#define QC_F32_MANT_MASK 0x7fffffu
#define QC_F32_ABS_MASK 0x7fffffffu
#define QC_F32_INF_BITS 0x7f800000u
#define QC_F32_QNAN_BITS 0x7fffffffu
// 2^-127 (E8M0 byte 0, and the multiplier of byte 254) is an fp32 subnormal: mantissa bit 22.
#define QC_F32_TWO_POW_M127_BITS 0x00400000u
#define QC_E4M3_MANT_BITS 3
#define QC_E4M3_EXP_BIAS 7

__host__ __device__ __forceinline__ uint32_t qc_f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}
__host__ __device__ __forceinline__ float qc_f32_from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}
__host__ __device__ __forceinline__ bool qc_is_nan(float f) {
  return (qc_f32_bits(f) & QC_F32_ABS_MASK) > QC_F32_INF_BITS;
}

// ---- E2M1 ------------------------------------------------------------------------------------
// fp32 -> E2M1 code: round to nearest even with saturation ("rn.satfinite"); NaN (either sign)
// -> QC_E2M1_NAN_CODE; the sign bit is copied (-0.0 -> 0x8). The magnitude index is the number
// of midpoints below |y|; at a midpoint exactly, it rounds to the even index of its two
// neighbours (midpoint i lies between indices i and i + 1). +-Inf counts every midpoint: +-6.
// This is the threshold rule that tests/test_mx_exhaustive.py proves equal to the reference on
// all 2^32 fp32 inputs.
__host__ __device__ __forceinline__ uint32_t qc_e2m1_code(float y) {
  if (qc_is_nan(y)) return QC_E2M1_NAN_CODE;
  const float mids[] = QC_E2M1_MIDPOINTS_INIT;
  const float a = fabsf(y);
  uint32_t q = 0;
#pragma unroll
  for (int i = 0; i < (int)(sizeof(mids) / sizeof(mids[0])); ++i)
    q += (a > mids[i] || (a == mids[i] && ((i + 1) & 1) == 0)) ? 1u : 0u;
  return q | ((qc_f32_bits(y) >> 31) ? (uint32_t)QC_E2M1_SIGN_BIT : 0u);
}

// ---- E4M3 ("fn": no Inf, NaN = 0x7F / 0xFF) --------------------------------------------------
// fp32 -> E4M3 byte: RNE, saturating to +-QC_E4M3_MAX (Inf too), NaN -> QC_E4M3_NAN_CODE, sign
// kept (-0.0 and negative values that round to zero give 0x80, as ml_dtypes writes them).
__host__ __device__ __forceinline__ uint32_t qc_e4m3_code(float v) {
  const uint32_t u = qc_f32_bits(v);
  const uint32_t sign = (u >> 24) & 0x80u;
  uint32_t a = u & QC_F32_ABS_MASK;
  if (a > QC_F32_INF_BITS) return QC_E4M3_NAN_CODE;
  const uint32_t max_bits = qc_f32_bits(QC_E4M3_MAX);
  if (a > max_bits) a = max_bits;  // the max is on the grid: clamping = saturating after rounding
  const uint32_t exp = a >> QC_F32_MANT_BITS;
  const uint32_t rebias = QC_F32_BIAS - QC_E4M3_EXP_BIAS;  // E4M3 exponent = fp32 exponent - rebias
  if (exp > rebias) {  // E4M3 normal: round the fp32 mantissa to QC_E4M3_MANT_BITS bits
    const uint32_t shift = QC_F32_MANT_BITS - QC_E4M3_MANT_BITS;
    const uint32_t r = a + ((1u << (shift - 1)) - 1u) + ((a >> shift) & 1u);
    return sign | ((r >> shift) - (rebias << QC_E4M3_MANT_BITS));  // a carry lands in the exponent
  }
  // E4M3 subnormal range (below 2^(1 - bias)): an integer count of the spacing
  // 2^(1 - bias - mant bits); fp32 subnormals and anything below a quarter spacing give zero.
  // The count can round up to 2^mant bits: the smallest normal, whose encoding it is.
  if (exp == 0) return sign;
  const uint32_t shift = (QC_F32_BIAS + QC_F32_MANT_BITS) - (QC_E4M3_EXP_BIAS + QC_E4M3_MANT_BITS - 1) - exp;
  if (shift > QC_F32_MANT_BITS + 2) return sign;
  const uint32_t m = (a & QC_F32_MANT_MASK) | (1u << QC_F32_MANT_BITS);
  const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  uint32_t q = m >> shift;
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return sign | q;
}

// E4M3 byte -> fp32, exact (0x7F / 0xFF -> NaN).
__host__ __device__ __forceinline__ float qc_e4m3_value(uint32_t b) {
  if ((b & 0x7fu) == 0x7fu) return qc_f32_from_bits(QC_F32_QNAN_BITS);
  const uint32_t e = (b >> QC_E4M3_MANT_BITS) & 0xfu, m = b & ((1u << QC_E4M3_MANT_BITS) - 1u);
  float mag;
  if (e == 0u) {  // m * 2^(1 - bias - mant bits): a normal fp32, built from its bits
    mag = 0.0f;
    if (m != 0u) {
      int lead = 2;  // index of m's highest set bit (m < 8)
      while (!((m >> lead) & 1u)) --lead;
      const uint32_t exp = QC_F32_BIAS + 1 - QC_E4M3_EXP_BIAS - QC_E4M3_MANT_BITS + lead;
      const uint32_t frac = (m & ((1u << lead) - 1u)) << (QC_F32_MANT_BITS - lead);
      mag = qc_f32_from_bits((exp << QC_F32_MANT_BITS) | frac);
    }
  } else {
    mag = qc_f32_from_bits(((e + QC_F32_BIAS - QC_E4M3_EXP_BIAS) << QC_F32_MANT_BITS) |
                           (m << (QC_F32_MANT_BITS - QC_E4M3_MANT_BITS)));
  }
  return (b & 0x80u) ? -mag : mag;
}

// ---- E8M0 (MX scale) -------------------------------------------------------------------------
// Block amax (|x| max: >= 0, or NaN / Inf) -> scale byte. floor: e = E(amax) - bias - emax from
// amax's exponent field E (zero and subnormal amax clamp to byte 0); rceil adds one exactly when
// amax's mantissa field exceeds that of the element's largest value (ceil(log2(amax / max_elem))
// in exact arithmetic) and stops at byte 254. NaN or Inf amax -> QC_E8M0_NAN.
__host__ __device__ __forceinline__ uint32_t qc_e8m0_scale(float amax, int emax, uint32_t max_mant,
                                                           bool rceil) {
  const uint32_t u = qc_f32_bits(amax);
  const int ef = (int)((u >> QC_F32_MANT_BITS) & 0xffu);
  if (ef == 0xff) return QC_E8M0_NAN;
  int e = ef - QC_F32_BIAS - emax;
  int hi = QC_E8M0_BIAS + 1;
  if (rceil) {
    e += ((u & QC_F32_MANT_MASK) > max_mant) ? 1 : 0;
    hi = QC_E8M0_BIAS;
  }
  e = e < -QC_E8M0_BIAS ? -QC_E8M0_BIAS : (e > hi ? hi : e);
  return (uint32_t)(e + QC_E8M0_BIAS);
}

// Scale byte -> 2^(b - bias) (byte 0 is the fp32 subnormal 2^-127; 0xFF -> NaN).
__host__ __device__ __forceinline__ float qc_e8m0_value(uint32_t b) {
  if (b == (uint32_t)QC_E8M0_NAN) return qc_f32_from_bits(QC_F32_QNAN_BITS);
  if (b == 0u) return qc_f32_from_bits(QC_F32_TWO_POW_M127_BITS);
  return qc_f32_from_bits(b << QC_F32_MANT_BITS);
}

// The exact factor 2^(bias - b) that maps a block into its element range (NaN for 0xFF; byte 0
// gives 2^127, byte 254 the subnormal 2^-127).
__host__ __device__ __forceinline__ float qc_e8m0_multiplier(uint32_t b) {
  if (b == (uint32_t)QC_E8M0_NAN) return qc_f32_from_bits(QC_F32_QNAN_BITS);
  const uint32_t exp = 2u * QC_E8M0_BIAS - b;  // biased fp32 exponent of 2^(bias - b)
  if (exp == 0u) return qc_f32_from_bits(QC_F32_TWO_POW_M127_BITS);
  return qc_f32_from_bits(exp << QC_F32_MANT_BITS);
}

// ---- swizzled scale layout (128 x 4 tiles, row-tile-major) -----------------------------------
#define QC_SWIZZLE_GROUP_STRIDE ((QC_SWIZZLE_ROWS / QC_SWIZZLE_ROW_GROUP) * QC_SWIZZLE_COLS)

// Padded width (a multiple of QC_SWIZZLE_COLS) and height (of QC_SWIZZLE_ROWS).
__host__ __device__ __forceinline__ long long qc_swizzle_pad_cols(long long cols) {
  return qc_ceil_div(cols, QC_SWIZZLE_COLS) * QC_SWIZZLE_COLS;
}
__host__ __device__ __forceinline__ long long qc_swizzle_pad_rows(long long rows) {
  return qc_ceil_div(rows, QC_SWIZZLE_ROWS) * QC_SWIZZLE_ROWS;
}

// Byte offset of scale (r, c) in a swizzled buffer of padded width pc.
__host__ __device__ __forceinline__ long long qc_swizzle_offset(long long r, long long c, long long pc) {
  const long long tile = (r / QC_SWIZZLE_ROWS) * (pc / QC_SWIZZLE_COLS) + c / QC_SWIZZLE_COLS;
  return tile * QC_SWIZZLE_TILE_BYTES + (r % QC_SWIZZLE_ROW_GROUP) * QC_SWIZZLE_GROUP_STRIDE +
         ((r % QC_SWIZZLE_ROWS) / QC_SWIZZLE_ROW_GROUP) * QC_SWIZZLE_COLS + c % QC_SWIZZLE_COLS;
}

// Inverse: the (r, c) that byte `off` of a swizzled buffer of padded width pc holds (padding
// included: r or c may lie past the real matrix).
__host__ __device__ __forceinline__ void qc_swizzle_position(long long off, long long pc, long long* r,
                                                             long long* c) {
  const long long tile = off / QC_SWIZZLE_TILE_BYTES, inner = off % QC_SWIZZLE_TILE_BYTES;
  const long long tiles_per_row = pc / QC_SWIZZLE_COLS;
  *r = (tile / tiles_per_row) * QC_SWIZZLE_ROWS + inner / QC_SWIZZLE_GROUP_STRIDE +
       ((inner % QC_SWIZZLE_GROUP_STRIDE) / QC_SWIZZLE_COLS) * QC_SWIZZLE_ROW_GROUP;
  *c = (tile % tiles_per_row) * QC_SWIZZLE_COLS + inner % QC_SWIZZLE_COLS;
}
