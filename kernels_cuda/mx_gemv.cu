// linear_mx: y = x @ W^T for an fp4 weight W [N, K] kept quantized (MXFP4: E8M0 scales per 32
// elements; NVFP4: E4M3 scales per 16 and a global scale), activations x [B, K] in fp32 / fp16 /
// bf16 with B = 1..16 per launch (the launcher splits larger B), fp32 accumulation, one rounding
// into x's dtype. Semantics: quantcore/formats/mx.py (linear_mx); tolerance tier
// (quantcore/conformance/bounds.py, linear_mx). Two kernels (backends/cuda/mx.py, linear_mx and
// gemv_tc_takes pick): the CUDA-core gemv below for one input row, fp32 inputs and operands the
// other cannot take; the tensor-core gemv further down for fp16 / bf16 from 2 input rows.
//
// CUDA-core gemv. Memory-bound design for decode: the codes are read exactly once for all B input rows.
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

// CTAs per SM the register allocation must allow: for one input row 6 (24 warps to keep the loads
// in flight: 80 registers; 4 CTAs measured slower at most shapes, docs/performance.md MXG-4), 5 for
// fp16 input (whose conversions spill at 80 registers), 3 for two rows, 2 for more (the
// accumulators need the registers)
template <typename T>
struct GvB1Ctas {
    static constexpr int k = 6;
};
template <>
struct GvB1Ctas<TF16> {
    static constexpr int k = 5;
};
template <typename T, int NB>
constexpr int kGvMinCtas = NB == 1 ? GvB1Ctas<T>::k : (NB == 2 ? 3 : 2);

// (a row's first scale and a column's offset in either layout: mx_common.cuh scale_row_offset /
// scale_col_offset)

