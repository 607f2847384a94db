// Rotary position embedding, non-interleaved (rotate_half), over t [rows, dim]
// whose rows run over positions fastest-last: row r is at position r % seq.
// out[i] = t[i] * cos[p][i] + sign * rotate_half(t)[i] * sin[p][i] for i < rot,
// t[i] beyond; rotate_half([a, b]) = [-b, a]. cos/sin are fp32 [seq, rot] and
// rounded to the element type first, as the PyTorch fallback (ops/rope.py)
// does. The backward pass is the same rotation with sign = -1 (the tables
// repeat each frequency twice, so the rotation's transpose is its inverse).
#include "common.cuh"

namespace mz_cuda {
namespace {

template <typename T>
__global__ void rope(const T* __restrict__ t, const float* __restrict__ cos_t,
                     const float* __restrict__ sin_t, T* __restrict__ out, int64_t rows,
                     int64_t dim, int64_t rot, int64_t seq, float sign) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= rows * dim) return;
  const int64_t r = i / dim, j = i - r * dim;
  if (j >= rot) {
    out[i] = t[i];
    return;
  }
  const int64_t half = rot / 2, p = r % seq;
  const float c = to_f32(from_f32<T>(cos_t[p * rot + j]));
  const float s = to_f32(from_f32<T>(sin_t[p * rot + j]));
  const float partner = j < half ? -to_f32(t[i + half]) : to_f32(t[i - half]);
  out[i] = from_f32<T>(to_f32(t[i]) * c + sign * partner * s);
}

}  // namespace

cudaError_t rope_apply(DType dt, const void* t, const float* cos_t, const float* sin_t, void* out,
                       int64_t rows, int64_t dim, int64_t rot, int64_t seq, bool inverse,
                       cudaStream_t stream) {
  const int64_t n = rows * dim;
  if (n == 0) return cudaSuccess;
  const int threads = 256;
  const int64_t blocks = (n + threads - 1) / threads;
  MZ_DISPATCH(dt, rope<T><<<blocks, threads, 0, stream>>>(static_cast<const T*>(t), cos_t, sin_t,
                                                          static_cast<T*>(out), rows, dim, rot,
                                                          seq, inverse ? -1.f : 1.f));
  return cudaGetLastError();
}

}  // namespace mz_cuda
