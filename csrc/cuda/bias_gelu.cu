// Bias + GeLU (tanh approximation, Megatron's constants), forward and backward,
// elementwise in fp32 with a grid-stride loop.
#include "common.cuh"

namespace mz_cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float gelu(float x) {
  return x * 0.5f * (1.f + tanhf(0.79788456f * x * (1.f + 0.044715f * x * x)));
}

__device__ __forceinline__ float gelu_grad(float x) {
  const float t = tanhf(0.79788456f * x * (1.f + 0.044715f * x * x));
  return 0.5f * x * ((1.f - t * t) * (0.79788456f + 0.1070322243f * x * x)) + 0.5f * (1.f + t);
}

template <typename T>
__global__ void bias_gelu_fwd_k(const T* __restrict__ y, const T* __restrict__ bias,
                                T* __restrict__ out, int64_t n, int64_t hidden) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    out[i] = from_f32<T>(gelu(to_f32(y[i]) + to_f32(bias[i % hidden])));
}

template <typename T>
__global__ void bias_gelu_bwd_k(const T* __restrict__ dout, const T* __restrict__ y,
                                const T* __restrict__ bias, T* __restrict__ dy, int64_t n,
                                int64_t hidden) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    dy[i] = from_f32<T>(to_f32(dout[i]) * gelu_grad(to_f32(y[i]) + to_f32(bias[i % hidden])));
}

unsigned blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 65536 ? b : 65536);
}

}  // namespace

cudaError_t bias_gelu_fwd(DType dt, const void* y, const void* bias, void* out, int64_t n,
                          int64_t hidden, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  MZ_DISPATCH(dt, bias_gelu_fwd_k<T><<<blocks_for(n), kThreads, 0, stream>>>(
                      static_cast<const T*>(y), static_cast<const T*>(bias), static_cast<T*>(out),
                      n, hidden));
  return cudaGetLastError();
}

cudaError_t bias_gelu_bwd(DType dt, const void* dout, const void* y, const void* bias, void* dy,
                          int64_t n, int64_t hidden, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  MZ_DISPATCH(dt, bias_gelu_bwd_k<T><<<blocks_for(n), kThreads, 0, stream>>>(
                      static_cast<const T*>(dout), static_cast<const T*>(y),
                      static_cast<const T*>(bias), static_cast<T*>(dy), n, hidden));
  return cudaGetLastError();
}

}  // namespace mz_cuda
