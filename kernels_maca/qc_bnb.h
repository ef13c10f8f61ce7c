// Helpers shared by the bitsandbytes 4-bit kernels (quantize / dequantize and gemv).
#pragma once

#include "qc_maca.h"

// The 16-entry decode table of QT, copied into shared memory (lanes index it divergently).
// Every thread of the CTA must call it (it synchronizes).
template <int QT>
__device__ __forceinline__ void qc_load_code_4bit(float* s_code) {
  const float nf4[] = QC_NF4_CODE_INIT;
  const float fp4[] = QC_FP4_CODE_INIT;
  if (threadIdx.x < 16) s_code[threadIdx.x] = (QT == QC_QUANT_NF4) ? nf4[threadIdx.x] : fp4[threadIdx.x];
  __syncthreads();
}

// The fp32 absmax of block `blk`: stored, or decoded from double quantization as
// code2[q[blk]] * absmax2[blk / 256] + offset with two separate fp32 roundings (never an FMA).
template <bool NESTED>
__device__ __forceinline__ float qc_block_absmax(const void* absmax, const float* absmax2,
                                                 const float* code2, float offset, long long blk) {
  if (NESTED) {
    const uint8_t q = ((const uint8_t*)absmax)[blk];
    return __fadd_rn(__fmul_rn(code2[q], absmax2[blk / QC_NESTED_BLOCKSIZE]), offset);
  }
  return ((const float*)absmax)[blk];
}
