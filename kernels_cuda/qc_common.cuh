// Shared helpers of the CUDA kernels: element types, exact conversions, vector memory access,
// warp reductions and the format tables (taken from quantcore_constants.h, never spelled here).
//
// Compiled at run time by NVRTC (quantcore.backends.cuda) and, as a check, by nvcc. No CUDA
// header is included on purpose: every conversion and memory access that matters for
// bit-exactness or speed is written in PTX, so NVRTC and nvcc see the same code and no include
// path to the toolkit is needed. Kernels are built with -ftz=false --fmad=false: plain float
// arithmetic is IEEE round-to-nearest with subnormals, and a*b+c is never contracted unless
// fmaf() is written (the formats require two separate roundings in several places).
#pragma once
#include "quantcore_constants.h"

namespace qc {

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
typedef signed char i8;

// log2 of a power of two, at compile time
__host__ __device__ constexpr int ilog2(unsigned v) { return v > 1u ? 1 + ilog2(v >> 1) : 0; }

constexpr u32 kFullMask = 0xffffffffu;

struct alignas(8) Pair {
    float x, y;
};

// -- element types -------------------------------------------------------------------------------
// Each tag names the storage type S of one float dtype and converts one element to and from fp32
// with round-to-nearest-even, keeping subnormals.
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float((u32)h << 16); }
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

