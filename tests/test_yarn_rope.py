"""YaRN RoPE tables against Megatron-Core 0.16.1's YarnRotaryEmbedding (the cos/sin cache it builds)."""
import pytest
import torch

from megatron_zero.ops.yarn import yarn_rotary_tables

yarn = pytest.importorskip("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding")


@pytest.mark.parametrize("factor,mscale,mscale_all_dim", [(40.0, 1.0, 1.0), (4.0, 0.707, 0.0), (1.0, 1.0, 0.0)])
def test_yarn_tables_match_megatron_core(monkeypatch, factor, mscale, mscale_all_dim):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    dim, base, original, seq = 64, 10000.0, 128, 512
    reference = yarn.YarnRotaryEmbedding(dim, rotary_base=base, use_cpu_initialization=True, scaling_factor=factor,
                                         original_max_position_embeddings=original, mscale=mscale,
                                         mscale_all_dim=mscale_all_dim)
    ref_cos, ref_sin = reference.get_cached_cos_sin(seq, dtype=torch.float32)
    cos, sin = yarn_rotary_tables(seq, dim, base, factor, original, mscale=mscale, mscale_all_dim=mscale_all_dim)
    # The same fp32 operations in the same order: equal to the bit.
    torch.testing.assert_close(cos, ref_cos.reshape(seq, dim), rtol=0, atol=0)
    torch.testing.assert_close(sin, ref_sin.reshape(seq, dim), rtol=0, atol=0)
