// NVFP4 / MXFP4 / MXFP8 quantize and dequantize, and the 128x4 scale swizzle, bit-exact with
// quantcore/formats/mx.py (see mx_common.cuh for the conversions and the build flags).
//
// Work split: one thread per scale block (16 or 32 elements of one row). A warp covers
// consecutive blocks of a row, so its loads and code stores are contiguous; the quantize kernel
// writes the scales straight into the requested layout, and in the swizzled layout its grid
// spans the padded [ceil(rows/128)*128, ceil(cols/4)*4] matrix so that the padding is written as
// zeros by the same launch.
#include "mx_common.cuh"

namespace qcmx {

template <int FMT>
struct Fmt {
    static constexpr int kBlk = FMT == QC_FMT_NVFP4 ? QC_NVFP4_BLOCK : QC_MX_BLOCK;
    static constexpr bool kFp4 = FMT != QC_FMT_MXFP8;
    static constexpr int kCodeBytes = kFp4 ? kBlk / 2 : kBlk;  // bytes of codes per block
};

// Loads one block of BLK elements as fp32: 16-byte vector loads when vec (16-byte aligned base;
// every block starts at a multiple of 32 bytes), element loads otherwise.
template <typename T, int BLK>
__device__ __forceinline__ void load_block(const typename T::S* p, bool vec, float (&v)[BLK]) {
    if (vec) {
        constexpr int kVecs = BLK / T::kPer16;
        u32 w[kVecs][4];
#pragma unroll
        for (int i = 0; i < kVecs; ++i) ldg_v4(p + i * T::kPer16, w[i][0], w[i][1], w[i][2], w[i][3]);
#pragma unroll
        for (int i = 0; i < kVecs; ++i) T::unpack(w[i], v + i * T::kPer16);
    } else {
#pragma unroll
        for (int i = 0; i < BLK; ++i) v[i] = T::to_f(p[i]);
    }
}

// Stores NB bytes of codes (NB = 8, 16 or 32) held in NB/4 words.
template <int NB>
__device__ __forceinline__ void store_codes(u8* p, bool vec, const u32 (&w)[NB / 4]) {
    if (vec) {
        if (NB == 8) {
            stg_v2(p, w[0], w[1 % (NB / 4)]);
        } else {
#pragma unroll
            for (int i = 0; i < NB / 16; ++i)
                stg_v4(p + 16 * i, w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
        }
    } else {
#pragma unroll
        for (int i = 0; i < NB; ++i) p[i] = (u8)(w[i / 4] >> (8 * (i % 4)));
    }
}

// ==================================================================================================
// quantize
// ==================================================================================================
// x [rows, ncols*BLK]; codes [rows, ncols*kCodeBytes]; scales row-major [rows, ncols] or swizzled
// with padded width pcols. prow = rows (row-major) or the padded row count (swizzled); pcols =
// ncols (row-major) or the padded width. gscale: NVFP4's fp32 global scale (device, [1]).
// One thread per block (two blocks per thread for NVFP4 measured slower on the H200: 64
// registers, half the resident threads).
// One block: v (BLK values) -> its scale byte and codes (w, kCodeBytes bytes).
template <int FMT>
__device__ __forceinline__ u32 quantize_block(const float (&v)[Fmt<FMT>::kBlk], float g, const float* rcp_tab,
                                              bool rceil, u32 (&w)[Fmt<FMT>::kCodeBytes / 4]) {
    using F = Fmt<FMT>;
    constexpr int BLK = F::kBlk;
    float amax = fabsf(v[0]);
#pragma unroll
    for (int i = 1; i < BLK; ++i) amax = fmax_nan(amax, fabsf(v[i]));
    u32 sbyte;
    float mul;
    if (FMT == QC_FMT_NVFP4) {
        // s8 = e4m3(g * (amax * f32(1/6))); os = g * f32(1/s) (0 for a zero scale). amax >= 0 or
        // NaN, so s8 is in [0, 0x7f] and f32(1/s) comes from the table (correctly rounded).
        sbyte = e4m3x2_code(__fmul_rn(g, __fmul_rn(amax, QC_NVFP4_INV_E2M1_MAX)), 0.0f) & 0xffu;
        mul = sbyte != 0u ? __fmul_rn(g, rcp_tab[sbyte & 0x7fu]) : 0.0f;
    } else if (FMT == QC_FMT_MXFP4) {
        sbyte = e8m0_scale(amax, QC_EMAX_E2M1, QC_MAX_MANTISSA_BITS_E2M1, rceil);
        mul = e8m0_multiplier(sbyte);
    } else {
        sbyte = e8m0_scale(amax, QC_EMAX_E4M3, QC_MAX_MANTISSA_BITS_E4M3, rceil);
        mul = e8m0_multiplier(sbyte);
    }
    if (F::kFp4) {
#pragma unroll
        for (int i = 0; i < BLK / 8; ++i) {
            u32 word = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) word |= e2m1_code(__fmul_rn(v[8 * i + j], mul)) << (4 * j);
            w[i] = word;
        }
    } else {
#pragma unroll
        for (int i = 0; i < BLK / 4; ++i) {
            const u32 lo = e4m3x2_code(__fmul_rn(v[4 * i], mul), __fmul_rn(v[4 * i + 1], mul));
            const u32 hi = e4m3x2_code(__fmul_rn(v[4 * i + 2], mul), __fmul_rn(v[4 * i + 3], mul));
            w[i] = lo | (hi << 16);
        }
    }
    return sbyte;
}

template <typename T, int FMT>
__device__ __forceinline__ void mx_quantize_impl(const typename T::S* __restrict__ x, u8* __restrict__ codes,
                                                 u8* __restrict__ scales, const float* __restrict__ gscale,
                                                 i64 rows, int ncols, i64 prow, int pcols, int swizzled,
                                                 int rceil, int vec) {
    using F = Fmt<FMT>;
    constexpr int BLK = F::kBlk;
    __shared__ float rcp_tab[FMT == QC_FMT_NVFP4 ? 128 : 1];
    if (FMT == QC_FMT_NVFP4) {
        const int tid = threadIdx.y * blockDim.x + threadIdx.x;
        if (tid < 128) rcp_tab[tid] = __frcp_rn(e4m3_value((u32)tid));  // 0x7f: NaN
        __syncthreads();
    }
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= pcols) return;
    const float g = FMT == QC_FMT_NVFP4 ? *gscale : 0.0f;
    const i64 rstep = (i64)gridDim.y * blockDim.y;
    for (i64 r = (i64)blockIdx.y * blockDim.y + threadIdx.y; r < prow; r += rstep) {
        u32 sbyte = 0;
        const bool real = r < rows && c < ncols;
        if (real) {
            float v[BLK];
            load_block<T, BLK>(x + (r * ncols + c) * BLK, vec != 0, v);
            u32 w[F::kCodeBytes / 4];
            sbyte = quantize_block<FMT>(v, g, rcp_tab, rceil != 0, w);
            store_codes<F::kCodeBytes>(codes + (r * ncols + c) * F::kCodeBytes, vec != 0, w);
        }
        if (swizzled) {
            scales[swizzle_offset(r, c, pcols)] = (u8)sbyte;  // padding positions get 0
        } else if (real) {
            scales[r * ncols + c] = (u8)sbyte;
        }
    }
}

