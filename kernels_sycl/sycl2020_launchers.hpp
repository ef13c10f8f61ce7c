// SYCL 2020 launchers of the quantcore kernels for an offline SYCL compiler (icpx -fsycl,
// AdaptiveCpp's acpp, ...): the same kernel bodies as the run-time build, submitted as lambdas
// with sycl::local_accessor for work-group memory and [[sycl::reqd_sub_group_size]] for the
// kernels that reduce over a sub-group. No oneAPI extension is used here; the run-time build
// (entry_points.cpp) uses free-function kernels instead, which only the DPC++ kernel compiler has.
//
// Include after defining QC_SUBGROUP_SIZE for the target (the run-time backend picks 32 on GPUs,
// the SIMD width on CPUs) and put the generated quantcore_constants.h on the include path
// (python -c "from quantcore.formats import kernel_defines as k; k.write_header('.')").
// Pointers are USM; sizes as in quantcore/backend.py; every call returns the last event.
#pragma once

#include "bnb.hpp"
#include "ggml.hpp"
#include "tiled.hpp"

namespace qc::sycl2020 {

inline sycl::nd_range<1> groups_of(int64_t groups, int64_t wg) {
  return sycl::nd_range<1>{sycl::range<1>(static_cast<size_t>(groups * wg)),
                           sycl::range<1>(static_cast<size_t>(wg))};
}
inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline float *local_ptr(const sycl::local_accessor<float, 1> &acc) {
  return acc.get_multi_ptr<sycl::access::decorated::no>().get();
}

// Blockwise quantize geometry (as backends/sycl/__init__.py computes it).
struct QuantizeLaunch {
  int64_t values_per_item, groups;
  QuantizeLaunch(int64_t n, int64_t blocksize) {
    values_per_item = sycl::max<int64_t>(QC_QUANT_MIN_VALUES_PER_ITEM, blocksize / QC_QUANT_WG);
    const int64_t blocks_per_group = QC_QUANT_WG / (blocksize / values_per_item);
    groups = cdiv(cdiv(n, blocksize), blocks_per_group);
  }
};

// -- bitsandbytes ---------------------------------------------------------------------------------
template <typename T>
sycl::event dequantize_4bit(sycl::queue &q, const uint8_t *packed, Absmax absmax, T *out, int64_t n,
                            int64_t blocksize, int quant_type) {
  const int64_t groups = cdiv((n + 1) / 2, QC_DEQUANT_WG * QC_DEQUANT_BYTES_PER_ITEM);
  return q.submit([&](sycl::handler &h) {
    sycl::local_accessor<float, 1> lut(sycl::range<1>(kCodes4Bit), h);
    h.parallel_for(groups_of(groups, QC_DEQUANT_WG), [=](sycl::nd_item<1> it) {
      fill_local(it, local_ptr(lut), quant_type == kQuantNF4 ? kNF4Code : kFP4Code, kCodes4Bit);
      dequantize_blockwise<T, 4>(it, local_ptr(lut), packed, absmax, out, n, blocksize);
    });
  });
}

template <typename T>
sycl::event dequantize_blockwise_8bit(sycl::queue &q, const uint8_t *codes, const float *absmax,
                                      const float *code, T *out, int64_t n, int64_t blocksize) {
  const int64_t groups = cdiv(n, QC_DEQUANT_WG * QC_DEQUANT_BYTES_PER_ITEM);
  const Absmax scales{absmax, nullptr, nullptr, nullptr, nullptr};
  return q.submit([&](sycl::handler &h) {
    sycl::local_accessor<float, 1> lut(sycl::range<1>(kCodes8Bit), h);
    h.parallel_for(groups_of(groups, QC_DEQUANT_WG), [=](sycl::nd_item<1> it) {
      fill_local(it, local_ptr(lut), code, kCodes8Bit);
      dequantize_blockwise<T, 8>(it, local_ptr(lut), codes, scales, out, n, blocksize);
    });
  });
}

template <typename T>
sycl::event quantize_4bit(sycl::queue &q, const T *x, uint8_t *packed, float *absmax, int64_t n,
                          int64_t blocksize, int quant_type) {
  const QuantizeLaunch g(n, blocksize);
  const QuantizeGeometry geom{n, blocksize, g.values_per_item};
  return q.submit([&](sycl::handler &h) {
    sycl::local_accessor<float, 1> scratch(sycl::range<1>(QC_QUANT_WG), h);
    h.parallel_for(groups_of(g.groups, QC_QUANT_WG), [=](sycl::nd_item<1> it) {
      quantize_blockwise<4>(it, local_ptr(scratch), [=](int64_t i) { return Elem<T>::load(x, i); },
                            geom, quant_type, nullptr, packed, absmax);
    });
  });
}

template <typename T>
sycl::event quantize_blockwise_8bit(sycl::queue &q, const T *x, const float *thresholds,
                                    uint8_t *codes, float *absmax, int64_t n, int64_t blocksize) {
  const QuantizeLaunch g(n, blocksize);
  const QuantizeGeometry geom{n, blocksize, g.values_per_item};
  return q.submit([&](sycl::handler &h) {
    sycl::local_accessor<float, 1> scratch(sycl::range<1>(QC_QUANT_WG), h);
    sycl::local_accessor<float, 1> table(sycl::range<1>(kCodes8Bit - 1), h);
    h.parallel_for(groups_of(g.groups, QC_QUANT_WG), [=](sycl::nd_item<1> it) {
      fill_local(it, local_ptr(table), thresholds, kCodes8Bit - 1);
      quantize_blockwise<8>(it, local_ptr(scratch), [=](int64_t i) { return Elem<T>::load(x, i); },
                            geom, 0, local_ptr(table), codes, absmax);
    });
  });
}

#if QC_HAVE_FP64
inline sycl::event double_quantize(sycl::queue &q, const float *absmax, uint8_t *qabsmax,
                                   float *absmax2, float *offset, int64_t nblocks) {
  sycl::event mean = q.submit([&](sycl::handler &h) {
    sycl::local_accessor<double, 1> partial(sycl::range<1>(QC_SUM_WG), h);
    h.parallel_for(groups_of(1, QC_SUM_WG), [=](sycl::nd_item<1> it) {
      absmax_mean(it, partial.get_multi_ptr<sycl::access::decorated::no>().get(), absmax, nblocks,
                  offset);
    });
  });
  const QuantizeLaunch g(nblocks, QC_NESTED_BLOCKSIZE);
  const QuantizeGeometry geom{nblocks, QC_NESTED_BLOCKSIZE, g.values_per_item};
  return q.submit([&](sycl::handler &h) {
    h.depends_on(mean);
    sycl::local_accessor<float, 1> scratch(sycl::range<1>(QC_QUANT_WG), h);
    sycl::local_accessor<float, 1> table(sycl::range<1>(kCodes8Bit - 1), h);
    h.parallel_for(groups_of(g.groups, QC_QUANT_WG), [=](sycl::nd_item<1> it) {
      fill_local(it, local_ptr(table), kDynamicThresholds, kCodes8Bit - 1);
      const float center = offset[0];
      quantize_blockwise<8>(it, local_ptr(scratch), [=](int64_t i) { return absmax[i] - center; },
                            geom, 0, local_ptr(table), qabsmax, absmax2);
    });
  });
}
#endif

template <typename T>
sycl::event gemv_4bit(sycl::queue &q, const T *a, const uint8_t *packed, Absmax absmax, T *out,
                      int64_t batch, int64_t nrows, int64_t k, int64_t blocksize, int quant_type) {
  constexpr int64_t wg = QC_GEMV_ROWS_PER_WG * QC_SUBGROUP_SIZE;
  return q.submit([&](sycl::handler &h) {
    sycl::local_accessor<float, 1> lut(sycl::range<1>(kCodes4Bit), h);
    h.parallel_for(groups_of(cdiv(nrows, QC_GEMV_ROWS_PER_WG), wg),
                   [=](sycl::nd_item<1> it) [[sycl::reqd_sub_group_size(QC_SUBGROUP_SIZE)]] {
      fill_local(it, local_ptr(lut), quant_type == kQuantNF4 ? kNF4Code : kFP4Code, kCodes4Bit);
      qc::gemv_4bit<T>(it, local_ptr(lut), a, packed, absmax, out, batch, nrows, k, blocksize);
    });
  });
}

// the grouped gemv (rows below QC_TILED_MIN_ROWS): w[0 .. ngroups) one quant type and blocksize,
// out [batch, ldo] (weight i into columns n_0 + ... + n_{i-1} ..)
template <typename T>
sycl::event gemv_4bit_grouped(sycl::queue &q, const T *a, const GroupW *w, int ngroups, T *out, int64_t ldo,
                              int64_t batch, int64_t k, int64_t blocksize, int quant_type) {
  constexpr int64_t wg = QC_GEMV_ROWS_PER_WG * QC_SUBGROUP_SIZE;
  GroupW ws[QC_GV_GROUPS] = {};
  int64_t ntot = 0;
  for (int i = 0; i < ngroups; ++i) ntot += (ws[i] = w[i]).n;
  return q.submit([&](sycl::handler &h) {
    sycl::local_accessor<float, 1> lut(sycl::range<1>(kCodes4Bit), h);
    h.parallel_for(groups_of(cdiv(ntot, QC_GEMV_ROWS_PER_WG), wg),
                   [=](sycl::nd_item<1> it) [[sycl::reqd_sub_group_size(QC_SUBGROUP_SIZE)]] {
      fill_local(it, local_ptr(lut), quant_type == kQuantNF4 ? kNF4Code : kFP4Code, kCodes4Bit);
      qc::gemv_4bit_grouped<T>(it, local_ptr(lut), a, ws[0], ws[1], ws[2], ws[3], ngroups, out, ldo, batch, k,
                               blocksize);
    });
  });
}

// gemv_4bit for many rows (batch >= QC_TILED_MIN_ROWS, as the backend's glue chooses): tiled.hpp.
template <typename T>
sycl::event gemv_4bit_tiled(sycl::queue &q, const T *a, const uint8_t *packed, Absmax absmax, T *out,
                            int64_t batch, int64_t nrows, int64_t k, int64_t blocksize, int quant_type) {
  const int64_t groups = cdiv(nrows, QC_TILE_M) * cdiv(batch, QC_TILE_N);
  return q.submit([&](sycl::handler &h) {
    sycl::local_accessor<float, 1> lut(sycl::range<1>(kCodes4Bit), h);
    sycl::local_accessor<float, 1> ws(sycl::range<1>(QC_TILE_K * QC_TILE_M), h);
    sycl::local_accessor<float, 1> as(sycl::range<1>(QC_TILE_K * QC_TILE_N), h);
    h.parallel_for(groups_of(groups, QC_TILE_THREADS),
                   [=](sycl::nd_item<1> it) [[sycl::reqd_sub_group_size(QC_SUBGROUP_SIZE)]] {
      fill_local(it, local_ptr(lut), quant_type == kQuantNF4 ? kNF4Code : kFP4Code, kCodes4Bit);
      qc::gemv_4bit_tiled<T>(it, local_ptr(lut), local_ptr(ws), local_ptr(as), a, packed, absmax, out,
                             batch, nrows, k, blocksize);
    });
  });
}

// -- ggml -------------------------------------------------------------------------------------------
enum class GgmlFormat { q4_0, q8_0, q8_1 };

template <typename T>
sycl::event quantize_ggml(sycl::queue &q, GgmlFormat fmt, const T *x, uint8_t *out, int64_t nblocks) {
  return q.parallel_for(groups_of(cdiv(nblocks, QC_GGML_WG), QC_GGML_WG), [=](sycl::nd_item<1> it) {
    const int64_t b = static_cast<int64_t>(it.get_global_id(0));
    if (b >= nblocks) return;
    if (fmt == GgmlFormat::q4_0) quantize_q4_0_block(x + b * kQK, out + b * kQ40Bytes);
    else if (fmt == GgmlFormat::q8_0) quantize_q8_block(x + b * kQK, out + b * kQ80Bytes, false);
    else quantize_q8_block(x + b * kQK, out + b * kQ81Bytes, true);
  });
}

template <typename T>
sycl::event dequantize_ggml(sycl::queue &q, GgmlFormat fmt, const uint8_t *src, T *out, int64_t nblocks) {
  return q.parallel_for(groups_of(cdiv(nblocks, QC_GGML_WG), QC_GGML_WG), [=](sycl::nd_item<1> it) {
    const int64_t b = static_cast<int64_t>(it.get_global_id(0));
    if (b >= nblocks) return;
    if (fmt == GgmlFormat::q4_0) dequantize_q4_0_block(src + b * kQ40Bytes, out + b * kQK);
    else if (fmt == GgmlFormat::q8_0) dequantize_q8_block(src + b * kQ80Bytes, kQ80QsOffset, out + b * kQK);
    else dequantize_q8_block(src + b * kQ81Bytes, kQ81QsOffset, out + b * kQK);
  });
}

// W4A8 GEMM: `aq` (Q8_1 blocks) when ON_THE_FLY is false, else the float activation `a`.
template <bool ON_THE_FLY, typename T>
sycl::event gemm_w4a8(sycl::queue &q, const uint8_t *wq, const uint8_t *aq, const T *a, float *out,
                      int64_t m, int64_t n, int64_t k) {
  constexpr int64_t wg = QC_GEMM_ROWS_PER_WG * QC_SUBGROUP_SIZE;
  constexpr size_t slots = QC_MAX_BATCH * QC_SUBGROUP_SIZE;
  const int64_t groups = cdiv(m, QC_GEMM_ROWS_PER_WG) * cdiv(n, QC_MAX_BATCH);
  return q.submit([&](sycl::handler &h) {
    sycl::local_accessor<int8_t, 1> sq(sycl::range<1>(slots * kQK), h);
    sycl::local_accessor<float, 1> sd(sycl::range<1>(slots), h), ss(sycl::range<1>(slots), h);
    h.parallel_for(groups_of(groups, wg), [=](sycl::nd_item<1> it) [[sycl::reqd_sub_group_size(QC_SUBGROUP_SIZE)]] {
      const Q81Stage stage{sq.get_multi_ptr<sycl::access::decorated::no>().get(), local_ptr(sd),
                           local_ptr(ss)};
      qc::gemm_w4a8<ON_THE_FLY, T>(it, stage, wq, aq, a, out, m, n, k);
    });
  });
}

// W4A8 GEMM for many activation rows (n >= QC_TILED_MIN_ROWS) from Q8_1 blocks `aq`; a float
// activation is quantized first with quantize_ggml(q8_1), as the backend's glue does.
inline sycl::event gemm_q4_0_q8_1_tiled(sycl::queue &q, const uint8_t *wq, const uint8_t *aq, float *out,
                                        int64_t m, int64_t n, int64_t k) {
  const int64_t groups = cdiv(m, QC_TILE_M) * cdiv(n, QC_TILE_N);
  return q.submit([&](sycl::handler &h) {
    sycl::local_accessor<int8_t, 1> swq(sycl::range<1>(QC_TILE_K * QC_TILE_M), h);
    sycl::local_accessor<int8_t, 1> saq(sycl::range<1>(QC_TILE_K * QC_TILE_N), h);
    sycl::local_accessor<float, 1> sd4(sycl::range<1>(kTileKB * QC_TILE_M), h);
    sycl::local_accessor<float, 1> sd8(sycl::range<1>(kTileKB * QC_TILE_N), h);
    sycl::local_accessor<float, 1> ss8(sycl::range<1>(kTileKB * QC_TILE_N), h);
    h.parallel_for(groups_of(groups, QC_TILE_THREADS),
                   [=](sycl::nd_item<1> it) [[sycl::reqd_sub_group_size(QC_SUBGROUP_SIZE)]] {
      const TiledQ81Stage st{swq.get_multi_ptr<sycl::access::decorated::no>().get(), local_ptr(sd4),
                             saq.get_multi_ptr<sycl::access::decorated::no>().get(), local_ptr(sd8),
                             local_ptr(ss8)};
      qc::gemm_q4_0_q8_1_tiled(it, st, wq, aq, out, m, n, k);
    });
  });
}

} // namespace qc::sycl2020
