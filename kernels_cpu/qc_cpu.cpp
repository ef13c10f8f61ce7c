// Host kernels of the `cpu` backend: C++17, OpenMP threads, AVX-512 / AVX2 where the build target
// has them (scalar C++ otherwise).
//
// The semantics are those of the numpy reference (quantcore/formats/bnb.py, ggml.py): every
// quantizer and dequantizer here is bit for bit the same; gemv_4bit and the Q4_0 x Q8_1 GEMM are
// tolerance-tier ops (fp32 accumulation, see quantcore/conformance/bounds.py). The build must not
// contract a*b+c into an FMA where the reference rounds twice (-ffp-contract=off) and must not
// use -ffast-math (NaN rules, exact fp32 division). Format constants come from the generated
// quantcore_constants.h (quantcore.formats.kernel_defines), never spelled here.
//
// The entry points' arguments are declared once, in quantcore/formats/kernel_interface.py (the
// generated header declares them: QC_CPU_PROTOTYPES). Every entry point takes `nt`, the number of
// OpenMP threads (<= 0: the OpenMP default), writes only into the outputs it is given and
// allocates nothing but thread-local scratch kept between calls (the gemv activation in fp32, the GEMM's repacked Q8_1 activation, scaled_fp4_mm's
// unpacked operands; docs/cpu.md, "Memory").

#include <array>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QC_AVX2 1
#else
#define QC_AVX2 0
#endif
// AVX-512 (F + BW) adds a 16-entry register table lookup for the 4-bit decode (vpermps).
#if QC_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__)
#define QC_AVX512 1
#else
#define QC_AVX512 0
#endif
// AVX512-BF16 adds vcvtne2ps2bf16 (dequantize_4bit's bf16 output).
#if QC_AVX512 && defined(__AVX512BF16__)
#define QC_AVX512BF16 1
#else
#define QC_AVX512BF16 0
#endif

#include "quantcore_constants.h"

namespace {

using i64 = int64_t;

constexpr float kNF4[16] = QC_NF4_CODE_INIT;
constexpr float kFP4[16] = QC_FP4_CODE_INIT;
constexpr float kNF4Thr[QC_NF4_NTHRESHOLDS] = QC_NF4_THRESHOLDS_INIT;
constexpr float kFP4Thr[QC_FP4_NTHRESHOLDS] = QC_FP4_THRESHOLDS_INIT;
constexpr uint8_t kFP4Step[QC_FP4_NTHRESHOLDS + 1] = QC_FP4_STEP_CODES_INIT;
constexpr int32_t kFP4Step8[8] = QC_FP4_STEP_CODES_INIT;
constexpr float kDynThr[QC_DYNAMIC_NTHRESHOLDS] = QC_DYNAMIC_THRESHOLDS_INIT;

// Work below this many elements runs on one thread (a parallel region costs microseconds).
constexpr i64 kSerialBelow = 1 << 15;

inline int threads(int nt) { return nt > 0 ? nt : omp_get_max_threads(); }
inline int threads_for(int nt, i64 work) { return work < kSerialBelow ? 1 : threads(nt); }

// -- scalar conversions (exact; round to nearest even like numpy / ml_dtypes) -------------------
inline uint32_t bits_of(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float float_of(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  if (exp == 0x1F) return float_of(sign | 0x7F800000u | (man << 13));
  if (exp == 0) {
    // zero or subnormal: man * 2^-24, exact in fp32
    float v = (float)man * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return float_of(sign | ((exp + 112) << 23) | (man << 13));
}

inline uint16_t float_to_half(float f) {
  uint32_t x = bits_of(f);
  uint32_t sign = (x >> 16) & 0x8000;
  uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return (uint16_t)(sign | 0x7E00 | ((ax >> 13) & 0x3FF));  // NaN, quiet
  if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00);  // rounds to >= 65520: inf
  if (ax < 0x38800000u) {  // below the smallest fp16 normal: subnormal or zero
    if (ax < 0x33000000u) return (uint16_t)sign;  // < 2^-25: rounds to zero (2^-25 ties to even 0)
    uint32_t e = ax >> 23, m = (ax & 0x7FFFFF) | 0x800000;
    uint32_t shift = 126 - e;  // 14 + (113 - e) ... value = m * 2^(e-150); half unit 2^-24
    // result = round(m * 2^(e - 150 + 24)) = round(m >> (126 - e))
    uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1))) q++;
    return (uint16_t)(sign | q);
  }
  uint32_t r = ax + 0xFFF + ((ax >> 13) & 1);  // round the 13 dropped bits to nearest even
  return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}

inline float bf16_to_float(uint16_t h) { return float_of((uint32_t)h << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t x = bits_of(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x >> 16) | 0x40);
  return (uint16_t)((x + 0x7FFF + ((x >> 16) & 1)) >> 16);
}

inline float load_as_float(const void* p, int dtype, i64 i) {
  if (dtype == QC_DTYPE_F32) return ((const float*)p)[i];
  if (dtype == QC_DTYPE_F16) return half_to_float(((const uint16_t*)p)[i]);
  return bf16_to_float(((const uint16_t*)p)[i]);
}

inline void store_from_float(void* p, int dtype, i64 i, float v) {
  if (dtype == QC_DTYPE_F32) ((float*)p)[i] = v;
  else if (dtype == QC_DTYPE_F16) ((uint16_t*)p)[i] = float_to_half(v);
  else ((uint16_t*)p)[i] = float_to_bf16(v);
}

inline float read_half(const uint8_t* p) { uint16_t h; std::memcpy(&h, p, 2); return half_to_float(h); }
inline void write_half(uint8_t* p, uint16_t h) { std::memcpy(p, &h, 2); }

#if QC_AVX2
// -- AVX2 helpers ------------------------------------------------------------------------------
inline __m256 load8(const void* p, int dtype, i64 i) {
  if (dtype == QC_DTYPE_F32) return _mm256_loadu_ps((const float*)p + i);
  __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)p + i));
  if (dtype == QC_DTYPE_F16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline void store8(void* p, int dtype, i64 i, __m256 v) {
  if (dtype == QC_DTYPE_F32) { _mm256_storeu_ps((float*)p + i, v); return; }
  __m128i h;
  if (dtype == QC_DTYPE_F16) {
    h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  } else {
    __m256i x = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x40));
    __m256 isnan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(qnan), isnan));
    h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }
  _mm_storeu_si128((__m128i*)((uint16_t*)p + i), h);
}

// bf16 bits (in the low half of each lane) of eight finite fp32 values, rounded to nearest even.
inline __m256i bf16_bits_finite(__m256 v) {
  __m256i x = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7FFF)), lsb), 16);
}

// code[idx] for eight 4-bit indices (one per 32-bit lane).
inline __m256 lut16(__m256 lo, __m256 hi, __m256i idx) {
  __m256 a = _mm256_permutevar8x32_ps(lo, idx), b = _mm256_permutevar8x32_ps(hi, idx);
  return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

// 16 packed bytes (bitsandbytes order: element 2i in the high nibble) -> 32 indices in order.
inline void unpack32(const uint8_t* p, __m128i& e0, __m128i& e1) {
  __m128i v = _mm_loadu_si128((const __m128i*)p);
  __m128i m = _mm_set1_epi8(0x0F);
  __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), m), lo = _mm_and_si128(v, m);
  e0 = _mm_unpacklo_epi8(hi, lo);
  e1 = _mm_unpackhi_epi8(hi, lo);
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}
#endif

inline const float* code_table(int quant_type) { return quant_type == QC_QUANT_NF4 ? kNF4 : kFP4; }

// The smallest nonzero |code| (smallest = true) or the largest |code| of a 16-entry table.
constexpr float code_abs(const float* c, bool smallest) {
  float m = smallest ? 1.0f : 0.0f;
  for (int i = 0; i < 16; ++i) {
    float a = c[i] < 0 ? -c[i] : c[i];
    if (smallest ? (a != 0.0f && a < m) : a > m) m = a;
  }
  return m;
}
constexpr float pow2_at_most(float v) {  // the largest power of two <= v (v in (0, 1])
  float p = 1.0f;
  while (p > v) p *= 0.5f;
  return p;
}
static_assert(code_abs(kNF4, false) <= 1.0f && code_abs(kFP4, false) <= 1.0f, "4-bit codes in [-1, 1]");
// A block scale s with kNormalScale <= |s| <= FLT_MAX makes every product code * s with a nonzero
// code an fp32 normal (|code * s| >= min|code| * FLT_MIN / pow2 >= FLT_MIN) and no product NaN or
// Inf (|code| <= 1). The vector bf16 conversions of dequantize_4bit rely on it: vcvtneps2bf16
// reads fp32 subnormals as zero, and the bits rounding without a NaN test carries a NaN's payload
// into its sign. Blocks outside this range take the exact conversion (store_from_float / store8).
constexpr float kNormalScale =
    FLT_MIN / pow2_at_most(code_abs(kNF4, true) < code_abs(kFP4, true) ? code_abs(kNF4, true) : code_abs(kFP4, true));
inline bool bf16_vector_scale(float s) {
  float a = std::fabs(s);
  return a >= kNormalScale && a <= FLT_MAX;
}

// absmax of block b: plain fp32, or double quantization's code2[q] * absmax2[b / 256] + offset
// (two fp32 roundings; -ffp-contract=off keeps them two).
struct Absmax {
  const float* plain;
  const uint8_t* q;
  const float* absmax2;
  const float* code2;
  float offset;
  inline float operator()(i64 b) const {
    if (!q) return plain[b];
    float prod = code2[q[b]] * absmax2[b / QC_NESTED_BLOCKSIZE];
    return prod + offset;
  }
};

// absmax fp32, or (absmax2 given) the uint8 codes of a double quantization with absmax2, code2, offset
inline Absmax make_absmax(const void* absmax, const float* absmax2, const float* code2, const float* offset) {
  if (absmax2 == nullptr) return Absmax{(const float*)absmax, nullptr, nullptr, nullptr, 0.0f};
  return Absmax{nullptr, (const uint8_t*)absmax, absmax2, code2, *offset};
}

inline uint8_t nibble(const uint8_t* packed, i64 i) {
  uint8_t byte = packed[i >> 1];
  return (i & 1) ? (byte & 0x0F) : (byte >> 4);
}

// NaN-ignoring max of |x| over [i0, i1) (np.fmax.reduce); `start` is 0 for a zero-padded block,
// NaN otherwise (an all-NaN unpadded block keeps NaN).
inline float absmax_range(const void* x, int dtype, i64 i0, i64 i1, float start) {
  float m = start;
  i64 i = i0;
#if QC_AVX2
  if (i1 - i0 >= 8) {
    // maxps returns its second operand when either is NaN: NaN elements are skipped; -1 marks
    // "no number seen" (every |x| is >= 0)
    __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 vm = _mm256_set1_ps(-1.0f);
    for (; i + 8 <= i1; i += 8) vm = _mm256_max_ps(_mm256_and_ps(load8(x, dtype, i), absmask), vm);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    float vmax = _mm_cvtss_f32(h);
    if (vmax >= 0.0f) m = (vmax > m || m != m) ? vmax : m;
  }
#endif
  for (; i < i1; ++i) {
    float v = std::fabs(load_as_float(x, dtype, i));
    m = (v > m || m != m) ? v : m;
  }
  return m;
}

