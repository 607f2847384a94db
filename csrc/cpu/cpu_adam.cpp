// megatron_zero._C_cpu_adam: one fused, multi-threaded AdamW step over flat fp32
// tensors, optionally writing the bf16/fp16 copy of the new weights in the same
// pass (what ZeRO-Offload hands back to the GPU). Math is torch.optim.AdamW's.
// The caller says how many threads step it (ZeRO-Offload's --cpu-optimizer-threads):
// torch's intra-op count is 1 per rank under torchrun, which would leave the
// offloaded step on one core. Every element's update is independent of the
// split, so the result is bit-identical for any thread count.
#include <torch/extension.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <utility>
#include <vector>

#include "adam_isa.h"

namespace {

using KernelFn = void (*)(const mz::AdamRange&, const mz::AdamScalars&);

struct Kernel {
  KernelFn fn;
  const char* isa;
};

Kernel pick_kernel() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma"))
    return {mz::adam_range_avx512, "avx512"};
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    return {mz::adam_range_avx2, "avx2"};
#endif
  return {mz::adam_range_default, "default"};
}

const Kernel& kernel() {
  static const Kernel k = pick_kernel();
  return k;
}

void check_flat(const torch::Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu(), "cpu_adam: ", name, " must be on the CPU, got ", t.device());
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, "cpu_adam: ", name, " must be float32, got ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "cpu_adam: ", name, " must be contiguous");
  TORCH_CHECK(t.numel() == numel, "cpu_adam: ", name, " has ", t.numel(),
              " elements but param has ", numel);
}

// The kernel's loops promise the compiler that no two arrays share memory.
void check_disjoint(const std::vector<std::pair<const char*, const torch::Tensor*>>& ts) {
  for (size_t i = 0; i < ts.size(); ++i)
    for (size_t j = i + 1; j < ts.size(); ++j) {
      const auto* a = static_cast<const char*>(ts[i].second->data_ptr());
      const auto* b = static_cast<const char*>(ts[j].second->data_ptr());
      const bool overlap = a < b + ts[j].second->nbytes() && b < a + ts[i].second->nbytes();
      TORCH_CHECK(!overlap || ts[i].second->numel() == 0, "cpu_adam: ", ts[i].first, " and ",
                  ts[j].first, " share memory; each needs its own buffer");
    }
}

int64_t adam_step(torch::Tensor param, torch::Tensor grad, torch::Tensor exp_avg,
               torch::Tensor exp_avg_sq, int64_t step, double lr, double beta1, double beta2,
               double eps, double weight_decay, c10::optional<torch::Tensor> low_out,
               int64_t num_threads) {
  const int64_t n = param.numel();
  TORCH_CHECK(num_threads >= 1, "cpu_adam: num_threads must be >= 1, got ", num_threads);
  check_flat(param, "param", n);
  check_flat(grad, "grad", n);
  check_flat(exp_avg, "exp_avg", n);
  check_flat(exp_avg_sq, "exp_avg_sq", n);
  TORCH_CHECK(step >= 1, "cpu_adam: step must be >= 1 (the count after this update), got ", step);
  int low_kind = mz::kLowNone;
  uint16_t* low = nullptr;
  if (low_out.has_value()) {
    const torch::Tensor& o = *low_out;
    TORCH_CHECK(o.device().is_cpu() && o.is_contiguous() && o.numel() == n,
                "cpu_adam: low_out must be a contiguous CPU tensor with ", n, " elements");
    TORCH_CHECK(o.scalar_type() == torch::kBFloat16 || o.scalar_type() == torch::kFloat16,
                "cpu_adam: low_out must be bfloat16 or float16, got ", o.scalar_type());
    low_kind = o.scalar_type() == torch::kBFloat16 ? mz::kLowBF16 : mz::kLowF16;
    low = reinterpret_cast<uint16_t*>(o.data_ptr());
  }
  std::vector<std::pair<const char*, const torch::Tensor*>> arrays{
      {"param", &param}, {"grad", &grad}, {"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}};
  if (low_out.has_value()) arrays.emplace_back("low_out", &*low_out);
  check_disjoint(arrays);
  // Same double-precision folding as torch/optim/adam.py (_single_tensor_adam).
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  const mz::AdamScalars s{
      static_cast<float>(weight_decay != 0.0 ? 1.0 - lr * weight_decay : 1.0),
      static_cast<float>(1.0 - beta1),
      static_cast<float>(beta2),
      static_cast<float>(1.0 - beta2),
      static_cast<float>(std::pow(bc2, 0.5)),  // adam.py: bias_correction2**0.5
      static_cast<float>(eps),
      static_cast<float>(-(lr / bc1))};
  float* p = param.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  const KernelFn fn = kernel().fn;
  auto run = [&](int64_t begin, int64_t end) {
    const mz::AdamRange r{p + begin, m + begin, v + begin, g + begin,
                          low ? low + begin : nullptr, low_kind, end - begin};
    fn(r, s);
  };
  // Threads take chunks from a shared counter rather than one fixed slice each,
  // so a thread the OS preempts (a busy machine) does not hold up the step.
  // About 8 chunks per thread, each at least 64K elements: long runs for the
  // hardware prefetcher, small enough to rebalance. Returns the threads that ran
  // (fewer than asked only when there are fewer chunks than threads).
  const int64_t kChunk = std::max<int64_t>(1 << 16, ((n / (8 * num_threads)) + 15) / 16 * 16);
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  const int threads = static_cast<int>(std::min<int64_t>(num_threads, chunks));
  if (threads <= 1) {
    run(0, n);
    return 1;
  }
  std::atomic<int64_t> next{0};
  std::atomic<int> ran{0};
#pragma omp parallel num_threads(threads)
  {
    if (omp_get_thread_num() == 0) ran = omp_get_num_threads();
    for (int64_t c = next++; c < chunks; c = next++) run(c * kChunk, std::min(n, (c + 1) * kChunk));
  }
  return ran.load();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.doc() = "Fused multi-threaded AdamW step on the CPU (torch.optim.AdamW's math)";
  // The Python side checks this (ops/registry.py API_VERSIONS): 2 = adam_step takes num_threads.
  mod.attr("api_version") = 2;
  mod.def("adam_step", &adam_step, "In-place AdamW step on flat fp32 tensors with num_threads threads; returns the threads that ran",
          py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
          py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
          py::arg("weight_decay"), py::arg("low_out").none(true), py::arg("num_threads"),
          py::call_guard<py::gil_scoped_release>());  // ZeRO-Offload overlaps it with Python
  mod.def("isa", [] { return std::string(kernel().isa); },
          "The instruction set the kernel dispatched to on this CPU");
}
