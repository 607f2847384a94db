"""FLOPs per iteration for a GPT (Megatron's formula) and the TFLOP/s per rank it implies."""


def gpt_flops_per_iteration(batch_size: int, seq_length: int, num_layers: int, hidden_size: int,
                            vocab_size: int, ffn_hidden_size: int = None, qkv_size: int = None,
                            swiglu: bool = False) -> float:
    """Forward + backward FLOPs of one global batch (no activation recomputation).

    The standard 6N-per-token count for the weight matmuls plus the attention
    score and context matmuls: per layer and token, forward 2*(4h^2 + 2h*ffn)
    for QKV/dense/MLP and 4*s*h for attention; backward twice the forward; and
    the logit layer 2*h*V forward. Grouped-query attention shrinks QKV to `qkv_size` rows
    (default 3h); SwiGLU doubles the first MLP matmul.
    """
    h, s, L, V = hidden_size, seq_length, num_layers, vocab_size
    ffn = ffn_hidden_size or 4 * h
    qkv = qkv_size or 3 * h
    mlp_in = 2 * ffn if swiglu else ffn
    per_token_forward = L * (2 * (h * qkv + h * h + h * mlp_in + ffn * h) + 4 * s * h) + 2 * h * V
    return 3.0 * per_token_forward * batch_size * s


def tflops_per_rank(flops: float, seconds: float, world_size: int) -> float:
    return flops / seconds / world_size / 1e12 if seconds > 0 else 0.0
