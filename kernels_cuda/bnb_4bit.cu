// bitsandbytes 4-bit NF4 / FP4: quantize, dequantize (nested statistics decoded in the same
// kernel) and gemv. Semantics: quantcore/formats/bnb.py (docs/formats.md).
#include "bnb_nested.cuh"

namespace qc {

// ==================================================================================================
// quantize_4bit
// ==================================================================================================
// Rounding a scaled value s to a 4-bit code is "code = number of thresholds t with v > t"
// (v = s for NF4, |s| for FP4). Instead of 15 comparisons per element, v is placed in one of 127
// cells; a per-cell byte says how many thresholds lie surely below the cell, and one comparison
// with the next threshold finishes the count. That is exact for every fp32 v, values a rounding
// away from a cell edge and NaN included, as long as no two thresholds fall in one cell widened
// by the margin; build_cells checks it (the closest thresholds of both tables are 0.08 apart, a
// cell is 1/63 (NF4) or 1/126 (FP4) wide). Per element:
// - u = sat(v / 2 + 1/2) (NF4) or sat(|v|) (FP4) in one fma.sat: NaN -> 0, -inf -> 0, +inf -> 1,
//   so no clamp and no NaN case. The cell is k = rne(126 u), computed as u * (126 * 2^-149):
//   the product rounds onto the subnormal grid (kernels keep subnormals), so the bits of the
//   result are the integer k in [0, 126] - no float-to-int conversion (a quarter-rate
//   instruction), no mask. The rounding of u (2^-25) is covered by the cell margin. A NaN v lands
//   in cell 0 and its comparison is false (count 0); +inf in cell 126 above every threshold.
// - The cell table holds 4 * count, the byte offset of the next threshold, so the threshold is
//   read without an address computation; the codes are packed as 4 * code and shifted back.
// - 16 elements per thread: the correctly rounded reciprocal and the group max are paid once per
//   16 elements; the next 16 elements' loads are issued before this chunk's rounding.
// The two tables stay 128 bytes and 16 words: one word per bank, so a warp's random lookups
// never conflict.
template <int QT>
struct Round4 {
    static constexpr int kNThr = QT == QC_QUANT_NF4 ? QC_NF4_NTHRESHOLDS : QC_FP4_NTHRESHOLDS;
    static __device__ __forceinline__ float thr(int i) {
        return QT == QC_QUANT_NF4 ? kNf4Thresholds[i] : kFp4Thresholds[i];
    }
};

constexpr int kQuantThreads = QC_Q4_THREADS;
constexpr int kQuantElems = QC_Q4_ELEMS;
constexpr int kQuantCtasPerSm = QC_Q4_CTAS_PER_SM;
constexpr int kCells = 128;  // 127 used (k = 0..126)
constexpr float kCellsScale = 126.0f;
constexpr float kCellsMargin = 1.0f / 4096.0f;

struct Round4Cells {
    float thr[16];     // thresholds, padded with +inf
    u8 cell[kCells];   // 4 * (number of thresholds surely below each cell)
    u32 steps;         // FP4: magnitude code of each count, 4 bits per count
    int bad;
};

__device__ __forceinline__ float fma_sat(float a, float b, float c) {
    float d;
    asm("fma.rn.sat.f32 %0, %1, %2, %3;" : "=f"(d) : "f"(a), "f"(b), "f"(c));
    return d;
}

template <int QT>
__device__ __forceinline__ u32 cell_of(float s) {
    const float u = QT == QC_QUANT_NF4 ? fma_sat(s, 0.5f, 0.5f) : fma_sat(fabsf(s), 1.0f, 0.0f);
    return __float_as_uint(__fmul_rn(u, __uint_as_float(126u)));  // 126 * 2^-149 (subnormal)
}

template <int QT>
__device__ void build_cells(Round4Cells& t) {
    using R = Round4<QT>;
    const int i = threadIdx.x;
    if (i == 0) {
        t.bad = 0;
        u32 steps = 0;
        for (int j = 0; j <= QC_FP4_NTHRESHOLDS; ++j) steps |= (u32)kFp4StepCodes[j] << (4 * j);
        t.steps = steps;
    }
    if (i < 16) t.thr[i] = i < R::kNThr ? R::thr(i) : pos_inf();
    __syncthreads();
    if (i < kCells) {
        // u of cell i: [(i - 1/2) / 126, (i + 1/2) / 126]; v = 2u - 1 (NF4) or u (FP4)
        float lo = ((float)i - 0.5f) / kCellsScale, hi = ((float)i + 0.5f) / kCellsScale;
        if (QT == QC_QUANT_NF4) {
            lo = 2.0f * lo - 1.0f;
            hi = 2.0f * hi - 1.0f;
        }
        lo -= kCellsMargin;
        hi += kCellsMargin;
        int below = 0, inside = 0;
        for (int j = 0; j < R::kNThr; ++j) {
            const float th = R::thr(j);
            below += th < lo;
            inside += (th >= lo) && (th <= hi);
        }
        t.cell[i] = (u8)(4 * below);
        if (inside > 1) atomicExch(&t.bad, 1);
    }
    __syncthreads();
    if (t.bad) __trap();
}

// 4 * (the code of s): NF4 4 * count, FP4 4 * (magnitude code | sign)
template <int QT>
__device__ __forceinline__ u32 round4_x4(const Round4Cells& t, float s, u32 steps) {
    const u32 base4 = t.cell[cell_of<QT>(s)];
    const float th = *reinterpret_cast<const float*>(reinterpret_cast<const u8*>(t.thr) + base4);
    if (QT == QC_QUANT_NF4) return s > th ? base4 + 4u : base4;
    const u32 count4 = fabsf(s) > th ? base4 + 4u : base4;
    const u32 mag = (steps >> count4) & 7u;
    return 4u * (mag | (s < 0.0f ? (u32)QC_FP4_SIGN_BIT : 0u));  // sign iff s < 0: -0.0 stays positive
}

// 16 consecutive elements as raw 32-bit words (one or two 16-byte loads per 8 elements)
template <typename T>
struct Raw16 {
    static constexpr int kWords = kQuantElems * T::kBytes / 4;
    u32 w[kWords];
};

template <typename T>
__device__ __forceinline__ void raw16_load(const typename T::S* p, Raw16<T>& r) {
#pragma unroll
    for (int q = 0; q < Raw16<T>::kWords / 4; ++q)
        ldg_v4(reinterpret_cast<const u8*>(p) + 16 * q, r.w[4 * q], r.w[4 * q + 1], r.w[4 * q + 2], r.w[4 * q + 3]);
}

template <typename T>
__device__ __forceinline__ void raw16_to_f(const Raw16<T>& r, float (&v)[kQuantElems]) {
    if constexpr (T::kBytes == 4) {
#pragma unroll
        for (int i = 0; i < kQuantElems; ++i) v[i] = __uint_as_float(r.w[i]);
    } else {
#pragma unroll
        for (int i = 0; i < kQuantElems / 2; ++i) {
            v[2 * i] = T::lo(r.w[i]);
            v[2 * i + 1] = T::hi(r.w[i]);
        }
    }
}

// element loads, 0.0 past n (the format's padding of a partial block)
template <typename T>
__device__ __forceinline__ void elems16_load(const typename T::S* x, i64 e0, i64 n, float (&v)[kQuantElems]) {
#pragma unroll
    for (int i = 0; i < kQuantElems; ++i) {
        float f = 0.0f;
        if (e0 + i < n) {
            if constexpr (T::kBytes == 4) {
                f = ldg_f32(reinterpret_cast<const float*>(x) + e0 + i);
            } else {
                f = T::to_f((u16)ldg_u16(x + e0 + i));
            }
        }
        v[i] = f;
    }
}

// 8 codes (elements c0 .. c0 + 7) as one word of 4 packed bytes, element 2i in the high nibble of
// byte i: nibbles from the most significant down are elements 6, 7, 4, 5, 2, 3, 0, 1. The codes
// come as 4 * code: the 7 low nibbles are accumulated 4x too large (30 bits) and shifted back.
template <int QT>
__device__ __forceinline__ u32 pack8(const Round4Cells& t, const float (&v)[kQuantElems], int c0, float r,
                                        u32 steps) {
    constexpr int kOrder[7] = {7, 4, 5, 2, 3, 0, 1};
    u32 acc = 0;
#pragma unroll
    for (int i = 0; i < 7; ++i) acc = acc * 16u + round4_x4<QT>(t, __fmul_rn(v[c0 + kOrder[i]], r), steps);
    return (acc >> 2) + (round4_x4<QT>(t, __fmul_rn(v[c0 + 6], r), steps) << 26);
}

// the NaN-ignoring max of |v| over one thread's 16 elements
__device__ __forceinline__ float absmax16(const float (&v)[kQuantElems]) {
    float m = fabsf(v[0]);
#pragma unroll
    for (int i = 1; i < kQuantElems; ++i) m = fmaxf(m, fabsf(v[i]));
    return m;
}

// One thread's 16 elements v (zeros past n) with their block's absmax m: m stored to *amax where
// amax is not null, the codes stored at packed[b0 .. b0 + 8) (whole: one 8-byte store, packed
// 8-byte aligned; else byte by byte below nbytes).
template <int QT>
__device__ __forceinline__ void codes16(const Round4Cells& tab, u32 steps, const float (&v)[kQuantElems], float m,
                                        float* amax, u8* packed, i64 b0, bool whole, i64 nbytes) {
    const float r = recip_rn(m);  // correctly rounded; 1/0 = inf and 0*inf = NaN -> code 0
    if (amax) *amax = m;
    const u32 w0 = pack8<QT>(tab, v, 0, r, steps);
    const u32 w1 = pack8<QT>(tab, v, 8, r, steps);
    if (whole) {
        asm volatile("st.global.v2.u32 [%0], {%1, %2};" :: "l"(packed + b0), "r"(w0), "r"(w1) : "memory");
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i)
            if (b0 + i < nbytes) packed[b0 + i] = (u8)((i < 4 ? w0 : w1) >> (8 * (i & 3)));
    }
}

