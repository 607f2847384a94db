// The exponentials of the cross-entropy's shifted logits in one pass: for fp32 rows x
// [N, V] and a shift per row (the row max over all TP ranks), e = exp(x - shift) in a
// new tensor and the row sums of e. -inf logits (vocabulary padding) give exactly 0.
#include "cpu_ops.h"
#include "vec_math.h"

namespace {

MZ_CLONES float exp_row(const float* x, float shift, float* e, int64_t v) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < v; ++j) {
    const float ej = mz::exp_f32(x[j] - shift);
    e[j] = ej;
    sum += ej;
  }
  return sum;
}

}  // namespace

std::vector<torch::Tensor> exp_shifted_rows(const torch::Tensor& x, const torch::Tensor& shift) {
  mz::check_rows(x, "exp_shifted_rows: x");
  const int64_t v = x.size(-1), rows = x.numel() / std::max<int64_t>(v, 1);
  mz::check_rows(shift, "exp_shifted_rows: shift");
  TORCH_CHECK(shift.numel() == rows, "exp_shifted_rows: shift has ", shift.numel(), " elements, expected ", rows);
  auto e = torch::empty_like(x);
  auto sums = torch::empty_like(shift);
  const float *xp = x.data_ptr<float>(), *sp = shift.data_ptr<float>();
  float *ep = e.data_ptr<float>(), *op = sums.data_ptr<float>();
  at::parallel_for(0, rows, mz::grain(v), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = exp_row(xp + r * v, sp[r], ep + r * v, v);
  });
  return {e, sums};
}
