"""torchtitan's Llama forward (models/common: RMSNorm, ComplexRoPE on interleaved pairs, grouped-query attention,
SwiGLU FFN), written from its code over a torchtitan state dict, for the DCP interop tests (torchtitan 0.3.0
itself does not import on this CPU: it needs spmd_types)."""
import torch
import torch.nn.functional as F


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, freqs_cis):
    x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_ * freqs_cis).flatten(3).type_as(x)


def titan_logits(sd: dict, config, tokens: torch.Tensor) -> torch.Tensor:
    b, s = tokens.shape
    heads, groups, hd = config.num_attention_heads, config.num_query_groups, config.head_dim
    eps = config.layernorm_epsilon
    freqs = 1.0 / (config.rotary_base ** (torch.arange(0, hd, 2)[: hd // 2].float() / hd))
    freqs_cis = torch.polar(torch.ones(s, hd // 2), torch.outer(torch.arange(s).float(), freqs))[None, :, None, :]
    h = sd["tok_embeddings.weight"][tokens]
    for i in range(config.num_layers):
        p = f"layers.{i}."
        x = _rms(h, sd[p + "attention_norm.weight"], eps)
        q = (x @ sd[p + "attention.qkv_linear.wq.weight"].T).view(b, s, heads, hd)
        k = (x @ sd[p + "attention.qkv_linear.wk.weight"].T).view(b, s, groups, hd)
        v = (x @ sd[p + "attention.qkv_linear.wv.weight"].T).view(b, s, groups, hd)
        q, k = _rope(q, freqs_cis), _rope(k, freqs_cis)
        k, v = (t.repeat_interleave(heads // groups, dim=2) for t in (k, v))
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        h = h + o.transpose(1, 2).reshape(b, s, heads * hd) @ sd[p + "attention.wo.weight"].T
        x = _rms(h, sd[p + "ffn_norm.weight"], eps)
        ff = F.silu(x @ sd[p + "feed_forward.w1.weight"].T) * (x @ sd[p + "feed_forward.w3.weight"].T)
        h = h + ff @ sd[p + "feed_forward.w2.weight"].T
    return _rms(h, sd["norm.weight"], eps) @ sd["lm_head.weight"].T
