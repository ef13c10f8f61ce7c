// linear_mx: y = x @ W^T for an fp4 weight W [N, K] kept quantized (MXFP4: E8M0 scales per 32
// elements; NVFP4: E4M3 scales per 16 and a global scale), activations x [B, K] in fp32 / fp16 /
// bf16 with B = 1..16 per launch (the launcher splits larger B), fp32 accumulation, one rounding
// into x's dtype. Semantics: quantcore/formats/mx.py (linear_mx); tolerance tier
// (quantcore/conformance/bounds.py, linear_mx).
//
// Memory-bound design for decode: the codes are read exactly once for all B input rows.
// A CTA of QC_MXGV_WARPS warps owns RW consecutive weight rows (RW: 4 for 1..2 input rows, 2 for
// 3..8, 1 for 9..16: the accumulators take RW x B registers; GvRows) and all of K.
// K is cut into units of 32 elements (16 code bytes per row: one MXFP4 block, two NVFP4
// blocks); the CTA's lanes take units u = warp * 32 + lane, stride 32 * warps, so each load
// instruction of a warp reads 512 contiguous bytes of a row. A lane loads its unit's code bytes
// for its RW rows (the next unit's are loaded before the current one is used), and for each
// 8-element word: the 8 activations of each input row once (used for all RW rows), the 8 weights
// of each row decoded once (used for all input rows).
//
// Decode: a nibble's three magnitude bits placed at bits 9..11 of an fp16 (and its sign at bit
// 15) make the fp16 value e2m1 * 2^-14 exactly (the two subnormal codes included): nibbles i and
// i + 4 of a word fill the two halves of one f16x2 with two shifts and two logic operations.
// Products x * (e2m1 * 2^-14) are summed per block in fp32; the block sum is multiplied by 2^14
// (exact) and by the block's scale (E8M0: exact power of two; E4M3: one rounding) and added to
// the row's fp32 total; NVFP4 divides the total by the global scale once (IEEE division). Each
// term thus sees at most four fp32 roundings, the K terms are added in fp32 (the bound's
// arithmetic). One caveat of the 2^-14 factor: a product whose magnitude falls below 2^-126
// (|x| below about 2^-111) is rounded in the fp32 subnormal range before the 2^14 scaling.
//
// The lanes' partial sums are added with warp shuffles, then across the CTA's warps through
// shared memory in warp order (deterministic); warp 0 stores the RW x B outputs.
#include "mx_common.cuh"

namespace qcmx {

constexpr int kGvWarps = QC_MXGV_WARPS;

// weight rows per CTA for NB input rows (kernel_defines.mx_gemv_rows, which the launcher uses)
template <int NB>
struct GvRows {
    static_assert(NB >= 1 && NB <= QC_MXGV_MAX_BATCH, "input rows per launch");
    static constexpr int kRW = NB <= 2 ? QC_MXGV_ROWS : (NB <= 8 ? QC_MXGV_ROWS_B4 : QC_MXGV_ROWS_B16);
};

// flags of the launch (qc_mx_gemv_*): how the operands may be loaded
constexpr int kGvSwizzled = 1;  // scales in the 128x4 tile layout
constexpr int kGvCodes16 = 2;   // codes base 16-byte aligned and K/2 a multiple of 16: v4 loads
constexpr int kGvCodes4 = 4;    // codes base 4-byte aligned (K/2 is a multiple of 8): u32 loads
constexpr int kGvX16 = 8;       // x base 16-byte aligned: vector loads of 8 activations
constexpr int kGvScale16 = 16;  // NVFP4: a unit's two scale bytes 2-byte aligned (one 16-bit load)

// nibbles i and i + 4 of w -> f16x2 (lo: nibble i, hi: nibble i + 4), value e2m1 * 2^-14
template <int I>
__device__ __forceinline__ u32 gv_pair(u32 w) {
    constexpr int kMag = 9 - 4 * I;   // bits 4I..4I+2 -> 9..11
    constexpr int kSign = 12 - 4 * I; // bit 4I+3 -> 15
    const u32 m = kMag >= 0 ? (w << (kMag >= 0 ? kMag : 0)) : (w >> (kMag < 0 ? -kMag : 0));
    const u32 s = w << kSign;
    return (m & 0x0E000E00u) | (s & 0x80008000u);
}

__device__ __forceinline__ void gv_h2f(u32 h, float& lo, float& hi) {
    asm("{.reg .f16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;}"
        : "=f"(lo), "=f"(hi) : "r"(h));
}

// the 8 weights of one code word (element order), each e2m1 * 2^-14
__device__ __forceinline__ void gv_decode8(u32 w, float (&v)[8]) {
    gv_h2f(gv_pair<0>(w), v[0], v[4]);
    gv_h2f(gv_pair<1>(w), v[1], v[5]);
    gv_h2f(gv_pair<2>(w), v[2], v[6]);
    gv_h2f(gv_pair<3>(w), v[3], v[7]);
}

// 8 activations x[e0 .. e0 + 8) as fp32 (e0 a multiple of 8; K a multiple of 16)
template <typename T>
__device__ __forceinline__ void gv_load_x(const typename T::S* x, int e0, bool vec, float (&v)[8]) {
    if (vec) {
        if (T::kPer16 == 8) {
            u32 w[4];
            qc::ldg_v4(x + e0, w[0], w[1], w[2], w[3]);
            T::unpack(w, v);
        } else {
            u32 w[4];
            qc::ldg_v4(x + e0, w[0], w[1], w[2], w[3]);
            T::unpack(w, v);
            qc::ldg_v4(x + e0 + 4, w[0], w[1], w[2], w[3]);
            T::unpack(w, v + 4);
        }
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            if (T::kPer16 == 8) {
                v[i] = T::to_f((typename T::S)qc::ldg_u16(x + e0 + i));
            } else {
                v[i] = __uint_as_float(qc::ldg_u32(x + e0 + i));
            }
        }
    }
}

