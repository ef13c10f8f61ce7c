// bitsandbytes blockwise 8-bit with the dynamic map, and the double quantization of absmax.
// Semantics: shared/design/FORMATS.md sections 1 (double quantization) and 2.
#include "qc_common.cuh"

namespace qc {

// code = number of the kDynNThr (255) ascending thresholds t with s > t (nearest code value, ties
// to the lower index, NaN to 0): a branch-free binary search.
__device__ __forceinline__ u32 round8(const float* thr, float s) {
    static_assert(kDynNThr == 255, "an 8-step search covers 2^8 - 1 thresholds");
    u32 idx = 0;
#pragma unroll
    for (u32 step = 128; step > 0; step >>= 1)
        if (s > thr[idx + step - 1]) idx += step;
    return idx;
}

// quantize_blockwise: one thread per 8 elements, G threads per block. ``thresholds`` may be null
// (the dynamic map's own). ``center`` (double quantization) points at the offset subtracted from
// every element in fp32 first; elements past n stay 0.0, as the reference pads the centered array.
template <typename T>
__global__ void __launch_bounds__(512) quantize_blockwise_kernel(
    const typename T::S* __restrict__ x, const float* __restrict__ thresholds, u8* __restrict__ codes,
    float* __restrict__ absmax, const float* __restrict__ center, i64 n, int log2bs, int vec) {
    __shared__ float thr[kDynNThr + 1];
    __shared__ float red[16];
    for (int i = threadIdx.x; i < kDynNThr; i += blockDim.x)
        thr[i] = thresholds ? ldg_f32(thresholds + i) : kDynamicThresholds[i];
    __syncthreads();

    const int G = (1 << log2bs) >> 3;
    const i64 nthreads = (n + 7) >> 3;
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t - threadIdx.x < nthreads;
         t += (i64)gridDim.x * blockDim.x) {
        const i64 e0 = t * 8;
        float v[8];
        load8<T>(x, e0, n, vec != 0, v);
        if (center) {
            const float off = ldg_f32(center);
#pragma unroll
            for (int i = 0; i < 8; ++i)
                if (e0 + i < n) v[i] = __fsub_rn(v[i], off);
        }
        float m = nan_value();
#pragma unroll
        for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(v[i]));
        m = group_absmax(m, G, red);
        const float r = recip_rn(m);
        if ((threadIdx.x & (G - 1)) == 0 && e0 < n) absmax[e0 >> log2bs] = m;
        u32 lo = 0, hi = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            lo |= round8(thr, __fmul_rn(v[i], r)) << (8 * i);
            hi |= round8(thr, __fmul_rn(v[i + 4], r)) << (8 * i);
        }
        if (vec && e0 + 8 <= n) {
            *reinterpret_cast<u64*>(codes + e0) = ((u64)hi << 32) | lo;
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i)
                if (e0 + i < n) codes[e0 + i] = (u8)((i < 4 ? lo : hi) >> (8 * (i & 3)));
        }
        if (G > 32) __syncthreads();  // red[] is rewritten by the next iteration
    }
}

// dequantize_blockwise: out = T(code[q] * absmax[i / blocksize]); 8 elements per thread, two
// groups of 8 per thread, loads first.
template <typename T>
__global__ void __launch_bounds__(256) dequantize_blockwise_kernel(
    const u8* __restrict__ codes, const float* __restrict__ absmax, const float* __restrict__ code,
    typename T::S* __restrict__ out, i64 n, int log2bs, int vec) {
    __shared__ float table[kDynNThr + 1];
    for (int i = threadIdx.x; i <= kDynNThr; i += blockDim.x) table[i] = ldg_f32(code + i);
    __syncthreads();
    const i64 first = (i64)blockIdx.x * blockDim.x * 2 + threadIdx.x;
    u64 q[2];
    float s[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const i64 e0 = (first + (i64)j * blockDim.x) * 8;
        q[j] = (vec && e0 + 8 <= n) ? ldg_u64(codes + e0) : 0ull;
        s[j] = e0 < n ? ldg_f32(absmax + (e0 >> log2bs)) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const i64 e0 = (first + (i64)j * blockDim.x) * 8;
        if (e0 >= n) continue;
        float v[8];
        const bool whole = vec && e0 + 8 <= n;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const i64 e = e0 + i;
            if (whole) {
                v[i] = __fmul_rn(table[(u32)(q[j] >> (8 * i)) & 255u], s[j]);
            } else if (e < n) {  // a block boundary may fall inside these 8 (blocksize >= 64: no)
                v[i] = __fmul_rn(table[ldg_u8(codes + e)], ldg_f32(absmax + (e >> log2bs)));
            } else {
                v[i] = 0.0f;
            }
        }
        store8<T>(out, e0, n, whole, v);
    }
}

// Double-quantization offset: f32(pairwise_sum_f64(absmax) / nb), with exactly the perfect
// binary tree of quantcore.formats.bnb.pairwise_sum_f64 (zero padded, pairs (2i, 2i+1) level by
// level). A CTA reduces an aligned chunk of 2048 values: 8 per thread (three levels in registers),
// then butterfly shuffles (each xor step is one level; a + b == b + a bit for bit), then the 8
// warp sums. Chunks are aligned subtrees, so a second launch over the chunk sums continues the
// same tree. The last launch (one CTA) writes the offset; earlier ones write fp64 partial sums.
constexpr int kTreeChunk = 2048;