inline uint8_t code_4bit(float s, int quant_type) {
  if (quant_type == QC_QUANT_NF4) {
    int c = 0;
    for (int t = 0; t < QC_NF4_NTHRESHOLDS; ++t) c += s > kNF4Thr[t];
    return (uint8_t)c;
  }
  float mag = std::fabs(s);
  int c = 0;
  for (int t = 0; t < QC_FP4_NTHRESHOLDS; ++t) c += mag > kFP4Thr[t];
  return (uint8_t)(kFP4Step[c] | (s < 0.0f ? QC_FP4_SIGN_BIT : 0));
}

// searchsorted(thresholds, s, "left") over a sorted 255-entry table (the number of entries
// below s), branch free; NaN -> 0.
static_assert(QC_DYNAMIC_NTHRESHOLDS == 255, "code_8bit searches 255 thresholds");
inline uint8_t code_8bit(float s, const float* thr) {
  int pos = 0;
  for (int step = 128; step >= 1; step >>= 1) pos += (thr[pos + step - 1] < s) ? step : 0;
  return (uint8_t)pos;
}

// Perfect binary tree sum in fp64 of v[lo, lo + size) with zeros past n (bnb.pairwise_sum_f64):
// the same tree level by level inside a leaf of up to 64 values, recursion above it.
double tree_sum(const float* v, i64 n, i64 lo, i64 size) {
  if (lo >= n) return 0.0;
  if (size <= 64) {
    double buf[64];
    for (i64 i = 0; i < size; ++i) buf[i] = lo + i < n ? (double)v[lo + i] : 0.0;
    for (i64 w = size; w > 1; w /= 2)
      for (i64 i = 0; i < w / 2; ++i) buf[i] = buf[2 * i] + buf[2 * i + 1];
    return buf[0];
  }
  i64 h = size / 2;
  return tree_sum(v, n, lo, h) + tree_sum(v, n, lo + h, h);
}

void quantize_blockwise_impl(const void* x, int dtype, i64 n, int bs, const float* thr,
                             uint8_t* codes, float* absmax, int nt) {
  i64 nb = (n + bs - 1) / bs;
#pragma omp parallel for num_threads(threads_for(nt, n)) schedule(static)
  for (i64 b = 0; b < nb; ++b) {
    i64 i0 = b * bs, i1 = i0 + bs < n ? i0 + bs : n;
    float m = absmax_range(x, dtype, i0, i1, i1 - i0 < bs ? 0.0f : NAN);
    absmax[b] = m;
    float r = 1.0f / m;
    for (i64 i = i0; i < i1; ++i) codes[i] = code_8bit(load_as_float(x, dtype, i) * r, thr);
  }
}

// One weight row against NB activation rows (rows of whole blocks): res[t] = row . a_t.
// NB is a template parameter so the accumulators stay in registers.
template <int NB>
void gemv_row(const float* af, i64 K, i64 r, const uint8_t* packed, const Absmax& am, int bs,
              const float* code, float* res) {
  i64 kb = K / bs;
#if QC_AVX512
    __m512 lut = _mm512_loadu_ps(code);
    __m512 acc[NB];
    for (int t = 0; t < NB; ++t) acc[t] = _mm512_setzero_ps();
    for (i64 blk = 0; blk < kb; ++blk) {
      __m512 b0acc[NB], b1acc[NB];
      for (int t = 0; t < NB; ++t) b0acc[t] = b1acc[t] = _mm512_setzero_ps();
      const uint8_t* p = packed + (r * K + blk * bs) / 2;
      i64 k0 = blk * bs;
      for (i64 g = 0; g < bs; g += 32) {
        __m128i e0, e1;
        unpack32(p + g / 2, e0, e1);
        __m512 w0 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(e0), lut);
        __m512 w1 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(e1), lut);
        for (int t = 0; t < NB; ++t) {
          const float* ap = af + t * K + k0 + g;
          b0acc[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(ap), b0acc[t]);
          b1acc[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(ap + 16), b1acc[t]);
        }
      }
      __m512 vs = _mm512_set1_ps(am(r * kb + blk));
      for (int t = 0; t < NB; ++t) acc[t] = _mm512_fmadd_ps(_mm512_add_ps(b0acc[t], b1acc[t]), vs, acc[t]);
    }
    for (int t = 0; t < NB; ++t) res[t] = _mm512_reduce_add_ps(acc[t]);
#elif QC_AVX2
    __m256 lo = _mm256_loadu_ps(code), hi = _mm256_loadu_ps(code + 8);
    __m256 acc[NB];
    for (int t = 0; t < NB; ++t) acc[t] = _mm256_setzero_ps();
    for (i64 blk = 0; blk < kb; ++blk) {
      __m256 bacc[NB];
      for (int t = 0; t < NB; ++t) bacc[t] = _mm256_setzero_ps();
      const uint8_t* p = packed + (r * K + blk * bs) / 2;
      i64 k0 = blk * bs;
      for (i64 g = 0; g < bs; g += 32) {
        __m128i e0, e1;
        unpack32(p + g / 2, e0, e1);
        __m256 w0 = lut16(lo, hi, _mm256_cvtepu8_epi32(e0));
        __m256 w1 = lut16(lo, hi, _mm256_cvtepu8_epi32(_mm_srli_si128(e0, 8)));
        __m256 w2 = lut16(lo, hi, _mm256_cvtepu8_epi32(e1));
        __m256 w3 = lut16(lo, hi, _mm256_cvtepu8_epi32(_mm_srli_si128(e1, 8)));
        for (int t = 0; t < NB; ++t) {
          const float* ap = af + t * K + k0 + g;
          __m256 s = _mm256_mul_ps(w0, _mm256_loadu_ps(ap));
          s = _mm256_fmadd_ps(w1, _mm256_loadu_ps(ap + 8), s);
          s = _mm256_fmadd_ps(w2, _mm256_loadu_ps(ap + 16), s);
          s = _mm256_fmadd_ps(w3, _mm256_loadu_ps(ap + 24), s);
          bacc[t] = _mm256_add_ps(bacc[t], s);
        }
      }
      __m256 vs = _mm256_set1_ps(am(r * kb + blk));
      for (int t = 0; t < NB; ++t) acc[t] = _mm256_fmadd_ps(bacc[t], vs, acc[t]);
    }
    for (int t = 0; t < NB; ++t) res[t] = hsum8(acc[t]);
#else
    for (i64 blk = 0; blk < kb; ++blk) {
      float scale = am(r * kb + blk);
      i64 k0 = blk * bs;
      const uint8_t* p = packed + (r * K + k0) / 2;
      for (int t = 0; t < NB; ++t) {
        const float* ap = af + t * K + k0;
        float s = 0.0f;
        for (i64 j = 0; j < bs / 2; ++j) {
          s += ap[2 * j] * code[p[j] >> 4];
          s += ap[2 * j + 1] * code[p[j] & 0x0F];
        }
        res[t] += s * scale;
      }
    }
#endif
}

#if QC_AVX512
// -- gemv_4bit, AVX-512: the weight read as 32-bit words, the activation permuted to match -------
// A 64-byte load holds 128 codes of one row: 32-bit lane i holds bytes 4i..4i+3, so nibble j of
// lane i (bits 4j..4j+3) is element 8i + (j ^ 1) of the group (bitsandbytes puts element 2m in
// the high nibble of byte m). vpermps reads only the low 4 bits of each index, so
// `word >> 4j` is already the index of nibble j: the decode of 128 weights is 7 shifts and 8
// table lookups, no unpacking. The activation is permuted once per call to the same order:
// ap[128g + 16j + i] = a[128g + 8i + (j ^ 1)] (fp32; see permute_activation).
constexpr i64 kGroup = 128;

// fp32 copy of B rows of K (K % 128 == 0) in the permuted order above.
void permute_activation(const void* a, int dtype, i64 B, i64 K, float* ap) {
  const __m512i gidx = _mm512_setr_epi32(1, 9, 17, 25, 33, 41, 49, 57, 65, 73, 81, 89, 97, 105, 113, 121);
  for (i64 g = 0; g < B * K; g += kGroup) {
    alignas(64) float tmp[kGroup];
    for (int e = 0; e < kGroup; e += 8) _mm256_store_ps(tmp + e, load8(a, dtype, g + e));
    for (int j = 0; j < 8; ++j) {
      // lane i <- tmp[8i + (j ^ 1)]: gidx holds 8i + 1, so add (j ^ 1) - 1
      __m512i idx = _mm512_add_epi32(gidx, _mm512_set1_epi32((j ^ 1) - 1));
      _mm512_storeu_ps(ap + g + 16 * j, _mm512_i32gather_ps(idx, tmp, 4));
    }
  }
}

// The block scales of row r, blocks [b0, b0 + n) into sc (n <= kScaleChunk): plain fp32 or
// double quantization's two fp32 roundings (code2[q] * absmax2, then + offset).
constexpr i64 kScaleChunk = 256;
inline void row_scales(const Absmax& am, i64 b0, i64 n, float* sc) {
  if (!am.q) { std::memcpy(sc, am.plain + b0, (size_t)n * 4); return; }
  i64 i = 0;
  const __m512 off = _mm512_set1_ps(am.offset);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; i + 16 <= n; i += 16) {
    i64 b = b0 + i;
    __m512 c = _mm512_i32gather_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(am.q + b))), am.code2, 4);
    __m512 a2;
    if (b / QC_NESTED_BLOCKSIZE == (b + 15) / QC_NESTED_BLOCKSIZE) {
      a2 = _mm512_set1_ps(am.absmax2[b / QC_NESTED_BLOCKSIZE]);
    } else {
      __m512i bi = _mm512_add_epi32(_mm512_set1_epi32((int)(b % QC_NESTED_BLOCKSIZE)), lane);
      __m512i idx = _mm512_add_epi32(_mm512_set1_epi32((int)(b / QC_NESTED_BLOCKSIZE)),
                                     _mm512_srli_epi32(bi, __builtin_ctz(QC_NESTED_BLOCKSIZE)));
      a2 = _mm512_i32gather_ps(idx, am.absmax2, 4);
    }
    // code2[q] * absmax2, then + offset: two roundings, as the reference (no FMA)
    _mm512_storeu_ps(sc + i, _mm512_add_ps(_mm512_mul_ps(c, a2), off));
  }
  for (; i < n; ++i) sc[i] = am(b0 + i);
}
static_assert((QC_NESTED_BLOCKSIZE & (QC_NESTED_BLOCKSIZE - 1)) == 0, "row_scales shifts by log2");

// Decode the 128 weights of one 64-byte load into w[0..7] (vector j = nibble j of every lane).
#ifndef QC_PREFETCH
#define QC_PREFETCH 1536
#endif
inline void decode128(const uint8_t* p, __m512 lut, __m512* w) {
  if (QC_PREFETCH) _mm_prefetch((const char*)p + QC_PREFETCH, _MM_HINT_T0);
  __m512i v = _mm512_loadu_si512(p);
  w[0] = _mm512_permutexvar_ps(v, lut);
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut);
  w[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8), lut);
  w[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 12), lut);
  w[4] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 16), lut);
  w[5] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 20), lut);
  w[6] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 24), lut);
  w[7] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 28), lut);
}

