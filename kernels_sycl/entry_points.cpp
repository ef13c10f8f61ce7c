// Kernel entry points of the quantcore SYCL backend: the root of the one bundle the backend
// compiles at run time (backends/sycl/runtime.py passes the headers of this folder and the
// generated quantcore_constants.h as include files).
//
// Entry points are free-function kernels (oneAPI extension sycl_ext_oneapi_free_function_kernels)
// with C names, so the host finds them by name and sets their arguments one by one; work-group
// local memory is `work_group_static` (sycl_ext_oneapi_work_group_static) declared in the entry
// point. All the arithmetic is in the SYCL 2020 bodies of bnb.hpp and ggml.hpp; an offline build
// with another SYCL compiler replaces this file only (see docs/sycl.md).
//
// The arguments are declared once, in quantcore/formats/kernel_interface.py (the ops' common list,
// less the dtype, which the kernel name carries): the generated header declares every kernel
// (QC_SYCL_PROTOTYPES), so a definition here that disagrees does not compile, and the launcher
// passes each argument as its declared kind. Every array is a USM pointer. The arguments were
// validated by the core and the launcher; the kernels still guard every index against the sizes
// they get.

#include "bnb.hpp"
#include "ggml.hpp"
#include "mx.hpp"
#include "tiled.hpp"

namespace syclext = sycl::ext::oneapi;
namespace syclexp = sycl::ext::oneapi::experimental;

#define QC_KERNEL \
  extern "C" SYCL_EXTERNAL SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<1>))
// Kernels that reduce over a sub-group state its size: the reduction and the lane <-> data map
// assume exactly QC_SUBGROUP_SIZE lanes.
#define QC_KERNEL_SUBGROUP                                                                 \
  extern "C" SYCL_EXTERNAL SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<1>)) \
      SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::sub_group_size<QC_SUBGROUP_SIZE>))

#define QC_ITEM syclext::this_work_item::get_nd_item<1>()
#define QC_LOCAL(array) (*&(array)) // work_group_static<T[n]> -> T*

// One entry point per element type: f32, f16, bf16 (the dtype codes of the core).
#define QC_FOR_EACH_DTYPE(X) X(f32, float) X(f16, qc::half) X(bf16, qc::bf16)

QC_SYCL_PROTOTYPES

namespace {
// absmax fp32, or (absmax2 given) the uint8 codes of a double quantization
inline qc::Absmax make_absmax(const void *absmax, const float *absmax2, const float *code2,
                              const float *offset) {
  if (absmax2 == nullptr) return qc::Absmax{static_cast<const float *>(absmax), nullptr, nullptr, nullptr, nullptr};
  return qc::Absmax{nullptr, static_cast<const uint8_t *>(absmax), absmax2, code2, offset};
}
inline const float *code_4bit(int64_t quant_type) {
  return quant_type == qc::kQuantNF4 ? qc::kNF4Code : qc::kFP4Code;
}
} // namespace

// ---- bitsandbytes ---------------------------------------------------------------------------------
#define QC_DEQUANTIZE_4BIT(NAME, T)                                                           \
  QC_KERNEL void qc_dequantize_4bit_##NAME(                                                   \
      const uint8_t *packed, const void *absmax, const float *absmax2, const float *code2,    \
      const float *offset, T *out, int64_t n, int blocksize, int quant_type) {                \
    static syclexp::work_group_static<float[qc::kCodes4Bit]> lut;                             \
    const auto it = QC_ITEM;                                                                  \
    qc::fill_local(it, QC_LOCAL(lut), code_4bit(quant_type), qc::kCodes4Bit);                 \
    qc::dequantize_blockwise<T, 4>(it, QC_LOCAL(lut), packed,                                 \
                                   make_absmax(absmax, absmax2, code2, offset), out, n,       \
                                   blocksize);                                                \
  }
QC_FOR_EACH_DTYPE(QC_DEQUANTIZE_4BIT)

