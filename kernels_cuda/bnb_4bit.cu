// bitsandbytes 4-bit NF4 / FP4: quantize, dequantize (nested statistics decoded in the same
// kernel) and gemv. Semantics: shared/design/FORMATS.md section 1 and quantcore/formats/bnb.py.
#include "qc_common.cuh"

namespace qc {

// ==================================================================================================
// quantize_4bit
// ==================================================================================================
// Rounding a scaled value s to a 4-bit code is "code = number of thresholds t with v > t"
// (v = s for NF4, |s| for FP4). Instead of 15 comparisons per element, v is placed in one of 64
// cells per unit (floor(v * 64 + OFF)); a per-cell byte says how many thresholds lie surely below
// the cell, and one comparison with the next threshold finishes the count. That is exact for
// every fp32 v, values a rounding away from a cell edge and NaN (cell 0, compares false) included,
// as long as no two thresholds fall in one cell widened by the margin; build_round4 checks it
// (the closest thresholds of both tables are 0.08 apart, a cell is 1/64 wide).
constexpr float kCellsPerUnit = 64.0f;
constexpr float kCellMargin = 1.0f / 1024.0f;

template <int QT>
struct Round4 {
    static constexpr int kNThr = QT == QC_QUANT_NF4 ? QC_NF4_NTHRESHOLDS : QC_FP4_NTHRESHOLDS;
    static constexpr int kCells = QT == QC_QUANT_NF4 ? 128 : 64;  // v in [-1, 1] or [0, 1]
    static constexpr float kOff = QT == QC_QUANT_NF4 ? 64.0f : 0.0f;
    static __device__ __forceinline__ float thr(int i) {
        return QT == QC_QUANT_NF4 ? kNf4Thresholds[i] : kFp4Thresholds[i];
    }
};

struct Round4Tables {
    float thr[16];  // thresholds, padded with +inf
    u8 cell[128];   // number of thresholds surely below each cell
    u32 steps;      // FP4: magnitude code of each count, 4 bits per count
    int bad;        // two thresholds in one cell: the tables cannot work, the kernel traps
};

template <int QT>
__device__ void build_round4(Round4Tables& t) {
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
    if (i < R::kCells) {
        const float lo = ((float)i - R::kOff) / kCellsPerUnit - kCellMargin;
        const float hi = ((float)(i + 1) - R::kOff) / kCellsPerUnit + kCellMargin;
        int below = 0, inside = 0;
        for (int j = 0; j < R::kNThr; ++j) {
            const float th = R::thr(j);
            below += th < lo;
            inside += (th >= lo) && (th < hi);
        }
        t.cell[i] = (u8)below;
        if (inside > 1) atomicExch(&t.bad, 1);
    }
    __syncthreads();
    if (t.bad) __trap();
}

template <int QT>
__device__ __forceinline__ u32 round4(const Round4Tables& t, float s) {
    using R = Round4<QT>;
    const float v = QT == QC_QUANT_NF4 ? s : fabsf(s);
    int c = __float2int_rd(fmaf(v, kCellsPerUnit, R::kOff));  // exact v*64, one rounding; NaN -> 0
    c = min(max(c, 0), R::kCells - 1);
    const int base = t.cell[c];
    const u32 count = (u32)base + (v > t.thr[base] ? 1u : 0u);
    if (QT == QC_QUANT_NF4) return count;
    const u32 mag = (t.steps >> (4 * count)) & 7u;
    return mag | (s < 0.0f ? (u32)QC_FP4_SIGN_BIT : 0u);  // sign iff s < 0: -0.0 stays positive
}

// Max of a value over the G consecutive threads of one quantization block (G = blocksize / 8, a
// power of two from 4 to 512; the CTA holds whole groups). NaN-ignoring like the format's absmax.
__device__ __forceinline__ float group_absmax(float m, int G, float* red) {
    const int lanes = G < 32 ? G : 32;
    for (int off = lanes >> 1; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(kFullMask, m, off));
    if (G > 32) {  // uniform over the CTA
        const int warp = threadIdx.x >> 5, wpg = G >> 5, first = (warp / wpg) * wpg;
        if (lane_id() == 0) red[warp] = m;
        __syncthreads();
        m = red[first];
        for (int j = 1; j < wpg; ++j) m = fmaxf(m, red[first + j]);
    }
    return m;
}

// One thread per 8 consecutive elements; G threads per block. packed byte i holds element 2i in
// its high nibble. Elements past n count as 0.0 (the format's padding), so the low nibble of an
// odd n's last byte is the block's code of 0.0, and a partial block's absmax ignores the padding
// only through fmaxf(., 0).
template <typename T, int QT>
__global__ void __launch_bounds__(512) quantize_4bit_kernel(
    const typename T::S* __restrict__ x, u8* __restrict__ packed, float* __restrict__ absmax,
    i64 n, int log2bs, int vec) {
    __shared__ Round4Tables tab;
    __shared__ float red[16];
    build_round4<QT>(tab);

    const int G = (1 << log2bs) >> 3;
    const i64 nbytes = (n + 1) >> 1;
    // persistent CTAs (the grid is sized to the resident capacity): the tables are built once
    const i64 nthreads = (n + 7) >> 3;
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t - threadIdx.x < nthreads;
         t += (i64)gridDim.x * blockDim.x) {
        const i64 e0 = t * 8;
        float v[8];
        load8<T>(x, e0, n, vec != 0, v);
        float m = nan_value();
#pragma unroll
        for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(v[i]));
        m = group_absmax(m, G, red);
        const float r = recip_rn(m);  // correctly rounded; 1/0 = inf and 0*inf = NaN -> code 0

