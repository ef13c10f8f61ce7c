// gemv_4bit for many input rows (prefill, batched serving): a tensor-core GEMM that reads the
// bitsandbytes 4-bit layout directly (NF4 / FP4, with or without double quantization), fp16 / bf16
// activations, K % 64 == 0, blocksize >= 64. Semantics: quantcore/formats/bnb.py (gemv_4bit).
//
// Numerics (those of the decode gemv, bnb_gemv.cu): T(code) is the only rounding before the fp32
// products (mma.sync m16n8k16, fp32 accumulators); each 64-element chunk's mma result is multiplied
// by its block's scale (computed in fp32 as dequantize_4bit does) and added to the fp32 sum; the
// K slices of a tile are added in a fixed order; one rounding to T at the end.
//
// Design (docs/performance.md, "NF4 prefill", Session 16): the weight is the mma's A operand (16
// weight rows), the input its B operand (8 input rows), so a decoded weight fragment serves 4 input
// tiles. A warp owns 64 weight rows x 32 input rows; a CTA's 8 warps are WW (weight rows) x WR (input
// rows) x WK (K slices): stage s of the CTA's shared-memory ring holds chunks s WK .. s WK + WK - 1
// (the packed codes of its 64 WW weight rows, the 32 WR input rows, each weight row's scale data),
// filled by 16-byte cp.async S - 1 stages ahead, one barrier per stage; warp (ww, wr, wk) takes chunk
// s WK + wk. Lane (g, c) reads 8 code bytes of rows g and g + 8 (elements 16 c .. 16 c + 15) and the
// input's elements 16 c .. 16 c + 15 of its input rows: the mma's k slots are that permutation of the
// chunk (as in the decode gemv), so 2 loads per input tile give the 4 k steps. Codes become mma
// operands by a per-lane table of T(hi), T(lo) pairs in shared memory, one byte_perm + one load per
// pair (the table's address a multiple of 64 KiB). The WK slices of a tile are added through shared
// memory after the loop. Launch geometry from the generated header (QC_GM_*).
#include "qc_common.cuh"

