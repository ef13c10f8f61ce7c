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
        // s8 = e4m3(g * (amax * f32(1/6))); os = g * f32(1/s) (0 for a zero scale, +0 or -0:
        // a negative global scale gives negative scale bytes); f32(1/s) comes from the table of
        // all 256 bytes (correctly rounded).
        sbyte = e4m3x2_code(__fmul_rn(g, __fmul_rn(amax, QC_NVFP4_INV_E2M1_MAX)), 0.0f) & 0xffu;
        mul = (sbyte & 0x7fu) != 0u ? __fmul_rn(g, rcp_tab[sbyte]) : 0.0f;
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
    __shared__ float rcp_tab[FMT == QC_FMT_NVFP4 ? 256 : 1];
    if (FMT == QC_FMT_NVFP4) {
        const int tid = threadIdx.y * blockDim.x + threadIdx.x;  // 256 threads per CTA
        if (tid < 256) rcp_tab[tid] = __frcp_rn(e4m3_value((u32)tid));  // 0x7f / 0xff: NaN
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
// quantize, version 2 (default; version 1 above stays selectable: QUANTCORE_CUDA_TUNE=mx_quant_v=1)
// ==================================================================================================
// Why a second kernel: version 1 gives each thread one scale block straight from global memory,
// so a thread loads, then computes a few hundred instructions, then stores, and nothing of its
// own is in flight while it computes; at 16384^2 bf16 it reached 46-74% of copy bandwidth with
// the issue slots only about a third used (latency-bound, not instruction-bound).
//
// Version 2: a "unit" is 32 consecutive elements of the flat tensor (one MX block, two NVFP4
// blocks; blocks never straddle rows because K % block == 0, so units need no row arithmetic
// except for the scale address). A CTA of 256 threads owns tiles of 256 units; a persistent
// grid walks the tiles, and each warp brings its 32 units of a tile into shared memory by
// coalesced 16-byte cp.async (L2::128B), kStages - 1 tiles ahead of the one it computes (bytes
// in flight without registers; warps never wait for each other). Thread t then computes unit t of the tile from shared memory (the 16-byte
// chunks of a unit are XOR-swizzled so the per-thread reads are bank-conflict free), writes 16
// (fp4) or 32 (fp8) contiguous bytes of codes (a warp writes 512 contiguous bytes) and its scale
// byte(s). Zero padding of the swizzled scales is written by a separate grid-stride loop.
// Element work: amax on the raw 16-bit (or 32-bit) patterns with an integer max of |x| (NaN,
// whose pattern exceeds Inf's, propagates exactly as the reference's max does); E2M1 by one
// fp32 addition whose magic constant comes from the exponent of max(|y|, 1) (3 instructions
// instead of 2 compares + 2 selects); NVFP4's per-block multiplier from a 256-entry table
// os[s8] = (s != 0) ? f32(g * f32(1/s)) : 0 built once per CTA (every s8 byte, so a negative or
// NaN global scale follows the reference too).
//
// Measured on an H200 at 16384^2 bf16 (swizzled scales; docs/performance.md, MX log): version 2
// is faster for mxfp4 (179 us, 89% of copy, 3 CTAs per SM; fewer CTAs per SM is faster still) and
// nvfp4 (245 us vs 273 us), slower for mxfp8, whose two 16-byte code stores per thread land on
// alternate halves of 32-byte sectors (ncu: L2 92% busy at 69% DRAM); the launcher picks the
// faster version per format and input type. NVFP4's scale stores were the rest of its gap: the
// band layout (below; whole 32-byte sectors of swizzled scales) runs 16384^2 bf16 in 173 us
// (quantcore.bench, 93% of copy; ncu 170 us, DRAM 83%, L2 88%) against 245 us for the flat one.
// The MXFP8 pair layout (512 contiguous bytes per code store) measured 215 us under ncu, not
// faster than version 1's 194 us, so it is opt-in (QUANTCORE_CUDA_TUNE=mx_quant_layout=2).
#define QCMX_V2_THREADS QC_MXQ2_THREADS

__device__ __forceinline__ void cp_async16(u32 dst, const void* gptr) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;" ::"r"(dst), "l"(gptr) : "memory");
}

// max of two packed pairs of unsigned 16-bit integers
__device__ __forceinline__ u32 vmax_u16x2(u32 a, u32 b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    u32 r;
    asm("max.u16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
#else
    const u32 lo = max(a & 0xffffu, b & 0xffffu), hi = max(a >> 16, b >> 16);
    return lo | (hi << 16);
#endif
}

// fp32 -> E2M1 code with its sign (bits 0-3), the same function as e2m1_code in mx_common.cuh:
// |y| clamped to 6 (NaN -> 6: code 7), then ONE IEEE addition of M = 2^22, 2^23 + 2 or 2^24 + 8
// for |y| < 2, [2, 4), [4, 6] leaves the code in the low three bits. M is computed from the
// exponent field E of max(|y|, 1) (127, 128 or 129): bits(M) = 0x4A800000 + (E - 127) * 0x800002.
// e2m1_mag_bits returns the bits of that sum: code in bits 0-2, bits 3-22 zero (so byte 0 is the
// magnitude code), the exponent above.
__device__ __forceinline__ u32 e2m1_mag_bits(float y) {
    const float a = fminf(fabsf(y), QC_E2M1_MAX);
    const u32 e = __float_as_uint(fmaxf(a, 1.0f)) >> 23;
    const float m = __uint_as_float(e * 0x800002u + (0x4A800000u - 127u * 0x800002u));
    return __float_as_uint(__fadd_rn(a, m));
}
__device__ __forceinline__ u32 lop3_sel(u32 a, u32 b, u32 mask) {  // (a & mask) | (b & ~mask)
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xE4;" : "=r"(r) : "r"(a), "r"(b), "r"(mask));
    return r;
}
__device__ __forceinline__ u32 e2m1_code_v2(float y) {
    static_assert(QC_E2M1_SIGN_BIT == 8, "the sign of an E2M1 code is bit 3");
    // bits 0-2 from the sum, bit 3 = y's sign (y >> 28 has nothing above bit 3)
    return lop3_sel(e2m1_mag_bits(y), __float_as_uint(y) >> 28, 7u);
}
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}
// Eight codes from 16-bit inputs whose scaled values carry the inputs' signs (a positive finite
// multiplier; no NaN among them): magnitudes from e2m1_mag_bits, two per byte by one LEA
// (byte 0 of t0 + (t1 << 4)), four bytes by three PRMT; the eight sign bits straight from the
// input words (bits 15 and 31) by four sign-replicating PRMT and two LOP3 (0.75 instead of
// 2 instructions per element).
__device__ __forceinline__ u32 fp4_signs16(u32 w0, u32 w1, u32 w2, u32 w3);
__device__ __forceinline__ u32 fp4_pack8_signed16(const u32 (&t)[8], u32 w0, u32 w1, u32 w2, u32 w3) {
    const u32 p0 = t[0] + (t[1] << 4), p1 = t[2] + (t[3] << 4), p2 = t[4] + (t[5] << 4), p3 = t[6] + (t[7] << 4);
    const u32 mag = prmt(prmt(p0, p1, 0x3340u), prmt(p2, p3, 0x3340u), 0x5410u);
    return mag | fp4_signs16(w0, w1, w2, w3);
}