        if ((threadIdx.x & (G - 1)) == 0 && e0 < n) absmax[e0 >> log2bs] = m;
        u32 word = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 hi = round4<QT>(tab, __fmul_rn(v[2 * i], r));
            const u32 lo = round4<QT>(tab, __fmul_rn(v[2 * i + 1], r));
            word |= ((hi << 4) | lo) << (8 * i);
        }
        const i64 b0 = t * 4;
        if (vec && b0 + 4 <= nbytes) {
            *reinterpret_cast<u32*>(packed + b0) = word;
        } else {
#pragma unroll
            for (int i = 0; i < 4; ++i)
                if (b0 + i < nbytes) packed[b0 + i] = (u8)(word >> (8 * i));
        }
        if (G > 32) __syncthreads();  // red[] is rewritten by the next iteration
    }
}

// ==================================================================================================
// dequantize_4bit
// ==================================================================================================
// absmax of block b: plain fp32, or (nested) code2[q[b]] * absmax2[b / 256] + offset with two
// roundings, in that order.
template <bool NESTED>
__device__ __forceinline__ float block_scale(const void* absmax, const float* absmax2, const float* c2,
                                             float offset, i64 b) {
    if (!NESTED) return ldg_f32(reinterpret_cast<const float*>(absmax) + b);
    const u32 q = ldg_u8(reinterpret_cast<const u8*>(absmax) + b);
    return __fadd_rn(__fmul_rn(c2[q], ldg_f32(absmax2 + (b >> 8))), offset);
}

constexpr int kDequantThreads = 256;
constexpr int kDequantWords = 8;  // packed 32-bit words (8 elements each) per thread

