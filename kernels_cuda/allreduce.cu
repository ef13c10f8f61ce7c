// One-shot all-reduce of a small tensor over the GPUs of one node, for the rowwise layers of tensor-
// parallel decode (quantcore.nn.parallel, all_reduce="oneshot"). Each rank's buffer is one allocation
// of torch's symmetric memory, mapped on every peer: QC_AR_FLAG_BYTES of flags (word r: the last round
// rank r announced), then 2 x world slots of the tensor's bytes: slot (e % 2, q) holds rank q's partial
// sums of round e. A round, in one CTA:
//   0. launched as a programmatic dependent (where the launcher can), the CTA is resident while the
//      kernel that writes x still runs, and waits for it here (griddepcontrol.wait) before reading;
//   1. push (default): the rank writes its partial sums into its slot of round e in every rank's buffer
//      (its own and each peer's, over NVLink: posted writes); pull (`push` 0): into its own buffer only;
//   2. a barrier of the CTA, then thread p (each peer p) fences at system scope and writes e into flag
//      word `rank` of peer p's buffer (a release store over NVLink), then waits until flag word p of
//      its own buffer reaches e (acquire loads): peer p's part of round e is written;
//   3. every element is the sum of the ranks' slots in rank order (fp32, starting from rank 0's value),
//      rounded once: the same bits on every rank, and for two ranks the bits of NCCL's sum. Push reads
//      all slots from the rank's own memory; pull reads each peer's slot over NVLink.
// Two rounds of slots and the flags' round numbers make a second barrier needless: a rank writes a
// slot of round e + 2 only after round e + 1's barrier, which a peer passes only after its round e
// kernel (and its reads of round e) ended: kernels of one stream run in order.
// The round counter lives in device memory (`round`), so a CUDA graph replays rounds in order; every
// rank must run the same sequence of all-reduces on a buffer. A peer that never comes makes the waiting
// thread trap after about QC_AR_SPIN_LIMIT polls instead of hanging the stream.
#include "qc_common.cuh"

