// gemv_4bit for many input rows (prefill, batched serving): a tiled tensor-core GEMM that reads the
// bitsandbytes 4-bit layout directly (NF4 / FP4, with or without double quantization), fp16 / bf16
// activations, K % 64 == 0, blocksize >= 64. Semantics: quantcore/formats/bnb.py (gemv_4bit).
//
// Numerics: each weight element is dequantized exactly as dequantize_4bit does it (the block scale
// in fp32, code * scale in fp32, one rounding to T), then multiplied with mma.sync m16n8k16 (exact
// products, fp32 accumulation) and rounded to T once: the result is dequantize_4bit + a matmul with
// fp32 accumulation, up to the order of the fp32 additions.
//
// Design (docs/performance.md, "NF4 prefill"): a CTA owns a BM (input rows) x BN (weight rows)
// output tile and walks K in stages of 64 (one 64-element chunk of a weight row lies in one block).
// A ring of S shared-memory slots (as many as two CTAs per SM allow) holds each stage's activation tile (BM x 64, 16-byte
// cp.async, rows past the input zero-filled) and packed weight tile (BN x 32 bytes); one stage ahead
// of the tensor cores, every thread decodes its share of the packed tile (BN / 4 elements of one
// row, its block's scale data copied into the slot with the codes) into a bf16 / fp16 tile (two
// buffers): no global load waits inside the loop. The weight is
// read once per BM input rows; 8 warps (2 along M, 4 along N) take their fragments by ldmatrix.
#include "qc_common.cuh"

namespace qc {

constexpr int kGmThreads = QC_GM_THREADS;
constexpr int kGmPitch = QC_GM_PITCH;  // bytes per row of a 64-element T tile: 128 + 16 (ldmatrix rows on distinct banks)
static_assert(kGmThreads == 256 && kGmPitch == 144, "the warp layout and the fragment addressing below");

// shared memory of one (BM, BN, S): the ring, the two decoded weight tiles, the code tables
template <int BM, int BN, int S>
struct GmGeo {
    static constexpr int kA = BM * kGmPitch;          // activation tile of a stage
    static constexpr int kP = BN * 32;                // packed weight tile of a stage
    static constexpr int kS = BN * 8;                 // its rows' scale data: the absmax word, absmax2
    static constexpr int kSlot = kA + kP + kS;
    static constexpr int kW = BN * kGmPitch;          // one decoded weight tile
    static constexpr int kTables = 4 * (16 + kDynCodes);
    static constexpr int kBytes = S * kSlot + 2 * kW + kTables;
};

__device__ __forceinline__ void gm_ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void gm_ldsm_x2(u32 addr, u32& r0, u32& r1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];" : "=r"(r0), "=r"(r1) : "r"(addr));
}
// 4 bytes global -> shared through L1 (the scale data), src_size of them read, the rest zero-filled
__device__ __forceinline__ void gm_cp_async4(u32 dst, const void* src, u32 src_size) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_size) : "memory");
}
__device__ __forceinline__ void gm_sts_v4(u32 addr, u32 a, u32 b, u32 c, u32 d) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