template <bool FROM_F32>
__global__ void __launch_bounds__(256) absmax_tree_sum_kernel(
    const void* __restrict__ in, i64 count, double* __restrict__ partial, float* __restrict__ offset,
    i64 nb) {
    __shared__ double ws[8];
    const i64 base = (i64)blockIdx.x * kTreeChunk + threadIdx.x * 8;
    double v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const i64 idx = base + i;
        v[i] = idx < count ? (FROM_F32 ? (double)ldg_f32(reinterpret_cast<const float*>(in) + idx)
                                       : reinterpret_cast<const double*>(in)[idx])
                           : 0.0;
    }
    const double s = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
    double t = s;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) t = t + shfl_xor_f64(t, o);
    if (lane_id() == 0) ws[threadIdx.x >> 5] = t;
    __syncthreads();
    if (threadIdx.x == 0) {
        const double total = ((ws[0] + ws[1]) + (ws[2] + ws[3])) + ((ws[4] + ws[5]) + (ws[6] + ws[7]));
        if (gridDim.x == 1) {
            offset[0] = __double2float_rn(__ddiv_rn(total, (double)nb));
        } else {
            partial[blockIdx.x] = total;
        }
    }
}


// ==================================================================================================
// Version 2 (double_quantize in two launches; quantize_blockwise by cells)
// ==================================================================================================
// Rounding by cells: the count of thresholds below s (the code) is read from a per-cell table and
// finished with one comparison, instead of the 8 dependent shared-memory steps of round8 (whose
// deeper steps also conflict on banks). A cell is a range of |s| with the same exponent and top 6
// mantissa bits (|s| bits >> 17), exponents clamped to [105, 127) - everything below 2^-22 is one
// cell, everything from 1.0 up (inf, NaN) another - on each side of zero: 2 * 1410 cells in value
// order. Cell u holds 4 * (number of thresholds in cells before u); the next threshold thr[count]
// is then either in cell u itself or above every s of the cell, so "count + (s > thr[count])" is
// exact for every fp32 s as long as no cell holds two thresholds. The table is built from the
// thresholds given (the dynamic map's are 2^-6 of their own magnitude apart or more, one per cell
// at the most) and checked; a table that fails the check makes the CTA use round8.
// The side is "s >= 0": -0.0 joins +0.0, and NaN lands in the lowest cell of the negative side
// (count 0, and NaN > thr[0] is false): code 0, as the format says.
constexpr u32 kC8Lo = 105u * 64u - 1u;  // |s| < 2^-22
constexpr u32 kC8Hi = 127u * 64u;       // |s| >= 1
constexpr int kC8Half = (int)(kC8Hi - kC8Lo) + 1;  // 1410 cells per side
constexpr int kC8Cells = 2 * kC8Half;

__device__ __forceinline__ u32 cell8(float s) {
    const u32 a = __float_as_uint(s) & 0x7fffffffu;
    const u32 k = min(max(a >> 17, kC8Lo), kC8Hi) - kC8Lo;
    return s >= 0.0f ? (u32)kC8Half + k : (u32)kC8Half - 1u - k;
}

struct Cells8 {
    float thr[kDynNThr + 1];  // thresholds, thr[kDynNThr] = +inf
    int tc[kDynNThr + 1];     // cell of each threshold (build only), tc[kDynNThr] past every cell
    u16 off4[kC8Cells];      // 4 * (thresholds in earlier cells): the byte offset of the next one
    int bad;
};

// Every thread of the CTA takes part (barriers inside).
__device__ void build_cells8(Cells8& t, const float* __restrict__ thresholds) {
    const int i = threadIdx.x;
    if (i == 0) t.bad = 0;
    for (int j = i; j <= kDynNThr; j += blockDim.x) {
        const float th = j < kDynNThr ? (thresholds ? ldg_f32(thresholds + j) : kDynamicThresholds[j])
                                      : pos_inf();
        t.thr[j] = th;
        t.tc[j] = j < kDynNThr ? (int)cell8(th) : (1 << 30);
    }
    __syncthreads();
    for (int j = i; j < kDynNThr - 1; j += blockDim.x)
        if (t.tc[j] >= t.tc[j + 1]) t.bad = 1;  // two in one cell (or not ascending)
    for (int u = i; u < kC8Cells; u += blockDim.x) {
        int idx = 0;  // number of tc[] below u: tc is ascending (else bad)
#pragma unroll
        for (int step = 128; step > 0; step >>= 1)
            if (t.tc[idx + step - 1] < u) idx += step;
        t.off4[u] = (u16)(4 * idx);
    }
    __syncthreads();
}

__device__ __forceinline__ u32 round8_cells(const Cells8& t, float s) {
    const u32 o4 = t.off4[cell8(s)];
    const float th = *reinterpret_cast<const float*>(reinterpret_cast<const u8*>(t.thr) + o4);
    return (o4 >> 2) + (s > th ? 1u : 0u);
}

