// Shared checks and declarations of megatron_zero._C_cpu_ops (fp32, contiguous, CPU).
#pragma once
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace mz {

inline void check_rows(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be on the CPU, got ", t.device());
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, what, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), what, " must be contiguous");
  TORCH_CHECK(t.dim() >= 1, what, " must have at least one dimension");
}

inline void check_same(const torch::Tensor& t, const torch::Tensor& like, const char* what) {
  check_rows(t, what);
  TORCH_CHECK(t.sizes() == like.sizes(), what, " has shape ", t.sizes(), ", expected ", like.sizes());
}

// The data of an optional fp32 vector of n elements (an empty tensor stands for none: null).
inline const float* optional_vector(const torch::Tensor& v, int64_t n, const char* what) {
  if (v.numel() == 0) return nullptr;
  check_rows(v, what);
  TORCH_CHECK(v.numel() == n, what, " has ", v.numel(), " elements, expected ", n);
  return v.data_ptr<float>();
}

// Rows per task for at::parallel_for: about 32K elements.
inline int64_t grain(int64_t row) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row, 1)); }

}  // namespace mz

torch::Tensor bias_gelu_fwd(const torch::Tensor& y, const torch::Tensor& bias);
torch::Tensor bias_gelu_bwd(const torch::Tensor& dout, const torch::Tensor& y, const torch::Tensor& bias);
torch::Tensor causal_softmax_fwd(const torch::Tensor& x, double scale, int64_t diag);
torch::Tensor causal_softmax_bwd(const torch::Tensor& dy, const torch::Tensor& y, double scale, int64_t diag);
std::vector<torch::Tensor> exp_shifted_rows(const torch::Tensor& x, const torch::Tensor& shift);
std::vector<torch::Tensor> rms_norm_fwd(const torch::Tensor& x, const torch::Tensor& weight, double eps);
std::vector<torch::Tensor> rms_norm_bwd(const torch::Tensor& dy, const torch::Tensor& x,
                                        const torch::Tensor& invrms, const torch::Tensor& weight);
