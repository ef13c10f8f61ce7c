// gemv_4bit on sm_90: the 4-bit weights streamed through shared memory by asynchronous copies,
// decoded by table lookups into tensor-core fragments. Semantics: quantcore/formats/bnb.py
// (gemv_4bit); numerics as the mma kernel of bnb_4bit.cu: T(code) is the only rounding before the
// fp32 products, the absmax scale multiplies each super-piece's fp32 mma result.
#include "qc_common.cuh"

namespace qc {

// Why this kernel (docs/performance.md, gemv versions 13-16): the register-fed mma kernel of
// bnb_4bit.cu stays at ~40% of the copy bandwidth, with the bytes in flight bounded by its
// registers. Here each of 16 warps owns a ring of kGvStages shared-memory slots of 16 rows x kGvKC
// elements, filled by 16-byte cp.async copies (8 per lane and slot, no registers held while in
// flight). 1-D bulk copies (TMA), one per row and slot, were slower: a warp issues them one lane at
// a time (about ten instructions each) and the copy engine takes tens of ns per small copy.
//
// Work: CTA b owns the 16-row tiles [ntiles b / G, ntiles (b + 1) / G) (G = gridDim.x, at most the
// multiprocessor count: the tiles of any shape spread evenly), taken in groups of
// kGvWarps / ksplit; a unit is (group, stage). In a group, warp w takes tile w / ksplit and K slice
// w % ksplit (super-pieces [nsp * ks / ksplit, nsp * (ks + 1) / ksplit)), cut into stages. Each
// warp's ring runs across group boundaries; at the end of a group the K slices of a tile are added
// in a fixed order through shared memory (deterministic, no workspace).
//
// Layout of a slot: row i of the tile at i * PITCH (PITCH = kGvKC / 2 plus 32 bytes for 8-byte
// lane reads, 16 for 4-byte ones: the 8 rows read by one instruction then fall on distinct banks).
// The lane mapping of a super-piece is the one of the bnb_4bit.cu mma kernel (its comment).
// Shared memory: the 64 KiB pair table, the rings (147 KiB) and 9 KiB of small arrays: one CTA
// per multiprocessor, 16 warps, 128 registers each (so the mma groups are not unrolled).
constexpr int kGvWarps = 16;
constexpr int kGvStages = 2;
constexpr int kGvKC = 512;  // elements of a row per stage
constexpr int kGvU = 2;     // super-pieces per mma group (independent mma chains)
constexpr int kGvSc = 4;    // super-pieces per scale round (one per quad lane)
constexpr int kGvLutWords = 256 * 64;

template <int V>
struct GvGeo {
    static constexpr int kSps = kGvKC / (8 * V);  // super-pieces per stage: 8 (V = 8) or 16 (V = 4)
    static constexpr int kSpLog2 = ilog2(8 * V);  // log2 of a super-piece's 8 V elements
    static_assert(8 * V == 1 << kSpLog2, "a super-piece is 8 V elements");
    static constexpr int kGroups = kSps / kGvU;
    static constexpr int kRounds = kSps / kGvSc;
    static constexpr int kPitch = kGvKC / 2 + (V == 8 ? 32 : 16);
    static constexpr int kSlot = 16 * kPitch;
    // LUT, code2 table, reduction tiles, slots (the launcher computes the same sum)
    static constexpr int kSmem = 4 * kGvLutWords + 4 * kDynCodes + 4 * kGvWarps * 128 + kGvWarps * kGvStages * kSlot;
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#endif

// Byte J of word w looked up in the lane's copy of the pair table: lutx is the table's shared
// address (a multiple of 64 KiB) plus lane * 4, so one byte_perm forms the whole address
// (table + byte * 256 + lane * 4) and one 32-bit shared load reads the T pair.
template <int J, int DBG = 0>
__device__ __forceinline__ u32 gv_pair(u32 w, u32 lutx) {
    if (DBG == 1) return __byte_perm(w, lutx, 0x7604u | (J << 4));  // timing only: no table load
    u32 r;
    asm("ld.shared.b32 %0, [%1];" : "=r"(r) : "r"(__byte_perm(w, lutx, 0x7604u | (J << 4))));
    return r;
}

// p ? a : b as one selp the compiler cannot turn back into an indexed local array
__device__ __forceinline__ float gv_select(bool p, float a, float b) {
    float r;
    asm("{ .reg .pred q; setp.ne.s32 q, %3, 0; selp.f32 %0, %1, %2, q; }" : "=f"(r) : "f"(a), "f"(b), "r"((int)p));
    return r;
}

// DBG (timing experiments only, never launched by the backend; tools/dev/gemv_time.py): 1 decodes
// without the table load (the byte_perm's result is the pair), 2 issues no copies (the slots keep
// what they hold), 3 runs no mma groups (the copies, the scales and the bookkeeping only), 4 runs
// no mma (two XORs per mma instead keep the decode and the activations live).
template <typename T, int QT, bool NESTED, int V, int DBG = 0>
__global__ void __launch_bounds__(kGvWarps * 32, 1) gemv_4bit_stream_kernel(
    const u16* __restrict__ a, const u8* __restrict__ packed, const void* __restrict__ absmax,
    const float* __restrict__ absmax2, const float* __restrict__ code2, const float* __restrict__ offset,
    u16* __restrict__ out, int batch, i64 N, i64 K, int log2bs, int ksplit) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    using G = GvGeo<V>;
    constexpr int S = kGvStages, SPS = G::kSps;
    constexpr u32 kSmall = 4 * kDynCodes + 4 * kGvWarps * 128;  // code2, reduction
    constexpr u32 kRing = S * G::kSlot;
    extern __shared__ __align__(16) u8 gv_smem[];
    // The table must sit at a shared address that is a multiple of 64 KiB (gv_pair); what lies
    // before that boundary in the dynamic region holds the small arrays and as many warp rings as
    // fit, the rest follows the table. The launcher grants the device's maximum.
    const u32 front = (0u - smem_addr(gv_smem)) & 0xffffu;
    u8* lut = gv_smem + front;
    u8* small = front >= kSmall ? gv_smem : lut + 65536;
    u8* ring_front = front >= kSmall ? gv_smem + kSmall : gv_smem;
    const int nfront = min((int)((front >= kSmall ? front - kSmall : front) / kRing), kGvWarps);
    u8* ring_back = lut + 65536 + (front >= kSmall ? 0 : kSmall);
    {
        u32 dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if ((u32)(ring_back + (kGvWarps - nfront) * kRing - gv_smem) > dyn) __trap();  // launcher bug
    }
    float* c2 = reinterpret_cast<float*>(small);       // [kDynCodes]
    float* red = c2 + kDynCodes;                       // [kGvWarps][16][8]