// the raw scale byte(s) of unit u of a row (NVFP4: two blocks, in bytes 0 and 1; one 16-bit load
// when the pair is 2-byte aligned)
template <int FMT>
__device__ __forceinline__ u32 gv_load_scales(const u8* srow, int u, bool whole, bool swz, bool pair16) {
    if (FMT == QC_FMT_NVFP4) {
        const int o = scale_col_offset(2 * u, swz);  // columns 2u and 2u + 1 are adjacent in both layouts
        if (pair16 && whole) return qc::ldg_u16(srow + o);
        return qc::ldg_u8(srow + o) | (whole ? qc::ldg_u8(srow + o + 1) << 8 : 0u);
    }
    return qc::ldg_u8(srow + scale_col_offset(u, swz));
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
        srow[r] = scales + scale_row_offset(row, ncols, pcols, swz);
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
    extern "C" __global__ void __launch_bounds__(32 * QC_MXGV_WARPS, qcmx::kGvMinCtas<qcmx::T, NB>)                    \
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

// == The tensor-core gemv (qc_mx_gemv_tc_<fmt>_<dtype>_h<H>): fp16 / bf16 inputs, 2..16 rows ==
// (the launcher's conditions: K % 64 == 0, codes and x 16-byte aligned, scales 2-byte (MXFP4) /
// 4-byte (NVFP4) aligned; one input row, fp32 inputs and everything else run the kernel above.)
//
// Work: the weight's 16-row tiles are split evenly over a persistent grid (CTA b takes tiles
// [T b / G, T (b + 1) / G)); the CTA's 16 warps split that range's (tile, 64-element chunk) list
// evenly, so every shape keeps every warp busy. A warp streams its chunks through a ring of
// QC_MXTC_STAGES shared-memory slots (16 rows x QC_MXTC_CHUNKS chunks of 32 code bytes) filled
// by 16-byte cp.async copies (one copy instruction: 4 rows x 128 contiguous bytes), several
// stages in flight without registers. A tile that one warp covers whole is stored by that warp;
// the pieces of tiles shared by warps are added through shared memory in warp order after one
// barrier (deterministic: no atomics, no workspace).
//
// Products: mma.sync m16n8k16 (fp32 accumulators), the tile's rows as A, input rows as the B
// columns (H column blocks of 8: 1..8 input rows cost one block, 9..16 two). Every mma covers
// one scale block's elements only: MXFP4 (32 elements) lane c takes code word c of the block (its
// 8 elements, one 32-bit shared load per row), the first four in the block's first mma, the other
// four in its second; NVFP4 (16 elements) lane c takes the block's code bytes 2c, 2c + 1 (one
// 16-bit load per row per mma). The activations of a lane are then consecutive elements of its
// input row (16 / 8 bytes per load). A block's mma result (fp32, from zero) is multiplied by the
// block scale and added to the row's fp32 sum in one fma; NVFP4 divides by the global scale at the
// end. Each term: the exact product, the mma's sum, the scaled fma, the division (<= 4 roundings:
// bounds.py's linear_mx argument), the K terms added in fp32.
//
// Decode (exact, no table in memory): four codes at a time. Their 3-bit magnitudes are the
// selectors of one prmt over an 8-byte table held in two registers (QC_E2M1_*: the high bytes of
// the fp16 values, whose low bytes are zero; for bf16 a second prmt for the low bytes); their
// sign bits become 0x00 / 0xFF bytes by one sign-replicating prmt of the code byte and the code
// byte shifted by 4, OR-ed into the high bytes; two more prmts interleave the bytes into the two
// f16x2 / bf16x2 operands (elements (0, 1) and (2, 3)). The operands are the exact E2M1 values.
// Scales: lane (g, c) loads the raw scale bytes of chunk c of rows g and g + 8 a stage ahead (an L2
// prefetch of them goes out with the stage's copies), decodes them at the stage's start into the
// warp's scale buffer, where the quad reads each block's pair with one 8-byte load.
// Launched as a programmatic dependent (runtime.launch_pdl): arguments are read after
// griddepcontrol.wait, dependents are released after the main loop.
namespace qcmx {

constexpr int kTcWarps = QC_MXTC_WARPS;
constexpr int kTcChunks = QC_MXTC_CHUNKS;
constexpr int kTcStages = QC_MXTC_STAGES;
constexpr int kTcPitch = QC_MXTC_PITCH;
constexpr int kTcSlot = 16 * kTcPitch;
constexpr int kTcRing = QC_MXTC_RING;
constexpr int kTcScales = QC_MXTC_SCALES;
constexpr int kTcWarpBytes = kTcRing + kTcScales;
static_assert(kTcPitch == 32 * kTcChunks + 16, "the slot layout the kernel reads");
static_assert(kTcRing == kTcStages * kTcSlot, "the ring the launcher sizes");
static_assert(kTcChunks == 4, "one 16-byte copy per lane and row group per stage; chunk c's scales by lane c");
static_assert(kTcScales == kTcChunks * 4 * 16 * 4, "a stage's decoded scales");
static_assert(QC_MXTC_SMEM == kTcWarps * kTcWarpBytes, "the launcher's dynamic shared memory");

__device__ __forceinline__ u32 tc_prmt(u32 a, u32 b, u32 s) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
    return r;
}
__device__ __forceinline__ u32 tc_lds32(u32 addr) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}
__device__ __forceinline__ u32 tc_lds16(u32 addr) {
    u16 v;
    asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(addr));
    return v;
}
__device__ __forceinline__ void tc_sts_f2(u32 addr, float a, float b) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(a), "f"(b) : "memory");
}
__device__ __forceinline__ void tc_lds_f2(u32 addr, float& a, float& b) {
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(a), "=f"(b) : "r"(addr));
}
__device__ __forceinline__ void tc_ldg_v2(const void* p, u32& a, u32& b) {
    asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(a), "=r"(b) : "l"(p));
}

