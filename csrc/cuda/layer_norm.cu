// Fused LayerNorm forward and backward (one block per row; dgamma/dbeta summed
// in a fixed order over row slices, then across slices: deterministic).
#include "common.cuh"

namespace mz_cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRowSlices = 64;  // partial sums per column in the dgamma/dbeta pass

template <typename T>
__global__ void ln_fwd(const T* __restrict__ x, const T* __restrict__ gamma,
                       const T* __restrict__ beta, T* __restrict__ y, float* __restrict__ mean,
                       float* __restrict__ invvar, int64_t cols, float eps) {
  __shared__ float smem[32];
  const T* xr = x + blockIdx.x * cols;
  T* yr = y + blockIdx.x * cols;
  float s = 0.f;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) s += to_f32(xr[j]);
  const float mu = block_reduce<false>(s, smem) / cols;
  float ss = 0.f;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float d = to_f32(xr[j]) - mu;
    ss += d * d;
  }
  const float rstd = rsqrtf(block_reduce<false>(ss, smem) / cols + eps);
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x)
    yr[j] = from_f32<T>((to_f32(xr[j]) - mu) * rstd * to_f32(gamma[j]) + to_f32(beta[j]));
  if (threadIdx.x == 0) {
    mean[blockIdx.x] = mu;
    invvar[blockIdx.x] = rstd;
  }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma.
template <typename T>
__global__ void ln_bwd_dx(const T* __restrict__ dy, const T* __restrict__ x,
                          const float* __restrict__ mean, const float* __restrict__ invvar,
                          const T* __restrict__ gamma, T* __restrict__ dx, int64_t cols) {
  __shared__ float smem[32];
  const int64_t off = blockIdx.x * cols;
  const float mu = mean[blockIdx.x], rstd = invvar[blockIdx.x];
  float sg = 0.f, sgx = 0.f;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float g = to_f32(dy[off + j]) * to_f32(gamma[j]);
    sg += g;
    sgx += g * (to_f32(x[off + j]) - mu) * rstd;
  }
  const float mean_g = block_reduce<false>(sg, smem) / cols;
  const float mean_gx = block_reduce<false>(sgx, smem) / cols;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float g = to_f32(dy[off + j]) * to_f32(gamma[j]);
    const float xhat = (to_f32(x[off + j]) - mu) * rstd;
    dx[off + j] = from_f32<T>(rstd * (g - mean_g - xhat * mean_gx));
  }
}

// Partial column sums over one slice of rows: ws[slice][col] and ws[slices + slice][col].
template <typename T>
__global__ void ln_bwd_partial(const T* __restrict__ dy, const T* __restrict__ x,
                               const float* __restrict__ mean, const float* __restrict__ invvar,
                               float* __restrict__ ws, int64_t rows, int64_t cols) {
  const int64_t col = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (col >= cols) return;
  const int64_t per = (rows + kRowSlices - 1) / kRowSlices;
  const int64_t r0 = blockIdx.y * per, r1 = min(rows, r0 + per);
  float dg = 0.f, db = 0.f;
  for (int64_t r = r0; r < r1; ++r) {
    const float d = to_f32(dy[r * cols + col]);
    dg += d * (to_f32(x[r * cols + col]) - mean[r]) * invvar[r];
    db += d;
  }
  ws[blockIdx.y * cols + col] = dg;
  ws[(kRowSlices + blockIdx.y) * cols + col] = db;
}

template <typename T>
__global__ void ln_bwd_finish(const float* __restrict__ ws, T* __restrict__ dgamma,
                              T* __restrict__ dbeta, int64_t cols) {
  const int64_t col = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (col >= cols) return;
  float dg = 0.f, db = 0.f;
  for (int s = 0; s < kRowSlices; ++s) {
    dg += ws[s * cols + col];
    db += ws[(kRowSlices + s) * cols + col];
  }
  dgamma[col] = from_f32<T>(dg);
  dbeta[col] = from_f32<T>(db);
}

}  // namespace

cudaError_t layer_norm_fwd(DType dt, const void* x, const void* gamma, const void* beta, void* y,
                           float* mean, float* invvar, int64_t rows, int64_t cols, float eps,
                           cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  MZ_DISPATCH(dt, ln_fwd<T><<<rows, kThreads, 0, stream>>>(
                      static_cast<const T*>(x), static_cast<const T*>(gamma),
                      static_cast<const T*>(beta), static_cast<T*>(y), mean, invvar, cols, eps));
  return cudaGetLastError();
}

int64_t layer_norm_bwd_workspace_floats(int64_t cols) { return 2 * kRowSlices * cols; }

cudaError_t layer_norm_bwd(DType dt, const void* dy, const void* x, const float* mean,
                           const float* invvar, const void* gamma, void* dx, void* dgamma,
                           void* dbeta, float* workspace, int64_t rows, int64_t cols,
                           cudaStream_t stream) {
  const dim3 col_grid((cols + 127) / 128, kRowSlices);
  MZ_DISPATCH(dt, {
    const T* dy_ = static_cast<const T*>(dy);
    const T* x_ = static_cast<const T*>(x);
    if (rows > 0)
      ln_bwd_dx<T><<<rows, kThreads, 0, stream>>>(dy_, x_, mean, invvar,
                                                  static_cast<const T*>(gamma),
                                                  static_cast<T*>(dx), cols);
    ln_bwd_partial<T><<<col_grid, 128, 0, stream>>>(dy_, x_, mean, invvar, workspace, rows, cols);
    ln_bwd_finish<T><<<col_grid.x, 128, 0, stream>>>(workspace, static_cast<T*>(dgamma),
                                                     static_cast<T*>(dbeta), cols);
  });
  return cudaGetLastError();
}

}  // namespace mz_cuda
