// The causal attention softmax over [batches, sq, sk] fp32 scores: query row i keeps
// keys 0..diag+i, softmax(scale * x) over them, zeros after; diag = 0 with sq == sk is
// Megatron's scaled_upper_triang_masked_softmax, diag > 0 a block of queries that
// starts diag positions into the keys. Only the kept part of a row is read.
#include "cpu_ops.h"
#include "vec_math.h"

namespace {

MZ_CLONES void softmax_row(const float* x, float* y, int64_t keep, int64_t s, float scale) {
  float m = x[0];
#pragma omp simd reduction(max : m)
  for (int64_t j = 1; j < keep; ++j) m = x[j] > m ? x[j] : m;  // max is exact in any order
  const float shift = m * scale;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < keep; ++j) {
    const float e = mz::exp_f32(x[j] * scale - shift);
    y[j] = e;
    sum += e;
  }
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int64_t j = 0; j < keep; ++j) y[j] *= inv;
  for (int64_t j = keep; j < s; ++j) y[j] = 0.0f;
}

// dx = scale * y * (dy - sum_j dy_j y_j); masked keys get 0.
MZ_CLONES void softmax_bwd_row(const float* dy, const float* y, float* dx, int64_t keep, int64_t s, float scale) {
  float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
  for (int64_t j = 0; j < keep; ++j) dot += dy[j] * y[j];
#pragma omp simd
  for (int64_t j = 0; j < keep; ++j) dx[j] = scale * y[j] * (dy[j] - dot);
  for (int64_t j = keep; j < s; ++j) dx[j] = 0.0f;
}

void check_scores(const torch::Tensor& x, int64_t diag, const char* what) {
  mz::check_rows(x, what);
  TORCH_CHECK(x.dim() == 3 && diag >= 0 && x.size(2) == x.size(1) + diag, what,
              " must be [batches, sq, sq + diag] with diag >= 0, got ", x.sizes(), " and diag ", diag);
}

}  // namespace

torch::Tensor causal_softmax_fwd(const torch::Tensor& x, double scale, int64_t diag) {
  check_scores(x, diag, "causal_softmax_fwd: x");
  TORCH_CHECK(scale > 0, "causal_softmax_fwd: scale must be positive, got ", scale);
  const int64_t sq = x.size(1), s = x.size(2), rows = x.size(0) * sq;
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, mz::grain(s), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) softmax_row(xp + r * s, yp + r * s, diag + r % sq + 1, s, float(scale));
  });
  return y;
}

torch::Tensor causal_softmax_bwd(const torch::Tensor& dy, const torch::Tensor& y, double scale, int64_t diag) {
  check_scores(y, diag, "causal_softmax_bwd: y");
  mz::check_same(dy, y, "causal_softmax_bwd: dy");
  const int64_t sq = y.size(1), s = y.size(2), rows = y.size(0) * sq;
  auto dx = torch::empty_like(y);
  const float *gp = dy.data_ptr<float>(), *yp = y.data_ptr<float>();
  float* dp = dx.data_ptr<float>();
  at::parallel_for(0, rows, mz::grain(s), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      softmax_bwd_row(gp + r * s, yp + r * s, dp + r * s, diag + r % sq + 1, s, float(scale));
  });
  return dx;
}