// Each thread decodes kDequantWords packed words spaced a CTA apart, so each load and each
// 8-element store of a warp is contiguous; all loads are issued before the first use.
template <typename T, int QT, bool NESTED>
__global__ void __launch_bounds__(kDequantThreads, 4) dequantize_4bit_kernel(
    const u8* __restrict__ packed, const void* __restrict__ absmax, const float* __restrict__ absmax2,
    const float* __restrict__ code2, const float* __restrict__ offset, typename T::S* __restrict__ out,
    i64 n, int log2bs, int vec) {
    __shared__ float lut[16];
    __shared__ float c2[NESTED ? 256 : 1];
    if (threadIdx.x < 16) lut[threadIdx.x] = code_4bit<QT>(threadIdx.x);
    if (NESTED)
        for (int i = threadIdx.x; i < 256; i += blockDim.x) c2[i] = ldg_f32(code2 + i);
    __syncthreads();
    const float off = NESTED ? ldg_f32(offset) : 0.0f;

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
                s2[j] = ldg_f32(absmax2 + (b >> 8));
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
                    NESTED ? __fadd_rn(__fmul_rn(c2[sraw[j]], s2[j]), off) : __uint_as_float(sraw[j]);
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
// gemv_4bit, tensor-core path (fp16 / bf16 activations, K % 32 == 0, aligned operands)
// ==================================================================================================
// out[b, r] = sum_k a[b, k] * code[q(r, k)] * absmax(r, k). A warp computes a tile of 16 weight
// rows for up to 8 activation rows with mma.m16n8k16 (A = the 4-bit codes as fp16/bf16 values,
// B = the activations, fp32 accumulation). The absmax scale is applied in fp32 to each 32-wide
// piece of K (one piece never straddles a block: blocksize >= 32 and rows start on a piece):
// the 4 lanes sharing a row each hold 4 bytes of the piece's 16, so the two k16 steps of a piece
// hold only that piece's values; any order of k inside the mma is allowed as long as A and B use
// the same one. Numerics: T(code) is the only rounding before the fp32 products.
//
// Memory: a warp streams its 16 rows in stages of 8 pieces (128 bytes per row). Each lane loads
// 16 contiguous bytes per row and stage half (a quad of lanes covers 64 contiguous bytes of a row,
// two full sectors), then a 4x4 transpose inside the quad gives each lane its 4 bytes of every
// piece. The next stage is loaded while the current one is multiplied (register double
// buffering), and the scales are fetched with the weights: lane c of a quad fetches those of
// pieces 2c and 2c+1 and hands them to the quad by shuffles, so a scale is loaded once per row.
//
// Decoding a byte (two codes) is one shared-memory load from a 256-entry table of T pairs. Each
// lane has its own copy of the table (32 KiB) so that a warp's 32 random lookups never meet in a
// bank. K is split between the warps of a CTA when there are too few row tiles; partial sums are
// added in a fixed order (deterministic).
constexpr int kGemvWarps = 8;
constexpr int kGemvStage = 8;  // pieces of 32 k per stage

template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1);

template <>
__device__ __forceinline__ void mma_16816<F16>(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<BF16>(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Byte j of word w looked up in the lane's copy of the pair table.
__device__ __forceinline__ u32 lut_pair(const u32* lut, u32 w, int j, u32 lane) {
    return lut[__byte_perm(w, 0u, 0x4440u + (u32)j) * 32u + lane];
}

__device__ __forceinline__ void ldg_stream_v4(const void* p, u32 (&w)[4]) {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
}

// Lane c of each quad holds word j of item c in m[j]; afterwards it holds word c of item j.
__device__ __forceinline__ void quad_transpose(u32 (&m)[4], int c) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const bool up = (c & 2) != 0;
        const u32 recv = __shfl_xor_sync(kFullMask, up ? m[j] : m[j + 2], 2);
        if (up) m[j] = recv; else m[j + 2] = recv;
    }
#pragma unroll
    for (int j = 0; j < 4; j += 2) {
        const bool up = (c & 1) != 0;
        const u32 recv = __shfl_xor_sync(kFullMask, up ? m[j] : m[j + 1], 1);
        if (up) m[j] = recv; else m[j + 1] = recv;
    }
}

// One stage as loaded: w[row][half][word] (16 bytes of piece 4*half + c), and the raw scale data
// of pieces 2c and 2c+1 (absmax bits or nested code byte, and the nested second-level absmax).
struct GemvStage {
    u32 w[2][2][4];
    u32 raw[2][2];
    float a2[2][2];
};

