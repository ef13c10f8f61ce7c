// Common definitions of quantcore's MetaX MACA kernels: wave width, lane masks, shuffles,
// dtype loads and stores with the reference's rounding, and the launcher conventions.
//
// Every format constant comes from quantcore_constants.h, which the backend generates from the
// Python core into its build folder (-I<build folder>); no table is spelled here.
#pragma once

#include <stdint.h>
#include <string.h>

#include <mc_runtime.h>
#include <maca_fp16.h>
#include <maca_bfloat16.h>

#include "quantcore_constants.h"

// ---- wave width ---------------------------------------------------------------------------
// The one constant every kernel takes the wave width from. MetaX waves are 64 lanes and take
// 64-bit lane masks; a 32-bit mask on a 64-lane wave silently drops the upper half. The CUDA
// compatibility build (compat/maca_compat.h defines QC_MACA_COMPAT) uses the NVIDIA warp of 32.
// The backend checks this value against the device's reported wave size when it loads the
// library (qc_maca_wave_size below).
#if defined(QC_MACA_COMPAT)
#if defined(__MACA__)
#error "the CUDA compatibility header must not be used when compiling with mxcc"
#endif
#define QC_WAVE_SIZE 32
typedef unsigned int qc_lane_mask_t;
#else
#define QC_WAVE_SIZE 64
typedef unsigned long long qc_lane_mask_t;
#endif
#define QC_FULL_MASK (~(qc_lane_mask_t)0)

// Threads per CTA of every kernel: a whole number of waves for both 32 and 64 lanes.
#define QC_THREADS 256
#define QC_WAVES (QC_THREADS / QC_WAVE_SIZE)
static_assert(QC_THREADS % QC_WAVE_SIZE == 0, "a CTA must hold whole waves");
static_assert(QC_WAVE_SIZE >= QC_QK, "a ggml block of QC_QK lanes must fit in one wave");

// Grid-stride kernels launch at most this many CTAs.
#define QC_MAX_GRID 65535

// ---- shuffles (all lanes of the wave take part; width 1..QC_WAVE_SIZE) ------------------------
template <typename V>
__device__ __forceinline__ V qc_shfl_xor(V v, int lane_mask) {
  return __shfl_xor_sync(QC_FULL_MASK, v, lane_mask, QC_WAVE_SIZE);
}

// fp64 travels as two 32-bit halves, so only 32-bit shuffles are needed.
__device__ __forceinline__ double qc_shfl_xor(double v, int lane_mask) {
  const long long bits = __double_as_longlong(v);
  const int lo = qc_shfl_xor((int)(bits & 0xffffffffLL), lane_mask);
  const int hi = qc_shfl_xor((int)(bits >> 32), lane_mask);
  return __longlong_as_double(((long long)hi << 32) | (long long)(unsigned)lo);
}

template <typename V>
__device__ __forceinline__ V qc_shfl(V v, int src_lane, int width) {
  return __shfl_sync(QC_FULL_MASK, v, src_lane, width);
}

template <typename V>
__device__ __forceinline__ V qc_shfl_down(V v, int delta, int width) {
  return __shfl_down_sync(QC_FULL_MASK, v, delta, width);
}

// NaN-ignoring max over aligned groups of `width` lanes (a power of two <= QC_WAVE_SIZE):
// fmaxf returns the other operand when one is NaN, as numpy's fmax does.
__device__ __forceinline__ float qc_group_fmax(float v, int width) {
  for (int o = width >> 1; o > 0; o >>= 1) v = fmaxf(v, qc_shfl_xor(v, o));
  return v;
}

__device__ __forceinline__ float qc_wave_sum(float v) {
#pragma unroll
  for (int o = 1; o < QC_WAVE_SIZE; o <<= 1) v += qc_shfl_xor(v, o);
  return v;
}

// ---- dtype codes (quantcore.formats.kernel_defines.DTYPE_CODE) and element I/O ---------------
__device__ __forceinline__ float qc_to_float(float v) { return v; }
__device__ __forceinline__ float qc_to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float qc_to_float(maca_bfloat16 v) { return __bfloat162float(v); }

// fp32 -> bf16 bits, round to nearest even; NaN keeps its sign and becomes the quiet NaN
// 0x7fc0 / 0xffc0, as ml_dtypes (the reference's bfloat16) converts it.
__device__ __forceinline__ uint16_t qc_bf16_bits_rn(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)(((u >> 16) & 0x8000u) | 0x7fc0u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

// fp32 -> fp16 bits, round to nearest even, in integer arithmetic; NaN keeps its sign and the top
// 10 payload bits (at least one set), as numpy converts it. Integer code on purpose: with nvcc
// 13.0 on sm_90, a byte store of the 16-bit register holding a __float2half_rn result wrote 0
// instead of the low byte (measured on the ggml d fields), and the bytes of a block must be exact.
__host__ __device__ __forceinline__ uint32_t qc_half_bits_rn(float f) {
  uint32_t x;
  memcpy(&x, &f, sizeof(x));
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) {  // Inf, NaN
    const uint32_t payload = (ax & 0x7fffffu) >> 13;
    return sign | 0x7c00u | (ax == 0x7f800000u ? 0u : (payload ? payload : 1u));
  }
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to Inf
  if (ax >= 0x38800000u) {                        // normal fp16: rebias, round 13 bits away
    const uint32_t r = ax - 0x38000000u;
    return sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13);
  }
  if (ax < 0x33000000u) return sign;  // below half the smallest subnormal: zero
  const uint32_t shift = 126u - (ax >> 23);  // fp16 subnormal: units of 2^-24
  const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
  const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  uint32_t q = m >> shift;
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return sign | q;
}