// sum_j w[j] * a[16j ..] for one activation row, in CH independent chains.
template <int CH>
inline __m512 dot128(const __m512* w, const float* ap) {
  __m512 s[CH];
  for (int c = 0; c < CH; ++c) s[c] = _mm512_mul_ps(w[c], _mm512_loadu_ps(ap + 16 * c));
  for (int j = CH; j < 8; ++j) s[j % CH] = _mm512_fmadd_ps(w[j], _mm512_loadu_ps(ap + 16 * j), s[j % CH]);
  if (CH == 4) { s[0] = _mm512_add_ps(s[0], s[2]); s[1] = _mm512_add_ps(s[1], s[3]); }
  if (CH >= 2) s[0] = _mm512_add_ps(s[0], s[1]);
  return s[0];
}

// One weight row against NB permuted activation rows (stride K): res[t] = row . a_t.
// bs is 32, 64 or a multiple of 128. A block's products are summed in fp32, then scaled by its
// absmax once (one rounding), as in gemv_row.
template <int NB>
void gemv_row512(const float* ap, i64 K, i64 r, const uint8_t* packed, const Absmax& am, int bs,
                 __m512 lut, float* res) {
  constexpr int CH = NB == 1 ? 2 : NB == 2 ? 2 : 1;
  const uint8_t* prow = packed + r * K / 2;
  i64 kb = K / bs;
  __m512 acc[NB];
  for (int t = 0; t < NB; ++t) acc[t] = _mm512_setzero_ps();
  alignas(64) float sc[kScaleChunk + 16];
  __m512 w[8];
  if (bs >= kGroup) {
    i64 gpb = bs / kGroup;  // groups per block
    for (i64 c0 = 0; c0 < kb; c0 += kScaleChunk) {
      i64 cn = kb - c0 < kScaleChunk ? kb - c0 : kScaleChunk;
      row_scales(am, r * kb + c0, cn, sc);
      for (i64 blk = 0; blk < cn; ++blk) {
        i64 k0 = (c0 + blk) * bs;
        __m512 bacc[NB];
        for (int t = 0; t < NB; ++t) bacc[t] = _mm512_setzero_ps();
        for (i64 g = 0; g < gpb; ++g) {
          i64 k = k0 + g * kGroup;
          decode128(prow + k / 2, lut, w);
          for (int t = 0; t < NB; ++t) bacc[t] = _mm512_add_ps(bacc[t], dot128<CH>(w, ap + t * K + k));
        }
        __m512 vs = _mm512_set1_ps(sc[blk]);
        for (int t = 0; t < NB; ++t) acc[t] = _mm512_fmadd_ps(bacc[t], vs, acc[t]);
      }
    }
  } else {
    // bs 64: lanes 0-7 of a group are one block, 8-15 the next; bs 32: four blocks of 4 lanes
    const __m512i sidx = bs == 64 ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
                                  : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    i64 bpg = kGroup / bs;  // blocks per group
    i64 chunk = kScaleChunk / bpg * bpg;
    for (i64 c0 = 0; c0 < kb; c0 += chunk) {
      i64 cn = kb - c0 < chunk ? kb - c0 : chunk;
      row_scales(am, r * kb + c0, cn, sc);
      for (i64 gb = 0; gb < cn; gb += bpg) {
        i64 k = (c0 + gb) * bs;
        decode128(prow + k / 2, lut, w);
        __m512 vs = _mm512_permutexvar_ps(sidx, _mm512_loadu_ps(sc + gb));
        for (int t = 0; t < NB; ++t) acc[t] = _mm512_fmadd_ps(dot128<CH>(w, ap + t * K + k), vs, acc[t]);
      }
    }
  }
  for (int t = 0; t < NB; ++t) res[t] = _mm512_reduce_add_ps(acc[t]);
}
#endif

#if QC_AVX512
// -- dequantize_4bit, AVX-512: 32 outputs per 16 packed bytes ------------------------------------
// The 16 bytes widened to 16 dword lanes: vpermps reads index bits 0-3, so the lane itself looks up
// the low nibble (the odd elements 2m + 1) and the lane >> 4 the high nibble (the even elements
// 2m). Each is multiplied by the block scale in fp32 (the reference's one product), converted to
// the output type (one rounding), and the even / odd halves are interleaved by one two-source
// permute on the way to the store.

template <int DT>
inline void dequant32(const uint8_t* p, __m512 lut, __m512 vs, void* out, i64 i) {
  __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  __m512 odd = _mm512_mul_ps(_mm512_permutexvar_ps(v, lut), vs);
  __m512 even = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut), vs);
  if (DT == QC_DTYPE_F32) {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    _mm512_storeu_ps((float*)out + i, _mm512_permutex2var_ps(even, lo, odd));
    _mm512_storeu_ps((float*)out + i + 16, _mm512_permutex2var_ps(even, hi, odd));
    return;
  }
  __m512i w;
  if (DT == QC_DTYPE_F16) {
    // word m of the even half, word m of the odd half (the odd half is the second source)
    const __m512i idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                         39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    __m256i he = _mm512_cvtps_ph(even, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i ho = _mm512_cvtps_ph(odd, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    w = _mm512_permutex2var_epi16(_mm512_castsi256_si512(he), idx, _mm512_castsi256_si512(ho));
  } else {
#if QC_AVX512BF16
    // cvtne2ps(a, b): words 0-15 from b, 16-31 from a
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    w = _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
#else
    // round to nearest even on the bits (finite values: see bf16_vector_scale), then the high
    // word of each dword
    const __m512i idx = _mm512_set_epi16(63, 31, 61, 29, 59, 27, 57, 25, 55, 23, 53, 21, 51, 19, 49, 17,
                                         47, 15, 45, 13, 43, 11, 41, 9, 39, 7, 37, 5, 35, 3, 33, 1);
    const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
    __m512i xe = _mm512_castps_si512(even), xo = _mm512_castps_si512(odd);
    xe = _mm512_add_epi32(_mm512_add_epi32(xe, bias), _mm512_and_si512(_mm512_srli_epi32(xe, 16), one));
    xo = _mm512_add_epi32(_mm512_add_epi32(xo, bias), _mm512_and_si512(_mm512_srli_epi32(xo, 16), one));
    w = _mm512_permutex2var_epi16(xe, idx, xo);
#endif
  }
  _mm512_storeu_si512((uint16_t*)out + i, w);
}

// Blocks [b0, b0 + nblk) (nblk <= kScaleChunk) of the output; a thread's unit of work is about
// kDequantChunkElems elements of whole blocks.
constexpr i64 kDequantChunkElems = 1 << 14;
template <int DT>
void dequant4_blocks(const uint8_t* packed, const float* code, const Absmax& am, i64 b0, i64 nblk, i64 n,
                     int bs, void* out) {
  alignas(64) float sc[kScaleChunk + 16];
  row_scales(am, b0, nblk, sc);
  const __m512 lut = _mm512_loadu_ps(code);
  for (i64 j = 0; j < nblk; ++j) {
    i64 i = (b0 + j) * bs, i1 = i + bs < n ? i + bs : n;
    float s = sc[j];
    if (DT != QC_DTYPE_BF16 || bf16_vector_scale(s)) {
      __m512 vs = _mm512_set1_ps(s);
      for (; i + 32 <= i1; i += 32) dequant32<DT>(packed + i / 2, lut, vs, out, i);
    }
    for (; i < i1; ++i) store_from_float(out, DT, i, code[nibble(packed, i)] * s);
  }
}
#endif

// One Q4_0 weight row against NT Q8_1 activation rows (stride nb blocks): acc[t] = row . a_t.
template <int NT>
void gemm_row(const uint8_t* wrow, const uint8_t* aq, i64 nb, float* acc) {
  for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
  i64 b = 0;
#if QC_AVX2
  // four blocks at a time: exact int32 block sums, then the block terms as fp32 vectors
  __m128 vacc[NT];
  for (int t = 0; t < NT; ++t) vacc[t] = _mm_setzero_ps();
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m128 eight = _mm_set1_ps((float)QC_Q4_0_OFFSET);
  for (; b + 4 <= nb; b += 4) {
    const uint8_t* w = wrow + b * QC_Q4_0_BLOCK_BYTES;
    __m256i q4[4];
    uint16_t dh[4];
    for (int u = 0; u < 4; ++u) {
      const uint8_t* wb = w + u * QC_Q4_0_BLOCK_BYTES;
      __m128i v = _mm_loadu_si128((const __m128i*)(wb + 2));
      q4[u] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
      std::memcpy(&dh[u], wb, 2);
    }
    __m128 d4 = _mm_cvtph_ps(_mm_setr_epi16((short)dh[0], (short)dh[1], (short)dh[2], (short)dh[3], 0, 0, 0, 0));
    for (int t = 0; t < NT; ++t) {
      const uint8_t* a = aq + (t * nb + b) * QC_Q8_1_BLOCK_BYTES;
      __m256i p[4];
      uint16_t ah[8];
      for (int u = 0; u < 4; ++u) {
        const uint8_t* ab = a + u * QC_Q8_1_BLOCK_BYTES;
        __m256i q8 = _mm256_loadu_si256((const __m256i*)(ab + 4));
        p[u] = _mm256_madd_epi16(_mm256_maddubs_epi16(q4[u], q8), ones);
        std::memcpy(&ah[u], ab, 2);
        std::memcpy(&ah[4 + u], ab + 2, 2);
      }
      __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
      __m128i sumi = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
      __m256 ds = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)ah));
      __m128 d8 = _mm256_castps256_ps128(ds), s8 = _mm256_extractf128_ps(ds, 1);
      __m128 inner = _mm_sub_ps(_mm_mul_ps(d8, _mm_cvtepi32_ps(sumi)), _mm_mul_ps(eight, s8));
      vacc[t] = _mm_add_ps(vacc[t], _mm_mul_ps(d4, inner));
    }
  }
  for (int t = 0; t < NT; ++t) {
    __m128 v = vacc[t];
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    acc[t] = _mm_cvtss_f32(v);
  }
#endif
  for (; b < nb; ++b) {
    const uint8_t* w = wrow + b * QC_Q4_0_BLOCK_BYTES;
    float d4 = read_half(w);
    for (int t = 0; t < NT; ++t) {
      const uint8_t* a = aq + (t * nb + b) * QC_Q8_1_BLOCK_BYTES;
      const int8_t* qs = (const int8_t*)(a + 4);
      int sumi = 0;
      for (int j = 0; j < QC_QK / 2; ++j)
        sumi += (w[2 + j] & 0x0F) * qs[j] + (w[2 + j] >> 4) * qs[j + QC_QK / 2];
      float d8 = read_half(a), s8 = read_half(a + 2);
      float inner = d8 * (float)sumi;
      inner = inner - (float)QC_Q4_0_OFFSET * s8;
      acc[t] += d4 * inner;
    }
  }
}

#if QC_AVX2
// -- Q4_0 x Q8_1, eight blocks at a time ------------------------------------------------------------
// The activation is repacked once per call (repack_q8_1): its int8 values contiguous, d8 and
// 8 * s8 as fp32 (exact: fp16 values, times 8). A weight block's 16 bytes are broadcast to both
// 128-bit halves of a ymm register; shifting the upper half right by 4 puts the high nibbles
// (elements 16..31) there, so after `& 0x0F` the 32 bytes are the block's codes in element order,
// against the activation's 32 int8 values. vpdpbusd (AVX512-VNNI) or maddubs + madd gives eight
// exact int32 partial sums per block; a transposing hadd tree turns eight blocks' partials into
// their eight exact sums, so the block terms are those of the scalar path, eight per vector.
struct Q8Rows {
  const int8_t* qs;  // [N, nb * 32]
  const float* d8;   // [N, nb]
  const float* e8s;  // [N, nb]: 8 * s8
};

