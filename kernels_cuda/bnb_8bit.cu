// bitsandbytes blockwise 8-bit with the dynamic map, and the double quantization of absmax.
// Semantics: shared/design/FORMATS.md sections 1 (double quantization) and 2.
#include "qc_common.cuh"

namespace qc {

// code = number of the 255 ascending thresholds t with s > t (nearest code value, ties to the
// lower index, NaN to 0): a branch-free binary search.
__device__ __forceinline__ u32 round8(const float* thr, float s) {
    u32 idx = 0;
#pragma unroll
    for (u32 step = 128; step > 0; step >>= 1)
        if (s > thr[idx + step - 1]) idx += step;
    return idx;
}

// quantize_blockwise: one thread per 8 elements, G threads per block. ``thresholds`` may be null
// (the dynamic map's own). ``center`` (double quantization) points at the offset subtracted from
// every element in fp32 first; elements past n stay 0.0, as the reference pads the centered array.
template <typename T>
__global__ void __launch_bounds__(512) quantize_blockwise_kernel(
    const typename T::S* __restrict__ x, const float* __restrict__ thresholds, u8* __restrict__ codes,
    float* __restrict__ absmax, const float* __restrict__ center, i64 n, int log2bs, int vec) {
    __shared__ float thr[256];
    __shared__ float red[16];
    for (int i = threadIdx.x; i < 255; i += blockDim.x)
        thr[i] = thresholds ? ldg_f32(thresholds + i) : kDynamicThresholds[i];
    __syncthreads();

    const int G = (1 << log2bs) >> 3;
    const i64 nthreads = (n + 7) >> 3;
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t - threadIdx.x < nthreads;
         t += (i64)gridDim.x * blockDim.x) {
        const i64 e0 = t * 8;
        float v[8];
        load8<T>(x, e0, n, vec != 0, v);
        if (center) {
            const float off = ldg_f32(center);
#pragma unroll
            for (int i = 0; i < 8; ++i)
                if (e0 + i < n) v[i] = __fsub_rn(v[i], off);
        }
        float m = nan_value();
#pragma unroll
        for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(v[i]));
        m = group_absmax(m, G, red);
        const float r = recip_rn(m);
        if ((threadIdx.x & (G - 1)) == 0 && e0 < n) absmax[e0 >> log2bs] = m;
        u32 lo = 0, hi = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            lo |= round8(thr, __fmul_rn(v[i], r)) << (8 * i);
            hi |= round8(thr, __fmul_rn(v[i + 4], r)) << (8 * i);
        }
        if (vec && e0 + 8 <= n) {
            *reinterpret_cast<u64*>(codes + e0) = ((u64)hi << 32) | lo;
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i)
                if (e0 + i < n) codes[e0 + i] = (u8)((i < 4 ? lo : hi) >> (8 * (i & 3)));
        }
        if (G > 32) __syncthreads();  // red[] is rewritten by the next iteration
    }
}

// dequantize_blockwise: out = T(code[q] * absmax[i / blocksize]); 8 elements per thread, two
// groups of 8 per thread, loads first.
template <typename T>
__global__ void __launch_bounds__(256) dequantize_blockwise_kernel(
    const u8* __restrict__ codes, const float* __restrict__ absmax, const float* __restrict__ code,
    typename T::S* __restrict__ out, i64 n, int log2bs, int vec) {
    __shared__ float table[256];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) table[i] = ldg_f32(code + i);
    __syncthreads();
    const i64 first = (i64)blockIdx.x * blockDim.x * 2 + threadIdx.x;
    u64 q[2];
    float s[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const i64 e0 = (first + (i64)j * blockDim.x) * 8;
        q[j] = (vec && e0 + 8 <= n) ? ldg_u64(codes + e0) : 0ull;
        s[j] = e0 < n ? ldg_f32(absmax + (e0 >> log2bs)) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const i64 e0 = (first + (i64)j * blockDim.x) * 8;
        if (e0 >= n) continue;
        float v[8];
        const bool whole = vec && e0 + 8 <= n;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const i64 e = e0 + i;
            if (whole) {
                v[i] = __fmul_rn(table[(u32)(q[j] >> (8 * i)) & 255u], s[j]);
            } else if (e < n) {  // a block boundary may fall inside these 8 (blocksize >= 64: no)
                v[i] = __fmul_rn(table[ldg_u8(codes + e)], ldg_f32(absmax + (e >> log2bs)));
            } else {
                v[i] = 0.0f;
            }
        }
        store8<T>(out, e0, n, whole, v);
    }
}

// Double-quantization offset: f32(pairwise_sum_f64(absmax) / nb), with exactly the perfect
// binary tree of quantcore.formats.bnb.pairwise_sum_f64 (zero padded, pairs (2i, 2i+1) level by
// level). A CTA reduces an aligned chunk of 2048 values: 8 per thread (three levels in registers),
// then butterfly shuffles (each xor step is one level; a + b == b + a bit for bit), then the 8
// warp sums. Chunks are aligned subtrees, so a second launch over the chunk sums continues the
// same tree. The last launch (one CTA) writes the offset; earlier ones write fp64 partial sums.
constexpr int kTreeChunk = 2048;

template <bool FROM_F32>
__global__ void __launch_bounds__(256) absmax_tree_sum_kernel(
    const void* __restrict__ in, i64 count, double* __restrict__ partial, float* __restrict__ offset,
    i64 nb) {
    __shared__ double ws[8];
    const i64 base = (i64)blockIdx.x * kTreeChunk + threadIdx.x * 8;
    double v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const i64 idx = base + i;
        v[i] = idx < count ? (FROM_F32 ? (double)ldg_f32(reinterpret_cast<const float*>(in) + idx)
                                       : reinterpret_cast<const double*>(in)[idx])
                           : 0.0;
    }
    const double s = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
    double t = s;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) t = t + shfl_xor_f64(t, o);
    if (lane_id() == 0) ws[threadIdx.x >> 5] = t;
    __syncthreads();
    if (threadIdx.x == 0) {
        const double total = ((ws[0] + ws[1]) + (ws[2] + ws[3])) + ((ws[4] + ws[5]) + (ws[6] + ws[7]));
        if (gridDim.x == 1) {
            offset[0] = __double2float_rn(__ddiv_rn(total, (double)nb));
        } else {
            partial[blockIdx.x] = total;
        }
    }
}

}  // namespace qc