__device__ __forceinline__ float qc_half_bits_to_float(uint16_t bits) {
  __half h;
  memcpy(&h, &bits, sizeof(bits));
  return __half2float(h);
}

__device__ __forceinline__ void qc_store(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void qc_store(__half* p, long long i, float v) {
  reinterpret_cast<uint16_t*>(p)[i] = (uint16_t)qc_half_bits_rn(v);
}
__device__ __forceinline__ void qc_store(maca_bfloat16* p, long long i, float v) {
  reinterpret_cast<uint16_t*>(p)[i] = qc_bf16_bits_rn(v);
}

// Correctly rounded fp32 reciprocal (the reference's F32(1) / x; never an approximate rcp).
__device__ __forceinline__ float qc_rcp_rn(float x) { return __fdiv_rn(1.0f, x); }

// ---- launchers -------------------------------------------------------------------------------
// Every launcher is `extern "C" int qc_maca_<op>(..., mcStream_t stream)`, launches on the
// caller's stream and returns the mcError_t as an int (0 = success).
#define QC_EXPORT extern "C" __attribute__((visibility("default")))

// Every launcher's declaration, generated from quantcore/formats/kernel_interface.py (the one
// declaration of the kernel interface): a launcher that disagrees with it does not compile.
QC_MACA_PROTOTYPES

// Sizes arrive as long long (the interface's i64); the kernels that index in int refuse larger ones.
inline bool qc_fits_int(long long a, long long b, long long c) {
  return a <= 2147483647LL && b <= 2147483647LL && c <= 2147483647LL;
}

// A launcher first clears an error left by earlier work of this runtime, so that the status it
// returns belongs to its own launch.
#define QC_CLEAR_LAST_ERROR() ((void)mcGetLastError())
#define QC_RETURN_LAUNCH_STATUS() return (int)mcGetLastError()

// Calls `fn<T>(...)` for the element type of a DTYPE_CODE; an unknown code returns
// mcErrorInvalidValue from the enclosing launcher.
#define QC_DISPATCH_DTYPE(code, FN, ...)                                     \
  switch (code) {                                                            \
    case QC_DTYPE_F32: FN<float>(__VA_ARGS__); break;                        \
    case QC_DTYPE_F16: FN<__half>(__VA_ARGS__); break;                       \
    case QC_DTYPE_BF16: FN<maca_bfloat16>(__VA_ARGS__); break;               \
    default: return (int)mcErrorInvalidValue;                                \
  }

__host__ __device__ __forceinline__ long long qc_ceil_div(long long a, long long b) {
  return (a + b - 1) / b;
}
static inline unsigned qc_grid(long long work_items, long long per_cta) {
  long long g = qc_ceil_div(work_items, per_cta);
  return (unsigned)(g < 1 ? 1 : (g > QC_MAX_GRID ? QC_MAX_GRID : g));
}

// ---- blockwise absmax ------------------------------------------------------------------------
// NaN-ignoring max over a group of `group` consecutive threads of the CTA (a power of two, at
// most QC_THREADS): within a wave by shuffles, across waves through `s_part` (QC_WAVES floats).
// Every thread of the CTA must call it (it may synchronize).
__device__ __forceinline__ float qc_group_absmax(float m, int group, float* s_part) {
  const int width = group < QC_WAVE_SIZE ? group : QC_WAVE_SIZE;
  m = qc_group_fmax(m, width);
  if (group <= QC_WAVE_SIZE) return m;
  const int wave = threadIdx.x / QC_WAVE_SIZE;
  if (threadIdx.x % QC_WAVE_SIZE == 0) s_part[wave] = m;
  __syncthreads();
  const int waves_per_group = group / QC_WAVE_SIZE;
  const int first = (threadIdx.x / group) * waves_per_group;
  m = s_part[first];
  for (int w = 1; w < waves_per_group; ++w) m = fmaxf(m, s_part[first + w]);
  return m;
}

// The identity of fmaxf: max(NaN, x) = x, so an all-NaN block stays NaN as in the reference.
__device__ __forceinline__ float qc_fmax_identity() { return __int_as_float(0x7fffffff); }
