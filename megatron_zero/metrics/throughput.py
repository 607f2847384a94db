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
                            swiglu: bool = False, attention: Optional[Tuple[int, int]] = None,
                            causal: bool = True) -> float:
    """Forward + backward FLOPs of one global batch of a model whose every layer is dense (no activation
    recomputation), Megatron-LM's count.

    Per layer and token, forward: 2 per multiply-add of each weight (QKV, output projection, the MLP's two
    matmuls; grouped-query attention shrinks QKV to `qkv_size` rows, default 3h; SwiGLU doubles the first MLP
    matmul) and the attention's score and context matmuls, 2 x s x width each position, halved by the causal mask
    (`causal`; False: the whole s x s, as an unfused core multiplies it); the logit layer 2 x h x V; backward twice
    the forward. `attention`: another attention's (weights per layer, width: heads x (q head + v head)), e.g.
    multi-latent attention's (model/mla.py's `mla_flop_sizes`); the default is (h qkv + h^2, 2h).
    """
    h = hidden_size
    ffn = ffn_hidden_size or 4 * h
    mlp = num_layers * h * ((2 * ffn if swiglu else ffn) + ffn)
    return _flops(batch_size, seq_length, h, vocab_size, num_layers,
                  attention or (h * (qkv_size or 3 * h) + h * h, 2 * h), mlp, causal=causal)


def _flops(batch_size: int, s: int, h: int, vocab_size: int, layers: int, attention: Tuple[int, int],
           mlp_weights: int, mtp_depths: int = 0, causal: bool = True) -> float:
    """3 x (forward FLOPs per token) x tokens: 2 per multiply-add of every weight a token meets (the layers'
    attention weights, `mlp_weights` summed over the layers, each MTP depth's three norms and its 2h -> h
    projection, one logit layer per output), and each layer's attention core."""
    weights, width = attention
    core = layers * s * width * (1 if causal else 2)
    per_token_forward = (2 * (layers * weights + mlp_weights + mtp_depths * (3 * h + 2 * h * h)
                              + (mtp_depths + 1) * h * vocab_size) + core)
    return 3.0 * per_token_forward * batch_size * s


def model_flops_per_iteration(config, global_batch_size: int, tp_size: int = 1) -> float:
    """Forward + backward FLOPs of one global batch of a GPTConfig's model, Megatron-LM's count
    (`num_floating_point_operations` of its megatron/training/training.py), what the log's TFLOP/s and MFU and the
    planner's step time count:

    - a dense layer's MLP is ffn_hidden_size wide; an MoE layer's (`--moe-layer-freq`: the dense first layers stay
      dense) is its top-k experts' (moe_ffn_hidden_size) and its shared expert's;
    - attention: QKV and the output projection over heads x kv_channels, or multi-latent attention's own
      projections (model/mla.py's `mla_flop_sizes`) and the norms of its q and kv latents (one multiply-add per
      element, as Megatron-LM counts them); the score and context matmuls over the causal half;
    - each multi-token prediction depth (`--mtp-num-layers`): a layer built like the last block (MoE where it is),
      its three norms (3h) and its 2h -> h projection, and another logit layer;
    - not counted, as in Megatron-LM: the other norms, the router, activations, the softmax, embeddings.
    """
    from ..model.mla import mla_flop_sizes
    c = config
    h = c.hidden_size
    depths = c.mtp_num_layers or 0
    layers = c.num_layers + depths
    moe_layers = c.num_moe_layers()
    per_mlp = 3 if c.swiglu else 2  # weights per hidden unit: [gate;] up and down
    moe_width = c.moe_router_topk * c.moe_ffn_hidden_size + (c.moe_shared_expert_intermediate_size or 0)
    mlp = h * per_mlp * ((layers - moe_layers) * c.ffn_hidden_size + moe_layers * moe_width)
    if c.multi_latent_attention:
        weights, width = mla_flop_sizes(c)
        attention = (weights + (c.q_lora_rank or 0) + c.kv_lora_rank, width)
    else:
        q = c.query_projection_size
        attention = (h * c.qkv_size + q * h, 2 * q)
    return _flops(global_batch_size, c.seq_length, h, c.padded_vocab_size(tp_size), layers, attention, mlp, depths)


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