// One thread's 16 elements v (zeros past n): the absmax of the G threads of the block, then
// codes16. Uniform over the CTA when G > 32 (barrier).
template <int QT>
__device__ __forceinline__ void quant16(const Round4Cells& tab, u32 steps, const float (&v)[kQuantElems], int G,
                                        float* red, float* amax, u8* packed, i64 b0, bool whole, i64 nbytes) {
    const float m = group_absmax(absmax16(v), G, red);
    if (G > 32) __syncthreads();  // red[] is rewritten by the next call
    codes16<QT>(tab, steps, v, m, amax, packed, b0, whole, nbytes);
}

// One thread per 16 consecutive elements; G = blocksize / 16 threads per block (2 .. 256; a CTA
// of 256 holds whole blocks).
template <typename T, int QT>
__global__ void __launch_bounds__(kQuantThreads, kQuantCtasPerSm) quantize_4bit_kernel(
    const typename T::S* __restrict__ x, u8* __restrict__ packed, float* __restrict__ absmax,
    i64 n, int log2bs, int vec) {
    __shared__ Round4Cells tab;
    __shared__ float red[kQuantThreads / 32];
    build_cells<QT>(tab);
    const u32 steps = tab.steps;

    const int G = (1 << log2bs) >> 4;
    const i64 nbytes = (n + 1) >> 1;
    const i64 nthreads = (n + kQuantElems - 1) / kQuantElems;
    const i64 stride = (i64)gridDim.x * kQuantThreads;
    i64 t = (i64)blockIdx.x * kQuantThreads + threadIdx.x;
    Raw16<T> raw;
    if (vec && (t + 1) * kQuantElems <= n) raw16_load<T>(x + t * kQuantElems, raw);
    for (; t - threadIdx.x < nthreads; t += stride) {  // uniform over the CTA (barriers inside)
        const i64 e0 = t * kQuantElems;
        float v[kQuantElems];
        const bool whole = vec && e0 + kQuantElems <= n;
        if (whole) {
            raw16_to_f<T>(raw, v);
        } else {
            elems16_load<T>(x, e0, n, v);
        }
        const i64 e1 = e0 + stride * kQuantElems;  // the next chunk's loads go out now
        if (vec && e1 + kQuantElems <= n) raw16_load<T>(x + e1, raw);

        const bool lead = (threadIdx.x & (G - 1)) == 0 && e0 < n;
        quant16<QT>(tab, steps, v, G, red, lead ? absmax + (e0 >> log2bs) : nullptr, packed, e0 >> 1, whole, nbytes);
    }
}

