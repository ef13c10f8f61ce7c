// gemv_4bit for decode (1..16 input rows, fp16 / bf16) on sm_90, reading the bitsandbytes layout
// directly, one or several weights that share the input in one launch (the grouped gemv).
// Semantics: quantcore/formats/bnb.py (gemv_4bit); numerics: T(code) is the only rounding before
// the fp32 products (mma.sync m16n8k16, fp32 accumulators), each 64-element chunk's mma result is
// multiplied by its block's absmax in fp32 and added to the row's fp32 sum.
// The same kernel runs linear_mx for MX FP4 weights (QT QC_GV_QT_MXFP4 / QC_GV_QT_NVFP4 with fp16 /
// bf16 input; backends/cuda/mx.py picks it): semantics quantcore/formats/mx.py (linear_mx), tolerance
// tier. There a lane's 16 elements of a chunk lie in one scale block (NVFP4: block c of the chunk's
// four, MXFP4: block c / 2 of two), so the lane multiplies its decoded pairs by the block scale in the
// input's type before the mma (E2M1 x E4M3 is exact in fp16 and bf16, E2M1 x 2^(e - 127) in bf16: each
// weight is exactly the reference's fp32 value, or overflows to inf where that does), the mma adds the
// products into the row's fp32 sums, and NVFP4 divides the sum by the global scale once at the end (as
// mx_gemv.cu's kernels do). MXFP4 with fp16 input (kSplit) runs each block's lanes through their own
// mma and scales the two fp32 results instead. The scale slots in the ring's row
// padding hold a chunk's raw scale bytes (4 NVFP4, 2 MXFP4) for rows g and g + 8.
#include "qc_common.cuh"
#include "mx_common.cuh"  // linear_mx: the scale layouts, E8M0 / E4M3 values, pair products

namespace qc {

// Design (docs/performance.md, GV-30): a warp owns 16 rows (a tile) and a contiguous range of
// 64-element chunks of K. Its ring of S shared-memory slots (16 rows x CH chunks)
// is filled by 16-byte cp.async copies (each copy instruction: 4 rows x 128 contiguous bytes), so
// many bytes stay in flight without registers. For a chunk, lane (g, c) (g = lane / 4, c = lane %
// 4) reads 8 bytes of rows g and g + 8 at byte 8 c of the chunk's 32 (the codes of elements 16 c ..
// 16 c + 15). The dot product may take K in any order, so mma step m (0..3) of the chunk uses, as
// its k slots 2c, 2c+1 and 2c+8, 2c+9, the lane's bytes 2m and 2m+1 (elements 16 c + 4 m .. + 3);
// the activation fragment of lane (g, c) is then the 4 consecutive inputs 16 c + 4 m .. + 3 of
// input row g: two 16-byte loads per chunk give all four steps. Every element of a chunk lies in
// one block (blocksize >= 64, K % 64 == 0): lane (g, c) loads the scale data of chunks c and c + 4
// of its two rows a stage ahead, decodes them and leaves them in the slot's row padding, where
// the quad reads each chunk's pair with one load (GV-36).
//
// Work: the tiles of all groups form one list; CTA b takes tiles [T b / G, T (b + 1) / G) and its
// 16 warps split that range's (tile, chunk) list evenly, so any shape keeps every warp busy. A
// tile that one warp covers whole is written by that warp; the pieces of a tile shared by warps
// are added through shared memory in warp order after one barrier (deterministic, no workspace).
//
// Decode: the 64 KiB table holds T(hi nibble), T(lo nibble) for each byte, one copy per lane
// (conflict-free); its shared address is a multiple of 64 KiB so one byte_perm forms the entry's
// address (table + byte * 256 + lane * 4). The entries take bytes 0 .. 127 of each 256-byte table
// row; when a CTA's input rows fit in the other halves (32 KiB, XS), they are copied there once and
// read from shared memory (no input loads through the small L1 that the shared carve-out leaves).
// Before the programmatic-dependent wait each warp prefetches its first stages into L2.
// The geometry comes from the generated header (quantcore.formats.kernel_defines.LAUNCH_GEOMETRY),
// which the launcher reads too.
constexpr int kGtWarps = QC_GV_WARPS;
constexpr int kGtGroups = QC_GV_GROUPS;  // weights per launch at most
// A warp's ring: S slots of 16 rows x CH chunks; two geometries (QC_GV_CHUNKS x QC_GV_STAGES, and
// the short one for warps with little work); the launcher sizes shared memory for the larger ring
constexpr int kGtRingMax = QC_GV_RING;
template <int CH, int S>
struct GtRing {
    static_assert((CH == QC_GV_CHUNKS && S == QC_GV_STAGES) || (CH == QC_GV_CHUNKS_SHORT && S == QC_GV_STAGES_SHORT),
                  "one of the generated ring geometries");
    static constexpr int kPitch = 32 * CH + 32;  // bytes per row in a slot: 32 per chunk + 32 (rows g = 0..3 on distinct banks)
    static constexpr int kSc = CH / 4;           // chunks whose scales one lane decodes per stage
    static_assert(2 * CH <= 16, "a stage's scales fit in its slot's row padding");
    static constexpr int kSlot = 16 * kPitch;
    static constexpr int kBytes = S * kSlot;
    static_assert(kBytes <= kGtRingMax, "the ring the launcher sizes");
};
// XS: the input rows of a CTA's block, when they fit, live in the decode table's free halves
// (bytes 128 .. 255 of each of its 256 rows: the lanes' entries take bytes 0 .. 127)
constexpr int kGtXs = QC_GV_XS_BYTES;
static_assert(kGtXs == 256 * 128, "the table's free halves");

template <int NB, int RING>
struct GtGeo {
    static constexpr int kPart = NB * 128;  // floats of one warp's partial tile
    // code2 tables, the partial tiles' ids and links (the partial tiles themselves go in the warp's ring)
    static constexpr int kSmall = 4 * kGtGroups * kDynCodes + 8 * kGtWarps * 2 + 4 * kGtWarps * 2;
    static_assert(2 * kPart * 4 <= RING, "a warp's partial tiles fit in its ring");
};

__device__ __forceinline__ void gt_lds_v2(u32 addr, u32& a, u32& b) {
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(a), "=r"(b) : "r"(addr));
}

