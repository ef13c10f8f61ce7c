// bitsandbytes' double quantization machinery, shared by bnb_8bit.cu (quantize_blockwise,
// double_quantize) and bnb_4bit.cu (quantize_4bit with double quantization in one launch): the
// dynamic map's rounding (a threshold search, and by cells), one 8-value task of the blockwise
// quantization, the top of the fp64 summation tree, and the gpu-scope synchronization the
// one-launch kernels count their CTAs with. Semantics: quantcore/formats/bnb.py.
#pragma once
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

// The last log2(k) levels of a thread's N leaves v (N a power of two, k <= N of them nonzero):
// widths N -> N/2 -> ... -> 1 pairwise in index order, the levels with k leaves or fewer skipped,
// so v[0] is the sum of v[0 .. k) by the summation tree's order.
template <int N>
__device__ __forceinline__ void tree_levels(double (&v)[N], int k) {
#pragma unroll
    for (int h = N / 2; h >= 1; h >>= 1) {
#pragma unroll
        for (int i = 0; i < N / 2; ++i)
            if (i < h && h < k) v[i] = v[2 * i] + v[2 * i + 1];
    }
}

// The top levels of a tree whose leaf sums p are held by threads 0 .. q-1 (q a power of two): the
// butterfly over the warp pairs neighbouring threads level by level, then the warp sums pairwise
// in ws (thread 0). Every thread calls it (a barrier inside when q > 32); valid in thread 0.
__device__ double tree_top_finish(double p, int q, double* ws) {
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
        tree_levels(v, k);
        p = v[0];
        q = 256;
    } else {
        p = (int)threadIdx.x < nchunks ? partials[threadIdx.x] : 0.0;
        q = npart;
    }
    return tree_top_finish(p, q, ws);
}

// quantize_blockwise, version 2: one thread per 8 elements, G = blocksize / 8 threads per block, a
// persistent grid whose next chunk's loads are issued before this chunk's rounding (and the first
// chunk's before the cell table is built). Double quantization (partials != null): x is absmax
// (fp32), centered by the offset every CTA computes from the chunk sums; CTA 0 writes it. The
// chunk sums and a counter (zeroed by the sum launch) lie in the first bytes of ``codes``, the
// blocks below ``ndefer``: every CTA counts itself in after reading the sums, and the last one to

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
// The top of the perfect binary tree over npart leaves (a power of two, <= 512 * 32), of which
// those from nleaves on are zero, by a CTA of 512 threads: thread t sums k = npart / 512
// contiguous leaves (as up to 8 groups of k / 8, each group and then the groups pairwise: aligned
// subtrees), or holds leaf t; the butterfly over the warp pairs neighbouring threads level by
// level; then the warp sums pairwise. Every thread calls it (a barrier inside); the result is
// valid in thread 0. ws: 16 doubles of shared memory.
__device__ double tree_top_512(const double* leaves, int npart, int nleaves, double* ws) {
    const int tid = threadIdx.x;
    // loads from an index clamped into the leaves, so they can all be in flight together (a load
    // under a branch waits for the ones before it), then the zeros past nleaves selected
    auto leaf = [&](int i) {
        const double v = __ldcg(leaves + min(i, nleaves - 1));
        return i < nleaves ? v : 0.0;
    };
    double p;
    int q;  // threads holding leaves: 0 .. q-1
    if (npart >= 512) {
        const int k = npart >> 9;              // 1 .. 32
        const int ng = k < 8 ? k : 8, gs = k / ng;  // groups, leaves per group (1, 2 or 4)
        double g[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int b = tid * k + j * gs;
            double s = 0.0;
            if (j < ng) {
                if (gs == 1) {
                    s = leaf(b);
                } else if (gs == 2) {
                    s = leaf(b) + leaf(b + 1);
                } else {
                    s = (leaf(b) + leaf(b + 1)) + (leaf(b + 2) + leaf(b + 3));
                }
            }
            g[j] = s;
        }
        tree_levels(g, ng);
        p = g[0];
        q = 512;
    } else {
        p = leaf(tid);
        q = npart;
    }
    return tree_top_finish(p, q, ws);
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

}  // namespace qc