#define QC_DEQUANTIZE_BLOCKWISE(NAME, T)                                                      \
  QC_KERNEL void qc_dequantize_blockwise_##NAME(const uint8_t *codes, const float *absmax,    \
                                                const float *code, T *out, int64_t n,         \
                                                int blocksize) {                              \
    static syclexp::work_group_static<float[qc::kCodes8Bit]> lut;                             \
    const auto it = QC_ITEM;                                                                  \
    qc::fill_local(it, QC_LOCAL(lut), code, qc::kCodes8Bit);                                  \
    qc::dequantize_blockwise<T, 8>(it, QC_LOCAL(lut), codes,                                  \
                                   make_absmax(absmax, nullptr, nullptr, nullptr),            \
                                   out, n, blocksize);                                        \
  }
QC_FOR_EACH_DTYPE(QC_DEQUANTIZE_BLOCKWISE)

#define QC_QUANTIZE_4BIT(NAME, T)                                                               \
  QC_KERNEL void qc_quantize_4bit_##NAME(const T *x, uint8_t *packed, float *absmax, int64_t n, \
                                         int blocksize, int quant_type,                         \
                                         int64_t values_per_item) {                             \
    static syclexp::work_group_static<float[QC_QUANT_WG]> scratch;                              \
    const auto it = QC_ITEM;                                                                    \
    qc::quantize_blockwise<4>(                                                                  \
        it, QC_LOCAL(scratch), [=](int64_t i) { return qc::Elem<T>::load(x, i); },              \
        qc::QuantizeGeometry{n, blocksize, values_per_item}, static_cast<int>(quant_type),      \
        nullptr, packed, absmax);                                                               \
  }
QC_FOR_EACH_DTYPE(QC_QUANTIZE_4BIT)

#define QC_QUANTIZE_BLOCKWISE(NAME, T)                                                         \
  QC_KERNEL void qc_quantize_blockwise_##NAME(const T *x, const float *thresholds,             \
                                              uint8_t *codes, float *absmax, int64_t n,        \
                                              int blocksize, int64_t values_per_item) {        \
    static syclexp::work_group_static<float[QC_QUANT_WG]> scratch;                             \
    static syclexp::work_group_static<float[qc::kCodes8Bit - 1]> table;                        \
    const auto it = QC_ITEM;                                                                   \
    qc::fill_local(it, QC_LOCAL(table), thresholds, qc::kCodes8Bit - 1);                       \
    qc::quantize_blockwise<8>(                                                                 \
        it, QC_LOCAL(scratch), [=](int64_t i) { return qc::Elem<T>::load(x, i); },             \
        qc::QuantizeGeometry{n, blocksize, values_per_item}, 0, QC_LOCAL(table), codes,        \
        absmax);                                                                               \
  }
QC_FOR_EACH_DTYPE(QC_QUANTIZE_BLOCKWISE)

#if QC_HAVE_FP64
// Double quantization, step 1 (one work-group of QC_SUM_WG): the fp64 tree mean of absmax.
QC_KERNEL void qc_absmax_mean(const float *absmax, int64_t nblocks, float *offset) {
  static syclexp::work_group_static<double[QC_SUM_WG]> partial;
  qc::absmax_mean(QC_ITEM, QC_LOCAL(partial), absmax, nblocks, offset);
}
#endif

// Double quantization, step 2: 8-bit blockwise (blocks of 256) of absmax - offset, with the
// dynamic map's thresholds from the core.
QC_KERNEL void qc_double_quantize(const float *absmax, uint8_t *qabsmax, float *absmax2, float *offset,
                                  int64_t nblocks, int64_t values_per_item) {
  static syclexp::work_group_static<float[QC_QUANT_WG]> scratch;
  static syclexp::work_group_static<float[qc::kCodes8Bit - 1]> table;
  const auto it = QC_ITEM;
  qc::fill_local(it, QC_LOCAL(table), qc::kDynamicThresholds, qc::kCodes8Bit - 1);
  const float center = offset[0];
  qc::quantize_blockwise<8>(
      it, QC_LOCAL(scratch), [=](int64_t i) { return absmax[i] - center; },
      qc::QuantizeGeometry{nblocks, QC_NESTED_BLOCKSIZE, values_per_item}, 0, QC_LOCAL(table),
      qabsmax, absmax2);
}