namespace qc {

constexpr int kGmThreads = QC_GM_THREADS;
constexpr int kGmTable = QC_GM_TABLE;  // the pair table: 256 code bytes x 256 bytes (32 lanes x 4 used)
constexpr int kGmApad = QC_GM_APAD;    // bytes after an input row's chunks (its rows on distinct banks)
constexpr int kGmCpad = QC_GM_CPAD;    // bytes after a weight row's code chunks when WK > 1 (likewise)
constexpr u32 kGmSmem = QC_GM_SMEM;    // the dynamic shared memory the launcher gives (S is sized for it)
static_assert(kGmThreads == 256 && kGmTable == 65536, "8 warps; the byte_perm table address");

// one ring slot of a (WW, WR, WK) CTA: the codes, the input tile, the scale data (8 bytes per weight
// row and chunk: the absmax word, absmax2); quantcore.formats.kernel_defines.gm_slot_bytes
template <int WW, int WR, int WK>
struct GmGeo {
    static_assert(WW * WR * WK == 8 && WW * WK >= 2, "8 warps; whole code pieces per thread");
    static constexpr int kRowsW = 64 * WW;
    static constexpr int kRowsA = 32 * WR;
    static constexpr int kCPitch = 32 * WK + (WK > 1 ? kGmCpad : 0);
    static constexpr int kAPitch = 128 * WK + kGmApad;
    static constexpr int kC = kRowsW * kCPitch;
    static constexpr int kA = kRowsA * kAPitch;
    static constexpr int kSc = kRowsW * WK * 8;
    static constexpr int kSlot = kC + kA + kSc;
    static constexpr int kPart = 64 * 32 * 4;  // one warp's accumulators
};

// 4 bytes global -> shared through L1 (the scale data), src_size of them read, the rest zero-filled
__device__ __forceinline__ void gm_cp_async4(u32 dst, const void* src, u32 src_size) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_size) : "memory");
}
__device__ __forceinline__ void gm_lds_v2(u32 addr, u32& a, u32& b) {
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(a), "=r"(b) : "r"(addr));
}
__device__ __forceinline__ float gm_lds_f32(u32 addr) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr));
    return v;
}
__device__ __forceinline__ void gm_sts_f32(u32 addr, float v) {
    asm volatile("st.shared.f32 [%0], %1;" ::"r"(addr), "f"(v) : "memory");
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// clusters (sm_90): the K slices of a tile over CL CTAs, added through distributed shared memory
__device__ __forceinline__ void gm_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ float gm_ld_cluster_f32(u32 addr, u32 rank) {
    u32 remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
}
#define QC_GM_CLUSTER(CL) __cluster_dims__(1, 1, CL)
#else
#define QC_GM_CLUSTER(CL)  // CL > 1 only on sm_90 (the launcher's choice); the body traps below it
#endif

// out[r, n] = T(sum_k a[r, k] * w[n, k]) for r < rows, n < N; out rows ldo elements apart.
// grid: x the blocks of 32 WR input rows (CTAs sharing a weight tile run together), y the blocks
// of 64 WW weight rows, z the CL K slices of a cluster (CTA z takes chunks C z / CL .. C (z + 1) / CL).
// N K / 64 < 2^31 (the launcher checks).
template <typename T, int QT, bool NESTED, int WW, int WR, int WK, int S, int CL>
__global__ void QC_GM_CLUSTER(CL) __launch_bounds__(kGmThreads, 1) gemm_4bit_kernel(
    const u16* __restrict__ a, const u8* __restrict__ packed, const void* __restrict__ absmax,
    const float* __restrict__ absmax2, const float* __restrict__ code2, const float* __restrict__ offset,
    u16* __restrict__ out, i64 ldo, int rows, i64 N, i64 K, int log2bs) {
    using G = GmGeo<WW, WR, WK>;
    static_assert(S >= 3, "stages kt + 1 .. kt + S - 2 are in flight while stage kt is multiplied");
    extern __shared__ __align__(16) u8 gm_smem[];
    require_dynamic_smem(kGmSmem);
    const u32 base = smem_addr(gm_smem);
    const u32 end = base + kGmSmem;
    // the table at the 64 KiB boundary of the window that leaves the most slots around it; nf slots
    // before it, the rest after it (the launcher sizes S for the worst placement)
    u32 tab = 0;
    int nf = 0, most = -1;
    for (u32 b = (base + 0xffffu) & ~0xffffu; b + kGmTable <= end; b += 0x10000u) {
        const int f = (int)((b - base) / G::kSlot), r = (int)((end - b - kGmTable) / G::kSlot);
        if (f + r > most) {
            most = f + r;
            tab = b;
            nf = f;
        }
    }
    if (most < S) __trap();  // launcher bug
    nf = min(nf, S);
    const u32 tab_end = tab + kGmTable;
    auto slot_addr = [&](int s) -> u32 { return s < nf ? base + s * G::kSlot : tab_end + (s - nf) * G::kSlot; };

    const int tid = threadIdx.x, warp = tid >> 5, lane = lane_id(), g = lane >> 2, c = lane & 3;
    // the pair table: entry (byte, lane) at tab + 256 byte + 4 lane; the code2 copy in the rows'
    // free halves (value i at row i / 32, byte 128 + 4 (i % 32))
    for (int i = tid; i < 256 * 8; i += kGmThreads) {
        const int byte = i >> 3;
        const u32 v = T::pack2(code_4bit<QT>(byte >> 4), code_4bit<QT>(byte & 15));
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(tab + byte * 256 + (i & 7) * 16), "r"(v)
                     : "memory");
    }
    auto c2_addr = [&](u32 i) { return tab + (i >> 5) * 256 + 128 + (i & 31) * 4; };
    if (NESTED)
        for (int i = tid; i < kDynCodes; i += kGmThreads) gm_sts_f32(c2_addr(i), ldg_f32(code2 + i));
    const float off = NESTED ? ldg_f32(offset) : 0.0f;

    const int wk = warp % WK, wr = (warp / WK) % WR, ww = warp / (WK * WR);
    const int m0 = blockIdx.x * G::kRowsA;
    const i64 n0 = (i64)blockIdx.y * G::kRowsW;
    const int C = (int)(K >> 6);
    const int cbeg = (int)((i64)C * blockIdx.z / CL), cend = (int)((i64)C * (blockIdx.z + 1) / CL);
    const int KT = (cend - cbeg + WK - 1) / WK;
    const i64 row_bytes = K >> 1;
    const int bsh = log2bs - 6;  // chunks per block, log2
    const i64 nblk = (N * K + (1LL << log2bs) - 1) >> log2bs;

    // copies of a stage, per thread: code pieces tid + 256 i (i < CP) of the 16-byte pieces of the
    // stage's WK chunks of its 64 WW weight rows (rows past N read row N - 1, never written out);
    // input pieces tid + 256 i (i < AP) of its 32 WR rows (rows past the input zero-filled); scale
    // entries tid + 256 i (i < SP) of (weight row, chunk). 256 is a multiple of the pieces per row,
    // so a thread's piece column is the same for every i; the sources advance with the stage.
    constexpr int CP = WW * WK / 2, AP = WR * WK, SP = (G::kRowsW * WK + kGmThreads - 1) / kGmThreads;
    constexpr int CPR = 2 * WK, APR = 8 * WK;  // pieces per row
    static_assert(kGmThreads % APR == 0 && kGmThreads % WK == 0, "piece columns per thread");
    const int cq = tid % CPR, aq = tid % APR, sj = tid % WK;
    const u32 cdst = (tid / CPR) * G::kCPitch + 16 * cq, adst = G::kC + (tid / APR) * G::kAPitch + 16 * aq;
    const u8* csrc[CP];
#pragma unroll
    for (int i = 0; i < CP; ++i)
        csrc[i] = packed + min(n0 + tid / CPR + i * (kGmThreads / CPR), N - 1) * row_bytes + 32 * cbeg + 16 * cq;
    const u16* asrc = a + (i64)(m0 + tid / APR) * K + 64 * cbeg + 8 * aq;
    u32 sent[SP];  // the entry's first chunk over the matrix (weight row clamped)
#pragma unroll
    for (int i = 0; i < SP; ++i)
        sent[i] = (u32)min(n0 + (tid + kGmThreads * i) / WK, N - 1) * (u32)C + (u32)(cbeg + sj);
    auto issue = [&](int kt) {
        if (kt < KT) {
            const u32 slot = slot_addr(kt % S);
            const int ch0 = cbeg + kt * WK;
            const bool cok = ch0 + cq / 2 < cend;
#pragma unroll
            for (int i = 0; i < CP; ++i)
                cp_async16(slot + cdst + i * (kGmThreads / CPR) * G::kCPitch, cok ? csrc[i] + 32 * kt * WK : packed,
                           cok ? 16u : 0u);
            const bool aok = ch0 + aq / 8 < cend;
#pragma unroll
            for (int i = 0; i < AP; ++i) {
                const bool ok = aok && m0 + tid / APR + i * (kGmThreads / APR) < rows;
                cp_async16(slot + adst + i * (kGmThreads / APR) * G::kAPitch,
                           ok ? asrc + (i64)i * (kGmThreads / APR) * K + 64 * kt * WK : a, ok ? 16u : 0u);
            }
            if (ch0 + sj < cend) {
#pragma unroll
                for (int i = 0; i < SP; ++i) {
                    const int e = tid + kGmThreads * i;
                    if (e < G::kRowsW * WK) {
                        const u32 b = (sent[i] + (u32)(kt * WK)) >> bsh;
                        const u32 dst = slot + G::kC + G::kA + 8 * e;
                        if constexpr (NESTED) {
                            const i64 w0 = b & ~3u;
                            gm_cp_async4(dst, reinterpret_cast<const u8*>(absmax) + w0, (u32)min((i64)4, nblk - w0));
                            gm_cp_async4(dst + 4, absmax2 + (b >> kNestLog2), 4u);
                        } else {
                            gm_cp_async4(dst, reinterpret_cast<const float*>(absmax) + b, 4u);
                        }
                    }
                }
            }
        }
        cp_async_commit();  // one group per stage (empty past the end)
    };

    const u32 lutx = tab | (4u * (u32)lane);

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;

    for (int s = 0; s < S - 1; ++s) issue(s);
    __syncthreads();  // the tables
    int cur = 0;  // kt % S
    for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<S - 2>();  // this thread's copies of stages <= kt
        if constexpr (NESTED) {  // the scale entries this thread copied for stage kt, decoded in place
            if (cbeg + kt * WK + sj < cend) {
                const u32 sbase = slot_addr(cur) + G::kC + G::kA;
#pragma unroll
                for (int i = 0; i < SP; ++i) {
                    const int e = tid + kGmThreads * i;
                    if (e < G::kRowsW * WK) {
                        u32 raw, s2;
                        gm_lds_v2(sbase + 8 * e, raw, s2);
                        const u32 b = (sent[i] + (u32)(kt * WK)) >> bsh;
                        const float c2v = gm_lds_f32(c2_addr((raw >> (8 * (b & 3u))) & 0xffu));
                        gm_sts_f32(sbase + 8 * e, __fadd_rn(__fmul_rn(c2v, __uint_as_float(s2)), off));
                    }
                }
            }
        }
        __syncthreads();  // everyone's copies (and scales); stage kt - 1 fully consumed (its slot is refilled now)
        issue(kt + S - 1);
        const int ch = cbeg + kt * WK + wk;
        if (ch < cend) {
            const u32 slot = slot_addr(cur);
            // the input fragments of the chunk: tile nt, row 8 nt + g, elements 16 c .. 16 c + 15
            u32 x[4][8];
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                const u32 ad = slot + G::kC + (wr * 32 + nt * 8 + g) * G::kAPitch + wk * 128 + 32 * c;
                lds_v4(ad, x[nt][0], x[nt][1], x[nt][2], x[nt][3]);
                lds_v4(ad + 16, x[nt][4], x[nt][5], x[nt][6], x[nt][7]);
            }
#pragma unroll
            for (int mt = 0; mt < 4; ++mt) {
                const int r = ww * 64 + mt * 16 + g;
                u32 wq[4];
                gm_lds_v2(slot + r * G::kCPitch + wk * 32 + 8 * c, wq[0], wq[1]);
                gm_lds_v2(slot + (r + 8) * G::kCPitch + wk * 32 + 8 * c, wq[2], wq[3]);
                // the rows' block scales (fp32: absmax, or decoded in place above)
                const float sc[2] = {gm_lds_f32(slot + G::kC + G::kA + 8 * (r * WK + wk)),
                                     gm_lds_f32(slot + G::kC + G::kA + 8 * ((r + 8) * WK + wk))};
                float d[4][4];
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) d[nt][0] = d[nt][1] = d[nt][2] = d[nt][3] = 0.0f;
#pragma unroll
                for (int m = 0; m < 4; ++m) {
                    u32 af[4];
                    pair_frag(m, wq, lutx, af);
#pragma unroll
                    for (int nt = 0; nt < 4; ++nt) mma_16816<T>(d[nt], af, x[nt][2 * m], x[nt][2 * m + 1]);
                }
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) {
                    fma_rows(acc[mt][nt], d[nt], sc[0], sc[1]);
                }
            }
        }
        cur = cur + 1 == S ? 0 : cur + 1;
    }
    cp_async_wait<0>();

    // the K slices: warps wk > 0 leave their sums in shared memory (the larger region beside the
    // table), warp wk = 0 of the tile adds them in slice order; then (CL > 1) the cluster's CTAs 1 ..
    // CL - 1 leave theirs after those, and CTA 0 adds them in rank order
    const u32 part = (tab - base >= end - tab_end) ? base : tab_end;
    const u32 tile = (u32)(ww * WR + wr);
    if constexpr (WK > 1 || CL > 1) {
        if (max(tab - base, end - tab_end) < (u32)(8 * G::kPart)) __trap();  // launcher bug
        __syncthreads();  // every warp is done with the ring
    }
    if constexpr (WK > 1) {
        if (wk > 0) {
            const u32 dst = part + (tile * (WK - 1) + wk - 1) * G::kPart + 4 * lane;
#pragma unroll
            for (int i = 0; i < 64; ++i) gm_sts_f32(dst + 128 * i, acc[i >> 4][(i >> 2) & 3][i & 3]);
        }
        __syncthreads();
        if (wk == 0)
            for (int q = 0; q < WK - 1; ++q) {
                const u32 src = part + (tile * (WK - 1) + q) * G::kPart + 4 * lane;
#pragma unroll
                for (int i = 0; i < 64; ++i) acc[i >> 4][(i >> 2) & 3][i & 3] += gm_lds_f32(src + 128 * i);
            }
    }
    if constexpr (CL > 1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        const u32 cpart = part + (8 - WW * WR + tile) * G::kPart + 4 * lane;
        if (blockIdx.z > 0 && wk == 0) {
#pragma unroll
            for (int i = 0; i < 64; ++i) gm_sts_f32(cpart + 128 * i, acc[i >> 4][(i >> 2) & 3][i & 3]);
        }
        gm_cluster_sync();  // every CTA's sums are in place
        if (blockIdx.z == 0 && wk == 0)
            for (u32 q = 1; q < (u32)CL; ++q) {
#pragma unroll
                for (int i = 0; i < 64; ++i) acc[i >> 4][(i >> 2) & 3][i & 3] += gm_ld_cluster_f32(cpart + 128 * i, q);
            }
        gm_cluster_sync();  // no CTA leaves while CTA 0 reads its shared memory
        if (blockIdx.z > 0) return;
#else
        __trap();  // launcher bug: clusters are sm_90
#endif
    }
    if (wk > 0) return;

    // C fragment of lane (g, c) for (mt, nt): weight rows 16 mt + g (+ 8), input rows 8 nt + 2 c (+ 1)
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = m0 + wr * 32 + nt * 8 + 2 * c + (e & 1);
                const i64 n = n0 + ww * 64 + mt * 16 + g + 8 * (e >> 1);
                if (r < rows && n < N) out[(i64)r * ldo + n] = T::from_f(acc[mt][nt][e]);
            }
}

}  // namespace qc