struct F32 {
    typedef float S;
    static constexpr int kBytes = 4;
    static constexpr bool kBf16 = false;
    static __device__ __forceinline__ float to_f(S v) { return v; }
    static __device__ __forceinline__ S from_f(float f) { return f; }
    // two fp32 values packed into one 32-bit word is not possible: F32 stores go element-wise
};
struct F16 {
    typedef u16 S;
    static constexpr int kBytes = 2;
    static constexpr bool kBf16 = false;
    static __device__ __forceinline__ float to_f(S v) { return f16_to_f32(v); }
    static __device__ __forceinline__ S from_f(float f) { return f32_to_f16(f); }
    static __device__ __forceinline__ u32 pack2(float lo, float hi) {
        u32 r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static __device__ __forceinline__ float lo(u32 w) { return f16_to_f32((u16)(w & 0xffffu)); }
    static __device__ __forceinline__ float hi(u32 w) { return f16_to_f32((u16)(w >> 16)); }
};
struct BF16 {
    typedef u16 S;
    static constexpr int kBytes = 2;
    static constexpr bool kBf16 = true;
    static __device__ __forceinline__ float to_f(S v) { return bf16_to_f32(v); }
    static __device__ __forceinline__ S from_f(float f) { return f32_to_bf16(f); }
    static __device__ __forceinline__ u32 pack2(float lo, float hi) {
        u32 r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static __device__ __forceinline__ float lo(u32 w) { return __uint_as_float(w << 16); }
    static __device__ __forceinline__ float hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }
};

// -- memory access ---------------------------------------------------------------------------------
// Read-only loads go through the non-coherent path: inputs are never written while a kernel runs.
// The asm is volatile: to the compiler a non-volatile asm is a pure function of its operands, which
// it may evaluate ahead of the branch that guards it (a bounds check) and read past an allocation.
__device__ __forceinline__ u32 ldg_u32(const void* p) {
    u32 v;
    asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ u32 ldg_u16(const void* p) {
    u16 v;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ u32 ldg_u8(const void* p) {
    u16 v;
    asm volatile("ld.global.nc.u8 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ float ldg_f32(const float* p) {
    float v;
    asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ u64 ldg_u64(const void* p) {
    u64 v;
    asm volatile("ld.global.nc.u64 %0, [%1];" : "=l"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ void ldg_v4(const void* p, u32& a, u32& b, u32& c, u32& d) {
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "l"(p));
}
// Streaming loads of data read exactly once (quantized weights): keep L1 for what is reused.
__device__ __forceinline__ u32 ldg_stream_u32(const void* p) {
    u32 v;
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ void stg_v4(void* p, u32 a, u32 b, u32 c, u32 d) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" :: "l"(p), "r"(a), "r"(b), "r"(c), "r"(d)
                 : "memory");
}

// 8 consecutive elements starting at x[e0] as fp32. Vector loads when the caller guarantees a
// 16-byte aligned base and e0 + 8 <= n; otherwise element loads, with 0 past n (the formats pad
// a partial last block with zeros).
template <typename T>
__device__ __forceinline__ void load8(const typename T::S* x, i64 e0, i64 n, bool vec, float (&v)[8]);

template <>
__device__ __forceinline__ void load8<F32>(const float* x, i64 e0, i64 n, bool vec, float (&v)[8]) {
    if (vec && e0 + 8 <= n) {
        u32 w[8];
        ldg_v4(x + e0, w[0], w[1], w[2], w[3]);
        ldg_v4(x + e0 + 4, w[4], w[5], w[6], w[7]);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = __uint_as_float(w[i]);
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = (e0 + i < n) ? ldg_f32(x + e0 + i) : 0.0f;
    }
}

template <typename T>
__device__ __forceinline__ void load8_half(const u16* x, i64 e0, i64 n, bool vec, float (&v)[8]) {
    if (vec && e0 + 8 <= n) {
        u32 w[4];
        ldg_v4(x + e0, w[0], w[1], w[2], w[3]);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[2 * i] = T::lo(w[i]);
            v[2 * i + 1] = T::hi(w[i]);
        }
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = (e0 + i < n) ? T::to_f((u16)ldg_u16(x + e0 + i)) : 0.0f;
    }
}
template <>
__device__ __forceinline__ void load8<F16>(const u16* x, i64 e0, i64 n, bool vec, float (&v)[8]) {
    load8_half<F16>(x, e0, n, vec, v);
}
template <>
__device__ __forceinline__ void load8<BF16>(const u16* x, i64 e0, i64 n, bool vec, float (&v)[8]) {
    load8_half<BF16>(x, e0, n, vec, v);
}

// 8 consecutive outputs at out[e0]: one rounding from fp32 each; vector stores when aligned and
// whole, otherwise element stores of those below n.
template <typename T>
__device__ __forceinline__ void store8(typename T::S* out, i64 e0, i64 n, bool vec, const float (&v)[8]);

template <>
__device__ __forceinline__ void store8<F32>(float* out, i64 e0, i64 n, bool vec, const float (&v)[8]) {
    if (vec && e0 + 8 <= n) {
        stg_v4(out + e0, __float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]),
               __float_as_uint(v[3]));
        stg_v4(out + e0 + 4, __float_as_uint(v[4]), __float_as_uint(v[5]), __float_as_uint(v[6]),
               __float_as_uint(v[7]));
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i)
            if (e0 + i < n) out[e0 + i] = v[i];
    }
}
template <typename T>
__device__ __forceinline__ void store8_half(u16* out, i64 e0, i64 n, bool vec, const float (&v)[8]) {
    if (vec && e0 + 8 <= n) {
        stg_v4(out + e0, T::pack2(v[0], v[1]), T::pack2(v[2], v[3]), T::pack2(v[4], v[5]),
               T::pack2(v[6], v[7]));
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i)
            if (e0 + i < n) out[e0 + i] = T::from_f(v[i]);
    }
}
template <>
__device__ __forceinline__ void store8<F16>(u16* out, i64 e0, i64 n, bool vec, const float (&v)[8]) {
    store8_half<F16>(out, e0, n, vec, v);
}
template <>
__device__ __forceinline__ void store8<BF16>(u16* out, i64 e0, i64 n, bool vec, const float (&v)[8]) {
    store8_half<BF16>(out, e0, n, vec, v);
}

// -- warp helpers ----------------------------------------------------------------------------------
__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }

