// Shared helpers of the quantcore SYCL kernels: element loads and stores per dtype, the exact
// roundings the bit-exact tier depends on, and the format tables from the core.
//
// Everything here is standard SYCL 2020 (no vendor extension): the extension-dependent entry
// points live in entry_points.cpp only.
#pragma once

#include <sycl/sycl.hpp>

#include <cstdint>

#include "quantcore_constants.h" // generated from the core (quantcore.formats.kernel_defines)

// fp64 is needed only by the double-quantization mean; the run-time build passes 0 on a device
// without the fp64 aspect (and the backend then does not declare double_quantize).
#ifndef QC_HAVE_FP64
#define QC_HAVE_FP64 1
#endif

// Bit-exactness needs every `a * b + c` rounded twice, as the numpy reference does; clang-based
// SYCL compilers contract such expressions into one FMA by default (measured on the OpenCL CPU
// device: 4% of products differ). The launcher also passes -ffp-contract=off; this pragma keeps
// the sources right for an offline compile that forgets the option.
#if defined(__clang__)
#pragma clang fp contract(off)
#endif

namespace qc {

using bf16 = sycl::ext::oneapi::bfloat16;
using sycl::half;

// -- format tables (values come from the core; never spelled here) ---------------------------------
inline constexpr float kNF4Code[16] = QC_NF4_CODE_INIT;
inline constexpr float kNF4Thresholds[QC_NF4_NTHRESHOLDS] = QC_NF4_THRESHOLDS_INIT;
inline constexpr float kFP4Code[16] = QC_FP4_CODE_INIT;
inline constexpr float kFP4Thresholds[QC_FP4_NTHRESHOLDS] = QC_FP4_THRESHOLDS_INIT;
inline constexpr uint8_t kFP4StepCodes[QC_FP4_NTHRESHOLDS + 1] = QC_FP4_STEP_CODES_INIT;
inline constexpr float kDynamicThresholds[QC_DYNAMIC_NTHRESHOLDS] = QC_DYNAMIC_THRESHOLDS_INIT;

inline constexpr int kCodes4Bit = 16;
inline constexpr int kCodes8Bit = QC_DYNAMIC_NTHRESHOLDS + 1;
inline constexpr int kQuantNF4 = QC_QUANT_NF4;
inline constexpr int kQuantFP4 = QC_QUANT_FP4;
inline constexpr int kNestedBlockShift = 8; // log2(QC_NESTED_BLOCKSIZE)
static_assert((1 << kNestedBlockShift) == QC_NESTED_BLOCKSIZE, "nested blocksize must be 256");

inline constexpr int kQK = QC_QK;
inline constexpr int kQ40Bytes = QC_Q4_0_BLOCK_BYTES;
inline constexpr int kQ80Bytes = QC_Q8_0_BLOCK_BYTES;
inline constexpr int kQ81Bytes = QC_Q8_1_BLOCK_BYTES;
inline constexpr int kQ4Offset = QC_Q4_0_OFFSET;
inline constexpr float kQ4RoundBias = QC_Q4_0_ROUND_BIAS;
inline constexpr int kQ8Max = QC_Q8_MAX;
inline constexpr int kHalfBytes = 2;
inline constexpr int kQ81SumOffset = kHalfBytes;          // half d; half s; int8 qs[32]
inline constexpr int kQ81QsOffset = 2 * kHalfBytes;
inline constexpr int kQ80QsOffset = kHalfBytes;           // half d; int8 qs[32]
inline constexpr int kQ40QsOffset = kHalfBytes;           // half d; uint8 qs[16]
inline constexpr int kQ40HalfBlock = QC_QK / 2;           // element j in the low nibble of qs[j]

// -- element conversion -----------------------------------------------------------------------------
// float -> bf16 rounding to nearest even; NaN -> the canonical quiet NaN with the sign kept
// (0x7fc0 / 0xffc0, the rule of ml_dtypes, which the reference uses).
inline uint16_t bf16_bits_rne(float v) {
  const uint32_t u = sycl::bit_cast<uint32_t>(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7fc0u);
  const uint32_t lsb = (u >> 16) & 1u;
  return static_cast<uint16_t>((u + 0x7fffu + lsb) >> 16);
}

inline float bf16_bits_to_float(uint16_t b) {
  return sycl::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}

// Loads widen exactly to fp32; stores round to nearest even (half: the device's IEEE conversion,
// checked bit for bit against numpy by the tests; bf16: bf16_bits_rne).
template <typename T> struct Elem;
template <> struct Elem<float> {
  static float load(const float *p, int64_t i) { return p[i]; }
  static void store(float *p, int64_t i, float v) { p[i] = v; }
};
template <> struct Elem<half> {
  static float load(const half *p, int64_t i) { return static_cast<float>(p[i]); }
  static void store(half *p, int64_t i, float v) { p[i] = static_cast<half>(v); }
};
template <> struct Elem<bf16> {
  static float load(const bf16 *p, int64_t i) {
    return bf16_bits_to_float(sycl::bit_cast<uint16_t>(p[i]));
  }
  static void store(bf16 *p, int64_t i, float v) { p[i] = sycl::bit_cast<bf16>(bf16_bits_rne(v)); }
};

// fp16 values kept as little-endian bytes inside ggml blocks (ggml's layout), read and written
// byte by byte: block starts are only 2-byte aligned and nothing is punned through a pointer cast.
inline float load_half_le(const uint8_t *p) {
  const uint16_t bits = static_cast<uint16_t>(p[0] | (static_cast<uint16_t>(p[1]) << 8));
  return static_cast<float>(sycl::bit_cast<half>(bits));
}
inline void store_half_le(uint8_t *p, float v) {
  const uint16_t bits = sycl::bit_cast<uint16_t>(static_cast<half>(v));
  p[0] = static_cast<uint8_t>(bits & 0xffu);
  p[1] = static_cast<uint8_t>(bits >> 8);
}

// -- exact arithmetic the formats define --------------------------------------------------------------
// Correctly rounded fp32 reciprocal (the reference's 1.0f / absmax). The launcher compiles with
// -foffload-fp32-prec-div; on the OpenCL CPU device the division was measured correctly rounded
// on 5M values, subnormals and specials included (tests/test_sycl.py keeps checking it).
inline float recip_rn(float a) { return 1.0f / a; }

// Largest |x| ignoring NaN (fmaxf semantics); starts from -1 so "no finite value" is visible.
inline constexpr float kNoMagnitude = -1.0f;
inline float fold_magnitude(float acc, float x) { return sycl::fmax(acc, sycl::fabs(x)); }
inline float finish_magnitude(float acc) {
  return acc < 0.0f ? sycl::bit_cast<float>(0x7fc00000u) : acc; // all-NaN block -> NaN
}

// Number of entries t of the sorted table with s > t (strictly), by binary search over at most
// 256 entries; NaN compares false and gives 0, as the reference's searchsorted rule does.
inline int count_below(const float *sorted, int count, float s) {
  int c = 0;
  for (int step = 128; step > 0; step >>= 1)
    if (c + step <= count && sorted[c + step - 1] < s) c += step;
  return c;
}

// 4-bit codes: NF4 counts the thresholds below s; FP4 takes the sign bit from s < 0 and the
// magnitude code from the step table.
inline uint8_t quantize_nf4(float s) {
  int c = 0;
  for (int i = 0; i < QC_NF4_NTHRESHOLDS; ++i) c += (s > kNF4Thresholds[i]) ? 1 : 0;
  return static_cast<uint8_t>(c);
}
inline uint8_t quantize_fp4(float s) {
  const float mag = sycl::fabs(s);
  int c = 0;
  for (int i = 0; i < QC_FP4_NTHRESHOLDS; ++i) c += (mag > kFP4Thresholds[i]) ? 1 : 0;
  const uint8_t sign = (s < 0.0f) ? static_cast<uint8_t>(QC_FP4_SIGN_BIT) : 0;
  return static_cast<uint8_t>(kFP4StepCodes[c] | sign);
}
inline uint8_t quantize_4bit_code(float s, int quant_type) {
  return quant_type == kQuantNF4 ? quantize_nf4(s) : quantize_fp4(s);
}

// C's float-to-int truncation with a GPU's behaviour off range: NaN -> 0, saturate to [lo, hi].
inline int trunc_saturate(float v, int lo, int hi) {
  if (!sycl::isfinite(v)) return 0;  // NaN and +-inf -> 0, as ggml's C reference on x86 and gguf-py
  if (v >= static_cast<float>(hi)) return hi;
  if (v <= static_cast<float>(lo)) return lo;
  return static_cast<int>(v);
}

// roundf (half away from zero) to int8: NaN and +-inf -> 0 (ggml's C reference on x86, gguf-py),
// finite values clamp to int8.
inline int round_q8(float v) {
  if (!sycl::isfinite(v)) return 0;
  const float r = sycl::round(v);
  return static_cast<int>(sycl::clamp(r, -128.0f, 127.0f));
}

// Copy a small table into work-group local memory, then make it visible to the work-group.
inline void fill_local(const sycl::nd_item<1> &it, float *dst, const float *src, int count) {
  for (int i = static_cast<int>(it.get_local_id(0)); i < count;
       i += static_cast<int>(it.get_local_range(0)))
    dst[i] = src[i];
  sycl::group_barrier(it.get_group());
}

inline int log2_pow2(int64_t v) { return static_cast<int>(sycl::ctz(static_cast<uint64_t>(v))); }

// The weight row a sub-group takes in the row-per-sub-group kernels (gemv_4bit, linear_mx).
inline int64_t subgroup_row(const sycl::nd_item<1> &it) {
  const sycl::sub_group sg = it.get_sub_group();
  return static_cast<int64_t>(it.get_group(0)) * sg.get_group_linear_range() + sg.get_group_linear_id();
}

// The grouped kernels (gemv_4bit_grouped, linear_mx_grouped): the weight (of w0..w3, each with its row
// count n; ngroups used) holding row `row` of their rows taken as one list, and in `first` that weight's
// first row there (its first output column). Rows past the last weight's: the last.
template <typename W>
inline W group_member(int64_t row, const W &w0, const W &w1, const W &w2, const W &w3, int ngroups,
                      int64_t &first) {
  const int64_t e1 = w0.n, e2 = e1 + (ngroups > 1 ? w1.n : 0), e3 = e2 + (ngroups > 2 ? w2.n : 0);
  const int i = (ngroups > 1 && row >= e1) + (ngroups > 2 && row >= e2) + (ngroups > 3 && row >= e3);
  first = i == 0 ? 0 : i == 1 ? e1 : i == 2 ? e2 : e3;
  return i == 0 ? w0 : i == 1 ? w1 : i == 2 ? w2 : w3;
}

} // namespace qc