// the 16 code bytes of unit u of a row (the second 8 bytes only when the unit is whole)
__device__ __forceinline__ void gv_load_codes(const u8* row, int u, bool whole, int flags, u32 (&q)[4]) {
    const u8* p = row + (i64)u * 16;
    if (flags & kGvCodes16) {
        qc::ldg_v4(p, q[0], q[1], q[2], q[3]);  // K/2 % 16 == 0: every unit is whole
    } else if (flags & kGvCodes4) {
        q[0] = qc::ldg_u32(p);
        q[1] = qc::ldg_u32(p + 4);
        q[2] = whole ? qc::ldg_u32(p + 8) : 0u;
        q[3] = whole ? qc::ldg_u32(p + 12) : 0u;
    } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            u32 v = 0;
            if (j < 2 || whole) {
#pragma unroll
                for (int b = 0; b < 4; ++b) v |= qc::ldg_u8(p + 4 * j + b) << (8 * b);
            }
            q[j] = v;
        }
    }
}

// CTAs per SM the register allocation must allow: 4 for one input row (16 warps to keep the
// loads in flight), 3 for two, 2 for more (the accumulators need the registers)
template <int NB>
constexpr int kGvMinCtas = NB == 1 ? 4 : (NB == 2 ? 3 : 2);

// byte offset of a row's first scale: row-major r * ncols; swizzled, the row's place in its
// 128 x 4 tiles (column c then adds (c / 4) * 512 + c % 4)
__device__ __forceinline__ int gv_scale_row(int r, int ncols, int pcols, bool swz) {
    if (!swz) return r * ncols;
    return (r / QC_SWIZZLE_ROWS) * (pcols / QC_SWIZZLE_COLS) * QC_SWIZZLE_TILE_BYTES +
           (r % QC_SWIZZLE_ROW_GROUP) * 16 + ((r % QC_SWIZZLE_ROWS) / QC_SWIZZLE_ROW_GROUP) * 4;
}
__device__ __forceinline__ int gv_scale_col(int c, bool swz) {
    return swz ? (c / QC_SWIZZLE_COLS) * QC_SWIZZLE_TILE_BYTES + (c % QC_SWIZZLE_COLS) : c;
}

// the raw scale byte(s) of unit u of a row (NVFP4: two blocks, in bytes 0 and 1; one 16-bit load
// when the pair is 2-byte aligned)
template <int FMT>
__device__ __forceinline__ u32 gv_load_scales(const u8* srow, int u, bool whole, bool swz, bool pair16) {
    if (FMT == QC_FMT_NVFP4) {
        const int o = gv_scale_col(2 * u, swz);  // columns 2u and 2u + 1 are adjacent in both layouts
        if (pair16 && whole) return qc::ldg_u16(srow + o);
        return qc::ldg_u8(srow + o) | (whole ? qc::ldg_u8(srow + o + 1) << 8 : 0u);
    }
    return qc::ldg_u8(srow + gv_scale_col(u, swz));
}

