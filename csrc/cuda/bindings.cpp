// megatron_zero._C_cuda: torch bindings of the launchers in kernels.h. Built
// only when torch is a CUDA build (csrc/extensions.py); shapes are checked here.
// Every binding first makes its input tensor's device current (a CUDAGuard), so
// its allocations, its stream and its launch are on that tensor's GPU whatever
// device the calling thread has current (tests/test_cuda_bindings_guard.py).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace {

mz_cuda::DType dtype_of(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return mz_cuda::kF32;
    case torch::kFloat16: return mz_cuda::kF16;
    case torch::kBFloat16: return mz_cuda::kBF16;
    default: TORCH_CHECK(false, "megatron_zero._C_cuda: unsupported dtype ", t.scalar_type());
  }
}

void check(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "megatron_zero._C_cuda: ", what, " failed: ",
              cudaGetErrorString(err));
}

void check_cuda(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.is_contiguous(), "megatron_zero._C_cuda: ", name,
              " must be a contiguous CUDA tensor");
}

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream(); }

std::vector<torch::Tensor> layer_norm_fwd(torch::Tensor x, torch::Tensor gamma,
                                          torch::Tensor beta, double eps) {
  check_cuda(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  TORCH_CHECK(gamma.numel() == cols && beta.numel() == cols, "layer_norm: weight/bias size");
  auto y = torch::empty_like(x);
  auto stats = x.new_empty({2, rows}, x.options().dtype(torch::kFloat32));
  check(mz_cuda::layer_norm_fwd(dtype_of(x), x.data_ptr(), gamma.data_ptr(), beta.data_ptr(),
                                y.data_ptr(), stats[0].data_ptr<float>(),
                                stats[1].data_ptr<float>(), rows, cols, float(eps), stream()),
        "layer_norm_fwd");
  return {y, stats[0], stats[1]};
}

std::vector<torch::Tensor> layer_norm_bwd(torch::Tensor dy, torch::Tensor x, torch::Tensor mean,
                                          torch::Tensor invvar, torch::Tensor gamma) {
  check_cuda(dy, "dy");
  const c10::cuda::CUDAGuard guard(dy.device());
  check_cuda(x, "x");
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  auto dx = torch::empty_like(x);
  auto dgamma = torch::empty_like(gamma);
  auto dbeta = torch::empty_like(gamma);
  auto ws = torch::empty({mz_cuda::layer_norm_bwd_workspace_floats(cols)},
                         x.options().dtype(torch::kFloat32));
  check(mz_cuda::layer_norm_bwd(dtype_of(x), dy.data_ptr(), x.data_ptr(),
                                mean.contiguous().data_ptr<float>(),
                                invvar.contiguous().data_ptr<float>(), gamma.data_ptr(),
                                dx.data_ptr(), dgamma.data_ptr(), dbeta.data_ptr(),
                                ws.data_ptr<float>(), rows, cols, stream()),
        "layer_norm_bwd");
  return {dx, dgamma, dbeta};
}

std::vector<torch::Tensor> rms_norm_fwd(torch::Tensor x, torch::Tensor gamma, double eps) {
  check_cuda(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  TORCH_CHECK(gamma.numel() == cols, "rms_norm: weight size");
  auto y = torch::empty_like(x);
  auto invrms = x.new_empty({rows}, x.options().dtype(torch::kFloat32));
  check(mz_cuda::rms_norm_fwd(dtype_of(x), x.data_ptr(), gamma.data_ptr(), y.data_ptr(),
                              invrms.data_ptr<float>(), rows, cols, float(eps), stream()),
        "rms_norm_fwd");
  return {y, invrms};
}

std::vector<torch::Tensor> rms_norm_bwd(torch::Tensor dy, torch::Tensor x, torch::Tensor invrms,
                                        torch::Tensor gamma) {
  check_cuda(dy, "dy");
  const c10::cuda::CUDAGuard guard(dy.device());
  check_cuda(x, "x");
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  auto dx = torch::empty_like(x);
  auto dgamma = torch::empty_like(gamma);
  auto ws = torch::empty({mz_cuda::rms_norm_bwd_workspace_floats(cols)},
                         x.options().dtype(torch::kFloat32));
  check(mz_cuda::rms_norm_bwd(dtype_of(x), dy.data_ptr(), x.data_ptr(),
                              invrms.contiguous().data_ptr<float>(), gamma.data_ptr(),
                              dx.data_ptr(), dgamma.data_ptr(), ws.data_ptr<float>(), rows, cols,
                              stream()),
        "rms_norm_bwd");
  return {dx, dgamma};
}

torch::Tensor rope_apply(torch::Tensor t, torch::Tensor cos_t, torch::Tensor sin_t, bool inverse) {
  check_cuda(t, "t");
  const c10::cuda::CUDAGuard guard(t.device());
  check_cuda(cos_t, "cos");
  check_cuda(sin_t, "sin");
  TORCH_CHECK(t.dim() >= 2 && cos_t.dim() == 2 && cos_t.sizes() == sin_t.sizes() &&
                  cos_t.scalar_type() == torch::kFloat32 && sin_t.scalar_type() == torch::kFloat32,
              "rope: t must be [..., seq, dim] and cos/sin fp32 [seq, rot]");
  const int64_t seq = t.size(-2), dim = t.size(-1), rot = cos_t.size(1);
  TORCH_CHECK(cos_t.size(0) == seq && rot <= dim && rot % 2 == 0, "rope: table shape ",
              cos_t.sizes(), " does not fit t ", t.sizes());
  auto out = torch::empty_like(t);
  check(mz_cuda::rope_apply(dtype_of(t), t.data_ptr(), cos_t.data_ptr<float>(),
                            sin_t.data_ptr<float>(), out.data_ptr(), t.numel() / dim, dim, rot,
                            seq, inverse, stream()),
        "rope_apply");
  return out;
}

torch::Tensor causal_softmax_fwd(torch::Tensor x, double scale) {
  check_cuda(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK(x.dim() == 3 && x.size(1) == x.size(2), "causal softmax: x must be [b, sq, sq]");
  auto y = torch::empty_like(x);
  check(mz_cuda::causal_softmax_fwd(dtype_of(x), x.data_ptr(), y.data_ptr(), x.size(0),
                                    x.size(1), float(scale), stream()),
        "causal_softmax_fwd");
  return y;
}

torch::Tensor causal_softmax_bwd(torch::Tensor dy, torch::Tensor y, double scale) {
  check_cuda(dy, "dy");
  const c10::cuda::CUDAGuard guard(dy.device());
  check_cuda(y, "y");
  auto dx = torch::empty_like(y);
  check(mz_cuda::causal_softmax_bwd(dtype_of(y), dy.data_ptr(), y.data_ptr(), dx.data_ptr(),
                                    y.size(0), y.size(1), float(scale), stream()),
        "causal_softmax_bwd");
  return dx;
}

torch::Tensor bias_gelu_fwd(torch::Tensor y, torch::Tensor bias) {
  check_cuda(y, "y");
  const c10::cuda::CUDAGuard guard(y.device());
  auto out = torch::empty_like(y);
  check(mz_cuda::bias_gelu_fwd(dtype_of(y), y.data_ptr(), bias.data_ptr(), out.data_ptr(),
                               y.numel(), bias.numel(), stream()),
        "bias_gelu_fwd");
  return out;
}

torch::Tensor bias_gelu_bwd(torch::Tensor dout, torch::Tensor y, torch::Tensor bias) {
  check_cuda(dout, "dout");
  const c10::cuda::CUDAGuard guard(dout.device());
  auto dy = torch::empty_like(y);
  check(mz_cuda::bias_gelu_bwd(dtype_of(y), dout.data_ptr(), y.data_ptr(), bias.data_ptr(),
                               dy.data_ptr(), y.numel(), bias.numel(), stream()),
        "bias_gelu_bwd");
  return dy;
}

void multi_tensor_adamw(std::vector<torch::Tensor> params, std::vector<torch::Tensor> grads,
                        std::vector<torch::Tensor> exp_avgs, std::vector<torch::Tensor> exp_avg_sqs,
                        int64_t step, double lr, double beta1, double beta2, double eps,
                        double weight_decay) {
  constexpr int64_t kChunk = 1 << 16;
  const size_t k = params.size();
  TORCH_CHECK(grads.size() == k && exp_avgs.size() == k && exp_avg_sqs.size() == k,
              "multi_tensor_adamw: list lengths differ");
  if (k == 0) return;
  check_cuda(params[0], "params[0]");
  const c10::cuda::CUDAGuard guard(params[0].device());
  std::vector<mz_cuda::AdamTensor> tensors(k);
  std::vector<int> chunk_tensor;
  std::vector<int64_t> chunk_start;
  for (size_t i = 0; i < k; ++i) {
    const int64_t n = params[i].numel();
    for (const auto* t : {&grads[i], &exp_avgs[i], &exp_avg_sqs[i]})
      TORCH_CHECK(t->numel() == n, "multi_tensor_adamw: tensor ", i, " sizes differ");
    tensors[i] = {params[i].data_ptr<float>(), grads[i].data_ptr<float>(),
                  exp_avgs[i].data_ptr<float>(), exp_avg_sqs[i].data_ptr<float>(), n};
    for (int64_t s = 0; s < n; s += kChunk) {
      chunk_tensor.push_back(static_cast<int>(i));
      chunk_start.push_back(s);
    }
  }
  // One host buffer -> one copy: [tensors | chunk_start | chunk_tensor].
  const size_t tb = k * sizeof(mz_cuda::AdamTensor), sb = chunk_start.size() * sizeof(int64_t);
  const size_t bytes = tb + sb + chunk_tensor.size() * sizeof(int);
  auto host = torch::empty({int64_t(bytes)}, torch::dtype(torch::kUInt8).pinned_memory(true));
  std::memcpy(host.data_ptr(), tensors.data(), tb);
  std::memcpy(host.data_ptr<uint8_t>() + tb, chunk_start.data(), sb);
  std::memcpy(host.data_ptr<uint8_t>() + tb + sb, chunk_tensor.data(), bytes - tb - sb);
  auto dev = host.to(params[0].device(), /*non_blocking=*/true);
  const uint8_t* d = dev.data_ptr<uint8_t>();
  const double bc1 = 1.0 - std::pow(beta1, double(step));
  const double bc2 = 1.0 - std::pow(beta2, double(step));
  const mz_cuda::AdamScalars s{float(weight_decay != 0.0 ? 1.0 - lr * weight_decay : 1.0),
                               float(1.0 - beta1), float(beta2), float(1.0 - beta2),
                               float(std::pow(bc2, 0.5)), float(eps), float(-(lr / bc1))};
  check(mz_cuda::multi_tensor_adamw(reinterpret_cast<const mz_cuda::AdamTensor*>(d),
                                    reinterpret_cast<const int*>(d + tb + sb),
                                    reinterpret_cast<const int64_t*>(d + tb),
                                    static_cast<int>(chunk_start.size()), kChunk, s, stream()),
        "multi_tensor_adamw");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.doc() =
      "Fused CUDA kernels: LayerNorm, RMSNorm, RoPE, causal softmax, bias+GeLU, multi-tensor AdamW";
  mod.def("layer_norm_fwd", &layer_norm_fwd);
  mod.def("layer_norm_bwd", &layer_norm_bwd);
  mod.def("rms_norm_fwd", &rms_norm_fwd);
  mod.def("rms_norm_bwd", &rms_norm_bwd);
  mod.def("rope_apply", &rope_apply);
  mod.def("causal_softmax_fwd", &causal_softmax_fwd);
  mod.def("causal_softmax_bwd", &causal_softmax_bwd);
  mod.def("bias_gelu_fwd", &bias_gelu_fwd);
  mod.def("bias_gelu_bwd", &bias_gelu_bwd);
  mod.def("multi_tensor_adamw", &multi_tensor_adamw);
}
