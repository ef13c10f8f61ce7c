// Launch geometry of the quantcore SYCL kernels, written once: the kernels include this file and
// the Python launcher (backends/sycl/runtime.py) reads the numbers of its `#define QC_* <int>`
// lines, so a change here reaches both sides. One definition per line, decimal integers only.
#pragma once

// Required sub-group size of the kernels that reduce over a sub-group (gemv, the ggml GEMMs).
// bitsandbytes' SYCL gemv uses 32; its bf16 gemv was once wrong because the size did not reach
// the kernel and the compiler chose 8, so the size is a kernel property and a test checks it.
// 32 is the size on GPUs. The run-time build passes -DQC_SUBGROUP_SIZE=<n> per device: on a CPU
// device a sub-group is one SIMD vector, so n is the native float width there (8 with AVX2,
// 16 with AVX-512); 32 lanes on an AVX2 CPU ran about 2x slower (docs/sycl.md).
#ifndef QC_SUBGROUP_SIZE
#define QC_SUBGROUP_SIZE 32
#endif

// Blockwise dequantize (port of bitsandbytes' kDequantizeBlockwise): 128 work-items per
// work-group, 4 packed bytes per work-item, so one work-group covers a tile of 512 bytes.
#define QC_DEQUANT_WG 128
#define QC_DEQUANT_BYTES_PER_ITEM 4

// Blockwise quantize (4-bit and 8-bit, new in SYCL): 128 work-items per work-group; a work-item
// takes at least 4 consecutive values (more for blocks larger than 512 values) and a block is
// spread over blocksize / values_per_item work-items of one work-group.
#define QC_QUANT_WG 128
#define QC_QUANT_MIN_VALUES_PER_ITEM 4

// gemv_4bit (port of kgemv_4bit_inference): one sub-group per weight row, 4 rows per
// work-group, 32 4-bit values (16 bytes) per lane and step.
#define QC_GEMV_ROWS_PER_WG 4
#define QC_GEMV_VALUES_PER_LANE 32

// Activation rows a gemv / GEMM work-group serves from one read of the weights.
#define QC_MAX_BATCH 8

// Double quantization: one work-group sums the absmax array (fp64 pairwise tree).
#define QC_SUM_WG 256

// ggml quantize / dequantize: one work-item per 32-value block.
#define QC_GGML_WG 64

// NVFP4 / MX: one work-item per block (quantize), per value (dequantize, the fp4 GEMM's outputs)
// or per scale byte (swizzle).
#define QC_MX_WG 128

// ggml GEMMs: one sub-group per weight row, 4 rows per work-group; the activation is staged in
// work-group local memory in chunks of QC_SUBGROUP_SIZE blocks (one block per lane).
#define QC_GEMM_ROWS_PER_WG 4