    const int warp = threadIdx.x >> 5, lane = lane_id(), g = lane >> 2, c = lane & 3;
    {
        u32* lw = reinterpret_cast<u32*>(lut);  // [256][64], words 0..31 used
        for (int i = threadIdx.x; i < 256 * 32; i += blockDim.x) {
            const int byte = i >> 5;
            lw[byte * 64 + (i & 31)] = T::pack2(code_4bit<QT>(byte >> 4), code_4bit<QT>(byte & 15));
        }
    }
    if (NESTED)
        for (int i = threadIdx.x; i < kDynCodes; i += blockDim.x) c2[i] = ldg_f32(code2 + i);
    u8* wring_p = warp < nfront ? ring_front + warp * kRing : ring_back + (warp - nfront) * kRing;
    const u32 wring = smem_addr(wring_p);
    __syncthreads();
    const float off = NESTED ? ldg_f32(offset) : 0.0f;
    const u32 lutx = smem_addr(lut) | (4u * (u32)lane);

    const int tpc = kGvWarps / ksplit, tslot = warp / ksplit, ks = warp % ksplit;
    const int b0 = blockIdx.y * 8, nb = min(8, batch - b0);
    const i64 ntiles = (N + 15) >> 4;
    const i64 t0 = ntiles * blockIdx.x / gridDim.x, t1 = ntiles * (blockIdx.x + 1) / gridDim.x;  // this CTA's tiles
    const i64 nsp = K / (8 * V);
    const i64 sp_begin = nsp * ks / ksplit, sp_end = nsp * (ks + 1) / ksplit;
    const int nsl = (int)(sp_end - sp_begin);       // super-pieces of this warp's slice
    const int nst = (nsl + SPS - 1) / SPS;          // its stages (>= 1: the launcher's split)
    const int my_groups = (int)((t1 - t0 + tpc - 1) / tpc);
    const int nunits = my_groups * nst;  // unit = (group, stage)
    const i64 row_bytes = K >> 1;
    // B fragment column g is batch row b0 + g; lanes past the batch read row b0 too (the same
    // addresses as lane g = 0: no extra memory traffic, and a predicated load costs a divergent
    // branch around the asm), which reaches only output columns that are not written
    const u16* arow = a + (i64)(b0 + (g < nb ? g : 0)) * K + sp_begin * (8 * V) + 2 * c * V;