// ==================================================================================================
// dequantize
// ==================================================================================================
// out [rows, ncols*BLK] in T; scales row-major [rows, ncols] or swizzled (padded width pcols).
template <typename T, int FMT>
__device__ __forceinline__ void mx_dequantize_impl(const u8* __restrict__ codes, const u8* __restrict__ scales,
                                                   typename T::S* __restrict__ out,
                                                   const float* __restrict__ gscale, i64 rows, int ncols,
                                                   int pcols, int swizzled, int vec) {
    using F = Fmt<FMT>;
    constexpr int BLK = F::kBlk;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= ncols) return;
    const float g = FMT == QC_FMT_NVFP4 ? *gscale : 0.0f;
    const i64 rstep = (i64)gridDim.y * blockDim.y;
    for (i64 r = (i64)blockIdx.y * blockDim.y + threadIdx.y; r < rows; r += rstep) {
        const u32 sb = swizzled ? scales[swizzle_offset(r, c, pcols)] : scales[r * ncols + c];
        const u8* cp = codes + (r * ncols + c) * F::kCodeBytes;
        u32 w[F::kCodeBytes / 4];
        if (vec) {
            if (F::kCodeBytes == 8) {
                const u64 q = *reinterpret_cast<const u64*>(cp);
                w[0] = (u32)q;
                w[1 % (F::kCodeBytes / 4)] = (u32)(q >> 32);
            } else {
#pragma unroll
                for (int i = 0; i < F::kCodeBytes / 16; ++i)
                    ldg_v4(cp + 16 * i, w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
            }
        } else {
#pragma unroll
            for (int i = 0; i < F::kCodeBytes / 4; ++i)
                w[i] = (u32)cp[4 * i] | (u32)cp[4 * i + 1] << 8 | (u32)cp[4 * i + 2] << 16 |
                       (u32)cp[4 * i + 3] << 24;
        }
        float v[BLK];
        if (FMT == QC_FMT_NVFP4) {
            // x = f32(f32(e2m1(q) * s) / g): the product is exact, one IEEE division
            const float s = e4m3_value(sb);
#pragma unroll
            for (int i = 0; i < BLK; ++i)
                v[i] = __fdiv_rn(__fmul_rn(e2m1_value(w[i / 8] >> (4 * (i % 8))), s), g);
        } else {
            const float sc = e8m0_value(sb);
            if (F::kFp4) {
#pragma unroll
                for (int i = 0; i < BLK; ++i) v[i] = __fmul_rn(e2m1_value(w[i / 8] >> (4 * (i % 8))), sc);
            } else {
#pragma unroll
                for (int i = 0; i < BLK; ++i) v[i] = __fmul_rn(e4m3_value((w[i / 4] >> (8 * (i % 4))) & 0xffu), sc);
            }
        }
        typename T::S* op = out + (r * ncols + c) * BLK;
        if (vec) {
#pragma unroll
            for (int i = 0; i < BLK / T::kPer16; ++i) {
                u32 o[4];
                T::pack(v + i * T::kPer16, o);
                stg_v4(op + i * T::kPer16, o[0], o[1], o[2], o[3]);
            }
        } else {
#pragma unroll
            for (int i = 0; i < BLK; ++i) op[i] = T::from_f(v[i]);
        }
    }
}

