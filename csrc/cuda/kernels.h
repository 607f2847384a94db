// Launchers of the CUDA kernels Megatron relies on. Plain CUDA C++: no torch
// headers, so nvcc compiles every .cu here on its own (CI does, for sm_80 and
// sm_90, even without a GPU); bindings.cpp adapts them to torch tensors.
// Every launcher enqueues on `stream` and returns cudaGetLastError().
#pragma once
#include <cuda_runtime_api.h>
#include <stdint.h>

namespace mz_cuda {

enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

// LayerNorm over rows of length `cols`; x, y, gamma, beta in `dt`; the row
// statistics mean and 1/std are fp32 [rows].
cudaError_t layer_norm_fwd(DType dt, const void* x, const void* gamma, const void* beta, void* y,
                           float* mean, float* invvar, int64_t rows, int64_t cols, float eps,
                           cudaStream_t stream);
// dgamma/dbeta are summed in a fixed order through `workspace` (fp32, of
// layer_norm_bwd_workspace_floats(cols) elements): deterministic.
int64_t layer_norm_bwd_workspace_floats(int64_t cols);
cudaError_t layer_norm_bwd(DType dt, const void* dy, const void* x, const float* mean,
                           const float* invvar, const void* gamma, void* dx, void* dgamma,
                           void* dbeta, float* workspace, int64_t rows, int64_t cols,
                           cudaStream_t stream);

// RMSNorm over rows of length `cols`: y = gamma * T(x / rms(x)); x, y, gamma
// in `dt`; invrms (1/rms per row) is fp32 [rows].
cudaError_t rms_norm_fwd(DType dt, const void* x, const void* gamma, void* y, float* invrms,
                         int64_t rows, int64_t cols, float eps, cudaStream_t stream);
// dgamma is summed in a fixed order through `workspace` (fp32, of
// rms_norm_bwd_workspace_floats(cols) elements): deterministic.
int64_t rms_norm_bwd_workspace_floats(int64_t cols);
cudaError_t rms_norm_bwd(DType dt, const void* dy, const void* x, const float* invrms,
                         const void* gamma, void* dx, void* dgamma, float* workspace, int64_t rows,
                         int64_t cols, cudaStream_t stream);

// Rotary embedding of the first `rot` features of each row of t [rows, dim],
// row r at position r % seq, with fp32 cos/sin tables [seq, rot]; `inverse`
// rotates the other way (the backward pass).
cudaError_t rope_apply(DType dt, const void* t, const float* cos_t, const float* sin_t, void* out,
                       int64_t rows, int64_t dim, int64_t rot, int64_t seq, bool inverse,
                       cudaStream_t stream);

// softmax(scale * x) over the last dim of x [batches, seq, seq] with key > query
// masked out (probability 0); accumulation in fp32.
cudaError_t causal_softmax_fwd(DType dt, const void* x, void* y, int64_t batches, int64_t seq,
                               float scale, cudaStream_t stream);
// dx = scale * y * (dy - sum(dy * y)) per row.
cudaError_t causal_softmax_bwd(DType dt, const void* dy, const void* y, void* dx,
                               int64_t batches, int64_t seq, float scale, cudaStream_t stream);

// out = gelu_tanh(y + bias), bias of length `hidden` broadcast over rows.
cudaError_t bias_gelu_fwd(DType dt, const void* y, const void* bias, void* out, int64_t n,
                          int64_t hidden, cudaStream_t stream);
// dy = dout * gelu_tanh'(y + bias); dbias is the column sum of dy (done by the caller).
cudaError_t bias_gelu_bwd(DType dt, const void* dout, const void* y, const void* bias, void* dy,
                          int64_t n, int64_t hidden, cudaStream_t stream);

// One fp32 tensor's AdamW state, as laid out in the device table below.
struct AdamTensor {
  float* p;
  const float* g;
  float* m;
  float* v;
  int64_t n;
};

// Scalars folded on the host as torch.optim.AdamW folds them.
struct AdamScalars {
  float decay, one_minus_b1, beta2, one_minus_b2, bc2_sqrt, eps, neg_step_size;
};

// AdamW over many tensors in one launch: chunk c covers elements
// [chunk_start[c], chunk_start[c] + chunk_size) of tensors[chunk_tensor[c]];
// all three tables are device memory.
cudaError_t multi_tensor_adamw(const AdamTensor* tensors, const int* chunk_tensor,
                               const int64_t* chunk_start, int num_chunks, int64_t chunk_size,
                               AdamScalars s, cudaStream_t stream);

}  // namespace mz_cuda