// out[r, n] = T(sum_k a[r, k] * w[n, k]) for r < rows, n < N; out rows ldo elements apart.
template <typename T, int QT, bool NESTED, int BM, int BN, int S>
__global__ void __launch_bounds__(kGmThreads, 2) gemm_4bit_kernel(
    const u16* __restrict__ a, const u8* __restrict__ packed, const void* __restrict__ absmax,
    const float* __restrict__ absmax2, const float* __restrict__ code2, const float* __restrict__ offset,
    u16* __restrict__ out, i64 ldo, int rows, i64 N, i64 K, int log2bs) {
    using G = GmGeo<BM, BN, S>;
    static_assert(S >= 3, "stages kt + 1 .. kt + S - 2 are in flight while stage kt is multiplied");
    constexpr int MT = BM / 32;  // m16 tiles per warp (2 warps along M)
    constexpr int NT = BN / 32;  // n8 tiles per warp (4 warps along N)
    constexpr int EPT = BN / 4;  // weight elements each thread decodes per stage (64 BN / 256)
    constexpr int TPR = 64 / EPT;  // threads per weight row
    static_assert(MT >= 1 && NT >= 1 && (NT == 1 || NT % 2 == 0) && EPT % 8 == 0 && EPT <= 32,
                  "BM in {32, 64, 128}, BN in {32, 64, 128}");
    extern __shared__ __align__(128) u8 gm_smem[];
    require_dynamic_smem(G::kBytes);
    const u32 sbase = smem_addr(gm_smem);
    const u32 wbase = sbase + S * G::kSlot;
    float* lut = reinterpret_cast<float*>(gm_smem + S * G::kSlot + 2 * G::kW);
    float* c2 = lut + 16;
    const int tid = threadIdx.x, warp = tid >> 5, lane = lane_id();
    if (tid < 16) lut[tid] = code_4bit<QT>(tid);
    if (NESTED)
        for (int i = tid; i < kDynCodes; i += kGmThreads) c2[i] = ldg_f32(code2 + i);
    const float off = NESTED ? ldg_f32(offset) : 0.0f;

    const i64 m0 = (i64)blockIdx.y * BM, n0 = (i64)blockIdx.x * BN;
    const int KT = (int)(K >> 6);
    const i64 row_bytes = K >> 1;

    // copies of a stage: activation pieces (16 bytes) tid + 256 i; packed pieces tid (2 per row)
    constexpr int APT = BM * 8 / kGmThreads;
    const int arow0 = tid >> 3;  // piece i: row arow0 + 32 i, bytes 16 (tid % 8) of the stage's 128
    const u16* abase = a + m0 * K + 8 * (tid & 7);
    const int avalid = (int)min((i64)BM, (i64)rows - m0);
    // decode share: row dr of the tile, elements de .. de + EPT - 1 of the stage's 64; the row's
    // first thread copies the row's scale data of each stage (the block's absmax word: for nested
    // statistics the 4 aligned code bytes holding it, and its absmax2)
    const int dr = tid / TPR, de = (tid % TPR) * EPT;
    const i64 drow = min(n0 + dr, N - 1);
    const bool scopy = tid % TPR == 0;
    const i64 nblk = (N * K + (1LL << log2bs) - 1) >> log2bs;
    auto block_of = [&](int kt) { return (drow * K + ((i64)kt << 6)) >> log2bs; };
    const bool pcopy = tid < 2 * BN;
    const i64 prow = n0 + (tid >> 1);
    const u8* psrc = packed + (prow < N ? prow : 0) * row_bytes + 16 * (tid & 1);
    const u32 pok = prow < N ? 16u : 0u;
    auto issue = [&](int kt) {
        if (kt < KT) {
            const u32 slot = sbase + (kt % S) * G::kSlot;
#pragma unroll
            for (int i = 0; i < APT; ++i) {
                const int r = arow0 + 32 * i;
                const bool ok = r < avalid;
                cp_async16(slot + r * kGmPitch + 16 * (tid & 7), abase + (ok ? (i64)r * K : 0) + 64 * kt, ok ? 16u : 0u);
            }
            if (pcopy) cp_async16(slot + G::kA + 16 * tid, psrc + 32 * kt, pok);
            if (scopy) {
                const i64 b = block_of(kt);
                const u32 sdst = slot + G::kA + G::kP + 8 * dr;
                if constexpr (NESTED) {
                    const i64 w0 = b & ~3LL;
                    gm_cp_async4(sdst, reinterpret_cast<const u8*>(absmax) + w0, (u32)min((i64)4, nblk - w0));
                    gm_cp_async4(sdst + 4, absmax2 + (b >> kNestLog2), 4u);
                } else {
                    gm_cp_async4(sdst, reinterpret_cast<const float*>(absmax) + b, 4u);
                }
            }
        }
        cp_async_commit();  // one group per stage (empty past the end)
    };

    auto decode = [&](int kt) {
        const u32 slot = sbase + (kt % S) * G::kSlot;
        const u32 src = slot + G::kA + dr * 32 + de / 2;
        const u32 dst = wbase + (kt & 1) * G::kW + dr * kGmPitch + 2 * de;
        u32 raw, s2;
        asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(raw), "=r"(s2) : "r"(slot + G::kA + G::kP + 8 * dr));
        float sc;
        if constexpr (NESTED) {
            const u32 q = (raw >> (8 * (u32)(block_of(kt) & 3))) & 0xffu;
            sc = __fadd_rn(__fmul_rn(c2[q], __uint_as_float(s2)), off);
        } else {
            sc = __uint_as_float(raw);
        }
        u32 w[EPT / 8];
        if constexpr (EPT == 32) {
            lds_v4(src, w[0], w[1], w[2], w[3]);
        } else if constexpr (EPT == 16) {
            asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "r"(src));
        } else {
            asm volatile("ld.shared.u32 %0, [%1];" : "=r"(w[0]) : "r"(src));
        }