// ==================================================================================================
// swizzle / unswizzle
// ==================================================================================================
// One thread per 4 consecutive scales of a row (4 bytes that are contiguous in both layouts).
// aligned: the swizzled buffer's base is 4-byte aligned (word access).
__device__ __forceinline__ void swizzle_impl(const u8* __restrict__ s, u8* __restrict__ out, i64 rows, int cols,
                                             i64 prow, int pcols, int aligned) {
    const int c4 = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (c4 >= pcols) return;
    const i64 rstep = (i64)gridDim.y * blockDim.y;
    for (i64 r = (i64)blockIdx.y * blockDim.y + threadIdx.y; r < prow; r += rstep) {
        u32 word = 0;
        if (r < rows) {
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (c4 + j < cols) word |= (u32)s[r * cols + c4 + j] << (8 * j);
        }
        u8* o = out + swizzle_offset(r, c4, pcols);
        if (aligned) {
            *reinterpret_cast<u32*>(o) = word;
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) o[j] = (u8)(word >> (8 * j));
        }
    }
}

__device__ __forceinline__ void unswizzle_impl(const u8* __restrict__ swz, u8* __restrict__ out, i64 rows, int cols,
                                               int pcols, int aligned) {
    const int c4 = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (c4 >= cols) return;
    const i64 rstep = (i64)gridDim.y * blockDim.y;
    for (i64 r = (i64)blockIdx.y * blockDim.y + threadIdx.y; r < rows; r += rstep) {
        const u8* p = swz + swizzle_offset(r, c4, pcols);
        const u32 word = aligned ? *reinterpret_cast<const u32*>(p)
                                 : ((u32)p[0] | (u32)p[1] << 8 | (u32)p[2] << 16 | (u32)p[3] << 24);
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (c4 + j < cols) out[r * cols + c4 + j] = (u8)(word >> (8 * j));
    }
}

}  // namespace qcmx

// -- entry points (plain C names: the loader needs no name mangling) --------------------------------
#define QCMX_QUANT(FMTNAME, FMT, DTNAME, T)                                                            \
    extern "C" __global__ void __launch_bounds__(256) qc_mx_quantize_##FMTNAME##_##DTNAME(             \
        const qcmx::T::S* x, qcmx::u8* codes, qcmx::u8* scales, const float* gscale, long long rows,   \
        int ncols, long long prow, int pcols, int swizzled, int rceil, int vec) {                      \
        qcmx::mx_quantize_impl<qcmx::T, FMT>(x, codes, scales, gscale, rows, ncols, prow, pcols,       \
                                             swizzled, rceil, vec);                                    \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) qc_mx_dequantize_##FMTNAME##_##DTNAME(           \
        const qcmx::u8* codes, const qcmx::u8* scales, qcmx::T::S* out, const float* gscale,           \
        long long rows, int ncols, int pcols, int swizzled, int vec) {                                 \
        qcmx::mx_dequantize_impl<qcmx::T, FMT>(codes, scales, out, gscale, rows, ncols, pcols,         \
                                               swizzled, vec);                                         \
    }

#define QCMX_QUANT_DTYPES(FMTNAME, FMT)     \
    QCMX_QUANT(FMTNAME, FMT, float32, TF32) \
    QCMX_QUANT(FMTNAME, FMT, float16, TF16) \
    QCMX_QUANT(FMTNAME, FMT, bfloat16, TBF16)

QCMX_QUANT_DTYPES(mxfp4, QC_FMT_MXFP4)
QCMX_QUANT_DTYPES(mxfp8, QC_FMT_MXFP8)
QCMX_QUANT_DTYPES(nvfp4, QC_FMT_NVFP4)

extern "C" __global__ void __launch_bounds__(256) qc_mx_swizzle(const qcmx::u8* s, qcmx::u8* out,
                                                                long long rows, int cols, long long prow,
                                                                int pcols, int aligned) {
    qcmx::swizzle_impl(s, out, rows, cols, prow, pcols, aligned);
}

extern "C" __global__ void __launch_bounds__(256) qc_mx_unswizzle(const qcmx::u8* swz, qcmx::u8* out,
                                                                  long long rows, int cols, int pcols,
                                                                  int aligned) {
    qcmx::unswizzle_impl(swz, out, rows, cols, pcols, aligned);
}