// --------------------------------------------------------------------------------------------------
// quantize_4bit's default kernel for blocksizes up to 512 (G = blocksize / 16 <= 32)
// --------------------------------------------------------------------------------------------------
// The same rounding per element as quantize_4bit_kernel (which takes the larger blocks); what
// changes is around it:
// - the input streams through shared memory by cp.async, S - 1 tiles of 4096 elements ahead per
//   CTA ((S - 1) x 4 x 8 KiB in flight per multiprocessor for 16-bit input). Each warp copies and reads only its own 1/8 of a tile,
//   so warps wait for their own copies (cp.async.wait_group + __syncwarp), never for each other;
// - G is a template argument (the block's absmax is a butterfly of log2(G) shuffles, no runtime
//   mask arithmetic and no CTA barrier), tiles are counted in 32 bits and whole tiles take no
//   bounds checks;
// - 16-bit input: the absmax of the 16 elements in packed max.xorsign.abs (one instruction per
//   two elements) on sm_86 and later;
// - the rounding and the stores are quantize_4bit_kernel's (codes16).
// Lane l's copy i is chunk c = l + 32 i (16 bytes) of its warp's part: element chunk c % CPT of
// thread c / CPT, stored at slot (c % CPT) ^ ((c / CPT >> kSh) % CPT) of that thread's 32 (fp32:
// 64) bytes - so that a quarter warp's 16-byte shared reads (8 threads, one chunk each) hit 8
// different 16-byte bank groups. The slot does not depend on i: copy i lands 512 i bytes after
// copy 0 and reads 512 i bytes after it.
// S = 3 (two tiles ahead): docs/performance.md, log Q-v3.
constexpr int kQ3TileElems = kQuantThreads * kQuantElems;  // 4096
constexpr int kQ3TileLog2 = ilog2(kQ3TileElems);