// Max of a value over the G consecutive threads of one quantization block (G a power of two up
// to 512 - blocksize / elements per thread; the CTA holds whole groups). NaN-ignoring like the
// format's absmax. Every shuffle step runs (no loop bound, no branch): a step past the group
// shuffles with lane ^ 0, itself (off & (G - 1) is off below G, else 0). For G > 32 the caller
// puts a barrier before red[] is written again.
__device__ __forceinline__ float group_absmax(float m, int G, float* red) {
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) m = fmaxf(m, __shfl_xor_sync(kFullMask, m, off & (G - 1)));
    if (G > 32) {  // uniform over the CTA
        const int warp = threadIdx.x >> 5, wpg = G >> 5, first = (warp / wpg) * wpg;
        if (lane_id() == 0) red[warp] = m;
        __syncthreads();
        m = red[first];
        for (int j = 1; j < wpg; ++j) m = fmaxf(m, red[first + j]);
    }
    return m;
}

// -- the decode gemvs' tiles shared by warps (bnb_gemv.cu, mx_gemv.cu) -----------------------------
// A warp's range of chunks cuts at most two tiles (16 weight rows x H blocks of 8 input rows): the
// piece of its first tile that an earlier warp began (kept) and the piece of its last tile that a
// later warp ends (acc). The warp leaves them in its ring (`part`, drained): slot s at float
// s * part_len, element h * 128 + 4 lane + r (the m16n8 C fragment of block h); last_slot < 0: none.
template <int H>
__device__ __forceinline__ void stash_tile_pieces(float* part, int part_len, bool have_keep, int last_slot,
                                                  const float (&keep)[H][4], const float (&acc)[H][4]) {
    const int lane = lane_id();
#pragma unroll
    for (int h = 0; h < H; ++h)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            if (have_keep) part[h * 128 + 4 * lane + r] = keep[h][r];
            if (last_slot >= 0) part[last_slot * part_len + h * 128 + 4 * lane + r] = acc[h][r];
        }
}
// A segment (the warp's range's piece of one tile) that is not the whole tile ends: the range's first
// piece, where more of the range follows (`more`), is kept for the end (keep); any other is the range's
// last piece and stays in acc (last_slot: its ring slot). Lane 0 records its tile in ptile (entry 2 warp
// + slot). Then the next segment: nseg counted, acc cleared where more follows.
template <int H, typename I>
__device__ __forceinline__ void end_tile_piece(bool more, int nseg, int tile, I* ptile, int warp, int lane,
                                               const float (&acc)[H][4], float (&keep)[H][4], bool& have_keep,
                                               int& last_slot) {
    if (nseg == 0 && more) {
#pragma unroll
        for (int h = 0; h < H; ++h)
#pragma unroll
            for (int r = 0; r < 4; ++r) keep[h][r] = acc[h][r];
        have_keep = true;
        if (lane == 0) ptile[2 * warp] = tile;
    } else {
        last_slot = nseg == 0 ? 0 : 1;
        if (lane == 0) ptile[2 * warp + last_slot] = tile;
    }
}
template <int H>
__device__ __forceinline__ void next_tile_segment(bool more, int& nseg, float (&acc)[H][4]) {
    ++nseg;
    if (more) {
#pragma unroll
        for (int h = 0; h < H; ++h) acc[h][0] = acc[h][1] = acc[h][2] = acc[h][3] = 0.0f;
    }
}
// ptile[0 .. n): the tile of piece entry i (warp i / 2, slot i % 2), -1 unused; a tile's pieces are the
// entries of consecutive warps. Threads 0 .. n - 1 write link[i]: the entry of the tile's next piece
// (0xff: none), bit 8 set on the tile's first piece, -1 for an unused entry. (The caller syncs.)
template <typename I>
__device__ __forceinline__ void link_tile_pieces(const I* ptile, int* link, int n) {
    if ((int)threadIdx.x < n) {
        const int i = threadIdx.x;
        const I tile = ptile[i];
        int nx = 0xff;
        for (int q = i + 1; q < n && tile >= 0; ++q) {
            const I tq = ptile[q];
            if (tq == tile) {
                nx = q;
                break;
            }
            if (tq >= 0) break;
        }
        int prev = i - 1;
        while (prev >= 0 && ptile[prev] < 0) --prev;
        const bool lead = tile >= 0 && !(prev >= 0 && ptile[prev] == tile);
        link[i] = tile < 0 ? -1 : (lead ? nx | 0x100 : nx);
    }
}
// The sum of a tile's pieces, element e, for its first piece's entry i (link[i] = l, bit 8 set), added
// in entry order (the same bits on every run); part(i, e) reads entry i's element e.
template <typename F>
__device__ __forceinline__ float sum_tile_pieces(const int* link, int i, int l, int e, const F& part) {
    float sum = part(i, e);
    for (int q = l & 0xff; q != 0xff; q = link[q] & 0xff) sum += part(q, e);
    return sum;
}

