// ggml Q4_0 / Q8_0 / Q8_1: quantize, dequantize, and the W4A8 GEMM (Q4_0 weights times Q8_1
// activations, given or quantized inside the kernel). Semantics: quantcore/formats/ggml.py
// (ggml's _ref C functions, bit for bit; docs/formats.md).
#include "qc_common.cuh"

namespace qc {

constexpr int kQK = QC_QK;
constexpr int kFmtQ4_0 = QC_FMT_Q4_0, kFmtQ8_0 = QC_FMT_Q8_0, kFmtQ8_1 = QC_FMT_Q8_1;

template <int FMT>
struct GgmlFmt {
    static constexpr int kBytes = FMT == kFmtQ4_0 ? QC_Q4_0_BLOCK_BYTES
                                  : FMT == kFmtQ8_0 ? QC_Q8_0_BLOCK_BYTES : QC_Q8_1_BLOCK_BYTES;
    static constexpr int kQs = FMT == kFmtQ8_1 ? 4 : 2;  // offset of the quants in a block
};

// 32 elements of one block as fp32.
template <typename T>
__device__ __forceinline__ void load_block(const typename T::S* x, bool vec, float (&v)[kQK]) {
#pragma unroll
    for (int i = 0; i < kQK; i += 8) {
        float w[8];
        load8<T>(x + i, 0, 8, vec, w);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[i + j] = w[j];
    }
}

// C's float -> int8 as the reference defines it: NaN and +-inf -> 0 (ggml's C reference on x86,
// gguf-py), finite values clipped to [-128, 127]. r is already an integer value.
__device__ __forceinline__ int q8_from_rounded(float r) {
    if ((__float_as_uint(r) & 0x7fffffffu) >= 0x7f800000u) return 0;
    return (int)fminf(fmaxf(r, -128.0f), 127.0f);
}

// The reference's rounding of one block's 32 values times id to Q8 (roundf: half away from zero),
// packed 4 per word; returns the sum of the codes.
__device__ __forceinline__ int q8_words_ref(const float (&v)[kQK], float id, u32 (&qw)[8]) {
    int sum = 0;
#pragma unroll
    for (int w = 0; w < 8; ++w) {
        u32 word = 0;
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const int q = q8_from_rounded(roundf(__fmul_rn(v[4 * w + b], id)));
            sum += q;
            word |= ((u32)q & 255u) << (8 * b);
        }
        qw[w] = word;
    }
    return sum;
}

// Q8 quantization of one block: d = amax / 127, id = 1/d (0 if d == 0), q = roundf(x * id) (half
// away from zero); sum of q for Q8_1. Returns d; q packed 4 per word, little-endian.
__device__ __forceinline__ float quantize_q8_block(const float (&v)[kQK], u32 (&qw)[8], int& qsum) {
    float amax = 0.0f;  // fmaxf skips NaN; an all-NaN block gives 0, as the reference
#pragma unroll
    for (int j = 0; j < kQK; ++j) amax = fmaxf(amax, fabsf(v[j]));
    const float d = __fdiv_rn(amax, (float)QC_Q8_MAX);
    const float id = d != 0.0f ? recip_rn(d) : 0.0f;
    qsum = q8_words_ref(v, id, qw);
    return d;
}

// Q8_1's s: fp16(f32(sum q) * d), the reference form (not ggml CUDA's sum of x). The product is
// NaN only for a block holding an infinity (d = inf, every q = 0); the core pins the bits of that
// NaN (QC_Q8_1_NAN_S_BITS) because a GPU multiply returns its own canonical NaN.
__device__ __forceinline__ u16 q8_1_s(int qsum, float d) {
    const float s = __fmul_rn((float)qsum, d);
    return is_nan(s) ? (u16)QC_Q8_1_NAN_S_BITS : f32_to_f16(s);
}

__device__ __forceinline__ void store_u16(u8* p, u32 v, bool aligned2) {
    if (aligned2) {
        *reinterpret_cast<u16*>(p) = (u16)v;
    } else {
        p[0] = (u8)v;
        p[1] = (u8)(v >> 8);
    }
}

// One thread per block. Q4_0: max = the signed value of the first element of largest |x| (NaN
// never wins; +0.0 when no element is a nonzero number), d = max / -8, id = 1/d (0 if d == 0), q = min(15, trunc(f32(x * id) + 8.5)) with
// the multiply and the add rounded separately; element j in the low nibble of qs[j], j + 16 in
// its high nibble.
template <typename T, int FMT>
__global__ void __launch_bounds__(QC_GGML_THREADS) quantize_ggml_kernel(
    const typename T::S* __restrict__ x, u8* __restrict__ out, i64 nblocks, int vec, int aligned2) {
    const i64 b = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= nblocks) return;
    float v[kQK];
    load_block<T>(x + b * kQK, vec != 0, v);
    u8* o = out + b * GgmlFmt<FMT>::kBytes;
    const bool al = aligned2 != 0;
    if (FMT == kFmtQ4_0) {
        // |x| compared as integers (the order of non-negative floats is that of their bits), NaN as
        // -1: no float comparison whose NaN behaviour a compiler could fold away
        int best = -1;
        float mx = 0.0f;
#pragma unroll
        for (int j = 0; j < kQK; ++j) {
            const u32 mag = __float_as_uint(v[j]) & 0x7fffffffu;
            const int key = mag > 0x7f800000u ? -1 : (int)mag;
            if (key > best) {
                best = key;
                mx = v[j];
            }
        }
        if (best <= 0) mx = 0.0f;  // no nonzero number: +0.0 as llama.cpp (x[0] may be -0.0)
        const float d = __fdiv_rn(mx, -(float)QC_Q4_0_OFFSET);
        const float id = d != 0.0f ? recip_rn(d) : 0.0f;
        int q[kQK];
#pragma unroll
        for (int j = 0; j < kQK; ++j) {
            const float b = __fadd_rn(__fmul_rn(v[j], id), QC_Q4_0_ROUND_BIAS);
            // NaN and +-inf -> 0 (the reference's rule; __float2int_rz would saturate +-inf)
            int t = (__float_as_uint(b) & 0x7fffffffu) >= 0x7f800000u ? 0 : __float2int_rz(b);
            t = min(max(t, -128), 127);
            q[j] = min(15, t);
        }
        store_u16(o, f32_to_f16(d), al);
#pragma unroll
        for (int j = 0; j < 16; j += 2) {
            const u32 b0 = ((u32)q[j] & 15u) | (((u32)q[j + 16] & 15u) << 4);
            const u32 b1 = ((u32)q[j + 1] & 15u) | (((u32)q[j + 17] & 15u) << 4);
            store_u16(o + 2 + j, b0 | (b1 << 8), al);
        }
    } else {
        u32 qw[8];
        int qsum;
        const float d = quantize_q8_block(v, qw, qsum);
        store_u16(o, f32_to_f16(d), al);
        if (FMT == kFmtQ8_1) store_u16(o + 2, q8_1_s(qsum, d), al);
        u8* qs = o + GgmlFmt<FMT>::kQs;
#pragma unroll
        for (int w = 0; w < 8; ++w) {
            store_u16(qs + 4 * w, qw[w] & 0xffffu, al);
            store_u16(qs + 4 * w + 2, qw[w] >> 16, al);
        }
    }
}