#define QC_GEMV_4BIT(NAME, T)                                                                  \
  QC_KERNEL_SUBGROUP void qc_gemv_4bit_##NAME(                                                 \
      const T *a, const uint8_t *packed, const void *absmax, const float *absmax2,             \
      const float *code2, const float *offset, T *out, int64_t batch, int64_t nrows,           \
      int64_t k, int blocksize, int quant_type) {                                              \
    static syclexp::work_group_static<float[qc::kCodes4Bit]> lut;                              \
    const auto it = QC_ITEM;                                                                   \
    qc::fill_local(it, QC_LOCAL(lut), code_4bit(quant_type), qc::kCodes4Bit);                  \
    qc::gemv_4bit<T>(it, QC_LOCAL(lut), a, packed, make_absmax(absmax, absmax2, code2, offset), \
                     out, batch, nrows, k, blocksize);                                         \
  }
QC_FOR_EACH_DTYPE(QC_GEMV_4BIT)

// the grouped gemv: QC_GV_GROUPS weights' parameters (ngroups used), one sub-group per row of all
#define QC_GROUP_W(i)                                                                          \
  const uint8_t *packed##i, const void *absmax##i, const float *absmax2_##i,                   \
      const float *code2_##i, const float *offset##i, int64_t n##i
#define QC_GROUP_MAKE(i) qc::GroupW{packed##i, make_absmax(absmax##i, absmax2_##i, code2_##i, offset##i), n##i}
static_assert(QC_GV_GROUPS == 4, "the grouped gemv's parameter list");
#define QC_GEMV_4BIT_GROUPED(NAME, T)                                                          \
  QC_KERNEL_SUBGROUP void qc_gemv_4bit_grouped_##NAME(                                         \
      const T *a, QC_GROUP_W(0), QC_GROUP_W(1), QC_GROUP_W(2), QC_GROUP_W(3), T *out,         \
      int64_t ldo, int64_t batch, int ngroups, int64_t k, int blocksize, int quant_type) {                  \
    static syclexp::work_group_static<float[qc::kCodes4Bit]> lut;                              \
    const auto it = QC_ITEM;                                                                   \
    qc::fill_local(it, QC_LOCAL(lut), code_4bit(quant_type), qc::kCodes4Bit);                  \
    qc::gemv_4bit_grouped<T>(it, QC_LOCAL(lut), a, QC_GROUP_MAKE(0), QC_GROUP_MAKE(1),          \
                             QC_GROUP_MAKE(2), QC_GROUP_MAKE(3), ngroups, out, ldo, batch, k,     \
                             blocksize);                                                        \
  }
QC_FOR_EACH_DTYPE(QC_GEMV_4BIT_GROUPED)

// the grouped gemv's many-row path: a weight's results [rows, row_bytes] into its columns of the
// grouped output (rows dst_stride bytes apart), one work-item per byte
QC_KERNEL void qc_copy_rows(const uint8_t *src, uint8_t *dst, int64_t rows, int64_t row_bytes, int64_t dst_stride) {
  const int64_t i = static_cast<int64_t>(QC_ITEM.get_global_id(0));
  if (i >= rows * row_bytes) return;
  const int64_t r = i / row_bytes;
  dst[r * dst_stride + (i - r * row_bytes)] = src[i];
}