__device__ __forceinline__ double shfl_xor_f64(double v, int mask) {
    int lo = __double2loint(v), hi = __double2hiint(v);
    lo = __shfl_xor_sync(kFullMask, lo, mask);
    hi = __shfl_xor_sync(kFullMask, hi, mask);
    return __hiloint2double(hi, lo);
}

// -- format tables ---------------------------------------------------------------------------------
__device__ const float kNf4Code[16] = QC_NF4_CODE_INIT;
__device__ const float kFp4Code[16] = QC_FP4_CODE_INIT;
__device__ const float kNf4Thresholds[QC_NF4_NTHRESHOLDS] = QC_NF4_THRESHOLDS_INIT;
__device__ const float kFp4Thresholds[QC_FP4_NTHRESHOLDS] = QC_FP4_THRESHOLDS_INIT;
__device__ const int kFp4StepCodes[QC_FP4_NTHRESHOLDS + 1] = QC_FP4_STEP_CODES_INIT;
constexpr int kDynNThr = QC_DYNAMIC_NTHRESHOLDS;
constexpr int kDynCodes = kDynNThr + 1;  // the dynamic map's codes (the nested statistics' code2)
__device__ const float kDynamicMap[kDynCodes] = QC_DYNAMIC_MAP_INIT;
// The nested (second-level) block of the 4-bit statistics: absmax2[b >> kNestLog2] scales block b.
constexpr int kNestBlock = QC_NESTED_BLOCKSIZE;
constexpr int kNestLog2 = 8;
static_assert(kNestBlock == 1 << kNestLog2, "kNestLog2 is log2 of the nested block size");
__device__ const float kDynamicThresholds[kDynNThr] = QC_DYNAMIC_THRESHOLDS_INIT;

template <int QT>
__device__ __forceinline__ float code_4bit(int q) {
    return QT == QC_QUANT_NF4 ? kNf4Code[q] : kFp4Code[q];
}
// The same from immediates (q in 0..15): no memory round trip, for a kernel's first instructions
// (a select chain in asm, which the compiler cannot turn back into an indexed local-memory table);
// the decode gemv's MX types (QC_GV_QT_MXFP4 / _NVFP4) take the E2M1 values
template <int QT>
__device__ __forceinline__ float code_4bit_imm(int q) {
    constexpr float kNf4[16] = QC_NF4_CODE_INIT, kFp4[16] = QC_FP4_CODE_INIT, kE2m1[16] = QC_E2M1_VALUES_INIT;
    auto tab = [&](int i) { return QT == QC_QUANT_NF4 ? kNf4[i] : (QT == QC_QUANT_FP4 ? kFp4[i] : kE2m1[i]); };
    float v = tab(0);
#pragma unroll
    for (int i = 1; i < 16; ++i)
        asm("{\n\t.reg .pred p;\n\tsetp.eq.s32 p, %1, %2;\n\tselp.f32 %0, %3, %0, p;\n\t}"
            : "+f"(v)
            : "r"(q), "r"(i), "f"(tab(i)));
    return v;
}

