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
#include "mx_common.cuh"  // hmul2: the pair times its block scale
#include "wgmma.cuh"

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
// A ring of S slots of `slot` bytes around a pair table of `table` bytes at a multiple of its size, in
// [base, end): the table where it leaves the most slots before and after it; tab its address, nf the
// slots before it (at most S). Traps where fewer than S fit (a launcher bug: it sizes S for the
// window's worst start).
__device__ __forceinline__ void place_table(u32 base, u32 end, u32 table, u32 slot, int S, u32& tab, int& nf) {
    int most = -1;
    tab = 0;
    nf = 0;
    for (u32 b = (base + table - 1) & ~(table - 1); b + table <= end; b += table) {
        const int f = (int)((b - base) / slot), r = (int)((end - b - table) / slot);
        if (f + r > most) {
            most = f + r;
            tab = b;
            nf = f;
        }
    }
    if (most < S) __trap();
    nf = min(nf, S);
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// clusters (sm_90): the K slices of a tile over CL CTAs, added through distributed shared memory
// (qc_common.cuh cluster_sync, ld_cluster_*)
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
    u32 tab;
    int nf;
    place_table(base, end, kGmTable, G::kSlot, S, tab, nf);
    const u32 tab_end = tab + kGmTable;
    auto slot_addr = [&](int s) -> u32 { return s < nf ? base + s * G::kSlot : tab_end + (s - nf) * G::kSlot; };

    const int tid = threadIdx.x, warp = tid >> 5, lane = lane_id(), g = lane >> 2, c = lane & 3;
    // the pair table: entry (byte, lane) at tab + 256 byte + 4 lane; the code2 copy in the rows'
    // free halves (value i at row i / 32, byte 128 + 4 (i % 32))
    fill_pair_table<T, QT>(tab, tid, kGmThreads);
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
                        gm_sts_f32(sbase + 8 * e, nested_absmax(c2v, __uint_as_float(s2), off));
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
        cluster_sync();  // every CTA's sums are in place
        if (blockIdx.z == 0 && wk == 0)
            for (u32 q = 1; q < (u32)CL; ++q) {
#pragma unroll
                for (int i = 0; i < 64; ++i) acc[i >> 4][(i >> 2) & 3][i & 3] += ld_cluster_f32(cpart + 128 * i, q);
            }
        cluster_sync();  // no CTA leaves while CTA 0 reads its shared memory
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


// -- many rows on Hopper's warpgroup MMA (sm_90a) ------------------------------------------------------
// gemm_4bit_wgmma_tma_kernel (below): the same operation for 128+ input rows (docs/performance.md, "NF4
// prefill on wgmma" and NPW-13). The weight is wgmma's A operand from registers (64 weight rows per
// warpgroup), the input its B operand from shared memory (NB = 128 or 256 input rows, K-major in the
// 128-byte swizzle, copied raw); a CTA is 2 warpgroups = 128 weight rows x NB input rows and walks K in
// 64-element stages through an S-deep ring loaded by TMA (the stage's input tile in a slot, the packed
// codes of its weight rows in a code slot). Thread (g, t) of a warp needs, per weight row and stage, byte t
// of each of the row's 8 code words (the A fragment's k = 16 s + 2 t, 2 t + 1 and 16 s + 8 + 2 t, + 9): one
// byte_perm forms the address of its entry in a per-lane pair table (64 KiB at a 64 KiB boundary), one
// load gives T(hi), T(lo), one fp16x2 / bf16x2 multiply by the row's block scale in T gives the operand:
// B = T(code) x T(absmax) rounded in T, the arithmetic bitsandbytes' kernels do (the conformance bound of
// gemv_4bit allows 4 roundings in T per term; this takes 3, then exact products summed in fp32). The next
// stage's operands are decoded while the current stage's MMAs run; scales are loaded from global memory
// two stages ahead (through the ring they measured slower: NPW-4). Values worked out once per CTA go
// through keep() (NPW-5). The epilogue goes through shared memory (the table's space) in parts of 64
// input rows, stored as 16-byte rows where the output allows. (The first form of this kernel, session 22,
// copied the stages by cp.async behind a CTA barrier per stage; the TMA ring, 4-7% faster with the same
// bits, replaced it in session 25 and it was deleted in session 26.)
constexpr int kGwThreads = QC_GW_THREADS;  // two warpgroups
constexpr u32 kGwSmem = QC_GW_SMEM;
constexpr int kGwTable = kGmTable;  // the same pair table as gemm_4bit_kernel's (its free halves: the codes)
static_assert(kGwThreads == 256, "two warpgroups");

// one ring slot of an NB CTA: the input tile (NB rows x 128 bytes, swizzled); the codes of its 128
// weight rows (32 bytes each) go in a code slot of their own (kWtCodes);
// quantcore.formats.kernel_defines.gw_slot_bytes. (Two m64 tiles per warpgroup do not fit the
// registers with the fragments double-buffered: ptxas serializes the MMAs.)
template <int NB>
struct GwGeo {
    static_assert(NB == 128 || NB == 256, "m64n128 / m64n256 MMAs");
    static constexpr int kRowsW = QC_GW_ROWS;  // 2 warpgroups x m64
    static constexpr int kB = NB * 128;
    static constexpr int kSlot = kB;
    static_assert(kSlot % 1024 == 0, "swizzled tiles 1024-byte aligned");
};
// x, opaque to the compiler from here on: kept in a register instead of recomputed where it is used
template <typename V>
__device__ __forceinline__ V keep(V x) {
    if constexpr (sizeof(V) == 8) {
        u64 v = (u64)x;
        asm volatile("" : "+l"(v));
        return (V)v;
    } else {
        u32 v = (u32)x;
        asm volatile("" : "+r"(v));
        return (V)v;
    }
}

// The wgmma GEMM's end of a tile, after its stages are consumed: the tile staged through the pair table's
// free halves in parts of 64 input rows and stored as 16-byte rows where the output allows (the ring may
// hold the next tile's stages already: a persistent grid). With CL > 1 (one tile a CTA) the CTAs of a cluster share the parts (part h is CTA h CL / parts' own): each
// leaves the sums of the parts it does not own at base + 16 (256 jn + tid) (a thread's 4 sums of fragment
// column block jn), then adds the K slices' sums of its own parts in rank order (the same fp32 additions
// in the same order whichever CTA makes them: the same bits) and stores them.
template <typename T, int NB, int CL>
__device__ __forceinline__ void gw_finish(float (&acc)[NB / 2], u32 base, u32 tab, u16* __restrict__ out, i64 ldo,
                                          int rows, i64 N, int m0, i64 n0) {
    constexpr int NA = NB / 2;
    const int tid = threadIdx.x, warp = tid >> 5, lane = lane_id();
    const int wg = warp >> 2, wi = warp & 3;
    constexpr int kParts = NB / 64;  // staged parts of 64 input rows: fragment column blocks 8 h .. 8 h + 7
    const int rank = CL > 1 ? (int)blockIdx.z : 0;
    auto owns = [&](int h) { return h * CL / kParts == rank; };
    if constexpr (CL > 1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        static_assert(NA * kGwThreads * 4 + kDynCodes * 4 + 1024 <= QC_GW_SMEM, "the partial sums fit");
        __syncthreads();  // every warpgroup's MMAs done: the partial sums overwrite the ring
#pragma unroll
        for (int jn = 0; jn < NB / 8; ++jn)
            if (!owns(jn / 8))
                asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(base + 16 * (kGwThreads * jn + tid)),
                             "f"(acc[4 * jn]), "f"(acc[4 * jn + 1]), "f"(acc[4 * jn + 2]), "f"(acc[4 * jn + 3])
                             : "memory");
        cluster_sync();  // every CTA's sums are in place
#pragma unroll
        for (int h = 0; h < kParts; ++h) {
            if (!owns(h)) continue;
            // the part's sums in rank order: ((p0 + p1) + ...) + p_rank (its own, in acc: t + acc is acc + t,
            // bit for bit) + p_rank+1 + ...; 8 remote loads in flight
            auto load = [&](int q, float(&v)[8][4]) {
#pragma unroll
                for (int x = 0; x < 8; ++x) ld_cluster_v4(base + 16 * (kGwThreads * (8 * h + x) + tid), (u32)q, v[x]);
            };
            float v[8][4];
            if (rank > 0) {
                float t[8][4];
                load(0, t);
                for (int q = 1; q < rank; ++q) {
                    load(q, v);
#pragma unroll
                    for (int x = 0; x < 8; ++x)
#pragma unroll
                        for (int e = 0; e < 4; ++e) t[x][e] += v[x][e];
                }
#pragma unroll
                for (int x = 0; x < 8; ++x)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[4 * (8 * h + x) + e] = t[x][e] + acc[4 * (8 * h + x) + e];
            }
            for (int q = rank + 1; q < CL; ++q) {
                load(q, v);
#pragma unroll
                for (int x = 0; x < 8; ++x)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[4 * (8 * h + x) + e] += v[x][e];
            }
        }
        cluster_sync();  // no CTA leaves or stages while another reads its shared memory
#endif
    }
    // staging: part h's 64 input rows x 128 weight rows (16 columns of 16 bytes a row) in the table's free
    // halves (byte 128 .. 255 of each 256, untouched by the decode), row r's column c in free half
    // 128 (h & 1) + 2 r + c / 8 at column (c % 8) ^ (r % 8): conflict-free both ways; alternate parts in
    // alternate halves of the table, so one barrier a part (a part's staging waits for nobody still
    // reading the part before it). stmatrix.trans writes the accumulator's 8 x 8 blocks (weight rows g,
    // input rows 2 t, 2 t + 1 of a thread) transposed: input row major.
    auto staged = [&](int h, int r, int c) -> u32 {
        return tab + 256u * (u32)(128 * (h & 1) + 2 * r + (c >> 3)) + 128u + 16u * (u32)((c & 7) ^ (r & 7));
    };
    const bool vec = (((u64)out | (u64)(ldo * 2)) & 15u) == 0;
#pragma unroll
    for (int h = 0; h < kParts; ++h) {
        if (!owns(h)) continue;  // (uniform: the CTA's rank)
        {
            const int mm = lane >> 3, j = lane & 7;  // the block and row this lane addresses
#pragma unroll
            for (int p = 0; p < 4; ++p) {  // fragment column blocks jn = 8 h + 2 p, + 1; weight row halves 0, 1
                const int jn = 8 * h + 2 * p;
                const u32 addr = staged(h, 8 * (2 * p + (mm >> 1)) + j, wg * 8 + wi * 2 + (mm & 1));
                asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                             ::"r"(addr), "r"(T::pack2(acc[4 * jn], acc[4 * jn + 1])),
                             "r"(T::pack2(acc[4 * jn + 2], acc[4 * jn + 3])),
                             "r"(T::pack2(acc[4 * jn + 4], acc[4 * jn + 5])),
                             "r"(T::pack2(acc[4 * jn + 6], acc[4 * jn + 7])) : "memory");
            }
        }
        __syncthreads();
#pragma unroll
        for (int i = tid; i < 64 * 16; i += kGwThreads) {
            const int r = i >> 4, c = i & 15;
            const int gr = m0 + 64 * h + r;
            const i64 gn = n0 + 8 * c;
            if (gr >= rows || gn >= N) continue;
            u32 w0, w1, w2, w3;
            lds_v4(staged(h, r, c), w0, w1, w2, w3);
            u16* o = out + (i64)gr * ldo + gn;
            if (vec && gn + 8 <= N) {
                stg_v4(o, w0, w1, w2, w3);
            } else {
                const u32 w[4] = {w0, w1, w2, w3};
#pragma unroll
                for (int k = 0; k < 8; ++k)
                    if (gn + k < N) o[k] = (u16)(w[k >> 1] >> (16 * (k & 1)));
            }
        }
    }
}