// dequantize: Q4_0 (q - 8) * d, Q8 q * d; one fp32 rounding, then one into T. One thread per
// 8 elements (a quarter block).
template <typename T, int FMT>
__global__ void __launch_bounds__(QC_GGML_THREADS) dequantize_ggml_kernel(
    const u8* __restrict__ q, typename T::S* __restrict__ out, i64 nblocks, int vec) {
    const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= nblocks * 4) return;
    const i64 b = t >> 2;
    const int part = (int)(t & 3);
    const u8* blk = q + b * GgmlFmt<FMT>::kBytes;
    const float d = f16_to_f32((u16)(ldg_u8(blk) | (ldg_u8(blk + 1) << 8)));
    float v[8];
    if (FMT == kFmtQ4_0) {
        const u8* qs = blk + 2 + (part & 1) * 8;  // parts 0,1: low nibbles; 2,3: high nibbles
        const int shift = (part >> 1) * 4;
#pragma unroll
        for (int i = 0; i < 8; ++i)
            v[i] = __fmul_rn((float)((int)((ldg_u8(qs + i) >> shift) & 15u) - QC_Q4_0_OFFSET), d);
    } else {
        const u8* qs = blk + GgmlFmt<FMT>::kQs + part * 8;
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = __fmul_rn((float)(i8)ldg_u8(qs + i), d);
    }
    store8<T>(out, t * 8, nblocks * kQK, vec != 0, v);
}

// 4 consecutive activation elements as fp32 (vec: 16-byte aligned fp32 / 8-byte aligned halves).
template <typename T>
__device__ __forceinline__ void load4_act(const typename T::S* x, int vec, float (&v)[4]) {
    if (T::kBytes == 4 && vec) {
        u32 w0, w1, w2, w3;
        ldg_v4(x, w0, w1, w2, w3);
        v[0] = __uint_as_float(w0);
        v[1] = __uint_as_float(w1);
        v[2] = __uint_as_float(w2);
        v[3] = __uint_as_float(w3);
    } else if (T::kBytes == 2 && vec) {
        const u64 w = ldg_u64(x);
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = T::to_f((typename T::S)(w >> (16 * j)));
    } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = T::to_f(x[j]);
    }
}

// Q8_1 of one block spread over 8 consecutive lanes (4 elements each; every lane of the warp calls
// it: shuffles). The reductions are a NaN-ignoring max and an integer sum, exact in any order, so
// the values equal quantize_q8_1's bytes. Returns the lane's 4 quants packed little-endian; d is
// the stored fp16 d as fp32, s8x8 = 8 * the stored fp16 s.
__device__ __forceinline__ u32 q8_1_lanes8(const float (&v)[4], float& d, float& s8x8) {
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) amax = fmaxf(amax, fabsf(v[j]));
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, o));
    const float dq = __fdiv_rn(amax, (float)QC_Q8_MAX);
    const float id = dq != 0.0f ? recip_rn(dq) : 0.0f;
    int sum = 0;
    u32 qw = 0u;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int q = q8_from_rounded(roundf(__fmul_rn(v[j], id)));
        sum += q;
        qw |= ((u32)q & 255u) << (8 * j);
    }
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) sum += __shfl_xor_sync(kFullMask, sum, o);
    d = f16_to_f32(f32_to_f16(dq));
    s8x8 = 8.0f * f16_to_f32(q8_1_s(sum, dq));
    return qw;
}

// ==================================================================================================
// W4A8 for N <= 8 (sm_90): device helpers of the stream kernel below (dp4a, mbarriers, bulk
// copies, cluster ranks and distributed shared memory)
// ==================================================================================================

__device__ __forceinline__ int dp4a(u32 a, u32 b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// (the mbarriers of qc_common.cuh, by pointer)
__device__ __forceinline__ void mbar_init(u64* bar, u32 count) { mbar_init(smem_addr(bar), count); }
__device__ __forceinline__ void mbar_expect_tx(u64* bar, u32 bytes) { mbar_expect_tx(smem_addr(bar), bytes); }
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) { mbar_wait(smem_addr(bar), parity); }
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, u32 bytes, u64* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
// (the cluster loads of qc_common.cuh, by pointer)
__device__ __forceinline__ float ld_cluster_f32(const float* p, u32 rank) { return ld_cluster_f32(smem_addr(p), rank); }
#endif

// ==================================================================================================
// W4A8 for N <= 8 (sm_90), version 2: one weight ring per CTA, int8 tensor cores
// ==================================================================================================
// gemm_w4a8_stream_kernel<T, NB, CL>. A cluster of CL CTAs (1, 2 or 4) owns `tpc` tiles of 16
// consecutive rows; CTA `rank` owns the K slice [rank * kbs, rank * kbs + nbl) blocks of them, so
// it quantizes N x nbl blocks of the activation once (one lane per block). A CTA has one
// producer warp and kWsWarps consumer warps sharing a ring of `nstage` stages: a stage is one
// tile's 16 rows x one chunk of kc blocks (one 1-D bulk copy per row, rows at a padded stride),
// with a full mbarrier (the copies' bytes) and an empty one (one arrival per consumer warp). The
// producer runs up to nstage stages ahead, also during the activation prologue; the bytes in
// flight do not cost registers and every warp of the CTA works on every stage.
//
// A consumer warp takes block pairs p = warp, warp + kWsWarps, ... of each tile (two Q4_0 blocks
// are 36 bytes, so a pair starts on a 4-byte boundary): per block one mma.m16n8k32 s8 over the 16
// rows and 8 activation columns, the nibbles 0..15 as A (the -8 is the s8 term), the Q8_1 quants
// as B, the accumulator started at the bits of 1.5 * 2^23 so that the result read as a float is
// 1.5 * 2^23 + sumi exactly (one FADD instead of an int->float conversion, which issues at a
// quarter of the FP32 rate). The per-warp partial sums of a tile are added in warp order after a
// barrier of the consumer warps, the CL partial sums of a row in rank order through distributed
// shared memory: deterministic, no workspace, no atomics.
//
// Measured (H200, docs/performance.md versions 13, W-14 and W-15): the time grows with the number
// of stages per CTA, not with the bulk copies, so stages take the longest row pieces (kc) that
// fit. The ring's slot and phase are stepped counters (W-15: the runtime divisions they replace,
// ~25 of a stage's ~67 own instructions per consumer warp, were not what bounds N = 1); a kernel
// that only reads the weights takes 11.3 us at 4096x14336 (log RC), against 15.7 us here.
//
// LD selects who fills the ring. LD = 0 (the default): the producer warp, one 1-D bulk copy per
// row and stage. LD = 1 (W-14, slower: 19.0 against 15.6 us at 4096x14336 N = 1, kept selectable
// through QUANTCORE_CUDA_TUNE=w4s_load=1): no producer warp; consumer warp w copies row w of each stage
// as 16-byte cp.async (lane l takes the units l, l + 32, ...: each warp instruction moves 512
// contiguous bytes; Q4_0 rows of nbk % 8 == 0 blocks and chunks of multiples of 8 blocks are whole
// 16-byte units, so no realignment on the way in) and hands them to the full barrier by
// cp.async.mbarrier.arrive.noinc (512 arrivals per stage). A warp issues stage s + L (L = nstage - 2)
// before it waits for stage s, after the empty barrier of stage s - 2, whose slot it refills, so
// the other warps have a stage of slack. Rows past M are not copied (their results are never
// stored). The consumer code is the same as LD = 0's, so the two give identical bits. The
// activation prologue (both fillers, 16-byte aligned input) loads block u + 512 before it quantizes
// block u (its load under the quantization of the block before; measured faster than all of a
// thread's loads issued first, docs/performance.md W-16).
constexpr int kWsWarps = QC_WS_WARPS;  // consumer warps; + 1 producer warp for LD = 0
static_assert((kWsWarps & (kWsWarps - 1)) == 0, "pair assignment masks by kWsWarps - 1");
constexpr int kWsRows = QC_WS_ROWS;    // rows per tile (the mma's M)
static_assert(kWsRows == 16, "a tile is one m16 mma");
constexpr int kWsMagic = 0x4B400000;  // bits of 1.5 * 2^23

