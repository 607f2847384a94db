// Fused RMSNorm forward and backward (one block per row; dgamma summed in a
// fixed order over row slices, then across slices: deterministic).
// y = gamma * T(x * rstd), rstd = 1/sqrt(mean(x^2) + eps): the normalised row
// is rounded to the element type before the weight is applied, as the PyTorch
// fallback (ops/rms_norm.py) and Hugging Face Llama do.
#include "common.cuh"

namespace mz_cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRowSlices = 64;  // partial sums per column in the dgamma pass

template <typename T>
__global__ void rms_fwd(const T* __restrict__ x, const T* __restrict__ gamma, T* __restrict__ y,
                        float* __restrict__ invrms, int64_t cols, float eps) {
  __shared__ float smem[32];
  const T* xr = x + blockIdx.x * cols;
  T* yr = y + blockIdx.x * cols;
  float ss = 0.f;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float v = to_f32(xr[j]);
    ss += v * v;
  }
  const float rstd = rsqrtf(block_reduce<false>(ss, smem) / cols + eps);
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float normed = to_f32(from_f32<T>(to_f32(xr[j]) * rstd));
    yr[j] = from_f32<T>(normed * to_f32(gamma[j]));
  }
  if (threadIdx.x == 0) invrms[blockIdx.x] = rstd;
}

// dx = rstd * (g - xhat * mean(g * xhat)), g = dy * gamma, xhat = x * rstd.
template <typename T>
__global__ void rms_bwd_dx(const T* __restrict__ dy, const T* __restrict__ x,
                           const float* __restrict__ invrms, const T* __restrict__ gamma,
                           T* __restrict__ dx, int64_t cols) {
  __shared__ float smem[32];
  const int64_t off = blockIdx.x * cols;
  const float rstd = invrms[blockIdx.x];
  float sgx = 0.f;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x)
    sgx += to_f32(dy[off + j]) * to_f32(gamma[j]) * to_f32(x[off + j]) * rstd;
  const float mean_gx = block_reduce<false>(sgx, smem) / cols;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float g = to_f32(dy[off + j]) * to_f32(gamma[j]);
    const float xhat = to_f32(x[off + j]) * rstd;
    dx[off + j] = from_f32<T>(rstd * (g - xhat * mean_gx));
  }
}

// Partial column sums of dy * T(xhat) over one slice of rows: ws[slice][col].
template <typename T>
__global__ void rms_bwd_partial(const T* __restrict__ dy, const T* __restrict__ x,
                                const float* __restrict__ invrms, float* __restrict__ ws,
                                int64_t rows, int64_t cols) {
  const int64_t col = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (col >= cols) return;
  const int64_t per = (rows + kRowSlices - 1) / kRowSlices;
  const int64_t r0 = blockIdx.y * per, r1 = min(rows, r0 + per);
  float dg = 0.f;
  for (int64_t r = r0; r < r1; ++r)
    dg += to_f32(dy[r * cols + col]) * to_f32(from_f32<T>(to_f32(x[r * cols + col]) * invrms[r]));
  ws[blockIdx.y * cols + col] = dg;
}

template <typename T>
__global__ void rms_bwd_finish(const float* __restrict__ ws, T* __restrict__ dgamma, int64_t cols) {
  const int64_t col = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (col >= cols) return;
  float dg = 0.f;
  for (int s = 0; s < kRowSlices; ++s) dg += ws[s * cols + col];
  dgamma[col] = from_f32<T>(dg);
}

}  // namespace

cudaError_t rms_norm_fwd(DType dt, const void* x, const void* gamma, void* y, float* invrms,
                         int64_t rows, int64_t cols, float eps, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  MZ_DISPATCH(dt, rms_fwd<T><<<rows, kThreads, 0, stream>>>(
                      static_cast<const T*>(x), static_cast<const T*>(gamma), static_cast<T*>(y),
                      invrms, cols, eps));
  return cudaGetLastError();
}

int64_t rms_norm_bwd_workspace_floats(int64_t cols) { return kRowSlices * cols; }

cudaError_t rms_norm_bwd(DType dt, const void* dy, const void* x, const float* invrms,
                         const void* gamma, void* dx, void* dgamma, float* workspace, int64_t rows,
                         int64_t cols, cudaStream_t stream) {
  const dim3 col_grid((cols + 127) / 128, kRowSlices);
  MZ_DISPATCH(dt, {
    const T* dy_ = static_cast<const T*>(dy);
    const T* x_ = static_cast<const T*>(x);
    if (rows > 0)
      rms_bwd_dx<T><<<rows, kThreads, 0, stream>>>(dy_, x_, invrms, static_cast<const T*>(gamma),
                                                   static_cast<T*>(dx), cols);
    rms_bwd_partial<T><<<col_grid, 128, 0, stream>>>(dy_, x_, invrms, workspace, rows, cols);
    rms_bwd_finish<T><<<col_grid.x, 128, 0, stream>>>(workspace, static_cast<T*>(dgamma), cols);
  });
  return cudaGetLastError();
}

}  // namespace mz_cuda