// codes 0..3 (the low 16 bits of q) -> (e0, e1), (e2, e3) as f16x2 (BF false) or bf16x2, exact
template <bool BF>
__device__ __forceinline__ void tc_decode4(u32 q, u32& r01, u32& r23) {
    const u32 sel = q & 0x7777u;
    // byte i: 0xFF where code i is negative (sign bits: 3 of (q << 4)'s byte 0, 7 of q's byte 0, ...)
    const u32 neg = tc_prmt(q, q << 4, 0x9D8Cu);
    if (BF) {
        const u32 hi = tc_prmt(QC_E2M1_BF16_HI0, QC_E2M1_BF16_HI1, sel) | (neg & 0x80808080u);
        const u32 lo = tc_prmt(QC_E2M1_BF16_LO0, QC_E2M1_BF16_LO1, sel);
        r01 = tc_prmt(lo, hi, 0x5140u);
        r23 = tc_prmt(lo, hi, 0x7362u);
    } else {
        const u32 hi = tc_prmt(QC_E2M1_F16_HI0, QC_E2M1_F16_HI1, sel) | (neg & 0x80808080u);
        r01 = tc_prmt(hi, 0u, 0x1404u);
        r23 = tc_prmt(hi, 0u, 0x3424u);
    }
}

// codes 0..7 of w (an MXFP4 row's word) -> (e0, e1), (e2, e3), (e4, e5), (e6, e7): tc_decode4 of
// both halves, the masks and the shifted copy computed once
template <bool BF>
__device__ __forceinline__ void tc_decode8(u32 w, u32& r01, u32& r23, u32& r45, u32& r67) {
    const u32 sel = w & 0x77777777u, w4 = w << 4;
    const u32 neg_lo = tc_prmt(w, w4, 0x9D8Cu), neg_hi = tc_prmt(w, w4, 0xBFAEu);
    const u32 sel_hi = sel >> 16;
    if (BF) {
        const u32 hl = tc_prmt(QC_E2M1_BF16_HI0, QC_E2M1_BF16_HI1, sel) | (neg_lo & 0x80808080u);
        const u32 hh = tc_prmt(QC_E2M1_BF16_HI0, QC_E2M1_BF16_HI1, sel_hi) | (neg_hi & 0x80808080u);
        const u32 ll = tc_prmt(QC_E2M1_BF16_LO0, QC_E2M1_BF16_LO1, sel);
        const u32 lh = tc_prmt(QC_E2M1_BF16_LO0, QC_E2M1_BF16_LO1, sel_hi);
        r01 = tc_prmt(ll, hl, 0x5140u);
        r23 = tc_prmt(ll, hl, 0x7362u);
        r45 = tc_prmt(lh, hh, 0x5140u);
        r67 = tc_prmt(lh, hh, 0x7362u);
    } else {
        const u32 hl = tc_prmt(QC_E2M1_F16_HI0, QC_E2M1_F16_HI1, sel) | (neg_lo & 0x80808080u);
        const u32 hh = tc_prmt(QC_E2M1_F16_HI0, QC_E2M1_F16_HI1, sel_hi) | (neg_hi & 0x80808080u);
        r01 = tc_prmt(hl, 0u, 0x1404u);
        r23 = tc_prmt(hl, 0u, 0x3424u);
        r45 = tc_prmt(hh, 0u, 0x1404u);
        r67 = tc_prmt(hh, 0u, 0x3424u);
    }
}

// a scale byte -> fp32, exact (as e4m3_value / e8m0_value, without their branches): E4M3's 7 magnitude
// bits placed at fp32 bits 20..26 read as e4m3 * 2^-120 (its subnormals as fp32 subnormals), times
// 2^120; 0x7F / 0xFF and the E8M0 byte 0xFF -> NaN, E8M0 0 -> 2^-127 (an fp32 subnormal)
template <bool NV>
__device__ __forceinline__ float tc_scale(u32 b) {
    if (NV) {
        const float v = __fmul_rn(__uint_as_float((b & 0x7fu) << 20 | (b & 0x80u) << 24), 0x1p120f);
        return (b & 0x7fu) == 0x7fu ? f_nan() : v;
    }
    return b == 255u ? f_nan() : __uint_as_float(b == 0u ? 0x00400000u : b << 23);
}

template <typename T>
struct TcMma;
template <>
struct TcMma<TF16> {
    typedef qc::F16 M;
    static constexpr bool kBf = false;
};
template <>
struct TcMma<TBF16> {
    typedef qc::BF16 M;
    static constexpr bool kBf = true;
};

