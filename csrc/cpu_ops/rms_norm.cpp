// RMSNorm over the last dimension of fp32 rows: y = w * (x / sqrt(mean(x^2) + eps)).
// Forward keeps 1/rms per row. Backward sums dweight over fixed blocks of rows and
// then over the blocks in order, so the result does not depend on the thread count.
#include "cpu_ops.h"
#include "vec_math.h"

#include <cmath>
#include <vector>

namespace {

constexpr int64_t kBlockRows = 64;

MZ_CLONES float rms_fwd_row(const float* x, const float* w, float* y, int64_t h, float eps) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < h; ++j) ss += x[j] * x[j];
  const float inv = 1.0f / std::sqrt(ss / float(h) + eps);
#pragma omp simd
  for (int64_t j = 0; j < h; ++j) y[j] = w[j] * (x[j] * inv);
  return inv;
}

// dx = inv * (g - xhat * mean(g * xhat)) with g = dy * w, xhat = x * inv; dw += dy * xhat.
MZ_CLONES void rms_bwd_row(const float* dy, const float* x, float inv, const float* w, float* dx, float* dw,
                           int64_t h) {
  float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
  for (int64_t j = 0; j < h; ++j) dot += dy[j] * w[j] * (x[j] * inv);
  const float mean = dot / float(h);
#pragma omp simd
  for (int64_t j = 0; j < h; ++j) {
    const float xhat = x[j] * inv;
    dx[j] = inv * (dy[j] * w[j] - xhat * mean);
    dw[j] += dy[j] * xhat;
  }
}

}  // namespace

std::vector<torch::Tensor> rms_norm_fwd(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  mz::check_rows(x, "rms_norm_fwd: x");
  const int64_t h = x.size(-1), rows = x.numel() / std::max<int64_t>(h, 1);
  const float* w = mz::optional_vector(weight, h, "rms_norm_fwd: weight");
  TORCH_CHECK(w != nullptr, "rms_norm_fwd: weight is empty");
  auto y = torch::empty_like(x);
  auto invrms = torch::empty({rows}, x.options());
  const float* xp = x.data_ptr<float>();
  float *yp = y.data_ptr<float>(), *ip = invrms.data_ptr<float>();
  at::parallel_for(0, rows, mz::grain(h), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) ip[r] = rms_fwd_row(xp + r * h, w, yp + r * h, h, float(eps));
  });
  return {y, invrms};
}

std::vector<torch::Tensor> rms_norm_bwd(const torch::Tensor& dy, const torch::Tensor& x,
                                        const torch::Tensor& invrms, const torch::Tensor& weight) {
  mz::check_rows(x, "rms_norm_bwd: x");
  mz::check_same(dy, x, "rms_norm_bwd: dy");
  const int64_t h = x.size(-1), rows = x.numel() / std::max<int64_t>(h, 1);
  const float* w = mz::optional_vector(weight, h, "rms_norm_bwd: weight");
  TORCH_CHECK(w != nullptr, "rms_norm_bwd: weight is empty");
  mz::check_rows(invrms, "rms_norm_bwd: invrms");
  TORCH_CHECK(invrms.numel() == rows, "rms_norm_bwd: invrms has ", invrms.numel(), " elements, expected ", rows);
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  auto dx = torch::empty_like(x);
  auto partial = torch::zeros({std::max<int64_t>(blocks, 1), h}, x.options());
  const float *gp = dy.data_ptr<float>(), *xp = x.data_ptr<float>(), *ip = invrms.data_ptr<float>();
  float *dp = dx.data_ptr<float>(), *pp = partial.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t r = b * kBlockRows; r < std::min(rows, (b + 1) * kBlockRows); ++r)
        rms_bwd_row(gp + r * h, xp + r * h, ip[r], w, dp + r * h, pp + b * h, h);
  });
  for (int64_t b = 1; b < blocks; ++b) {  // in block order: deterministic
    float* acc = pp;
    const float* part = pp + b * h;
    for (int64_t j = 0; j < h; ++j) acc[j] += part[j];
  }
  return {dx, partial[0].clone()};
}