// One thread's 8 values of a version-2/3 blockwise task: centred by off for double quantization
// (elements past n stay 0.0: the reference pads the centred array), the group's NaN-ignoring
// absmax (returned; written to absmax[] unless that is null), the codes (by cells when the table
// is usable, else the threshold search), stored 8 at a time. For G > 32 the caller puts a barrier
// before the next task (red[]).
__device__ __forceinline__ float blockwise8_task(float (&v)[8], i64 e0, i64 n, bool dq, float off, int G, float* red,
                                                int tid, const Cells8& tab, bool cells, float* absmax, int log2bs,
                                                u8* codes, bool vec) {
    if (dq) {
        const int valid = e0 + 8 <= n ? 8 : (int)(n - e0);
#pragma unroll
        for (int i = 0; i < 8; ++i)
            if (i < valid) v[i] = __fsub_rn(v[i], off);
    }
    float m = fabsf(v[0]);
#pragma unroll
    for (int i = 1; i < 8; ++i) m = fmaxf(m, fabsf(v[i]));
    m = group_absmax(m, G, red);
    const float r = recip_rn(m);
    if (absmax && (tid & (G - 1)) == 0 && e0 < n) absmax[e0 >> log2bs] = m;
    u32 lo = 0, hi = 0;
    if (cells) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            lo |= round8_cells(tab, __fmul_rn(v[i], r)) << (8 * i);
            hi |= round8_cells(tab, __fmul_rn(v[i + 4], r)) << (8 * i);
        }
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            lo |= round8(tab.thr, __fmul_rn(v[i], r)) << (8 * i);
            hi |= round8(tab.thr, __fmul_rn(v[i + 4], r)) << (8 * i);
        }
    }
    if (vec && e0 + 8 <= n) {
        *reinterpret_cast<u64*>(codes + e0) = ((u64)hi << 32) | lo;
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i)
            if (e0 + i < n) codes[e0 + i] = (u8)((i < 4 ? lo : hi) >> (8 * (i & 3)));
    }
    return m;
}

// 8 consecutive elements as raw 32-bit words
template <typename T>
struct Raw8 {
    static constexpr int kWords = 8 * T::kBytes / 4;
    u32 w[kWords];
};

template <typename T>
__device__ __forceinline__ void raw8_load(const typename T::S* p, Raw8<T>& r) {
#pragma unroll
    for (int q = 0; q < Raw8<T>::kWords / 4; ++q)
        ldg_v4(reinterpret_cast<const u8*>(p) + 16 * q, r.w[4 * q], r.w[4 * q + 1], r.w[4 * q + 2], r.w[4 * q + 3]);
}

template <typename T>
__device__ __forceinline__ void raw8_to_f(const Raw8<T>& r, float (&v)[8]) {
    if constexpr (T::kBytes == 4) {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = __uint_as_float(r.w[i]);
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[2 * i] = T::lo(r.w[i]);
            v[2 * i + 1] = T::hi(r.w[i]);
        }
    }
}

// The double-quantization offset from the chunk sums of absmax_chunk_sum_kernel: the top of the
// perfect binary tree over npart (a power of two, <= 256 * 16) leaves, of which those from nchunks
// on are zero chunks. Each thread sums K = npart / 256 contiguous leaves (or holds one leaf), the
// butterfly pairs neighbouring threads level by level, then the warp sums. Every thread calls it;
// the result is valid in thread 0.
__device__ double chunk_tree_top(const double* partials, int npart, int nchunks, double* ws) {
    double p;
    int q;  // leaves held by threads 0 .. q-1
    if (npart >= 256) {
        const int k = npart >> 8;
        double v[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const int idx = threadIdx.x * k + i;
            v[i] = (i < k && idx < nchunks) ? partials[idx] : 0.0;
        }
#pragma unroll
        for (int l = 0; l < 4; ++l) {  // widths 16 -> 8 -> 4 -> 2 -> 1, the last log2(k) of them
            const int h = 8 >> l;
#pragma unroll
            for (int i = 0; i < 8; ++i)
                if (i < h && h < k) v[i] = v[2 * i] + v[2 * i + 1];
        }
        p = v[0];
        q = 256;
    } else {
        p = (int)threadIdx.x < nchunks ? partials[threadIdx.x] : 0.0;
        q = npart;
    }
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const double other = shfl_xor_f64(p, o);
        if (o < q) p = p + other;
    }
    if (q > 32) {
        if (lane_id() == 0 && (int)threadIdx.x < q) ws[threadIdx.x >> 5] = p;
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int h = q >> 6; h >= 1; h >>= 1)
                for (int i = 0; i < h; ++i) ws[i] = ws[2 * i] + ws[2 * i + 1];
            p = ws[0];
        }
    }
    return p;
}

