// gemv_4bit for decode (1..16 input rows, fp16 / bf16) on sm_90, reading the bitsandbytes layout
// directly, one or several weights that share the input in one launch (the grouped gemv).
// Semantics: quantcore/formats/bnb.py (gemv_4bit); numerics: T(code) is the only rounding before
// the fp32 products (mma.sync m16n8k16, fp32 accumulators), each 64-element chunk's mma result is
// multiplied by its block's absmax in fp32 and added to the row's fp32 sum.
#include "qc_common.cuh"

namespace qc {

// Design (docs/performance.md, GV-30): a warp owns 16 rows (a tile) and a contiguous range of
// 64-element chunks of K. For a chunk, lane (g, c) (g = lane / 4, c = lane % 4) loads 8 bytes of
// rows g and g + 8 at byte 8 c of the chunk's 32 bytes (the codes of elements 16 c .. 16 c + 15):
// a warp's load is 8 rows x 32 contiguous bytes, whole sectors, no shared-memory staging. The dot
// product may take K in any order, so mma step m (0..3) of the chunk uses, as its k slots 2c, 2c+1
// and 2c+8, 2c+9, the lane's bytes 2m and 2m+1 (elements 16 c + 4 m .. + 3); the activation
// fragment of lane (g, c) is then the 4 consecutive inputs 16 c + 4 m .. + 3 of input row g: two
// 16-byte loads per chunk give all four steps. Every element of a chunk lies in one block
// (blocksize >= 64, K % 64 == 0), and each lane reads the absmax of its own two rows: no shuffles.
//
// Work: the tiles of all groups form one list; CTA b takes tiles [T b / G, T (b + 1) / G) and its
// 16 warps split that range's (tile, chunk) list evenly, so any shape keeps every warp busy. A
// tile that one warp covers whole is written by that warp; the pieces of a tile shared by warps
// are added through shared memory in warp order after one barrier (deterministic, no workspace).
//
// Decode: the 64 KiB table holds T(hi nibble), T(lo nibble) for each byte, one copy per lane
// (conflict-free); its shared address is a multiple of 64 KiB so one byte_perm forms the entry's
// address (table + byte * 256 + lane * 4).
constexpr int kGtWarps = 16;
constexpr int kGtGroups = 4;   // weights per launch at most
constexpr int kGtAhead = 4;    // chunks loaded ahead (a batch)

template <int NB>
struct GtGeo {
    static constexpr int kPart = NB * 128;  // floats of one warp's partial tile
    // code2 tables, partial tiles (2 per warp), their tile ids
    static constexpr int kSmall = 4 * kGtGroups * kDynCodes + 4 * kGtWarps * 2 * kPart + 8 * kGtWarps * 2;
};

template <int J>
__device__ __forceinline__ u32 gt_pair(u32 w, u32 lutx) {
    u32 r;
    asm("ld.shared.b32 %0, [%1];" : "=r"(r) : "r"(__byte_perm(w, lutx, 0x7604u | (J << 4))));
    return r;
}

__device__ __forceinline__ void gt_ldg_v2(const void* p, u32& a, u32& b) {
    asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(a), "=r"(b) : "l"(p));
}

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

template <typename T, int QT, bool NESTED, int NB>
__global__ void __launch_bounds__(kGtWarps * 32, 1) gemv_4bit_tc_kernel(
    const u16* __restrict__ a, QC_GT_GROUP_PARAMS(0), QC_GT_GROUP_PARAMS(1), QC_GT_GROUP_PARAMS(2),
    QC_GT_GROUP_PARAMS(3), u16* __restrict__ out, i64 ldo, int batch, i64 K, int log2bs, int ngroups) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    using G = GtGeo<NB>;
    extern __shared__ __align__(16) u8 gt_smem[];
    const u32 front = (0u - smem_addr(gt_smem)) & 0xffffu;
    u8* lut = gt_smem + front;
    u8* small = front >= (u32)G::kSmall ? gt_smem : lut + 65536;
    {
        u32 dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if ((u32)(small + G::kSmall - gt_smem) > dyn || (u32)(lut + 65536 - gt_smem) > dyn) __trap();  // launcher bug
    }
    float* c2s = reinterpret_cast<float*>(small);          // [kGtGroups][kDynCodes]
    float* part = c2s + kGtGroups * kDynCodes;             // [kGtWarps][2][kPart]
    i64* ptile = reinterpret_cast<i64*>(part + kGtWarps * 2 * G::kPart);  // [kGtWarps][2]

    const int warp = threadIdx.x >> 5, lane = lane_id(), g = lane >> 2, c = lane & 3;
    // the pair table: thread (warp w, lane l) fills bytes 16 w .. 16 w + 15 for lanes 4 (l & 7) ..
    // + 3 (16-byte stores), two bytes per pass
    {
        u32* lw = reinterpret_cast<u32*>(lut);
        const int q4 = lane & 7;
        for (int b = 16 * warp + (lane >> 3); b < 16 * warp + 16; b += 4) {
            const u32 v = T::pack2(code_4bit<QT>(b >> 4), code_4bit<QT>(b & 15));
            *reinterpret_cast<uint4*>(lw + b * 64 + 4 * q4) = make_uint4(v, v, v, v);
        }
    }
    if (NESTED) {
        for (int i = threadIdx.x; i < ngroups * kDynCodes; i += blockDim.x) {
            const int q = i / kDynCodes;
            const float* c2p = q == 0 ? code2_0 : q == 1 ? code2_1 : q == 2 ? code2_2 : code2_3;
            c2s[i] = ldg_f32(c2p + i % kDynCodes);
        }
    }
    const u32 lutx = smem_addr(lut) | (4u * (u32)lane);

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
    const int bsh = log2bs - 6;  // chunks per block, log2
    // input rows of this lane's B fragment columns (clamped: a lane past the batch reads row 0,
    // its columns are never written)
    const u16* arow[NB];