// The raw scale data of stage st (clamped to the CTA's nst stages; a CTA of a cluster may have none when
// K is short) of a thread's two weight rows, whose first chunk indices are rch: the absmax bits, or the
// nested byte and its absmax2.
template <bool NESTED>
__device__ __forceinline__ void gw_load_scales(int st, int nst, const u32 (&rch)[2], int bsh, const void* absmax,
                                               const float* absmax2, u32 (&raw)[2], float (&s2)[2]) {
    st = max(min(st, nst - 1), 0);
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const u32 b = (rch[rr] + (u32)st) >> bsh;
        if constexpr (NESTED) {
            raw[rr] = ldg_u8(reinterpret_cast<const u8*>(absmax) + b);
            s2[rr] = ldg_f32(absmax2 + (b >> kNestLog2));
        } else {
            raw[rr] = ldg_u32(reinterpret_cast<const float*>(absmax) + b);
        }
    }
}

// The A fragments of a stage from its codes in shared memory: register (k16 step s, 2 hh + rr) = the pair
// of byte t of row rr's code word 2 s + hh (row rr's two 16-byte chunks at slot + dofs0 / dofs1 + 256 rr:
// rows g and g + 8 of the warp's 16), times the row's block scale (raw / s2: gw_load_scales).
template <typename T, bool NESTED>
__device__ __forceinline__ void gw_decode(u32 slot, u32 dofs0, u32 dofs1, const u32 (&raw)[2], const float (&s2)[2],
                                          float off, u32 c2s, u32 lutx, u32 sel, u32 (&af)[4][4]) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        u32 q[8];
        lds_v4(slot + dofs0 + 256 * rr, q[0], q[1], q[2], q[3]);
        lds_v4(slot + dofs1 + 256 * rr, q[4], q[5], q[6], q[7]);
        const float sc = NESTED ? nested_absmax(gm_lds_f32(c2s + 4 * raw[rr]), s2[rr], off) : __uint_as_float(raw[rr]);
        const u32 s2x = T::pack2(sc, sc);