inline __m256i block_codes(const uint8_t* wb) {
  const __m256i shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
  __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(wb + 2)));
  return _mm256_and_si256(_mm256_srlv_epi32(v, shift), _mm256_set1_epi8(0x0F));
}

inline __m256i block_dot(__m256i q4, const int8_t* q8) {
  __m256i a = _mm256_loadu_si256((const __m256i*)q8);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), q4, a);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(q4, a), _mm256_set1_epi16(1));  // |q4 q8| pairs < 2^15
#endif
}

// lanes u of p[u] summed: out lane u = sum of p[u]'s eight lanes (exact int32).
inline __m256i sum8x8(const __m256i* p) {
  __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
  __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31));
}

// The fp16 d of eight consecutive Q4_0 blocks as fp32.
inline __m256 block_d8(const uint8_t* wb) {
  const __m256i offs = _mm256_setr_epi32(0, 18, 36, 54, 72, 90, 108, 126);
  static_assert(QC_Q4_0_BLOCK_BYTES == 18, "block_d8's offsets");
  __m256i g = _mm256_i32gather_epi32((const int*)wb, offs, 1);  // low 16 bits: d (little endian)
#if defined(__AVX512VL__)
  __m128i h = _mm256_cvtepi32_epi16(g);
#else
  g = _mm256_shuffle_epi8(g, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                              0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1));
  __m128i h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(g, 0x08));
#endif
  return _mm256_cvtph_ps(h);
}

template <int NT>
void gemm_row8(const uint8_t* wrow, const Q8Rows& a, i64 nb, float* acc) {
  __m256 vacc[NT];
  for (int t = 0; t < NT; ++t) vacc[t] = _mm256_setzero_ps();
  i64 b = 0;
  for (; b + 8 <= nb; b += 8) {
    const uint8_t* wb = wrow + b * QC_Q4_0_BLOCK_BYTES;
    _mm_prefetch((const char*)wb + 1536, _MM_HINT_T0);
    _mm_prefetch((const char*)wb + 1536 + 64, _MM_HINT_T0);
    _mm_prefetch((const char*)wb + 1536 + 128, _MM_HINT_T0);
    __m256i q4[8];
    for (int u = 0; u < 8; ++u) q4[u] = block_codes(wb + u * QC_Q4_0_BLOCK_BYTES);
    __m256 d4 = block_d8(wb);
    for (int t = 0; t < NT; ++t) {
      const int8_t* q8 = a.qs + (t * nb + b) * QC_QK;
      __m256i p[8];
      for (int u = 0; u < 8; ++u) p[u] = block_dot(q4[u], q8 + u * QC_QK);
      __m256 sumi = _mm256_cvtepi32_ps(sum8x8(p));  // exact: |sumi| < 2^24
      // d8 * sumi - 8 s8, then d4 *: the scalar path's three roundings
      __m256 inner = _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(a.d8 + t * nb + b), sumi),
                                   _mm256_loadu_ps(a.e8s + t * nb + b));
      vacc[t] = _mm256_add_ps(vacc[t], _mm256_mul_ps(d4, inner));
    }
  }
  for (int t = 0; t < NT; ++t) acc[t] = hsum8(vacc[t]);
  for (; b < nb; ++b) {
    const uint8_t* w = wrow + b * QC_Q4_0_BLOCK_BYTES;
    float d4 = read_half(w);
    for (int t = 0; t < NT; ++t) {
      const int8_t* qs = a.qs + (t * nb + b) * QC_QK;
      int sumi = 0;
      for (int j = 0; j < QC_QK / 2; ++j)
        sumi += (w[2 + j] & 0x0F) * qs[j] + (w[2 + j] >> 4) * qs[j + QC_QK / 2];
      float inner = a.d8[t * nb + b] * (float)sumi;
      inner = inner - a.e8s[t * nb + b];
      acc[t] += d4 * inner;
    }
  }
}
#endif

}  // namespace

extern "C" {

// every entry point's declaration, generated from quantcore/formats/kernel_interface.py: a
// definition below that disagrees with it does not compile
QC_CPU_PROTOTYPES

const char* qc_cpu_build_info() {
  return QC_AVX512BF16 ? "avx512+bf16+avx2+fma+f16c" : QC_AVX512 ? "avx512+avx2+fma+f16c"
         : QC_AVX2      ? "avx2+fma+f16c"
                        : "scalar";
}

int qc_cpu_max_threads() { return omp_get_max_threads(); }

// -- the bandwidth ceilings of `quantcore bench` ---------------------------------------------------
// Stream read: sum n fp32 values (8 independent vector sums per thread); stream copy: dst = src.
double qc_stream_read(const float* p, i64 n, int nt) {
  double total = 0.0;
#pragma omp parallel for num_threads(threads(nt)) schedule(static) reduction(+ : total)
  for (i64 c = 0; c < n / 1024; ++c) {
    const float* q = p + c * 1024;
#if QC_AVX2
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int j = 0; j < 1024; j += 32) {
      s0 = _mm256_add_ps(s0, _mm256_loadu_ps(q + j));
      s1 = _mm256_add_ps(s1, _mm256_loadu_ps(q + j + 8));
      s2 = _mm256_add_ps(s2, _mm256_loadu_ps(q + j + 16));
      s3 = _mm256_add_ps(s3, _mm256_loadu_ps(q + j + 24));
    }
    total += (double)hsum8(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
#else
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int j = 0; j < 1024; ++j) acc[j & 7] += q[j];
    total += (double)(acc[0] + acc[1] + acc[2] + acc[3] + acc[4] + acc[5] + acc[6] + acc[7]);
#endif
  }
  return total;
}

void qc_stream_copy(const float* src, float* dst, i64 n, int nt) {
#pragma omp parallel for num_threads(threads(nt)) schedule(static)
  for (i64 c = 0; c < n / 1024; ++c) std::memcpy(dst + c * 1024, src + c * 1024, 1024 * sizeof(float));
}

// -- bitsandbytes 4-bit ----------------------------------------------------------------------------
void qc_quantize_4bit(const void* x, int dtype, uint8_t* packed, float* absmax, i64 n, int bs,
                      int quant_type, int nt) {
  i64 nb = (n + bs - 1) / bs;
#pragma omp parallel for num_threads(threads_for(nt, n)) schedule(static)
  for (i64 b = 0; b < nb; ++b) {
    i64 i0 = b * bs, i1 = i0 + bs < n ? i0 + bs : n;
    float m = absmax_range(x, dtype, i0, i1, i1 - i0 < bs ? 0.0f : NAN);
    absmax[b] = m;
    float r = 1.0f / m;
    i64 len = i1 - i0;  // bs is even, so i0 is even: the block owns its bytes
    uint8_t* out = packed + i0 / 2;
    i64 pairs = len / 2;
    i64 j = 0;
#if QC_AVX2
    // 32 elements at a time: codes by threshold counting, pairs packed as (even << 4) | odd
    __m256 vr = _mm256_set1_ps(r);
    __m256i pairw = _mm256_set1_epi16(0x0110);  // bytes (16, 1): even * 16 + odd
    __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256i step = _mm256_loadu_si256((const __m256i*)kFP4Step8);
    for (; 2 * j + 32 <= len; j += 16) {
      __m256i c[4];
      for (int g = 0; g < 4; ++g) {
        __m256 sv = _mm256_mul_ps(load8(x, dtype, i0 + 2 * j + 8 * g), vr);
        __m256i cnt = _mm256_setzero_si256();
        if (quant_type == QC_QUANT_NF4) {
          for (int t = 0; t < QC_NF4_NTHRESHOLDS; ++t)
            cnt = _mm256_sub_epi32(cnt, _mm256_castps_si256(_mm256_cmp_ps(sv, _mm256_set1_ps(kNF4Thr[t]), _CMP_GT_OQ)));
        } else {
          __m256 mag = _mm256_and_ps(sv, absmask);
          for (int t = 0; t < QC_FP4_NTHRESHOLDS; ++t)
            cnt = _mm256_sub_epi32(cnt, _mm256_castps_si256(_mm256_cmp_ps(mag, _mm256_set1_ps(kFP4Thr[t]), _CMP_GT_OQ)));
          cnt = _mm256_permutevar8x32_epi32(step, cnt);
          __m256i neg = _mm256_castps_si256(_mm256_cmp_ps(sv, _mm256_setzero_ps(), _CMP_LT_OQ));
          cnt = _mm256_or_si256(cnt, _mm256_and_si256(neg, _mm256_set1_epi32(QC_FP4_SIGN_BIT)));
        }
        c[g] = cnt;
      }
      // 32 int32 codes -> 32 bytes in element order
      __m256i w01 = _mm256_packus_epi32(c[0], c[1]), w23 = _mm256_packus_epi32(c[2], c[3]);
      __m256i b = _mm256_packus_epi16(w01, w23);
      b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      __m256i pk = _mm256_maddubs_epi16(b, pairw);  // int16: even * 16 + odd
      __m128i bytes = _mm_packus_epi16(_mm256_castsi256_si128(pk), _mm256_extracti128_si256(pk, 1));
      _mm_storeu_si128((__m128i*)(out + j), bytes);
    }
#endif
    for (; j < pairs; ++j) {
      uint8_t c0 = code_4bit(load_as_float(x, dtype, i0 + 2 * j) * r, quant_type);
      uint8_t c1 = code_4bit(load_as_float(x, dtype, i0 + 2 * j + 1) * r, quant_type);
      out[j] = (uint8_t)((c0 << 4) | c1);
    }
    if (len & 1) {  // the odd last element; its partner nibble is the block's code of 0.0
      uint8_t c0 = code_4bit(load_as_float(x, dtype, i1 - 1) * r, quant_type);
      uint8_t c1 = code_4bit(0.0f * r, quant_type);
      out[pairs] = (uint8_t)((c0 << 4) | c1);
    }
  }
}