template <bool NESTED>
__device__ __forceinline__ void gemv_load_stage(GemvStage& st, const u8* const (&wrow)[2], const i64 (&erow)[2],
                                                i64 p0, i64 p_end, int c, const void* absmax,
                                                const float* absmax2, int log2bs) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const i64 p = p0 + 4 * h + c;
            if (p < p_end) {
                ldg_stream_v4(wrow[r] + p * 16, st.w[r][h]);
            } else {
                st.w[r][h][0] = st.w[r][h][1] = st.w[r][h][2] = st.w[r][h][3] = 0u;
            }
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const i64 p = p0 + 2 * c + i;
            const i64 blk = (erow[r] + (p < p_end ? p : p0) * 32) >> log2bs;
            if (NESTED) {
                st.raw[i][r] = ldg_u8(reinterpret_cast<const u8*>(absmax) + blk);
                st.a2[i][r] = ldg_f32(absmax2 + (blk >> 8));
            } else {
                st.raw[i][r] = ldg_u32(reinterpret_cast<const float*>(absmax) + blk);
            }
        }
    }
}

template <typename T, int QT, bool NESTED>
__global__ void __launch_bounds__(kGemvWarps * 32, 2) gemv_4bit_mma_kernel(
    const u16* __restrict__ a, const u8* __restrict__ packed, const void* __restrict__ absmax,
    const float* __restrict__ absmax2, const float* __restrict__ code2, const float* __restrict__ offset,
    u16* __restrict__ out, int batch, i64 N, i64 K, int log2bs, int ksplit) {
    __shared__ u32 lut[256 * 32];
    __shared__ float c2[NESTED ? 256 : 1];
    __shared__ float red[kGemvWarps][16][8];

    for (int i = threadIdx.x; i < 256 * 32; i += blockDim.x) {
        const int byte = i >> 5;
        lut[i] = T::pack2(code_4bit<QT>(byte >> 4), code_4bit<QT>(byte & 15));
    }
    if (NESTED)
        for (int i = threadIdx.x; i < 256; i += blockDim.x) c2[i] = ldg_f32(code2 + i);
    __syncthreads();
    const float off = NESTED ? ldg_f32(offset) : 0.0f;

    const int warp = threadIdx.x >> 5, lane = lane_id(), g = lane >> 2, c = lane & 3;
    const u32 lane4 = (u32)lane;  // lut_pair's lane operand
    const int tiles_per_cta = kGemvWarps / ksplit;
    const int slot = warp / ksplit, ks = warp % ksplit;
    const int b0 = blockIdx.y * 8, nb = min(8, batch - b0);
    const i64 ntiles = (N + 15) >> 4, ngroups = (ntiles + tiles_per_cta - 1) / tiles_per_cta;
    const i64 npieces = K >> 5;
    const i64 p_begin = npieces * ks / ksplit, p_end = npieces * (ks + 1) / ksplit;
    // batch row of this lane's B fragment; lanes past the batch feed zeros
    const bool has_row = g < nb;
    const u16* arow = a + (i64)(b0 + (has_row ? g : 0)) * K + 8 * c;

    for (i64 grp = blockIdx.x; grp < ngroups; grp += gridDim.x) {
        const i64 tile = grp * tiles_per_cta + slot;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (tile < ntiles) {  // warp-uniform
            const i64 r0 = min(tile * 16 + g, N - 1), r1 = min(tile * 16 + g + 8, N - 1);
            const u8* const wrow[2] = {packed + ((r0 * K) >> 1), packed + ((r1 * K) >> 1)};
            const i64 erow[2] = {r0 * K, r1 * K};
            GemvStage cur, nxt;
            gemv_load_stage<NESTED>(cur, wrow, erow, p_begin, p_end, c, absmax, absmax2, log2bs);
            for (i64 p0 = p_begin; p0 < p_end; p0 += kGemvStage) {
                // activations of the stage (L1/L2 hits: every warp of the grid reads them)
                const int valid = (int)min(p_end - p0, (i64)kGemvStage);  // pieces of this stage
                const u16* ap = arow + p0 * 32;
                u32 x[kGemvStage][4];
#pragma unroll
                for (int u = 0; u < kGemvStage; ++u) {
                    if (has_row && u < valid) {
                        ldg_v4(ap + u * 32, x[u][0], x[u][1], x[u][2], x[u][3]);
                    } else {
                        x[u][0] = x[u][1] = x[u][2] = x[u][3] = 0u;
                    }
                }
                if (p0 + kGemvStage < p_end)
                    gemv_load_stage<NESTED>(nxt, wrow, erow, p0 + kGemvStage, p_end, c, absmax, absmax2, log2bs);
                float sc[2][2];
#pragma unroll
                for (int i = 0; i < 2; ++i)
#pragma unroll
                    for (int r = 0; r < 2; ++r)
                        sc[i][r] = NESTED ? __fadd_rn(__fmul_rn(c2[cur.raw[i][r]], cur.a2[i][r]), off)
                                          : __uint_as_float(cur.raw[i][r]);
#pragma unroll
                for (int r = 0; r < 2; ++r)
#pragma unroll
                    for (int h = 0; h < 2; ++h) quad_transpose(cur.w[r][h], c);
#pragma unroll
                for (int u = 0; u < kGemvStage; ++u) {
                    const int src = (lane & ~3) | (u >> 1);
                    const float s0 = __shfl_sync(kFullMask, sc[u & 1][0], src);
                    const float s1 = __shfl_sync(kFullMask, sc[u & 1][1], src);
                    if (u < valid) {  // warp-uniform
                        const u32 q0 = cur.w[0][u >> 2][u & 3], q1 = cur.w[1][u >> 2][u & 3];
                        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const u32 af[4] = {lut_pair(lut, q0, 2 * h, lane4), lut_pair(lut, q1, 2 * h, lane4),
                                               lut_pair(lut, q0, 2 * h + 1, lane4),
                                               lut_pair(lut, q1, 2 * h + 1, lane4)};
                            mma_16816<T>(d, af, x[u][2 * h], x[u][2 * h + 1]);
                        }
                        acc[0] = fmaf(d[0], s0, acc[0]);
                        acc[1] = fmaf(d[1], s0, acc[1]);
                        acc[2] = fmaf(d[2], s1, acc[2]);
                        acc[3] = fmaf(d[3], s1, acc[3]);
                    }
                }
                cur = nxt;
            }
        }
        // C fragment: (row g, col 2c), (row g, col 2c+1), (row g+8, col 2c), (row g+8, col 2c+1)
        red[warp][g][2 * c] = acc[0];
        red[warp][g][2 * c + 1] = acc[1];
        red[warp][g + 8][2 * c] = acc[2];
        red[warp][g + 8][2 * c + 1] = acc[3];
        __syncthreads();
        for (int idx = threadIdx.x; idx < tiles_per_cta * 128; idx += blockDim.x) {
            const int s = idx >> 7, col = (idx >> 4) & 7, row = idx & 15;
            const i64 r = (grp * tiles_per_cta + s) * 16 + row;
            if (r < N && col < nb) {
                float sum = red[s * ksplit][row][col];
                for (int j = 1; j < ksplit; ++j) sum += red[s * ksplit + j][row][col];
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
__global__ void __launch_bounds__(256) gemv_4bit_simple_kernel(
    const typename T::S* __restrict__ a, const u8* __restrict__ packed, const void* __restrict__ absmax,
    const float* __restrict__ absmax2, const float* __restrict__ code2, const float* __restrict__ offset,
    typename T::S* __restrict__ out, int batch, i64 N, i64 K, int log2bs) {
    __shared__ float lut[16];
    __shared__ float c2[NESTED ? 256 : 1];
    if (threadIdx.x < 16) lut[threadIdx.x] = code_4bit<QT>(threadIdx.x);
    if (NESTED)
        for (int i = threadIdx.x; i < 256; i += blockDim.x) c2[i] = ldg_f32(code2 + i);
    __syncthreads();
    const float off = NESTED ? ldg_f32(offset) : 0.0f;
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