// Bytes between the rows of a stage: kc blocks rounded up to 16 bytes, an odd number of 16-byte
// units, so the 8 rows the lanes of a quad group read fall in 8 different groups of 4 banks.
__host__ __device__ constexpr int ws_stride(int kc) {
    return ((kc * QC_Q4_0_BLOCK_BYTES + 15) / 16) % 2 ? (kc * QC_Q4_0_BLOCK_BYTES + 15) / 16 * 16
                                                      : (kc * QC_Q4_0_BLOCK_BYTES + 15) / 16 * 16 + 16;
}

// Q8_1 of one block held by one lane, the reference's bytes. Where d is a normal float (or 0, or
// inf) |x * id| <= 127.0001, and there roundf's half-away-from-zero equals
// trunc(y + copysign(0.5 - 2^-25, y)) in fp32 (checked exhaustively over |y| <= 128); NaN -> 0
// through the conversion. Blocks whose d is subnormal take the reference's general form. d8: the
// stored fp16 d as fp32; sbits: the stored fp16 s.
__device__ __forceinline__ void ws_q8_1_block_bits(const float (&v)[kQK], u32 (&qw)[8], float& d8, u16& sbits) {
    float amax = 0.0f;  // fmaxf skips NaN
#pragma unroll
    for (int j = 0; j < kQK; ++j) amax = fmaxf(amax, fabsf(v[j]));
    const float d = __fdiv_rn(amax, (float)QC_Q8_MAX);
    const float id = d != 0.0f ? recip_rn(d) : 0.0f;
    int sum = 0;
    if (d == 0.0f || d >= 1.17549435e-38f) {
        const float half = 0.49999997f;
#pragma unroll
        for (int w = 0; w < 8; ++w) {
            u32 q[4];
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const float y = __fmul_rn(v[4 * w + b], id);
                q[b] = (u32)__float2int_rz(__fadd_rn(y, copysignf(half, y)));
            }
            const u32 word = __byte_perm(__byte_perm(q[0], q[1], 0x0040u), __byte_perm(q[2], q[3], 0x0040u), 0x5410u);
            sum = dp4a(word, 0x01010101u, sum);
            qw[w] = word;
        }
    } else {
        sum = q8_words_ref(v, id, qw);
    }
    d8 = f16_to_f32(f32_to_f16(d));
    sbits = q8_1_s(sum, d);
}

// The same with s8x8 = 8 * the stored s as fp32.
__device__ __forceinline__ void ws_q8_1_block(const float (&v)[kQK], u32 (&qw)[8], float& d8, float& s8x8) {
    u16 sbits;
    ws_q8_1_block_bits(v, qw, d8, sbits);
    s8x8 = 8.0f * f16_to_f32(sbits);
}

__device__ __forceinline__ void mma_s8_16832_magic(int (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(kWsMagic));
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void mbar_arrive(u64* bar) { mbar_arrive(smem_addr(bar)); }
__device__ __forceinline__ void consumers_sync() {
    asm volatile("bar.sync 1, %0;" :: "r"(kWsWarps * 32) : "memory");
}
// one arrival on bar once every cp.async this thread issued before has landed; the barrier's count
// includes it (noinc)
__device__ __forceinline__ void ws_cp_arrive(u64* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(smem_addr(bar)) : "memory");
}
#endif

// One activation block's raw words (32 elements: 16 words of fp16/bf16, 32 of fp32), loaded as
// 16-byte vectors from a 16-byte aligned address, and converted to fp32 as load_block does.
template <typename T>
struct WsRaw {
    static constexpr int kWords = T::kBytes * 8;
    u32 w[kWords];
    __device__ __forceinline__ void load(const typename T::S* x) {
#pragma unroll
        for (int i = 0; i < kWords; i += 4) ldg_v4(reinterpret_cast<const u32*>(x) + i, w[i], w[i + 1], w[i + 2], w[i + 3]);
    }
    __device__ __forceinline__ void to_f32(float (&v)[kQK]) const {
        if constexpr (T::kBytes == 4) {
#pragma unroll
            for (int i = 0; i < kQK; ++i) v[i] = __uint_as_float(w[i]);
        } else {
#pragma unroll
            for (int i = 0; i < kQK / 2; ++i) {
                v[2 * i] = T::lo(w[i]);
                v[2 * i + 1] = T::hi(w[i]);
            }
        }
    }
};

// The B fragment words and (d8, 8 s8) of activation block (bl, n) into shared memory.
__device__ __forceinline__ void ws_store_act(u32* aq, Pair* ads, int NB, int bl, int n, const u32 (&qw)[8], float d8,
                                             float s8x8) {
    // B fragment order: (k 4c..4c+3, k 16+4c..16+4c+3) adjacent for c = 0..3
    uint4* dst = reinterpret_cast<uint4*>(aq + (bl * NB + n) * 8);
    uint4 lo, hi;
    lo.x = qw[0], lo.y = qw[4], lo.z = qw[1], lo.w = qw[5];
    hi.x = qw[2], hi.y = qw[6], hi.z = qw[3], hi.w = qw[7];
    dst[0] = lo;
    dst[1] = hi;
    ads[bl * NB + n] = Pair{d8, s8x8};
}