// ---- ggml -------------------------------------------------------------------------------------------
#define QC_GGML_CODECS(NAME, T)                                                                 \
  QC_KERNEL void qc_quantize_q4_0_##NAME(const T *x, uint8_t *out, int64_t nblocks) {           \
    const int64_t b = static_cast<int64_t>(QC_ITEM.get_global_id(0));                          \
    if (b < nblocks) qc::quantize_q4_0_block(x + b * qc::kQK, out + b * qc::kQ40Bytes);         \
  }                                                                                             \
  QC_KERNEL void qc_quantize_q8_0_##NAME(const T *x, uint8_t *out, int64_t nblocks) {           \
    const int64_t b = static_cast<int64_t>(QC_ITEM.get_global_id(0));                          \
    if (b < nblocks) qc::quantize_q8_block(x + b * qc::kQK, out + b * qc::kQ80Bytes, false);    \
  }                                                                                             \
  QC_KERNEL void qc_quantize_q8_1_##NAME(const T *x, uint8_t *out, int64_t nblocks) {           \
    const int64_t b = static_cast<int64_t>(QC_ITEM.get_global_id(0));                          \
    if (b < nblocks) qc::quantize_q8_block(x + b * qc::kQK, out + b * qc::kQ81Bytes, true);     \
  }                                                                                             \
  QC_KERNEL void qc_dequantize_ggml_##NAME(const uint8_t *q, int fmt, T *out, int64_t nblocks) { \
    const int64_t b = static_cast<int64_t>(QC_ITEM.get_global_id(0));                          \
    if (b >= nblocks) return;                                                                   \
    if (fmt == QC_FMT_Q4_0)                                                                     \
      qc::dequantize_q4_0_block(q + b * qc::kQ40Bytes, out + b * qc::kQK);                      \
    else if (fmt == QC_FMT_Q8_0)                                                                \
      qc::dequantize_q8_block(q + b * qc::kQ80Bytes, qc::kQ80QsOffset, out + b * qc::kQK);      \
    else                                                                                        \
      qc::dequantize_q8_block(q + b * qc::kQ81Bytes, qc::kQ81QsOffset, out + b * qc::kQK);      \
  }
QC_FOR_EACH_DTYPE(QC_GGML_CODECS)

#define QC_GEMM_STAGE                                                                   \
  static syclexp::work_group_static<int8_t[QC_MAX_BATCH * QC_SUBGROUP_SIZE * QC_QK]> sq; \
  static syclexp::work_group_static<float[QC_MAX_BATCH * QC_SUBGROUP_SIZE]> sd;          \
  static syclexp::work_group_static<float[QC_MAX_BATCH * QC_SUBGROUP_SIZE]> ss;          \
  const qc::Q81Stage stage{QC_LOCAL(sq), QC_LOCAL(sd), QC_LOCAL(ss)};

QC_KERNEL_SUBGROUP void qc_gemm_q4_0_q8_1(const uint8_t *wq, const uint8_t *aq, float *out,
                                          int64_t m, int64_t n, int64_t k) {
  QC_GEMM_STAGE
  qc::gemm_w4a8<false, float>(QC_ITEM, stage, wq, aq, nullptr, out, m, n, k);
}

#define QC_GEMM_W4A8(NAME, T)                                                                  \
  QC_KERNEL_SUBGROUP void qc_gemm_w4a8_##NAME(const uint8_t *wq, const T *a, float *out,       \
                                              int64_t m, int64_t n, int64_t k) {               \
    QC_GEMM_STAGE                                                                              \
    qc::gemm_w4a8<true, T>(QC_ITEM, stage, wq, nullptr, a, out, m, n, k);                      \
  }
QC_FOR_EACH_DTYPE(QC_GEMM_W4A8)