    auto tile_row = [&](int q, int r) {  // row r of this warp's tile in its q-th group (clamped)
        return min((t0 + (i64)q * tpc + tslot) * 16 + r, N - 1);
    };
    // producer side: unit (qi, ji), S units ahead of the consumer. A stage is 16 rows x 256 bytes,
    // 256 chunks of 16 bytes: lane l copies chunk l & 15 of rows 2m + (l >> 4), m = 0..7. Rows past
    // N and chunks past a short last stage are zero-filled.
    int qi = 0, ji = 0;
    const int crow = lane >> 4, ccol = lane & 15;
    auto irow_of = [&](int qq) {
        return packed + (t0 + (i64)qq * tpc + tslot) * 16 * row_bytes + (i64)crow * row_bytes +
               sp_begin * (4 * V) + ccol * 16;
    };
    auto nrows_of = [&](int qq) {  // rows of the tile that exist
        const i64 t = t0 + (i64)qq * tpc + tslot;  // a tile past t1 (the next CTA's) is not read
        return t < t1 ? (int)min((i64)16, N - t * 16) : 0;
    };
    const u8* irow = irow_of(0);
    int inrows = nrows_of(0);
    auto issue_next = [&](int i) {
        const u32 dst = wring + (i % S) * G::kSlot + crow * G::kPitch + ccol * 16;
        const u8* src = irow + ji * (SPS * 4 * V);
        if (inrows == 16 && nsl - ji * SPS >= SPS) {  // a whole stage of a whole tile: no bounds
#pragma unroll
            for (int m = 0; m < 8; ++m)
                if (DBG != 2) cp_async16(dst + 2 * m * G::kPitch, src + m * (2 * row_bytes), 16u);
        } else {
            const bool col_ok = ccol * 16 < min(nsl - ji * SPS, SPS) * (4 * V);
#pragma unroll
            for (int m = 0; m < 8; ++m) {  // branch-free: a chunk that does not exist is zero-filled
                const bool ok = col_ok && 2 * m + crow < inrows;
                if (DBG != 2) cp_async16(dst + 2 * m * G::kPitch, ok ? src : packed, ok ? 16u : 0u);
                src += 2 * row_bytes;
            }
        }
        if (++ji == nst) {
            ji = 0;
            ++qi;
            irow = irow_of(qi);
            inrows = nrows_of(qi);
        }
    };

    // raw scale data of unit (q, j), loaded one unit ahead and first read when the unit starts:
    // for scale round gi, super-piece 4 gi + c of the stage, rows g and g + 8 (nested: the code
    // byte and its block's second-level absmax, both loads issued here)
    struct Raw {
        u32 q[G::kRounds][2];
        float a2[NESTED ? G::kRounds : 1][2];
    };
    // first super-piece of the slice in rows g and g + 8 of the tile (counted over the whole
    // matrix: a block is 2^bsh super-pieces, and the launcher keeps N K / (8 V) < 2^32), for the
    // next unit's group
    const int bsh = log2bs - G::kSpLog2;
    u32 esp[2];
    auto set_esp = [&](int q) {
#pragma unroll
        for (int r = 0; r < 2; ++r) esp[r] = (u32)tile_row(q, g + 8 * r) * (u32)(K / (8 * V)) + (u32)sp_begin;
    };
    auto load_raw = [&](Raw& rw, int j) {
        const int last = min(nsl - j * SPS, SPS) - 1;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const u32 e0 = esp[r] + j * SPS;
#pragma unroll
            for (int gi = 0; gi < G::kRounds; ++gi) {
                const u32 blk = (e0 + min(kGvSc * gi + c, last)) >> bsh;
                if constexpr (NESTED) {
                    rw.q[gi][r] = ldg_u8(reinterpret_cast<const u8*>(absmax) + blk);
                    rw.a2[gi][r] = ldg_f32(absmax2 + (blk >> kNestLog2));
                } else {
                    rw.q[gi][r] = ldg_u32(reinterpret_cast<const float*>(absmax) + blk);
                }
            }
        }
    };
    // activations of mma group gi of stage j (L1 / L2 hits: every warp reads them)
    auto load_x = [&](u32 (&x)[kGvU][V], int j, int gi, int lim) {
        const int sp0 = j * SPS + kGvU * gi;
        const u16* p = arow + sp0 * (8 * V);
#pragma unroll
        for (int u = 0; u < kGvU; ++u) {
#pragma unroll
            for (int h = 0; h < V / 4; ++h) {
                if (u < lim) {
                    ldg_v4(p + u * (8 * V) + 8 * h, x[u][4 * h], x[u][4 * h + 1], x[u][4 * h + 2], x[u][4 * h + 3]);
                } else {
                    x[u][4 * h] = x[u][4 * h + 1] = x[u][4 * h + 2] = x[u][4 * h + 3] = 0u;
                }
            }
        }
    };

