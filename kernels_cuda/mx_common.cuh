// Exact element and scale conversions of the MX family (NVFP4, MXFP4, MXFP8), shared by
// mx_quant.cu and mx_gemm.cu. The rules are quantcore/formats/mx.py; every constant comes from
// quantcore_constants.h (QC_*).
//
// Compiled by NVRTC at first use (quantcore/backends/cuda/mx.py) and by nvcc in the tests, with
// -ftz=false --fmad=false (and -prec-div=true): plain float arithmetic is IEEE round-to-nearest
// with subnormals and a*b+c is never contracted. The conversions that decide bits are written
// so that they do not depend on those flags anyway (__fmul_rn, __fadd_rn, __frcp_rn, __fdiv_rn).
// No CUDA header is included: NVRTC and nvcc see the same code without an include path.
//
// Why software conversions: cvt.rn.satfinite.e2m1x2.f32 and the ue8m0 conversions only assemble
// for sm_100a/sm_120a-class targets; on sm_90 E2M1 and E8M0 are done here. E4M3 uses the
// hardware cvt (sm_89+) in the hot MXFP8 path and the software rounding elsewhere; both are
// checked bit for bit against the reference by the tests.
#pragma once
#include "quantcore_constants.h"
#include "qc_common.cuh"

namespace qcmx {

// integer types and the fp16 / bf16 conversions are the backend's common ones
using qc::f16_to_f32;
using qc::f32_to_bf16;
using qc::f32_to_f16;
using qc::i64;
using qc::u16;
using qc::u32;
using qc::u64;
using qc::u8;
using qc::cp_async_commit;
using qc::smem_addr;
using qc::cp_async_wait;
using qc::lds_v4;

__device__ __forceinline__ float f_nan() { return __uint_as_float(0x7fffffffu); }

// NaN-propagating max (max.NaN): the reference's block amax propagates NaN (np.max).
__device__ __forceinline__ float fmax_nan(float a, float b) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// -- E2M1 -------------------------------------------------------------------------------------
// fp32 -> E2M1 code (RNE, satfinite, NaN -> 0x7, sign kept for +-0 and tiny values).
// |y| is clamped to 6 first (fminf returns the non-NaN operand, so NaN and Inf become 6: code
// 7), which equals saturating after rounding because 6 is on the grid. Then ONE IEEE addition
// of a constant M rounds |y| to the grid spacing of its binade and leaves the code in the low
// three mantissa bits: below 2, M = 2^22 (ulp 0.5: the low bits count halves = the code);
// in [2, 4), M = 2^23 + 2 (ulp 1: low bits = round(|y|) + 2); from 4, M = 2^24 + 8 (ulp 2: low
// bits = round(|y|)/2 + 4). The added 2 and 8 are whole even numbers of ulps, so ties still go to
// the even E2M1 code. (Exhaustively equal to the reference on [-8, 8], which the clamp covers.)
// The sign comes from y's sign bit: a NaN produced by arithmetic is the canonical positive NaN
// on NVIDIA GPUs, so NaN gets code 0x7 as the reference requires.
__device__ __forceinline__ u32 e2m1_code(float y) {
    const float a = fminf(fabsf(y), QC_E2M1_MAX);
    const float M = a < 2.0f ? 4194304.0f : (a < 4.0f ? 8388610.0f : 16777224.0f);
    const u32 t = __float_as_uint(__fadd_rn(a, M));
    return (t & 7u) | ((__float_as_uint(y) >> 28) & (u32)QC_E2M1_SIGN_BIT);
}

// E2M1 code (low 4 bits) -> fp32, exact.
__device__ __forceinline__ float e2m1_value(u32 code) {
    const u32 em = code & 7u;
    // em = (e1 e0 m): e = 0 -> m * 0.5; else 2^(e-1) * (1 + m/2)
    const float mag = (em < 2u) ? 0.5f * (float)em
                                : __uint_as_float(((em >> 1) + 126u) << 23 | (em & 1u) << 22);
    return (code & 8u) ? -mag : mag;
}

// -- E4M3 ("fn": no Inf, max 448, NaN = 0x7F) -------------------------------------------------
// Software RNE with saturation, NaN -> 0x7F, -0 -> 0x80. Subnormal range (|v| < 2^-6, spacing
// 2^-9): one IEEE addition of 2^14 (ulp 2^-9) rounds to the grid; normal range: integer RNE of
// the fp32 mantissa to 3 bits.
__device__ __forceinline__ u32 e4m3_code_sw(float v) {
    if (v != v) return QC_E4M3_NAN_CODE;
    const u32 sign = (__float_as_uint(v) >> 24) & 0x80u;
    const float a = fminf(fabsf(v), QC_E4M3_MAX);  // 448 is on the grid: clamp == satfinite
    if (a < 0.015625f) {
        const u32 t = __float_as_uint(__fadd_rn(a, 16384.0f));
        return sign | (t - 0x46800000u);  // 0..8 (8 = 2^-6, the first normal, same encoding)
    }
    u32 u = __float_as_uint(a);
    u = u + 0x7ffffu + ((u >> 20) & 1u);
    return sign | ((u >> 20) - (120u << 3));
}

// Two values at once: byte 0 <- lo, byte 1 <- hi.
__device__ __forceinline__ u32 e4m3x2_code(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    u16 r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return e4m3_code_sw(lo) | (e4m3_code_sw(hi) << 8);
#endif
}

// E4M3 byte -> fp32, exact (0x7F / 0xFF -> NaN).
__device__ __forceinline__ float e4m3_value(u32 b) {
    const u32 e = (b >> 3) & 15u, m = b & 7u;
    float mag;
    if ((b & 0x7fu) == 0x7fu) {
        mag = f_nan();
    } else if (e == 0u) {
        mag = __fmul_rn((float)m, 0.001953125f);  // m * 2^-9, exact
    } else {
        mag = __uint_as_float((e + 120u) << 23 | m << 20);
    }
    return (b & 0x80u) ? -mag : mag;
}

// Four E4M3 bytes of a word (lowest byte first) -> fp32, exact, as e4m3_value (NaN bytes give a NaN):
// on sm_89+ two hardware conversions to f16 pairs (E4M3 is exact in f16), then to fp32.
__device__ __forceinline__ void e4m3x4_values(u32 w, float* v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm("{\n\t.reg .b16 l, h, p, q, r, s;\n\t.reg .b32 x, y;\n\t"
        "mov.b32 {l, h}, %4;\n\tcvt.rn.f16x2.e4m3x2 x, l;\n\tcvt.rn.f16x2.e4m3x2 y, h;\n\t"
        "mov.b32 {p, q}, x;\n\tmov.b32 {r, s}, y;\n\t"
        "cvt.f32.f16 %0, p;\n\tcvt.f32.f16 %1, q;\n\tcvt.f32.f16 %2, r;\n\tcvt.f32.f16 %3, s;\n\t}"
        : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3])
        : "r"(w));
