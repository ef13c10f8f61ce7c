// ggml block formats on SYCL: Q4_0 / Q8_0 / Q8_1 quantize and dequantize (ggml's `_ref` rules,
// bit for bit), and the W4A8 GEMMs: Q4_0 weights times Q8_1 activations, given quantized or
// quantized on the fly inside the kernel (no Q8_1 buffer in device memory).
//
// Plain SYCL 2020 bodies; entry_points.cpp wraps them.
#pragma once

#include "qc_common.hpp"

namespace qc {

// ---------------------------------------------------------------------------------------------
// Quantize one 32-value block. Blocks of a row-major [R, K] array (K % 32 == 0) are the
// consecutive 32-value slices of the flattened array, so every op here works on flat blocks.
template <typename T>
void quantize_q4_0_block(const T *x, uint8_t *dst) {
  // max = the signed value of the first element of largest |x|; NaN never wins; a block without
  // a nonzero number gives +0.0 (the reference's rule, llama.cpp's: x[0] may be -0.0).
  float amax = kNoMagnitude, maxv = 0.0f;
  for (int j = 0; j < kQK; ++j) {
    const float v = Elem<T>::load(x, j);
    const float m = sycl::fabs(v);
    if (m > amax) {
      amax = m;
      maxv = v;
    }
  }
  if (!(amax > 0.0f)) maxv = 0.0f;
  const float d = maxv / static_cast<float>(-kQ4Offset);
  const float id = d != 0.0f ? recip_rn(d) : 0.0f;
  store_half_le(dst, d);
  for (int j = 0; j < kQ40HalfBlock; ++j) {
    // f32(x * id) + 8.5 with two roundings, then C truncation, capped at 15.
    const float s0 = Elem<T>::load(x, j) * id;
    const float s1 = Elem<T>::load(x, j + kQ40HalfBlock) * id;
    const int q0 = sycl::min(15, trunc_saturate(s0 + kQ4RoundBias, -128, 127));
    const int q1 = sycl::min(15, trunc_saturate(s1 + kQ4RoundBias, -128, 127));
    dst[kQ40QsOffset + j] = static_cast<uint8_t>((q0 & 0x0f) | ((q1 & 0x0f) << 4));
  }
}

// Q8 scale and codes of one block: d = amax / 127, q = roundf(x * (1/d)); returns sum(q).
template <typename Load>
int q8_block(const Load &load, float &d, int8_t *q) {
  float amax = 0.0f; // fmaxf semantics: NaN ignored, all-NaN -> 0
  for (int j = 0; j < kQK; ++j) amax = sycl::fmax(amax, sycl::fabs(load(j)));
  d = amax / static_cast<float>(kQ8Max);
  const float id = d != 0.0f ? recip_rn(d) : 0.0f;
  int sum = 0;
  for (int j = 0; j < kQK; ++j) {
    const int v = round_q8(load(j) * id);
    q[j] = static_cast<int8_t>(v);
    sum += v;
  }
  return sum;
}

// s = fp16(f32(sum q) * d): the reference form (not ggml CUDA's fp16(sum x)).
inline float q8_1_sum(int sum, float d) { return static_cast<float>(sum) * d; }

template <typename T>
void quantize_q8_block(const T *x, uint8_t *dst, bool with_sum) {
  float d;
  int8_t q[kQK];
  const int sum = q8_block([&](int j) { return Elem<T>::load(x, j); }, d, q);
  store_half_le(dst, d);
  const int qs = with_sum ? kQ81QsOffset : kQ80QsOffset;
  if (with_sum) {
    // s is NaN only for a block holding an infinity: the core pins that NaN's fp16 bits
    const float s = q8_1_sum(sum, d);
    if (sycl::isnan(s)) {
      dst[kQ81SumOffset] = static_cast<uint8_t>(QC_Q8_1_NAN_S_BITS & 0xff);
      dst[kQ81SumOffset + 1] = static_cast<uint8_t>(QC_Q8_1_NAN_S_BITS >> 8);
    } else {
      store_half_le(dst + kQ81SumOffset, s);
    }
  }
  for (int j = 0; j < kQK; ++j) dst[qs + j] = sycl::bit_cast<uint8_t>(q[j]);
}

// ---------------------------------------------------------------------------------------------
// Dequantize one block into 32 values of T: Q4_0 (q - 8) * d, Q8 q * d, one fp32 rounding each.
template <typename T>
void dequantize_q4_0_block(const uint8_t *src, T *out) {
  const float d = load_half_le(src);
  for (int j = 0; j < kQ40HalfBlock; ++j) {
    const uint8_t byte = src[kQ40QsOffset + j];
    Elem<T>::store(out, j, static_cast<float>(static_cast<int>(byte & 0x0f) - kQ4Offset) * d);
    Elem<T>::store(out, j + kQ40HalfBlock, static_cast<float>(static_cast<int>(byte >> 4) - kQ4Offset) * d);
  }
}

template <typename T>
void dequantize_q8_block(const uint8_t *src, int qs_offset, T *out) {
  const float d = load_half_le(src);
  for (int j = 0; j < kQK; ++j)
    Elem<T>::store(out, j, static_cast<float>(sycl::bit_cast<int8_t>(src[qs_offset + j])) * d);
}

// ---------------------------------------------------------------------------------------------
// W4A8 GEMM: out[m, n] = sum_b d4[m,b] * (d8[n,b] * sum_j q4[m,b,j] * q8[n,b,j] - 8 * s8[n,b]),
// integer dot products, fp32 accumulation, out fp32 [M, N] row-major.
// One sub-group per weight row m (QC_GEMM_ROWS_PER_WG rows per work-group), one lane per
// 32-value block, up to QC_MAX_BATCH activation rows per work-group. The activation blocks of
// a chunk of `lanes` blocks are staged in local memory first: copied from Q8_1 blocks, or
// quantized from the float activation with quantize_q8_1's exact rule, so both entry points do
// the same arithmetic and gemm_w4a8(a) equals gemm_q4_0_q8_1(quantize_q8_1(a)) bit for bit.
struct Q81Stage {  // local memory, [QC_MAX_BATCH][QC_SUBGROUP_SIZE] blocks
  int8_t *q;       // [.. * kQK]
  float *d;
  float *s;
};

template <bool ON_THE_FLY, typename T>
void gemm_w4a8(const sycl::nd_item<1> &it, const Q81Stage &stage, const uint8_t *wq,
               const uint8_t *aq, const T *a, float *out, int64_t m_rows, int64_t n_cols,
               int64_t k) {
  const sycl::sub_group sg = it.get_sub_group();
  const int lane = static_cast<int>(sg.get_local_linear_id());
  const int lanes = static_cast<int>(sg.get_local_linear_range()); // == QC_SUBGROUP_SIZE
  const int lid = static_cast<int>(it.get_local_id(0));
  const int wg = static_cast<int>(it.get_local_range(0));
  const int64_t kb_total = k / kQK;
  const int64_t row_groups = (m_rows + sg.get_group_linear_range() - 1) / sg.get_group_linear_range();
  const int64_t group = static_cast<int64_t>(it.get_group(0));
  const int64_t row = (group % row_groups) * sg.get_group_linear_range() + sg.get_group_linear_id();
  const int64_t n0 = (group / row_groups) * QC_MAX_BATCH;
  const int ncols = static_cast<int>(sycl::min<int64_t>(QC_MAX_BATCH, n_cols - n0));
  const bool active = row < m_rows; // uniform over the sub-group

  float acc[QC_MAX_BATCH];
  for (int c = 0; c < QC_MAX_BATCH; ++c) acc[c] = 0.0f;

  for (int64_t kb0 = 0; kb0 < kb_total; kb0 += lanes) {
    const int chunk = static_cast<int>(sycl::min<int64_t>(lanes, kb_total - kb0));
    for (int t = lid; t < ncols * chunk; t += wg) {
      const int c = t / chunk, j = t % chunk;
      const int slot = c * QC_SUBGROUP_SIZE + j;
      const int64_t blk = (n0 + c) * kb_total + kb0 + j;
      if constexpr (ON_THE_FLY) {
        const T *src = a + blk * kQK;
        float d;
        const int sum = q8_block([&](int i) { return Elem<T>::load(src, i); }, d, stage.q + slot * kQK);
        // Round d and s through fp16 exactly as the Q8_1 bytes would hold them.
        stage.d[slot] = static_cast<float>(static_cast<half>(d));
        stage.s[slot] = static_cast<float>(static_cast<half>(q8_1_sum(sum, d)));
      } else {
        const uint8_t *src = aq + blk * kQ81Bytes;
        stage.d[slot] = load_half_le(src);
        stage.s[slot] = load_half_le(src + kQ81SumOffset);
        for (int i = 0; i < kQK; ++i)
          stage.q[slot * kQK + i] = sycl::bit_cast<int8_t>(src[kQ81QsOffset + i]);
      }
    }
    sycl::group_barrier(it.get_group());
    if (active && lane < chunk) {
      const uint8_t *w = wq + (row * kb_total + kb0 + lane) * kQ40Bytes;
      const float d4 = load_half_le(w);
      int q4[kQK];
      for (int j = 0; j < kQ40HalfBlock; ++j) {
        q4[j] = w[kQ40QsOffset + j] & 0x0f;
        q4[j + kQ40HalfBlock] = w[kQ40QsOffset + j] >> 4;
      }
      for (int c = 0; c < QC_MAX_BATCH; ++c) {
        if (c >= ncols) break;
        const int slot = c * QC_SUBGROUP_SIZE + lane;
        const int8_t *q8 = stage.q + slot * kQK;
        int sumi = 0;
        for (int j = 0; j < kQK; ++j) sumi += q4[j] * static_cast<int>(q8[j]);
        const float inner = stage.d[slot] * static_cast<float>(sumi) -
                            static_cast<float>(kQ4Offset) * stage.s[slot];
        acc[c] = sycl::fma(d4, inner, acc[c]);
      }
    }
    sycl::group_barrier(it.get_group());
  }
  for (int c = 0; c < QC_MAX_BATCH; ++c) {
    if (c >= ncols) break;
    const float total = sycl::reduce_over_group(sg, acc[c], sycl::plus<float>());
    if (active && lane == 0) out[row * n_cols + n0 + c] = total;
  }
}

} // namespace qc
