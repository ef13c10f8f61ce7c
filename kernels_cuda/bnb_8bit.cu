// bitsandbytes blockwise 8-bit with the dynamic map, and the double quantization of absmax.
// Semantics: quantcore/formats/bnb.py (double quantization, the dynamic map; docs/formats.md).
#include "bnb_nested.cuh"

namespace qc {

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
__global__ void __launch_bounds__(QC_DQBW_THREADS) dequantize_blockwise_kernel(
    const u8* __restrict__ codes, const float* __restrict__ absmax, const float* __restrict__ code,
    typename T::S* __restrict__ out, i64 n, int log2bs, int vec) {
    __shared__ float table[kDynNThr + 1];
    for (int i = threadIdx.x; i <= kDynNThr; i += blockDim.x) table[i] = ldg_f32(code + i);
    __syncthreads();
    constexpr int W = QC_DQBW_WORDS;  // words of 8 codes per thread
    const i64 first = (i64)blockIdx.x * blockDim.x * W + threadIdx.x;
    u64 q[W];
    float s[W];
#pragma unroll
    for (int j = 0; j < W; ++j) {
        const i64 e0 = (first + (i64)j * blockDim.x) * 8;
        q[j] = (vec && e0 + 8 <= n) ? ldg_u64(codes + e0) : 0ull;
        s[j] = e0 < n ? ldg_f32(absmax + (e0 >> log2bs)) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < W; ++j) {
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
constexpr int kTreeChunk = QC_DQ_TREE_CHUNK;
static_assert(QC_DQ_TREE_THREADS == 256 && QC_DQ_TREE_THREADS * 8 == kTreeChunk,
              "8 warps of 8 values per thread: the pairwise order of the reference's tree");

template <bool FROM_F32>
__global__ void __launch_bounds__(QC_DQ_TREE_THREADS) absmax_tree_sum_kernel(
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
// quantize_blockwise by cells (the default) and double_quantize in two launches
// ==================================================================================================
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

// What the kernel's prologue does:
// - the cell table: built at compile time from QC_DYNAMIC_THRESHOLDS_INIT (below) and copied to
//   shared memory; built at run time (build_cells8) only when the thresholds passed differ from
//   the dynamic map's in some bit, which the CTA finds with one comparison per thread;
// - double quantization: the CTAs count themselves with a non-blocking release atomic whose result
//   is read after the first tasks; the counter lives in the offset's 4 bytes (the CTA that counts
//   itself in last writes the offset over it), so only the chunk sums lie in ``codes``: 16 blocks
//   to defer at 4 M values, one task per thread of that CTA;
// - the tree top over the chunk sums: 512 threads, one to eight chunk sums each.
// The main loop keeps two tasks' loads (16 elements) in flight per thread.

constexpr int kQ3Threads = QC_QBW_THREADS;
static_assert(kQ3Threads * 8 == QC_DQ_SUM_MAX_PARTS, "the tree top: one to eight chunk sums per thread");

// quantize_blockwise by cells: one thread per 8 elements, G = blocksize / 8 threads per block, a
// persistent grid, the prologue above and two tasks' loads ahead: task t + 2 * stride
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
    tree_levels(v, k);
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

// The chunk sums of the double-quantization tree: CTA c sums absmax[c * kSumChunk, (c + 1) * kSumChunk)
// (zeros past nb) into partials[c] and zeroes ``counter`` (the offset's word); read coalesced - 1024
// threads, 8 contiguous values each (two 16-byte
// loads, lanes 32 bytes apart) - three levels in registers, the butterfly over the warp, then the
// 32 warp sums' butterfly in warp 0. At most 32 registers: two CTAs per multiprocessor.
constexpr int kSum3Threads = QC_DQ_SUM_THREADS;
constexpr int kSumChunk = QC_DQ_SUM_CHUNK;
static_assert(kSumChunk == kSum3Threads * 8, "8 values per thread");

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


}  // namespace qc