// A nested block's absmax from its second-level code's value c2v (code2[q]), its absmax2 a2 and the
// offset: c2v * a2 + offset, two roundings in that order (dequantize_4bit's rule)
__device__ __forceinline__ float nested_absmax(float c2v, float a2, float offset) {
    return __fadd_rn(__fmul_rn(c2v, a2), offset);
}

// acc += d times its rows' block scales: d an m16n8 fp32 C fragment of one scale block's product
// (d[0], d[1] on row g, d[2], d[3] on row g + 8), sa row g's scale, sb row g + 8's; one fma each
__device__ __forceinline__ void fma_rows(float* acc, const float* d, float sa, float sb) {
    acc[0] = fmaf(d[0], sa, acc[0]);
    acc[1] = fmaf(d[1], sa, acc[1]);
    acc[2] = fmaf(d[2], sb, acc[2]);
    acc[3] = fmaf(d[3], sb, acc[3]);
}

// -- the 4-bit pair table of the decode gemv and the many-row GEMM (bnb_gemv.cu, bnb_gemm.cu) ----------
// A per-lane table of T(hi nibble), T(lo nibble) for each code byte, its shared address a multiple of
// 64 KiB, so that one byte_perm forms an entry's address (lutx: the table's address | 4 lane).
// The pair of the byte of w that the byte_perm selector sel = 0x7604 | (j << 4) picks (byte j).
__device__ __forceinline__ u32 pair_lut_sel(u32 w, u32 lutx, u32 sel) {
    u32 r;
    asm("ld.shared.b32 %0, [%1];" : "=r"(r) : "r"(__byte_perm(w, lutx, sel)));
    return r;
}
template <int J>
__device__ __forceinline__ u32 pair_lut(u32 w, u32 lutx) {  // the pair of byte J of w
    return pair_lut_sel(w, lutx, 0x7604u | (J << 4));
}
// The table itself at tab (a multiple of 64 KiB): entry (code byte, lane) at tab + 256 byte + 4 lane,
// T(hi nibble) in its low half; bytes 128..255 of each row are left free. Filled by nthreads threads.
template <typename T, int QT>
__device__ __forceinline__ void fill_pair_table(u32 tab, int tid, int nthreads) {
    for (int i = tid; i < 256 * 8; i += nthreads) {
        const int byte = i >> 3;
        const u32 v = T::pack2(code_4bit<QT>(byte >> 4), code_4bit<QT>(byte & 15));
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(tab + byte * 256 + (i & 7) * 16), "r"(v)
                     : "memory");
    }
}
// The m16n8k16 A fragment of mma step m (0..3) of a 64-element chunk: lane (g, c) holds 8 code bytes of
// row g (wq[0..1]) and of row g + 8 (wq[2..3]); step m takes its bytes 2m and 2m + 1, so the dot
// product runs over that permutation of the chunk's K order (the input fragment follows it).
__device__ __forceinline__ void pair_frag(int m, const u32 (&wq)[4], u32 lutx, u32 (&af)[4]) {
    const u32 wa = wq[m >> 1], wb = wq[2 + (m >> 1)];
    if (m & 1) {
        af[0] = pair_lut<2>(wa, lutx);
        af[1] = pair_lut<2>(wb, lutx);
        af[2] = pair_lut<3>(wa, lutx);
        af[3] = pair_lut<3>(wb, lutx);
    } else {
        af[0] = pair_lut<0>(wa, lutx);
        af[1] = pair_lut<0>(wb, lutx);
        af[2] = pair_lut<1>(wa, lutx);
        af[3] = pair_lut<1>(wb, lutx);
    }
}