// quantize_blockwise, version 2: one thread per 8 elements, G = blocksize / 8 threads per block, a
// persistent grid whose next chunk's loads are issued before this chunk's rounding (and the first
// chunk's before the cell table is built). Double quantization (partials != null): x is absmax
// (fp32), centered by the offset every CTA computes from the chunk sums; CTA 0 writes it. The
// chunk sums and a counter (zeroed by the sum launch) lie in the first bytes of ``codes``, the
// blocks below ``ndefer``: every CTA counts itself in after reading the sums, and the last one to
// do so - when no CTA still needs them - writes those blocks. No CTA waits for another.
template <typename T>
__global__ void __launch_bounds__(512, 2) quantize_blockwise_v2_kernel(
    const typename T::S* __restrict__ x, const float* __restrict__ thresholds, u8* codes,
    float* __restrict__ absmax, i64 n, int log2bs, int vec, const double* partials, int npart,
    int nchunks, u32* counter, float* __restrict__ offset, i64 nb, int ndefer) {
    __shared__ Cells8 tab;
    __shared__ float red[16];
    __shared__ double ws[8];
    __shared__ float s_off;
    __shared__ int s_last;

    const int G = (1 << log2bs) >> 3;
    const i64 nthreads = (n + 7) >> 3;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    Raw8<T> raw;
    if (vec && (t + 1) * 8 <= n) raw8_load<T>(x + t * 8, raw);

    float off = 0.0f;
    const bool dq = partials != nullptr;
    if (dq) {
        const double total = chunk_tree_top(partials, npart, nchunks, ws);
        if (threadIdx.x == 0) {
            s_off = __double2float_rn(__ddiv_rn(total, (double)nb));
            if (blockIdx.x == 0) offset[0] = s_off;
            __threadfence();
            s_last = atomicAdd(counter, 1u) == gridDim.x - 1;
        }
    }
    build_cells8(tab, thresholds);  // barriers: s_off and s_last are visible after it
    if (dq) off = s_off;
    const bool cells = !tab.bad;

    auto process = [&](i64 tt, float (&v)[8]) {
        blockwise8_task(v, tt * 8, n, dq, off, G, red, (int)threadIdx.x, tab, cells, absmax, log2bs, codes, vec);
    };

    const i64 tdefer = (i64)ndefer << (log2bs - 3);  // the deferred blocks' threads (G = 32 there)
    for (; t - threadIdx.x < nthreads; t += stride) {  // uniform over the CTA (barriers inside)
        const i64 e0 = t * 8;
        float v[8];
        if (vec && e0 + 8 <= n) {
            raw8_to_f<T>(raw, v);
        } else {
            load8<T>(x, e0, n, false, v);
        }
        const i64 e1 = e0 + stride * 8;
        if (vec && e1 + 8 <= n) raw8_load<T>(x + e1, raw);
        if (t - (threadIdx.x & 31) < tdefer) continue;  // whole warps (one block each)
        process(t, v);
        if (G > 32) __syncthreads();  // red[] is rewritten by the next iteration
    }
    if (dq && s_last) {  // up to 2 tasks per thread, their loads first (this CTA is the tail)
        const i64 lane = threadIdx.x & 31;
        for (i64 t0 = threadIdx.x; t0 - lane < tdefer; t0 += 2 * (i64)blockDim.x) {
            float v[2][8];
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const i64 tt = t0 + j * (i64)blockDim.x;
                if (tt - lane < tdefer) load8<T>(x, tt * 8, n, false, v[j]);
            }
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const i64 tt = t0 + j * (i64)blockDim.x;
                if (tt - lane < tdefer) process(tt, v[j]);
            }
        }
    }
}

// Chunk sums of the double-quantization tree: CTA c sums absmax[c * 8192, (c + 1) * 8192) (zeros
// past nb) over the perfect binary tree - 32 contiguous values per thread in registers, the
// butterfly over the warp, the 8 warp sums - and writes partials[c]; CTA 0 zeroes the counter
// quantize_blockwise_v2_kernel counts its CTAs with (stream order: before any of them runs).
constexpr int kSumPerThread = 32;
constexpr int kSumChunk = 256 * kSumPerThread;

__global__ void __launch_bounds__(256) absmax_chunk_sum_kernel(
    const float* __restrict__ in, i64 nb, int vec, double* partials, u32* counter) {
    __shared__ double ws[8];
    const i64 base = (i64)blockIdx.x * kSumChunk + (i64)threadIdx.x * kSumPerThread;
    float f[kSumPerThread];
    if (vec && base + kSumPerThread <= nb) {
        u32 w[kSumPerThread];
#pragma unroll
        for (int q = 0; q < kSumPerThread / 4; ++q)
            ldg_v4(in + base + 4 * q, w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3]);
#pragma unroll
        for (int i = 0; i < kSumPerThread; ++i) f[i] = __uint_as_float(w[i]);
    } else {
#pragma unroll
        for (int i = 0; i < kSumPerThread; ++i) f[i] = base + i < nb ? ldg_f32(in + base + i) : 0.0f;
    }
    double v[kSumPerThread / 2];
#pragma unroll
    for (int i = 0; i < kSumPerThread / 2; ++i) v[i] = (double)f[2 * i] + (double)f[2 * i + 1];
#pragma unroll
    for (int l = 0; l < 4; ++l) {  // widths 16 -> 8 -> 4 -> 2 -> 1
#pragma unroll
        for (int i = 0; i < 8; ++i)
            if (i < (8 >> l)) v[i] = v[2 * i] + v[2 * i + 1];
    }
    double t = v[0];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) t = t + shfl_xor_f64(t, o);
    if (lane_id() == 0) ws[threadIdx.x >> 5] = t;
    __syncthreads();
    if (threadIdx.x == 0) {
        partials[blockIdx.x] = ((ws[0] + ws[1]) + (ws[2] + ws[3])) + ((ws[4] + ws[5]) + (ws[6] + ws[7]));
        if (blockIdx.x == 0) *counter = 0u;
    }
}


// ==================================================================================================
// Version 3 (double_quantize: the same two launches and chunk-sum layout as version 2, without the
// serial prologue)
// ==================================================================================================
// What version 2's quantize prologue spent its time on, and what replaces it here:
// - the cell table: built at compile time from QC_DYNAMIC_THRESHOLDS_INIT (below) and copied to
//   shared memory; built at run time (build_cells8) only when the thresholds passed differ from
//   the dynamic map's in some bit, which the CTA finds with one comparison per thread;
// - the counter: a non-blocking release atomic whose result is read after the first tasks, not a
//   __threadfence plus a blocking atomic; it lives in the offset's 4 bytes (the CTA that counts
//   itself in last writes the offset over it), so only the chunk sums lie in ``codes``: 16 blocks
//   to defer at 4 M values, one task per thread of that CTA;
// - the tree top: 512 threads, one to eight chunk sums each.
// The main loop keeps two tasks' loads (16 elements) in flight per thread instead of one.