#pragma unroll
    for (int h = 0; h < NB; ++h) arow[h] = a + (i64)min(8 * h + g, batch - 1) * K + 16 * c;

    bool waited = false;
    i64 pos = w0;
    while (pos < w1) {
        const i64 tile = t0 + pos / C;
        const int j0 = (int)(pos % C);
        const int j1 = (int)min(C, (i64)j0 + (w1 - pos));
        const GtW wt = weight_of(tile);
        const i64 r0 = (tile - wt.tile0) * 16 + g;
        const i64 ra = min(r0, wt.n - 1), rb = min(r0 + 8, wt.n - 1);
        const u8* pa = wt.packed + ra * row_bytes + 8 * c;
        const u8* pb = wt.packed + rb * row_bytes + 8 * c;
        const i64 ea = ra * C, eb = rb * C;  // the rows' first chunk, counted over the matrix
        const float off = NESTED ? ldg_f32(wt.offset) : 0.0f;
        const float* c2 = c2s + wt.gi * kDynCodes;

        float acc[NB][4];
#pragma unroll
        for (int h = 0; h < NB; ++h) acc[h][0] = acc[h][1] = acc[h][2] = acc[h][3] = 0.0f;

        // a batch: kGtAhead chunks' weights and raw scales in registers, the next batch's loaded
        // while this one is computed
        u32 wq[2][kGtAhead][4];
        u32 sq[2][kGtAhead][2];
        float s2[2][kGtAhead][2];
        auto load = [&](int buf, int j) {
#pragma unroll
            for (int u = 0; u < kGtAhead; ++u) {
                const int jj = min(j + u, j1 - 1);  // past the range: a repeat of the last chunk
                gt_ldg_v2(pa + 32 * (i64)jj, wq[buf][u][0], wq[buf][u][1]);
                gt_ldg_v2(pb + 32 * (i64)jj, wq[buf][u][2], wq[buf][u][3]);
                const i64 ba = (ea + jj) >> bsh, bb = (eb + jj) >> bsh;
                if constexpr (NESTED) {
                    sq[buf][u][0] = ldg_u8(wt.absmax + ba);
                    sq[buf][u][1] = ldg_u8(wt.absmax + bb);
                    s2[buf][u][0] = ldg_f32(wt.absmax2 + (ba >> kNestLog2));
                    s2[buf][u][1] = ldg_f32(wt.absmax2 + (bb >> kNestLog2));
                } else {
                    sq[buf][u][0] = ldg_u32(reinterpret_cast<const float*>(wt.absmax) + ba);
                    sq[buf][u][1] = ldg_u32(reinterpret_cast<const float*>(wt.absmax) + bb);
                }
            }
        };
        auto compute = [&](int buf, int j) {
#pragma unroll
            for (int u = 0; u < kGtAhead; ++u) {
                if (j + u >= j1) break;
                const i64 e = (i64)(j + u) * 64;
                u32 x[NB][8];
#pragma unroll
                for (int h = 0; h < NB; ++h) {
                    ldg_v4(arow[h] + e, x[h][0], x[h][1], x[h][2], x[h][3]);
                    ldg_v4(arow[h] + e + 8, x[h][4], x[h][5], x[h][6], x[h][7]);
                }
                float d[NB][4];
#pragma unroll
                for (int h = 0; h < NB; ++h) d[h][0] = d[h][1] = d[h][2] = d[h][3] = 0.0f;
#pragma unroll
                for (int m = 0; m < 4; ++m) {
                    const u32 wa = wq[buf][u][m >> 1], wb = wq[buf][u][2 + (m >> 1)];
                    u32 af[4];
                    if (m & 1) {
                        af[0] = gt_pair<2>(wa, lutx);
                        af[1] = gt_pair<2>(wb, lutx);
                        af[2] = gt_pair<3>(wa, lutx);
                        af[3] = gt_pair<3>(wb, lutx);
                    } else {
                        af[0] = gt_pair<0>(wa, lutx);
                        af[1] = gt_pair<0>(wb, lutx);
                        af[2] = gt_pair<1>(wa, lutx);
                        af[3] = gt_pair<1>(wb, lutx);
                    }
#pragma unroll
                    for (int h = 0; h < NB; ++h) mma_16816<T>(d[h], af, x[h][2 * m], x[h][2 * m + 1]);
                }
                float sa, sb;
                if constexpr (NESTED) {
                    sa = __fadd_rn(__fmul_rn(c2[sq[buf][u][0]], s2[buf][u][0]), off);
                    sb = __fadd_rn(__fmul_rn(c2[sq[buf][u][1]], s2[buf][u][1]), off);
                } else {
                    sa = __uint_as_float(sq[buf][u][0]);
                    sb = __uint_as_float(sq[buf][u][1]);
                }
#pragma unroll
                for (int h = 0; h < NB; ++h) {
                    acc[h][0] = fmaf(d[h][0], sa, acc[h][0]);
                    acc[h][1] = fmaf(d[h][1], sa, acc[h][1]);
                    acc[h][2] = fmaf(d[h][2], sb, acc[h][2]);
                    acc[h][3] = fmaf(d[h][3], sb, acc[h][3]);
                }
            }
        };

        load(0, j0);
        if (!waited) {  // the input (and out) may be written by the previous kernel (PDL)
            grid_dep_wait();
            waited = true;
        }
        int j = j0;
        for (; j + kGtAhead < j1; j += 2 * kGtAhead) {
            load(1, j + kGtAhead);
            compute(0, j);
            if (j + 2 * kGtAhead < j1) load(0, j + 2 * kGtAhead);
            compute(1, j + kGtAhead);
        }
        if (j < j1) compute(0, j);

        // the segment's result: C fragment (row g, col 2c), (g, 2c + 1), (g + 8, 2c), (g + 8, 2c + 1)
        if (j0 == 0 && j1 == C) {
#pragma unroll
            for (int h = 0; h < NB; ++h)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int col = 8 * h + 2 * c + (r & 1);
                    const i64 row = r0 + 8 * (r >> 1);
                    if (col < batch && row < wt.n) out[col * ldo + wt.col0 + row] = T::from_f(acc[h][r]);
                }
        } else {
            const int slot = pos == w0 ? 0 : 1;
            float* p = part + (2 * warp + slot) * G::kPart;
#pragma unroll
            for (int h = 0; h < NB; ++h)
#pragma unroll
                for (int r = 0; r < 4; ++r) p[h * 128 + 4 * lane + r] = acc[h][r];
            if (lane == 0) ptile[2 * warp + slot] = tile;
        }
        pos += j1 - j0;
    }
    if (!waited) grid_dep_wait();
    grid_dep_launch();
    __syncthreads();
    // tiles shared by warps: add the pieces in warp order
    for (int idx = threadIdx.x; idx < 2 * kGtWarps * G::kPart; idx += blockDim.x) {
        const int ws = idx / G::kPart, e = idx % G::kPart;  // the piece (warp, slot) this thread may lead
        const i64 tile = ptile[ws];
        if (tile < 0) continue;
        // the leader is the first piece of the tile (the pieces' tiles never decrease with the
        // index; unused slots hold -1)
        int prev = ws - 1;
        while (prev >= 0 && ptile[prev] < 0) --prev;
        if (prev >= 0 && ptile[prev] == tile) continue;
        float sum = part[ws * G::kPart + e];
        for (int k = ws + 1; k < 2 * kGtWarps; ++k) {
            const i64 tk = ptile[k];
            if (tk == tile) sum += part[k * G::kPart + e];
            else if (tk >= 0) break;
        }
        const GtW wt = weight_of(tile);
        const int h = e >> 7, ln = (e >> 2) & 31, r = e & 3;
        const int col = 8 * h + 2 * (ln & 3) + (r & 1);
        const i64 row = (tile - wt.tile0) * 16 + (ln >> 2) + 8 * (r >> 1);
        if (col < batch && row < wt.n) out[col * ldo + wt.col0 + row] = T::from_f(sum);
    }
#endif
}

#undef QC_GT_GROUP_PARAMS

}  // namespace qc