__device__ __forceinline__ void gt_sts_f2(u32 addr, float a, float b) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(a), "f"(b) : "memory");
}
__device__ __forceinline__ void gt_lds_f2(u32 addr, float& a, float& b) {
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(a), "=f"(b) : "r"(addr));
}

// -- MX weights (linear_mx) -------------------------------------------------------------------------
// (a row's scale bytes in either layout: mx_common.cuh scale_row_offset / scale_col_offset; chunk u's
// scales are columns 4u .. 4u + 3 (NVFP4: one tile column when swizzled) or 2u, 2u + 1 (MXFP4: half of
// one), adjacent in both layouts)
static_assert(QC_SWIZZLE_COLS == 4, "a chunk's scales: whole or half a tile column");
// The scale of lane c's block for rows g (ra: the chunk's raw scale bytes of that row) and g + 8 (rb),
// each as a pair of the input type (pg: row g's twice, pg8: row g + 8's), exact: NVFP4's E4M3 by the
// hardware conversion to fp16 (exact), for bf16 through fp32 (exact: 4 significant bits); MXFP4's
// E8M0 as bf16 (bf16 input only): the upper half of its fp32 value (e 0: the subnormal 2^-127; 255: NaN)
template <typename T, bool NV>
__device__ __forceinline__ void gv_mx_scale_pairs(u32 ra, u32 rb, int c, u32& pg, u32& pg8) {
    if constexpr (NV) {
        const u32 t = __byte_perm(ra, rb, (u32)c | (u32)(c + 4) << 4);  // bits 0..15: row g's byte c, row g + 8's
        const u32 h2 = qcmx::e4m3x2_f16x2<0>(t);
        if constexpr (T::kBf16) {
            pg = __byte_perm(__float_as_uint(F16::lo(h2)), 0u, 0x3232u);
            pg8 = __byte_perm(__float_as_uint(F16::hi(h2)), 0u, 0x3232u);
        } else {
            pg = __byte_perm(h2, 0u, 0x1010u);
            pg8 = __byte_perm(h2, 0u, 0x3232u);
        }
    } else {
        const u32 sel = (u32)c >> 1;
        const u32 t = __byte_perm(ra, rb, sel | (sel + 4) << 4);
        pg = __byte_perm(__float_as_uint(qcmx::e8m0_value(t & 0xffu)), 0u, 0x3232u);
        pg8 = __byte_perm(__float_as_uint(qcmx::e8m0_value(t >> 8 & 0xffu)), 0u, 0x3232u);
    }
}
// a row's fp32 sum -> its result: NVFP4 divided by the global scale (when given), once
template <bool NV>
__device__ __forceinline__ float gv_mx_post(float v, const float* gscale) {
    return NV && gscale != nullptr ? __fdiv_rn(v, ldg_f32(gscale)) : v;
}

#define QC_GT_GROUP_PARAMS(i)                                                                          \
    const u8 *__restrict__ packed##i, const void *__restrict__ absmax##i, const float *__restrict__ absmax2_##i, \
        const float *__restrict__ code2_##i, const float *__restrict__ offset##i, i64 n##i

