// ggml block quantizers shared by the quantize kernels and the fused W4A8 GEMM, so that the
// GEMM's in-kernel Q8_1 activation is exactly what qc_maca_quantize_q8_1 writes.
//
// A ggml block of QC_QK elements is quantized by QC_QK consecutive lanes of one wave (lane j
// holds element j); every lane of the wave must call these functions (they shuffle). Bit for bit
// with quantcore.formats.ggml (ggml's _ref C functions, no FMA contraction).
#pragma once

#include "qc_maca.h"

// C float-to-int truncation with a GPU's behaviour off range: NaN -> 0, saturate to [lo, hi].
__device__ __forceinline__ int qc_trunc_sat(float v, int lo, int hi) {
  if (!isfinite(v)) return 0;  // NaN and +-inf -> 0, as ggml's C reference on x86 and gguf-py
  if (v <= (float)lo) return lo;
  if (v >= (float)hi) return hi;
  return (int)v;
}

// C roundf (half away from zero), exact through fp64; NaN and +-inf -> 0 (ggml's C reference on
// x86, gguf-py), then clamped to int8.
__device__ __forceinline__ int qc_round_q8(float v) {
  if (!isfinite(v)) return 0;
  const double a = floor(fabs((double)v) + 0.5);
  double r = v < 0.0f ? -a : a;
  r = r < -128.0 ? -128.0 : (r > 127.0 ? 127.0 : r);
  return (int)r;
}

// Q4_0: the signed value of the first element of largest |x| (NaN skipped; +0.0 when no element is
// a nonzero number), d = max / -8,
// id = 1/d (0 if d == 0), q = min(15, trunc(f32(x * id) + 8.5)); returns q as the uint8 the
// reference stores (a saturated negative wraps) and d in fp32.
__device__ __forceinline__ uint32_t qc_q4_0_lane(float x, int j, float* d_out) {
  float best = fabsf(x);
  if (best != best) best = -1.0f;
  int best_j = j;
#pragma unroll
  for (int o = QC_QK / 2; o > 0; o >>= 1) {
    const float other = qc_shfl_xor(best, o);
    const int other_j = qc_shfl_xor(best_j, o);
    if (other > best || (other == best && other_j < best_j)) {
      best = other;
      best_j = other_j;
    }
  }
  float mx = qc_shfl(x, best_j, QC_QK);
  if (!(best > 0.0f)) mx = 0.0f;  // NaN or zero only: +0.0 as llama.cpp (x[0] may be -0.0)
  const float d = __fdiv_rn(mx, -(float)QC_Q4_0_OFFSET);
  const float id = d != 0.0f ? qc_rcp_rn(d) : 0.0f;
  const float biased = __fadd_rn(__fmul_rn(x, id), QC_Q4_0_ROUND_BIAS);
  int q = qc_trunc_sat(biased, -128, 127);
  q = q < 15 ? q : 15;
  *d_out = d;
  return (uint32_t)(uint8_t)q;
}

// Q8_0 / Q8_1: amax = NaN-ignoring max |x| (all NaN -> 0), d = amax / 127, id = 1/d (0 if
// d == 0), q = roundf(x * id); *sum_out = sum of q over the block (for Q8_1's s).
__device__ __forceinline__ int qc_q8_lane(float x, float* d_out, int* sum_out) {
  float amax = qc_group_fmax(fabsf(x), QC_QK);
  if (amax != amax) amax = 0.0f;
  const float d = __fdiv_rn(amax, (float)QC_Q8_MAX);
  const float id = d != 0.0f ? qc_rcp_rn(d) : 0.0f;
  const int q = qc_round_q8(__fmul_rn(x, id));
  int sum = q;
#pragma unroll
  for (int o = QC_QK / 2; o > 0; o >>= 1) sum += qc_shfl_xor(sum, o);
  *d_out = d;
  *sum_out = sum;
  return q;
}

// Q8_1's s is NaN only when d = inf (an infinite input): every q is then 0 and s = 0 * inf. The
// core pins its fp16 bits (QC_Q8_1_NAN_S_BITS, from quantcore_constants.h), since a GPU multiply
// returns its own canonical NaN and s is a byte field of the block.

// Q8_1's s = fp16(f32(sum q) * d), as fp16 bits.
__device__ __forceinline__ uint32_t qc_q8_1_s_bits(int sum, float d) {
  const float s = __fmul_rn((float)sum, d);
  return s != s ? (uint32_t)QC_Q8_1_NAN_S_BITS : qc_half_bits_rn(s);
}

// Little-endian fp16 bits at p (blocks are byte arrays with no alignment promise).
__device__ __forceinline__ float qc_load_half_le(const uint8_t* p) {
  return qc_half_bits_to_float((uint16_t)(p[0] | (p[1] << 8)));
}
__device__ __forceinline__ void qc_store_half_bits_le(uint8_t* p, uint32_t bits) {
  p[0] = (uint8_t)(bits & 0xffu);
  p[1] = (uint8_t)((bits >> 8) & 0xffu);
}
