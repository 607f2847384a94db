// Shared device helpers: dtype dispatch, fp32 loads/stores, block reductions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels.h"

namespace mz_cuda {

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Reduce over the block (blockDim.x a multiple of 32, at most 1024); every
// thread gets the result. `smem` holds 32 floats.
template <bool kMax>
__device__ __forceinline__ float block_reduce(float v, float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = kMax ? warp_max(v) : warp_sum(v);
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  const float neutral = kMax ? -INFINITY : 0.f;
  v = threadIdx.x < (blockDim.x >> 5) ? smem[lane] : neutral;
  if (warp == 0) v = kMax ? warp_max(v) : warp_sum(v);
  if (threadIdx.x == 0) smem[0] = v;
  __syncthreads();
  v = smem[0];
  __syncthreads();  // smem may be reused by the caller's next reduction
  return v;
}

}  // namespace mz_cuda

// Run `...` with T bound to the element type named by `dt`.
#define MZ_DISPATCH(dt, ...)                                 \
  switch (dt) {                                              \
    case ::mz_cuda::kF32: {                                  \
      using T = float;                                       \
      __VA_ARGS__;                                           \
      break;                                                 \
    }                                                        \
    case ::mz_cuda::kF16: {                                  \
      using T = __half;                                      \
      __VA_ARGS__;                                           \
      break;                                                 \
    }                                                        \
    case ::mz_cuda::kBF16: {                                 \
      using T = __nv_bfloat16;                               \
      __VA_ARGS__;                                           \
      break;                                                 \
    }                                                        \
    default:                                                 \
      return cudaErrorInvalidValue;                          \
  }