// Sign bits of eight 16-bit inputs (words w0..w3, bits 15 / 31) placed at bit 3 of each nibble.
__device__ __forceinline__ u32 fp4_signs16(u32 w0, u32 w1, u32 w2, u32 w3) {
    const u32 x = prmt(w0, w1, 0xFBD9u), y = prmt(w2, w3, 0xFBD9u);  // sign bytes s0 s2 s1 s3 | s4 s6 s5 s7
    const u32 lo = prmt(x, y, 0x5410u), hi = prmt(x, y, 0x7632u);     // s0 s2 s4 s6 | s1 s3 s5 s7
    return (lo & 0x08080808u) | (hi & 0x80808080u);
}

// MXFP4 from bf16 two elements per instruction (sm_90: add.rn.bf16x2). For a block of scale
// exponent e (byte sb = e + 127), x * 2^-e is exact, and rounding commutes with the power-of-two
// scaling, so instead of scaling x the magic constants are scaled: with a = min(|x|, 6 * 2^e)
// and E the exponent field of max(a, 2^e) (127 + e + L, L = 0, 1, 2 for a / 2^e in [0, 2),
// [2, 4), [4, 6]), the bf16 sum a + M(L) * 2^e, M = 64, 130, 264 (ulp 0.5, 1, 2 times 2^e),
// is exactly rounded to the E2M1 grid and leaves the code in its low three mantissa bits.
// bits(M(L) * 2^e) = (E + 6) << 7 | 2L = (E << 7) + (E << 1) + 768 - 254 - 2e, computed on both
// halves at once from h = bits(max(a, 2^e)) & 0x7f807f80 as h + (h >> 6) + K (no carry or
// borrow crosses the halves). Valid while every constant is a normal bf16 and no input that can
// round to a nonzero code is subnormal: sb in [8, 245] (the caller's fallback covers the rest).
__device__ __forceinline__ bool mxfp4_bf16x2_ok(u32 sb) { return sb - 8u <= 237u; }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define QCMX_HAVE_BF16X2_ADD 1
__device__ __forceinline__ u32 bf16x2_min(u32 a, u32 b) {
    u32 r;
    asm("min.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ u32 bf16x2_max(u32 a, u32 b) {
    u32 r;
    asm("max.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ u32 bf16x2_add(u32 a, u32 b) {
    u32 r;
    asm("add.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
// Eight MXFP4 codes (one packed word) from four bf16x2 input words of a block with byte sb.
__device__ __forceinline__ u32 mxfp4_pack8_bf16x2(u32 w0, u32 w1, u32 w2, u32 w3, u32 c6, u32 p1, u32 kk) {
    const u32 wv[4] = {w0, w1, w2, w3};
    u32 t[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 a = bf16x2_min(wv[i] & 0x7fff7fffu, c6);
        const u32 h = bf16x2_max(a, p1) & 0x7f807f80u;
        t[i] = bf16x2_add(a, h + (h >> 6) + kk);
    }
    // codes at bits 0-2 of bytes 0 and 2 of each t: gather c0 c1 c2 c3, mask, fold nibbles
    const u32 v01 = prmt(t[0], t[1], 0x6420u) & 0x07070707u, v23 = prmt(t[2], t[3], 0x6420u) & 0x07070707u;
    const u32 mag = prmt(v01 + (v01 >> 4), v23 + (v23 >> 4), 0x6420u);
    return mag | fp4_signs16(w0, w1, w2, w3);
}
#endif

// Raw-pattern element access of a unit held as 32-bit words.
template <typename T>
struct Raw;
template <>
struct Raw<TF32> {
    static constexpr int kWords = 32;
    static __device__ __forceinline__ float elem(const u32 (&w)[32], int i) { return __uint_as_float(w[i]); }
    // |x| patterns max over elements [i0, i0 + n): an integer max (NaN > Inf > finite)
    static __device__ __forceinline__ float absmax(const u32 (&w)[32], int i0, int n) {
        u32 m = 0;
#pragma unroll
        for (int i = 0; i < n; ++i) m = max(m, w[i0 + i] & 0x7fffffffu);
        return __uint_as_float(m);
    }
};
template <typename T>
struct Raw16 {
    static constexpr int kWords = 16;
    static __device__ __forceinline__ float elem(const u32 (&w)[16], int i) {
        return T::to_f((u16)(i & 1 ? w[i / 2] >> 16 : w[i / 2] & 0xffffu));
    }
    static __device__ __forceinline__ float absmax(const u32 (&w)[16], int i0, int n) {
        u32 m = 0;
#pragma unroll
        for (int i = 0; i < n / 2; ++i) m = vmax_u16x2(m, w[i0 / 2 + i] & 0x7fff7fffu);
        return T::to_f((u16)max(m & 0xffffu, m >> 16));
    }
};
template <>
struct Raw<TF16> : Raw16<TF16> {};
template <>
struct Raw<TBF16> : Raw16<TBF16> {
    // the bf16 -> fp32 widening is a shift / mask
    static __device__ __forceinline__ float elem(const u32 (&w)[16], int i) {
        return __uint_as_float(i & 1 ? w[i / 2] & 0xffff0000u : w[i / 2] << 16);
    }
};

template <typename T>
struct IsBf16 {
    static constexpr bool value = false;
};
template <>
struct IsBf16<TBF16> {
    static constexpr bool value = true;
};

// One unit of version 2 (32 elements = BPU blocks, raw words w) -> its codes (out) and scale
// bytes (sb).
template <typename T, int FMT>
__device__ __forceinline__ void quantize_unit_v2(const u32 (&w)[Raw<T>::kWords], float g, const float* os_tab,
                                                 bool rceil, bool bf16x2,
                                                 u32 (&out)[Fmt<FMT>::kFp4 ? 4 : 8], u32 (&sb)[32 / Fmt<FMT>::kBlk]) {
    using F = Fmt<FMT>;
    using R = Raw<T>;
    constexpr int BLK = F::kBlk;
    constexpr int BPU = 32 / BLK;
    constexpr int ES = (int)sizeof(typename T::S);
#pragma unroll
    for (int b = 0; b < BPU; ++b) {
        const float amax = R::absmax(w, b * BLK, BLK);
        float mul;
        if (FMT == QC_FMT_NVFP4) {
            sb[b] = e4m3x2_code(__fmul_rn(g, __fmul_rn(amax, QC_NVFP4_INV_E2M1_MAX)), 0.0f) & 0xffu;
            mul = os_tab[sb[b]];
        } else if (FMT == QC_FMT_MXFP4) {
            sb[b] = e8m0_scale(amax, QC_EMAX_E2M1, QC_MAX_MANTISSA_BITS_E2M1, rceil);
            mul = e8m0_multiplier(sb[b]);
        } else {
            sb[b] = e8m0_scale(amax, QC_EMAX_E4M3, QC_MAX_MANTISSA_BITS_E4M3, rceil);
            mul = e8m0_multiplier(sb[b]);
        }
        if (F::kFp4) {
            // fast: the scaled values keep the inputs' signs and no NaN arises (NVFP4: os
            // positive finite or +0; MX: a finite scale). Otherwise MX has a NaN scale
            // (every code 0x7) and NVFP4 takes the per-element path (NaN / Inf / negative os).
            const bool fast = ES == 2 && (FMT == QC_FMT_NVFP4 ? __float_as_uint(mul) < 0x7f800000u
                                                              : sb[b] != (u32)QC_E8M0_NAN);
#ifdef QCMX_HAVE_BF16X2_ADD
            if (FMT == QC_FMT_MXFP4 && bf16x2 && mxfp4_bf16x2_ok(sb[b])) {
                const u32 c6 = (((sb[b] + 2u) << 7) | 0x40u) * 0x10001u;  // 6 * 2^e
                const u32 p1 = (sb[b] << 7) * 0x10001u;                   // 2^e
                const u32 kk = (768u - 2u * sb[b]) * 0x10001u;
#pragma unroll
                for (int q = 0; q < BLK / 8; ++q) {
                    const int wi = (b * BLK + 8 * q) / 2 % R::kWords;
                    out[b * (BLK / 8) + q] =
                        mxfp4_pack8_bf16x2(w[wi], w[(wi + 1) % R::kWords], w[(wi + 2) % R::kWords],
                                           w[(wi + 3) % R::kWords], c6, p1, kk);
                }
            } else
#endif
            if (fast) {
#pragma unroll
                for (int q = 0; q < BLK / 8; ++q) {
                    const int e0 = b * BLK + 8 * q;
                    u32 t[8];
#pragma unroll
                    for (int j = 0; j < 8; ++j) t[j] = e2m1_mag_bits(__fmul_rn(R::elem(w, e0 + j), mul));
                    const int wi = (e0 / 2) % R::kWords;  // (ES == 2 here; the modulo keeps fp32 in range)
                    out[b * (BLK / 8) + q] = fp4_pack8_signed16(t, w[wi], w[(wi + 1) % R::kWords],
                                                                w[(wi + 2) % R::kWords], w[(wi + 3) % R::kWords]);
                }
            } else if (FMT != QC_FMT_NVFP4 && ES == 2) {
#pragma unroll
                for (int q = 0; q < BLK / 8; ++q) out[b * (BLK / 8) + q] = 0x77777777u;
            } else {
#pragma unroll
                for (int q = 0; q < BLK / 8; ++q) {
                    u32 word = 0;
#pragma unroll
                    for (int j = 0; j < 8; ++j)
                        word |= e2m1_code_v2(__fmul_rn(R::elem(w, b * BLK + 8 * q + j), mul)) << (4 * j);
                    out[b * (BLK / 8) + q] = word;
                }
            }
        } else {
#pragma unroll
            for (int q = 0; q < BLK / 4; ++q) {
                const int e0 = b * BLK + 4 * q;
                const u32 lo = e4m3x2_code(__fmul_rn(R::elem(w, e0), mul), __fmul_rn(R::elem(w, e0 + 1), mul));
                const u32 hi = e4m3x2_code(__fmul_rn(R::elem(w, e0 + 2), mul), __fmul_rn(R::elem(w, e0 + 3), mul));
                out[q] = lo | (hi << 16);
            }
        }
    }
}

// Half of an MXFP8 unit: 16 elements in w[0 .. kWords / 2), the other 16 in lane ^ 1 (which calls
// this for the same unit at the same time) -> 16 code bytes (out) and the block's scale byte.
// The two partial maxima are nonnegative or NaN with the sign clear, so the integer max of their
// bits is the block's max with NaN winning, as in the one-thread version.
template <typename T>
__device__ __forceinline__ u32 quantize_half_mxfp8(const u32 (&w)[Raw<T>::kWords], bool rceil, u32 (&out)[4]) {
    using R = Raw<T>;
    const u32 m = __float_as_uint(R::absmax(w, 0, 16));
    const float amax = __uint_as_float(max(m, __shfl_xor_sync(0xffffffffu, m, 1)));
    const u32 sb = e8m0_scale(amax, QC_EMAX_E4M3, QC_MAX_MANTISSA_BITS_E4M3, rceil);
    const float mul = e8m0_multiplier(sb);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const u32 lo = e4m3x2_code(__fmul_rn(R::elem(w, 4 * q), mul), __fmul_rn(R::elem(w, 4 * q + 1), mul));
        const u32 hi = e4m3x2_code(__fmul_rn(R::elem(w, 4 * q + 2), mul), __fmul_rn(R::elem(w, 4 * q + 3), mul));
        out[q] = lo | (hi << 16);
    }
    return sb;
}

// Unit-to-thread layouts of version 2 (the kernel name's letter after "quantize2"):
//  QCMX_FLAT (""): a tile is 256 consecutive units of the flat tensor; thread t computes unit t.
//  QCMX_BAND ("b", NVFP4, swizzled scales, blocks per row a multiple of 4): a tile is one
//    128-row band of 2 units (64 elements, 4 blocks) per row, so its scales are exactly one
//    512-byte swizzle tile. Warp w takes rows 4w + {0..3} + {0, 32, 64, 96} of the band, two
//    lanes per row; its 2-byte scale stores fill two whole 32-byte sectors (the flat layout's
//    byte stores touch 32 sectors per warp and tile). Codes: two lanes write one whole sector.
//  QCMX_PAIR ("p", MXFP8): flat tiles, but lanes 2i and 2i + 1 split unit 16 q + i (q = 0, 1) of
//    the warp's 32 in halves, so each 16-byte code store of the warp writes 512 contiguous bytes
//    (one thread per unit writes two 16-byte halves of 32-byte sectors per instruction).
#define QCMX_FLAT 0
#define QCMX_BAND 1
#define QCMX_PAIR 2

// mode: bit 0 rceil scales, bit 1 no packed bf16x2 MXFP4 path (timing comparisons), bit 2 NVFP4's
// two scale bytes of a unit as one 2-byte store (the launcher checks the alignment: scales base
// even, and an even block count per row when swizzled).
template <typename T, int FMT, int LAYOUT>
__device__ __forceinline__ void mx_quantize_v2_impl(const typename T::S* __restrict__ x, u8* __restrict__ codes,
                                                    u8* __restrict__ scales, const float* __restrict__ gscale,
                                                    u32 nunits, u32 rows, u32 ncols, int ncols_shift, u32 prow,
                                                    u32 pcols, int swizzled, int mode) {
    using F = Fmt<FMT>;
    using R = Raw<T>;
    constexpr int BLK = F::kBlk;
    constexpr int BPU = 32 / BLK;                   // blocks per unit
    constexpr int ES = (int)sizeof(typename T::S);  // bytes per element
    constexpr int UB = 32 * ES;                     // input bytes per unit
    constexpr int CPU = UB / 16;                    // 16-byte chunks per unit (4 or 8)
    constexpr int kStages = ES == 2 ? QC_MXQ2_STAGES_16 : QC_MXQ2_STAGES_32;
    constexpr int kTileUnits = QCMX_V2_THREADS;
    constexpr int kTileBytes = kTileUnits * UB;
    constexpr int kSwzShift = CPU == 4 ? 1 : 0;  // chunk j of unit u sits at slot j ^ ((u >> s) % CPU)
    static_assert(LAYOUT != QCMX_BAND || (BPU == 2 && QC_SWIZZLE_ROWS == 128 && QC_SWIZZLE_COLS == 4 &&
                                          QC_SWIZZLE_ROW_GROUP == 32 && QC_SWIZZLE_TILE_BYTES == 512),
                  "the band layout is NVFP4's: one 512-byte swizzle tile of 128 rows x 4 blocks per tile");
    static_assert(LAYOUT != QCMX_PAIR || FMT == QC_FMT_MXFP8, "the pair layout splits MXFP8 units");
    // MXFP4 from bf16 by packed bf16x2 arithmetic (QUANTCORE_CUDA_TUNE=mx_quant_bf16x2=0: the
    // fp32 path, for a side-by-side timing)
    constexpr bool kBf16x2 = IsBf16<T>::value;
    const bool bf16x2 = kBf16x2 && !(mode & 2);
    const bool rceil = (mode & 1) != 0;
    const bool sst16 = (mode & 4) != 0;
    extern __shared__ __align__(128) u8 qcmx_v2_smem[];
    __shared__ float os_tab[FMT == QC_FMT_NVFP4 ? 256 : 1];
    const int tid = threadIdx.x;

    if (FMT == QC_FMT_NVFP4) {
        const float g = *gscale;
        const float s = e4m3_value((u32)tid);  // 256 threads: every E4M3 byte
        os_tab[tid] = s != 0.0f ? __fmul_rn(g, __frcp_rn(s)) : 0.0f;
        __syncthreads();
    }
    if (swizzled) {  // zero padding: columns [ncols, pcols) of real rows, then rows [rows, prow)
        const u64 dc = pcols - ncols;
        const u64 na = (u64)rows * dc, nall = na + (u64)(prow - rows) * pcols;
        for (u64 i = (u64)blockIdx.x * blockDim.x + tid; i < nall; i += (u64)gridDim.x * blockDim.x) {
            u32 r, c;
            if (i < na) {
                r = (u32)(i / dc);
                c = ncols + (u32)(i - (u64)r * dc);
            } else {
                const u64 j = i - na;
                r = rows + (u32)(j / pcols);
                c = (u32)(j - (u64)(r - rows) * pcols);
            }
            scales[swizzle_offset(r, c, pcols)] = 0;
        }
    }

    // band layout: tile = band * cgroups + p (p: the 4-block column group); units per row upr
    const u32 cgroups = ncols / 4, upr = ncols / 2;
    auto band_split = [&](u32 tile, u32& band, u32& p) {
        band = ncols_shift >= 2 ? tile >> (ncols_shift - 2) : tile / cgroups;
        p = tile - band * cgroups;
    };
    const u32 ntiles = LAYOUT == QCMX_BAND ? (prow / 128) * cgroups : (nunits + kTileUnits - 1) / kTileUnits;
    // Each warp streams its own 32 units of every tile (no CTA barrier in the loop: a warp waits
    // for its own copies and syncs with __syncwarp). Flat: lane l's copy i is warp-local chunk
    // c = l + 32 i: unit 32 w + c / CPU, chunk j = c % CPU = l % CPU, stored at slot
    // j ^ ((unit >> s) % CPU); for CPU = 4 that slot does not depend on i, so copy i sits at
    // dst0 + 512 i (immediate offsets); the global address is always src + 512 i.
    const int lane = tid & 31, warp = tid >> 5;
    const u32 sbase = smem_addr(qcmx_v2_smem);
    auto dst_off = [&](int i) -> u32 {
        const u32 c = lane + 32 * i, u = warp * 32 + c / CPU, j = c % CPU;
        return u * UB + 16 * (j ^ ((u >> kSwzShift) % CPU));
    };
    const u32 dst0 = sbase + dst_off(0);
    const u8* xsrc = reinterpret_cast<const u8*>(x) + warp * 32 * UB + 16 * lane;
    // band: lane l's copy 0 is row j0 = l / (2 CPU) (band row 4 w + j0), unit bh, chunk bjj; the
    // copies of a lane differ only in the row (see issue)
    const u32 bj0 = lane / (2 * CPU), bh = lane % (2 * CPU) / CPU, bjj = lane % CPU;
    const u64 rowbytes = (u64)upr * UB;
    const u64 bsrc0 = (4 * warp + bj0) * rowbytes + bh * UB + 16 * bjj;
    auto bdst_off = [&](int i) -> u32 {
        const u32 u = warp * 32 + 2 * (bj0 + i * (16 / CPU)) + bh;
        return u * UB + 16 * (bjj ^ ((u >> kSwzShift) % CPU));
    };
    const u32 bdst0 = sbase + bdst_off(0);
    // Band: warp-local chunk c = l + 32 i is row j = c / (2 CPU) of the warp's 16 (band row
    // 32 (j / 4) + 4 w + j % 4), unit h = c % (2 CPU) / CPU of the row's two, chunk c % CPU;
    // eight (fp32: sixteen) lanes read one row's 128 (256) contiguous bytes. It lands where the
    // flat layout puts unit 32 w + 2 j + h, which thread 32 w + 2 j + h computes.
    auto issue = [&](u32 tile, int slot) {
        if (tile < ntiles) {
            if (LAYOUT == QCMX_BAND) {
                u32 band, p;
                band_split(tile, band, p);
                const u8* base = reinterpret_cast<const u8*>(x) + (u64)band * 128u * rowbytes + 2u * p * UB + bsrc0;
                const int left = (int)(rows - band * 128u) - (int)(4 * warp + bj0);  // rows of the band from copy 0's
#pragma unroll
                for (int i = 0; i < CPU; ++i) {
                    // copy i is row j0 + i k (k = 16 / CPU rows per copy, j0 < k): band row
                    // 32 (i k / 4) + (i k) % 4 further down than copy 0's
                    constexpr int k = 16 / CPU;
                    const int drl = 32 * ((i * k) / 4) + (i * k) % 4;
                    const u32 dst = CPU == 4 ? bdst0 + slot * kTileBytes + 512 * i
                                             : sbase + slot * kTileBytes + bdst_off(i);
                    if (drl < left) cp_async16(dst, base + (u64)drl * rowbytes);
                }
            } else {
                const u8* src = xsrc + (u64)tile * kTileBytes;
                const u32 left = nunits - tile * kTileUnits;
#pragma unroll
                for (int i = 0; i < CPU; ++i) {
                    const u32 dst = CPU == 4 ? dst0 + slot * kTileBytes + 512 * i
                                             : sbase + slot * kTileBytes + dst_off(i);
                    if (left >= (u32)kTileUnits || warp * 32 + (lane + 32 * i) / CPU < left)
                        cp_async16(dst, src + 512 * i);
                }
            }
        }
        cp_async_commit();  // an empty group keeps the wait count uniform
    };
    // flat scale address of block b (row-major, or swizzled through its row and column)
    auto scale_at = [&](u32 b) -> u8* {
        if (!swizzled) return scales + b;
        const u32 r = ncols_shift >= 0 ? b >> ncols_shift : b / ncols;
        const u32 c = b - r * ncols;
        const u32 tile_i = (r / QC_SWIZZLE_ROWS) * (pcols / QC_SWIZZLE_COLS) + c / QC_SWIZZLE_COLS;
        return scales + (u64)tile_i * QC_SWIZZLE_TILE_BYTES + (r % QC_SWIZZLE_ROW_GROUP) * 16 +
               ((r % QC_SWIZZLE_ROWS) / QC_SWIZZLE_ROW_GROUP) * 4 + (c % QC_SWIZZLE_COLS);
    };

    u32 tile = blockIdx.x;
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) issue(tile + s * gridDim.x, s);

    const float g = FMT == QC_FMT_NVFP4 ? *gscale : 0.0f;
    for (int k = 0; tile < ntiles; ++k, tile += gridDim.x) {
        cp_async_wait<kStages - 2>();
        __syncwarp();  // the warp's part of tile k is in; every lane is done with the slot refilled next
        issue(tile + (kStages - 1) * gridDim.x, (k + kStages - 1) % kStages);
        const u32 slot_base = sbase + (k % kStages) * kTileBytes;

        if (LAYOUT == QCMX_PAIR) {
            // every lane runs both halves (the shuffle needs its partner), stores only real units
            const int h = lane & 1;
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                const u32 su = warp * 32 + 16 * q + (lane >> 1), unit = tile * kTileUnits + su;
                u32 w[R::kWords];
#pragma unroll
                for (int i = 0; i < CPU / 2; ++i) {
                    const u32 jj = h * (CPU / 2) + i;
                    lds_v4(slot_base + su * UB + 16 * (jj ^ ((su >> kSwzShift) % CPU)), w[4 * i], w[4 * i + 1],
                           w[4 * i + 2], w[4 * i + 3]);
                }
                u32 out[4];
                const u32 sb = quantize_half_mxfp8<T>(w, rceil, out);
                if (unit < nunits) {
                    stg_v4(codes + (u64)unit * 32 + 16 * h, out[0], out[1], out[2], out[3]);
                    if (h == 0) *scale_at(unit) = (u8)sb;
                }
            }
            continue;
        }

        u32 unit, band = 0, p = 0;
        if (LAYOUT == QCMX_BAND) {
            band_split(tile, band, p);
            const u32 j = lane >> 1, row = band * 128u + 32 * (j / 4) + 4 * warp + j % 4;
            if (row >= rows) continue;
            unit = row * upr + 2 * p + (lane & 1);
        } else {
            unit = tile * kTileUnits + tid;
            if (unit >= nunits) continue;
        }

        u32 w[R::kWords];
        const u32 ubase = slot_base + tid * UB;
#pragma unroll
        for (int i = 0; i < CPU; ++i)
            lds_v4(ubase + 16 * (i ^ ((tid >> kSwzShift) % CPU)), w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);

        u32 sb[BPU];
        u32 out[F::kFp4 ? 4 : 8];
        quantize_unit_v2<T, FMT>(w, g, os_tab, rceil, bf16x2, out, sb);
        u8* cp = codes + (u64)unit * (F::kFp4 ? 16 : 32);
        stg_v4(cp, out[0], out[1], out[2], out[3]);
        if (!F::kFp4) stg_v4(cp + 16, out[4 % (F::kFp4 ? 4 : 8)], out[5 % (F::kFp4 ? 4 : 8)],
                             out[6 % (F::kFp4 ? 4 : 8)], out[7 % (F::kFp4 ? 4 : 8)]);

        if (LAYOUT == QCMX_BAND) {
            // swizzle tile band * cgroups + p; row r: (r % 32) * 16 + (r % 128 / 32) * 4; block 2h
            const u32 j = lane >> 1;
            const u32 off = (band * (pcols / 4) + p) * 512u + (4 * warp + j % 4) * 16 + (j / 4) * 4 + 2 * (lane & 1);
            *reinterpret_cast<u16*>(scales + off) = (u16)(sb[0] | (sb[BPU - 1] << 8));
        } else if (BPU == 2 && sst16) {
            // blocks 2 unit and 2 unit + 1: adjacent bytes of one row in either layout
            *reinterpret_cast<u16*>(scale_at(unit * BPU)) = (u16)(sb[0] | (sb[BPU - 1] << 8));
        } else if (swizzled) {
            const u32 b0 = unit * BPU;
            u32 r = ncols_shift >= 0 ? b0 >> ncols_shift : b0 / ncols;
            u32 c = b0 - r * ncols;
#pragma unroll
            for (int b = 0; b < BPU; ++b) {
                if (b > 0 && ++c == ncols) {
                    c = 0;
                    ++r;
                }
                const u32 tile_i = (r / QC_SWIZZLE_ROWS) * (pcols / QC_SWIZZLE_COLS) + c / QC_SWIZZLE_COLS;
                scales[(u64)tile_i * QC_SWIZZLE_TILE_BYTES + (r % QC_SWIZZLE_ROW_GROUP) * 16 +
                       ((r % QC_SWIZZLE_ROWS) / QC_SWIZZLE_ROW_GROUP) * 4 + (c % QC_SWIZZLE_COLS)] = (u8)sb[b];
            }
        } else {
#pragma unroll
            for (int b = 0; b < BPU; ++b) scales[unit * BPU + b] = (u8)sb[b];
        }
    }
    cp_async_wait<0>();
}

// ==================================================================================================
// dequantize
// ==================================================================================================
// out [rows, ncols*BLK] in T; scales row-major [rows, ncols] or swizzled (padded width pcols);
// gscale: NVFP4's fp32 global scale (device, [1]) or null (the operand e2m1 * s itself, as the
// GEMM's panels want it: no division).
//
// Work split: a chunk is the E = 16 / sizeof(T) output elements of one 16-byte store (a chunk
// never straddles a block or a row: BLK is a multiple of E). Thread t of a grid of G threads takes
// chunks t, t + G, t + 2G ... kUnroll at a time (all their loads issued before the first store),
// so every warp-wide store covers 512 consecutive bytes and every code load 32 consecutive words.
// Values come from tables in shared memory built once per CTA with the exact per-element formula
// (the reference's rounding, bit for bit): FP4 formats a [256 scale bytes][16 codes] table of
// output values (NVFP4's one IEEE division per pair of entries, +-code, instead of per element);
// MXFP8 the 256 E4M3 values and the 256 E8M0 scales in fp32, one fmul and one conversion per
// element (on sm_89+ with QC_MXDQ_CVT8 the codes go through the hardware's exact E4M3 -> f16
// conversion instead of the table: no shared-memory load per element).
// Block index -> row / block column: a multiply-high division by ncols (div_mul, div_shift from
// the launcher: (umulhi(b, mul) + b) >> shift, exact for b < 2^31). With swizzled scales and
// sstep != 0 the launcher made G a multiple of 128 rows of chunks: the swizzled offset is worked
// out once per thread and then moves by sstep per step (dequantize_grid in backends/cuda/mx.py).
template <int FMT>
__device__ __forceinline__ float dq_value(u32 code, u32 sb, float g, bool has_g) {
    if (FMT == QC_FMT_NVFP4) {
        // x = f32(f32(e2m1(q) * s) / g): the product is exact, one IEEE division
        const float p = __fmul_rn(e2m1_value(code), e4m3_value(sb));
        return has_g ? __fdiv_rn(p, g) : p;
    }
    return __fmul_rn(e2m1_value(code), e8m0_value(sb));
}

// MXFP8 codes by the hardware's E4M3 -> f16 conversion (sm_89+) instead of the table's first half
#if QC_MXDQ_CVT8 && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
constexpr bool kDqCvt8 = true;
#else
constexpr bool kDqCvt8 = false;
#endif

template <typename T, int FMT>
__device__ __forceinline__ void mx_dequantize_impl(const u8* __restrict__ codes, const u8* __restrict__ scales,
                                                   typename T::S* __restrict__ out,
                                                   const float* __restrict__ gscale, u32 nchunks, u32 ncols,
                                                   u32 div_mul, u32 div_shift, u32 tile_row_bytes,
                                                   u32 sstep, int swizzled, int vec) {
    using F = Fmt<FMT>;
    using S = typename T::S;
    constexpr int E = 16 / (int)sizeof(S);             // elements per chunk
    constexpr int CPB = F::kBlk / E;                    // chunks per block (2, 4 or 8)
    constexpr int CSH = CPB == 2 ? 1 : (CPB == 4 ? 2 : 3);
    constexpr int CB = F::kFp4 ? E / 2 : E;             // code bytes per chunk (2, 4 or 8)
    constexpr int CW = CB >= 4 ? CB / 4 : 1;            // code words per chunk
    constexpr int U = QC_MXDQ_UNROLL;
    __shared__ S tab4[F::kFp4 ? 256 * 16 : 1];          // FP4: [scale byte][code] -> output value
    __shared__ float tab8[F::kFp4 ? 1 : 512];           // MXFP8: E4M3 values (unless kDqCvt8), then E8M0 scales
    const bool has_g = FMT == QC_FMT_NVFP4 && gscale != nullptr;
    const float g = has_g ? *gscale : 1.0f;
    if (F::kFp4) {
        // code c | 8 is -e2m1(c): its product and quotient are the negated ones (round to nearest is
        // symmetric), so half the entries (and of NVFP4's divisions) are computed, the rest negated;
        // a NaN is copied as it is (the arithmetic gives the same canonical NaN for both signs)
        for (u32 i = threadIdx.x; i < 256u * 8u; i += blockDim.x) {
            const float v = dq_value<FMT>(i & 7u, i >> 3, g, has_g);
            tab4[(i >> 3) * 16u + (i & 7u)] = T::from_f(v);
            tab4[(i >> 3) * 16u + 8u + (i & 7u)] = T::from_f(v != v ? v : -v);
        }
    } else {
        for (u32 i = threadIdx.x; i < 256u; i += blockDim.x) {
            if (!kDqCvt8) tab8[i] = e4m3_value(i);
            tab8[256 + i] = e8m0_value(i);
        }
    }
    __syncthreads();
    const u32 stride = gridDim.x * blockDim.x;
    // swizzled offset of block b (row-major block index)
    auto swz = [&](u32 b) -> u32 {
        const u32 r = (__umulhi(b, div_mul) + b) >> div_shift;
        const u32 c = b - r * ncols;
        return (r / QC_SWIZZLE_ROWS) * tile_row_bytes + (c / QC_SWIZZLE_COLS) * QC_SWIZZLE_TILE_BYTES +
               (r % QC_SWIZZLE_ROW_GROUP) * 16u + ((r % QC_SWIZZLE_ROWS) / QC_SWIZZLE_ROW_GROUP) * 4u +
               c % QC_SWIZZLE_COLS;
    };
    // sstep != 0 (swizzled only): the launcher made stride a multiple of 128 rows of chunks, so a
    // thread keeps its block column and moves down by whole 128-row tiles: its scale offset moves by
    // sstep per chunk, worked out once
    u32 so0 = sstep != 0u ? swz((blockIdx.x * blockDim.x + threadIdx.x) >> CSH) : 0u;
    for (u32 q0 = blockIdx.x * blockDim.x + threadIdx.x; q0 < nchunks; q0 += U * stride) {
        u32 w[U][CW];
        u32 sb[U];
#pragma unroll
        for (int j = 0; j < U; ++j) {
            const u32 q = q0 + j * stride;
            if (q >= nchunks) break;
            const u32 b = q >> CSH;  // block index (row-major over [rows, ncols])
            const u32 so = sstep != 0u ? so0 + j * sstep : (swizzled ? swz(b) : b);
            sb[j] = __ldg(scales + so);
            const u8* cp = codes + (u64)q * CB;
            if (vec) {
                if (CB == 2) {
                    w[j][0] = __ldg(reinterpret_cast<const u16*>(cp));
                } else if (CB == 4) {
                    w[j][0] = __ldg(reinterpret_cast<const u32*>(cp));
                } else {
                    const uint2 v2 = __ldg(reinterpret_cast<const uint2*>(cp));
                    w[j][0] = v2.x;
                    w[j][CW - 1] = v2.y;
                }
            } else {
#pragma unroll
                for (int i = 0; i < CW; ++i) {
                    u32 x = 0;
#pragma unroll
                    for (int k = 0; k < (CB < 4 ? CB : 4); ++k) x |= (u32)__ldg(cp + 4 * i + k) << (8 * k);
                    w[j][i] = x;
                }
            }
        }
#pragma unroll
        for (int j = 0; j < U; ++j) {
            const u32 q = q0 + j * stride;
            if (q >= nchunks) break;
            u32 o[4];
            if (F::kFp4) {
                const S* t = tab4 + sb[j] * 16u;
                S v[E];
#pragma unroll
                for (int i = 0; i < E; ++i) v[i] = t[(w[j][0] >> (4 * i)) & 15u];
                if (sizeof(S) == 2) {
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                        o[i] = (u32)(u16)v[2 * i] | ((u32)(u16)v[2 * i + 1] << 16);
                } else {
#pragma unroll
                    for (int i = 0; i < 4; ++i) o[i] = __float_as_uint((float)v[i]);
                }
            } else {
                const float sc = tab8[256 + sb[j]];
                float v[E];
                if (kDqCvt8) {  // the codes converted by the hardware: no table load per element
#pragma unroll
                    for (int i = 0; i < E / 4; ++i) e4m3x4_values(w[j][i], v + 4 * i);
#pragma unroll
                    for (int i = 0; i < E; ++i) v[i] = __fmul_rn(v[i], sc);
                } else {
#pragma unroll
                    for (int i = 0; i < E; ++i) v[i] = __fmul_rn(tab8[(w[j][i / 4] >> (8 * (i % 4))) & 0xffu], sc);
                }
                T::pack(v, o);
            }
            S* op = out + (u64)q * E;
            if (vec) {
                // evict-first: the output is a stream nothing here reads again
                asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(op), "r"(o[0]), "r"(o[1]), "r"(o[2]),
                             "r"(o[3]) : "memory");
            } else {
#pragma unroll
                for (int i = 0; i < E; ++i) {
                    const u32 word = o[i * (int)sizeof(S) / 4];
                    if (sizeof(S) == 2) {
                        reinterpret_cast<u16*>(op)[i] = (u16)(word >> (16 * (i & 1)));
                    } else {
                        reinterpret_cast<u32*>(op)[i] = word;
                    }
                }
            }
        }
        so0 += U * sstep;
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
    extern "C" __global__ void __launch_bounds__(QC_MX_THREADS) qc_mx_quantize_##FMTNAME##_##DTNAME(             \
        const qcmx::T::S* x, qcmx::u8* codes, qcmx::u8* scales, const float* gscale, long long rows,   \
        int ncols, long long prow, int pcols, int swizzled, int rceil, int vec) {                      \
        qcmx::mx_quantize_impl<qcmx::T, FMT>(x, codes, scales, gscale, rows, ncols, prow, pcols,       \
                                             swizzled, rceil, vec);                                    \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(QCMX_V2_THREADS) qc_mx_quantize2_##FMTNAME##_##DTNAME(   \
        const qcmx::T::S* x, qcmx::u8* codes, qcmx::u8* scales, const float* gscale, unsigned nunits,  \
        unsigned rows, unsigned ncols, int ncols_shift, unsigned prow, unsigned pcols, int swizzled,      \
        int mode) {                                                                                    \
        qcmx::mx_quantize_v2_impl<qcmx::T, FMT, QCMX_FLAT>(x, codes, scales, gscale, nunits, rows,     \
                                                           ncols, ncols_shift, prow, pcols, swizzled, mode); \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(QC_MXDQ_THREADS) qc_mx_dequantize_##FMTNAME##_##DTNAME(   \
        const qcmx::u8* codes, const qcmx::u8* scales, qcmx::T::S* out, const float* gscale,           \
        unsigned nchunks, unsigned ncols, unsigned div_mul, unsigned div_shift, unsigned tile_row_bytes,   \
        unsigned sstep, int swizzled, int vec) {                                                       \
        qcmx::mx_dequantize_impl<qcmx::T, FMT>(codes, scales, out, gscale, nchunks, ncols, div_mul,    \
                                               div_shift, tile_row_bytes, sstep, swizzled, vec);       \
    }

#define QCMX_QUANT_DTYPES(FMTNAME, FMT)     \
    QCMX_QUANT(FMTNAME, FMT, float32, TF32) \
    QCMX_QUANT(FMTNAME, FMT, float16, TF16) \
    QCMX_QUANT(FMTNAME, FMT, bfloat16, TBF16)

QCMX_QUANT_DTYPES(mxfp4, QC_FMT_MXFP4)
QCMX_QUANT_DTYPES(mxfp8, QC_FMT_MXFP8)
QCMX_QUANT_DTYPES(nvfp4, QC_FMT_NVFP4)

// version 2 in the band (NVFP4) and pair (MXFP8) layouts: qc_mx_quantize2b_nvfp4_<dtype>,
// qc_mx_quantize2p_mxfp8_<dtype>; the same arguments as qc_mx_quantize2_*
#define QCMX_QUANT2L(TAG, FMTNAME, FMT, LAYOUT, DTNAME, T)                                             \
    extern "C" __global__ void __launch_bounds__(QCMX_V2_THREADS) qc_mx_quantize2##TAG##_##FMTNAME##_##DTNAME( \
        const qcmx::T::S* x, qcmx::u8* codes, qcmx::u8* scales, const float* gscale, unsigned nunits,  \
        unsigned rows, unsigned ncols, int ncols_shift, unsigned prow, unsigned pcols, int swizzled,      \
        int mode) {                                                                                    \
        qcmx::mx_quantize_v2_impl<qcmx::T, FMT, LAYOUT>(x, codes, scales, gscale, nunits, rows, ncols, \
                                                        ncols_shift, prow, pcols, swizzled, mode);     \
    }