// One group's weight, selected per tile.
struct GtW {
    const u8* packed;
    const u8* absmax;  // u8 codes (nested) or fp32 values
    const float* absmax2;
    const float* offset;
    i64 n, tile0, col0;
    int gi;
};

template <typename T, int QT, bool NESTED, int NB, bool XS, int CH, int S>
__global__ void __launch_bounds__(kGtWarps * 32, 1) gemv_4bit_tc_kernel(
    const u16* __restrict__ a, QC_GT_GROUP_PARAMS(0), QC_GT_GROUP_PARAMS(1), QC_GT_GROUP_PARAMS(2),
    QC_GT_GROUP_PARAMS(3), u16* __restrict__ out, i64 ldo, int batch, i64 K, int log2bs, int ngroups, int scols) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // MX weights (one group): absmax0 the scale bytes, absmax2_0 NVFP4's global scale (or null), log2bs
    // the scale block's log2, scols the swizzled scales' padded column count (0: row-major scales)
    constexpr bool kMx = QT == QC_GV_QT_MXFP4 || QT == QC_GV_QT_NVFP4, kNv = QT == QC_GV_QT_NVFP4;
    static_assert(!(kMx && NESTED), "MX scales are not nested");
    // MXFP4 with fp16 input: 2^(e - 127) is outside fp16's range, so the chunk's two blocks go through
    // separate mma (each lane's pairs into the one of its block, zeros into the other), their fp32
    // results times the block scales in fp32 (mx_gemv.cu's tensor-core numerics)
    constexpr bool kSplit = QT == QC_GV_QT_MXFP4 && !T::kBf16;
    using R = GtRing<CH, S>;
    constexpr int kGtRing = R::kBytes, kGtPitch = R::kPitch, kGtSlot = R::kSlot, kGtSc = R::kSc;
    using G = GtGeo<NB, kGtRing>;
    extern __shared__ __align__(16) u8 gt_smem[];
    // the table on the first 64 KiB boundary; the small arrays and as many rings as fit before it,
    // the rest after it
    const u32 front = (0u - smem_addr(gt_smem)) & 0xffffu;
    u8* lut = gt_smem + front;
    const bool small_front = front >= (u32)G::kSmall;
    u8* small = small_front ? gt_smem : lut + 65536;
    u8* ring_front = small_front ? gt_smem + G::kSmall : gt_smem;
    const int nfront = min((int)((small_front ? front - G::kSmall : front) / kGtRing), kGtWarps);
    u8* ring_back = lut + 65536 + (small_front ? 0 : G::kSmall);
    require_dynamic_smem((u32)(ring_back + (kGtWarps - nfront) * kGtRing - gt_smem));
    float* c2s = reinterpret_cast<float*>(small);                            // [kGtGroups][kDynCodes]
    i64* ptile = reinterpret_cast<i64*>(c2s + kGtGroups * kDynCodes);      // [kGtWarps][2]

    const int warp = threadIdx.x >> 5, lane = lane_id(), g = lane >> 2, c = lane & 3;
    u8* wring_p = warp < nfront ? ring_front + warp * kGtRing : ring_back + (warp - nfront) * kGtRing;
    const u32 wring = smem_addr(wring_p);
    // the pair table: warp w fills bytes 16 w .. 16 w + 15, lane l the 16 bytes of lanes 4 (l & 7)
    // .. + 3 of byte 16 w + (l >> 3) + 4 i
    {
        u32* lw = reinterpret_cast<u32*>(lut);
        const int q4 = lane & 7;
        const float code = code_4bit_imm<QT>(lane & 15);  // one value per lane; the table by shuffles
        const float hi = __shfl_sync(kFullMask, code, warp);  // byte 16 w + ...: high nibble w
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int lo = (lane >> 3) + 4 * i;
            const float vlo = __shfl_sync(kFullMask, code, lo);
            // bitsandbytes: the high nibble is the first element; MX: the low nibble
            const u32 v = kMx ? T::pack2(vlo, hi) : T::pack2(hi, vlo);
            *reinterpret_cast<uint4*>(lw + (16 * warp + lo) * 64 + 4 * q4) = make_uint4(v, v, v, v);
        }
    }
    // the tile list: group i owns tiles [tb(i), tb(i + 1)) (read from the parameters where used, so
    // nothing of it stays in registers through the main loop)
    auto nt = [&](int i) -> i64 {
        const i64 n = i == 0 ? n0 : i == 1 ? n1 : i == 2 ? n2 : n3;
        return i < ngroups ? (n + 15) >> 4 : 0;
    };
    const i64 ntiles = nt(0) + nt(1) + nt(2) + nt(3);
    const i64 t0 = ntiles * blockIdx.x / gridDim.x, t1 = ntiles * (blockIdx.x + 1) / gridDim.x;
    const i64 C = K >> 6;  // chunks per row
    const i64 W = (t1 - t0) * C;
    const i64 w0 = W * warp / kGtWarps, w1 = W * (warp + 1) / kGtWarps;
    if (lane < 2) ptile[2 * warp + lane] = -1;
    __syncwarp();

    auto weight_of = [&](i64 tile) {
        GtW w;
        const i64 e1 = nt(0), e2 = e1 + nt(1), e3 = e2 + nt(2);
        const int i = (tile >= e1) + (tile >= e2) + (tile >= e3);
        w.gi = i;
        w.packed = i == 0 ? packed0 : i == 1 ? packed1 : i == 2 ? packed2 : packed3;
        w.absmax = reinterpret_cast<const u8*>(i == 0 ? absmax0 : i == 1 ? absmax1 : i == 2 ? absmax2 : absmax3);
        w.absmax2 = i == 0 ? absmax2_0 : i == 1 ? absmax2_1 : i == 2 ? absmax2_2 : absmax2_3;
        w.offset = i == 0 ? offset0 : i == 1 ? offset1 : i == 2 ? offset2 : offset3;
        w.n = i == 0 ? n0 : i == 1 ? n1 : i == 2 ? n2 : n3;
        w.tile0 = i == 0 ? 0 : i == 1 ? e1 : i == 2 ? e2 : e3;
        w.col0 = (i > 0 ? n0 : 0) + (i > 1 ? n1 : 0) + (i > 2 ? n2 : 0);
        return w;
    };

    const i64 row_bytes = K >> 1;
    // L2 prefetch of the warp's first stages of weight bytes: a prefetch brings nothing into the
    // kernel, and L2 is where a previous kernel's writes land, so it may precede the wait below
    if (w1 > w0) {
        const i64 tile = t0 + w0 / C, j = w0 % C;
        const GtW wt = weight_of(tile);
        const i64 r = (tile - wt.tile0) * 16 + (lane >> 1);
        const i64 nb = 32 * min(min((i64)(S * CH), C - j), w1 - w0);
        const u8* base = wt.packed + r * row_bytes + 32 * j;
#pragma unroll
        for (int m = 0; m < 2 * S * CH / 8; m += 2) {
            const i64 off = 128 * (m + (lane & 1));
            if (r < wt.n && off < nb) asm volatile("prefetch.global.L2 [%0];" ::"l"(base + off));
        }
    }
    // Launched as a programmatic dependent (PDL), the kernel may start while the previous one in the
    // stream drains: everything above reads only this kernel's own constants; every argument array
    // (the input, the weights and their statistics, which a previous kernel may have just written)
    // is read below this wait. After it, one round trip: the code2 copies, the block's input rows
    // (XS) and the ring's first stages go out as cp.async and the first stage's scale data as
    // loads, all before one wait and one barrier.
    grid_dep_wait();
    // The next kernel may launch now: its CTAs take each multiprocessor as this kernel's CTA there
    // leaves (the shared memory holds one), so their set-up overlaps this kernel's tail; they read
    // this kernel's output only after their own wait, which waits for the whole grid.
    grid_dep_launch();
    if (NESTED) {
        for (int i = threadIdx.x; i < ngroups * kDynCodes; i += blockDim.x) {
            const int q = i / kDynCodes;
            const float* c2p = q == 0 ? code2_0 : q == 1 ? code2_1 : q == 2 ? code2_2 : code2_3;
            cp_async4(smem_addr(c2s + i), c2p + i % kDynCodes);
        }
    }
    const u32 lutx = smem_addr(lut) | (4u * (u32)lane);

    const int bsh = kMx ? 0 : log2bs - 6;  // chunks per block, log2 (bitsandbytes)
    const int Ci = (int)C;
    // input rows of this lane's B fragment columns (clamped: a lane past the batch reads the last
    // row, its columns are never written)
    // grid.y takes the input rows in blocks of 8 NB (one launch for any row count; each block
    // reads the weights once)
    a += (i64)blockIdx.y * (8 * NB) * K;
    out += (i64)blockIdx.y * (8 * NB) * ldo;
    batch = min(batch - (int)blockIdx.y * (8 * NB), 8 * NB);
    int arow[NB];  // element offsets into a (32-bit: 16 rows of K < 2^26 elements; registers are tight)
