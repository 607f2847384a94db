"""The small models the parity tests share: fast on 8 gloo ranks, vocabulary padded (100 -> 112 at TP1)."""
from ..model.config import GPTConfig

LLAMA_ARCHITECTURE = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                          untie_embeddings_and_output_weights=True, add_bias_linear=False)


def tiny_gpt_config(num_layers: int = 4, **overrides) -> GPTConfig:
    """Hidden 32, 4 heads, seq 8, vocab 100 padded to a multiple of 16 x TP, fp32 with dropout 0."""
    fields = dict(vocab_size=100, hidden_size=32, num_layers=num_layers, num_attention_heads=4, seq_length=8,
                  max_position_embeddings=8, make_vocab_size_divisible_by=16, hidden_dropout=0.0,
                  attention_dropout=0.0)
    fields.update(overrides)
    return GPTConfig(**fields)


def tiny_llama_config(num_layers: int = 4, num_query_groups: int = 2, **overrides) -> GPTConfig:
    """tiny_gpt_config as a Llama: RMSNorm, RoPE, SwiGLU (ffn 48), grouped-query attention, untied, no bias."""
    fields = dict(LLAMA_ARCHITECTURE, num_query_groups=num_query_groups, ffn_hidden_size=48, hidden_size=64)
    fields.update(overrides)
    return tiny_gpt_config(num_layers, **fields)


def without_key_bias(name: str, t, config: GPTConfig):
    """`t` without the key entries of a QKV bias (other tensors as they are), for comparing weights after
    Adam steps: softmax is shift-invariant, so their gradient is exactly zero in exact arithmetic and Adam
    (m / (sqrt(v) + eps)) turns each layout's roundoff (~1e-10) into updates of size ~lr * 1e-2. They
    cannot change the loss."""
    if not name.endswith("query_key_value.bias"):
        return t
    per_head = t.view(config.num_attention_heads, 3, config.head_dim)
    return per_head[:, 0::2].reshape(-1)
