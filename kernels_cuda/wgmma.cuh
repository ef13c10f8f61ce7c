// Hopper's warpgroup MMA (wgmma, sm_90a) as the GEMM kernels use it: mx_gemm.cu (scaled_fp4_mm) and
// bnb_gemm.cu (gemv_4bit for many rows). Everything is defined only when the target has the sm_90a
// features (__CUDA_ARCH_FEAT_SM90_ALL: the backend builds a kernel whose name holds "wgmma" for
// sm_90a on compute capability 9.0); QC_HAS_WGMMA says so to the including file.
//
// The operands: A (64 rows x 16 K per warpgroup) from registers in mma.m16n8k16's A-fragment layout
// (warp w of the warpgroup holds rows 16 w .. 16 w + 15), B (128 rows x 16 K) from shared memory,
// K-major in the 128-byte swizzle (row n at n * 128 bytes, its 16-byte chunk c at c ^ (n % 8),
// 1024-byte aligned tiles); the 64 fp32 accumulators of thread (warp w, lane 4 g + t) hold
// d[4 j + 2 r + e] = D[16 w + g + 8 r][8 j + 2 t + e] (m64n256: B 256 rows, 128 accumulators).
#pragma once
#include "qc_common.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QC_HAS_WGMMA 1
namespace qc {

// Descriptor of a K-major 16-bit operand in the 128-byte swizzle: 8-row groups 1024 bytes apart
// (SBO), LBO unused for this layout, base 1024-byte aligned; K steps of 16 add 32 bytes (2 in the
// address field).
__device__ __forceinline__ u64 desc_sw128(u32 saddr) {
    return (u64)((saddr & 0x3ffffu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
// this thread's generic-proxy writes to shared memory (stores, cp.async) visible to the MMAs' reads
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// Keeps the compiler from moving accumulator accesses across the asynchronous MMAs.
template <int N>
__device__ __forceinline__ void fence_acc(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// the 64 fp32 accumulators of m64n128 (the PTX operand list and the asm outputs), shared by the
// register-A and shared-memory-A forms
#define QC_WGMMA_ACC64_REGS "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
#define QC_WGMMA_ACC64_OUTS \
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), \
          "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), \
          "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), \
          "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), \
          "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), \
          "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), \
          "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), \
          "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
// d += A (registers) x B (descriptor): m64n128k16, fp32 accumulators, fp16 (F16) or bf16 operands
#define QC_WGMMA_RS(NAME, TY) \
__device__ __forceinline__ void NAME(float (&d)[64], const u32 (&a)[4], u64 desc) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " QC_WGMMA_ACC64_REGS \
                 "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n" \
                 : QC_WGMMA_ACC64_OUTS \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1)); \
}
QC_WGMMA_RS(wgmma_m64n128k16_rs_bf16, "bf16")
QC_WGMMA_RS(wgmma_m64n128k16_rs_f16, "f16")
#undef QC_WGMMA_RS
template <bool F16>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const u32 (&a)[4], u64 desc) {
    if (F16) {
        wgmma_m64n128k16_rs_f16(d, a, desc);
    } else {
        wgmma_m64n128k16_rs_bf16(d, a, desc);
    }
}

// the same for m64n256 (128 accumulators): bnb_gemm.cu's 256-input-row tile
#define QC_WGMMA_ACC128_REGS "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
#define QC_WGMMA_ACC128_OUTS \
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
#define QC_WGMMA_RS256(NAME, TY) \
__device__ __forceinline__ void NAME(float (&d)[128], const u32 (&a)[4], u64 desc) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " " QC_WGMMA_ACC128_REGS \
                 "{%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n" \
                 : QC_WGMMA_ACC128_OUTS \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1)); \
}
QC_WGMMA_RS256(wgmma_m64n256k16_rs_bf16, "bf16")
QC_WGMMA_RS256(wgmma_m64n256k16_rs_f16, "f16")
#undef QC_WGMMA_RS256
#undef QC_WGMMA_ACC128_REGS
#undef QC_WGMMA_ACC128_OUTS
// d += A x B for m64nNk16, N = 2 x the accumulators (128 or 256)
template <bool F16, int NACC>
__device__ __forceinline__ void wgmma_rs(float (&d)[NACC], const u32 (&a)[4], u64 desc) {
    static_assert(NACC == 64 || NACC == 128, "m64n128 or m64n256");
    if constexpr (NACC == 64) {
        wgmma_m64n128k16_rs<F16>(d, a, desc);
    } else if constexpr (F16) {
        wgmma_m64n256k16_rs_f16(d, a, desc);
    } else {
        wgmma_m64n256k16_rs_bf16(d, a, desc);
    }
}

}  // namespace qc
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