namespace qc {

constexpr int kArThreads = QC_AR_THREADS;
constexpr int kArMaxRanks = QC_AR_MAX_RANKS;
constexpr int kArFlagBytes = QC_AR_FLAG_BYTES;
static_assert(4 * kArMaxRanks <= kArFlagBytes && kArFlagBytes % 16 == 0, "one flag word per rank, slots 16-byte aligned");

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

// Steps 0-2 of a round: the slots of round e written and every peer's announcement of e seen. Returns
// the byte offset of slot (e % 2, 0) in a buffer and sets e.
template <typename T>
__device__ __forceinline__ i64 ar_exchange(const typename T::S* __restrict__ x, u8* const (&bufs)[kArMaxRanks],
                                           const u32* round, int rank, int world, i64 units, i64 slot_bytes,
                                           int push, u32& e) {
    grid_dep_wait();  // x is the previous kernel's output
    e = *reinterpret_cast<const volatile u32*>(round) + 1;  // this round: one after the last one
    const i64 off = kArFlagBytes + (i64)(e & 1u) * world * slot_bytes;  // slot (e % 2, 0)
    const u8* const xs = reinterpret_cast<const u8*>(x);
    const int ndst = push ? world : 1;
    for (i64 i = threadIdx.x; i < units; i += kArThreads) {
        u32 w[4];
        ldg_v4(xs + 16 * i, w[0], w[1], w[2], w[3]);
        for (int d = 0; d < ndst; ++d) {
            u8* const dst = bufs[push ? d : rank] + off + rank * slot_bytes;
            stg_v4(dst + 16 * i, w[0], w[1], w[2], w[3]);
        }
    }
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

// Step 3 for 16-byte unit i: the ranks' values summed in rank order (fp32)
template <typename T>
__device__ __forceinline__ void ar_sum_unit(u8* const (&bufs)[kArMaxRanks], i64 off, int rank, int world,
                                            i64 slot_bytes, int push, i64 i, float (&s)[16 / T::kBytes]) {
    u32 w[4];
    float v[16 / T::kBytes];
    ar_ld_v4((push ? bufs[rank] : bufs[0]) + off + 16 * i, w);
    ar_unpack<T>(w, s);
    for (int q = 1; q < world; ++q) {
        ar_ld_v4((push ? bufs[rank] : bufs[q]) + off + q * slot_bytes + 16 * i, w);
        ar_unpack<T>(w, v);
#pragma unroll
        for (int j = 0; j < 16 / T::kBytes; ++j) s[j] = s[j] + v[j];
    }
}

template <typename T>
__global__ void __launch_bounds__(kArThreads, 1) all_reduce_oneshot_kernel(
    const typename T::S* __restrict__ x, typename T::S* __restrict__ out, u8* buf0, u8* buf1, u8* buf2, u8* buf3,
    u8* buf4, u8* buf5, u8* buf6, u8* buf7, u32* round, int rank, int world, i64 units, i64 slot_bytes, int push) {
    u8* const bufs[kArMaxRanks] = {buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7};
    u32 e;
    const i64 off = ar_exchange<T>(x, bufs, round, rank, world, units, slot_bytes, push, e);
    u8* const o = reinterpret_cast<u8*>(out);
    for (i64 i = threadIdx.x; i < units; i += kArThreads) {
        float s[16 / T::kBytes];
        ar_sum_unit<T>(bufs, off, rank, world, slot_bytes, push, i, s);
        u32 w[4];
        ar_pack<T>(s, w);
        stg_v4(o + 16 * i, w[0], w[1], w[2], w[3]);
    }
    if (threadIdx.x == 0) *round = e;
}

// The all-reduce, the residual add and the RMSNorm after it, as a decoder layer runs them after a rowwise
// layer (quantcore.nn.parallel.all_reduce_add_rms_norm): for each of `rows` rows of n elements (n * T's
// bytes a multiple of 16),
//   y = T(sum of the ranks' x), h = T(res + y) -> res_out, norm_out = T(T(h * rsqrt(mean(h^2) + eps)) * w)
// with h's squares summed in fp32 (warp shuffles, then the warps' sums in order): the unfused ops'
// roundings; the mean's order of addition is the kernel's own.
template <typename T>
__global__ void __launch_bounds__(kArThreads, 1) all_reduce_add_rms_norm_kernel(
    const typename T::S* __restrict__ x, const typename T::S* __restrict__ res, const typename T::S* __restrict__ w,
    typename T::S* __restrict__ res_out, typename T::S* __restrict__ norm_out, u8* buf0, u8* buf1, u8* buf2,
    u8* buf3, u8* buf4, u8* buf5, u8* buf6, u8* buf7, u32* round, int rank, int world, i64 units, i64 slot_bytes,
    int push, int rows, float eps) {
    u8* const bufs[kArMaxRanks] = {buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7};
    constexpr int E = 16 / T::kBytes;
    __shared__ float warp_sums[kArThreads / 32];
    u32 e;
    const i64 off = ar_exchange<T>(x, bufs, round, rank, world, units, slot_bytes, push, e);
    const i64 row_units = units / rows;
    const float inv_n = 1.0f / (float)(row_units * E);
    const u8* const rs = reinterpret_cast<const u8*>(res);
    const u8* const ws = reinterpret_cast<const u8*>(w);
    u8* const ro = reinterpret_cast<u8*>(res_out);
    u8* const no = reinterpret_cast<u8*>(norm_out);
    for (int r = 0; r < rows; ++r) {
        float sq = 0.f;
        for (i64 i = r * row_units + threadIdx.x; i < (r + 1) * row_units; i += kArThreads) {
            float s[E], v[E];
            ar_sum_unit<T>(bufs, off, rank, world, slot_bytes, push, i, s);
            u32 u[4];
            ar_pack<T>(s, u);  // y, rounded as the all-reduce's output
            ar_unpack<T>(u, s);
            ar_ld_v4(rs + 16 * i, u);  // (a plain load: res may be the caller's res_out)
            ar_unpack<T>(u, v);
#pragma unroll
            for (int j = 0; j < E; ++j) s[j] = v[j] + s[j];
            ar_pack<T>(s, u);  // h
            stg_v4(ro + 16 * i, u[0], u[1], u[2], u[3]);
            ar_unpack<T>(u, s);
#pragma unroll
            for (int j = 0; j < E; ++j) sq = fmaf(s[j], s[j], sq);
        }
#pragma unroll
        for (int m = 16; m > 0; m >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, m);
        if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = sq;
        __syncthreads();  // also makes this row's h (res_out) visible to the whole CTA
        float tot = 0.f;
#pragma unroll
        for (int k = 0; k < kArThreads / 32; ++k) tot += warp_sums[k];
        const float scale = rsqrtf(tot * inv_n + eps);
        for (i64 i = r * row_units + threadIdx.x; i < (r + 1) * row_units; i += kArThreads) {
            u32 u[4];
            float h[E], g[E];
            ar_ld_v4(ro + 16 * i, u);  // this thread's own writes (not through the read-only path)
            ar_unpack<T>(u, h);
            ldg_v4(ws + 16 * (i - r * row_units), u[0], u[1], u[2], u[3]);
            ar_unpack<T>(u, g);
#pragma unroll
            for (int j = 0; j < E; ++j) h[j] = h[j] * scale;
            ar_pack<T>(h, u);
            ar_unpack<T>(u, h);  // T(h * rsqrt(...))
#pragma unroll
            for (int j = 0; j < E; ++j) h[j] = h[j] * g[j];
            ar_pack<T>(h, u);
            stg_v4(no + 16 * i, u[0], u[1], u[2], u[3]);
        }
        __syncthreads();  // warp_sums is rewritten by the next row
    }
    if (threadIdx.x == 0) *round = e;
}

}  // namespace qc