// Many rows (tiled.hpp): one work-group of QC_TILE_THREADS per QC_TILE_M x QC_TILE_N output tile.
#define QC_GEMV_4BIT_TILED(NAME, T)                                                              \
  QC_KERNEL_SUBGROUP void qc_gemv_4bit_tiled_##NAME(                                                      \
      const T *a, const uint8_t *packed, const void *absmax, const float *absmax2,               \
      const float *code2, const float *offset, T *out, int64_t batch, int64_t nrows, int64_t k,  \
      int blocksize, int quant_type) {                                                           \
    static syclexp::work_group_static<float[qc::kCodes4Bit]> lut;                                \
    static syclexp::work_group_static<float[QC_TILE_K * QC_TILE_M]> ws;                          \
    static syclexp::work_group_static<float[QC_TILE_K * QC_TILE_N]> as;                          \
    const auto it = QC_ITEM;                                                                     \
    qc::fill_local(it, QC_LOCAL(lut), code_4bit(quant_type), qc::kCodes4Bit);                    \
    qc::gemv_4bit_tiled<T>(it, QC_LOCAL(lut), QC_LOCAL(ws), QC_LOCAL(as), a, packed,             \
                           make_absmax(absmax, absmax2, code2, offset), out, batch,              \
                           nrows, k, blocksize);                                                 \
  }
QC_FOR_EACH_DTYPE(QC_GEMV_4BIT_TILED)

QC_KERNEL_SUBGROUP void qc_gemm_q4_0_q8_1_tiled(const uint8_t *wq, const uint8_t *aq, float *out, int64_t m,
                                       int64_t n, int64_t k) {
  static syclexp::work_group_static<int8_t[QC_TILE_K * QC_TILE_M]> swq;
  static syclexp::work_group_static<float[qc::kTileKB * QC_TILE_M]> sd4;
  static syclexp::work_group_static<int8_t[QC_TILE_K * QC_TILE_N]> saq;
  static syclexp::work_group_static<float[qc::kTileKB * QC_TILE_N]> sd8;
  static syclexp::work_group_static<float[qc::kTileKB * QC_TILE_N]> ss8;
  const qc::TiledQ81Stage st{QC_LOCAL(swq), QC_LOCAL(sd4), QC_LOCAL(saq), QC_LOCAL(sd8), QC_LOCAL(ss8)};
  qc::gemm_q4_0_q8_1_tiled(QC_ITEM, st, wq, aq, out, m, n, k);
}

// ---- NVFP4 / MX -----------------------------------------------------------------------------------
#define QC_GID static_cast<int64_t>(QC_ITEM.get_global_id(0))
namespace {
inline qc::MXArgs mx_args(int64_t rows, int64_t cols, int fmt, bool rceil, int swizzled,
                          const float *global_scale) {
  return qc::MXArgs{rows, cols, fmt, rceil, swizzled != 0, global_scale};
}
} // namespace

#define QC_MX_CODECS(NAME, T)                                                                     \
  QC_KERNEL void qc_mx_quantize_##NAME(const T *x, uint8_t *codes, uint8_t *scales, int64_t rows, \
                                       int64_t cols, int fmt, int scale_mode, int swizzled,       \
                                       const float *global_scale) {                               \
    const auto g = mx_args(rows, cols, fmt, scale_mode == QC_SCALE_MODE_RCEIL, swizzled,          \
                           global_scale);                                                         \
    const int64_t b = QC_GID;                                                                     \
    if (b < rows * (cols / qc::mx_block(g.fmt))) qc::mx_quantize_block(x, codes, scales, g, b);   \
  }                                                                                               \
  QC_KERNEL void qc_mx_dequantize_##NAME(const uint8_t *codes, const uint8_t *scales, T *out,     \
                                         int64_t rows, int64_t cols, int fmt, int swizzled,       \
                                         const float *global_scale) {                             \
    const auto g = mx_args(rows, cols, fmt, false, swizzled, global_scale);                       \
    const int64_t i = QC_GID;                                                                     \
    if (i < rows * cols) qc::mx_dequantize_value(codes, scales, out, g, i);                       \
  }
QC_FOR_EACH_DTYPE(QC_MX_CODECS)