// The cell key of cell8 computed without bit casts (so the compiler can evaluate it): |th| in
// [2^-22, 1) is p * (1 + m / 2^23) with p = 2^(e - 127), and (|th| bits) >> 17 = e * 64 + the top 6
// bits of m. Every step is exact: halving p, |th| / p in [1, 2), minus 1, times 64.
__host__ __device__ constexpr u32 c8_key_const(float th) {
    const float a = th < 0.0f ? -th : th;
    if (!(a >= 0x1p-22f)) return kC8Lo;  // zero and everything below (NaN is not a threshold)
    if (a >= 1.0f) return kC8Hi;
    u32 e = 126;
    float p = 0.5f;
    while (a < p) {
        p *= 0.5f;
        --e;
    }
    return e * 64u + (u32)((a / p - 1.0f) * 64.0f);
}
__host__ __device__ constexpr int c8_cell_const(float th) {
    const int k = (int)(c8_key_const(th) - kC8Lo);
    return th >= 0.0f ? kC8Half + k : kC8Half - 1 - k;
}

// the dynamic thresholds again, as a compile-time constant (kDynamicThresholds is device memory)
constexpr float kDynThrConst[kDynNThr] = QC_DYNAMIC_THRESHOLDS_INIT;

// The dynamic map's thresholds lie in distinct, ascending cells: the table below is exact.
__host__ __device__ constexpr bool dyn_cells8_one_per_cell() {
    for (int j = 0; j + 1 < kDynNThr; ++j)
        if (c8_cell_const(kDynThrConst[j]) >= c8_cell_const(kDynThrConst[j + 1])) return false;
    return true;
}
static_assert(dyn_cells8_one_per_cell(), "two dynamic thresholds in one cell: the table cannot hold them");

struct alignas(16) DynCells8 {
    u16 off4[kC8Cells];  // as Cells8::off4 built from the dynamic thresholds
};
static_assert(kC8Cells % 2 == 0, "the table is copied as 32-bit words");

__host__ __device__ constexpr DynCells8 make_dyn_cells8() {
    DynCells8 t{};
    int j = 0;  // thresholds in the cells below u (they ascend)
    for (int u = 0; u < kC8Cells; ++u) {
        while (j < kDynNThr && c8_cell_const(kDynThrConst[j]) < u) ++j;
        t.off4[u] = (u16)(4 * j);
    }
    return t;
}
__device__ const DynCells8 kDynCells8 = make_dyn_cells8();