// absmax16 of 16-bit input from the raw words on sm_86 and later (packed max.xorsign.abs: the
// larger magnitude, NaN only where both are NaN, as fmaxf; the sign bits are dropped at the end);
// otherwise absmax16 of the converted values v
template <typename T>
__device__ __forceinline__ float absmax16_raw(const u32 (&w)[Raw16<T>::kWords], const float (&v)[kQuantElems]) {
#if __CUDA_ARCH__ >= 860
    if constexpr (T::kBytes == 2) {
        u32 a = w[0], b = w[1];
#pragma unroll
        for (int i = 2; i < Raw16<T>::kWords; i += 2) {
            if constexpr (T::kBf16) {
                asm("max.xorsign.abs.bf16x2 %0, %0, %1;" : "+r"(a) : "r"(w[i]));
                asm("max.xorsign.abs.bf16x2 %0, %0, %1;" : "+r"(b) : "r"(w[i + 1]));
            } else {
                asm("max.xorsign.abs.f16x2 %0, %0, %1;" : "+r"(a) : "r"(w[i]));
                asm("max.xorsign.abs.f16x2 %0, %0, %1;" : "+r"(b) : "r"(w[i + 1]));
            }
        }
        if constexpr (T::kBf16) {
            asm("max.xorsign.abs.bf16x2 %0, %0, %1;" : "+r"(a) : "r"(b));
        } else {
            asm("max.xorsign.abs.f16x2 %0, %0, %1;" : "+r"(a) : "r"(b));
        }
        return fmaxf(fabsf(T::lo(a)), fabsf(T::hi(a)));
    }
#endif
    return absmax16(v);
}

template <typename T, int QT, int G, int S>
__global__ void __launch_bounds__(kQuantThreads, kQuantCtasPerSm) quantize_4bit_v3_kernel(
    const typename T::S* __restrict__ x, u8* __restrict__ packed, float* __restrict__ absmax, i64 n, int vec) {
    static_assert(G >= 2 && G <= 32 && (G & (G - 1)) == 0, "2 to 32 threads per block");
    constexpr int kLog2Bs = ilog2(G * kQuantElems);
    constexpr int kTB = kQ3TileElems * T::kBytes;  // tile bytes
    constexpr int kCPT = kQuantElems * T::kBytes / 16;  // 16-byte chunks per thread: 2 or 4
    constexpr int kSh = kCPT == 2 ? 2 : 1;
    extern __shared__ __align__(128) u8 q4v3_smem[];
    require_dynamic_smem(S * kTB);  // S tiles in the ring
    __shared__ Round4Cells tab;
    build_cells<QT>(tab);
    const u32 steps = tab.steps;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 ntiles = (u32)((n + kQ3TileElems - 1) >> kQ3TileLog2);
    const u32 nwhole = vec ? (u32)(n >> kQ3TileLog2) : 0u;  // tiles copied (whole, aligned)
    const u32 sbase = smem_addr(q4v3_smem) + warp * (kTB / 8);
    const u32 dst0 = sbase + (lane / kCPT) * (kTB / kQuantThreads) +
                     16 * ((lane % kCPT) ^ (((lane / kCPT) >> kSh) % kCPT));
    const u8* src0 = reinterpret_cast<const u8*>(x) + warp * (kTB / 8) + 16 * lane;
    const u32 rd0 = sbase + lane * (kTB / kQuantThreads);  // this thread's 32 (64) bytes
    const u32 rsw = (lane >> kSh) % kCPT;

    auto issue = [&](u32 t, int slot) {
        if (t < nwhole) {
            const u8* src = src0 + (u64)t * kTB;
#pragma unroll
            for (int i = 0; i < kCPT; ++i) cp_async16(dst0 + slot * kTB + 512 * i, src + 512 * i);
        }
        cp_async_commit();  // an empty group keeps the wait count uniform
    };

    u32 tile = blockIdx.x;
#pragma unroll
    for (int s = 0; s < S - 1; ++s) issue(tile + s * gridDim.x, s);
    for (int k = 0; tile < ntiles; ++k, tile += gridDim.x) {
        cp_async_wait<S - 2>();
        __syncwarp();  // the warp's part of this tile is in; every lane is done with the slot refilled next
        issue(tile + (S - 1) * gridDim.x, (k + S - 1) % S);

        const i64 e0 = ((i64)tile << kQ3TileLog2) + tid * kQuantElems;
        const bool whole = tile < nwhole;
        float v[kQuantElems];
        float m;
        if (whole) {
            Raw16<T> raw;
            const u32 rd = rd0 + (k % S) * kTB;
#pragma unroll
            for (int j = 0; j < kCPT; ++j)
                lds_v4(rd + 16 * (j ^ rsw), raw.w[4 * j], raw.w[4 * j + 1], raw.w[4 * j + 2], raw.w[4 * j + 3]);
            raw16_to_f<T>(raw, v);
            m = absmax16_raw<T>(raw.w, v);
        } else {  // the partial last tile, or input not 16-byte aligned: element loads, zeros past n
            elems16_load<T>(x, e0, n, v);
            m = absmax16(v);
        }
#pragma unroll
        for (int o = 1; o < G; o <<= 1) m = fmaxf(m, __shfl_xor_sync(kFullMask, m, o));
        const bool lead = (tid & (G - 1)) == 0 && e0 < n;
        codes16<QT>(tab, steps, v, m, lead ? absmax + (e0 >> kLog2Bs) : nullptr, packed, e0 >> 1, whole,
                    (n + 1) >> 1);
    }
    cp_async_wait<0>();
}