void qc_dequantize_4bit(const uint8_t* packed, const void* absmax, const float* absmax2,
                        const float* code2, const float* offset, void* out, int dtype, i64 n, int bs,
                        int quant_type, int nt) {
  const float* code = code_table(quant_type);
  const Absmax am = make_absmax(absmax, absmax2, code2, offset);
  i64 nb = (n + bs - 1) / bs;
#if QC_AVX512
  // chunks of whole blocks, their scales decoded together (row_scales)
  i64 chunk = kDequantChunkElems / bs;
  chunk = chunk < 1 ? 1 : chunk > kScaleChunk ? kScaleChunk : chunk;
  i64 nchunks = (nb + chunk - 1) / chunk;
#pragma omp parallel for num_threads(threads_for(nt, n)) schedule(static)
  for (i64 c = 0; c < nchunks; ++c) {
    i64 b0 = c * chunk, nblk = nb - b0 < chunk ? nb - b0 : chunk;
    if (dtype == QC_DTYPE_F32) dequant4_blocks<QC_DTYPE_F32>(packed, code, am, b0, nblk, n, bs, out);
    else if (dtype == QC_DTYPE_F16) dequant4_blocks<QC_DTYPE_F16>(packed, code, am, b0, nblk, n, bs, out);
    else dequant4_blocks<QC_DTYPE_BF16>(packed, code, am, b0, nblk, n, bs, out);
  }
#else
#pragma omp parallel for num_threads(threads_for(nt, n)) schedule(dynamic, 1024)
  for (i64 b = 0; b < nb; ++b) {
    i64 i0 = b * bs, i1 = i0 + bs < n ? i0 + bs : n;
    float scale = am(b);
    i64 i = i0;
#if QC_AVX2
    __m256 lo = _mm256_loadu_ps(code), hi = _mm256_loadu_ps(code + 8), vs = _mm256_set1_ps(scale);
    if (dtype == QC_DTYPE_BF16 && bf16_vector_scale(scale)) {
      // finite products: bf16 by the bits rounding alone (no NaN test), 16 values per pack
      for (; i + 32 <= i1; i += 32) {
        __m128i e0, e1;
        unpack32(packed + i / 2, e0, e1);
        __m256i r0 = bf16_bits_finite(_mm256_mul_ps(lut16(lo, hi, _mm256_cvtepu8_epi32(e0)), vs));
        __m256i r1 = bf16_bits_finite(_mm256_mul_ps(lut16(lo, hi, _mm256_cvtepu8_epi32(_mm_srli_si128(e0, 8))), vs));
        __m256i r2 = bf16_bits_finite(_mm256_mul_ps(lut16(lo, hi, _mm256_cvtepu8_epi32(e1)), vs));
        __m256i r3 = bf16_bits_finite(_mm256_mul_ps(lut16(lo, hi, _mm256_cvtepu8_epi32(_mm_srli_si128(e1, 8))), vs));
        uint16_t* o = (uint16_t*)out + i;
        _mm256_storeu_si256((__m256i*)o, _mm256_permute4x64_epi64(_mm256_packus_epi32(r0, r1), 0xD8));
        _mm256_storeu_si256((__m256i*)(o + 16), _mm256_permute4x64_epi64(_mm256_packus_epi32(r2, r3), 0xD8));
      }
    }
    for (; i + 32 <= i1; i += 32) {
      __m128i e0, e1;
      unpack32(packed + i / 2, e0, e1);
      store8(out, dtype, i, _mm256_mul_ps(lut16(lo, hi, _mm256_cvtepu8_epi32(e0)), vs));
      store8(out, dtype, i + 8, _mm256_mul_ps(lut16(lo, hi, _mm256_cvtepu8_epi32(_mm_srli_si128(e0, 8))), vs));
      store8(out, dtype, i + 16, _mm256_mul_ps(lut16(lo, hi, _mm256_cvtepu8_epi32(e1)), vs));
      store8(out, dtype, i + 24, _mm256_mul_ps(lut16(lo, hi, _mm256_cvtepu8_epi32(_mm_srli_si128(e1, 8))), vs));
    }
#endif
    for (; i < i1; ++i) store_from_float(out, dtype, i, code[nibble(packed, i)] * scale);
  }
#endif
}

void qc_double_quantize(const float* absmax, uint8_t* qabsmax, float* absmax2, float* offset_out,
                        i64 nb, int nt) {
  if (nb <= 0) { offset_out[0] = 0.0f; return; }
  i64 size = 1;
  while (size < nb) size <<= 1;
  float offset = (float)(tree_sum(absmax, nb, 0, size) / (double)nb);
  offset_out[0] = offset;
  i64 nb2 = (nb + QC_NESTED_BLOCKSIZE - 1) / QC_NESTED_BLOCKSIZE;
#pragma omp parallel for num_threads(threads_for(nt, nb)) schedule(static)
  for (i64 b = 0; b < nb2; ++b) {
    i64 i0 = b * QC_NESTED_BLOCKSIZE;
    i64 i1 = i0 + QC_NESTED_BLOCKSIZE < nb ? i0 + QC_NESTED_BLOCKSIZE : nb;
    float m = i1 - i0 < QC_NESTED_BLOCKSIZE ? 0.0f : NAN;
    for (i64 i = i0; i < i1; ++i) {
      float v = std::fabs(absmax[i] - offset);
      m = (v > m || m != m) ? v : m;
    }
    absmax2[b] = m;
    float r = 1.0f / m;
    for (i64 i = i0; i < i1; ++i) {
      float centered = absmax[i] - offset;
      qabsmax[i] = code_8bit(centered * r, kDynThr);
    }
  }
}

// -- blockwise 8-bit -------------------------------------------------------------------------------
void qc_quantize_blockwise(const void* x, int dtype, const float* thresholds, uint8_t* codes,
                           float* absmax, i64 n, int bs, int nt) {
  quantize_blockwise_impl(x, dtype, n, bs, thresholds, codes, absmax, nt);
}

void qc_dequantize_blockwise(const uint8_t* codes, const float* absmax, const float* code, void* out,
                             int dtype, i64 n, int bs, int nt) {
  i64 nb = (n + bs - 1) / bs;
#pragma omp parallel for num_threads(threads_for(nt, n)) schedule(static)
  for (i64 b = 0; b < nb; ++b) {
    i64 i0 = b * bs, i1 = i0 + bs < n ? i0 + bs : n;
    float scale = absmax[b];
    i64 i = i0;
#if QC_AVX2
    __m256 vs = _mm256_set1_ps(scale);
    for (; i + 8 <= i1; i += 8) {
      __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(codes + i)));
      store8(out, dtype, i, _mm256_mul_ps(_mm256_i32gather_ps(code, idx, 4), vs));
    }
#endif
    for (; i < i1; ++i) store_from_float(out, dtype, i, code[codes[i]] * scale);
  }
}

// -- gemv_4bit: out[b, r] = sum_k a[b, k] * code[q(r, k)] * absmax(block(r, k)) --------------------
// fp32 accumulation. A block's products a * code are summed in fp32, then scaled by its absmax
// once (a term of the tolerance tier's bound: one rounding for the product, one for the scaling).
void qc_gemv_4bit(const void* a, int adtype, const uint8_t* packed, const void* absmax,
                  const float* absmax2, const float* code2, const float* offset, void* out, i64 B,
                  i64 N, i64 K, int bs, int quant_type, int nt) {
  const float* code = code_table(quant_type);
  const Absmax am = make_absmax(absmax, absmax2, code2, offset);
  thread_local std::vector<float> converted;
#if QC_AVX512
  if (K % kGroup == 0 && K % bs == 0 && (bs == 32 || bs == 64 || bs % kGroup == 0)) {
    if ((i64)converted.size() < B * K) converted.resize((size_t)(B * K));
    float* ap = converted.data();
    permute_activation(a, adtype, B, K, ap);
    const __m512 lut = _mm512_loadu_ps(code);
    constexpr int TILE = 8;
#pragma omp parallel for num_threads(threads_for(nt, N * K)) schedule(static)
    for (i64 r = 0; r < N; ++r) {
      for (i64 b0 = 0; b0 < B; b0 += TILE) {
        int nbt = (int)(B - b0 < TILE ? B - b0 : TILE);
        float res[TILE];
        const float* at = ap + b0 * K;
        switch (nbt) {
          case 1: gemv_row512<1>(at, K, r, packed, am, bs, lut, res); break;
          case 2: gemv_row512<2>(at, K, r, packed, am, bs, lut, res); break;
          case 3: gemv_row512<3>(at, K, r, packed, am, bs, lut, res); break;
          case 4: gemv_row512<4>(at, K, r, packed, am, bs, lut, res); break;
          case 5: gemv_row512<5>(at, K, r, packed, am, bs, lut, res); break;
          case 6: gemv_row512<6>(at, K, r, packed, am, bs, lut, res); break;
          case 7: gemv_row512<7>(at, K, r, packed, am, bs, lut, res); break;
          default: gemv_row512<8>(at, K, r, packed, am, bs, lut, res); break;
        }
        for (int t = 0; t < nbt; ++t) store_from_float(out, adtype, (b0 + t) * N + r, res[t]);
      }
    }
    return;
  }
#endif
  const float* af;
  if (adtype == QC_DTYPE_F32) {
    af = (const float*)a;
  } else {
    if ((i64)converted.size() < B * K) converted.resize((size_t)(B * K));
    for (i64 i = 0; i < B * K; ++i) converted[(size_t)i] = load_as_float(a, adtype, i);
    af = converted.data();
  }
  bool aligned = K % bs == 0 && bs % 32 == 0;
  constexpr int TILE = 4;
#pragma omp parallel for num_threads(threads_for(nt, N * K)) schedule(dynamic, 16)
  for (i64 r = 0; r < N; ++r) {
    for (i64 b0 = 0; b0 < B; b0 += TILE) {
      int nbt = (int)(B - b0 < TILE ? B - b0 : TILE);
      float res[TILE] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (aligned) {
        switch (nbt) {
          case 1: gemv_row<1>(af + b0 * K, K, r, packed, am, bs, code, res); break;
          case 2: gemv_row<2>(af + b0 * K, K, r, packed, am, bs, code, res); break;
          case 3: gemv_row<3>(af + b0 * K, K, r, packed, am, bs, code, res); break;
          default: gemv_row<4>(af + b0 * K, K, r, packed, am, bs, code, res); break;
        }
      } else {  // rows not aligned to blocks (or an odd K): element by element, w = f32(code * absmax)
        for (i64 k = 0; k < K; ++k) {
          i64 i = r * K + k;
          float w = code[nibble(packed, i)] * am(i / bs);
          for (int t = 0; t < nbt; ++t) res[t] += af[(b0 + t) * K + k] * w;
        }
      }
      for (int t = 0; t < nbt; ++t) store_from_float(out, adtype, (b0 + t) * N + r, res[t]);
    }
  }
}

// -- ggml ---------------------------------------------------------------------------------------------
void qc_quantize_q4_0(const void* x, int dtype, uint8_t* out, i64 nblocks, int nt) {
#pragma omp parallel for num_threads(threads_for(nt, nblocks * QC_QK)) schedule(static)
  for (i64 b = 0; b < nblocks; ++b) {
    float v[QC_QK];
    for (int j = 0; j < QC_QK; ++j) v[j] = load_as_float(x, dtype, b * QC_QK + j);
    float best = -1.0f, mx = 0.0f;
    for (int j = 0; j < QC_QK; ++j) {
      float mag = std::fabs(v[j]);
      if (mag != mag) mag = -1.0f;
      if (mag > best) { best = mag; mx = v[j]; }
    }
    if (!(best > 0.0f)) mx = 0.0f;  // NaN or zero only: +0.0 as llama.cpp (x[0] may be -0.0)
    float d = mx / (float)(-QC_Q4_0_OFFSET);
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    uint8_t* blk = out + b * QC_Q4_0_BLOCK_BYTES;
    write_half(blk, float_to_half(d));
    uint8_t q[QC_QK];
    for (int j = 0; j < QC_QK; ++j) {
      float biased = v[j] * id + QC_Q4_0_ROUND_BIAS;
      int t = std::isfinite(biased) ? (int)std::fmax(-128.0f, std::fmin(127.0f, std::trunc(biased))) : 0;
      q[j] = (uint8_t)(t < 15 ? t : 15);
    }
    for (int j = 0; j < QC_QK / 2; ++j) blk[2 + j] = (uint8_t)((q[j] & 0x0F) | (q[j + QC_QK / 2] << 4));
  }
}

}  // extern "C"

