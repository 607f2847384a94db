// megatron_zero._C_cpu_ops: fused fp32 CPU kernels behind megatron_zero.ops
// (bias-GeLU, the causal attention softmax, RMSNorm, the cross-entropy's exponentials), each with a PyTorch fallback.
#include "cpu_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bias_gelu_fwd", &bias_gelu_fwd, "GeLU_tanh(y + bias); an empty bias means none");
  m.def("bias_gelu_bwd", &bias_gelu_bwd, "d/dy of GeLU_tanh(y + bias) times dout");
  m.def("causal_softmax_fwd", &causal_softmax_fwd, "causal softmax of scale * x [batches, sq, sq + diag]",
        py::arg("x"), py::arg("scale"), py::arg("diag") = 0);
  m.def("causal_softmax_bwd", &causal_softmax_bwd, "its backward from the saved output", py::arg("dy"),
        py::arg("y"), py::arg("scale"), py::arg("diag") = 0);
  m.def("exp_shifted_rows", &exp_shifted_rows, "cross-entropy: (exp(x - shift per row), row sums)");
  m.def("rms_norm_fwd", &rms_norm_fwd, "RMSNorm forward: (y, 1/rms per row)");
  m.def("rms_norm_bwd", &rms_norm_bwd, "RMSNorm backward: (dx, dweight)");
}