// One block's contribution to the 4 accumulators of a lane: rows g, g + 8 (d4 of each), columns
// 2c, 2c + 1. bq: the lane's B fragment words of the block (column g mod NB), ds: (d8, 8 * s8) of
// columns 2c mod NB and the next. Lanes whose columns are past NB read another column's values (no
// predicate, no zeroing); their results are never stored.
template <int NB>
__device__ __forceinline__ void ws_block(float (&acc)[4], u32 qg, u32 qg8, float d4g, float d4g8, const u32* bq,
                                         const Pair* ds) {
    const u32 a[4] = {qg & 0x0f0f0f0fu, qg8 & 0x0f0f0f0fu, (qg >> 4) & 0x0f0f0f0fu, (qg8 >> 4) & 0x0f0f0f0fu};
    const uint2 bv = *reinterpret_cast<const uint2*>(bq);
    float da, sa, db = 0.0f, sb = 0.0f;
    if (NB >= 2) {
        const float4 v = *reinterpret_cast<const float4*>(ds);
        da = v.x;
        sa = v.y;
        db = v.z;
        sb = v.w;
    } else {
        const Pair v = *ds;
        da = v.x;
        sa = v.y;
    }
    int d[4];
    mma_s8_16832_magic(d, a, bv.x, bv.y);
    const float s0 = __fsub_rn(__int_as_float(d[0]), 12582912.0f);
    const float s2 = __fsub_rn(__int_as_float(d[2]), 12582912.0f);
    acc[0] = fmaf(d4g, fmaf(da, s0, -sa), acc[0]);
    acc[2] = fmaf(d4g8, fmaf(da, s2, -sa), acc[2]);
    if (NB >= 2) {
        const float s1 = __fsub_rn(__int_as_float(d[1]), 12582912.0f);
        const float s3 = __fsub_rn(__int_as_float(d[3]), 12582912.0f);
        acc[1] = fmaf(d4g, fmaf(db, s1, -sb), acc[1]);
        acc[3] = fmaf(d4g8, fmaf(db, s3, -sb), acc[3]);
    }
}