namespace {
// kind 0: Q8_0 (34 bytes: d, qs); kind 1: Q8_1 (36 bytes: d, s, qs).
void quantize_q8(const void* x, int dtype, i64 nblocks, int kind, uint8_t* out, int nt) {
  int width = kind ? QC_Q8_1_BLOCK_BYTES : QC_Q8_0_BLOCK_BYTES;
#pragma omp parallel for num_threads(threads_for(nt, nblocks * QC_QK)) schedule(static)
  for (i64 b = 0; b < nblocks; ++b) {
    alignas(32) float v[QC_QK];
#if QC_AVX2
    for (int j = 0; j < QC_QK; j += 8) _mm256_store_ps(v + j, load8(x, dtype, b * QC_QK + j));
    float amax = absmax_range(v, QC_DTYPE_F32, 0, QC_QK, NAN);  // NaN skipped; all NaN -> NaN
#else
    for (int j = 0; j < QC_QK; ++j) v[j] = load_as_float(x, dtype, b * QC_QK + j);
    float amax = NAN;
    for (int j = 0; j < QC_QK; ++j) {
      float m = std::fabs(v[j]);
      amax = (m > amax || amax != amax) ? m : amax;
    }
#endif
    if (amax != amax) amax = 0.0f;
    float d = amax / (float)QC_Q8_MAX;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    uint8_t* blk = out + b * width;
    int8_t* qs = (int8_t*)(blk + (kind ? 4 : 2));
    int sum = 0;
#if QC_AVX2
    // roundf(s) = trunc(s) + (|s - trunc(s)| >= 0.5 ? sign(s) : 0), exact (s - trunc(s) is exact);
    // non-finite s -> 0; clamped to [-128, 127]
    static_assert(QC_QK == 32, "the vector Q8 quantizer does four groups of 8");
    __m256 vid = _mm256_set1_ps(id), half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 signmask = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    __m256i c[4];
    for (int g = 0; g < 4; ++g) {
      __m256 s = _mm256_mul_ps(_mm256_loadu_ps(v + 8 * g), vid);
      __m256 t = _mm256_round_ps(s, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
      __m256 up = _mm256_cmp_ps(_mm256_and_ps(_mm256_sub_ps(s, t), absmask), half, _CMP_GE_OQ);
      __m256 r = _mm256_add_ps(t, _mm256_and_ps(up, _mm256_or_ps(_mm256_and_ps(s, signmask), one)));
      r = _mm256_max_ps(_mm256_set1_ps(-128.0f), _mm256_min_ps(_mm256_set1_ps(127.0f), r));
      __m256 fin = _mm256_cmp_ps(_mm256_and_ps(s, absmask), _mm256_set1_ps(INFINITY), _CMP_LT_OQ);
      c[g] = _mm256_cvttps_epi32(_mm256_and_ps(r, fin));
    }
    sum = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3])));
    __m256i b8 = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    b8 = _mm256_permutevar8x32_epi32(b8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i*)qs, b8);
#else
    for (int j = 0; j < QC_QK; ++j) {
      float s = v[j] * id;
      int q = std::isfinite(s) ? (int)std::fmax(-128.0f, std::fmin(127.0f, std::round(s))) : 0;
      qs[j] = (int8_t)q;
      sum += q;
    }
#endif
    write_half(blk, float_to_half(d));
    if (kind) {
      float s = (float)sum * d;
      write_half(blk + 2, s != s ? (uint16_t)QC_Q8_1_NAN_S_BITS : float_to_half(s));
    }
  }
}

}  // namespace

extern "C" {

void qc_quantize_q8_0(const void* x, int dtype, uint8_t* out, i64 nblocks, int nt) {
  quantize_q8(x, dtype, nblocks, 0, out, nt);
}

void qc_quantize_q8_1(const void* x, int dtype, uint8_t* out, i64 nblocks, int nt) {
  quantize_q8(x, dtype, nblocks, 1, out, nt);
}

// fmt 0: Q4_0, 1: Q8_0, 2: Q8_1 -> out [nblocks * 32] in dtype.
void qc_dequantize_ggml(const uint8_t* q, int fmt, void* out, int dtype, i64 nblocks, int nt) {
  int width = fmt == QC_FMT_Q4_0 ? QC_Q4_0_BLOCK_BYTES : fmt == QC_FMT_Q8_0 ? QC_Q8_0_BLOCK_BYTES : QC_Q8_1_BLOCK_BYTES;
#pragma omp parallel for num_threads(threads_for(nt, nblocks * QC_QK)) schedule(static)
  for (i64 b = 0; b < nblocks; ++b) {
    const uint8_t* blk = q + b * width;
    float d = read_half(blk);
    i64 o = b * QC_QK;
    if (fmt == QC_FMT_Q4_0) {
      for (int j = 0; j < QC_QK / 2; ++j) {
        store_from_float(out, dtype, o + j, ((float)(blk[2 + j] & 0x0F) - (float)QC_Q4_0_OFFSET) * d);
        store_from_float(out, dtype, o + j + QC_QK / 2, ((float)(blk[2 + j] >> 4) - (float)QC_Q4_0_OFFSET) * d);
      }
    } else {
      const int8_t* qs = (const int8_t*)(blk + (fmt == QC_FMT_Q8_1 ? 4 : 2));
      for (int j = 0; j < QC_QK; ++j) store_from_float(out, dtype, o + j, (float)qs[j] * d);
    }
  }
}

// out[m, n] = sum_b d4[m,b] * (d8[n,b] * sumi - 8 * s8[n,b]); wq [M, nb, 18], aq [N, nb, 36].
// The integer dot product is exact; each block term is three fp32 roundings (d8 * sumi, the
// subtraction, d4 *), summed in fp32 (the tolerance tier's bound allows four).
void qc_gemm_q4_0_q8_1(const uint8_t* wq, const uint8_t* aq, float* out, i64 M, i64 N, i64 K, int nt) {
  const i64 nb = K / QC_QK;
  constexpr int TILE = 4;  // activation rows per pass over a weight row
#if QC_AVX2
  {
    // the activation repacked once (kept per calling thread between calls): int8 values
    // contiguous, d8 and 8 * s8 in fp32
    thread_local std::vector<int8_t> qs;
    thread_local std::vector<float> ds;
    if ((i64)qs.size() < N * nb * QC_QK) qs.resize((size_t)(N * nb * QC_QK));
    if ((i64)ds.size() < 2 * N * nb) ds.resize((size_t)(2 * N * nb));
    for (i64 i = 0; i < N * nb; ++i) {
      const uint8_t* blk = aq + i * QC_Q8_1_BLOCK_BYTES;
      std::memcpy(qs.data() + i * QC_QK, blk + 4, QC_QK);
      ds[(size_t)i] = read_half(blk);
      ds[(size_t)(N * nb + i)] = (float)QC_Q4_0_OFFSET * read_half(blk + 2);  // exact
    }
    Q8Rows rows{qs.data(), ds.data(), ds.data() + N * nb};
#pragma omp parallel for num_threads(threads_for(nt, M * nb * QC_QK)) schedule(static)
    for (i64 m = 0; m < M; ++m) {
      const uint8_t* wrow = wq + m * nb * QC_Q4_0_BLOCK_BYTES;
      for (i64 n0 = 0; n0 < N; n0 += TILE) {
        int nt_ = (int)(N - n0 < TILE ? N - n0 : TILE);
        float acc[TILE];
        Q8Rows at{rows.qs + n0 * nb * QC_QK, rows.d8 + n0 * nb, rows.e8s + n0 * nb};
        switch (nt_) {
          case 1: gemm_row8<1>(wrow, at, nb, acc); break;
          case 2: gemm_row8<2>(wrow, at, nb, acc); break;
          case 3: gemm_row8<3>(wrow, at, nb, acc); break;
          default: gemm_row8<4>(wrow, at, nb, acc); break;
        }
        for (int t = 0; t < nt_; ++t) out[m * N + n0 + t] = acc[t];
      }
    }
    return;
  }
#endif
#pragma omp parallel for num_threads(threads_for(nt, M * nb * QC_QK)) schedule(dynamic, 16)
  for (i64 m = 0; m < M; ++m) {
    const uint8_t* wrow = wq + m * nb * QC_Q4_0_BLOCK_BYTES;
    for (i64 n0 = 0; n0 < N; n0 += TILE) {
      int nt_ = (int)(N - n0 < TILE ? N - n0 : TILE);
      float acc[TILE];
      const uint8_t* arow = aq + n0 * nb * QC_Q8_1_BLOCK_BYTES;
      switch (nt_) {
        case 1: gemm_row<1>(wrow, arow, nb, acc); break;
        case 2: gemm_row<2>(wrow, arow, nb, acc); break;
        case 3: gemm_row<3>(wrow, arow, nb, acc); break;
        default: gemm_row<4>(wrow, arow, nb, acc); break;
      }
      for (int t = 0; t < nt_; ++t) out[m * N + n0 + t] = acc[t];
    }
  }
}

// -- MX family: dequantize and the swizzled scale layout (quantcore/formats/mx.py) -----------------
}  // extern "C"

namespace {

constexpr float kE2M1[16] = QC_E2M1_VALUES_INIT;

inline float e4m3_value(uint8_t b) {
  int e = (b >> 3) & 0xF, m = b & 7;
  float v;
  if (e == 0xF && m == 7) v = NAN;
  else if (e == 0) v = (float)m * 0.001953125f;  // m * 2^-9, exact
  else v = float_of((uint32_t)(e + 120) << 23 | (uint32_t)m << 20);  // (1 + m/8) * 2^(e-7)
  return (b & 0x80) ? -v : v;
}

inline float e8m0_value(uint8_t b) {
  if (b == QC_E8M0_NAN) return NAN;
  return b == 0 ? float_of(0x00400000u) : float_of((uint32_t)b << 23);  // 2^(b-127); b = 0: the denormal 2^-127
}

// Byte offset of scale (r, c) in the swizzled layout of a [*, ncols] scale matrix.
inline i64 swizzle_offset(i64 r, i64 c, i64 ncols) {
  i64 pc = (ncols + QC_SWIZZLE_COLS - 1) / QC_SWIZZLE_COLS * QC_SWIZZLE_COLS;
  i64 tile = (r / QC_SWIZZLE_ROWS) * (pc / QC_SWIZZLE_COLS) + c / QC_SWIZZLE_COLS;
  i64 inner = (r % QC_SWIZZLE_ROW_GROUP) * 16 + ((r % QC_SWIZZLE_ROWS) / QC_SWIZZLE_ROW_GROUP) * 4 +
              c % QC_SWIZZLE_COLS;
  return tile * QC_SWIZZLE_TILE_BYTES + inner;
}

}  // namespace