// ==================================================================================================
// dequantize_4bit
// ==================================================================================================
// absmax of block b: plain fp32, or (nested) code2[q[b]] * absmax2[b / kNestBlock] + offset with two
// roundings, in that order.
template <bool NESTED>
__device__ __forceinline__ float block_scale(const void* absmax, const float* absmax2, const float* c2,
                                             float offset, i64 b) {
    if (!NESTED) return ldg_f32(reinterpret_cast<const float*>(absmax) + b);
    const u32 q = ldg_u8(reinterpret_cast<const u8*>(absmax) + b);
    return nested_absmax(c2[q], ldg_f32(absmax2 + (b >> kNestLog2)), offset);
}

// The format's 16 codes and (nested) the kDynCodes second-level codes into shared memory; returns the
// nested offset (0 when not nested). Contains a CTA barrier.
template <int QT, bool NESTED>
__device__ __forceinline__ float load_decode_tables(float* lut, float* c2, const float* code2, const float* offset) {
    if (threadIdx.x < 16) lut[threadIdx.x] = code_4bit<QT>(threadIdx.x);
    if (NESTED)
        for (int i = threadIdx.x; i < kDynCodes; i += blockDim.x) c2[i] = ldg_f32(code2 + i);
    __syncthreads();
    return NESTED ? ldg_f32(offset) : 0.0f;
}

constexpr int kDequantThreads = QC_DQ4_THREADS;
constexpr int kDequantWords = QC_DQ4_WORDS;  // packed 32-bit words (8 elements each) per thread

// Each thread decodes kDequantWords packed words spaced a CTA apart, so each load and each
// 8-element store of a warp is contiguous; all loads are issued before the first use.
// Its bound is the access mix (1 byte read per 4 written), not the read latency: docs/performance.md,
// logs WC and RC.
template <typename T, int QT, bool NESTED>
__global__ void __launch_bounds__(kDequantThreads, 4) dequantize_4bit_kernel(
    const u8* __restrict__ packed, const void* __restrict__ absmax, const float* __restrict__ absmax2,
    const float* __restrict__ code2, const float* __restrict__ offset, typename T::S* __restrict__ out,
    i64 n, int log2bs, int vec) {
    __shared__ float lut[16];
    __shared__ float c2[NESTED ? kDynCodes : 1];
    const float off = load_decode_tables<QT, NESTED>(lut, c2, code2, offset);

    const i64 nwords = (n + 7) >> 3;
    for (i64 chunk = blockIdx.x; chunk * (kDequantThreads * kDequantWords) < nwords; chunk += gridDim.x) {
        const i64 first = chunk * (kDequantThreads * kDequantWords) + threadIdx.x;
        // all loads first (words and the raw scale data), then decode: many bytes in flight
        u32 word[kDequantWords], sraw[kDequantWords];
        float s2[kDequantWords];
#pragma unroll
        for (int j = 0; j < kDequantWords; ++j) {
            const i64 e0 = (first + j * kDequantThreads) * 8;
            word[j] = (vec && e0 + 8 <= n) ? ldg_u32(packed + (e0 >> 1)) : 0u;
            const i64 b = e0 < n ? (e0 >> log2bs) : 0;
            if (NESTED) {
                sraw[j] = ldg_u8(reinterpret_cast<const u8*>(absmax) + b);
                s2[j] = ldg_f32(absmax2 + (b >> kNestLog2));
            } else {
                sraw[j] = ldg_u32(reinterpret_cast<const float*>(absmax) + b);
                s2[j] = 0.0f;
            }
        }
#pragma unroll
        for (int j = 0; j < kDequantWords; ++j) {
            const i64 e0 = (first + j * kDequantThreads) * 8;
            if (e0 >= n) continue;
            float v[8];
            if (vec && e0 + 8 <= n) {
                const u32 w = word[j];
                const float sc =
                    NESTED ? nested_absmax(c2[sraw[j]], s2[j], off) : __uint_as_float(sraw[j]);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    v[2 * i] = __fmul_rn(lut[(w >> (8 * i + 4)) & 15u], sc);
                    v[2 * i + 1] = __fmul_rn(lut[(w >> (8 * i)) & 15u], sc);
                }
                store8<T>(out, e0, n, true, v);
            } else {
                // tail or unaligned: element by element; a block may start inside these 8 elements
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const i64 e = e0 + i;
                    if (e < n) {
                        const u32 byte = ldg_u8(packed + (e >> 1));
                        const u32 q = (e & 1) ? (byte & 15u) : (byte >> 4);
                        const float s = block_scale<NESTED>(absmax, absmax2, c2, off, e >> log2bs);
                        v[i] = __fmul_rn(lut[q], s);
                    } else {
                        v[i] = 0.0f;
                    }
                }
                store8<T>(out, e0, n, false, v);
            }
        }
    }
}