#pragma unroll
    for (int h = 0; h < NB; ++h) arow[h] = min(8 * h + g, batch - 1) * (int)K + 16 * c;
    // XS: the block's input rows to the table's free halves, element e of row b at table row
    // b C + e / 64, byte 128 + 2 (e % 64) (one 64-element chunk per row; the launcher checks the fit)
    const u32 xbase = smem_addr(lut) + 128;
    if constexpr (XS) {
        if ((i64)batch * K * 2 > kGtXs) __trap();  // launcher bug
        const int rowp = (int)(K >> 3);  // 16-byte pieces of a row
        for (int p = threadIdx.x; p < batch * rowp; p += blockDim.x) {
            const int b = p / rowp, e = (p - b * rowp) * 8;
            cp_async16(xbase + (u32)(b * Ci + (e >> 6)) * 256 + 2 * (e & 63), a + ((i64)b * K + e));
        }
    }
    cp_async_commit();  // the oldest group (code2, XS): the stages' waits below cover it

    // A stage: chunks [j, j + nch) of one tile (never crossing a tile). Producer and consumer walk
    // the warp's range with the same steps; 32-bit counts (the launcher keeps N K / 64 < 2^31).
    struct Cursor {
        int tile, j, nch, left;  // left: chunks of the range from this stage on
    };
    auto stage_len = [&](int j, int left) { return min(CH, min(Ci - j, left)); };
    const int r0w = (int)(w0 / C);
    Cursor pq{(int)t0 + r0w, (int)(w0 - (i64)r0w * C), 0, (int)(w1 - w0)};
    pq.nch = stage_len(pq.j, pq.left);
    Cursor cq = pq;
    auto advance = [&](Cursor& q) {  // true when the next stage starts a new tile
        q.left -= q.nch;
        q.j += q.nch;
        const bool nt = q.j == Ci;
        if (nt) {
            q.j = 0;
            ++q.tile;
        }
        q.nch = stage_len(q.j, q.left);
        return nt;
    };

    // producer: lane l copies rows l / 8 + 4 h (h < 4) of the tile, bytes 128 i + 16 (l % 8) of the
    // stage's 32 CH (a copy instruction: 4 rows x 128 contiguous bytes; each quarter warp writes
    // one row's 128 bytes, on distinct banks), from a row pointer that advances with the stage; rows
    // past N and chunks past the row are zero-filled (the slow path)
    static_assert(CH % 4 == 0, "whole 128-byte pieces of a row per stage");
    constexpr int kPieces = CH / 4;  // 128-byte pieces of a row in a stage
    const int pr = lane >> 3, pc = lane & 7;
    const u8* psrc = nullptr;
    const i64 prow4 = 4 * row_bytes;  // bytes from row pr to row pr + 4
    bool pfull = false;               // all 16 rows of the tile exist (warp-uniform)
    u32 pok = 0;                      // bit h: row pr + 4 h exists
    auto producer_tile = [&](int tile) {
        const GtW wt = weight_of(tile);
        const i64 r = (tile - wt.tile0) * 16;
        const i64 rows = min((i64)16, wt.n - r);
        pfull = rows == 16;
        pok = 0;
#pragma unroll
        for (int h = 0; h < 4; ++h) pok |= pr + 4 * h < rows ? 1u << h : 0u;
        psrc = wt.packed + (r + min((i64)pr, rows - 1)) * row_bytes + 16 * pc;
    };
    const u32 pdst = wring + pr * kGtPitch + 16 * pc;
    auto issue = [&](const Cursor& q, int s) {
        if (q.left > 0) {
            const u8* src = psrc + 32 * q.j;
            const u32 dst = pdst + s * kGtSlot;
            if (q.nch == CH && pfull) {
#pragma unroll
                for (int h = 0; h < 4; ++h)
#pragma unroll
                    for (int i = 0; i < kPieces; ++i)
                        cp_async16(dst + 4 * h * kGtPitch + 128 * i, src + h * prow4 + 128 * i);
            } else {
#pragma unroll
                for (int h = 0; h < 4; ++h)
#pragma unroll
                    for (int i = 0; i < kPieces; ++i) {
                        const bool ok = 4 * i + (pc >> 1) < q.nch && (pok >> h & 1u);
                        cp_async16(dst + 4 * h * kGtPitch + 128 * i, ok ? src + h * prow4 + 128 * i : psrc,
                                   ok ? 16u : 0u);
                    }
            }
        }
        cp_async_commit();  // one group per stage (empty past the end): wait_group counts stages
    };

    if (pq.left > 0) producer_tile(pq.tile);
    for (int s = 0; s < S; ++s) {
        issue(pq, s);
        if (pq.left > 0 && advance(pq) && pq.left > 0) producer_tile(pq.tile);
    }

    // consumer's tile: its weight, rows and the blocks of its two rows
    const u8* cabs = nullptr;  // the consumer's tile: its weight's absmax and absmax2
    const float* cabs2 = nullptr;
    u32 ea = 0, eb = 0;  // first chunk of rows g and g + 8, counted over the matrix (MX: their scale rows' offsets)
    float off = 0.0f;
    const float* c2 = c2s;
    auto consumer_tile = [&](int tile) {
        const GtW ct = weight_of(tile);
        const i64 r = (tile - ct.tile0) * 16 + g;
        if constexpr (kMx) {
            ea = qcmx::scale_row_offset((u32)min(r, ct.n - 1), (u32)(K >> log2bs), (u32)scols, scols != 0);
            eb = qcmx::scale_row_offset((u32)min(r + 8, ct.n - 1), (u32)(K >> log2bs), (u32)scols, scols != 0);
        } else {
            ea = (u32)(min(r, ct.n - 1) * C);
            eb = (u32)(min(r + 8, ct.n - 1) * C);
        }
        off = NESTED ? ldg_f32(ct.offset) : 0.0f;
        c2 = c2s + ct.gi * kDynCodes;
        cabs = ct.absmax;
        cabs2 = ct.absmax2;
    };
    // raw scale data of a stage: lane (g, c) loads those of chunks c + 4 i (i < kGtSc) of rows g
    // and g + 8; a chunk's scales reach the quad's other lanes by shuffles
    u32 sq[kGtSc][2];
    float s2[NESTED ? kGtSc : 1][2];
    auto load_scales = [&](const Cursor& q) {
        if (q.left <= 0) return;
#pragma unroll
        for (int i = 0; i < kGtSc; ++i) {
            const u32 uu = (u32)(q.j + min(c + 4 * i, q.nch - 1));
            if constexpr (kMx) {  // the chunk's raw scale bytes (adjacent in both layouts)
                const u32 co = qcmx::scale_col_offset(kNv ? 4 * uu : 2 * uu, scols != 0);
                sq[i][0] = kNv ? ldg_u32(cabs + ea + co) : ldg_u16(cabs + ea + co);
                sq[i][1] = kNv ? ldg_u32(cabs + eb + co) : ldg_u16(cabs + eb + co);
            } else if constexpr (NESTED) {
                const u32 ba = (ea + uu) >> bsh, bb = (eb + uu) >> bsh;
                sq[i][0] = ldg_u8(cabs + ba);
                sq[i][1] = ldg_u8(cabs + bb);
                s2[i][0] = ldg_f32(cabs2 + (ba >> kNestLog2));
                s2[i][1] = ldg_f32(cabs2 + (bb >> kNestLog2));
            } else {
                const u32 ba = (ea + uu) >> bsh, bb = (eb + uu) >> bsh;
                sq[i][0] = ldg_u32(reinterpret_cast<const float*>(cabs) + ba);
                sq[i][1] = ldg_u32(reinterpret_cast<const float*>(cabs) + bb);
            }
        }
    };
    if (cq.left > 0) {
        consumer_tile(cq.tile);
        load_scales(cq);
    }
    cp_async_wait<S>();  // this thread's code2 and input copies (its stage groups may be in flight)
    __syncthreads();     // everyone's, and the table

    float acc[NB][4];