extern "C" {

// codes [rows, cols/2] (fp4, element 2i in the low nibble) or [rows, cols] (E4M3 bytes), scales
// row-major [rows, cols/blk] or swizzled -> out [rows, cols]: f32(elem * scale) (nvfp4:
// f32(f32(elem * scale) / g)), rounded once to dtype.
void qc_mx_dequantize(const uint8_t* codes, const uint8_t* scales, void* out, int dtype, i64 rows,
                      i64 cols, int fmt, int swizzled, const float* global_scale, int nt) {
  const float g = global_scale ? *global_scale : 1.0f;
  int blk = fmt == QC_FMT_NVFP4 ? QC_NVFP4_BLOCK : QC_MX_BLOCK;
  bool fp4 = fmt != QC_FMT_MXFP8;
  i64 ncols = cols / blk;
#pragma omp parallel for num_threads(threads_for(nt, rows * cols)) schedule(static)
  for (i64 r = 0; r < rows; ++r) {
    for (i64 c = 0; c < ncols; ++c) {
      uint8_t sb = scales[swizzled ? swizzle_offset(r, c, ncols) : r * ncols + c];
      float scale = fmt == QC_FMT_NVFP4 ? e4m3_value(sb) : e8m0_value(sb);
      for (int j = 0; j < blk; ++j) {
        i64 k = c * blk + j;
        float v;
        if (fp4) {
          uint8_t byte = codes[r * (cols / 2) + k / 2];
          v = kE2M1[(k & 1) ? byte >> 4 : byte & 0x0F];
        } else {
          v = e4m3_value(codes[r * cols + k]);
        }
        float prod = v * scale;
        if (fmt == QC_FMT_NVFP4) prod = prod / g;
        store_from_float(out, dtype, r * cols + k, prod);
      }
    }
  }
}

// linear_mx: y [batch, n] = x [batch, k] @ W^T for an fp4 weight W [n, k] (mxfp4 / nvfp4; codes
// [n, k/2], scales row-major or swizzled). W's elements are dequantize_mx's values e2m1 * scale
// (exact in fp32), nvfp4 then divided by g (the AVX-512 path multiplies by f32(1/g): one more
// rounding, within the tolerance tier's 4 per term); products summed in fp32 in lane-wise
// partials, one rounding into dtype at the end (docs/formats-mx.md, linear_mx). x is converted to
// fp32 once per call into a buffer kept by the calling thread (AVX-512: each 32-element chunk's
// even elements first, then its odd ones, the order of a code byte's two nibbles); weight rows go
// over the threads; at most QC_CPU_MX_BATCH input rows (the glue sends more rows to the
// reference: dequantize + BLAS).
void qc_linear_mx(const void* x, int dtype, const uint8_t* codes, const uint8_t* scales,
                  const float* global_scale, void* out, i64 batch, i64 n, i64 k, int fmt, int swizzled,
                  int nt) {
  const float g = global_scale ? *global_scale : 1.0f;
  constexpr int kB = QC_CPU_MX_BATCH;
  const bool nv = fmt == QC_FMT_NVFP4;
  const int blk = nv ? QC_NVFP4_BLOCK : QC_MX_BLOCK;
  const i64 nbk = k / blk;
  const i64 k32 = k / 32 * 32;  // the part taken 32 elements at a time (the rest: k % 32 == 16, nvfp4)
  thread_local std::vector<float> xf;
  xf.resize((size_t)(batch * k));
  for (i64 b = 0; b < batch; ++b) {
    for (i64 i = 0; i < k; ++i) {
      i64 d = i;
#if QC_AVX512
      if (i < k32) d = i / 32 * 32 + (i % 2) * 16 + (i % 32) / 2;
#endif
      xf[(size_t)(b * k + d)] = load_as_float(x, dtype, b * k + i);
    }
  }
  const float* xs = xf.data();
  static const std::array<float, 256> e4m3_table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[(size_t)b] = e4m3_value((uint8_t)b);
    return t;
  }();
  static const std::array<float, 256> e8m0_table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[(size_t)b] = e8m0_value((uint8_t)b);
    return t;
  }();
  const float* stab = nv ? e4m3_table.data() : e8m0_table.data();
  // scale (r, c) lies at sbase(r) + (c / COLS) * cstep + c % COLS (swizzled; swizzle_offset's terms
  // that depend on r alone taken out of the loop), or r * nbk + c
  const i64 cstep = swizzled ? QC_SWIZZLE_TILE_BYTES : QC_SWIZZLE_COLS;
#pragma omp parallel for num_threads(threads_for(nt, n * k * batch)) schedule(static)
  for (i64 r = 0; r < n; ++r) {
    const uint8_t* row = codes + r * (k / 2);
    const i64 sbase = swizzled ? swizzle_offset(r, 0, nbk) : r * nbk;
    auto scale_of = [&](i64 c) { return stab[scales[sbase + (c / QC_SWIZZLE_COLS) * cstep + c % QC_SWIZZLE_COLS]]; };
    float tot[kB] = {};
    i64 k0 = 0;
#if QC_AVX512
    {
      const __m512 table = _mm512_loadu_ps(kE2M1);
      const __m512 inv_g = _mm512_set1_ps(nv ? 1.0f / g : 1.0f);
      const __m128i lo4 = _mm_set1_epi8(0x0F);
      __m512 acc[kB];
      for (i64 b = 0; b < batch; ++b) acc[b] = _mm512_setzero_ps();
      for (; k0 < k32; k0 += 32) {
        // 16 bytes: elements k0 + 2j (low nibbles) and k0 + 2j + 1 (high nibbles), j = 0..15
        __m128i bytes = _mm_loadu_si128((const __m128i*)(row + k0 / 2));
        __m512i ie = _mm512_cvtepu8_epi32(_mm_and_si128(bytes, lo4));
        __m512i io = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), lo4));
        __m512 sv;
        if (nv) {  // lanes 0..7: the first 16-element block, 8..15 the second
          sv = _mm512_mask_blend_ps((__mmask16)0xFF00, _mm512_set1_ps(scale_of(k0 / 16)),
                                    _mm512_set1_ps(scale_of(k0 / 16 + 1)));
          sv = _mm512_mul_ps(sv, inv_g);
        } else {
          sv = _mm512_set1_ps(scale_of(k0 / 32));
        }
        __m512 we = _mm512_mul_ps(_mm512_permutexvar_ps(ie, table), sv);
        __m512 wo = _mm512_mul_ps(_mm512_permutexvar_ps(io, table), sv);
        for (i64 b = 0; b < batch; ++b) {
          const float* xb = xs + b * k + k0;
          acc[b] = _mm512_fmadd_ps(_mm512_loadu_ps(xb), we, acc[b]);
          acc[b] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 16), wo, acc[b]);
        }
      }
      for (i64 b = 0; b < batch; ++b) tot[b] = _mm512_reduce_add_ps(acc[b]);
    }
#endif
    for (i64 c = k0 / blk; c < nbk; ++c) {  // scalar: every block without AVX-512, else the tail
      float scale = scale_of(c);
      for (int j = 0; j < blk; ++j) {
        i64 e = c * blk + j;
        uint8_t byte = row[e / 2];
        float w = kE2M1[(e & 1) ? byte >> 4 : byte & 0x0F] * scale;
        if (nv) w = w / g;
        for (i64 b = 0; b < batch; ++b) tot[b] += xs[b * k + e] * w;
      }
    }
    for (i64 b = 0; b < batch; ++b) store_from_float(out, dtype, b * n + r, tot[b]);
  }
}

// scales uint8 [rows, cols] -> out [ceil(rows/128)*128, ceil(cols/4)*4] swizzled, padding zeroed.
void qc_swizzle_scales(const uint8_t* scales, uint8_t* out, i64 rows, i64 cols, int /*nt: one thread*/) {
  i64 pr = (rows + QC_SWIZZLE_ROWS - 1) / QC_SWIZZLE_ROWS * QC_SWIZZLE_ROWS;
  i64 pc = (cols + QC_SWIZZLE_COLS - 1) / QC_SWIZZLE_COLS * QC_SWIZZLE_COLS;
  std::memset(out, 0, (size_t)(pr * pc));
  for (i64 r = 0; r < rows; ++r)
    for (i64 c = 0; c < cols; ++c) out[swizzle_offset(r, c, cols)] = scales[r * cols + c];
}

void qc_unswizzle_scales(const uint8_t* swz, uint8_t* out, i64 rows, i64 cols, int /*nt: one thread*/) {
  for (i64 r = 0; r < rows; ++r)
    for (i64 c = 0; c < cols; ++c) out[r * cols + c] = swz[swizzle_offset(r, c, cols)];
}

}  // extern "C"

// -- MX family: quantize (bit for bit quantcore/formats/mx.py) and scaled_fp4_mm ------------------
namespace {

// fp32 -> E2M1 code: RNE with saturation on the grid of each binade range (spacing 0.5 on [0, 2),
// 1 on [2, 4), 2 above), NaN -> QC_E2M1_NAN_CODE, the sign bit kept (except for NaN).
inline uint8_t e2m1_code(float v) {
  if (v != v) return (uint8_t)QC_E2M1_NAN_CODE;
  float a = std::fabs(v);
  float idx;
  if (a < 2.0f) idx = std::nearbyint(a * 2.0f);
  else if (a < 4.0f) idx = std::nearbyint(a) + 2.0f;
  else idx = std::fmin(std::nearbyint(a * 0.5f) + 4.0f, 7.0f);
  return (uint8_t)((int)idx | (std::signbit(v) ? QC_E2M1_SIGN_BIT : 0));
}

// fp32 -> E4M3 ("fn") byte: clamp to +-448, then RNE (subnormals in steps of 2^-9); NaN -> 0x7F.
inline uint8_t e4m3_code(float v) {
  if (v != v) return (uint8_t)QC_E4M3_NAN_CODE;
  uint8_t sign = std::signbit(v) ? 0x80 : 0;
  float a = std::fmin(std::fabs(v), QC_E4M3_MAX);
  uint32_t code;
  if (a < 0.015625f) {  // below 2^-6, the smallest normal: q = rint(a * 2^9), exact scaling
    code = (uint32_t)std::nearbyint(a * 512.0f);
  } else {
    uint32_t u = bits_of(a);
    uint32_t e = (u >> 23) - 127 + 7, m = (u >> 20) & 7, rem = u & 0xFFFFF;
    code = (e << 3) + m;
    if (rem > 0x80000u || (rem == 0x80000u && (m & 1))) code += 1;  // a carry moves into the exponent
  }
  return (uint8_t)(sign | code);
}

#if QC_AVX512
// 16 lanes of e2m1_code / e4m3_code (the same arithmetic, lane by lane), as int32 lanes.
inline __m512i e2m1_code16(__m512 v) {
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  __m512 a = _mm512_and_ps(v, absmask);
  constexpr int rne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m512 low = _mm512_roundscale_ps(_mm512_mul_ps(a, _mm512_set1_ps(2.0f)), rne);
  __m512 mid = _mm512_add_ps(_mm512_roundscale_ps(a, rne), _mm512_set1_ps(2.0f));
  __m512 high = _mm512_min_ps(_mm512_add_ps(_mm512_roundscale_ps(_mm512_mul_ps(a, _mm512_set1_ps(0.5f)), rne),
                                            _mm512_set1_ps(4.0f)), _mm512_set1_ps(7.0f));
  __m512 idx = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(4.0f), _CMP_LT_OQ), high, mid);
  idx = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(2.0f), _CMP_LT_OQ), idx, low);
  __m512i code = _mm512_cvttps_epi32(idx);  // NaN lanes fixed below
  __mmask16 neg = _mm512_test_epi32_mask(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u));
  code = _mm512_mask_or_epi32(code, neg, code, _mm512_set1_epi32(QC_E2M1_SIGN_BIT));
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(code, nan, _mm512_set1_epi32(QC_E2M1_NAN_CODE));
}