// Adds 1 to *p with release semantics at gpu scope, without waiting for the result: the returned
// register is read later, when the atomic has long come back (an acquire atomic would wait for it).
// The CTA that reads the last count makes it an acquire pattern with fence_acq_rel_gpu. An inc
// (wrapping past 2^31 - 1, never reached here), not an add: ptxas aggregates an add (and an inc
// wrapping at 2^32 - 1, the same thing) over the warp, and the shuffle handing out the result
// waits for the atomic at once.
__device__ __forceinline__ u32 atom_inc_release_gpu(u32* p) {
    u32 old;
    asm volatile("atom.release.gpu.global.inc.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(0x7fffffffu) : "memory");
    return old;
}
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

constexpr int kQ3Threads = 512;

// quantize_blockwise, version 3: as version 2 (one thread per 8 elements, G = blocksize / 8 threads
// per block, persistent grid), with the prologue above and two tasks' loads ahead: task t + 2 * stride
// is loaded when task t's registers are freed. Double quantization (partials != null): the offset
// from the chunk sums, ``offset`` holding the counter (zeroed by the sum launch) until the CTA that
// counts itself in last writes the offset over it; that CTA also writes the blocks below
// ``ndefer`` - whose codes overlap the chunk sums in ``codes`` - right after its first two tasks.
template <typename T>
__global__ void __launch_bounds__(kQ3Threads, 2) quantize_blockwise_v3_kernel(
    const typename T::S* __restrict__ x, const float* __restrict__ thresholds, u8* codes,
    float* __restrict__ absmax, i64 n, int log2bs, int vec, const double* partials, int npart,
    int nchunks, float* offset, i64 nb, int ndefer) {
    __shared__ Cells8 tab;
    __shared__ float red[16];
    __shared__ double ws[16];
    __shared__ float s_off;
    __shared__ int s_last;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int G = (1 << log2bs) >> 3;
    const i64 nthreads = (n + 7) >> 3;
    const i64 stride = (i64)gridDim.x * kQ3Threads;
    const i64 t0 = (i64)blockIdx.x * kQ3Threads + tid;
    const bool dq = partials != nullptr;

    // 1. the first two tasks' loads
    Raw8<T> raw0, raw1;
    if (vec && (t0 + 1) * 8 <= n) raw8_load<T>(x + t0 * 8, raw0);
    if (vec && (t0 + stride + 1) * 8 <= n) raw8_load<T>(x + (t0 + stride) * 8, raw1);

    // 2. every other load of the prologue before any use (one latency, under the first tasks'):
    // the chunk sums - thread i holds leaves [i k, (i + 1) k) of the top tree's npart (a power of
    // two, <= 4096; leaves from nchunks on are zero chunks), k = npart / 512, or leaf i alone - the
    // thresholds given and the dynamic map's, and the compile-time cell table as 32-bit words
    const int k = npart >= kQ3Threads ? npart / kQ3Threads : 1;
    const int q = npart >= kQ3Threads ? kQ3Threads : npart;  // threads holding leaves: 0 .. q-1
    double v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int idx = tid * k + i;
        v[i] = (dq && i < k && idx < nchunks) ? partials[idx] : 0.0;
    }
    const int tj = tid < kDynNThr ? tid : kDynNThr - 1;
    const float dyn = kDynamicThresholds[tj];
    const float given = thresholds ? ldg_f32(thresholds + tj) : dyn;
    const u32* csrc = reinterpret_cast<const u32*>(kDynCells8.off4);
    constexpr int kWords = kC8Cells / 2;
    static_assert(kWords <= 3 * kQ3Threads, "three words per thread");
    const u32 cw0 = csrc[tid], cw1 = csrc[tid + kQ3Threads];
    const u32 cw2 = tid + 2 * kQ3Threads < kWords ? csrc[tid + 2 * kQ3Threads] : 0u;

    // 3. the leaves' levels in registers (widths 8 -> 4 -> 2 -> 1, the last log2(k) of them), the
    // butterfly over the warp (xor o pairs neighbours level by level), the warp sums in ws; the
    // thresholds (thr[kDynNThr] = +inf) and the table in shared memory
#pragma unroll
    for (int l = 0; l < 3; ++l) {
        const int h = 4 >> l;
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if (i < h && h < k) v[i] = v[2 * i] + v[2 * i + 1];
    }
    double p = v[0];
    if (dq) {
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const double other = shfl_xor_f64(p, o);
            if (o < q) p = p + other;
        }
        if (lane == 0 && tid < q) ws[warp] = p;
    }
    int differ = 0;
    if (tid <= kDynNThr) {
        tab.thr[tid] = tid < kDynNThr ? given : pos_inf();
        differ = tid < kDynNThr && __float_as_uint(given) != __float_as_uint(dyn);
    }
    {
        u32* dst = reinterpret_cast<u32*>(tab.off4);
        dst[tid] = cw0;
        dst[tid + kQ3Threads] = cw1;
        if (tid + 2 * kQ3Threads < kWords) dst[tid + 2 * kQ3Threads] = cw2;
    }
    if (tid == 0) tab.bad = 0;
    differ = __syncthreads_or(differ);  // also: ws, thr and off4 complete; every chunk sum read
    u32 ticket = 0;
    if (dq && warp == 0) {
        const int nw = q >> 5;  // warp sums (q > 32), combined by a butterfly over lanes 0 .. nw-1
        if (nw > 1) {
            p = lane < nw ? ws[lane] : 0.0;
#pragma unroll
            for (int o = 1; o < 16; o <<= 1) {
                const double other = shfl_xor_f64(p, o);
                if (o < nw) p = p + other;
            }
        }
        if (lane == 0) {
            s_off = __double2float_rn(__ddiv_rn(p, (double)nb));
            // every thread's reads of the chunk sums precede the barrier above; the release makes
            // them precede the last CTA's overwriting of the chunk sums (after its acquire fence)
            ticket = atom_inc_release_gpu(reinterpret_cast<u32*>(offset));
        }
    }
    if (differ) {
        build_cells8(tab, thresholds);  // barriers inside; rare (thresholds of another map)
    } else {
        __syncthreads();
    }
    const float off = dq ? s_off : 0.0f;
    const bool cells = !tab.bad;

    auto process = [&](i64 tt, float (&v)[8]) {
        blockwise8_task(v, tt * 8, n, dq, off, G, red, tid, tab, cells, absmax, log2bs, codes, vec);
    };

    // one task: its values from ``raw`` (loaded ahead) or element loads, then the task two strides
    // on into ``raw``, then the rounding; tasks of the deferred blocks are skipped (whole warps:
    // G = 32 there). Uniform over the CTA when G > 32 (barriers).
    const i64 tdefer = (i64)ndefer << (log2bs - 3);
    auto task = [&](i64 tt, Raw8<T>& raw) {
        const i64 e0 = tt * 8;
        float v[8];
        if (vec && e0 + 8 <= n) {
            raw8_to_f<T>(raw, v);
        } else {
            load8<T>(x, e0, n, false, v);
        }
        const i64 e2 = e0 + 2 * stride * 8;
        if (vec && e2 + 8 <= n) raw8_load<T>(x + e2, raw);
        if (tt - lane >= tdefer) process(tt, v);
        if (G > 32) __syncthreads();  // red[] is rewritten by the next task
    };
    // the deferred blocks, by the CTA that counted itself in last (one task per thread and round:
    // 16 blocks or fewer are one round); every CTA arrives here once, with a barrier: uniform
    auto deferred = [&]() {
        if (tid == 0) {
            s_last = ticket == gridDim.x - 1;
            if (s_last) fence_acq_rel_gpu();  // with the atomic: acquire (the others' releases)
        }
        __syncthreads();
        if (!s_last) return;
        if (tid == 0) offset[0] = off;  // over the counter: all counted
        for (i64 d0 = tid; d0 - lane < tdefer; d0 += kQ3Threads) {
            float v[8];
            load8<T>(x, d0 * 8, n, false, v);
            process(d0, v);
        }
    };

    bool pending = dq;
    for (i64 t = t0; t - tid < nthreads; t += 2 * stride) {  // uniform over the CTA
        task(t, raw0);
        if (t + stride - tid < nthreads) task(t + stride, raw1);
        if (pending) {
            pending = false;
            deferred();
        }
    }
    if (pending) deferred();
}