    for (int i = 0; i < S; ++i) {
        if (i < nunits) issue_next(i);
        cp_async_commit();  // one group per unit (empty past the end), so wait_group counts units
    }
    Raw raw;  // the next unit's, loaded one unit ahead
    set_esp(0);
    if (nunits > 0) load_raw(raw, 0);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    u32 x[kGvU][V];  // the activation fragments of the current mma group
#pragma unroll
    for (int u = 0; u < kGvU; ++u)
#pragma unroll
        for (int v = 0; v < V; ++v) x[u][v] = 0u;

    int q = 0, j = 0;  // consumer: unit (q, j)
    for (int i = 0; i < nunits; ++i) {
        const int s = i % S;
        const int nspc = min(nsl - j * SPS, SPS);  // valid super-pieces of this stage
        const int qn = j + 1 == nst ? q + 1 : q, jn = j + 1 == nst ? 0 : j + 1;  // the next unit
        cp_async_wait<S - 1>();  // this unit's copies (by every lane) have landed
        __syncwarp();
        const u8* sl = wring_p + s * G::kSlot + c * V;
        // this unit's scales (lane c: super-piece 4 gi + c of rows g and g + 8), then the next
        // unit's raw scale data into the same registers
        float sc[G::kRounds][2];
#pragma unroll
        for (int gi = 0; gi < G::kRounds; ++gi)
#pragma unroll
            for (int r = 0; r < 2; ++r)
                sc[gi][r] = NESTED ? __fadd_rn(__fmul_rn(c2[raw.q[gi][r]], raw.a2[gi][r]), off) : __uint_as_float(raw.q[gi][r]);
        if (i + 1 < nunits) {
            if (qn != q) set_esp(qn);
            load_raw(raw, jn);
        }

        // one mma group: activations, weights, the mma chains and the scaled accumulation. Only
        // the first lim super-pieces exist (a short last stage): the others get zero activations
        // and are left out of the accumulation (their scale may be anything)
        auto run_group = [&](int gi, int lim, bool full) {
            load_x(x, j, gi, full ? kGvU : lim);
            u32 w[kGvU][2][V / 4];
#pragma unroll
            for (int u = 0; u < kGvU; ++u) {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const u8* p = sl + (g + 8 * r) * G::kPitch + (kGvU * gi + u) * (4 * V);
                    if constexpr (V == 8) {
                        const uint2 v2 = *reinterpret_cast<const uint2*>(p);
                        w[u][r][0] = v2.x;
                        w[u][r][1] = v2.y;
                    } else {
                        w[u][r][0] = *reinterpret_cast<const u32*>(p);
                    }
                }
            }
            float d[kGvU][4];
            u32 sink[kGvU];  // DBG 4
#pragma unroll
            for (int u = 0; u < kGvU; ++u) {
                d[u][0] = d[u][1] = d[u][2] = d[u][3] = 0.0f;
                sink[u] = 0u;
            }
#pragma unroll
            for (int jj = 0; jj < V / 2; ++jj) {
#pragma unroll
                for (int u = 0; u < kGvU; ++u) {
                    {  // past lim: stale slot bytes decode to finite codes, times zero activations
                        const u32 q0 = w[u][0][jj >> 1], q1 = w[u][1][jj >> 1];
                        u32 af[4];
                        if (jj & 1) {
                            af[0] = gv_pair<2, DBG>(q0, lutx);
                            af[1] = gv_pair<2, DBG>(q1, lutx);
                            af[2] = gv_pair<3, DBG>(q0, lutx);
                            af[3] = gv_pair<3, DBG>(q1, lutx);
                        } else {
                            af[0] = gv_pair<0, DBG>(q0, lutx);
                            af[1] = gv_pair<0, DBG>(q1, lutx);
                            af[2] = gv_pair<1, DBG>(q0, lutx);
                            af[3] = gv_pair<1, DBG>(q1, lutx);
                        }
                        if (DBG == 4) {  // timing only: no mma (two XORs keep the decode and activations live)
                            sink[u] ^= af[0] ^ af[1] ^ af[2];
                            sink[u] ^= af[3] ^ x[u][2 * jj] ^ x[u][2 * jj + 1];
                        } else {
                            mma_16816<T>(d[u], af, x[u][2 * jj], x[u][2 * jj + 1]);
                        }
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < kGvU; ++u) {
                if (DBG == 4) d[u][0] = __uint_as_float(sink[u] & 0x3c00ffffu);
                const int sp = kGvU * gi + u;
                const int src = (lane & ~3) | (sp % kGvSc);
                float v0 = sc[0][0], v1 = sc[0][1];  // sc[sp / kGvSc] by selects (not local memory)
#pragma unroll
                for (int k = 1; k < G::kRounds; ++k) {
                    v0 = gv_select(sp / kGvSc == k, sc[k][0], v0);
                    v1 = gv_select(sp / kGvSc == k, sc[k][1], v1);
                }
                const float s0 = __shfl_sync(kFullMask, v0, src);
                const float s1 = __shfl_sync(kFullMask, v1, src);
                if (full || u < lim) {
                    acc[0] = fmaf(d[u][0], s0, acc[0]);
                    acc[1] = fmaf(d[u][1], s0, acc[1]);
                    acc[2] = fmaf(d[u][2], s1, acc[2]);
                    acc[3] = fmaf(d[u][3], s1, acc[3]);
                }
            }
        };
        // groups not unrolled: unrolled, the compiler hoists later groups' loads past the 128
        // registers that 16 warps leave
        if (DBG == 3) {
        } else if (nspc == SPS) {
#pragma unroll 1
            for (int gi = 0; gi < G::kGroups; ++gi) run_group(gi, kGvU, true);
        } else {
#pragma unroll 1
            for (int gi = 0; gi < G::kGroups; ++gi) run_group(gi, min(max(nspc - kGvU * gi, 0), kGvU), false);
        }
        __syncwarp();  // every lane has read the slot: refill it
        if (i + S < nunits) issue_next(i + S);
        cp_async_commit();

        if (j + 1 == nst) {  // last stage of this group: add the K slices of each tile
            const i64 tq = t0 + (i64)q * tpc;  // first tile of this group
            // C fragment: (row g, col 2c), (row g, col 2c+1), (row g+8, col 2c), (row g+8, col 2c+1)
            float* rw = red + warp * 128;
            rw[g * 8 + 2 * c] = acc[0];
            rw[g * 8 + 2 * c + 1] = acc[1];
            rw[(g + 8) * 8 + 2 * c] = acc[2];
            rw[(g + 8) * 8 + 2 * c + 1] = acc[3];
            acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;
            __syncthreads();
            for (int idx = threadIdx.x; idx < tpc * 128; idx += blockDim.x) {
                const int t = idx >> 7, col = (idx >> 4) & 7, row = idx & 15;
                const i64 r = (tq + t) * 16 + row;
                if (tq + t < t1 && r < N && col < nb) {  // tiles past t1 are the next CTA's
                    float sum = red[(t * ksplit) * 128 + row * 8 + col];
                    for (int jj = 1; jj < ksplit; ++jj) sum += red[(t * ksplit + jj) * 128 + row * 8 + col];
                    out[(i64)(b0 + col) * N + r] = T::from_f(sum);
                }
            }
            __syncthreads();
        }
        q = qn;
        j = jn;
    }
#endif
}

}  // namespace qc