template <int FMT>
__device__ __forceinline__ float gv_scale_value(u32 b) {
    return FMT == QC_FMT_NVFP4 ? e4m3_value(b & 0xffu) : e8m0_value(b & 0xffu);
}

// word j of a unit's four (a select where the loop over j is not unrolled: no local memory)
__device__ __forceinline__ u32 gv_word(const u32 (&q)[4], int j) {
    return j == 0 ? q[0] : (j == 1 ? q[1] : (j == 2 ? q[2] : q[3]));
}

template <typename T, int FMT, int NB>
__device__ __forceinline__ void mx_gemv_impl(const typename T::S* __restrict__ x, const u8* __restrict__ codes,
                                             const u8* __restrict__ scales, const float* __restrict__ gscale,
                                             typename T::S* __restrict__ out, int nrows, int n, int k,
                                             int pcols, int flags) {
    constexpr int RW = GvRows<NB>::kRW;
    __shared__ float red[kGvWarps][RW * NB];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r0 = blockIdx.x * RW;
    const int kb = k >> 1;                  // code bytes per row
    const int nunits = (k + 31) >> 5;       // the last one half when K % 32 == 16 (NVFP4)
    const bool tail = (k & 31) != 0;
    const int ncols = k / (FMT == QC_FMT_NVFP4 ? QC_NVFP4_BLOCK : QC_MX_BLOCK);
    const bool swz = flags & kGvSwizzled, xvec = flags & kGvX16, pair16 = flags & kGvScale16;
    const u8* rowp[RW];
    const u8* srow[RW];
#pragma unroll
    for (int r = 0; r < RW; ++r) {
        const int row = min(r0 + r, n - 1);  // rows past N: row N-1, never stored
        rowp[r] = codes + (i64)row * kb;
        srow[r] = scales + gv_scale_row(row, ncols, pcols, swz);
    }
    const typename T::S* xb[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b) xb[b] = x + (i64)min(b, nrows - 1) * k;

    float acc[RW][NB];
#pragma unroll
    for (int r = 0; r < RW; ++r)
#pragma unroll
        for (int b = 0; b < NB; ++b) acc[r][b] = 0.0f;

    const int stride = 32 * kGvWarps;
    int u = warp * 32 + lane;
    u32 q[RW][4], sq[RW];  // the next unit's codes and raw scale bytes, loaded a unit ahead
    if (u < nunits) {
        const bool whole = !tail || u + 1 < nunits;
#pragma unroll
        for (int r = 0; r < RW; ++r) {
            gv_load_codes(rowp[r], u, whole, flags, q[r]);
            sq[r] = gv_load_scales<FMT>(srow[r], u, whole, swz, pair16);
        }
    }
    for (; u < nunits; u += stride) {
        const bool whole = !tail || u + 1 < nunits;
        u32 cur[RW][4], sc_raw[RW];
#pragma unroll
        for (int r = 0; r < RW; ++r) {
            sc_raw[r] = sq[r];
#pragma unroll
            for (int j = 0; j < 4; ++j) cur[r][j] = q[r][j];
        }
        const int un = u + stride;
        if (un < nunits) {  // the next unit's codes and scales in flight while this one is used
            const bool wn = !tail || un + 1 < nunits;
#pragma unroll
            for (int r = 0; r < RW; ++r) {
                gv_load_codes(rowp[r], un, wn, flags, q[r]);
                sq[r] = gv_load_scales<FMT>(srow[r], un, wn, swz, pair16);
            }
        }
        float part[RW][NB];
#pragma unroll
        for (int r = 0; r < RW; ++r)
#pragma unroll
            for (int b = 0; b < NB; ++b) part[r][b] = 0.0f;
        const int e0 = u * 32;
        // 16 input rows: one word at a time (all four words' activations at once exceed the
        // register file)
#pragma unroll(NB >= 16 ? 1 : 4)
        for (int j = 0; j < 4; ++j) {
            if (j < 2 || whole) {
                float wv[RW][8];
#pragma unroll
                for (int r = 0; r < RW; ++r) gv_decode8(gv_word(cur[r], j), wv[r]);
#pragma unroll
                for (int b = 0; b < NB; ++b) {
                    float xv[8];
                    gv_load_x<T>(xb[b], e0 + 8 * j, xvec, xv);
#pragma unroll
                    for (int r = 0; r < RW; ++r) {
                        float s = part[r][b];
#pragma unroll
                        for (int i = 0; i < 8; ++i) s = __fmaf_rn(xv[i], wv[r][i], s);
                        part[r][b] = s;
                    }
                }
            }
            if ((FMT == QC_FMT_NVFP4 && j == 1) || j == 3) {  // a block ends: scale its sums
                const bool hi = FMT == QC_FMT_NVFP4 && j == 3;
                if (j == 1 || whole || FMT != QC_FMT_NVFP4) {
#pragma unroll
                    for (int r = 0; r < RW; ++r) {
                        const float sc = gv_scale_value<FMT>(hi ? sc_raw[r] >> 8 : sc_raw[r]);
#pragma unroll
                        for (int b = 0; b < NB; ++b)
                            acc[r][b] = __fadd_rn(acc[r][b], __fmul_rn(__fmul_rn(part[r][b], 16384.0f), sc));
                    }
                }
#pragma unroll
                for (int r = 0; r < RW; ++r)
#pragma unroll
                    for (int b = 0; b < NB; ++b) part[r][b] = 0.0f;
            }
        }
    }
    // lanes -> warp -> CTA (warp order), warp 0 stores
#pragma unroll
    for (int r = 0; r < RW; ++r)
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            float v = acc[r][b];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
            acc[r][b] = v;
        }
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < RW; ++r)
#pragma unroll
            for (int b = 0; b < NB; ++b) red[warp][r * NB + b] = acc[r][b];
    }
    __syncthreads();
    if (warp == 0) {
        const float g = FMT == QC_FMT_NVFP4 ? qc::ldg_f32(gscale) : 1.0f;
        for (int i = lane; i < RW * NB; i += 32) {
            const int r = i / NB, b = i % NB;
            float v = red[0][i];
#pragma unroll
            for (int w = 1; w < kGvWarps; ++w) v = __fadd_rn(v, red[w][i]);
            if (FMT == QC_FMT_NVFP4) v = __fdiv_rn(v, g);
            if (r0 + r < n && b < nrows) out[(i64)b * n + r0 + r] = T::from_f(v);
        }
    }
}

}  // namespace qcmx