// Version 3's chunk sums: the same chunks of kSumChunk values and partials as
// absmax_chunk_sum_kernel (``counter``: the offset's word for version 3), read coalesced - 1024 threads, 8 contiguous values each (two 16-byte
// loads, lanes 32 bytes apart) - three levels in registers, the butterfly over the warp, then the
// 32 warp sums' butterfly in warp 0. At most 32 registers: two CTAs per multiprocessor.
constexpr int kSum3Threads = 1024;
static_assert(kSum3Threads * 8 == kSumChunk, "version 3's chunks are version 2's");

__global__ void __launch_bounds__(kSum3Threads, 2) absmax_chunk_sum_v3_kernel(
    const float* __restrict__ in, i64 nb, int vec, double* partials, u32* counter) {
    __shared__ double ws[32];
    const i64 base = (i64)blockIdx.x * kSumChunk + (i64)threadIdx.x * 8;
    u32 w[8];
    if (vec && base + 8 <= nb) {
        ldg_v4(in + base, w[0], w[1], w[2], w[3]);
        ldg_v4(in + base + 4, w[4], w[5], w[6], w[7]);
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = base + i < nb ? __float_as_uint(ldg_f32(in + base + i)) : 0u;
    }
    double d[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        d[i] = (double)__uint_as_float(w[2 * i]) + (double)__uint_as_float(w[2 * i + 1]);
    double t = (d[0] + d[1]) + (d[2] + d[3]);
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) t = t + shfl_xor_f64(t, o);
    if (lane_id() == 0) ws[threadIdx.x >> 5] = t;
    __syncthreads();
    if (threadIdx.x < 32) {
        t = ws[threadIdx.x];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) t = t + shfl_xor_f64(t, o);
        if (threadIdx.x == 0) {
            partials[blockIdx.x] = t;
            if (blockIdx.x == 0) *counter = 0u;
        }
    }
}


// ==================================================================================================
// Version 4 (double_quantize in one cooperative launch; opt-in: QUANTCORE_CUDA_TUNE=dq_v=4)
// ==================================================================================================
// Versions 2 and 3 read absmax twice (the chunk sums, then the quantization) in two launches. Here
// every CTA copies its contiguous share of absmax into shared memory once (16-byte cp.async, all in
// flight together), sums it over the perfect binary tree in leaves of kDq4Unit values (aligned
// subtrees: the reference's tree), writes the leaf sums over the first bytes of the codes and counts
// itself in at a grid barrier; the CTA that arrives last sums the leaves' top, writes the offset and
// releases the others; then every CTA quantizes its blocks from shared memory (a warp per nested
// block of 256). The launch is cooperative (cuLaunchCooperativeKernel refuses a grid that cannot be
// resident at once), so spinning on the barrier cannot deadlock.
// Measured (H200, 4 M values; tools/dev/dq4_trace.py): bit-exact, 19.2 us against version 3's
// 18.7 us. The phases run one after the other: values in 2.2 us, leaf sums 2.0 us (fp32 -> fp64
// conversions), the barrier 4.1 us (CTA start spread 1.3 us, then two trips through L2), the
// rounding 4.4 us, and ~4 us of launch and barrier-word memset around the 14.9 us kernel span.
// Tried without gain: every CTA summing the top itself (leaves in absmax2's bytes), two blocks per
// warp at a time. Kept opt-in as the base for fusing double quantization into quantize_4bit.
//
// The barrier word is absmax2's last element, zeroed by the host before the launch: G arrivals,
// + 1 when the offset is out, + 1 per CTA once it has read the offset (2 G + 1 in all). The CTA
// owning the last block writes that block's absmax2 over the word after the count is complete.
// The leaf sums in ``codes`` are read by the last arriver only, before any CTA writes a code.
constexpr int kDq4Threads = 512;
constexpr int kDq4UnitBlocks = 8;                       // nested blocks (of 256) per leaf
constexpr int kDq4Unit = kDq4UnitBlocks * 256;          // values per leaf
constexpr int kDq4MaxUnits = 12;                        // leaves per CTA: 96 KiB of shared memory
static_assert(kDq4Threads == 512 && kDq4Unit % (4 * kDq4Threads) == 0, "whole 16-byte copies per round");

