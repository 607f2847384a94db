"""FLOPs per iteration for a GPT (Megatron's formula), the TFLOP/s per rank it implies, and MFU.

MFU (model FLOPs utilisation) is achieved model TFLOP/s per rank over the device's peak for the
training dtype. The peak is `--peak-tflops` when given; otherwise the dense peak of a known
accelerator (PEAK_TFLOPS, from the vendors' data sheets, without sparsity); otherwise none, and MFU
is not reported: a CPU has no peak that this code could know (give --peak-tflops to get one).
"""
from typing import Optional, Tuple

import torch

# device name substring -> dense peak TFLOP/s by training dtype (NVIDIA data sheets, SXM parts;
# fp32 means TF32 tensor cores, which torch uses for fp32 matmuls only when allowed: an upper bound)
PEAK_TFLOPS = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.5},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.5},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0},
    "V100": {"bf16": 0.0, "fp16": 125.0, "fp32": 15.7},
}


def gpt_flops_per_iteration(batch_size: int, seq_length: int, num_layers: int, hidden_size: int,
                            vocab_size: int, ffn_hidden_size: int = None, qkv_size: int = None,
                            swiglu: bool = False, attention: Optional[Tuple[int, int]] = None) -> float:
    """Forward + backward FLOPs of one global batch (no activation recomputation).

    The standard 6N-per-token count for the weight matmuls plus the attention
    score and context matmuls: per layer and token, forward 2*(4h^2 + 2h*ffn)
    for QKV/dense/MLP and 4*s*h for attention; backward twice the forward; and
    the logit layer 2*h*V forward. Grouped-query attention shrinks QKV to `qkv_size` rows
    (default 3h); SwiGLU doubles the first MLP matmul. `attention`: another attention's (weights per layer,
    the width its score and context matmuls run over per position: heads x (q head + v head)), e.g.
    multi-latent attention's (model/mla.py's `mla_flop_sizes`); the default is (h qkv + h^2, 2h).
    """
    h, s, L, V = hidden_size, seq_length, num_layers, vocab_size
    ffn = ffn_hidden_size or 4 * h
    qkv = qkv_size or 3 * h
    mlp_in = 2 * ffn if swiglu else ffn
    weights, width = attention or (h * qkv + h * h, 2 * h)
    per_token_forward = L * (2 * (weights + h * mlp_in + ffn * h) + 2 * s * width) + 2 * h * V
    return 3.0 * per_token_forward * batch_size * s


def model_flops_per_iteration(config, global_batch_size: int, tp_size: int = 1) -> float:
    """gpt_flops_per_iteration of a GPTConfig's model (what the log's TFLOP/s and MFU and the planner's step time
    count): an MoE token runs its top-k experts' MLPs and the shared expert's, multi-latent attention its own
    matmuls (model/mla.py's `mla_flop_sizes`)."""
    from ..model.mla import mla_flop_sizes
    c = config
    ffn = c.ffn_hidden_size
    if c.num_experts:
        ffn = c.moe_router_topk * c.moe_ffn_hidden_size + (c.moe_shared_expert_intermediate_size or 0)
    return gpt_flops_per_iteration(global_batch_size, c.seq_length, c.num_layers, c.hidden_size,
                                   c.padded_vocab_size(tp_size), ffn, c.qkv_size, c.swiglu, mla_flop_sizes(c))


def tflops_per_rank(flops: float, seconds: float, world_size: int) -> float:
    return flops / seconds / world_size / 1e12 if seconds > 0 else 0.0


def peak_tflops(device: torch.device, dtype: str, given: Optional[float] = None) -> Optional[float]:
    """--peak-tflops if given, else the known dense peak of `device` for `dtype`, else None."""
    if given is not None:
        return given
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_TFLOPS.items():
        if key in name and peaks.get(dtype):
            return peaks[dtype]
    return None


def mfu(tflops: float, peak: Optional[float]) -> Optional[float]:
    """Fraction of the peak achieved, or None without a peak."""
    return tflops / peak if peak else None