// out: [M, N] fp32 (yt = 0) or [N, M] of T (yt = 1); N <= NB; nbk % 8 == 0, kbs and kc multiples of 8,
// wq 16-byte aligned; nstage >= 2.
// Shared memory (the launcher computes the same sum; the kernel traps on less): nstage x 16 x ws_stride(kc) ring,
// kbs x NB x 32 quants, kbs x NB x 8 (d8, 8 s8), 2 x kWsWarps x 16 x NB + tpc x 16 x NB floats,
// 2 x nstage mbarriers. Threads: (kWsWarps + 1) x 32 for LD = 0, kWsWarps x 32 for LD = 1.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define QC_WS_CLUSTER(CL)  // the kernel body is empty below sm_90; the launcher never picks it there
#else
#define QC_WS_CLUSTER(CL) __cluster_dims__(CL, 1, 1)
#endif
template <typename T, int NB, int CL, int LD>
__global__ void QC_WS_CLUSTER(CL) __launch_bounds__((kWsWarps + (LD == 0 ? 1 : 0)) * 32, 1) gemm_w4a8_stream_kernel(
    const u8* __restrict__ wq, const void* __restrict__ act, void* __restrict__ out, i64 M, int N, i64 K,
    int kbs, int kc, int nstage, int tpc, int vec, int yt) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __attribute__((aligned(16))) u8 smem[];
    const int warp = threadIdx.x >> 5, lane = lane_id();
    const u32 rank = CL > 1 ? cluster_rank() : 0u;
    const i64 nbk = K / kQK;
    const i64 kb0 = (i64)rank * kbs;
    const int nbl = (int)max((i64)0, min((i64)kbs, nbk - kb0));  // blocks of this CTA's slice
    const int nch = (nbl + kc - 1) / kc;
    const int stride = ws_stride(kc), stage_bytes = kWsRows * stride;
    const i64 tile0 = (i64)(blockIdx.x / CL) * tpc;
    const int ntl = (int)max((i64)0, min((i64)tpc, (M + kWsRows - 1) / kWsRows - tile0));
    const int nst = ntl * nch;  // stages of this CTA
    u8* ring = smem;
    u32* aq = reinterpret_cast<u32*>(smem + nstage * stage_bytes);
    Pair* ads = reinterpret_cast<Pair*>(aq + kbs * NB * 8);
    float* red = reinterpret_cast<float*>(ads + kbs * NB);  // [2][kWsWarps][16][NB]
    float* part = red + 2 * kWsWarps * kWsRows * NB;         // [tpc][16][NB]
    u64* full = reinterpret_cast<u64*>(part + tpc * kWsRows * NB);
    u64* empty = full + nstage;
    require_dynamic_smem((u32)(reinterpret_cast<u8*>(empty + nstage) - smem));

    if (threadIdx.x == 0) {
        for (int s = 0; s < nstage; ++s) {
            mbar_init(full + s, LD == 0 ? 1 : kWsWarps * 32);
            mbar_init(empty + s, kWsWarps);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    // LD = 1: the next stage this warp copies (index, slot, use of the slot, tile, chunk)
    int iq = 0, islot = 0, iuse = 0, it = 0, ich = 0;
    const u32 ring_s = smem_addr(ring) + warp * stride + 16 * lane;
    auto issue_next = [&]() {
        if (iq >= nst) return;
        if (iuse > 0) mbar_wait(empty + islot, (u32)(iuse - 1) & 1u);  // all warps are done with the slot
        const i64 r = (tile0 + it) * kWsRows + warp;
        if (r < M) {
            const int units = min(kc, nbl - ich * kc) * QC_Q4_0_BLOCK_BYTES / 16;
            const u8* src = wq + (r * nbk + kb0 + (i64)ich * kc) * QC_Q4_0_BLOCK_BYTES + 16 * lane;
            u32 dst = ring_s + islot * stage_bytes;
            for (int u = lane; u < units; u += 32, src += 512, dst += 512) cp_async16(dst, src);  // L2 only: the weights are read once
        }
        ws_cp_arrive(full + islot);
        ++iq;
        if (++islot == nstage) islot = 0, ++iuse;
        if (++ich == nch) ich = 0, ++it;
    };
    const int ahead = nstage > 2 ? nstage - 2 : 1;  // stages in flight ahead of the one consumed

    if (LD == 0 && warp == kWsWarps) {  // producer: stage s = (tile s / nch, chunk s % nch) into slot s % nstage
        // slot, use of the slot, tile and chunk are stepped, not divided out (a runtime division is
        // ~20 instructions)
        int slot = 0, use = 0, t = 0, ch = 0;
        for (int s = 0; s < nst; ++s) {
            if (use > 0) mbar_wait(empty + slot, (u32)(use - 1) & 1u);
            const i64 r0 = (tile0 + t) * kWsRows;
            const int nr = (int)min((i64)kWsRows, M - r0);
            const u32 bytes = (u32)min(kc, nbl - ch * kc) * QC_Q4_0_BLOCK_BYTES;
            if (lane == 0) mbar_expect_tx(full + slot, (u32)nr * bytes);
            __syncwarp();
            if (lane < nr)
                bulk_copy(ring + slot * stage_bytes + lane * stride,
                          wq + ((r0 + lane) * nbk + kb0 + (i64)ch * kc) * QC_Q4_0_BLOCK_BYTES, bytes, full + slot);
            if (++slot == nstage) slot = 0, ++use;
            if (++ch == nch) ch = 0, ++t;
        }
    } else {
        if (LD == 1)
            for (int q = 0; q < ahead; ++q) issue_next();
        // prologue: the activation slice as Q8_1, one lane per block; columns n >= N are zeros
        const int nu = NB * nbl;
        if (vec) {
            // the next block's raw bytes are loaded before this one is quantized (its load latency
            // under this block's quantization)
            WsRaw<T> cur, nxt;
            const typename T::S* a = reinterpret_cast<const typename T::S*>(act);
            int u = threadIdx.x, n = u / max(nbl, 1), bl = u - n * nbl;
            if (u < nu && n < N) cur.load(a + (i64)n * K + (kb0 + bl) * kQK);
            for (; u < nu; u += kWsWarps * 32) {
                const int un = u + kWsWarps * 32, nn = un / nbl, bln = un - nn * nbl;
                if (un < nu && nn < N) nxt.load(a + (i64)nn * K + (kb0 + bln) * kQK);
                u32 qw[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
                float d8 = 0.0f, s8x8 = 0.0f;
                if (n < N) {
                    float v[kQK];
                    cur.to_f32(v);
                    ws_q8_1_block(v, qw, d8, s8x8);
                }
                ws_store_act(aq, ads, NB, bl, n, qw, d8, s8x8);
                cur = nxt;
                n = nn;
                bl = bln;
            }
        } else {
            for (int u = threadIdx.x; u < nu; u += kWsWarps * 32) {
                const int n = u / nbl, bl = u - n * nbl;
                u32 qw[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
                float d8 = 0.0f, s8x8 = 0.0f;
                if (n < N) {
                    float v[kQK];
                    load_block<T>(reinterpret_cast<const typename T::S*>(act) + (i64)n * K + (kb0 + bl) * kQK,
                                  vec != 0, v);
                    ws_q8_1_block(v, qw, d8, s8x8);
                }
                ws_store_act(aq, ads, NB, bl, n, qw, d8, s8x8);
            }
        }
        consumers_sync();

        const int g = lane >> 2, c = lane & 3;
        const int kcp = kc / 2, npairs = nbl / 2;
        int slot = 0;
        u32 phase = 0;  // stage s sits in slot s % nstage, its use (s / nstage) & 1: stepped, not divided
        for (int t = 0; t < ntl; ++t) {
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int ch = 0; ch < nch; ++ch) {
                if (LD == 1) issue_next();  // stage s + ahead
                mbar_wait(full + slot, phase);
                const u8* st = ring + slot * stage_bytes;
                const int pbeg = ch * kcp, pend = min(pbeg + kcp, npairs);
                const int p0 = pbeg + ((warp - pbeg) & (kWsWarps - 1));  // the first pair p = warp mod kWsWarps
                // per pair p: row bytes at 36 (p - pbeg), activation of blocks 2p and 2p + 1
                const u8* rg = st + g * stride + 36 * (p0 - pbeg);
                const u32* bq = aq + (2 * p0 * NB + (g & (NB - 1))) * 8 + 2 * c;
                const Pair* dsp = ads + 2 * p0 * NB + ((2 * c) & (NB - 1));
                for (int p = p0; p < pend; p += kWsWarps) {
                    const u8* rg8 = rg + 8 * stride;
                    const u32 x0 = *reinterpret_cast<const u32*>(rg + 4 * c);
                    const u32 x1 = *reinterpret_cast<const u32*>(rg + 4 * c + 4);
                    const u32 x2 = *reinterpret_cast<const u32*>(rg + 4 * c + 20);
                    const u32 y0 = *reinterpret_cast<const u32*>(rg8 + 4 * c);
                    const u32 y1 = *reinterpret_cast<const u32*>(rg8 + 4 * c + 4);
                    const u32 y2 = *reinterpret_cast<const u32*>(rg8 + 4 * c + 20);
                    const u32 xh = *reinterpret_cast<const u32*>(rg), xh1 = *reinterpret_cast<const u32*>(rg + 16);
                    const u32 yh = *reinterpret_cast<const u32*>(rg8), yh1 = *reinterpret_cast<const u32*>(rg8 + 16);
                    // block 2p: d in bytes 0-1, quants from byte 2 (realigned); block 2p + 1: d in
                    // bytes 18-19, quants from byte 20 (aligned)
                    ws_block<NB>(acc, __byte_perm(x0, x1, 0x5432u), __byte_perm(y0, y1, 0x5432u),
                                 f16_to_f32((u16)(xh & 0xffffu)), f16_to_f32((u16)(yh & 0xffffu)), bq, dsp);
                    ws_block<NB>(acc, x2, y2, f16_to_f32((u16)(xh1 >> 16)), f16_to_f32((u16)(yh1 >> 16)), bq + NB * 8,
                                 dsp + NB);
                    rg += 36 * kWsWarps;
                    bq += 2 * kWsWarps * NB * 8;
                    dsp += 2 * kWsWarps * NB;
                }
                __syncwarp();
                if (lane == 0) mbar_arrive(empty + slot);
                if (++slot == nstage) slot = 0, phase ^= 1u;
            }
            // the tile's partial sums of the consumer warps, added in warp order
            float* rw = red + ((t & 1) * kWsWarps + warp) * kWsRows * NB;
            if (2 * c < NB) {
                rw[g * NB + 2 * c] = acc[0];
                rw[(g + 8) * NB + 2 * c] = acc[2];
                if (2 * c + 1 < NB) {
                    rw[g * NB + 2 * c + 1] = acc[1];
                    rw[(g + 8) * NB + 2 * c + 1] = acc[3];
                }
            }
            consumers_sync();
            for (int i = threadIdx.x; i < kWsRows * NB; i += kWsWarps * 32) {
                const float* r = red + (t & 1) * kWsWarps * kWsRows * NB + i;
                float sum = 0.0f;
#pragma unroll
                for (int w = 0; w < kWsWarps; ++w) sum += r[w * kWsRows * NB];
                part[t * kWsRows * NB + i] = sum;
            }
        }
    }

    // the partial sums of the cluster, added in rank order; CTA `rank` writes its share of rows:
    // yt = 0 as fp32 out[m * N + n], yt = 1 as a linear layer's y[n * M + m] in T (one rounding of
    // the same fp32 sum; consecutive threads take consecutive m of one y row)
    if (CL > 1) cluster_sync(); else __syncthreads();
    const int per = tpc * kWsRows / CL;
    for (int idx = threadIdx.x; idx < per * NB; idx += blockDim.x) {
        const int rr = (int)rank * per + (yt ? idx % per : idx / NB), n = yt ? idx / per : idx % NB;
        const i64 m = tile0 * kWsRows + rr;
        if (m < M && n < N) {
            float sum = 0.0f;
            if (CL > 1) {
#pragma unroll
                for (u32 q = 0; q < (u32)CL; ++q) sum += ld_cluster_f32(part + rr * NB + n, q);
            } else {
                sum = part[rr * NB + n];
            }
            if (yt)
                reinterpret_cast<typename T::S*>(out)[n * M + m] = T::from_f(sum);
            else
                reinterpret_cast<float*>(out)[m * N + n] = sum;
        }
    }
    if (CL > 1) cluster_sync();  // no CTA leaves while another reads its shared memory
#endif
}


// ==================================================================================================
// W4A8 on int8 tensor cores for any N (the N <= 8 stream kernel above aside): a Q8_1 pre-pass
// into a workspace, then a tiled GEMM
// ==================================================================================================
// Workspace (the launcher allocates it per call): the activation as Q8_1 values in layouts the
// GEMM copies with 16-byte cp.async. npad = N rounded up to QC_W4T_NPAD, nbp = the block count nb
// rounded up to QC_W4T_BK; rows n >= N and blocks b >= nb are zeros (they add 0 to every sum).
//   quants  int8 [npad][nbp * 32]
//   dm      fp32 pairs [nbp][npad]: (d8, -d8 * 1.5 * 2^23), d8 the block's fp16 d (the product is
//           exact: 11 x 2 significant bits)
//   s       fp16 [npad][nbp]: the block's stored s
constexpr int kTcBK = QC_W4T_BK;
constexpr int kTcWRow = kTcBK * QC_Q4_0_BLOCK_BYTES;  // a weight row's bytes per stage (144)
constexpr int kTcARow = kTcBK * kQK + QC_W4T_APAD;      // an activation row's bytes per stage (272)
constexpr float kTcMagic = 12582912.0f;                 // 1.5 * 2^23, the float of kWsMagic's bits
static_assert(kTcBK == 8, "a stage is 4 pairs of Q4_0 blocks (144 bytes, whole 16-byte units) and one k8 mma");
static_assert(kTcWRow % 16 == 0 && (kTcWRow / 4) % 32 == 4, "weight rows 4 banks apart");
static_assert((kTcARow / 16) % 2 == 1, "activation rows in distinct 16-byte bank groups (ldmatrix)");

__host__ __device__ constexpr i64 w4t_dm_offset(int npad, i64 nbp) { return (i64)npad * nbp * kQK; }
__host__ __device__ constexpr i64 w4t_s_offset(int npad, i64 nbp) { return (i64)npad * nbp * (kQK + 8); }
static_assert(QC_W4T_WS_BLOCK_BYTES == kQK + 8 + 2, "the launcher sizes the workspace with QC_W4T_WS_BLOCK_BYTES");

// One thread per block (n, b), n-major: QUANTIZE the float activation x [N, K] (ws_q8_1_block_bits:
// quantize_q8_1's bytes), else repack given Q8_1 blocks [N, nb, 36].
template <typename T, bool QUANTIZE>
__global__ void __launch_bounds__(QC_GGML_THREADS) w4a8_tc_act_kernel(const void* __restrict__ x, u8* __restrict__ ws, int N,
                                                          i64 nb, int npad, i64 nbp, int vec, int aligned4) {
    const i64 u = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (u >= (i64)npad * nbp) return;
    const int n = (int)(u / nbp);
    const i64 b = u - (i64)n * nbp;
    u32 qw[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
    float d8 = 0.0f;
    u16 sbits = 0;
    if (n < N && b < nb) {
        if (QUANTIZE) {
            const typename T::S* src = reinterpret_cast<const typename T::S*>(x) + ((i64)n * nb + b) * kQK;
            float v[kQK];
            if (vec) {
                WsRaw<T> raw;
                raw.load(src);
                raw.to_f32(v);
            } else {
                load_block<T>(src, false, v);
            }
            ws_q8_1_block_bits(v, qw, d8, sbits);
        } else {
            const u8* blk = reinterpret_cast<const u8*>(x) + ((i64)n * nb + b) * QC_Q8_1_BLOCK_BYTES;
            d8 = f16_to_f32((u16)(ldg_u8(blk) | (ldg_u8(blk + 1) << 8)));
            sbits = (u16)(ldg_u8(blk + 2) | (ldg_u8(blk + 3) << 8));
#pragma unroll
            for (int w = 0; w < 8; ++w) {
                const u8* q = blk + 4 + 4 * w;
                qw[w] = aligned4 ? ldg_u32(q)
                                 : (ldg_u8(q) | (ldg_u8(q + 1) << 8) | (ldg_u8(q + 2) << 16) | (ldg_u8(q + 3) << 24));
            }
        }
    }
    uint4* dq = reinterpret_cast<uint4*>(ws + u * kQK);
    dq[0] = make_uint4(qw[0], qw[1], qw[2], qw[3]);
    dq[1] = make_uint4(qw[4], qw[5], qw[6], qw[7]);
    reinterpret_cast<Pair*>(ws + w4t_dm_offset(npad, nbp))[b * npad + n] = Pair{d8, -d8 * kTcMagic};
    reinterpret_cast<u16*>(ws + w4t_s_offset(npad, nbp))[u] = sbits;
}

__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// D = A (16 x 8 fp16, row) x B (8 x 8 fp16, col), fp32, accumulator zero
__device__ __forceinline__ void mma_f16_1688(float (&d)[4], u32 a0, u32 a1, u32 b0) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%7,%7,%7};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a0), "r"(a1), "r"(b0), "f"(0.0f));
}