__device__ __forceinline__ void cp_async16_zfill(void* sdst, const void* gsrc, u32 src_bytes) {
    const u32 d = (u32)__cvta_generic_to_shared(sdst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(gsrc), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ u32 ld_acquire_gpu(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void red_add_release_gpu(u32* p, u32 v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 atom_add_release_gpu(u32* p, u32 v) {
    u32 old;
    asm volatile("atom.release.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}
__device__ __forceinline__ void spin_until_at_least(const u32* p, u32 target) {
    while (ld_acquire_gpu(p) < target) __nanosleep(64);
}
__device__ __forceinline__ u64 globaltimer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

// nunits = ceil(nb / kDq4Unit) leaves, CTA c owning leaves [nunits c / G, nunits (c + 1) / G);
// npart: the tree's padded leaf count (a power of two, <= 4096); leaves: 8-byte aligned scratch in
// ``codes``; vec: codes 8-byte aligned (absmax must be 16-byte aligned for the copies); trace
// (development, null otherwise): per CTA the global timer at 6 points (start, values in, leaves
// out, offset known, codes out, end).
__global__ void __launch_bounds__(kDq4Threads, 2) double_quantize_v4_kernel(
    const float* __restrict__ absmax, i64 nb, u8* codes, float* absmax2, float* offset, double* leaves,
    int npart, int vec, u64* trace) {
    extern __shared__ float4 s_vals4[];  // the CTA's leaves of absmax, zeros past nb
    __shared__ Cells8 tab;
    __shared__ double s_bsum[kDq4MaxUnits * kDq4UnitBlocks];
    __shared__ double ws[8];
    __shared__ float s_off, s_lastm;
    __shared__ int s_last;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 G = gridDim.x;
    const i64 nunits = (nb + kDq4Unit - 1) / kDq4Unit;
    const i64 u0 = nunits * blockIdx.x / G, u1 = nunits * (blockIdx.x + 1) / G;
    const int nu = (int)(u1 - u0);
    const i64 nbl2 = (nb + 255) >> 8;
    u32* bar = reinterpret_cast<u32*>(absmax2 + (nbl2 - 1));
    u64* tr = trace ? trace + 8 * blockIdx.x : nullptr;
    if (tr && tid == 0) tr[0] = globaltimer_ns();

    // 1. the CTA's values into shared memory (copies past nb read nothing and zero-fill)
    {
        const float* src0 = absmax + u0 * kDq4Unit;
        const i64 left = nb - u0 * kDq4Unit;  // values from src0 on
        for (int j = tid; j < nu * (kDq4Unit / 4); j += kDq4Threads) {
            const i64 rem = left - 4 * (i64)j;
            const u32 bytes = rem >= 4 ? 16u : rem > 0 ? (u32)rem * 4u : 0u;
            cp_async16_zfill(s_vals4 + j, bytes ? src0 + 4 * (i64)j : absmax, bytes);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
    // 2. meanwhile the cell table: the dynamic map's, from compile time (exact: static_assert above)
    if (tid <= kDynNThr) tab.thr[tid] = tid < kDynNThr ? kDynamicThresholds[tid] : pos_inf();
    {
        const u32* csrc = reinterpret_cast<const u32*>(kDynCells8.off4);
        u32* dst = reinterpret_cast<u32*>(tab.off4);
        for (int w = tid; w < kC8Cells / 2; w += kDq4Threads) dst[w] = csrc[w];
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    if (tr && tid == 0) tr[1] = globaltimer_ns();

    // 3. the tree: a warp per nested block (a lane's 8 contiguous values, then the butterfly),
    // then the leaves' 8 block sums
    for (int b = warp; b < nu * kDq4UnitBlocks; b += kDq4Threads / 32) {
        const float4 x = s_vals4[b * 64 + 2 * lane], y = s_vals4[b * 64 + 2 * lane + 1];
        double t = (((double)x.x + (double)x.y) + ((double)x.z + (double)x.w)) +
                   (((double)y.x + (double)y.y) + ((double)y.z + (double)y.w));
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) t = t + shfl_xor_f64(t, o);
        if (lane == 0) s_bsum[b] = t;
    }
    __syncthreads();
    if (tid < nu) {
        const double* q = s_bsum + kDq4UnitBlocks * tid;
        leaves[u0 + tid] = ((q[0] + q[1]) + (q[2] + q[3])) + ((q[4] + q[5]) + (q[6] + q[7]));
    }
    __syncthreads();
    if (tr && tid == 0) tr[2] = globaltimer_ns();

    // 4. the grid barrier and the offset
    if (tid == 0) {
        __threadfence();  // the CTA's leaf sums (ordered before by the barrier) before the count
        const u32 old = atom_add_release_gpu(bar, 1u);
        s_last = old == G - 1;
        if (s_last) fence_acq_rel_gpu();  // acquire: every CTA's leaf sums
    }
    __syncthreads();
    if (s_last) {  // uniform over the CTA (barriers inside chunk_tree_top)
        const double total = chunk_tree_top(leaves, npart, (int)nunits, ws);
        if (tid == 0) {
            const float off = __double2float_rn(__ddiv_rn(total, (double)nb));
            s_off = off;
            offset[0] = off;
            red_add_release_gpu(bar, 2u);  // the offset is out (+1), and this CTA has it (+1)
        }
    } else if (tid == 0) {
        spin_until_at_least(bar, G + 1);
        s_off = __ldcg(offset);  // after the acquire: the last arriver's write
        red_add_release_gpu(bar, 1u);
    }
    __syncthreads();
    const float off = s_off;
    if (tr && tid == 0) tr[3] = globaltimer_ns();

    // 5. the codes and absmax2 of the CTA's blocks, a warp per block (whole blocks: G = 32 lanes)
    const i64 b0 = u0 * kDq4UnitBlocks;
    for (int b = warp; b < nu * kDq4UnitBlocks && b0 + b < nbl2; b += kDq4Threads / 32) {
        const i64 gb = b0 + b;
        const float4 x = s_vals4[b * 64 + 2 * lane], y = s_vals4[b * 64 + 2 * lane + 1];
        float v[8] = {x.x, x.y, x.z, x.w, y.x, y.y, y.z, y.w};
        const bool last = gb == nbl2 - 1;
        const float m = blockwise8_task(v, gb * 256 + 8 * lane, nb, true, off, 32, nullptr, lane, tab, true,
                                        last ? nullptr : absmax2, 8, codes, vec != 0);
        if (last && lane == 0) s_lastm = m;
    }
    if (tr && tid == 0) tr[4] = globaltimer_ns();

    // 6. the last block's absmax2 over the barrier word, once every CTA has read the offset
    if (blockIdx.x == G - 1) {
        __syncthreads();
        if (tid == 0) {
            spin_until_at_least(bar, 2 * G + 1);
            absmax2[nbl2 - 1] = s_lastm;
        }
    }
    if (tr && tid == 0) tr[5] = globaltimer_ns();
}

}  // namespace qc