#pragma unroll
        for (int j = 0; j < EPT / 8; ++j) {
            u32 o[4];
#pragma unroll
            for (int i = 0; i < 4; ++i)
                o[i] = T::pack2(__fmul_rn(lut[(w[j] >> (8 * i + 4)) & 15u], sc), __fmul_rn(lut[(w[j] >> (8 * i)) & 15u], sc));
            gm_sts_v4(dst + 16 * j, o[0], o[1], o[2], o[3]);
        }
    };

    // fragments: warp (wm, wn) owns rows wm BM/2 .. and weight rows wn BN/4 ..
    const int wm = warp >> 2, wn = warp & 3;
    const u32 a_lane = (u32)((wm * (BM / 2) + (lane & 7) + ((lane >> 3) & 1) * 8) * kGmPitch + (lane >> 4) * 16);
    const u32 b_lane = NT >= 2 ? (u32)((wn * (BN / 4) + (lane & 7) + ((lane >> 4) << 3)) * kGmPitch + ((lane >> 3) & 1) * 16)
                               : (u32)((wn * (BN / 4) + (lane & 7)) * kGmPitch + ((lane >> 3) & 1) * 16);
    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;

    for (int s = 0; s < S - 1; ++s) issue(s);
    cp_async_wait<S - 2>();
    __syncthreads();  // stage 0 and the tables
    decode(0);

    for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<S - 3>();  // this thread's copies of stages <= kt + 1
        __syncthreads();  // everyone's copies and decode(kt) visible; stage kt - 1 fully consumed
        issue(kt + S - 1);
        if (kt + 1 < KT) decode(kt + 1);
        const u32 as = sbase + (kt % S) * G::kSlot + a_lane;
        const u32 bs = wbase + (kt & 1) * G::kW + b_lane;
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
            u32 af[MT][4], bf[NT][2];
#pragma unroll
            for (int i = 0; i < MT; ++i) gm_ldsm_x4(as + i * 16 * kGmPitch + 32 * ks, af[i][0], af[i][1], af[i][2], af[i][3]);
            if constexpr (NT >= 2) {
#pragma unroll
                for (int j = 0; j < NT; j += 2)
                    gm_ldsm_x4(bs + j * 8 * kGmPitch + 32 * ks, bf[j][0], bf[j][1], bf[j + 1][0], bf[j + 1][1]);
            } else {
                gm_ldsm_x2(bs + 32 * ks, bf[0][0], bf[0][1]);
            }
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int j = 0; j < NT; ++j) mma_16816<T>(acc[i][j], af[i], bf[j][0], bf[j][1]);
        }
    }
    cp_async_wait<0>();

    // C fragment of lane (g, c): rows g and g + 8 of an m16 tile, weight rows 2c, 2c + 1 of an n8 tile
    const int g = lane >> 2, c = lane & 3;
    const bool pairs = (ldo & 1) == 0 && (reinterpret_cast<u64>(out) & 3) == 0;  // 4-byte stores of two columns
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const i64 n = n0 + wn * (BN / 4) + j * 8 + 2 * c;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const i64 r = m0 + wm * (BM / 2) + i * 16 + g + 8 * h;
                if (r >= rows) continue;
                u16* o = out + r * ldo + n;
                const float v0 = acc[i][j][2 * h], v1 = acc[i][j][2 * h + 1];
                if (pairs && n + 1 < N) {
                    *reinterpret_cast<u32*>(o) = T::pack2(v0, v1);
                } else {
                    if (n < N) o[0] = T::from_f(v0);
                    if (n + 1 < N) o[1] = T::from_f(v1);
                }
            }
        }
}

}  // namespace qc
