// GeLU with the tanh approximation of (y + bias), forward and backward, fp32 rows
// of width F (Megatron's bias_gelu; torch's F.gelu(approximate="tanh") formulas).
#include "cpu_ops.h"
#include "vec_math.h"

namespace {

constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kKappa = 0.044715f;

MZ_CLONES void gelu_fwd_row(const float* y, const float* b, float* out, int64_t f) {
#pragma omp simd
  for (int64_t j = 0; j < f; ++j) {
    const float x = y[j] + b[j];
    const float t = mz::tanh_f32(kBeta * (x + kKappa * x * x * x));
    out[j] = 0.5f * x * (1.0f + t);
  }
}

MZ_CLONES void gelu_bwd_row(const float* dout, const float* y, const float* b, float* dy, int64_t f) {
#pragma omp simd
  for (int64_t j = 0; j < f; ++j) {
    const float x = y[j] + b[j];
    const float t = mz::tanh_f32(kBeta * (x + kKappa * x * x * x));
    const float inner_d = kBeta * (1.0f + 3.0f * kKappa * x * x);
    dy[j] = dout[j] * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * inner_d);
  }
}

}  // namespace

torch::Tensor bias_gelu_fwd(const torch::Tensor& y, const torch::Tensor& bias) {
  mz::check_rows(y, "bias_gelu_fwd: y");
  const int64_t f = y.size(-1), rows = y.numel() / std::max<int64_t>(f, 1);
  const torch::Tensor b_or_0 = bias.numel() ? bias : torch::zeros({f}, y.options());
  const float* b = mz::optional_vector(b_or_0, f, "bias_gelu_fwd: bias");
  auto out = torch::empty_like(y);
  const float* yp = y.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, mz::grain(f), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) gelu_fwd_row(yp + r * f, b, op + r * f, f);
  });
  return out;
}

torch::Tensor bias_gelu_bwd(const torch::Tensor& dout, const torch::Tensor& y, const torch::Tensor& bias) {
  mz::check_rows(y, "bias_gelu_bwd: y");
  mz::check_same(dout, y, "bias_gelu_bwd: dout");
  const int64_t f = y.size(-1), rows = y.numel() / std::max<int64_t>(f, 1);
  const torch::Tensor b_or_0 = bias.numel() ? bias : torch::zeros({f}, y.options());
  const float* b = mz::optional_vector(b_or_0, f, "bias_gelu_bwd: bias");
  auto dy = torch::empty_like(y);
  const float *gp = dout.data_ptr<float>(), *yp = y.data_ptr<float>();
  float* dp = dy.data_ptr<float>();
  at::parallel_for(0, rows, mz::grain(f), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) gelu_bwd_row(gp + r * f, yp + r * f, b, dp + r * f, f);
  });
  return dy;
}
