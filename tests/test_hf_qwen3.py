"""Hugging Face Qwen3 and Qwen3-MoE import/export (QK-norm, head_dim 32 with hidden 64 and 4 heads): tiny random
Qwen3ForCausalLM / Qwen3MoeForCausalLM built here from configs, nothing downloaded.

Claims (fp32): our model on an imported checkpoint gives transformers' logits (1e-5); HF -> ours -> HF is
bit-exact (tensors) with the same config keys; tools/convert_from_hf.py takes the directory from the command
line and prints the flags that build the model (--qk-layernorm, --kv-channels); the imported dense model's first
training loss at TP2 x PP2 is transformers' loss on that batch (1e-5)."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from megatron_zero.checkpoint.export.hf import for_hf_config, qwen3, qwen3_moe
from megatron_zero.checkpoint.export.hf.exporter import export_hf
from megatron_zero.checkpoint.export.hf.importer import import_hf
from megatron_zero.testing import run_ranks
from megatron_zero.testing.hf_parity import SEQ, VOCAB, first_loss, hf_tensors, our_logits, tokens

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hf_model(kind="qwen3", seed=0):
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=16, rms_norm_eps=1e-6,
                  rope_theta=5000.0, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, tie_word_embeddings=False)
    if kind == "qwen3":
        cfg, cls = transformers.Qwen3Config(**fields), transformers.Qwen3ForCausalLM
    else:
        cfg = transformers.Qwen3MoeConfig(**fields, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        cls = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():  # non-trivial norms, so every mapping counts
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def save_hf(tmp_path, kind):
    path = str(tmp_path / kind)
    hf_model(kind).save_pretrained(path)
    return path


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_import_matches_logits_and_round_trips(tmp_path, kind):
    src = save_hf(tmp_path, kind)
    hf = json.load(open(os.path.join(src, "config.json")))
    module = for_hf_config(hf)
    assert module is {"qwen3": qwen3, "qwen3_moe": qwen3_moe}[kind]
    out = import_hf(src, str(tmp_path / "ckpt"))
    assert "--qk-layernorm" in out["flags"] and out["flags"][out["flags"].index("--kv-channels") + 1] == "32"
    config = module.config_from_hf(hf)
    assert config.qk_layernorm and config.head_dim == 32
    toks = tokens()
    with torch.no_grad():
        want = hf_model(kind)(toks).logits
    torch.testing.assert_close(our_logits(str(tmp_path / "ckpt"), config, toks), want, rtol=1e-5, atol=1e-5)
    back = str(tmp_path / "back")
    export_hf(str(tmp_path / "ckpt"), back)
    got, orig = hf_tensors(back), hf_tensors(src)
    assert set(got) == set(orig)
    for name, t in orig.items():
        assert torch.equal(got[name], t), name
    exported = json.load(open(os.path.join(back, "config.json")))
    assert exported["architectures"] == hf["architectures"] and exported["head_dim"] == 32
    reloaded = type(hf_model(kind)).from_pretrained(back).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(toks).logits, want, rtol=0, atol=0)


def test_sliding_window_refused_in_one_sentence(tmp_path):
    from megatron_zero.checkpoint.errors import CheckpointError
    with pytest.raises(CheckpointError, match="use_sliding_window"):
        qwen3.config_from_hf({**hf_model().config.to_dict(), "use_sliding_window": True})


def test_cli_import_trains_at_tp2_pp2(tmp_path):
    src = save_hf(tmp_path, "qwen3")
    ckpt = str(tmp_path / "ckpt")
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_from_hf.py"), "--input", src,
                          "--output", ckpt], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "--qk-layernorm" in run.stdout + run.stderr
    hf = json.load(open(os.path.join(src, "config.json")))
    config = qwen3.config_from_hf(hf)
    config.seq_length, config.hidden_dropout, config.attention_dropout = SEQ - 1, 0.0, 0.0
    losses = run_ranks(first_loss, 4, 2, 2, ckpt, config, timeout=300)
    toks = tokens(4)
    with torch.no_grad():
        logits = hf_model()(toks[:, :-1]).logits
    want = F.cross_entropy(logits.reshape(-1, VOCAB), toks[:, 1:].reshape(-1)).item()
    for loss in losses:
        assert loss == pytest.approx(want, rel=1e-5)