inline __m512i e4m3_code16(__m512 v) {
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  __m512 a = _mm512_min_ps(_mm512_and_ps(v, absmask), _mm512_set1_ps(QC_E4M3_MAX));
  __m512i sub = _mm512_cvttps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(a, _mm512_set1_ps(512.0f)),
                                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  __m512i u = _mm512_castps_si512(a);
  __m512i e = _mm512_sub_epi32(_mm512_srli_epi32(u, 23), _mm512_set1_epi32(120));
  __m512i m = _mm512_and_si512(_mm512_srli_epi32(u, 20), _mm512_set1_epi32(7));
  __m512i rem = _mm512_and_si512(u, _mm512_set1_epi32(0xFFFFF));
  __mmask16 up = _mm512_cmpgt_epi32_mask(rem, _mm512_set1_epi32(0x80000)) |
                 (_mm512_cmpeq_epi32_mask(rem, _mm512_set1_epi32(0x80000)) &
                  _mm512_test_epi32_mask(m, _mm512_set1_epi32(1)));
  __m512i norm = _mm512_add_epi32(_mm512_slli_epi32(e, 3), m);
  norm = _mm512_mask_add_epi32(norm, up, norm, _mm512_set1_epi32(1));
  __mmask16 is_sub = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.015625f), _CMP_LT_OQ);
  __m512i code = _mm512_mask_mov_epi32(norm, is_sub, sub);
  __mmask16 neg = _mm512_test_epi32_mask(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u));
  code = _mm512_mask_or_epi32(code, neg, code, _mm512_set1_epi32(0x80));
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(code, nan, _mm512_set1_epi32(QC_E4M3_NAN_CODE));
}

// 16 fp4 codes (int32 lanes, element order) -> 8 bytes, element 2i in the low nibble.
inline void store_fp4_16(uint8_t* o, __m512i code) {
  __m128i b = _mm512_cvtepi32_epi8(code);
  __m128i w = _mm_or_si128(_mm_and_si128(b, _mm_set1_epi16(0x0F)), _mm_slli_epi16(_mm_srli_epi16(b, 8), 4));
  _mm_storel_epi64((__m128i*)o, _mm_packus_epi16(w, w));
}
#endif

// E8M0 byte of a block amax (floor or rceil), as mx.e8m0_scale.
inline uint8_t e8m0_byte(float amax, int emax, uint32_t max_mant, int rceil) {
  if (!std::isfinite(amax)) return (uint8_t)QC_E8M0_NAN;
  uint32_t u = bits_of(amax);
  int e = (int)((u >> 23) & 0xFF) - QC_E8M0_BIAS - emax;
  if (rceil) e += (u & 0x7FFFFF) > max_mant ? 1 : 0;
  int hi = rceil ? QC_E8M0_BIAS : QC_E8M0_BIAS + 1;
  e = e < -QC_E8M0_BIAS ? -QC_E8M0_BIAS : e > hi ? hi : e;
  return (uint8_t)(e + QC_E8M0_BIAS);
}

// 2^(127 - b) in fp32 (b = 254: the denormal 2^-127; 0xFF: NaN).
inline float e8m0_multiplier(uint8_t b) {
  if (b == QC_E8M0_NAN) return NAN;
  return b == 254 ? float_of(0x00400000u) : float_of((uint32_t)(254 - b) << 23);
}

// e2m1 code -> twice its value, an integer in [-12, 12] (exact products and block sums)
constexpr int8_t kE2M1x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static_assert(QC_E2M1_SIGN_BIT == 8, "kE2M1x2 puts the sign in bit 3");

// sum of n (16 or 32) products of int8 values in [-12, 12] (exact)
inline int32_t block_dot_i8(const int8_t* x, const int8_t* y, int n) {
#if QC_AVX2
  if (n == 32) {
    __m256i xv = _mm256_loadu_si256((const __m256i*)x), yv = _mm256_loadu_si256((const __m256i*)y);
    __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(xv), _mm256_sign_epi8(yv, xv));  // |pair| <= 288
    return hsum_epi32(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
  }
  if (n == 16) {
    __m128i xv = _mm_loadu_si128((const __m128i*)x), yv = _mm_loadu_si128((const __m128i*)y);
    __m128i s = _mm_madd_epi16(_mm_maddubs_epi16(_mm_abs_epi8(xv), _mm_sign_epi8(yv, xv)), _mm_set1_epi16(1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
  }
#endif
  int32_t isum = 0;
  for (int j = 0; j < n; ++j) isum += (int32_t)x[j] * (int32_t)y[j];
  return isum;
}

}  // namespace

extern "C" {

// x [rows, cols] (fp32 / fp16 / bf16) -> codes [rows, cols/2] (fp4, element 2i in the low nibble)
// or [rows, cols] (E4M3 bytes), scales row-major [rows, cols/blk] or swizzled (padding zeroed).
void qc_mx_quantize(const void* x, int dtype, uint8_t* codes, uint8_t* scales, i64 rows, i64 cols,
                    int fmt, int scale_mode, int swizzled, const float* global_scale, int nt) {
  const float g = global_scale ? *global_scale : 1.0f;
  int blk = fmt == QC_FMT_NVFP4 ? QC_NVFP4_BLOCK : QC_MX_BLOCK;
  bool fp4 = fmt != QC_FMT_MXFP8;
  int emax = fp4 ? QC_EMAX_E2M1 : QC_EMAX_E4M3;
  uint32_t max_mant = fp4 ? QC_MAX_MANTISSA_BITS_E2M1 : QC_MAX_MANTISSA_BITS_E4M3;
  int rceil = scale_mode == QC_SCALE_MODE_RCEIL;
  i64 ncols = cols / blk;
  if (swizzled) {
    i64 pr = (rows + QC_SWIZZLE_ROWS - 1) / QC_SWIZZLE_ROWS * QC_SWIZZLE_ROWS;
    i64 pc = (ncols + QC_SWIZZLE_COLS - 1) / QC_SWIZZLE_COLS * QC_SWIZZLE_COLS;
    std::memset(scales, 0, (size_t)(pr * pc));
  }
#pragma omp parallel for num_threads(threads_for(nt, rows * cols)) schedule(static)
  for (i64 r = 0; r < rows; ++r) {
    for (i64 c = 0; c < ncols; ++c) {
      float v[QC_MX_BLOCK];
      i64 i0 = r * cols + c * blk;
      float amax = 0.0f;
      bool nan = false;
#if QC_AVX2
      for (int j = 0; j < blk; j += 8) _mm256_storeu_ps(v + j, load8(x, dtype, i0 + j));
#else
      for (int j = 0; j < blk; ++j) v[j] = load_as_float(x, dtype, i0 + j);
#endif
      for (int j = 0; j < blk; ++j) {
        float a = std::fabs(v[j]);
        nan |= a != a;
        amax = a > amax ? a : amax;
      }
      if (nan) amax = NAN;  // np.max propagates NaN
      uint8_t sb;
      float mult;
      if (fmt == QC_FMT_NVFP4) {
        float t = amax * QC_NVFP4_INV_E2M1_MAX;
        sb = e4m3_code(g * t);
        float s = e4m3_value(sb);
        mult = s != 0.0f ? g * (1.0f / s) : 0.0f;  // NaN s: NaN
      } else {
        sb = e8m0_byte(amax, emax, max_mant, rceil);
        mult = e8m0_multiplier(sb);
      }
      scales[swizzled ? swizzle_offset(r, c, ncols) : r * ncols + c] = sb;
#if QC_AVX512
      __m512 vm = _mm512_set1_ps(mult);
      for (int j = 0; j < blk; j += 16) {
        __m512 s = _mm512_mul_ps(_mm512_loadu_ps(v + j), vm);
        if (fp4) store_fp4_16(codes + (i0 + j) / 2, e2m1_code16(s));
        else _mm_storeu_si128((__m128i*)(codes + i0 + j), _mm512_cvtepi32_epi8(e4m3_code16(s)));
      }
      continue;
#endif
      if (fp4) {
        uint8_t* o = codes + i0 / 2;
        for (int j = 0; j < blk; j += 2)
          o[j / 2] = (uint8_t)(e2m1_code(v[j] * mult) | (e2m1_code(v[j + 1] * mult) << 4));
      } else {
        for (int j = 0; j < blk; ++j) codes[i0 + j] = e4m3_code(v[j] * mult);
      }
    }
  }
}

// D [M, N] bf16 = alpha * A @ B^T + bias: A [M, K/2], B [N, K/2] packed E2M1, swizzled scales
// (E4M3 for nvfp4, E8M0 for mxfp4). The reference's arithmetic: each block's sum of e2m1 products
// is an exact integer (the codes doubled are integers), the block term isum * sa * sb / 4 is exact
// in fp64, the terms are summed in fp64, then f32(f64(alpha) * acc (+ f64(bias))) -> bf16.
// Scratch (kept per calling thread): the operands' doubled codes as int8 and their scales as fp64.
void qc_scaled_fp4_mm(const uint8_t* a, const uint8_t* b, const uint8_t* sa, const uint8_t* sb,
                      const float* alpha, const uint16_t* bias, uint16_t* out, i64 M, i64 N, i64 K,
                      int fmt, int nt) {
  int blk = fmt == QC_FMT_NVFP4 ? QC_NVFP4_BLOCK : QC_MX_BLOCK;
  i64 nbk = K / blk;
  thread_local std::vector<int8_t> qv;
  thread_local std::vector<double> sv;
  if ((i64)qv.size() < (M + N) * K) qv.resize((size_t)((M + N) * K));
  if ((i64)sv.size() < (M + N) * nbk) sv.resize((size_t)((M + N) * nbk));
  int8_t* qa = qv.data();
  int8_t* qb = qa + M * K;
  double* da = sv.data();
  double* db = da + M * nbk;
  auto unpack = [&](const uint8_t* p, const uint8_t* s, i64 rows, int8_t* q, double* d) {
#pragma omp parallel for num_threads(threads_for(nt, rows * K)) schedule(static)
    for (i64 r = 0; r < rows; ++r) {
      for (i64 j = 0; j < K / 2; ++j) {
        uint8_t byte = p[r * (K / 2) + j];
        q[r * K + 2 * j] = kE2M1x2[byte & 0x0F];
        q[r * K + 2 * j + 1] = kE2M1x2[byte >> 4];
      }
      for (i64 c = 0; c < nbk; ++c) {
        uint8_t v = s[swizzle_offset(r, c, nbk)];
        d[r * nbk + c] = fmt == QC_FMT_NVFP4 ? (double)e4m3_value(v) : (double)e8m0_value(v);
      }
    }
  };
  unpack(a, sa, M, qa, da);
  unpack(b, sb, N, qb, db);
  double al = (double)*alpha;
#pragma omp parallel for collapse(2) num_threads(threads_for(nt, M * N * K)) schedule(static)
  for (i64 m = 0; m < M; ++m) {
    for (i64 n = 0; n < N; ++n) {
      const int8_t* x = qa + m * K;
      const int8_t* y = qb + n * K;
      double acc = 0.0;
      for (i64 c = 0; c < nbk; ++c) {
        int32_t isum = block_dot_i8(x + c * blk, y + c * blk, blk);
        acc += (double)isum * (da[m * nbk + c] * db[n * nbk + c]) * 0.25;
      }
      double d = al * acc;
      if (bias) d = d + (double)bf16_to_float(bias[n]);  // bf16 -> fp32 is exact
      out[m * N + n] = float_to_bf16((float)d);
    }
  }
}

}  // extern "C"
