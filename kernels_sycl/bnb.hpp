// bitsandbytes formats on SYCL: blockwise dequantize (port of bitsandbytes' kDequantizeBlockwise
// for General8bit, FP4 and NF4), 4-bit gemv (port of kgemv_4bit_inference), and the quantizers
// bitsandbytes has no SYCL version of (4-bit, 8-bit, double quantization).
//
// Kernel bodies are plain SYCL 2020 functions of an nd_item and their arguments; the work-group
// local tables are allocated by the caller (entry_points.cpp) and passed in as pointers.
#pragma once

#include "qc_common.hpp"

namespace qc {

// The statistics of a 4-bit or 8-bit weight: plain fp32 absmax, or (double quantization) uint8
// codes of the centered absmax decoded in the kernel as code2[q] * absmax2[b / 256] + offset.
struct Absmax {
  const float *absmax;   // fp32 [nblocks], or nullptr when nested
  const uint8_t *qabsmax; // nested: uint8 [nblocks]
  const float *absmax2;  // nested: fp32 [ceil(nblocks / 256)]
  const float *code2;    // nested: fp32 [256]
  const float *offset;   // nested: fp32 [1]

  float operator()(int64_t block) const {
    if (absmax != nullptr) return absmax[block];
    // Two roundings, never one FMA (contraction is off for this file): the reference's order.
    const float scaled = code2[qabsmax[block]] * absmax2[block >> kNestedBlockShift];
    return scaled + offset[0];
  }
};

// ---------------------------------------------------------------------------------------------
// Blockwise dequantize. As in bitsandbytes' kernel, each work-item takes
// QC_DEQUANT_BYTES_PER_ITEM consecutive bytes (8 values at 4 bits, 4 at 8 bits, always inside one
// block since blocks hold >= 32 values) and a work-group of QC_DEQUANT_WG items covers one tile;
// the launch has one work-item per BYTES_PER_ITEM bytes (a grid-stride loop measured 2x slower on
// the OpenCL CPU device). `code` is the decode table in work-group local memory (16 or 256 entries).
template <typename T, int BITS>
void dequantize_blockwise(const sycl::nd_item<1> &it, const float *code, const uint8_t *q,
                          const Absmax &absmax, T *out, int64_t n, int64_t blocksize) {
  static_assert(BITS == 4 || BITS == 8, "4-bit or 8-bit codes");
  constexpr int kPerByte = 8 / BITS;
  constexpr int kBytes = QC_DEQUANT_BYTES_PER_ITEM;
  constexpr int kValues = kBytes * kPerByte;
  const int64_t nbytes = (n + kPerByte - 1) / kPerByte;
  const int64_t byte0 = static_cast<int64_t>(it.get_global_id(0)) * kBytes;
  if (byte0 >= nbytes) return;
  const int64_t first = byte0 * kPerByte;
  const float scale = absmax(first >> log2_pow2(blocksize));
  float vals[kValues];
  for (int j = 0; j < kBytes; ++j) {
    const uint8_t byte = (byte0 + j < nbytes) ? q[byte0 + j] : 0;
    if constexpr (BITS == 4) {
      vals[2 * j] = code[byte >> 4] * scale; // element 2i: high nibble (bitsandbytes' packing)
      vals[2 * j + 1] = code[byte & 0x0f] * scale;
    } else {
      vals[j] = code[byte] * scale;
    }
  }
  if (first + kValues <= n) {
    for (int j = 0; j < kValues; ++j) Elem<T>::store(out, first + j, vals[j]);
  } else {
    for (int j = 0; j < kValues; ++j)
      if (first + j < n) Elem<T>::store(out, first + j, vals[j]);
  }
}

// ---------------------------------------------------------------------------------------------
// Blockwise quantize (4-bit NF4 / FP4 and 8-bit with a sorted threshold table). A block of
// `blocksize` values is spread over blocksize / values_per_item consecutive work-items of one
// work-group (a power of two, at most the work-group); they reduce the block's NaN-ignoring
// absmax through local memory with a tree of barriers, then each quantizes its own values with
// the correctly rounded reciprocal. `scratch` is local memory of one float per work-item. The
// launch has exactly ceil(nblocks / blocks_per_group) work-groups.
//
// Load: a functor (int64 index) -> float giving the block's input values (already fp32).
struct QuantizeGeometry {
  int64_t n;                // number of values
  int64_t blocksize;        // values per block (power of two)
  int64_t values_per_item;  // consecutive values of one work-item (power of two, even)
};

template <int BITS, typename Load>
void quantize_blockwise(const sycl::nd_item<1> &it, float *scratch, const Load &load,
                        const QuantizeGeometry &g, int quant_type, const float *thresholds,
                        uint8_t *out, float *absmax_out) {
  static_assert(BITS == 4 || BITS == 8, "4-bit or 8-bit codes");
  const int lid = static_cast<int>(it.get_local_id(0));
  const int64_t per_item = g.values_per_item;
  const int items_per_block = static_cast<int>(g.blocksize / per_item);
  const int blocks_per_group = static_cast<int>(it.get_local_range(0)) / items_per_block;
  const int64_t nblocks = (g.n + g.blocksize - 1) / g.blocksize;
  const int64_t block = static_cast<int64_t>(it.get_group(0)) * blocks_per_group + lid / items_per_block;
  const int64_t first = block * g.blocksize + static_cast<int64_t>(lid % items_per_block) * per_item;

  // The reference pads the last block with zeros and takes the padding into its max, so a
  // partial block of NaNs has absmax 0, not NaN. Work-items past the last block hold -1.
  float mag = kNoMagnitude;
  if (block < nblocks)
    for (int64_t j = 0; j < per_item; ++j)
      mag = fold_magnitude(mag, first + j < g.n ? load(first + j) : 0.0f);
  scratch[lid] = mag;
  sycl::group_barrier(it.get_group());
  for (int s = 1; s < items_per_block; s <<= 1) {
    if ((lid & (2 * s - 1)) == 0) scratch[lid] = sycl::fmax(scratch[lid], scratch[lid + s]);
    sycl::group_barrier(it.get_group());
  }
  if (block >= nblocks) return; // after the last barrier
  const float amax = finish_magnitude(scratch[lid - lid % items_per_block]);
  if (lid % items_per_block == 0) absmax_out[block] = amax;

  const float r = recip_rn(amax); // 0 -> inf, and 0 * inf = NaN -> code 0, as the reference
  if constexpr (BITS == 4) {
    // A value past n quantizes as 0.0 (the odd element's partner nibble); nothing is written
    // past the last byte.
    for (int64_t j = 0; j < per_item; j += 2) {
      const int64_t e = first + j;
      if (e >= g.n) break;
      const float hi = load(e) * r;
      const float lo = (e + 1 < g.n ? load(e + 1) : 0.0f) * r;
      out[e >> 1] = static_cast<uint8_t>((quantize_4bit_code(hi, quant_type) << 4) |
                                         quantize_4bit_code(lo, quant_type));
    }
  } else {
    for (int64_t j = 0; j < per_item; ++j) {
      const int64_t e = first + j;
      if (e >= g.n) break;
      out[e] = static_cast<uint8_t>(count_below(thresholds, kCodes8Bit - 1, load(e) * r));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Double quantization, step 1: offset = f32(pairwise_sum_f64(absmax) / nblocks), the exact tree
// of quantcore.formats.bnb.pairwise_sum_f64 (zero padded to a power of two, level by level).
// One work-group: each work-item sums an aligned power-of-two chunk with the same tree (a
// stack of partial sums), then the chunk sums meet in a tree in local memory. Needs fp64.
inline constexpr int kMaxTreeDepth = 64;

inline void absmax_mean(const sycl::nd_item<1> &it, double *partial, const float *absmax,
                        int64_t nblocks, float *offset) {
  const int lid = static_cast<int>(it.get_local_id(0));
  const int wg = static_cast<int>(it.get_local_range(0)); // a power of two
  int64_t leaves = 1;
  while (leaves < nblocks) leaves <<= 1;
  const int64_t chunk = leaves > wg ? leaves / wg : 1;

  double stack[kMaxTreeDepth];
  int depth = 0;
  const int64_t first = static_cast<int64_t>(lid) * chunk;
  for (int64_t i = 0; i < chunk; ++i) {
    double v = (first + i < nblocks) ? static_cast<double>(absmax[first + i]) : 0.0;
    // Leaf i closes one subtree per trailing one bit of i + 1 (sum left + right, as the tree).
    for (int64_t closed = i + 1; (closed & 1) == 0; closed >>= 1) v = stack[--depth] + v;
    stack[depth++] = v;
  }
  partial[lid] = depth > 0 ? stack[0] : 0.0;
  sycl::group_barrier(it.get_group());
  for (int s = 1; s < wg; s <<= 1) {
    if ((lid & (2 * s - 1)) == 0) partial[lid] = partial[lid] + partial[lid + s];
    sycl::group_barrier(it.get_group());
  }
  if (lid == 0) offset[0] = static_cast<float>(partial[0] / static_cast<double>(nblocks));
}

// ---------------------------------------------------------------------------------------------
// gemv_4bit (port of bitsandbytes' kgemv_4bit_inference): out[b, row] = sum_k A[b, k] * W[row, k]
// for the 4-bit weight W [N, K] stored row-major as bitsandbytes packs it. One sub-group per
// weight row (QC_GEMV_ROWS_PER_WG rows per work-group), each lane takes 32 values (16 bytes) per
// step, the 16-entry decode table sits in local memory, and the sub-group reduces the fp32 sums.
// Unlike bitsandbytes, the weight is decoded in fp32 (code * absmax) and the products are fp32,
// and up to QC_MAX_BATCH rows of A share one read of the weight. When K is not a multiple of 32
// a row may start inside a byte or a block, so a per-value path handles it.
// This sub-group's row `row` of the weight (nrows rows; none when row >= nrows): out[b * ldo + row]
// for the input rows b (the grouped gemv writes each weight's block of columns of a wider output).
template <typename T>
void gemv_4bit_row(const sycl::nd_item<1> &it, const float *code, const T *a, const uint8_t *packed,
                   const Absmax &absmax, T *out, int64_t ldo, int64_t batch, int64_t row, int64_t nrows,
                   int64_t k, int64_t blocksize) {
  constexpr int kLaneValues = QC_GEMV_VALUES_PER_LANE;
  constexpr int kLaneBytes = kLaneValues / 2;
  const sycl::sub_group sg = it.get_sub_group();
  const int lane = static_cast<int>(sg.get_local_linear_id());
  const int lanes = static_cast<int>(sg.get_local_linear_range());
  const bool active = row < nrows; // uniform over the sub-group
  const int shift = log2_pow2(blocksize);
  const int64_t row_first = row * k; // index of W[row, 0] in the flattened weight

  for (int64_t b0 = 0; b0 < batch; b0 += QC_MAX_BATCH) {
    const int64_t nb = sycl::min<int64_t>(QC_MAX_BATCH, batch - b0);
    float acc[QC_MAX_BATCH];
    for (int b = 0; b < QC_MAX_BATCH; ++b) acc[b] = 0.0f;
    const T *a0 = a + b0 * k;

    if (active && k % kLaneValues == 0) {
      for (int64_t kk = static_cast<int64_t>(lane) * kLaneValues; kk < k;
           kk += static_cast<int64_t>(lanes) * kLaneValues) {
        const int64_t e = row_first + kk; // even, 32-aligned: whole bytes, one absmax block
        const float scale = absmax(e >> shift);
        uint8_t bytes[kLaneBytes];
        for (int j = 0; j < kLaneBytes; ++j) bytes[j] = packed[(e >> 1) + j];
        float w[kLaneValues];
        for (int j = 0; j < kLaneBytes; ++j) {
          w[2 * j] = code[bytes[j] >> 4] * scale;
          w[2 * j + 1] = code[bytes[j] & 0x0f] * scale;
        }
        for (int b = 0; b < QC_MAX_BATCH; ++b) {
          if (b >= nb) break;
          float s = acc[b];
          for (int j = 0; j < kLaneValues; ++j)
            s = sycl::fma(Elem<T>::load(a0, b * k + kk + j), w[j], s);
          acc[b] = s;
        }
      }
    } else if (active) {
      for (int64_t kk = lane; kk < k; kk += lanes) {
        const int64_t e = row_first + kk;
        const uint8_t byte = packed[e >> 1];
        const float w = code[(e & 1) ? (byte & 0x0f) : (byte >> 4)] * absmax(e >> shift);
        for (int b = 0; b < QC_MAX_BATCH; ++b) {
          if (b >= nb) break;
          acc[b] = sycl::fma(Elem<T>::load(a0, b * k + kk), w, acc[b]);
        }
      }
    }
    for (int b = 0; b < QC_MAX_BATCH; ++b) {
      if (b >= nb) break;
      const float total = sycl::reduce_over_group(sg, acc[b], sycl::plus<float>());
      if (active && lane == 0) Elem<T>::store(out, (b0 + b) * ldo + row, total);
    }
  }
}

// gemv_4bit: the sub-group's row of the work-group's QC_GEMV_ROWS_PER_WG, out [batch, nrows].
template <typename T>
void gemv_4bit(const sycl::nd_item<1> &it, const float *code, const T *a, const uint8_t *packed,
               const Absmax &absmax, T *out, int64_t batch, int64_t nrows, int64_t k,
               int64_t blocksize) {
  gemv_4bit_row<T>(it, code, a, packed, absmax, out, nrows, batch, subgroup_row(it), nrows, k, blocksize);
}

// The grouped gemv: up to QC_GV_GROUPS weights [n_i, K] that share the input, their rows one list
// (weight i's after those of the weights before it), a sub-group per row as in gemv_4bit; weight
// i's results go to columns n_0 + ... + n_{i-1} .. of out [batch, ldo]. `GroupW` holds one weight's
// arrays and row count.
struct GroupW {
  const uint8_t *packed;
  Absmax absmax;
  int64_t n;
};
// The weight is picked by selects into values (qc_common.hpp group_member: a first version that
// indexed an array of them measured 5-16% slower than the single gemvs on the CPU device).
template <typename T>
void gemv_4bit_grouped(const sycl::nd_item<1> &it, const float *code, const T *a, const GroupW &w0,
                       const GroupW &w1, const GroupW &w2, const GroupW &w3, int ngroups, T *out, int64_t ldo,
                       int64_t batch, int64_t k, int64_t blocksize) {
  const int64_t row = subgroup_row(it);
  int64_t col;
  const GroupW w = group_member(row, w0, w1, w2, w3, ngroups, col);
  gemv_4bit_row<T>(it, code, a, w.packed, w.absmax, out + col, ldo, batch, row - col, w.n, k, blocksize);
}

} // namespace qc
