// Many-rows kernels of the SYCL backend: gemv_4bit with more than 8 activation rows and the W4A8
// GEMM with N > 8, as tiled dot products (no matrix instructions: joint_matrix is not offered by
// the OpenCL CPU device, see docs/sycl.md).
//
// A work-group of QC_TILE_THREADS work-items computes a QC_TILE_M (weight rows) x QC_TILE_N
// (activation rows) tile of the output. It walks K in steps of QC_TILE_K values: the step's weight
// tile is decoded into local memory (4-bit codes -> fp32 code * absmax; Q4_0 nibbles as int8 with
// their fp16 d), the activation tile beside it (fp32; Q8_1 int8 with d and s), then each work-item
// accumulates a QC_TILE_TM x QC_TILE_TN register micro-tile. Work-item (tx, ty) owns weight rows
// tx + i * kTileCols and activation rows ty + j * kTileRowsT, so consecutive work-items (one SIMD
// vector on a CPU device) read consecutive local addresses of the weight tile and one address of
// the activation tile; in the staging, consecutive work-items take consecutive rows, so their
// stores are consecutive too. Positions come from the sub-group (split_position), and the
// kernels run with the required sub-group size QC_SUBGROUP_SIZE. The arithmetic per term is the few-rows kernels' (bnb.hpp, ggml.hpp), so
// the results stay within the same tolerance bounds. The geometry comes from the generated
// quantcore_constants.h (quantcore.formats.kernel_defines.TILED_GEOMETRY), which the launcher reads too.
#pragma once

#include "bnb.hpp"
#include "ggml.hpp"