// ==================================================================================================
// gemv_4bit, tensor-core path (fp16 / bf16 activations, K % (8 V) == 0, aligned operands)
// ==================================================================================================
// out[b, r] = sum_k a[b, k] * code[q(r, k)] * absmax(r, k). A warp computes a tile of 16 weight
// rows for up to 8 activation rows with mma.m16n8k16 (A = the 4-bit codes as fp16/bf16 values,
// B = the activations, fp32 accumulation). Numerics: T(code) is the only rounding before the fp32
// products; the absmax scale is applied in fp32 to the mma result of each super-piece.
//
// Layout (no shuffles of weights): K is cut into super-pieces of 8V elements (4V bytes per row,
// V = 8 bytes, or 4 when the blocksize is 32, so that a super-piece never straddles a block).
// Lane c of a quad loads its own V contiguous bytes of the super-piece for rows g and g+8 with
// one 8-byte (4-byte) load each: a quad covers 32 contiguous bytes of a row, a whole sector.
// mma step j takes the lane's bytes 2j and 2j+1 as its A columns (2c, 2c+1) and (2c+8, 2c+9);
// any assignment of k to mma columns is right as long as B uses the same one, so the lane's B
// fragment holds the activation pairs of those same bytes: elements [2cV, 2cV + 2V) of the
// super-piece, one or two 16-byte loads. The scale of a super-piece is computed by one lane of
// the quad (lane c for the c-th super-piece of an iteration of 4) and handed out by shuffles.
//
// Decoding a byte (two codes) is two instructions: one byte_perm forms the shared-memory address
// (the byte times 256 plus the lane times 4) and one 32-bit load reads the T pair from the lane's
// own copy of a 256-entry table (rows of 64 words, the first 32 used: never a bank conflict).
// Weights are loaded one iteration ahead (register double buffer). K is split between the warps
// of a CTA when there are too few row tiles; partial sums are added in a fixed order.
constexpr int kGemvWarps = QC_GEMV_MMA_WARPS;
constexpr int kGemvU = QC_GEMV_MMA_U;                      // super-pieces per iteration (one per quad lane)
constexpr int kGemvLutWords = 256 * 64;         // table rows of 256 bytes
constexpr int kGemvSmemBytes = 4 * (kGemvLutWords + kDynCodes + kGemvWarps * 16 * 8);
static_assert(kGemvSmemBytes == QC_GEMV_MMA_SMEM, "the launcher sizes the shared memory from QC_GEMV_MMA_SMEM");

// Byte j of word w looked up in the lane's copy of the pair table (lane4 = lane * 4).
template <int J>
__device__ __forceinline__ u32 lut_pair(const u8* lut, u32 w, u32 lane4) {
    return *reinterpret_cast<const u32*>(lut + __byte_perm(w, lane4, 0x7604u | (J << 4)));
}

template <int V>
__device__ __forceinline__ void ldg_stream_w(const u8* p, u32 (&w)[V / 4]) {
    if constexpr (V == 8) {
        asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
    } else {
        asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(w[0]) : "l"(p));
    }
}

// One iteration's loads: the lane's V bytes of kGemvU super-pieces for rows g and g+8, and the raw
// scale data (absmax bits or nested code byte) of super-piece sp0 + c for both rows.
template <int V>
struct GemvStage {
    u32 w[kGemvU][2][V / 4];
    u32 raw[2];  // the second-level absmax is read at use (an L1 hit): fewer registers
};

template <int V, bool NESTED>
__device__ __forceinline__ void gemv_load_stage(GemvStage<V>& st, const u8* const (&wrow)[2], const i64 (&erow)[2],
                                                i64 sp0, i64 sp_end, int c, const void* absmax,
                                                const float* absmax2, int log2bs) {
#pragma unroll
    for (int u = 0; u < kGemvU; ++u) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if (sp0 + u < sp_end) {
                ldg_stream_w<V>(wrow[r] + (sp0 + u) * (4 * V), st.w[u][r]);
            } else {
#pragma unroll
                for (int i = 0; i < V / 4; ++i) st.w[u][r][i] = 0u;
            }
        }
    }
    const i64 sp = sp0 + c < sp_end ? sp0 + c : sp0;  // a lane past the end reads a valid block
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const i64 blk = (erow[r] + sp * (8 * V)) >> log2bs;
        st.raw[r] = NESTED ? ldg_u8(reinterpret_cast<const u8*>(absmax) + blk)
                           : ldg_u32(reinterpret_cast<const float*>(absmax) + blk);
    }
}

