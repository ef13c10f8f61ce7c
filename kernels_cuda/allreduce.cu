// One-shot all-reduce of a small tensor over the GPUs of one node, for the rowwise layers of tensor-
// parallel decode (quantcore.nn.parallel, all_reduce="oneshot"). Each rank's buffer is one allocation
// of torch's symmetric memory, mapped on every peer: QC_AR_FLAG_BYTES of flags (word r: the last round
// rank r announced), then QC_AR_ROUNDS x world slots of the tensor's bytes: slot (e % R, q) holds rank
// q's partial sums of round e (R = 2 with flags, 3 with sentinels). A round, in one CTA:
//   0. launched as a programmatic dependent (where the launcher can), the CTA is resident while the
//      kernel that writes x still runs, and waits for it (griddepcontrol.wait) before reading; then
//      (the `mode` bit QC_AR_EARLY) it lets its own dependent launch, which waits for it in turn;
//   1. the rank's partial sums go into its slot of round e: in every rank's buffer (its own and each
//      peer's, over NVLink: posted writes; `mode` 1 and 2) or in its own buffer only (`mode` 0);
//   2. mode 0 and 1 (flags): a barrier of the CTA, then thread p (each peer p) fences at system scope
//      and writes e into flag word `rank` of peer p's buffer (a release store over NVLink), then waits
//      until flag word p of its own buffer reaches e (acquire loads): peer p's part is written.
//      Mode 2 (sentinels, the default): no fence and no flag. Free slots hold a sentinel word (a -0.0
//      in every element) that no rank writes: a word equal to it is sent as +0.0 instead. Each thread
//      reads its units of every slot until no word is the sentinel (each 32-bit store lands whole), and
//      writes the sentinel back once it has read them: one trip over NVLink instead of the fence's round
//      trip and the flag's trip. (The one difference from NCCL's sum: a word of -0.0s sums as +0.0s.)
//   3. every element is the sum of the ranks' slots in rank order (fp32, starting from rank 0's value),
//      rounded once: the same bits on every rank, and for two ranks the bits of NCCL's sum. Modes 1
//      and 2 read all slots from the rank's own memory; mode 0 reads each peer's slot over NVLink.
// The rounds' slots make a second barrier needless: a rank writes its slot of round e + R only after
// its round e + R - 1, which needs every peer's part of that round, sent after the peer's round e
// kernel (its reads, and in mode 2 its sentinel writes, of round e's slots) ended.
// The round counter lives in device memory (`round`), so a CUDA graph replays rounds in order; every
// rank must run the same sequence of all-reduces on a buffer. A peer that never comes makes the waiting
// thread trap after about QC_AR_SPIN_LIMIT polls instead of hanging the stream.
#include "qc_common.cuh"

namespace qc {

constexpr int kArThreads = QC_AR_THREADS;
constexpr int kArMaxRanks = QC_AR_MAX_RANKS;
constexpr int kArFlagBytes = QC_AR_FLAG_BYTES;
constexpr int kArRounds = QC_AR_ROUNDS;  // slots per rank in a buffer: enough rounds for either protocol
constexpr int kArNormUnits = QC_AR_NORM_UNITS;  // all_reduce_add_rms_norm: 16-byte units of a row per thread
static_assert(4 * kArMaxRanks <= kArFlagBytes && kArFlagBytes % 16 == 0, "one flag word per rank, slots 16-byte aligned");
static_assert(kArRounds >= 3, "the sentinel protocol needs 3 rounds of slots; the flag protocols use 2 of them");

__device__ __forceinline__ void ar_st_release_sys(u8* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 ar_ld_acquire_sys(const u8* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// a peer's slot: never through L1 (a line of the same slot two rounds ago may still be there)
__device__ __forceinline__ void ar_ld_v4(const u8* p, u32 (&w)[4]) {
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p) : "memory");
}

// elements of a 16-byte unit as fp32, and back (T's rounding)
template <typename T>
__device__ __forceinline__ void ar_unpack(const u32 (&w)[4], float (&v)[16 / T::kBytes]) {
    if constexpr (T::kBytes == 4) {
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = __uint_as_float(w[i]);
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[2 * i] = T::to_f((u16)(w[i] & 0xffffu));
            v[2 * i + 1] = T::to_f((u16)(w[i] >> 16));
        }
    }
}
template <typename T>
__device__ __forceinline__ void ar_pack(const float (&v)[16 / T::kBytes], u32 (&w)[4]) {
    if constexpr (T::kBytes == 4) {
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = __float_as_uint(v[i]);
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = (u32)T::from_f(v[2 * i]) | ((u32)T::from_f(v[2 * i + 1]) << 16);
    }
}

// the sentinel word of a free slot in mode 2 (QC_AR_SENTINEL_*: -0.0 in every element of the word)
template <typename T>
__device__ __forceinline__ constexpr u32 ar_sentinel() {
    return T::kBytes == 4 ? (u32)QC_AR_SENTINEL_32 : (u32)QC_AR_SENTINEL_16;
}

