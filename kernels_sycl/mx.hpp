// NVFP4, MXFP4 / MXFP8 and the 128x4 swizzled scale layout on SYCL (quantcore.formats.mx is the
// reference, bit for bit; docs/formats-mx.md the rules): element conversions E2M1 / E4M3 / E8M0,
// block quantize and dequantize, scale swizzle, and the fp4 GEMM of the tolerance tier.
//
// Plain SYCL 2020 bodies; entry_points.cpp wraps them.
#pragma once

#include "qc_common.hpp"

namespace qc {

inline constexpr float kE2M1Values[16] = QC_E2M1_VALUES_INIT;
inline constexpr int kFmtMXFP4 = QC_FMT_MXFP4;
inline constexpr int kFmtMXFP8 = QC_FMT_MXFP8;
inline constexpr int kFmtNVFP4 = QC_FMT_NVFP4;
inline constexpr int kE8M0Bias = QC_E8M0_BIAS;
inline constexpr int kE8M0NaN = QC_E8M0_NAN;
inline constexpr int kE4M3ExpBias = 7;     // E4M3 "fn": 4 exponent bits, bias 7, 3 mantissa bits
inline constexpr int kE4M3MantBits = 3;
inline constexpr int kE4M3MinNormalExp = -6;
inline constexpr int kF32MantBits = 23;
inline constexpr int kF32ExpBias = 127;

inline bool is_nan(float v) { return !(v == v); }
inline uint32_t f32_bits(float v) { return sycl::bit_cast<uint32_t>(v); }
inline int f32_exp_field(float v) { return static_cast<int>((f32_bits(v) >> kF32MantBits) & 0xffu); }
inline float pow2(int e) { return sycl::ldexp(1.0f, e); } // exact, subnormal results included

// -- element formats ---------------------------------------------------------------------------------
// fp32 -> E2M1 code: RNE on each binade's grid (spacing .5 below 2, 1 below 4, 2 above), saturating
// at 6; NaN -> +6 (0x7); the sign of zero is kept.
inline uint8_t e2m1_code(float v) {
  if (is_nan(v)) return QC_E2M1_NAN_CODE;
  const float a = sycl::fabs(v);
  float idx;
  if (a < 2.0f) idx = sycl::rint(a * 2.0f);
  else if (a < 4.0f) idx = sycl::rint(a) + 2.0f;
  else idx = sycl::fmin(sycl::rint(a * 0.5f) + 4.0f, 7.0f);
  const uint8_t sign = sycl::signbit(v) ? static_cast<uint8_t>(QC_E2M1_SIGN_BIT) : 0;
  return static_cast<uint8_t>(static_cast<int>(idx) | sign);
}

// fp32 -> E4M3 ("fn") byte: RNE, saturating to +-448 (Inf too), NaN -> 0x7F.
inline uint8_t e4m3_code(float v) {
  if (is_nan(v)) return QC_E4M3_NAN_CODE;
  const uint8_t sign = sycl::signbit(v) ? 0x80 : 0;
  const float a = sycl::fmin(sycl::fabs(v), QC_E4M3_MAX); // 448 is representable: clamp = saturate
  int code;
  if (a < pow2(kE4M3MinNormalExp)) {
    // subnormals: multiples of 2^-9; a count of 8 is the smallest normal, whose code is also 8
    code = static_cast<int>(sycl::rint(a * pow2(kE4M3MantBits - kE4M3MinNormalExp)));
  } else {
    int e = f32_exp_field(a) - kF32ExpBias;
    // (a * 2^-e - 1) * 8 is exact in fp32; rint rounds the mantissa to nearest even
    int m = static_cast<int>(sycl::rint((sycl::ldexp(a, -e) - 1.0f) * (1 << kE4M3MantBits)));
    if (m == (1 << kE4M3MantBits)) {
      m = 0;
      ++e;
    }
    code = ((e + kE4M3ExpBias) << kE4M3MantBits) | m;
  }
  return static_cast<uint8_t>(code | sign);
}

inline float e4m3_value(uint8_t b) {
  const int e = (b >> kE4M3MantBits) & 0x0f, m = b & 0x07;
  if (e == 0x0f && m == 0x07) // NaN keeps the byte's sign (as ml_dtypes decodes 0xFF)
    return sycl::bit_cast<float>((b & 0x80) ? 0xffc00000u : 0x7fc00000u);
  const float mag = e == 0 ? static_cast<float>(m) * pow2(kE4M3MinNormalExp - kE4M3MantBits)
                           : (1.0f + static_cast<float>(m) / 8.0f) * pow2(e - kE4M3ExpBias);
  return (b & 0x80) ? -mag : mag;
}

// E8M0 scale byte of a block amax: floor(log2(amax)) - emax (+1 for rceil when amax's mantissa
// exceeds the element's largest); NaN / Inf amax -> 0xFF; zero or fp32-denormal amax -> 0.
inline uint8_t e8m0_scale(float amax, int emax, uint32_t max_mantissa, bool rceil) {
  if (is_nan(amax) || sycl::isinf(amax)) return kE8M0NaN;
  int e = f32_exp_field(amax) - kF32ExpBias - emax;
  int hi = kE8M0Bias + 1;
  if (rceil) {
    e += (f32_bits(amax) & 0x7fffffu) > max_mantissa ? 1 : 0;
    hi = kE8M0Bias;
  }
  return static_cast<uint8_t>(sycl::clamp(e, -kE8M0Bias, hi) + kE8M0Bias);
}
inline float e8m0_value(uint8_t b) {
  return b == kE8M0NaN ? sycl::bit_cast<float>(0x7fc00000u) : pow2(static_cast<int>(b) - kE8M0Bias);
}
inline float e8m0_multiplier(uint8_t b) { // 2^(127 - b): maps a block into the element range
  return b == kE8M0NaN ? sycl::bit_cast<float>(0x7fc00000u) : pow2(kE8M0Bias - static_cast<int>(b));
}

// -- swizzled scale layout ------------------------------------------------------------------------
inline int64_t padded_scale_cols(int64_t cols) {
  return (cols + QC_SWIZZLE_COLS - 1) / QC_SWIZZLE_COLS * QC_SWIZZLE_COLS;
}
inline int64_t padded_scale_rows(int64_t rows) {
  return (rows + QC_SWIZZLE_ROWS - 1) / QC_SWIZZLE_ROWS * QC_SWIZZLE_ROWS;
}
// Byte offset of scale (r, c) in the swizzled buffer of a [rows, cols] scale matrix.
inline int64_t swizzle_offset(int64_t r, int64_t c, int64_t cols) {
  const int64_t tile = (r / QC_SWIZZLE_ROWS) * (padded_scale_cols(cols) / QC_SWIZZLE_COLS) + c / QC_SWIZZLE_COLS;
  const int64_t inner = (r % QC_SWIZZLE_ROW_GROUP) * (QC_SWIZZLE_COLS * (QC_SWIZZLE_ROWS / QC_SWIZZLE_ROW_GROUP)) +
                        ((r % QC_SWIZZLE_ROWS) / QC_SWIZZLE_ROW_GROUP) * QC_SWIZZLE_COLS + c % QC_SWIZZLE_COLS;
  return tile * QC_SWIZZLE_TILE_BYTES + inner;
}
// The (r, c) stored at byte p of the swizzled buffer (the inverse of swizzle_offset).
inline void swizzle_position(int64_t p, int64_t cols, int64_t &r, int64_t &c) {
  const int64_t tiles_per_row = padded_scale_cols(cols) / QC_SWIZZLE_COLS;
  const int64_t tile = p / QC_SWIZZLE_TILE_BYTES, inner = p % QC_SWIZZLE_TILE_BYTES;
  const int64_t per_row = QC_SWIZZLE_COLS * (QC_SWIZZLE_ROWS / QC_SWIZZLE_ROW_GROUP); // 16 bytes
  const int64_t rem = inner % per_row;
  r = (tile / tiles_per_row) * QC_SWIZZLE_ROWS + (rem / QC_SWIZZLE_COLS) * QC_SWIZZLE_ROW_GROUP +
      inner / per_row;
  c = (tile % tiles_per_row) * QC_SWIZZLE_COLS + rem % QC_SWIZZLE_COLS;
}
inline int64_t scale_index(int64_t r, int64_t c, int64_t cols, bool swizzled) {
  return swizzled ? swizzle_offset(r, c, cols) : r * cols + c;
}

// -- quantize: one work-item per block ----------------------------------------------------------------
struct MXArgs {
  int64_t rows, cols;  // the [rows, cols] input; cols % block == 0
  int fmt;             // kFmtMXFP4 / kFmtMXFP8 / kFmtNVFP4
  bool rceil, swizzled;
  const float *global_scale; // nvfp4: fp32 [1]
};
inline int mx_block(int fmt) { return fmt == kFmtNVFP4 ? QC_NVFP4_BLOCK : QC_MX_BLOCK; }

template <typename T>
void mx_quantize_block(const T *x, uint8_t *codes, uint8_t *scales, const MXArgs &g, int64_t block) {
  const int blk = mx_block(g.fmt);
  const int64_t scols = g.cols / blk;
  const int64_t r = block / scols, cb = block % scols;
  const int64_t first = r * g.cols + cb * blk;
  float amax = 0.0f; // max |x| with NaN propagating (numpy's max)
  bool nan = false;
  for (int j = 0; j < blk; ++j) {
    const float a = sycl::fabs(Elem<T>::load(x, first + j));
    nan = nan || is_nan(a);
    amax = sycl::fmax(amax, a);
  }
  if (nan) amax = sycl::bit_cast<float>(0x7fc00000u);
  float mult;
  uint8_t sbyte;
  if (g.fmt == kFmtNVFP4) {
    const float gs = g.global_scale[0];
    const float amax6 = amax * QC_NVFP4_INV_E2M1_MAX;
    sbyte = e4m3_code(gs * amax6);
    const float s = e4m3_value(sbyte);
    mult = s != 0.0f ? gs * recip_rn(s) : 0.0f; // NaN != 0: a NaN block scales by NaN
  } else {
    const bool fp4 = g.fmt == kFmtMXFP4;
    sbyte = e8m0_scale(amax, fp4 ? QC_EMAX_E2M1 : QC_EMAX_E4M3,
                       fp4 ? QC_MAX_MANTISSA_BITS_E2M1 : QC_MAX_MANTISSA_BITS_E4M3, g.rceil);
    mult = e8m0_multiplier(sbyte);
  }
  scales[scale_index(r, cb, scols, g.swizzled)] = sbyte;
  if (g.fmt == kFmtMXFP8) {
    for (int j = 0; j < blk; ++j) codes[first + j] = e4m3_code(Elem<T>::load(x, first + j) * mult);
  } else {
    for (int j = 0; j < blk; j += 2) { // element 2i in the LOW nibble
      const uint8_t lo = e2m1_code(Elem<T>::load(x, first + j) * mult);
      const uint8_t hi = e2m1_code(Elem<T>::load(x, first + j + 1) * mult);
      codes[(first + j) >> 1] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

// -- dequantize: one work-item per element -------------------------------------------------------------
template <typename T>
void mx_dequantize_value(const uint8_t *codes, const uint8_t *scales, T *out, const MXArgs &g,
                         int64_t i) {
  const int blk = mx_block(g.fmt);
  const int64_t scols = g.cols / blk;
  const int64_t r = i / g.cols, c = i % g.cols;
  const uint8_t sbyte = scales[scale_index(r, c / blk, scols, g.swizzled)];
  float v;
  if (g.fmt == kFmtMXFP8) {
    v = e4m3_value(codes[i]) * e8m0_value(sbyte);
  } else {
    const uint8_t byte = codes[i >> 1];
    const float e = kE2M1Values[(i & 1) ? (byte >> 4) : (byte & 0x0f)];
    if (g.fmt == kFmtNVFP4) {
      const float prod = e * e4m3_value(sbyte); // exact
      v = prod / g.global_scale[0];             // one IEEE division
    } else {
      v = e * e8m0_value(sbyte);
    }
  }
  Elem<T>::store(out, i, v);
}

// -- scaled_fp4_mm: out = bf16(alpha * A @ B^T + bias), fp32 accumulation ------------------------------
// One work-item per output element. The operands e2m1(q) * scale are exact in fp32 (the NVFP4 global
// scale is in alpha); the products and the sum are fp32 (the tolerance tier's rule).
inline float fp4_operand(const uint8_t *codes, const uint8_t *scales, int64_t row, int64_t k, int64_t kk,
                         int fmt) {
  const int blk = mx_block(fmt);
  const uint8_t byte = codes[(row * k + kk) >> 1];
  const float e = kE2M1Values[(kk & 1) ? (byte >> 4) : (byte & 0x0f)];
  const uint8_t sbyte = scales[swizzle_offset(row, kk / blk, k / blk)];
  return e * (fmt == kFmtNVFP4 ? e4m3_value(sbyte) : e8m0_value(sbyte));
}

inline void scaled_fp4_mm_value(const uint8_t *a, const uint8_t *b, const uint8_t *sa, const uint8_t *sb,
                                const float *alpha, const bf16 *bias, bf16 *out, int64_t m, int64_t n,
                                int64_t k, int fmt, int64_t idx) {
  const int64_t i = idx / n, j = idx % n;
  float acc = 0.0f;
  for (int64_t kk = 0; kk < k; ++kk)
    acc = sycl::fma(fp4_operand(a, sa, i, k, kk, fmt), fp4_operand(b, sb, j, k, kk, fmt), acc);
  float d = alpha[0] * acc;
  if (bias != nullptr) d = d + Elem<bf16>::load(bias, j);
  Elem<bf16>::store(out, idx, d);
}

// -- linear_mx: out[b, row] = T(sum_k x[b, k] * W[row, k]), W the fp4 weight (weight-only MX) ----------
// The gemv's structure (gemv_4bit above, kernels_cuda/mx_gemv.cu): one sub-group per weight row
// (QC_GEMV_ROWS_PER_WG rows per work-group), a lane takes units of 32 elements (16 code bytes: one
// MXFP4 block, two NVFP4 blocks; the last unit holds 16 when K % 32 == 16), the codes are read once
// for up to QC_MAX_BATCH input rows. Products x * e2m1 are summed per block in fp32, the block sum is
// multiplied by the block's scale and added to the row's fp32 total; NVFP4 divides the total by the
// global scale once. The sub-group reduces the totals; one rounding into T.
// linear_mx_row: the sub-group's weight row `row` of a weight [nrows, K] into out [batch, ldo].
template <typename T>
void linear_mx_row(const sycl::nd_item<1> &it, const T *x, const uint8_t *codes, const uint8_t *scales,
                   const float *global_scale, T *out, int64_t ldo, int64_t batch, int64_t row, int64_t nrows,
                   int64_t k, int fmt, bool swizzled) {
  const sycl::sub_group sg = it.get_sub_group();
  const int lane = static_cast<int>(sg.get_local_linear_id());
  const int lanes = static_cast<int>(sg.get_local_linear_range());
  const bool active = row < nrows; // uniform over the sub-group
  const bool nv = fmt == kFmtNVFP4;
  const int blk = mx_block(fmt);
  const int64_t scols = k / blk;
  const int64_t nunits = (k + 31) / 32;
  const uint8_t *rowc = codes + row * (k / 2);
  for (int64_t b0 = 0; b0 < batch; b0 += QC_MAX_BATCH) {
    const int64_t nb = sycl::min<int64_t>(QC_MAX_BATCH, batch - b0);
    float acc[QC_MAX_BATCH];
    for (int b = 0; b < QC_MAX_BATCH; ++b) acc[b] = 0.0f;
    const T *x0 = x + b0 * k;
    if (active) {
      for (int64_t u = lane; u < nunits; u += lanes) {
        const int nvals = sycl::min<int64_t>(32, k - u * 32); // 32, or 16 for NVFP4's last unit
        float w[32];
        for (int j = 0; j < nvals / 2; ++j) {
          const uint8_t byte = rowc[u * 16 + j]; // element 2j in the LOW nibble
          w[2 * j] = kE2M1Values[byte & 0x0f];
          w[2 * j + 1] = kE2M1Values[byte >> 4];
        }
        for (int h = 0; h * blk < nvals; ++h) { // the unit's blocks
          const int64_t c = (u * 32) / blk + h;
          const uint8_t sbyte = scales[scale_index(row, c, scols, swizzled)];
          const float sc = nv ? e4m3_value(sbyte) : e8m0_value(sbyte);
          for (int b = 0; b < QC_MAX_BATCH; ++b) {
            if (b >= nb) break;
            float part = 0.0f;
            for (int j = h * blk; j < (h + 1) * blk; ++j)
              part = sycl::fma(Elem<T>::load(x0, b * k + u * 32 + j), w[j], part);
            acc[b] = acc[b] + part * sc;
          }
        }
      }
    }
    for (int b = 0; b < QC_MAX_BATCH; ++b) {
      if (b >= nb) break;
      float total = sycl::reduce_over_group(sg, acc[b], sycl::plus<float>());
      if (nv) total = total / global_scale[0];
      if (active && lane == 0) Elem<T>::store(out, (b0 + b) * ldo + row, total);
    }
  }
}

template <typename T>
void linear_mx(const sycl::nd_item<1> &it, const T *x, const uint8_t *codes, const uint8_t *scales,
               const float *global_scale, T *out, int64_t batch, int64_t nrows, int64_t k, int fmt,
               bool swizzled) {
  linear_mx_row<T>(it, x, codes, scales, global_scale, out, nrows, batch, subgroup_row(it), nrows, k, fmt,
                   swizzled);
}

// The grouped linear_mx: up to QC_GV_GROUPS fp4 weights [n_i, K] of one format and scale layout that
// share the input, their rows one list, a sub-group per row as in linear_mx; weight i's results go to
// columns n_0 + ... + n_{i-1} .. of out [batch, ldo] (gemv_4bit_grouped's structure, bnb.hpp).
struct MxGroupW {
  const uint8_t *codes;
  const uint8_t *scales;
  const float *global_scale;
  int64_t n;
};
template <typename T>
void linear_mx_grouped(const sycl::nd_item<1> &it, const T *x, const MxGroupW &w0, const MxGroupW &w1,
                       const MxGroupW &w2, const MxGroupW &w3, int ngroups, T *out, int64_t ldo, int64_t batch,
                       int64_t k, int fmt, bool swizzled) {
  const int64_t row = subgroup_row(it);
  int64_t col;
  const MxGroupW w = group_member(row, w0, w1, w2, w3, ngroups, col);
  linear_mx_row<T>(it, x, w.codes, w.scales, w.global_scale, out + col, ldo, batch, row - col, w.n, k, fmt,
                   swizzled);
}

} // namespace qc
