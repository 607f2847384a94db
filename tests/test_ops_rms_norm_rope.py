"""RMSNorm and RoPE ops against Hugging Face Llama's own modules (the meaning our Llama import relies on),
and their properties: RoPE preserves norms, is relative (q.k depends on the offset only), and with
--rotary-percent leaves the tail of each head alone."""
import pytest
import torch

from megatron_zero.ops import apply_rotary_pos_emb, rms_norm, rotary_tables

transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_llamas(dtype):
    x = torch.randn(3, 5, 64).to(dtype)
    hf = modeling_llama.LlamaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.1 * torch.randn(64))
    hf = hf.to(dtype)
    assert torch.equal(rms_norm(x, hf.weight, 1e-6, fused=False), hf(x))  # the fallback, bit for bit
    # the fused kernel where one applies (the fp32 CPU one here): fp32 rounding apart
    torch.testing.assert_close(rms_norm(x, hf.weight, 1e-6), hf(x), rtol=1e-5, atol=1e-6)


def test_rope_is_llamas():
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=32,
                                   rope_theta=5000.0)
    q = torch.randn(2, 4, 10, 16)
    rotary = modeling_llama.LlamaRotaryEmbedding(cfg)
    cos_hf, sin_hf = rotary(q, torch.arange(10).unsqueeze(0))
    cos, sin = rotary_tables(10, 16, 5000.0, q.device)
    torch.testing.assert_close(cos, cos_hf[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, sin_hf[0], rtol=0, atol=1e-6)
    want, _ = modeling_llama.apply_rotary_pos_emb(q, q, cos_hf, sin_hf)
    torch.testing.assert_close(apply_rotary_pos_emb(q, cos, sin), want, rtol=1e-6, atol=1e-6)


def test_rope_properties_and_rotary_percent():
    cos, sin = rotary_tables(12, 16, 10000.0, torch.device("cpu"))
    q, k = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    rq = apply_rotary_pos_emb(q.expand(12, 16), cos.double(), sin.double())
    rk = apply_rotary_pos_emb(k.expand(12, 16), cos.double(), sin.double())
    torch.testing.assert_close(rq.norm(dim=-1), q.norm().expand(12))
    assert torch.allclose(rq[3] @ rk[1], rq[9] @ rk[7]) and torch.allclose(rq[5] @ rk[5], q @ k)
    cos8, sin8 = rotary_tables(12, 8, 10000.0, torch.device("cpu"))  # rotary_percent 0.5 of head_dim 16
    x = torch.randn(2, 12, 16)
    y = apply_rotary_pos_emb(x, cos8, sin8)
    assert torch.equal(y[..., 8:], x[..., 8:])
    assert torch.equal(y[..., :8], apply_rotary_pos_emb(x[..., :8].contiguous(), cos8, sin8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    x = torch.randn(4, 8, 64)
    w = torch.randn(64)
    cos, sin = rotary_tables(8, 64, 10000.0, torch.device("cuda"))
    torch.testing.assert_close(rms_norm(x.cuda(), w.cuda()).cpu(), rms_norm(x, w), rtol=1e-5, atol=1e-5)
    c, s = rotary_tables(8, 64, 10000.0, torch.device("cpu"))
    torch.testing.assert_close(apply_rotary_pos_emb(x.cuda(), cos, sin).cpu(), apply_rotary_pos_emb(x, c, s),
                               rtol=1e-5, atol=1e-5)