#else
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = e4m3_value((w >> (8 * i)) & 0xffu);
#endif
}

// -- E8M0 -------------------------------------------------------------------------------------
// Block amax (>= 0, or NaN / Inf) -> scale byte. floor: e = floor(log2(amax)) - emax from the
// exponent field; rceil adds one when the mantissa exceeds the element's largest mantissa.
__device__ __forceinline__ u32 e8m0_scale(float amax, int emax, u32 max_mant, bool rceil) {
    const u32 bits = __float_as_uint(amax);
    const int ef = (int)((bits >> 23) & 0xffu);
    if (ef == 0xff) return QC_E8M0_NAN;
    int e = ef - QC_E8M0_BIAS - emax;
    int hi = QC_E8M0_BIAS + 1;
    if (rceil) {
        e += ((bits & 0x7fffffu) > max_mant) ? 1 : 0;
        hi = QC_E8M0_BIAS;
    }
    e = min(max(e, -QC_E8M0_BIAS), hi);
    return (u32)(e + QC_E8M0_BIAS);
}

// The exact factor 2^(127-b) that maps a block into its element range (NaN for 0xFF).
__device__ __forceinline__ float e8m0_multiplier(u32 b) {
    if (b == (u32)QC_E8M0_NAN) return f_nan();
    if (b == 254u) return __uint_as_float(0x00400000u);  // 2^-127, an fp32 subnormal
    return __uint_as_float((254u - b) << 23);
}

// Scale byte -> 2^(b-127) (byte 0 is the fp32 subnormal 2^-127; 0xFF -> NaN).
__device__ __forceinline__ float e8m0_value(u32 b) {
    if (b == (u32)QC_E8M0_NAN) return f_nan();
    if (b == 0u) return __uint_as_float(0x00400000u);
    return __uint_as_float(b << 23);
}

