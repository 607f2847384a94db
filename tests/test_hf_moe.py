"""Hugging Face MoE import/export: tiny random MixtralForCausalLM / Qwen2MoeForCausalLM built here from configs,
nothing downloaded (transformers 5.x saves their experts as per-expert Linear weights, the names mapped).

Claims (fp32): our model on an imported checkpoint gives HF's logits (1e-5) for Mixtral (softmax, top-k,
renormalised = our default router) and Qwen2-MoE with norm_topk_prob false (--moe-router-pre-softmax) and
true, QKV biases (--add-qkv-bias) and the gated shared expert; HF -> ours -> HF is bit-exact on every tensor
and transformers computes the same logits from the export; configs our MoE layer cannot compute are refused in
one sentence."""
import json
import os

import pytest
import torch

from megatron_zero.checkpoint.errors import CheckpointError
from megatron_zero.checkpoint.export.hf import for_hf_config, mixtral, qwen2_moe
from megatron_zero.checkpoint.export.hf.exporter import export_hf
from megatron_zero.checkpoint.export.hf.importer import import_hf
from megatron_zero.testing import run_ranks
from megatron_zero.testing.hf_parity import SEQ, VOCAB, first_loss, hf_tensors, our_logits, tokens

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=16, rms_norm_eps=1e-6, rope_theta=5000.0, tie_word_embeddings=False)
VARIANTS = {
    "mixtral": ("mixtral", dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2-moe": ("qwen2_moe", dict(intermediate_size=48, moe_intermediate_size=32, num_experts=4,
                                    num_experts_per_tok=2, shared_expert_intermediate_size=40)),
    "qwen2-moe-norm-topk": ("qwen2_moe", dict(intermediate_size=48, moe_intermediate_size=32, num_experts=4,
                                              num_experts_per_tok=2, shared_expert_intermediate_size=40,
                                              norm_topk_prob=True, qkv_bias=False)),
}


def hf_model(variant, seed=0):
    kind, overrides = VARIANTS[variant]
    config_class, model_class = {"mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
                                 "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM)}[kind]
    torch.manual_seed(seed)
    model = model_class(config_class(**{**COMMON, **overrides}))
    with torch.no_grad():  # non-trivial norms, biases and routers, so every mapping counts
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def save_hf(tmp_path, variant):
    path = str(tmp_path / variant)
    hf_model(variant).save_pretrained(path)
    return path


def hf_config(path):
    return json.load(open(os.path.join(path, "config.json")))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_import_matches_hf_logits(tmp_path, variant):
    src = save_hf(tmp_path, variant)
    out = import_hf(src, str(tmp_path / "ckpt"))
    config = for_hf_config(hf_config(src)).config_from_hf(hf_config(src))
    toks = tokens()
    with torch.no_grad():
        want = hf_model(variant)(toks).logits
    torch.testing.assert_close(our_logits(str(tmp_path / "ckpt"), config, toks), want, rtol=1e-5, atol=1e-5)
    assert ("--moe-router-pre-softmax" in out["flags"]) == (variant == "qwen2-moe")
    assert ("--moe-shared-expert-gate" in out["flags"]) == variant.startswith("qwen2")
    assert ("--add-qkv-bias" in out["flags"]) == (variant == "qwen2-moe")


@pytest.mark.parametrize("variant", [pytest.param(v, marks=pytest.mark.slow) if v == "qwen2-moe-norm-topk" else v
                                     for v in sorted(VARIANTS)])  # its tensors are qwen2-moe's
def test_round_trip_is_bit_exact(tmp_path, variant):
    src = save_hf(tmp_path, variant)
    import_hf(src, str(tmp_path / "ckpt"))
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"), max_shard_size="200KB")
    want = hf_model(variant).state_dict()
    got = hf_tensors(str(tmp_path / "back"))
    saved = hf_tensors(src)  # the per-expert names transformers saves
    assert sorted(got) == sorted(saved)
    assert all(torch.equal(got[k], saved[k]) for k in saved)
    original, exported = hf_config(src), hf_config(str(tmp_path / "back"))
    keys = set(original) - {"transformers_version", "dtype", "torch_dtype", "rope_parameters", "rope_theta",
                            "head_dim", "layer_types", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id"}
    assert {k: exported.get(k) for k in keys} == {k: original[k] for k in keys}
    back = type(hf_model(variant)).from_pretrained(str(tmp_path / "back")).eval()
    assert all(torch.equal(back.state_dict()[k], want[k]) for k in want)
    with torch.no_grad():
        assert torch.equal(back(tokens()).logits, hf_model(variant)(tokens()).logits)


def test_unsupported_moe_configs_are_refused(tmp_path):
    mix = hf_config(save_hf(tmp_path, "mixtral"))
    with pytest.raises(CheckpointError, match="router_jitter_noise 0.1"):
        mixtral.config_from_hf({**mix, "router_jitter_noise": 0.1})
    qwen = hf_config(save_hf(tmp_path, "qwen2-moe"))
    with pytest.raises(CheckpointError, match="decoder_sparse_step 2 and mlp_only_layers"):
        qwen2_moe.config_from_hf({**qwen, "decoder_sparse_step": 2})
    with pytest.raises(CheckpointError, match=r"mlp_only_layers \[1\]"):
        qwen2_moe.config_from_hf({**qwen, "mlp_only_layers": [1]})
    with pytest.raises(CheckpointError, match="use_sliding_window"):
        qwen2_moe.config_from_hf({**qwen, "use_sliding_window": True})


@pytest.mark.multirank
@pytest.mark.parametrize("variant,tp,ep", [("mixtral", 1, 2), pytest.param("qwen2-moe", 2, 2, marks=pytest.mark.slow)])
def test_first_loss_at_expert_parallel_equals_hf_loss(tmp_path, variant, tp, ep):
    """The import loaded at EP2 x DP2 (Qwen2-MoE also TP2; weights only, fresh optimizer): the first training
    loss is HF's loss on the same batch (1e-5), so every rank holds its experts under their global ids."""
    src = save_hf(tmp_path, variant)
    ckpt = str(tmp_path / "ckpt")
    import_hf(src, ckpt, tp=tp)
    config = for_hf_config(hf_config(src)).config_from_hf(hf_config(src))
    config.seq_length, config.hidden_dropout, config.attention_dropout = SEQ - 1, 0.0, 0.0
    config.make_vocab_size_divisible_by = 16
    losses = run_ranks(first_loss, 2 * tp, tp, 1, ckpt, config, ep, timeout=300)
    toks = tokens(4)
    with torch.no_grad():
        want = hf_model(variant)(toks, labels=toks).loss.item()  # HF shifts the labels itself
    assert all(abs(loss - want) <= 1e-5 * abs(want) for loss in losses), (losses, want)
