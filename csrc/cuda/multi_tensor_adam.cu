// Multi-tensor AdamW: one launch over the chunks of many fp32 tensors, with
// torch.optim.AdamW's op order (lerp and addcmul end in an FMA, as torch's do).
#include "common.cuh"

namespace mz_cuda {
namespace {

constexpr int kThreads = 512;

__global__ void adamw_chunks(const AdamTensor* __restrict__ tensors,
                             const int* __restrict__ chunk_tensor,
                             const int64_t* __restrict__ chunk_start, int64_t chunk_size,
                             AdamScalars s) {
  const AdamTensor t = tensors[chunk_tensor[blockIdx.x]];
  const int64_t begin = chunk_start[blockIdx.x];
  const int64_t end = min(t.n, begin + chunk_size);
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float g = t.g[i];
    const float m = fmaf(s.one_minus_b1, g - t.m[i], t.m[i]);
    const float v = fmaf(s.one_minus_b2 * g, g, t.v[i] * s.beta2);
    const float denom = sqrtf(v) / s.bc2_sqrt + s.eps;
    const float p = t.p[i] * s.decay;
    t.m[i] = m;
    t.v[i] = v;
    t.p[i] = p + __fdiv_rn(s.neg_step_size * m, denom);
  }
}

}  // namespace

cudaError_t multi_tensor_adamw(const AdamTensor* tensors, const int* chunk_tensor,
                               const int64_t* chunk_start, int num_chunks, int64_t chunk_size,
                               AdamScalars s, cudaStream_t stream) {
  if (num_chunks == 0) return cudaSuccess;
  adamw_chunks<<<num_chunks, kThreads, 0, stream>>>(tensors, chunk_tensor, chunk_start,
                                                    chunk_size, s);
  return cudaGetLastError();
}

}  // namespace mz_cuda