namespace qc {

inline constexpr int kTileM = QC_TILE_M;
inline constexpr int kTileN = QC_TILE_N;
inline constexpr int kTileK = QC_TILE_K;
inline constexpr int kTM = QC_TILE_TM;
inline constexpr int kTN = QC_TILE_TN;
inline constexpr int kTileCols = kTileM / kTM;  // work-items along the weight rows
inline constexpr int kTileRowsT = kTileN / kTN; // work-items along the activation rows
inline constexpr int kTileChunk = QC_TILE_CHUNK;
inline constexpr int kTileKB = kTileK / kQK;    // Q4_0 blocks per K step
static_assert(kTileCols * kTileRowsT == QC_TILE_THREADS, "one work-item per micro-tile");
static_assert(kTileK % kQK == 0 && kTileK % kTileChunk == 0 && kTileChunk % 2 == 0, "K step");

// The work-item's position (x, y) in a work-group seen as `width` x (size / width) work-items,
// x fastest, computed from its sub-group: the compiler of a CPU device vectorizes a sub-group
// into one SIMD vector and knows that the lane index is consecutive and the sub-group index
// uniform, so x = lane + uniform gives consecutive local addresses and y a uniform one
// (local_id % width hides that: every local load of the micro-tile loop became a gather,
// about 3x slower on the OpenCL CPU device, docs/performance.md).
template <int kWidth>
inline void split_position(const sycl::nd_item<1> &it, int &x, int &y) {
  const sycl::sub_group sg = it.get_sub_group();
  const int lane = static_cast<int>(sg.get_local_linear_id());
  const int sgid = static_cast<int>(sg.get_group_linear_id());
  constexpr int kSg = QC_SUBGROUP_SIZE;
  if constexpr (kSg <= kWidth) {
    static_assert(kWidth % kSg == 0, "sub-groups tile a row of work-items");
    x = (sgid % (kWidth / kSg)) * kSg + lane;
    y = sgid / (kWidth / kSg);
  } else {
    static_assert(kSg % kWidth == 0, "a sub-group holds whole rows of work-items");
    x = lane % kWidth;
    y = sgid * (kSg / kWidth) + lane / kWidth;
  }
}

// -- gemv_4bit for many rows -------------------------------------------------------------------
// out[b, row] = sum_k a[b, k] * W[row, k], W 4-bit [nrows, K] flattened into blocks of
// `blocksize` (element 2i in the high nibble); ws / as: local fp32 [kTileK][kTileM] and
// [kTileK][kTileN]; code: the 16-entry table in local memory. Groups: m tiles fastest.
template <typename T>
void gemv_4bit_tiled(const sycl::nd_item<1> &it, const float *code, float *ws, float *as, const T *a,
                     const uint8_t *packed, const Absmax &absmax, T *out, int64_t batch, int64_t nrows,
                     int64_t k, int64_t blocksize) {
  int tx, ty;
  split_position<kTileCols>(it, tx, ty);
  const int64_t mtiles = (nrows + kTileM - 1) / kTileM;
  const int64_t m0 = (static_cast<int64_t>(it.get_group(0)) % mtiles) * kTileM;
  const int64_t n0 = (static_cast<int64_t>(it.get_group(0)) / mtiles) * kTileN;
  const int shift = log2_pow2(blocksize);
  // A chunk of kTileChunk values starting at a multiple of kTileChunk lies in one absmax block
  // (blocks hold >= 32 values) and covers whole bytes when every row starts at such a multiple.
  const bool aligned = k % kTileChunk == 0;
  // Staging: one chunk of the weight tile and one of the activation tile per work-item.
  static_assert(kTileM * kTileK == kTileChunk * QC_TILE_THREADS, "one weight chunk per work-item");
  static_assert(kTileN * kTileK == kTileChunk * QC_TILE_THREADS, "one activation chunk per work-item");
  int wr, wkc, ar, akc;
  split_position<kTileM>(it, wr, wkc);
  split_position<kTileN>(it, ar, akc);
  wkc *= kTileChunk;
  akc *= kTileChunk;

  float acc[kTN][kTM];
  for (int j = 0; j < kTN; ++j)
    for (int i = 0; i < kTM; ++i) acc[j][i] = 0.0f;

  for (int64_t k0 = 0; k0 < k; k0 += kTileK) {
    {
      // weight: work-item (r, chunk) decodes values kc .. kc + kTileChunk - 1 of row m0 + r
      const int64_t row = m0 + wr, kk0 = k0 + wkc;
      float *dst = ws + wkc * kTileM + wr; // value j at dst[j * kTileM]
      if (row < nrows && aligned && kk0 + kTileChunk <= k) {
        const int64_t e = row * k + kk0; // a multiple of kTileChunk: whole bytes, one block
        const float scale = absmax(e >> shift);
        for (int j = 0; j < kTileChunk / 2; ++j) {
          const uint8_t byte = packed[(e >> 1) + j];
          dst[(2 * j) * kTileM] = code[byte >> 4] * scale;
          dst[(2 * j + 1) * kTileM] = code[byte & 0x0f] * scale;
        }
      } else {
        for (int j = 0; j < kTileChunk; ++j) {
          float w = 0.0f;
          if (row < nrows && kk0 + j < k) {
            const int64_t e = row * k + kk0 + j;
            const uint8_t byte = packed[e >> 1];
            w = code[(e & 1) ? (byte & 0x0f) : (byte >> 4)] * absmax(e >> shift);
          }
          dst[j * kTileM] = w;
        }
      }
      // activation: work-item (r, chunk) converts values kc .. kc + kTileChunk - 1 of row n0 + r
      const int64_t b = n0 + ar, ak0 = k0 + akc;
      float *adst = as + akc * kTileN + ar;
      for (int j = 0; j < kTileChunk; ++j)
        adst[j * kTileN] = (b < batch && ak0 + j < k) ? Elem<T>::load(a, b * k + ak0 + j) : 0.0f;
    }
    sycl::group_barrier(it.get_group());
    for (int kk = 0; kk < kTileK; ++kk) {
      float wv[kTM], av[kTN];
      for (int i = 0; i < kTM; ++i) wv[i] = ws[kk * kTileM + tx + i * kTileCols];
      for (int j = 0; j < kTN; ++j) av[j] = as[kk * kTileN + ty + j * kTileRowsT];
      for (int j = 0; j < kTN; ++j)
        for (int i = 0; i < kTM; ++i) acc[j][i] = sycl::fma(av[j], wv[i], acc[j][i]);
    }
    sycl::group_barrier(it.get_group());
  }
  for (int j = 0; j < kTN; ++j) {
    const int64_t b = n0 + ty + j * kTileRowsT;
    for (int i = 0; i < kTM; ++i) {
      const int64_t row = m0 + tx + i * kTileCols;
      if (b < batch && row < nrows) Elem<T>::store(out, b * nrows + row, acc[j][i]);
    }
  }
}

// -- W4A8 GEMM for many activation rows ----------------------------------------------------------
// out[m, n] = sum_b d4[m,b] * (d8[n,b] * sum_j q4[m,b,j] * q8[n,b,j] - 8 * s8[n,b]), fp32 [M, N],
// from Q4_0 weights [M, K/32, 18] and Q8_1 activations [N, K/32, 36] (gemm_w4a8 quantizes its
// float activation with quantize_q8_1 first: the same bytes). Per block the int32 sumi, then the
// few-rows kernel's scaling (inner = d8 * sumi - 8 * s8, two roundings; acc = fma(d4, inner, acc)).
// Local memory: the nibbles [kTileK][kTileM] and d4 [kTileKB][kTileM]; the Q8_1 codes
// [kTileK][kTileN], d8 and s8 [kTileKB][kTileN]. A block past K or a row past M / N is staged as
// zeros (its terms add nothing to a stored output).
struct TiledQ81Stage {
  int8_t *wq;  // [kTileK * kTileM]
  float *d4;   // [kTileKB * kTileM]
  int8_t *aq;  // [kTileK * kTileN]
  float *d8;   // [kTileKB * kTileN]
  float *s8;   // [kTileKB * kTileN]
};

inline void gemm_q4_0_q8_1_tiled(const sycl::nd_item<1> &it, const TiledQ81Stage &st, const uint8_t *wq,
                                 const uint8_t *aq, float *out, int64_t m_rows, int64_t n_cols, int64_t k) {
  int tx, ty;
  split_position<kTileCols>(it, tx, ty);
  const int64_t nbk = k / kQK;
  // Staging: each work-item copies one piece of a (row, block) of each tile.
  constexpr int kWBytes = kTileM * kTileKB * kQ40HalfBlock / QC_TILE_THREADS;
  constexpr int kWPieces = kQ40HalfBlock / kWBytes;
  constexpr int kABytes = kTileN * kTileKB * kQK / QC_TILE_THREADS;
  constexpr int kAPieces = kQK / kABytes;
  static_assert(kWBytes * kWPieces == kQ40HalfBlock && kTileM * kTileKB * kWPieces == QC_TILE_THREADS,
                "weight staging: whole pieces, one per work-item");
  static_assert(kABytes * kAPieces == kQK && kTileN * kTileKB * kAPieces == QC_TILE_THREADS,
                "activation staging: whole pieces, one per work-item");
  int wr, wy, ar, ay;
  split_position<kTileM>(it, wr, wy);
  split_position<kTileN>(it, ar, ay);
  const int64_t mtiles = (m_rows + kTileM - 1) / kTileM;
  const int64_t m0 = (static_cast<int64_t>(it.get_group(0)) % mtiles) * kTileM;
  const int64_t n0 = (static_cast<int64_t>(it.get_group(0)) / mtiles) * kTileN;

  float acc[kTN][kTM];
  for (int j = 0; j < kTN; ++j)
    for (int i = 0; i < kTM; ++i) acc[j][i] = 0.0f;

  for (int64_t kb0 = 0; kb0 < nbk; kb0 += kTileKB) {
    {
      // weight: work-item (r, y) copies kWBytes of the kQ40HalfBlock code bytes of one block of
      // row m0 + r (byte t holds elements t, low nibble, and t + 16)
      const int b = wy / kWPieces, t0 = (wy % kWPieces) * kWBytes;
      const bool valid = m0 + wr < m_rows && kb0 + b < nbk;
      const uint8_t *blk = wq + ((m0 + wr) * nbk + kb0 + b) * kQ40Bytes;
      for (int t = t0; t < t0 + kWBytes; ++t) {
        const uint8_t byte = valid ? blk[kQ40QsOffset + t] : 0;
        st.wq[(b * kQK + t) * kTileM + wr] = static_cast<int8_t>(byte & 0x0f);
        st.wq[(b * kQK + t + kQ40HalfBlock) * kTileM + wr] = static_cast<int8_t>(byte >> 4);
      }
      if (t0 == 0) st.d4[b * kTileM + wr] = valid ? load_half_le(blk) : 0.0f;
    }
    {
      // activation: work-item (r, y) copies kABytes of the kQK codes of one block of row n0 + r
      const int b = ay / kAPieces, j0 = (ay % kAPieces) * kABytes;
      const bool valid = n0 + ar < n_cols && kb0 + b < nbk;
      const uint8_t *blk = aq + ((n0 + ar) * nbk + kb0 + b) * kQ81Bytes;
      for (int j = j0; j < j0 + kABytes; ++j)
        st.aq[(b * kQK + j) * kTileN + ar] = valid ? sycl::bit_cast<int8_t>(blk[kQ81QsOffset + j]) : 0;
      if (j0 == 0) {
        st.d8[b * kTileN + ar] = valid ? load_half_le(blk) : 0.0f;
        st.s8[b * kTileN + ar] = valid ? load_half_le(blk + kQ81SumOffset) : 0.0f;
      }
    }
    sycl::group_barrier(it.get_group());
    for (int b = 0; b < kTileKB; ++b) {
      int sumi[kTN][kTM];
      for (int j = 0; j < kTN; ++j)
        for (int i = 0; i < kTM; ++i) sumi[j][i] = 0;
      for (int e = 0; e < kQK; ++e) {
        int wv[kTM], av[kTN];
        for (int i = 0; i < kTM; ++i) wv[i] = st.wq[(b * kQK + e) * kTileM + tx + i * kTileCols];
        for (int j = 0; j < kTN; ++j) av[j] = st.aq[(b * kQK + e) * kTileN + ty + j * kTileRowsT];
        for (int j = 0; j < kTN; ++j)
          for (int i = 0; i < kTM; ++i) sumi[j][i] += wv[i] * av[j];
      }
      for (int j = 0; j < kTN; ++j) {
        const float d8 = st.d8[b * kTileN + ty + j * kTileRowsT];
        const float s8 = st.s8[b * kTileN + ty + j * kTileRowsT];
        for (int i = 0; i < kTM; ++i) {
          const float inner = d8 * static_cast<float>(sumi[j][i]) - static_cast<float>(kQ4Offset) * s8;
          acc[j][i] = sycl::fma(st.d4[b * kTileM + tx + i * kTileCols], inner, acc[j][i]);
        }
      }
    }
    sycl::group_barrier(it.get_group());
  }
  for (int j = 0; j < kTN; ++j) {
    const int64_t n = n0 + ty + j * kTileRowsT;
    for (int i = 0; i < kTM; ++i) {
      const int64_t m = m0 + tx + i * kTileCols;
      if (m < m_rows && n < n_cols) out[m * n_cols + n] = acc[j][i];
    }
  }
}

} // namespace qc