template <typename T, int FMT, int H>
__device__ __forceinline__ void mx_gemv_tc_impl(const u16* __restrict__ x, const u8* __restrict__ codes,
                                                const u8* __restrict__ scales, const float* __restrict__ gscale,
                                                u16* __restrict__ out, int nrows, int n, int k, int pcols, int flags) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    using M = typename TcMma<T>::M;
    constexpr bool BF = TcMma<T>::kBf;
    constexpr bool NV = FMT == QC_FMT_NVFP4;
    constexpr int NBLK = NV ? 4 : 2;  // scale blocks per chunk
    constexpr int S = kTcStages, CH = kTcChunks;
    constexpr int kPart = H * 128;    // floats of one warp's partial tile
    static_assert(2 * kPart * 4 <= kTcRing, "a warp's partial tiles fit in its ring");
    extern __shared__ __align__(16) u8 tc_smem[];
    __shared__ int ptile[2 * kTcWarps];
    __shared__ int link[2 * kTcWarps];
    qc::require_dynamic_smem(QC_MXTC_SMEM);

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    u8* wring_p = tc_smem + warp * kTcWarpBytes;
    const u32 wring = smem_addr(wring_p);
    const u32 wsc = wring + kTcRing;
    const bool swz = flags & kGvSwizzled;
    const int ncols = k / (NV ? QC_NVFP4_BLOCK : QC_MX_BLOCK);

    const int ntiles = (n + 15) >> 4;
    const int t0 = (int)((i64)ntiles * blockIdx.x / gridDim.x);
    const int t1 = (int)((i64)ntiles * (blockIdx.x + 1) / gridDim.x);
    const int C = k >> 6;  // chunks per row
    const i64 W = (i64)(t1 - t0) * C;
    const int w0 = (int)(W * warp / kTcWarps), w1 = (int)(W * (warp + 1) / kTcWarps);
    if (lane < 2) ptile[2 * warp + lane] = -1;
    const i64 row_bytes = k >> 1;

    // L2 prefetch of the warp's first stages (a hint: it reads nothing into the kernel, so it may
    // precede the dependency wait)
    if (w1 > w0) {
        const int tile = t0 + w0 / C, j = w0 % C;
        const int r = tile * 16 + (lane >> 1);
        const int nb = 32 * min(min(S * CH, C - j), w1 - w0);
        const u8* base = codes + (i64)r * row_bytes + 32 * j;
        for (int off = 128 * (lane & 1); off < nb; off += 256)
            if (r < n) asm volatile("prefetch.global.L2 [%0];" ::"l"(base + off));
    }
    qc::grid_dep_wait();

    struct Cursor {
        int tile, j, nch, left;
    };
    auto stage_len = [&](int j, int left) { return min(CH, min(C - j, left)); };
    Cursor pq{t0 + w0 / C, w0 % C, 0, w1 - w0};
    pq.nch = stage_len(pq.j, pq.left);
    Cursor cq = pq;
    auto advance = [&](Cursor& q) {  // true when the next stage starts a new tile
        q.left -= q.nch;
        q.j += q.nch;
        const bool nt = q.j == C;
        if (nt) {
            q.j = 0;
            ++q.tile;
        }
        q.nch = stage_len(q.j, q.left);
        return nt;
    };
    // scale byte offsets: a row's base, a column's offset (swizzled: 128 x 4 tiles)
    auto srow = [&](int r) { return scale_row_offset(min(r, n - 1), ncols, pcols, swz); };
    auto scol = [&](int col) { return scale_col_offset(col, swz); };

    // producer: lane l copies rows l / 8 + 4 h (h < 4), bytes 16 (l % 8) of the stage's 128 (chunk
    // (l % 8) / 2); rows past N and chunks past the stage are zero-filled
    const int pr = lane >> 3, pc = lane & 7;
    const u8* psrc = nullptr;
    const i64 prow4 = 4 * row_bytes;
    bool pfull = false;
    u32 pok = 0;
    int psa = 0, psb = 0;  // scale row bases of rows g, g + 8 of the producer's tile (L2 prefetch)
    auto producer_tile = [&](int tile) {
        const int r = tile * 16;
        const int rows = min(16, n - r);
        pfull = rows == 16;
        pok = 0;
#pragma unroll
        for (int h = 0; h < 4; ++h) pok |= pr + 4 * h < rows ? 1u << h : 0u;
        psrc = codes + (i64)(r + min(pr, rows - 1)) * row_bytes + 16 * pc;
        psa = srow(r + g);
        psb = srow(r + g + 8);
    };
    const u32 pdst = wring + pr * kTcPitch + 16 * pc;
    auto issue = [&](const Cursor& q, int s) {
        if (q.left > 0) {
            const u8* src = psrc + 32 * q.j;
            const u32 dst = pdst + s * kTcSlot;
            if (q.nch == CH && pfull) {
#pragma unroll
                for (int h = 0; h < 4; ++h) qc::cp_async16(dst + 4 * h * kTcPitch, src + h * prow4);
            } else {
#pragma unroll
                for (int h = 0; h < 4; ++h) {
                    const bool ok = (pc >> 1) < q.nch && (pok >> h & 1u);
                    qc::cp_async16(dst + 4 * h * kTcPitch, ok ? src + h * prow4 : psrc, ok ? 16u : 0u);
                }
            }
            if (c < q.nch) {
                const int o = scol((NV ? 4 : 2) * (q.j + c));
                asm volatile("prefetch.global.L2 [%0];" ::"l"(scales + psa + o));
                asm volatile("prefetch.global.L2 [%0];" ::"l"(scales + psb + o));
            }
        }
        cp_async_commit();  // one group per stage (empty past the end): wait_group counts stages
    };
    if (pq.left > 0) producer_tile(pq.tile);
    for (int s = 0; s < S; ++s) {
        issue(pq, s);
        if (pq.left > 0 && advance(pq) && pq.left > 0) producer_tile(pq.tile);
    }

    // consumer: raw scale words of chunk c (rows g, g + 8) a stage ahead
    int csa = 0, csb = 0;
    auto consumer_tile = [&](int tile) {
        csa = srow(tile * 16 + g);
        csb = srow(tile * 16 + g + 8);
    };
    u32 sr0 = 0, sr1 = 0;
    auto load_scales = [&](const Cursor& q) {
        if (q.left > 0 && c < q.nch) {
            const int o = scol((NV ? 4 : 2) * (q.j + c));
            if (NV) {
                sr0 = qc::ldg_u32(scales + csa + o);
                sr1 = qc::ldg_u32(scales + csb + o);
            } else {
                sr0 = qc::ldg_u16(scales + csa + o);
                sr1 = qc::ldg_u16(scales + csb + o);
            }
        }
    };
    if (cq.left > 0) {
        consumer_tile(cq.tile);
        load_scales(cq);
    }
    const float gs = NV ? qc::ldg_f32(gscale) : 1.0f;
    // this lane's input rows (B column g of each block of 8; rows past the batch read the last row,
    // their columns are never stored)
    const u16* xr[H];
