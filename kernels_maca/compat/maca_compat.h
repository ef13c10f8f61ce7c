// MetaX MACA runtime names mapped onto CUDA, for the compatibility build only.
//
// The MACA sources in kernels_maca/ are MetaX sources: they include <mc_runtime.h>,
// <maca_fp16.h> and <maca_bfloat16.h> and use the mc* runtime. On an NVIDIA GPU the backend
// builds the same sources with nvcc and puts this folder first on the include path, so those
// three headers resolve here and every name below maps to its CUDA counterpart. This file holds
// mappings only (names, types, constants): no kernel logic. mxcc never sees it.
#pragma once

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// Marks the compatibility build; qc_maca.h takes the wave width from it.
#define QC_MACA_COMPAT 1

// Runtime types.
typedef cudaError_t mcError_t;
typedef cudaStream_t mcStream_t;
typedef cudaEvent_t mcEvent_t;
typedef cudaDeviceProp mcDeviceProp_t;

// Error codes.
#define mcSuccess cudaSuccess
#define mcErrorInvalidValue cudaErrorInvalidValue
#define mcErrorInvalidConfiguration cudaErrorInvalidConfiguration
#define mcErrorMemoryAllocation cudaErrorMemoryAllocation
#define mcErrorUnknown cudaErrorUnknown

// Runtime functions.
#define mcGetLastError cudaGetLastError
#define mcPeekAtLastError cudaPeekAtLastError
#define mcGetErrorString cudaGetErrorString
#define mcGetDevice cudaGetDevice
#define mcSetDevice cudaSetDevice
#define mcGetDeviceCount cudaGetDeviceCount
#define mcGetDeviceProperties cudaGetDeviceProperties
#define mcDeviceGetAttribute cudaDeviceGetAttribute
#define mcDeviceSynchronize cudaDeviceSynchronize
#define mcMalloc cudaMalloc
#define mcFree cudaFree
#define mcMemcpy cudaMemcpy
#define mcMemcpyAsync cudaMemcpyAsync
#define mcMemset cudaMemset
#define mcMemsetAsync cudaMemsetAsync
#define mcMemcpyHostToDevice cudaMemcpyHostToDevice
#define mcMemcpyDeviceToHost cudaMemcpyDeviceToHost
#define mcMemcpyDeviceToDevice cudaMemcpyDeviceToDevice
#define mcStreamCreate cudaStreamCreate
#define mcStreamSynchronize cudaStreamSynchronize
#define mcStreamDestroy cudaStreamDestroy
#define mcEventCreate cudaEventCreate
#define mcEventRecord cudaEventRecord
#define mcEventSynchronize cudaEventSynchronize
#define mcEventElapsedTime cudaEventElapsedTime

// Device attributes (MACA spells them mcDeviceAttribute*, CUDA cudaDevAttr*).
#define mcDeviceAttributeMaxSharedMemoryPerBlock cudaDevAttrMaxSharedMemoryPerBlock
#define mcDeviceAttributeMultiProcessorCount cudaDevAttrMultiProcessorCount
#define mcDeviceAttributeWarpSize cudaDevAttrWarpSize

// bf16 types (maca_bfloat16.h); the conversion functions (__bfloat162float,
// __float2bfloat16_rn, ...) have the same names in CUDA's cuda_bf16.h.
typedef __nv_bfloat16 maca_bfloat16;
typedef __nv_bfloat16 __maca_bfloat16;
typedef __nv_bfloat162 __maca_bfloat162;