// The CTA tile: WGM (rows) x WGN (columns) x WGK (K: the block pairs of a stage split between
// warps, their sums added in a fixed order at the end) warps; a warp owns MT 16-row tiles x 4
// 8-column tiles (16 MT x 32); ST pipeline stages of kTcBK blocks.
template <int MT, int WGM, int WGN, int WGK, int ST>
struct TcTile {
    static constexpr int kWarps = WGM * WGN * WGK, kThreads = 32 * kWarps;
    static constexpr int kBM = 16 * MT * WGM, kBN = 32 * WGN;
    static constexpr int kWBytes = kBM * kTcWRow, kABytes = kBN * kTcARow, kDBytes = kTcBK * kBN * 8;
    static constexpr int kSBytes = kBN * kTcBK * 2;
    static constexpr int kStage = kWBytes + kABytes + kDBytes + kSBytes;
    static constexpr int kRedBytes = (WGK - 1) * WGM * WGN * MT * 64 * 32 * 4;
    // 16-byte chunks of a stage per part; per thread (rounded up)
    static constexpr int kWCh = kBM * kTcWRow / 16, kACh = kBN * kTcBK * kQK / 16, kDCh = kDBytes / 16,
                         kSCh = kSBytes / 16;
    static constexpr int kWIt = (kWCh + kThreads - 1) / kThreads, kAIt = kACh / kThreads,
                         kDIt = (kDCh + kThreads - 1) / kThreads;
    static_assert((kTcBK / 2) % WGK == 0 && ST >= 2, "warp grid, pipeline");
    static_assert(kBN <= QC_W4T_NPAD && QC_W4T_NPAD % kBN == 0, "workspace rows cover every column tile");
    static_assert(kACh % kThreads == 0 && kThreads % 16 == 0, "activation chunks: whole passes, 16 per row");
    static_assert(kThreads % (kBN / 2) == 0 && kSCh <= kThreads, "d8 chunks: whole column tiles per pass; s: one");
};