// -- swizzled scale layout (128 x 4 tiles, row-tile-major) ------------------------------------
// Byte offset of scale (r, c) in a swizzled buffer whose padded width is pc (a multiple of 4).
__device__ __forceinline__ i64 swizzle_offset(i64 r, i64 c, i64 pc) {
    const i64 tile = (r / QC_SWIZZLE_ROWS) * (pc / QC_SWIZZLE_COLS) + c / QC_SWIZZLE_COLS;
    return tile * QC_SWIZZLE_TILE_BYTES + (r % QC_SWIZZLE_ROW_GROUP) * 16 +
           ((r % QC_SWIZZLE_ROWS) / QC_SWIZZLE_ROW_GROUP) * 4 + (c % QC_SWIZZLE_COLS);
}
// The same split for the gemvs, in 32-bit int or u32 (their launchers check the scale bytes fit): the
// byte offset of a row's first scale (row-major r * ncols; swizzled, the row's place in its 128 x 4
// tiles), plus that of column c (swizzled: (c / 4) * 512 + c % 4)
template <typename I>
__device__ __forceinline__ I scale_row_offset(I r, I ncols, I pcols, bool swz) {
    if (!swz) return r * ncols;
    return (r / QC_SWIZZLE_ROWS) * (pcols / QC_SWIZZLE_COLS) * QC_SWIZZLE_TILE_BYTES +
           (r % QC_SWIZZLE_ROW_GROUP) * 16 + ((r % QC_SWIZZLE_ROWS) / QC_SWIZZLE_ROW_GROUP) * 4;
}
template <typename I>
__device__ __forceinline__ I scale_col_offset(I c, bool swz) {
    return swz ? (c / QC_SWIZZLE_COLS) * QC_SWIZZLE_TILE_BYTES + (c % QC_SWIZZLE_COLS) : c;
}

// fp16x2 of the two E4M3 bytes in half H (0: bits 0..15, 1: bits 16..31) of w, the byte at the
// higher address in the upper half (exact; sm_89+)
template <int H>
__device__ __forceinline__ u32 e4m3x2_f16x2(u32 w) {
    u32 r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    if (H == 0) {
        asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %1;\ncvt.rn.f16x2.e4m3x2 %0, l;\n}" : "=r"(r) : "r"(w));
    } else {
        asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %1;\ncvt.rn.f16x2.e4m3x2 %0, h;\n}" : "=r"(r) : "r"(w));
    }
#endif
    return r;
}
// fp16x2 (BF: bf16x2) product a * b, rounded once (fma with -0 keeps the sign of a -0 product)
template <bool BF = false>
__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
    u32 r;
    if constexpr (BF)
        asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
    else
        asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
    return r;
}

// -- memory access ----------------------------------------------------------------------------
__device__ __forceinline__ void ldg_v4(const void* p, u32& a, u32& b, u32& c, u32& d) {
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "l"(p));
}
__device__ __forceinline__ void stg_v4(void* p, u32 a, u32 b, u32 c, u32 d) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d)
                 : "memory");
}
__device__ __forceinline__ void stg_v2(void* p, u32 a, u32 b) {
    asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(a), "r"(b) : "memory");
}

// -- input / output element types ---------------------------------------------------------------

// Each tag: storage type S, elements per 16 bytes, conversions of one element, and the 16-byte
// vector unpack / pack used by the hot loops.
struct TF32 {
    typedef float S;
    static constexpr int kPer16 = 4;
    static __device__ __forceinline__ float to_f(S v) { return v; }
    static __device__ __forceinline__ S from_f(float f) { return f; }
    static __device__ __forceinline__ void unpack(const u32 (&w)[4], float* v) {
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = __uint_as_float(w[i]);
    }
    static __device__ __forceinline__ void pack(const float* v, u32 (&w)[4]) {
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = __float_as_uint(v[i]);
    }
};
struct TF16 {
    typedef u16 S;
    static constexpr int kPer16 = 8;
    static __device__ __forceinline__ float to_f(S v) { return f16_to_f32(v); }
    static __device__ __forceinline__ S from_f(float f) { return f32_to_f16(f); }
    static __device__ __forceinline__ void unpack(const u32 (&w)[4], float* v) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[2 * i] = f16_to_f32((u16)(w[i] & 0xffffu));
            v[2 * i + 1] = f16_to_f32((u16)(w[i] >> 16));
        }
    }
    static __device__ __forceinline__ void pack(const float* v, u32 (&w)[4]) {
#pragma unroll
        for (int i = 0; i < 4; ++i)
            asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w[i]) : "f"(v[2 * i + 1]), "f"(v[2 * i]));
    }
};
struct TBF16 {
    typedef u16 S;
    static constexpr int kPer16 = 8;
    static __device__ __forceinline__ float to_f(S v) { return __uint_as_float((u32)v << 16); }
    static __device__ __forceinline__ S from_f(float f) { return f32_to_bf16(f); }
    static __device__ __forceinline__ void unpack(const u32 (&w)[4], float* v) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[2 * i] = __uint_as_float(w[i] << 16);
            v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    }
    static __device__ __forceinline__ void pack(const float* v, u32 (&w)[4]) {
#pragma unroll
        for (int i = 0; i < 4; ++i)
            asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[i]) : "f"(v[2 * i + 1]), "f"(v[2 * i]));
    }
};

}  // namespace qcmx