// Swizzled scales: byte p of the [ceil(rows/128)*128, ceil(cols/4)*4] buffer holds scale (r, c),
// or 0 in the padding. `scales` may be null: then only the padding is written (mx_quantize writes
// the scales themselves at their swizzled offsets).
QC_KERNEL void qc_swizzle_scales(const uint8_t *scales, uint8_t *out, int64_t rows, int64_t cols) {
  const int64_t p = QC_GID;
  if (p >= qc::padded_scale_rows(rows) * qc::padded_scale_cols(cols)) return;
  int64_t r, c;
  qc::swizzle_position(p, cols, r, c);
  const bool inside = r < rows && c < cols;
  if (!inside) out[p] = 0;
  else if (scales != nullptr) out[p] = scales[r * cols + c];
}

QC_KERNEL void qc_unswizzle_scales(const uint8_t *swz, uint8_t *out, int64_t rows, int64_t cols) {
  const int64_t i = QC_GID;
  if (i < rows * cols) out[i] = swz[qc::swizzle_offset(i / cols, i % cols, cols)];
}

QC_KERNEL void qc_scaled_fp4_mm(const uint8_t *a, const uint8_t *b, const uint8_t *scale_a,
                                const uint8_t *scale_b, const float *alpha, const qc::bf16 *bias,
                                qc::bf16 *out, int64_t m, int64_t n, int64_t k, int fmt) {
  const int64_t idx = QC_GID;
  if (idx < m * n) qc::scaled_fp4_mm_value(a, b, scale_a, scale_b, alpha, bias, out, m, n, k, fmt, idx);
}

#define QC_LINEAR_MX(NAME, T)                                                                     \
  QC_KERNEL_SUBGROUP void qc_linear_mx_##NAME(const T *x, const uint8_t *codes, const uint8_t *scales, \
                                              const float *global_scale, T *out, int64_t batch,        \
                                              int64_t nrows, int64_t k, int fmt, int swizzled) {       \
    qc::linear_mx<T>(QC_ITEM, x, codes, scales, global_scale, out, batch, nrows, k, fmt, swizzled != 0); \
  }
QC_FOR_EACH_DTYPE(QC_LINEAR_MX)

// the grouped linear_mx: QC_GV_GROUPS weights' parameters (ngroups used), one sub-group per row of all
#define QC_MX_GROUP_W(i) const uint8_t *codes##i, const uint8_t *scales##i, const float *global_scale##i, int64_t n##i
#define QC_MX_GROUP_MAKE(i) qc::MxGroupW{codes##i, scales##i, global_scale##i, n##i}
#define QC_LINEAR_MX_GROUPED(NAME, T)                                                                           \
  QC_KERNEL_SUBGROUP void qc_linear_mx_grouped_##NAME(const T *x, QC_MX_GROUP_W(0), QC_MX_GROUP_W(1),              \
                                                      QC_MX_GROUP_W(2), QC_MX_GROUP_W(3), T *out, int64_t ldo,     \
                                                      int64_t batch, int ngroups, int64_t k, int fmt, int swizzled) { \
    qc::linear_mx_grouped<T>(QC_ITEM, x, QC_MX_GROUP_MAKE(0), QC_MX_GROUP_MAKE(1), QC_MX_GROUP_MAKE(2),             \
                             QC_MX_GROUP_MAKE(3), ngroups, out, ldo, batch, k, fmt, swizzled != 0);                 \
  }
QC_FOR_EACH_DTYPE(QC_LINEAR_MX_GROUPED)

// ---- self-checks --------------------------------------------------------------------------------------
// The sub-group size the device really runs a QC_KERNEL_SUBGROUP kernel with (tests compare it
// with QC_SUBGROUP_SIZE: bitsandbytes' bf16 gemv once ran with 8 lanes instead of 32).
QC_KERNEL_SUBGROUP void qc_subgroup_probe(int64_t *out) {
  const auto it = QC_ITEM;
  if (it.get_global_id(0) == 0) out[0] = static_cast<int64_t>(it.get_sub_group().get_local_linear_range());
}