// out [M, N] fp32 = Q4_0 wq [M, nb] x the workspace's activation; grid (cdiv(M, BM), cdiv(N, BN)).
// wfast: nb % 8 == 0 and wq 16-byte aligned (weights by cp.async), else byte loads. ovec: N even
// and out 8-byte aligned (float2 stores). Shared memory: max(ST * kStage, kRedBytes) (the kernel traps on less).
//
// out[m, n] = sum_b d4 (d8 sumi - 8 s8), accumulated in fp32 as
//   sum_b d4 * round(d8 * sumi): per Q4_0 block one mma.m16n8k32.s8 per (16-row, 8-column)
//     tile: the nibbles 0..15 are A as they are (qs bytes 4c..4c+3 hold k 4c..4c+3 in their low
//     and k 16+4c.. in their high nibbles: the A fragment's columns), the Q8_1 quants B (ldmatrix
//     from rows padded to distinct banks); the accumulator starts at the bits of 1.5 * 2^23, so the
//     result read as a float f is 1.5 * 2^23 + sumi exactly and fma(d8, f, -d8 * 1.5 * 2^23) is
//     d8 * sumi rounded once; then fma(d4, ., acc): two fp32 operations per element and block.
//   - 8 sum_b d4 s8: per stage one mma.m16n8k8 f16 (d4 of the rows x s of the columns over the
//     stage's 8 blocks: the products are exact, 11 x 11 bits) into a zero accumulator, then
//     fma(-8, ., acc): one fp32 operation per element and stage.
// Every output is summed by one thread in block order (split-K warps: their partial sums added in
// warp order): deterministic.
template <int MT, int WGM, int WGN, int WGK, int ST>
__global__ void __launch_bounds__(WGM * WGN * WGK * 32, 1) gemm_w4a8_tc_kernel(
    const u8* __restrict__ wq, const u8* __restrict__ ws, float* __restrict__ out, i64 M, int N, i64 nb, int npad,
    i64 nbp, int wfast, int ovec) {
    using G = TcTile<MT, WGM, WGN, WGK, ST>;
    extern __shared__ __attribute__((aligned(16))) u8 smem[];
    require_dynamic_smem(max(ST * G::kStage, G::kRedBytes));
    const int tid = threadIdx.x, warp = tid >> 5, lane = lane_id(), g = lane >> 2, c = lane & 3;
    const int wk = warp % WGK, wm = (warp / WGK) % WGM, wn = warp / (WGK * WGM);
    const i64 m0 = (i64)blockIdx.x * G::kBM;
    const int n0 = blockIdx.y * G::kBN;
    const i64 kp = nbp * kQK;
    const int nkt = (int)(nbp / kTcBK);

    // this thread's 16-byte chunks of every stage: sources at stage 0 (advanced by a fixed step per
    // stage) and offsets in the stage
    const u8* wsrc[G::kWIt];
    u32 wdst[G::kWIt];
#pragma unroll
    for (int j = 0; j < G::kWIt; ++j) {
        const int i = min(tid + j * G::kThreads, G::kWCh - 1), r = i / (kTcWRow / 16), ch = i - r * (kTcWRow / 16);
        wsrc[j] = wq + min(m0 + r, M - 1) * nb * QC_Q4_0_BLOCK_BYTES + ch * 16;  // rows past M: never stored
        wdst[j] = r * kTcWRow + ch * 16;
    }
    const u8* asrc = ws + (i64)(n0 + tid / 16) * kp + (tid & 15) * 16;
    const u32 adst = G::kWBytes + (tid / 16) * kTcARow + (tid & 15) * 16;
    const int db = tid / (G::kBN / 2), dj = tid - db * (G::kBN / 2);
    const u8* dsrc = ws + w4t_dm_offset(npad, nbp) + ((i64)db * npad + n0 + 2 * dj) * 8;
    const u32 ddst = G::kWBytes + G::kABytes + tid * 16;
    const u8* ssrc = ws + w4t_s_offset(npad, nbp) + ((i64)(n0 + tid) * nbp) * 2;
    const u32 sdst = G::kWBytes + G::kABytes + G::kDBytes + tid * 16;
    const u32 sbase = smem_addr(smem);

    auto load = [&](int slot, int kt) {
        const u32 st = sbase + slot * G::kStage;
        const i64 kb0 = (i64)kt * kTcBK;
        if (wfast) {
#pragma unroll
            for (int j = 0; j < G::kWIt; ++j)
                if (G::kWCh % G::kThreads == 0 || tid + j * G::kThreads < G::kWCh)
                    cp_async16(st + wdst[j], wsrc[j] + kb0 * QC_Q4_0_BLOCK_BYTES);
        } else {  // blocks past nb are zeros: d4 = 0
            u8* sw = smem + slot * G::kStage;
            for (int i = tid; i < G::kBM * kTcWRow; i += G::kThreads) {
                const int r = i / kTcWRow, o = i - r * kTcWRow;
                const i64 gr = min(m0 + r, M - 1);
                sw[i] = kb0 + o / QC_Q4_0_BLOCK_BYTES < nb
                            ? (u8)ldg_u8(wq + (gr * nb + kb0) * QC_Q4_0_BLOCK_BYTES + o) : (u8)0;
            }
        }
#pragma unroll
        for (int j = 0; j < G::kAIt; ++j)
            cp_async16(st + adst + j * (G::kThreads / 16) * kTcARow,
                       asrc + (i64)j * (G::kThreads / 16) * kp + kb0 * kQK);
#pragma unroll
        for (int j = 0; j < G::kDIt; ++j)
            if (G::kDCh % G::kThreads == 0 || tid + j * G::kThreads < G::kDCh)
                cp_async16(st + ddst + j * G::kThreads * 16, dsrc + (kb0 + j * (G::kThreads / (G::kBN / 2))) * npad * 8);
        if (tid < G::kSCh) cp_async16(st + sdst, ssrc + kb0 * 2);
    };

    float acc[MT][4][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

#pragma unroll
    for (int s = 0; s < ST - 1; ++s) {
        if (s < nkt) load(s, s);
        cp_async_commit();
    }
    int slot = 0;
    for (int kt = 0; kt < nkt; ++kt) {
        cp_async_wait<ST - 2>();
        __syncthreads();  // stage kt landed for every thread; the slot refilled below was consumed
        {
            const int nx = kt + ST - 1;
            if (nx < nkt) load(slot == 0 ? ST - 1 : slot - 1, nx);
            cp_async_commit();
        }
        const u8* st = smem + slot * G::kStage;
        const u32* wsm = reinterpret_cast<const u32*>(st);
        const u32 sa = sbase + slot * G::kStage + G::kWBytes;
        const float* dsm = reinterpret_cast<const float*>(st + G::kWBytes + G::kABytes);
        const u32* ssm = reinterpret_cast<const u32*>(st + G::kWBytes + G::kABytes + G::kDBytes);
        if (++slot == ST) slot = 0;
        // corr: d4 of rows g, g + 8 over blocks 2c, 2c + 1 (pair c: d at bytes 0-1 and 18-19) x s
        if (wk == 0) {
            u32 sb[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) sb[j] = ssm[(wn * 32 + 8 * j + g) * (kTcBK / 2) + c];
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                const u32* r0 = wsm + (wm * 16 * MT + 16 * i + g) * (kTcWRow / 4) + 9 * c;
                const u32* r1 = r0 + 8 * (kTcWRow / 4);
                const u32 a0 = __byte_perm(r0[0], r0[4], 0x7610u), a1 = __byte_perm(r1[0], r1[4], 0x7610u);
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    float d[4];
                    mma_f16_1688(d, a0, a1, sb[j]);
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[i][j][e] = fmaf(-8.0f, d[e], acc[i][j][e]);
                }
            }
        }
#pragma unroll
        for (int pp = 0; pp < kTcBK / 2 / WGK; ++pp) {
            const int p = wk + pp * WGK;  // block pair: blocks 2p, 2p + 1 at bytes 36p of each row
            u32 qa[MT][2][2];
            float da[MT][2][2];
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const u32* rw = wsm + (wm * 16 * MT + 16 * i + g + 8 * h) * (kTcWRow / 4) + 9 * p;
                    const u32 x0 = rw[c], x1 = rw[c + 1], x2 = rw[5 + c], xh = rw[0], xh1 = rw[4];
                    qa[i][0][h] = __byte_perm(x0, x1, 0x5432u);  // block 2p: quants from byte 2
                    qa[i][1][h] = x2;                            // block 2p + 1: quants from byte 20
                    da[i][0][h] = f16_to_f32((u16)(xh & 0xffffu));
                    da[i][1][h] = f16_to_f32((u16)(xh1 >> 16));
                }
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int bl = 2 * p + e;
                u32 b[4][2];
#pragma unroll
                for (int jj = 0; jj < 2; ++jj) {
                    const int row = wn * 32 + jj * 16 + (lane >> 4) * 8 + (lane & 7);
                    ldsm_x4(sa + row * kTcARow + bl * kQK + ((lane >> 3) & 1) * 16, b[2 * jj][0], b[2 * jj][1],
                            b[2 * jj + 1][0], b[2 * jj + 1][1]);
                }
                float4 sc[4];  // (d8, -d8 * 1.5 * 2^23) of columns 2c, 2c + 1 of each column tile
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    sc[j] = *reinterpret_cast<const float4*>(dsm + (bl * G::kBN + wn * 32 + 8 * j + 2 * c) * 2);
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    const u32 a[4] = {qa[i][e][0] & 0x0f0f0f0fu, qa[i][e][1] & 0x0f0f0f0fu,
                                      (qa[i][e][0] >> 4) & 0x0f0f0f0fu, (qa[i][e][1] >> 4) & 0x0f0f0f0fu};
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        int d[4];
                        mma_s8_16832_magic(d, a, b[j][0], b[j][1]);
                        acc[i][j][0] = fmaf(da[i][e][0], fmaf(sc[j].x, __int_as_float(d[0]), sc[j].y), acc[i][j][0]);
                        acc[i][j][1] = fmaf(da[i][e][0], fmaf(sc[j].z, __int_as_float(d[1]), sc[j].w), acc[i][j][1]);
                        acc[i][j][2] = fmaf(da[i][e][1], fmaf(sc[j].x, __int_as_float(d[2]), sc[j].y), acc[i][j][2]);
                        acc[i][j][3] = fmaf(da[i][e][1], fmaf(sc[j].z, __int_as_float(d[3]), sc[j].w), acc[i][j][3]);
                    }
                }
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // the stages are free: the split-K partial sums go there

    if (WGK > 1) {
        float* red = reinterpret_cast<float*>(smem);
        const int tw = wm + WGM * wn;
        if (wk > 0) {
            float* r = red + ((wk - 1) * WGM * WGN + tw) * (MT * 64 * 32) + lane;
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) r[((i * 4 + j) * 4 + e) * 32] = acc[i][j][e];
        }
        __syncthreads();
        if (wk > 0) return;
        for (int w = 1; w < WGK; ++w) {
            const float* r = red + ((w - 1) * WGM * WGN + tw) * (MT * 64 * 32) + lane;
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[i][j][e] += r[((i * 4 + j) * 4 + e) * 32];
        }
    }
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const i64 r = m0 + wm * 16 * MT + 16 * i + g + 8 * h;
            if (r >= M) continue;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int n = n0 + wn * 32 + 8 * j + 2 * c;
                float* o = out + r * N + n;
                const float v0 = acc[i][j][2 * h], v1 = acc[i][j][2 * h + 1];
                if (ovec && n + 1 < N) {
                    *reinterpret_cast<float2*>(o) = make_float2(v0, v1);
                } else {
                    if (n < N) o[0] = v0;
                    if (n + 1 < N) o[1] = v1;
                }
            }
        }
}

}  // namespace qc