#define QCMX_QUANT2L_DTYPES(TAG, FMTNAME, FMT, LAYOUT)          \
    QCMX_QUANT2L(TAG, FMTNAME, FMT, LAYOUT, float32, TF32)      \
    QCMX_QUANT2L(TAG, FMTNAME, FMT, LAYOUT, float16, TF16)      \
    QCMX_QUANT2L(TAG, FMTNAME, FMT, LAYOUT, bfloat16, TBF16)

QCMX_QUANT2L_DTYPES(b, nvfp4, QC_FMT_NVFP4, QCMX_BAND)
QCMX_QUANT2L_DTYPES(p, mxfp8, QC_FMT_MXFP8, QCMX_PAIR)

extern "C" __global__ void __launch_bounds__(QC_MX_THREADS) qc_mx_swizzle(const qcmx::u8* s, qcmx::u8* out,
                                                                long long rows, int cols, long long prow,
                                                                int pcols, int aligned) {
    qcmx::swizzle_impl(s, out, rows, cols, prow, pcols, aligned);
}

extern "C" __global__ void __launch_bounds__(QC_MX_THREADS) qc_mx_unswizzle(const qcmx::u8* swz, qcmx::u8* out,
                                                                  long long rows, int cols, int pcols,
                                                                  int aligned) {
    qcmx::unswizzle_impl(swz, out, rows, cols, pcols, aligned);
}

// scaled_fp4_mm's panel path (backends/cuda/mx.py): *beta = 1 and out[r, :] = bias for every row,
// or *beta = 0 without a bias (the cuBLAS GEMM then computes out = alpha * acc + beta * out).
extern "C" __global__ void __launch_bounds__(QC_MX_THREADS) qc_mx_mm_bias_fill(const qcmx::u16* bias, qcmx::u16* out,
                                                                     float* beta, unsigned long long m,
                                                                     unsigned n) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *beta = bias != nullptr ? 1.0f : 0.0f;
    if (bias == nullptr) return;
    for (unsigned long long r = blockIdx.x; r < m; r += gridDim.x)
        for (unsigned c = threadIdx.x; c < n; c += blockDim.x) out[r * n + c] = bias[c];
}