template <typename T, int QT, bool NESTED, int V>
__global__ void __launch_bounds__(kGemvWarps * 32, 2) gemv_4bit_mma_kernel(
    const u16* __restrict__ a, const u8* __restrict__ packed, const void* __restrict__ absmax,
    const float* __restrict__ absmax2, const float* __restrict__ code2, const float* __restrict__ offset,
    u16* __restrict__ out, int batch, i64 N, i64 K, int log2bs, int ksplit) {
    extern __shared__ __align__(16) u32 gemv_smem[];
    u32* lut = gemv_smem;                                        // [256][64]
    float* c2 = reinterpret_cast<float*>(gemv_smem + kGemvLutWords);  // [kDynCodes]
    float* red = c2 + kDynCodes;                                 // [kGemvWarps][16][8]

    for (int i = threadIdx.x; i < 256 * 32; i += blockDim.x) {
        const int byte = i >> 5;
        lut[byte * 64 + (i & 31)] = T::pack2(code_4bit<QT>(byte >> 4), code_4bit<QT>(byte & 15));
    }
    if (NESTED)
        for (int i = threadIdx.x; i < kDynCodes; i += blockDim.x) c2[i] = ldg_f32(code2 + i);
    __syncthreads();
    const float off = NESTED ? ldg_f32(offset) : 0.0f;
    const u8* lutb = reinterpret_cast<const u8*>(lut);

    const int warp = threadIdx.x >> 5, lane = lane_id(), g = lane >> 2, c = lane & 3;
    const u32 lane4 = 4u * (u32)lane;
    const int tiles_per_cta = kGemvWarps / ksplit;
    const int slot = warp / ksplit, ks = warp % ksplit;
    const int b0 = blockIdx.y * 8, nb = min(8, batch - b0);
    const i64 ntiles = (N + 15) >> 4, ngroups = (ntiles + tiles_per_cta - 1) / tiles_per_cta;
    const i64 nsp = K / (8 * V);  // super-pieces per row
    const i64 sp_begin = nsp * ks / ksplit, sp_end = nsp * (ks + 1) / ksplit;
    // batch row of this lane's B fragment; lanes past the batch feed zeros
    const bool has_row = g < nb;
    const u16* arow = a + (i64)(b0 + (has_row ? g : 0)) * K + 2 * c * V;

    for (i64 grp = blockIdx.x; grp < ngroups; grp += gridDim.x) {
        const i64 tile = grp * tiles_per_cta + slot;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (tile < ntiles && sp_begin < sp_end) {  // warp-uniform
            const i64 r0 = min(tile * 16 + g, N - 1), r1 = min(tile * 16 + g + 8, N - 1);
            const u8* const wrow[2] = {packed + ((r0 * K) >> 1) + c * V, packed + ((r1 * K) >> 1) + c * V};
            const i64 erow[2] = {r0 * K, r1 * K};
            GemvStage<V> cur, nxt;
            gemv_load_stage<V, NESTED>(cur, wrow, erow, sp_begin, sp_end, c, absmax, absmax2, log2bs);
            for (i64 sp0 = sp_begin; sp0 < sp_end; sp0 += kGemvU) {
                const int valid = (int)min(sp_end - sp0, (i64)kGemvU);  // super-pieces of this iteration
                // activations (L1/L2 hits: every warp of the grid reads them)
                u32 x[kGemvU][V];
#pragma unroll
                for (int u = 0; u < kGemvU; ++u) {
#pragma unroll
                    for (int h = 0; h < V / 4; ++h) {
                        if (has_row && u < valid) {
                            ldg_v4(arow + (sp0 + u) * (8 * V) + 8 * h, x[u][4 * h], x[u][4 * h + 1], x[u][4 * h + 2],
                                   x[u][4 * h + 3]);
                        } else {
                            x[u][4 * h] = x[u][4 * h + 1] = x[u][4 * h + 2] = x[u][4 * h + 3] = 0u;
                        }
                    }
                }
                if (sp0 + kGemvU < sp_end)
                    gemv_load_stage<V, NESTED>(nxt, wrow, erow, sp0 + kGemvU, sp_end, c, absmax, absmax2, log2bs);
                float sc[2];
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    if (NESTED) {
                        const i64 sp = sp0 + c < sp_end ? sp0 + c : sp0;
                        const float a2 = ldg_f32(absmax2 + (((erow[r] + sp * (8 * V)) >> log2bs) >> kNestLog2));
                        sc[r] = nested_absmax(c2[cur.raw[r]], a2, off);
                    } else {
                        sc[r] = __uint_as_float(cur.raw[r]);
                    }
                }
                // the kGemvU super-pieces' mma chains interleaved (independent accumulators), so a
                // warp does not wait on one mma's result before issuing the next
                float d[kGemvU][4];
#pragma unroll
                for (int u = 0; u < kGemvU; ++u) d[u][0] = d[u][1] = d[u][2] = d[u][3] = 0.0f;
#pragma unroll
                for (int j = 0; j < V / 2; ++j) {
#pragma unroll
                    for (int u = 0; u < kGemvU; ++u) {
                        if (u < valid) {  // warp-uniform
                            const u32 q0 = cur.w[u][0][j >> 1], q1 = cur.w[u][1][j >> 1];
                            u32 af[4];
                            if (j & 1) {
                                af[0] = lut_pair<2>(lutb, q0, lane4);
                                af[1] = lut_pair<2>(lutb, q1, lane4);
                                af[2] = lut_pair<3>(lutb, q0, lane4);
                                af[3] = lut_pair<3>(lutb, q1, lane4);
                            } else {
                                af[0] = lut_pair<0>(lutb, q0, lane4);
                                af[1] = lut_pair<0>(lutb, q1, lane4);
                                af[2] = lut_pair<1>(lutb, q0, lane4);
                                af[3] = lut_pair<1>(lutb, q1, lane4);
                            }
                            mma_16816<T>(d[u], af, x[u][2 * j], x[u][2 * j + 1]);
                        }
                    }
                }
#pragma unroll
                for (int u = 0; u < kGemvU; ++u) {
                    const int src = (lane & ~3) | u;
                    const float s0 = __shfl_sync(kFullMask, sc[0], src);
                    const float s1 = __shfl_sync(kFullMask, sc[1], src);
                    if (u < valid) {  // warp-uniform
                        fma_rows(acc, d[u], s0, s1);
                    }
                }
                cur = nxt;
            }
        }
        // C fragment: (row g, col 2c), (row g, col 2c+1), (row g+8, col 2c), (row g+8, col 2c+1)
        float* rw = red + warp * 128;
        rw[g * 8 + 2 * c] = acc[0];
        rw[g * 8 + 2 * c + 1] = acc[1];
        rw[(g + 8) * 8 + 2 * c] = acc[2];
        rw[(g + 8) * 8 + 2 * c + 1] = acc[3];
        __syncthreads();
        for (int idx = threadIdx.x; idx < tiles_per_cta * 128; idx += blockDim.x) {
            const int s = idx >> 7, col = (idx >> 4) & 7, row = idx & 15;
            const i64 r = (grp * tiles_per_cta + s) * 16 + row;
            if (r < N && col < nb) {
                float sum = red[(s * ksplit) * 128 + row * 8 + col];
                for (int j = 1; j < ksplit; ++j) sum += red[(s * ksplit + j) * 128 + row * 8 + col];
                out[(i64)(b0 + col) * N + r] = T::from_f(sum);
            }
        }
        __syncthreads();
    }
}