// -- exact arithmetic of the formats ---------------------------------------------------------------
// Correctly rounded 1/x (the formats' reciprocal; never the approximate rcp of fast math).
__device__ __forceinline__ float recip_rn(float x) { return __frcp_rn(x); }

// absmax of a block as the formats define it: NaN-ignoring max of |x| (fmaxf returns the other
// operand when one is NaN), starting from NaN so that an all-NaN block stays NaN.
__device__ __forceinline__ float nan_value() { return __uint_as_float(0x7fffffffu); }
// NaN test on the bits (a float self-comparison is what an optimizer may fold away)
__device__ __forceinline__ bool is_nan(float x) { return (__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u; }
__device__ __forceinline__ float pos_inf() { return __uint_as_float(0x7f800000u); }

// -- asynchronous copies (sm_80+) --------------------------------------------------------------------
// the shared-window address of a pointer into shared memory
__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// mbarriers (sm_90), by shared-memory address: init with an arrival count, one arrival (with the bytes a
// stage's asynchronous copies will complete), a wait for the phase of a parity to complete
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}
// clusters (sm_90): a barrier of the cluster's CTAs (release / acquire: shared-memory writes before it are
// seen after it), and loads from CTA `rank`'s shared memory at the address `addr` has in this CTA's window
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ u32 cluster_addr(u32 addr, u32 rank) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    return remote;
}
__device__ __forceinline__ float ld_cluster_f32(u32 addr, u32 rank) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(cluster_addr(addr, rank)) : "memory");
    return v;
}
__device__ __forceinline__ void ld_cluster_v4(u32 addr, u32 rank, float (&v)[4]) {
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3])
                 : "r"(cluster_addr(addr, rank)) : "memory");
}
#endif

// A kernel whose launcher sizes its dynamic shared memory states the bytes its own layout needs: a
// launch given fewer stops the kernel (a launcher bug; the launch reports an illegal instruction)
// instead of letting it write past the allocation.
__device__ __forceinline__ void require_dynamic_smem(u32 bytes) {
    u32 dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (dyn < bytes) __trap();
}
// 16 bytes global -> shared (dst a shared address), L2 only; with src_size, the bytes past it are
// zero-filled (0: nothing is read)
__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, u32 src_size) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_size) : "memory");
}
// 4 bytes global -> shared, through L1 (src and dst 4-byte aligned)
__device__ __forceinline__ void cp_async4(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}
// 16 bytes from shared memory (a shared-window address)
__device__ __forceinline__ void lds_v4(u32 addr, u32& a, u32& b, u32& c, u32& d) {
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "r"(addr));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// until at most N of this thread's committed groups are pending
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// -- programmatic dependent launch (sm_90; runtime.launch_pdl) ---------------------------------------
// A kernel launched as a programmatic dependent waits here before it reads any argument array (the
// previous kernel in the stream may still be writing them), and lets its own dependents start once
// its main work is issued. No-ops below sm_90 (never launched that way there).
__device__ __forceinline__ void grid_dep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dep_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// -- tensor cores ------------------------------------------------------------------------------------
// D += A (16 x 16, row) x B (16 x 8, col), fp16 or bf16 operands, fp32 accumulators d[0..3]
// (sm_80+). One asm text, the operand type spliced in.
template <typename T>
__device__ __forceinline__ void mma_16816(float* d, const u32 (&a)[4], u32 b0, u32 b1);
#define QC_MMA_16816(T, TY)                                                                              \
    template <>                                                                                          \
    __device__ __forceinline__ void mma_16816<T>(float* d, const u32 (&a)[4], u32 b0, u32 b1) {          \
        asm("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "    \
            "{%8,%9}, {%0,%1,%2,%3};"                                                                    \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                             \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                             \
    }
QC_MMA_16816(F16, "f16")
QC_MMA_16816(BF16, "bf16")
#undef QC_MMA_16816

}  // namespace qc