#pragma unroll
    for (int h = 0; h < NB; ++h) acc[h][0] = acc[h][1] = acc[h][2] = acc[h][3] = 0.0f;
    float keep[NB][4];
    bool have_keep = false;
    int last_slot = -1, nseg = 0;
    int s = 0;
    int seg_j0 = cq.j;  // first chunk of the current segment
    while (cq.left > 0) {
        float sc[kGtSc][2];  // this lane's chunks' scales (c + 4 i), rows g and g + 8
#pragma unroll
        for (int i = 0; i < kGtSc; ++i)
#pragma unroll
            for (int r = 0; r < 2; ++r)
                sc[i][r] = NESTED ? nested_absmax(c2[sq[i][r]], s2[i][r], off) : __uint_as_float(sq[i][r]);  // MX: raw
        const int tile = cq.tile, j = cq.j, nch = cq.nch;
        const bool new_tile = advance(cq);  // cq is the next stage now
        if (new_tile && cq.left > 0) consumer_tile(cq.tile);
        load_scales(cq);

        // the scales go to the slot's row padding (bytes 32 CH .. 32 CH + 31 of each row, which the copies
        // never write): chunk u's pair (row g, row g + 8) at row 2 u + g / 4, byte 32 CH + 8 (g % 4), so a
        // chunk's eight pairs lie on distinct banks and a quad reads its pair by one broadcast load
        const u32 sbuf = wring + s * kGtSlot + (g >> 2) * kGtPitch + 32 * CH + 8 * (g & 3);
#pragma unroll
        for (int i = 0; i < kGtSc; ++i) gt_sts_f2(sbuf + (c + 4 * i) * 2 * kGtPitch, sc[i][0], sc[i][1]);
        // this lane's inputs at the current chunk (advanced by the chunk loops): in device memory,
        // or (XS) in the table's free halves, one table row per chunk
        const u16* xp[NB];
        u32 xq[NB];
#pragma unroll
        for (int h = 0; h < NB; ++h) {
            if constexpr (XS)
                xq[h] = xbase + (u32)((arow[h] >> 6) + j) * 256 + 32 * c;
            else
                xp[h] = a + (arow[h] + j * 64);
        }

        cp_async_wait<S - 1>();
        __syncwarp();
        const u32 slot = wring + s * kGtSlot + 8 * c;
        // one chunk: weights from the slot, inputs, decode, mma, the scaled accumulation
        auto run_chunk = [&](const int u, const int q) {  // q: u's offset from xp (a constant)
            u32 wq[4];
            gt_lds_v2(slot + g * kGtPitch + 32 * u, wq[0], wq[1]);
            gt_lds_v2(slot + (g + 8) * kGtPitch + 32 * u, wq[2], wq[3]);
            u32 x[NB][8];
#pragma unroll
            for (int h = 0; h < NB; ++h) {
                if constexpr (XS) {
                    lds_v4(xq[h] + 256 * q, x[h][0], x[h][1], x[h][2], x[h][3]);
                    lds_v4(xq[h] + 256 * q + 16, x[h][4], x[h][5], x[h][6], x[h][7]);
                } else {
                    ldg_v4(xp[h] + 64 * q, x[h][0], x[h][1], x[h][2], x[h][3]);
                    ldg_v4(xp[h] + 64 * q + 8, x[h][4], x[h][5], x[h][6], x[h][7]);
                }
            }
            if constexpr (kSplit) {  // block 0 (lanes c < 2) and block 1 (c >= 2): one mma each, fp32 scales
                u32 ra, rb;
                gt_lds_v2(sbuf + u * 2 * kGtPitch, ra, rb);
                float d0[NB][4], d1[NB][4];
#pragma unroll
                for (int h = 0; h < NB; ++h)
#pragma unroll
                    for (int r = 0; r < 4; ++r) d0[h][r] = d1[h][r] = 0.0f;
                const bool first = c < 2;
#pragma unroll
                for (int m = 0; m < 4; ++m) {
                    u32 af[4], a0[4], a1[4];
                    pair_frag(m, wq, lutx, af);
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        a0[r] = first ? af[r] : 0u;
                        a1[r] = first ? 0u : af[r];
                    }
#pragma unroll
                    for (int h = 0; h < NB; ++h) {
                        mma_16816<T>(d0[h], a0, x[h][2 * m], x[h][2 * m + 1]);
                        mma_16816<T>(d1[h], a1, x[h][2 * m], x[h][2 * m + 1]);
                    }
                }
                const float s0a = qcmx::e8m0_value(ra & 0xffu), s1a = qcmx::e8m0_value(ra >> 8 & 0xffu);
                const float s0b = qcmx::e8m0_value(rb & 0xffu), s1b = qcmx::e8m0_value(rb >> 8 & 0xffu);
#pragma unroll
                for (int h = 0; h < NB; ++h) {
                    fma_rows(acc[h], d0[h], s0a, s0b);
                    fma_rows(acc[h], d1[h], s1a, s1b);
                }
            } else if constexpr (kMx) {  // the lane's block scales (rows g, g + 8) times its pairs, the mma into acc
                u32 ra, rb, pg, pg8;
                gt_lds_v2(sbuf + u * 2 * kGtPitch, ra, rb);
                gv_mx_scale_pairs<T, kNv>(ra, rb, c, pg, pg8);
#pragma unroll
                for (int m = 0; m < 4; ++m) {
                    u32 af[4];
                    pair_frag(m, wq, lutx, af);
                    af[0] = qcmx::hmul2<T::kBf16>(af[0], pg);
                    af[1] = qcmx::hmul2<T::kBf16>(af[1], pg8);
                    af[2] = qcmx::hmul2<T::kBf16>(af[2], pg);
                    af[3] = qcmx::hmul2<T::kBf16>(af[3], pg8);
#pragma unroll
                    for (int h = 0; h < NB; ++h) mma_16816<T>(acc[h], af, x[h][2 * m], x[h][2 * m + 1]);
                }
            } else {
                float d[NB][4];
#pragma unroll
                for (int h = 0; h < NB; ++h) d[h][0] = d[h][1] = d[h][2] = d[h][3] = 0.0f;
#pragma unroll
                for (int m = 0; m < 4; ++m) {
                    u32 af[4];
                    pair_frag(m, wq, lutx, af);
#pragma unroll
                    for (int h = 0; h < NB; ++h) mma_16816<T>(d[h], af, x[h][2 * m], x[h][2 * m + 1]);
                }
                float sa, sb;
                gt_lds_f2(sbuf + u * 2 * kGtPitch, sa, sb);
#pragma unroll
                for (int h = 0; h < NB; ++h) fma_rows(acc[h], d[h], sa, sb);
            }
        };
        if (nch == CH) {  // a whole stage: chunks in pairs (one input row block) with no branch between
                          // them, so they interleave; two row blocks keep one chunk (registers)
            constexpr int P = NB == 1 ? 2 : 1;
#pragma unroll 1
            for (int u = 0; u < CH; u += P) {
#pragma unroll
                for (int q = 0; q < P; ++q) run_chunk(u + q, q);
#pragma unroll
                for (int h = 0; h < NB; ++h) {
                    if constexpr (XS)
                        xq[h] += 256 * P;
                    else
                        xp[h] += 64 * P;
                }
            }
        } else {
#pragma unroll 1
            for (int u = 0; u < nch; ++u) {
                run_chunk(u, 0);
#pragma unroll
                for (int h = 0; h < NB; ++h) {
                    if constexpr (XS)
                        xq[h] += 256;
                    else
                        xp[h] += 64;
                }
            }
        }
        __syncwarp();  // every lane has read the slot: refill it
        issue(pq, s);
        if (pq.left > 0 && advance(pq) && pq.left > 0) producer_tile(pq.tile);
        s = s + 1 == S ? 0 : s + 1;

        if (cq.left <= 0 || new_tile) {  // the segment ends: its result
            const bool whole = seg_j0 == 0 && j + nch == Ci;
            if (whole) {
                // C fragment (row g, col 2c), (g, 2c + 1), (g + 8, 2c), (g + 8, 2c + 1)
                const GtW wt = weight_of(tile);
                const i64 r0 = (tile - wt.tile0) * 16 + g;
#pragma unroll
                for (int h = 0; h < NB; ++h)
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const int col = 8 * h + 2 * c + (r & 1);
                        const i64 row = r0 + 8 * (r >> 1);
                        if (col < batch && row < wt.n) out[col * ldo + wt.col0 + row] = T::from_f(gv_mx_post<kNv>(acc[h][r], wt.absmax2));
                    }
            } else {  // the range's first piece (kept for the end) or its last (stays in acc)
                end_tile_piece<NB>(cq.left > 0, nseg, tile, ptile, warp, lane, acc, keep, have_keep, last_slot);
            }
            next_tile_segment<NB>(cq.left > 0, nseg, acc);
            seg_j0 = 0;
        }
    }
    // the pieces go to the warp's ring, drained now
    cp_async_wait<0>();
    __syncwarp();
    stash_tile_pieces<NB>(reinterpret_cast<float*>(wring_p), G::kPart, have_keep, last_slot, keep, acc);
    __syncthreads();
    // tiles shared by warps: the pieces added in warp order
    int* link = reinterpret_cast<int*>(ptile + 2 * kGtWarps);  // [2 kGtWarps]
    link_tile_pieces(ptile, link, 2 * kGtWarps);
    __syncthreads();
    auto part_of = [&](int k, int e) {
        const int w = k >> 1;
        const u8* ring = w < nfront ? ring_front + w * kGtRing : ring_back + (w - nfront) * kGtRing;
        return reinterpret_cast<const float*>(ring)[(k & 1) * G::kPart + e];
    };
    for (int idx = threadIdx.x; idx < 2 * kGtWarps * G::kPart; idx += blockDim.x) {
        const int ws = idx / G::kPart, e = idx % G::kPart;
        const int l = link[ws];
        if (l < 0 || !(l & 0x100)) continue;  // not the first piece of a tile
        const float sum = sum_tile_pieces(link, ws, l, e, part_of);
        const i64 tile = ptile[ws];
        const GtW wt = weight_of(tile);
        const int h = e >> 7, ln = (e >> 2) & 31, r = e & 3;
        const int col = 8 * h + 2 * (ln & 3) + (r & 1);
        const i64 row = (tile - wt.tile0) * 16 + (ln >> 2) + 8 * (r >> 1);
        if (col < batch && row < wt.n) out[col * ldo + wt.col0 + row] = T::from_f(gv_mx_post<kNv>(sum, wt.absmax2));
    }
#endif
}
#undef QC_GT_GROUP_PARAMS

}  // namespace qc