#pragma unroll
    for (int h = 0; h < H; ++h) xr[h] = x + (i64)min(8 * h + g, nrows - 1) * k + (NV ? 4 : 8) * c;

    // the activations of a chunk (MXFP4: 8 per block and input row, NVFP4: 4 per block), loaded a
    // chunk ahead (the next chunk of the stage, else the next stage's first)
    u32 xn[H][8];
    auto load_x = [&](int jc) {
        const i64 e = (i64)jc * 64;
#pragma unroll
        for (int h = 0; h < H; ++h) {
            if (NV) {
#pragma unroll
                for (int m = 0; m < 4; ++m) tc_ldg_v2(xr[h] + e + 16 * m, xn[h][2 * m], xn[h][2 * m + 1]);
            } else {
#pragma unroll
                for (int p = 0; p < 2; ++p)
                    ldg_v4(xr[h] + e + 32 * p, xn[h][4 * p], xn[h][4 * p + 1], xn[h][4 * p + 2], xn[h][4 * p + 3]);
            }
        }
    };
    if (cq.left > 0) load_x(cq.j);

    auto store = [&](int col, int row, float v) {
        if (col < nrows && row < n) {
            if (NV) v = __fdiv_rn(v, gs);
            out[(i64)col * n + row] = T::from_f(v);
        }
    };

    float acc[H][4];