// -- entry points: qc_mx_gemv_<fmt>_<dtype>_b<NB> (NB: input rows per launch at most) -----------
#define QCMX_GV(FMTNAME, FMT, DTNAME, T, NB)                                                           \
    extern "C" __global__ void __launch_bounds__(32 * QC_MXGV_WARPS, qcmx::kGvMinCtas<NB>)                    \
        qc_mx_gemv_##FMTNAME##_##DTNAME##_b##NB(                                                        \
        const qcmx::T::S* x, const qcmx::u8* codes, const qcmx::u8* scales, const float* gscale,       \
        qcmx::T::S* out, int nrows, int n, int k, int pcols, int flags) {                              \
        qcmx::mx_gemv_impl<qcmx::T, FMT, NB>(x, codes, scales, gscale, out, nrows, n, k, pcols, flags); \
    }
#define QCMX_GV_NB(FMTNAME, FMT, DTNAME, T) \
    QCMX_GV(FMTNAME, FMT, DTNAME, T, 1)     \
    QCMX_GV(FMTNAME, FMT, DTNAME, T, 2)     \
    QCMX_GV(FMTNAME, FMT, DTNAME, T, 4)     \
    QCMX_GV(FMTNAME, FMT, DTNAME, T, 8)     \
    QCMX_GV(FMTNAME, FMT, DTNAME, T, 16)
#define QCMX_GV_DTYPES(FMTNAME, FMT)              \
    QCMX_GV_NB(FMTNAME, FMT, float32, TF32)       \
    QCMX_GV_NB(FMTNAME, FMT, float16, TF16)       \
    QCMX_GV_NB(FMTNAME, FMT, bfloat16, TBF16)

QCMX_GV_DTYPES(mxfp4, QC_FMT_MXFP4)
QCMX_GV_DTYPES(nvfp4, QC_FMT_NVFP4)