// Steps 1-2 of a round (after the wait): this rank's slot of round e written, and in modes 0 and 1
// every peer's announcement of e seen. Returns the byte offset of slot (e % R, 0) in a buffer. `mode` as
// the launcher passes it: the protocol in the low bits, left there for step 3, and the flag bit
// QC_AR_EARLY: then the next kernel, where it is a programmatic dependent (the gemv after a decoder
// layer's norm), may launch now: it sets up and prefetches its weights during the exchange, and its own
// wait still waits for this whole grid.
template <typename T>
__device__ __forceinline__ i64 ar_exchange(const typename T::S* __restrict__ x, u8* const (&bufs)[kArMaxRanks],
                                           const u32* round, int rank, int world, i64 units, i64 slot_bytes,
                                           int& mode, u32& e) {
    if (mode & QC_AR_EARLY) grid_dep_launch();
    mode &= QC_AR_EARLY - 1;
    e = *reinterpret_cast<const volatile u32*>(round) + 1;  // this round: one after the last one
    const u32 nr = mode == 2 ? (u32)kArRounds : 2u;  // the sentinel protocol frees a slot for round e + R
    const i64 off = kArFlagBytes + (i64)(e % nr) * world * slot_bytes;  // slot (e % R, 0)
    const u8* const xs = reinterpret_cast<const u8*>(x);
    const int ndst = mode ? world : 1;
    for (i64 i = threadIdx.x; i < units; i += kArThreads) {
        u32 w[4];
        ldg_v4(xs + 16 * i, w[0], w[1], w[2], w[3]);
        if (mode == 2) {
#pragma unroll
            for (int j = 0; j < 4; ++j) w[j] = w[j] == ar_sentinel<T>() ? 0u : w[j];
        }
        for (int d = 0; d < ndst; ++d) {
            u8* const dst = bufs[mode ? d : rank] + off + rank * slot_bytes;
            stg_v4(dst + 16 * i, w[0], w[1], w[2], w[3]);
        }
    }
    if (mode == 2) return off;
    __syncthreads();
    const int p = threadIdx.x;
    if (p < world && p != rank) {
        __threadfence_system();  // the CTA's slot writes (ordered before this thread by the barrier)
        ar_st_release_sys(bufs[p] + 4 * rank, e);
        const u8* flag = bufs[rank] + 4 * p;
        for (u32 n = 0; (int)(ar_ld_acquire_sys(flag) - e) < 0; ++n)
            if (n > (u32)QC_AR_SPIN_LIMIT) __trap();  // a peer that never announced this round
    }
    __syncthreads();
    return off;
}

// Step 3 for 16-byte unit i: the ranks' values summed in rank order (fp32); in mode 2 each slot's unit
// is read until it holds no sentinel word, then the sentinel is written back
template <typename T>
__device__ __forceinline__ void ar_sum_unit(u8* const (&bufs)[kArMaxRanks], i64 off, int rank, int world,
                                            i64 slot_bytes, int mode, i64 i, float (&s)[16 / T::kBytes]) {
    float v[16 / T::kBytes];
    for (int q = 0; q < world; ++q) {
        u8* const src = (mode ? bufs[rank] : bufs[q]) + off + q * slot_bytes + 16 * i;
        u32 w[4];
        ar_ld_v4(src, w);
        if (mode == 2) {
            constexpr u32 z = ar_sentinel<T>();
            for (u32 n = 0; w[0] == z || w[1] == z || w[2] == z || w[3] == z; ++n) {
                if (n > (u32)QC_AR_SPIN_LIMIT) __trap();  // a peer that never sent this round
                ar_ld_v4(src, w);
            }
            stg_v4(src, z, z, z, z);  // free for round e + kArRounds
        }
        ar_unpack<T>(w, v);
        if (q == 0) {
#pragma unroll
            for (int j = 0; j < 16 / T::kBytes; ++j) s[j] = v[j];
        } else {
#pragma unroll
            for (int j = 0; j < 16 / T::kBytes; ++j) s[j] = s[j] + v[j];
        }
    }
}

template <typename T>
__global__ void __launch_bounds__(kArThreads, 1) all_reduce_oneshot_kernel(
    const typename T::S* __restrict__ x, typename T::S* __restrict__ out, u8* buf0, u8* buf1, u8* buf2, u8* buf3,
    u8* buf4, u8* buf5, u8* buf6, u8* buf7, u32* round, int rank, int world, i64 units, i64 slot_bytes, int mode) {
    u8* const bufs[kArMaxRanks] = {buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7};
    grid_dep_wait();  // x is the previous kernel's output
    u32 e;
    const i64 off = ar_exchange<T>(x, bufs, round, rank, world, units, slot_bytes, mode, e);
    u8* const o = reinterpret_cast<u8*>(out);
    for (i64 i = threadIdx.x; i < units; i += kArThreads) {
        float s[16 / T::kBytes];
        ar_sum_unit<T>(bufs, off, rank, world, slot_bytes, mode, i, s);
        u32 w[4];
        ar_pack<T>(s, w);
        stg_v4(o + 16 * i, w[0], w[1], w[2], w[3]);
    }
    if (threadIdx.x == 0) *round = e;
}