#pragma unroll
    for (int h = 0; h < H; ++h) acc[h][0] = acc[h][1] = acc[h][2] = acc[h][3] = 0.0f;
    float keep[H][4];
    bool have_keep = false;
    int last_slot = -1, nseg = 0, s = 0, seg_j0 = cq.j;
    while (cq.left > 0) {
        // this stage's scales: lane (g, c) decodes chunk c's blocks of rows g, g + 8 into the buffer
        // (entry (chunk, block, g): the pair of rows g, g + 8)
        if (c < cq.nch) {
#pragma unroll
            for (int b = 0; b < NBLK; ++b) {
                const u32 ba = (sr0 >> (8 * b)) & 0xffu, bb = (sr1 >> (8 * b)) & 0xffu;
                const float va = tc_scale<NV>(ba), vb = tc_scale<NV>(bb);
                tc_sts_f2(wsc + ((c * NBLK + b) * 8 + g) * 8, va, vb);
            }
        }
        const int tile = cq.tile, j = cq.j, nch = cq.nch;
        const bool new_tile = advance(cq);
        if (new_tile && cq.left > 0) consumer_tile(cq.tile);
        load_scales(cq);

        cp_async_wait<S - 1>();
        __syncwarp();
        const u32 slot = wring + s * kTcSlot + g * kTcPitch + (NV ? 2 : 4) * c;
#pragma unroll 1
        for (int u = 0; u < nch; ++u) {
            u32 xc[H][8];
#pragma unroll
            for (int h = 0; h < H; ++h)
#pragma unroll
                for (int i = 0; i < 8; ++i) xc[h][i] = xn[h][i];
            const int nj = u + 1 < nch ? j + u + 1 : (cq.left > 0 ? cq.j : -1);
            if (nj >= 0) load_x(nj);
            if (NV) {
#pragma unroll
                for (int m = 0; m < 4; ++m) {
                    const u32 qa = tc_lds16(slot + 32 * u + 8 * m);
                    const u32 qb = tc_lds16(slot + 8 * kTcPitch + 32 * u + 8 * m);
                    u32 af[4];
                    tc_decode4<BF>(qa, af[0], af[2]);
                    tc_decode4<BF>(qb, af[1], af[3]);
                    float sa, sb;
                    tc_lds_f2(wsc + ((u * NBLK + m) * 8 + g) * 8, sa, sb);
#pragma unroll
                    for (int h = 0; h < H; ++h) {
                        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                        qc::mma_16816<M>(d, af, xc[h][2 * m], xc[h][2 * m + 1]);
                        qc::fma_rows(acc[h], d, sa, sb);
                    }
                }
            } else {
#pragma unroll
                for (int p = 0; p < 2; ++p) {
                    const u32 wa = tc_lds32(slot + 32 * u + 16 * p);
                    const u32 wb = tc_lds32(slot + 8 * kTcPitch + 32 * u + 16 * p);
                    u32 a0[4], a1[4];
                    tc_decode8<BF>(wa, a0[0], a0[2], a1[0], a1[2]);
                    tc_decode8<BF>(wb, a0[1], a0[3], a1[1], a1[3]);
                    float sa, sb;
                    tc_lds_f2(wsc + ((u * NBLK + p) * 8 + g) * 8, sa, sb);
#pragma unroll
                    for (int h = 0; h < H; ++h) {
                        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                        qc::mma_16816<M>(d, a0, xc[h][4 * p], xc[h][4 * p + 1]);
                        qc::mma_16816<M>(d, a1, xc[h][4 * p + 2], xc[h][4 * p + 3]);
                        qc::fma_rows(acc[h], d, sa, sb);
                    }
                }
            }
        }
        __syncwarp();  // every lane has read the slot and the scale buffer: refill
        issue(pq, s);
        if (pq.left > 0 && advance(pq) && pq.left > 0) producer_tile(pq.tile);
        s = s + 1 == S ? 0 : s + 1;

        if (cq.left <= 0 || new_tile) {  // a segment (one tile's piece of the range) ends
            if (seg_j0 == 0 && j + nch == C) {  // the whole tile: stored here
                // C fragment: (row g, col 2c), (g, 2c + 1), (g + 8, 2c), (g + 8, 2c + 1)
#pragma unroll
                for (int h = 0; h < H; ++h)
#pragma unroll
                    for (int r = 0; r < 4; ++r)
                        store(8 * h + 2 * c + (r & 1), tile * 16 + g + 8 * (r >> 1), acc[h][r]);
            } else {  // the range's first piece (kept for the end) or its last (stays in acc)
                qc::end_tile_piece<H>(cq.left > 0, nseg, tile, ptile, warp, lane, acc, keep, have_keep, last_slot);
            }
            qc::next_tile_segment<H>(cq.left > 0, nseg, acc);
            seg_j0 = 0;
        }
    }
    // the pieces go to the warp's ring (drained now)
    cp_async_wait<0>();
    __syncwarp();
    qc::stash_tile_pieces<H>(reinterpret_cast<float*>(wring_p), kPart, have_keep, last_slot, keep, acc);
    qc::grid_dep_launch();
    __syncthreads();
    // tiles shared by warps: the pieces added in warp order
    qc::link_tile_pieces(ptile, link, 2 * kTcWarps);
    __syncthreads();
    auto part_of = [&](int i, int e) {
        return reinterpret_cast<const float*>(tc_smem + (i >> 1) * kTcWarpBytes)[(i & 1) * kPart + e];
    };
    for (int idx = threadIdx.x; idx < 2 * kTcWarps * kPart; idx += blockDim.x) {
        const int i = idx / kPart, e = idx % kPart;
        const int l = link[i];
        if (l < 0 || !(l & 0x100)) continue;  // not the first piece of a tile
        const float sum = qc::sum_tile_pieces(link, i, l, e, part_of);
        const int h = e >> 7, ln = (e >> 2) & 31, r = e & 3;
        store(8 * h + 2 * (ln & 3) + (r & 1), ptile[i] * 16 + (ln >> 2) + 8 * (r >> 1), sum);
    }
