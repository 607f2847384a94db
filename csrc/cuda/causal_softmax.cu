// Scaled upper-triangular masked softmax (causal attention), forward and
// backward. One block per row of x [batches, seq, seq]; row i sees keys 0..i,
// the rest of the row is written as 0. The mask is implied, never stored.
#include "common.cuh"

namespace mz_cuda {
namespace {

constexpr int kThreads = 128;

template <typename T>
__global__ void softmax_fwd(const T* __restrict__ x, T* __restrict__ y, int64_t seq, float scale) {
  __shared__ float smem[32];
  const int64_t row = blockIdx.x;
  const int64_t visible = row % seq + 1;  // query i attends to keys 0..i
  const T* xr = x + row * seq;
  T* yr = y + row * seq;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < visible; j += blockDim.x) mx = fmaxf(mx, to_f32(xr[j]) * scale);
  mx = block_reduce<true>(mx, smem);
  float sum = 0.f;
  for (int64_t j = threadIdx.x; j < visible; j += blockDim.x) sum += __expf(to_f32(xr[j]) * scale - mx);
  const float inv = 1.f / block_reduce<false>(sum, smem);
  for (int64_t j = threadIdx.x; j < seq; j += blockDim.x)
    yr[j] = from_f32<T>(j < visible ? __expf(to_f32(xr[j]) * scale - mx) * inv : 0.f);
}

template <typename T>
__global__ void softmax_bwd(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx,
                            int64_t seq, float scale) {
  __shared__ float smem[32];
  const int64_t row = blockIdx.x;
  const int64_t visible = row % seq + 1;
  const int64_t off = row * seq;
  float dot = 0.f;
  for (int64_t j = threadIdx.x; j < visible; j += blockDim.x)
    dot += to_f32(dy[off + j]) * to_f32(y[off + j]);
  dot = block_reduce<false>(dot, smem);
  for (int64_t j = threadIdx.x; j < seq; j += blockDim.x) {
    const float g = j < visible ? scale * to_f32(y[off + j]) * (to_f32(dy[off + j]) - dot) : 0.f;
    dx[off + j] = from_f32<T>(g);
  }
}

}  // namespace

cudaError_t causal_softmax_fwd(DType dt, const void* x, void* y, int64_t batches, int64_t seq,
                               float scale, cudaStream_t stream) {
  if (batches * seq == 0) return cudaSuccess;
  MZ_DISPATCH(dt, softmax_fwd<T><<<batches * seq, kThreads, 0, stream>>>(
                      static_cast<const T*>(x), static_cast<T*>(y), seq, scale));
  return cudaGetLastError();
}

cudaError_t causal_softmax_bwd(DType dt, const void* dy, const void* y, void* dx,
                               int64_t batches, int64_t seq, float scale, cudaStream_t stream) {
  if (batches * seq == 0) return cudaSuccess;
  MZ_DISPATCH(dt, softmax_bwd<T><<<batches * seq, kThreads, 0, stream>>>(
                      static_cast<const T*>(dy), static_cast<const T*>(y), static_cast<T*>(dx),
                      seq, scale));
  return cudaGetLastError();
}

}  // namespace mz_cuda