// The all-reduce, the residual add and the RMSNorm after it, as a decoder layer runs them after a rowwise
// layer (quantcore.nn.parallel.all_reduce_add_rms_norm): for each of `rows` rows of n elements (n * T's
// bytes a multiple of 16, at most kArNormUnits x kArThreads units of 16 bytes),
//   y = T(sum of the ranks' x), h = T(res + y) -> res_out, norm_out = T(T(h * rsqrt(mean(h^2) + eps)) * w)
// with h's squares summed in fp32 (each thread's units in order, warp shuffles, the warps' sums in order):
// the unfused ops' roundings; the mean's order of addition is the kernel's own. A thread keeps its units
// of h and w in registers; the first row's residual and w are loaded while the partial sums travel.
template <typename T>
__global__ void __launch_bounds__(kArThreads, 1) all_reduce_add_rms_norm_kernel(
    const typename T::S* __restrict__ x, const typename T::S* __restrict__ res, const typename T::S* __restrict__ w,
    typename T::S* __restrict__ res_out, typename T::S* __restrict__ norm_out, u8* buf0, u8* buf1, u8* buf2,
    u8* buf3, u8* buf4, u8* buf5, u8* buf6, u8* buf7, u32* round, int rank, int world, i64 units, i64 slot_bytes,
    int mode, int rows, float eps) {
    u8* const bufs[kArMaxRanks] = {buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7};
    constexpr int E = 16 / T::kBytes;
    constexpr int U = kArNormUnits;
    __shared__ float warp_sums[kArThreads / 32];
    const int row_units = (int)(units / rows);
    const float inv_n = 1.0f / (float)(row_units * E);
    const u8* const rs = reinterpret_cast<const u8*>(res);
    const u8* const ws = reinterpret_cast<const u8*>(w);
    u8* const ro = reinterpret_cast<u8*>(res_out);
    u8* const no = reinterpret_cast<u8*>(norm_out);
    u32 wv[U][4], rv[U][4];  // this thread's units of w, and of the row's residual
    grid_dep_wait();  // x is the previous kernel's output
#pragma unroll
    for (int k = 0; k < U; ++k) {
        const int c = threadIdx.x + k * kArThreads;
        if (c < row_units) {
            ldg_v4(ws + 16 * c, wv[k][0], wv[k][1], wv[k][2], wv[k][3]);
            ar_ld_v4(rs + 16 * c, rv[k]);  // (a plain load: res may be the caller's res_out)
        }
    }
    u32 e;
    const i64 off = ar_exchange<T>(x, bufs, round, rank, world, units, slot_bytes, mode, e);
    for (int r = 0; r < rows; ++r) {
        float sq = 0.f;
        u32 hv[U][4];
#pragma unroll
        for (int k = 0; k < U; ++k) {
            const int c = threadIdx.x + k * kArThreads;
            if (c < row_units) {
                const i64 i = (i64)r * row_units + c;
                if (r > 0) ar_ld_v4(rs + 16 * i, rv[k]);
                float s[E], v[E];
                ar_sum_unit<T>(bufs, off, rank, world, slot_bytes, mode, i, s);
                ar_pack<T>(s, hv[k]);  // y, rounded as the all-reduce's output
                ar_unpack<T>(hv[k], s);
                ar_unpack<T>(rv[k], v);
#pragma unroll
                for (int j = 0; j < E; ++j) s[j] = v[j] + s[j];
                ar_pack<T>(s, hv[k]);  // h
                stg_v4(ro + 16 * i, hv[k][0], hv[k][1], hv[k][2], hv[k][3]);
                ar_unpack<T>(hv[k], s);
#pragma unroll
                for (int j = 0; j < E; ++j) sq = fmaf(s[j], s[j], sq);
            }
        }
#pragma unroll
        for (int m = 16; m > 0; m >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, m);
        if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = sq;
        __syncthreads();
        float tot = 0.f;
#pragma unroll
        for (int k = 0; k < kArThreads / 32; ++k) tot += warp_sums[k];
        const float scale = rsqrtf(tot * inv_n + eps);
#pragma unroll
        for (int k = 0; k < U; ++k) {
            const int c = threadIdx.x + k * kArThreads;
            if (c < row_units) {
                float h[E], g[E];
                ar_unpack<T>(hv[k], h);
                ar_unpack<T>(wv[k], g);
#pragma unroll
                for (int j = 0; j < E; ++j) h[j] = h[j] * scale;
                u32 u[4];
                ar_pack<T>(h, u);
                ar_unpack<T>(u, h);  // T(h * rsqrt(...))
#pragma unroll
                for (int j = 0; j < E; ++j) h[j] = h[j] * g[j];
                ar_pack<T>(h, u);
                stg_v4(no + 16 * ((i64)r * row_units + c), u[0], u[1], u[2], u[3]);
            }
        }
        __syncthreads();  // warp_sums is rewritten by the next row
    }
    if (threadIdx.x == 0) *round = e;
}

}  // namespace qc