// ==================================================================================================
// gemv_4bit, general path (any dtype, any K, any alignment)
// ==================================================================================================
// One warp per weight row, lanes striding over K; up to 8 activation rows at once so the weight
// row is read once for them. fp32: w = f32(code * absmax), then fmaf(a, w, acc).
template <typename T, int QT, bool NESTED>
__global__ void __launch_bounds__(QC_GEMV_SIMPLE_THREADS) gemv_4bit_simple_kernel(
    const typename T::S* __restrict__ a, const u8* __restrict__ packed, const void* __restrict__ absmax,
    const float* __restrict__ absmax2, const float* __restrict__ code2, const float* __restrict__ offset,
    typename T::S* __restrict__ out, int batch, i64 N, i64 K, int log2bs) {
    __shared__ float lut[16];
    __shared__ float c2[NESTED ? kDynCodes : 1];
    const float off = load_decode_tables<QT, NESTED>(lut, c2, code2, offset);
    const int lane = lane_id();
    const int b0 = blockIdx.y * 8, nb = min(8, batch - b0);
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 r = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < N; r += warps) {
        float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        for (i64 k = lane; k < K; k += 32) {
            const i64 e = r * K + k;
            const u32 byte = ldg_u8(packed + (e >> 1));
            const u32 q = (e & 1) ? (byte & 15u) : (byte >> 4);
            const float w = __fmul_rn(lut[q], block_scale<NESTED>(absmax, absmax2, c2, off, e >> log2bs));
#pragma unroll
            for (int b = 0; b < 8; ++b)
                if (b < nb) acc[b] = fmaf(T::to_f(a[(i64)(b0 + b) * K + k]), w, acc[b]);
        }
#pragma unroll
        for (int b = 0; b < 8; ++b) {
            float s = acc[b];
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(kFullMask, s, o);
            if (lane == 0 && b < nb) out[(i64)(b0 + b) * N + r] = T::from_f(s);
        }
    }
}

}  // namespace qc