#endif
}

}  // namespace qcmx

// -- entry points: qc_mx_gemv_tc_<fmt>_<dtype>_h<H> (H: blocks of 8 input rows, 1 or 2) -----------
#define QCMX_TC(FMTNAME, FMT, DTNAME, T, H)                                                               \
    extern "C" __global__ void __launch_bounds__(32 * QC_MXTC_WARPS, 1) qc_mx_gemv_tc_##FMTNAME##_##DTNAME##_h##H( \
        const qcmx::u16* x, const qcmx::u8* codes, const qcmx::u8* scales, const float* gscale, qcmx::u16* out, \
        int nrows, int n, int k, int pcols, int flags) {                                                  \
        qcmx::mx_gemv_tc_impl<qcmx::T, FMT, H>(x, codes, scales, gscale, out, nrows, n, k, pcols, flags);   \
    }
#define QCMX_TC_H(FMTNAME, FMT, DTNAME, T) \
    QCMX_TC(FMTNAME, FMT, DTNAME, T, 1)     \
    QCMX_TC(FMTNAME, FMT, DTNAME, T, 2)
QCMX_TC_H(mxfp4, QC_FMT_MXFP4, float16, TF16)
QCMX_TC_H(mxfp4, QC_FMT_MXFP4, bfloat16, TBF16)
QCMX_TC_H(nvfp4, QC_FMT_NVFP4, float16, TF16)
QCMX_TC_H(nvfp4, QC_FMT_NVFP4, bfloat16, TBF16)