#pragma unroll
        for (int w = 0; w < 8; ++w) af[w >> 1][2 * (w & 1) + rr] = qcmx::hmul2<T::kBf16>(pair_lut_sel(q[w], lutx, sel), s2x);
    }
}

// The stages by TMA: thread 0 issues, per stage, one TMA of the input tile (128-byte swizzle) and one of
// the stage's codes of the 128 weight rows (32 bytes a row, 32-byte swizzle: row r's 16-byte half c at
// 32 r + 16 (c ^ bit 2 of r)) into an S-deep ring of full / empty mbarriers. The warps wait for a stage's
// full barrier, decode and multiply, and release a slot (one arrival per warp) once their MMAs of it are
// done; thread 0 refills it once all have (a producer warp of its own would be a ninth warp: 3 warps on
// one scheduler leave 168 registers a thread, and the MMA warps spill there). No cp.async and no CTA
// barrier in the loop. maps: the two CUtensorMaps (input [rows, K] u16, box 64 x NB; codes [N, K / 2] u8,
// box 32 x 128) by value (backends/cuda/bnb.py _input_map / _codes_map, runtime.tensor_map_2d).
constexpr int kWtThreads = kGwThreads;
// two CUtensorMaps passed by value (a __grid_constant__ parameter: the TMAs read them in parameter space)
struct alignas(64) TmaMaps2 {
    u64 m0[16];
    u64 m1[16];
};
constexpr int kWtCodes = QC_GW_STAGE_CODES;  // a stage's codes: 64 elements of each weight row
constexpr int kWtMaxStages = QC_GWT_MAX_STAGES;  // (the barriers' space: 16 bytes a stage)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void wt_tma2d(u32 dst, const void* map, int c0, int c1, u32 bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                 ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}
#endif
template <typename T, int QT, bool NESTED, int NB, int S, int CL = 1>
__global__ void QC_GM_CLUSTER(CL) __launch_bounds__(kWtThreads, 1) gemm_4bit_wgmma_tma_kernel(
    const u16* __restrict__ a, const u8* __restrict__ packed, const void* __restrict__ absmax,
    const float* __restrict__ absmax2, const float* __restrict__ code2, const float* __restrict__ offset,
    u16* __restrict__ out, i64 ldo, int rows, i64 N, i64 K, int log2bs, const __grid_constant__ TmaMaps2 maps) {
#if defined(QC_HAS_WGMMA)
    using G = GwGeo<NB>;
    constexpr int NA = NB / 2;
    constexpr bool kF16 = !T::kBf16;
    static_assert(S >= 3 && S <= kWtMaxStages, "stages");
    extern __shared__ __align__(1024) u8 gw_smem[];
    require_dynamic_smem(kGwSmem);
    // the window: the stages' codes at its start (1024-byte aligned), then the input slots around the pair
    // table, the barriers, code2's copy at its end (the launcher sizes S for the worst start)
    const u32 base = (smem_addr(gw_smem) + 1023u) & ~1023u;
    const u32 c2s = (smem_addr(gw_smem) + kGwSmem - 4 * kDynCodes) & ~15u;
    const u32 full = c2s - 16 * kWtMaxStages, empty = full + 8 * kWtMaxStages;
    const u32 codes = base, sbase = base + S * kWtCodes;  // (the codes first: the table's alignment
    u32 tab;                                                // wastes less space after them)
    int nf;
    place_table(sbase, full & ~15u, kGwTable, G::kSlot, S, tab, nf);
    const u32 tab_end = tab + kGwTable;
    auto slot_of = [&](int i) -> u32 { return i < nf ? sbase + i * G::kSlot : tab_end + (i - nf) * G::kSlot; };

    const int tid = threadIdx.x, warp = tid >> 5, lane = lane_id(), g = lane >> 2, t = lane & 3;
    fill_pair_table<T, QT>(tab, tid, kWtThreads);
    if (NESTED)
        for (int i = tid; i < kDynCodes; i += kWtThreads) gm_sts_f32(c2s + 4 * i, ldg_f32(code2 + i));
    // the tiles (NB input rows x 128 weight rows), x fastest: CTA x takes tiles x, x + gridDim.x, ... (a
    // grid of one CTA per tile, or a persistent one: then its ring runs on from one tile's stages into
    // the next's, and the table is filled once)
    const int mt = (rows + NB - 1) / NB;
    const int ntiles = mt * (int)((N + G::kRowsW - 1) / G::kRowsW);
    // (a cluster's CTAs take one tile each: the launcher's grid; known here, so the loop compiles out)
    const int mine = CL > 1 ? 1 : (int)blockIdx.x < ntiles ? (ntiles - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    const int sbeg = (int)((K >> 6) * blockIdx.z / CL);
    const int nst = (int)((K >> 6) * (blockIdx.z + 1) / CL) - sbeg;  // a tile's stages in this CTA
    const int total = mine * nst;                                    // the ring's items: tile i stage s = i nst + s
    auto tile_m0 = [&](int i) -> int { return ((int)blockIdx.x + i * (int)gridDim.x) % mt * NB; };
    auto tile_n0 = [&](int i) -> i64 { return (i64)(((int)blockIdx.x + i * (int)gridDim.x) / mt) * G::kRowsW; };
    const void* tma = &maps.m0;
    const void* tmc = &maps.m1;
    // thread 0's next item to load (tile li, stage ls), loaded in order
    int li = 0, ls = 0, lm0 = tile_m0(0);
    i64 ln0 = tile_n0(0);
    auto load_next = [&]() {  // item li nst + ls into ring entry (li nst + ls) % S
        const int e = (li * nst + ls) % S;
        const u32 bar = full + 8 * e;
        mbar_expect_tx(bar, G::kB + kWtCodes);
        wt_tma2d(slot_of(e), tma, 64 * (sbeg + ls), lm0, bar);
        wt_tma2d(codes + e * kWtCodes, tmc, 32 * (sbeg + ls), (int)ln0, bar);
        if (++ls == nst) {
            ls = 0;
            ++li;
            lm0 = tile_m0(li);
            ln0 = tile_n0(li);
        }
    };
    if (tid == 0) {
        for (int i = 0; i < S; ++i) {
            mbar_init(full + 8 * i, 1);   // thread 0's arrival (and the stage's bytes)
            mbar_init(empty + 8 * i, 8);  // the warps'
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (int q = 0; q < S && q < total; ++q) load_next();
    }
    __syncthreads();  // the tables, code2 and the barriers
    float acc[NA];
    const int wg = warp >> 2, wi = warp & 3;
    const int bsh = log2bs - 6;
    const float off = NESTED ? ldg_f32(offset) : 0.0f;
    const u32 lutx = keep(tab | (4u * (u32)lane)), sel = keep(0x7604u | ((u32)t << 4));
    const int drow = wg * 64 + wi * 16 + g;
    const u32 dsw = ((drow >> 2) & 1) << 4;
    const u32 dofs0 = keep(drow * 32 + dsw), dofs1 = keep(drow * 32 + (16 ^ dsw));
    auto decode = [&](u32 cslot, const u32(&raw)[2], const float(&s2)[2], u32(&af)[4][4]) {
        gw_decode<T, NESTED>(cslot, dofs0, dofs1, raw, s2, off, c2s, lutx, sel, af);  // (row g + 8: 8 rows on)
    };
    // an item's release (one arrival per warp) and, by thread 0 once every warp's is in, its entry's
    // refill with the item S on
    auto release = [&](int q) {
        const int e = q % S;
        __syncwarp();
        if (lane == 0) mbar_arrive(empty + 8 * e);
        if (tid == 0 && q + S < total) {
            mbar_wait(empty + 8 * e, (u32)(q / S) & 1u);
            load_next();
        }
        __syncwarp();
    };
    int ri = 0;   // the ring entry of the stage multiplied next
    u32 rph = 0;  // its full barrier's parity
    // this thread's weight rows of tile i: rr -> tile row wg 64 + wi 16 + g + 8 rr; their first 64-element
    // chunks over the whole weight (rows past N read row N - 1; N K / 64 < 2^31, the launcher checks)
    u32 rch[2];
    auto set_rows = [&](int i) {
        const i64 n0 = tile_n0(i);
#pragma unroll
        for (int rr = 0; rr < 2; ++rr)
            rch[rr] = keep((u32)(min(n0 + wg * 64 + wi * 16 + g + 8 * rr, N - 1) * (K >> 6)) + (u32)sbeg);
    };
    // the raw scale data of a stage (absmax bits, or the nested byte and absmax2), two stages in flight;
    // a tile's first two are loaded before it starts (the next tile's while this one's end is stored)
    u32 sraw[2][2];
    float ss2[2][2];
    auto load_scales = [&](int st, u32(&raw)[2], float(&s2)[2]) {
        gw_load_scales<NESTED>(st, nst, rch, bsh, absmax, absmax2, raw, s2);
    };
    set_rows(0);
    load_scales(0, sraw[0], ss2[0]);
    load_scales(1, sraw[1], ss2[1]);
    for (int i = 0; i < mine; ++i) {
        const int m0 = tile_m0(i);
        const i64 n0 = tile_n0(i);
        const int q0 = i * nst;  // the tile's first item
#pragma unroll
        for (int x = 0; x < NA; ++x) acc[x] = 0.0f;
        u32 af[2][4][4];
        if (nst > 0) mbar_wait(full + 8 * ri, rph);
        decode(codes + ri * kWtCodes, sraw[0], ss2[0], af[0]);
        load_scales(2, sraw[0], ss2[0]);
#define QC_GWT_STEP(P, J)                                                                                  \
    {                                                                                                     \
        const int j_ = (J);                                                                               \
        fence_acc(acc);                                                                                   \
        wgmma_fence();                                                                                    \
        const u64 desc0 = desc_sw128(slot_of(ri));                                                        \
        _Pragma("unroll") for (int s = 0; s < 4; ++s) wgmma_rs<kF16>(acc, af[P][s], desc0 + 2u * s);      \
        wgmma_commit();                                                                                   \
        fence_acc(acc);                                                                                   \
        if (++ri == S) {                                                                                  \
            ri = 0;                                                                                       \
            rph ^= 1u;                                                                                    \
        }                                                                                                 \
        if (j_ + 1 < nst) {                                                                               \
            wgmma_wait<1>(); /* stage j - 1's MMAs: its slot is free */                                   \
            fence_acc(acc);                                                                               \
            if (j_ > 0) release(q0 + j_ - 1);                                                             \
            mbar_wait(full + 8 * ri, rph);                                                                \
            _Pragma("unroll") for (int s = 0; s < 4; ++s) _Pragma("unroll") for (int x = 0; x < 4; ++x)   \
                asm volatile("" : "+r"(af[1 - P][s][x])::"memory");                                       \
            decode(codes + ri * kWtCodes, sraw[1 - P], ss2[1 - P], af[1 - P]);                            \
            load_scales(j_ + 3, sraw[1 - P], ss2[1 - P]);                                                 \
        }                                                                                                 \
    }
        for (int j = 0; j < nst; j += 2) {
            QC_GWT_STEP(0, j)
            if (j + 1 < nst) QC_GWT_STEP(1, j + 1)
        }
#undef QC_GWT_STEP
        wgmma_wait<0>();
        fence_acc(acc);
        if (i + 1 < mine) {  // (persistent) the next tile's first scales; the tile's last two items released:
            set_rows(i + 1);  // the next tile's stages load
            load_scales(0, sraw[0], ss2[0]);
            load_scales(1, sraw[1], ss2[1]);
            if (nst > 1) release(q0 + nst - 2);
            if (nst > 0) release(q0 + nst - 1);
        }
        gw_finish<T, NB, CL>(acc, base, tab, out, ldo, rows, N, m0, n0);
    }
#else
    __trap();
#endif
}

}  // namespace qc
