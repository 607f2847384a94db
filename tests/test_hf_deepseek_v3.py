"""Hugging Face DeepSeek-V3 import/export (checkpoint/export/hf/deepseek_v3.py): tiny random DeepseekV3ForCausalLM
built here from configs, nothing downloaded. The DeepSeek-V3 toy: MLA with a q latent of 24, a kv latent of 16,
heads of 12 + 8 rotary (q, k) and 10 (v), YaRN x4 over an original context of 4 with mscale 0.707 on both; one
dense block, then an MoE block of 8 experts in 4 groups (a token's 4 experts from its 2 best groups), sigmoid
scores with a random e_score_correction_bias (so it changes the choice), a scaling factor 2.5 and a shared expert
of two widths. The other toy: q projected directly (q_lora_rank null), plain RoPE, no groups, tied embeddings,
every block MoE.

Claims (fp32): our model on an imported checkpoint gives transformers' logits (1e-5); HF -> ours -> HF is
bit-exact on every tensor (the expert bias included, kept fp32 by a bf16 export) and transformers computes the
very logits from the export; a router without the bias exports with zeros in its place;
what transformers' class computes otherwise than ours is refused in one sentence; DeepSeek's MTP layer in the
files becomes our MTP depth and exports back bit-exactly (its copy of the embedding checked); tools/convert_from_hf.py
takes the directory, prints the flags, which build the very model, MTP depth included; the released DeepSeek-V3
config.json gives Megatron-LM's DeepSeek-V3 model flags. Slow: the import's first training
loss at EP2 (the bias restored whole on each rank) is transformers' loss on that batch (1e-5); pretrain_gpt.py
trains the import at EP2 with the bias moving, and tools/convert_to_hf.py exports that two-rank save to a
DeepseekV3ForCausalLM whose logits are ours (1e-5), its e_score_correction_bias the trained bias; a model of an
import's flags trained with --mtp-num-layers 1 exports its depth as DeepSeek's layer, and re-imports bit-exactly."""
import dataclasses
import json
import os

import pytest
import torch

from megatron_zero.checkpoint.errors import CheckpointError
from megatron_zero.checkpoint.export.hf import deepseek_v3, for_config, for_hf_config
from megatron_zero.checkpoint.export.hf.exporter import export_hf
from megatron_zero.checkpoint.export.hf.importer import import_hf
from megatron_zero.testing import run_ranks
from megatron_zero.testing.hf_parity import SEQ, VOCAB, first_loss, hf_tensors, our_logits, tokens

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8,
              v_head_dim=10, max_position_embeddings=16, rms_norm_eps=1e-6, bos_token_id=VOCAB - 1,
              eos_token_id=VOCAB - 1)
VARIANTS = {
    "v3": dict(q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
               routed_scaling_factor=2.5, n_shared_experts=2, first_k_dense_replace=1, norm_topk_prob=True,
               tie_word_embeddings=False,
               rope_parameters=dict(rope_type="yarn", rope_theta=5000.0, factor=4.0, original_max_position_embeddings=4,
                                    beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707)),
    "q-proj": dict(q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                   routed_scaling_factor=1.0, n_shared_experts=1, first_k_dense_replace=0, norm_topk_prob=True,
                   tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
}


def hf_model(variant="v3", seed=0, vocab=VOCAB):
    torch.manual_seed(seed)
    fields = {**COMMON, **VARIANTS[variant], "vocab_size": vocab, "bos_token_id": vocab - 1, "eos_token_id": vocab - 1}
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**fields))
    with torch.no_grad():  # non-trivial norms, routers and expert biases, so every mapping counts
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model.eval()


def save_hf(tmp_path, variant="v3", vocab=VOCAB):
    path = str(tmp_path / variant)
    hf_model(variant, vocab=vocab).save_pretrained(path)
    return path


def add_mtp_layer(path, seed=1):
    """Write DeepSeek's MTP layer into an HF directory's files as DeepSeek-V3's release holds it (transformers'
    save_pretrained writes none): model.layers.{L} with enorm, hnorm, eh_proj, a block shaped as the last one,
    shared_head.norm, and the copies of the embedding and output layer (shared_head.head)."""
    from safetensors.torch import load_file, save_file

    weights = os.path.join(path, "model.safetensors")
    tensors, config = load_file(weights), read_config(path)
    layers, h = config["num_hidden_layers"], config["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    extra = {mtp + n[len(last):]: t + 0.05 * torch.randn(t.shape, generator=g)
             for n, t in tensors.items() if n.startswith(last) and not n.endswith("e_score_correction_bias")}
    extra.update({mtp + n[len(last):]: t.clone() for n, t in tensors.items()
                  if n.startswith(last) and n.endswith("e_score_correction_bias")})
    extra.update({mtp + "enorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                  mtp + "hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                  mtp + "eh_proj.weight": 0.05 * torch.randn(h, 2 * h, generator=g),
                  mtp + "shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                  mtp + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                  mtp + "shared_head.head.weight": tensors.get("lm_head.weight",
                                                               tensors["model.embed_tokens.weight"]).clone()})
    save_file({**tensors, **extra}, weights, {"format": "pt"})
    return extra


def read_config(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_import_matches_logits_and_round_trips(tmp_path, variant):
    from megatron_zero.checkpoint.export.consolidate import get_fp32_state_dict
    from megatron_zero.model.layer_indices import mtp_index

    src = save_hf(tmp_path, variant)
    mtp = add_mtp_layer(src)
    hf = read_config(src)
    assert for_hf_config(hf) is deepseek_v3 and hf["num_nextn_predict_layers"] == 1
    out = import_hf(src, str(tmp_path / "ckpt"))
    config = deepseek_v3.config_for_files(deepseek_v3.config_from_hf(hf), hf, set(hf_tensors(src)))
    assert config.multi_latent_attention and config.moe_router_enable_expert_bias and config.mtp_num_layers == 1
    assert "--mtp-num-layers 1" in " ".join(out["flags"])
    ours, depth = get_fp32_state_dict(str(tmp_path / "ckpt")), f"{mtp_index(config.num_layers)}.0."
    for hf_name, ours_name in (("enorm.weight", "enorm.weight"), ("eh_proj.weight", "eh_proj.weight"),
                               ("shared_head.norm.weight", "final_layernorm.weight"),
                               ("self_attn.kv_b_proj.weight", "transformer_layer.self_attention.linear_kv_up_proj.weight"),
                               ("mlp.shared_experts.down_proj.weight", "transformer_layer.mlp.shared_expert.dense_4h_to_h.weight")):
        assert torch.equal(ours[depth + ours_name], mtp["model.layers.2." + hf_name]), hf_name
    toks = tokens()
    with torch.no_grad():
        want = hf_model(variant)(toks).logits
    torch.testing.assert_close(our_logits(str(tmp_path / "ckpt"), config, toks), want, rtol=1e-5, atol=1e-5)
    if variant == "v3":
        flags = " ".join(out["flags"])
        for flag in ("--multi-latent-attention --qk-layernorm", "--q-lora-rank 24", "--rope-type yarn",
                     "--rotary-scaling-factor 4.0", "--mscale-all-dim 0.707", "--moe-layer-freq [0]*1+[1]*1",
                     "--moe-router-num-groups 4 --moe-router-group-topk 2", "--moe-router-topk-scaling-factor 2.5",
                     "--moe-shared-expert-intermediate-size 32", "--moe-router-enable-expert-bias"):
            assert flag in flags, (flag, flags)
    back = str(tmp_path / "back")
    summary = export_hf(str(tmp_path / "ckpt"), back)
    assert summary["architecture"] == "DeepseekV3ForCausalLM" and summary["dropped"] == []
    got, orig = hf_tensors(back), hf_tensors(src)
    assert set(got) == set(orig) and any(n.endswith("e_score_correction_bias") for n in orig)
    for name, t in orig.items():
        assert torch.equal(got[name], t), name
    exported = read_config(back)
    for key in ("q_lora_rank", "n_group", "topk_group", "first_k_dense_replace", "routed_scaling_factor",
                "n_shared_experts", "tie_word_embeddings"):
        assert exported[key] == hf[key], key
    reloaded = transformers.DeepseekV3ForCausalLM.from_pretrained(back).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(toks).logits, want, rtol=0, atol=0)
    if variant == "v3":  # a bf16 export keeps the bias in fp32, as transformers holds it
        export_hf(str(tmp_path / "ckpt"), str(tmp_path / "bf16"), dtype="bf16")
        half = hf_tensors(str(tmp_path / "bf16"))
        assert all((t.dtype == torch.float32) == n.endswith("e_score_correction_bias") for n, t in half.items())


def test_released_config_gives_megatron_lms_deepseek_v3_flags():
    """DeepSeek-V3's released config.json (its keys as published: rope_scaling of type yarn, rope_theta at the top)
    gives the model flags Megatron-LM trains DeepSeek-V3 with (docs/models.md)."""
    released = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280,
                    hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
                    num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
                    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
                    qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
                    norm_topk_prob=True, hidden_act="silu", max_position_embeddings=163840, rms_norm_eps=1e-6,
                    rope_theta=10000, num_nextn_predict_layers=1, tie_word_embeddings=False,
                    rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=1.0, mscale_all_dim=1.0,
                                      original_max_position_embeddings=4096, type="yarn"))
    assert for_hf_config(released) is deepseek_v3
    flags = " ".join(deepseek_v3.flags(deepseek_v3.config_from_hf(released)))
    for want in ("--multi-latent-attention --qk-layernorm --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 "
                 "--v-head-dim 128 --rope-type yarn --q-lora-rank 1536 --rotary-scaling-factor 40.0 "
                 "--original-max-position-embeddings 4096 --beta-fast 32.0 --beta-slow 1.0 --mscale 1.0 --mscale-all-dim 1.0",
                 "--num-experts 256 --moe-router-topk 8 --moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size "
                 "2048 --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-dtype fp32 "
                 "--moe-layer-freq [0]*3+[1]*58 --moe-router-num-groups 8 --moe-router-group-topk 4 "
                 "--moe-router-topk-scaling-factor 2.5", "--rotary-base 10000 "):
        assert want in flags, (want, flags)


def test_what_transformers_computes_otherwise_is_refused_in_one_sentence():
    hf = hf_model().config.to_dict()
    for change, words in (({"topk_group": 1}, "scores a group by its top 2 experts"),
                          ({"rope_interleave": False}, "rope_interleave false"),
                          ({"rms_norm_eps": 1e-5}, "latent norms use 1e-06"),
                          ({"norm_topk_prob": False}, "norm_topk_prob false"),
                          ({"attention_bias": True}, "attention_bias true"),
                          ({"rope_parameters": {**hf["rope_parameters"], "mscale": None}}, "YaRN attention factor")):
        with pytest.raises(CheckpointError, match=words) as e:
            deepseek_v3.config_from_hf({**hf, **change})
        assert "\n" not in str(e.value) and str(e.value).startswith("this DeepSeek-V3 config has")
    # a router without the expert bias exports with zeros in its place (they route as it does)
    from megatron_zero.checkpoint.export.hf import mappings_for
    from megatron_zero.model.layer_indices import block_layer_index
    from megatron_zero.model.params import MOE_ROUTER_SUFFIX

    config = deepseek_v3.config_from_hf(hf)
    unbiased = dataclasses.replace(config, moe_router_enable_expert_bias=False)
    router = mappings_for(for_config(unbiased), unbiased)[f"{block_layer_index(1)}.{MOE_ROUTER_SUFFIX}"]
    weight = torch.randn(8, 64)
    assert router.hf[1] == "model.layers.1.mlp.gate.e_score_correction_bias"
    assert all(torch.equal(a, b) for a, b in zip(router.to_hf(weight), [weight, torch.zeros(8)]))
    # an export refuses what the class cannot hold: the MoE blocks must follow the dense ones
    config.moe_layer_freq, config.moe_layer_offset = (1, 0), 0
    with pytest.raises(CheckpointError, match=r"MoE blocks at \[1, 0\].*cannot hold"):
        for_config(config)


def test_cli_import_prints_the_flags_that_build_the_model(tmp_path, capsys):
    """tools/convert_from_hf.py (its main, with a user's argv) prints flags that pretrain_gpt.py's parser takes and
    that build the very model the import holds."""
    from megatron_zero.arguments import parse_args
    from megatron_zero.model.architecture import gpt_config
    from megatron_zero.testing.cli import imported_flags
    from tools.convert_from_hf import main

    src = save_hf(tmp_path)
    add_mtp_layer(src)  # DeepSeek's files hold its MTP layer as the next block
    ckpt = str(tmp_path / "ckpt")
    assert main(["--input-dir", src, "--output-dir", ckpt]) == 0
    printed = capsys.readouterr().out
    assert "DeepseekV3ForCausalLM" in printed and "--multi-latent-attention" in printed and "--mtp-num-layers 1" in printed
    config = dataclasses.replace(deepseek_v3.config_from_hf(read_config(src)), mtp_num_layers=1)
    argv = imported_flags(ckpt) + ["--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1",
                                   "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                                   str(VOCAB)]
    built = gpt_config(parse_args(argv, world_size=1), VOCAB)
    for field in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
                  "rotary_scaling_factor", "mscale", "mscale_all_dim", "original_max_position_embeddings", "beta_fast",
                  "beta_slow", "rotary_base", "num_experts", "moe_router_topk", "moe_layer_freq", "moe_layer_offset",
                  "moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor",
                  "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_dtype",
                  "moe_shared_expert_intermediate_size", "moe_ffn_hidden_size", "ffn_hidden_size", "qk_layernorm",
                  "layernorm_epsilon", "untie_embeddings_and_output_weights", "multi_latent_attention",
                  "mtp_num_layers"):
        assert getattr(built, field) == getattr(config, field), field


def test_import_takes_the_mtp_layers_the_files_hold_and_refuses_a_changed_copy(tmp_path):
    """transformers' save_pretrained writes no MTP layer though its config says num_nextn_predict_layers 1: the
    import builds no depth. DeepSeek's layer copies the embedding: a copy that differs is refused in one sentence."""
    from safetensors.torch import load_file, save_file

    src = save_hf(tmp_path, "q-proj")
    assert "--mtp-num-layers" not in import_hf(src, str(tmp_path / "none"))["flags"]
    add_mtp_layer(src)
    weights = os.path.join(src, "model.safetensors")
    tensors = load_file(weights)
    tensors["model.layers.2.embed_tokens.weight"][0, 0] += 1
    save_file(tensors, weights, {"format": "pt"})
    with pytest.raises(CheckpointError, match=r"^model\.layers\.2\.embed_tokens\.weight differs from "
                                              r"model\.embed_tokens\.weight: our multi-token prediction shares"):
        import_hf(src, str(tmp_path / "changed"))
    assert not os.path.exists(str(tmp_path / "changed"))


@pytest.mark.slow  # default tier: test_import_matches_logits_and_round_trips (the logits, the bias included)
@pytest.mark.multirank
def test_first_loss_at_ep2_equals_transformers_loss(tmp_path):
    """The import loaded at EP2 x DP2 (weights only, fresh optimizer) gives transformers' loss on the batch: every
    rank holds its experts under their global ids and the whole expert bias."""
    src = save_hf(tmp_path)
    ckpt = str(tmp_path / "ckpt")
    import_hf(src, ckpt)
    config = deepseek_v3.config_from_hf(read_config(src))
    config.seq_length, config.hidden_dropout, config.attention_dropout = SEQ - 1, 0.0, 0.0
    losses = run_ranks(first_loss, 2, 1, 1, ckpt, config, 2, timeout=300)
    toks = tokens(4)
    with torch.no_grad():
        want = hf_model()(toks, labels=toks).loss.item()  # HF shifts the labels itself
    assert all(abs(loss - want) <= 1e-5 * abs(want) for loss in losses), (losses, want)


@pytest.mark.slow  # default tier: test_import_matches_logits_and_round_trips, test_cli_import_prints_the_flags_that_build_the_model
@pytest.mark.multirank
def test_cli_trains_the_import_at_ep2_and_exports_the_save(tmp_path):
    from megatron_zero.checkpoint.export.consolidate import resolve_checkpoint_dir
    from megatron_zero.checkpoint.export.hf.exporter import shape_reader
    from megatron_zero.checkpoint.saved_config import saved_args, saved_config
    from megatron_zero.testing.cli import cli_flags, imported_flags, logged_losses, pretrain_cli, text_data, tool
    from megatron_zero.testing.launch import flags_argv
    from megatron_zero.testing.tolerances import assert_close_normwise

    src = save_hf(tmp_path, vocab=257)  # ByteTokenizer's ids
    imported, save = str(tmp_path / "imported"), str(tmp_path / "trained")
    tool("convert_from_hf.py", "--input-dir", src, "--output-dir", imported)
    data = text_data(str(tmp_path / "text"))
    flags = cli_flags(data, str(tmp_path / "cache"), None) + imported_flags(imported)
    run = pretrain_cli(2, flags + flags_argv({"load": imported, "train-iters": 3, "expert-model-parallel-size": 2,
                                              "save": save}))
    assert sorted(logged_losses(run)) == [1, 2, 3]
    exported = str(tmp_path / "exported")
    tool("convert_to_hf.py", save, exported)
    ckpt = resolve_checkpoint_dir(save, None)
    config = saved_config(*shape_reader(ckpt), saved_args(ckpt))
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, torch_dtype=torch.float32).eval()
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert not torch.equal(bias, hf_model(vocab=257).model.layers[1].mlp.gate.e_score_correction_bias)  # it trained
    toks = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = model(toks).logits
    assert_close_normwise(theirs, our_logits(ckpt, config, toks), 1e-5, "DeepSeek-V3 logits")


@pytest.mark.slow  # default tier: test_import_matches_logits_and_round_trips (a depth there and back, bit-exact)
def test_cli_export_writes_the_mtp_depth_as_deepseeks_layer(tmp_path):
    """A model of an import's flags trained by pretrain_gpt.py with --mtp-num-layers 1: tools/convert_to_hf.py writes
    its depth as DeepSeek's model.layers.2 (num_nextn_predict_layers 1), transformers loads the export (skipping
    that layer) and computes our logits, and tools/convert_from_hf.py takes the depth back bit-exactly."""
    from megatron_zero.checkpoint.export.consolidate import get_fp32_state_dict, resolve_checkpoint_dir
    from megatron_zero.checkpoint.export.hf.exporter import shape_reader
    from megatron_zero.checkpoint.saved_config import saved_args, saved_config
    from megatron_zero.model.layer_indices import mtp_index
    from megatron_zero.testing.cli import cli_flags, imported_flags, pretrain_cli, text_data, tool
    from megatron_zero.testing.launch import flags_argv
    from megatron_zero.testing.tolerances import assert_close_normwise

    path = str(tmp_path / "hf")
    torch.manual_seed(0)
    fields = {**COMMON, **VARIANTS["v3"], "vocab_size": 257, "bos_token_id": 256, "eos_token_id": 256}
    transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**fields)).save_pretrained(path)
    imported, save = str(tmp_path / "imported"), str(tmp_path / "trained")
    tool("convert_from_hf.py", "--input-dir", path, "--output-dir", imported)
    data = text_data(str(tmp_path / "text"))
    flags = cli_flags(data, str(tmp_path / "cache"), None) + imported_flags(imported)
    pretrain_cli(1, flags + flags_argv({"train-iters": 2, "mtp-num-layers": 1, "save": save}))
    exported = str(tmp_path / "exported")
    assert "multi-token prediction" not in tool("convert_to_hf.py", save, exported).stdout
    assert read_config(exported)["num_nextn_predict_layers"] == 1
    written = hf_tensors(exported)
    assert torch.equal(written["model.layers.2.embed_tokens.weight"], written["model.embed_tokens.weight"])
    assert torch.equal(written["model.layers.2.shared_head.head.weight"], written["lm_head.weight"])
    ckpt = resolve_checkpoint_dir(save, None)
    config = saved_config(*shape_reader(ckpt), saved_args(ckpt))
    assert config.mtp_num_layers == 1
    trained = get_fp32_state_dict(ckpt)
    depth = f"{mtp_index(config.num_layers)}.0."
    assert torch.equal(written["model.layers.2.eh_proj.weight"], trained[depth + "eh_proj.weight"])
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, torch_dtype=torch.float32).eval()
    toks = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = model(toks).logits
    assert_close_normwise(theirs, our_logits(ckpt, config, toks), 1e-5, "DeepSeek-V3 logits")
    again = str(tmp_path / "again")
    tool("convert_from_hf.py", "--input-dir", exported, "--output-dir", again)
    back = get_fp32_state_dict(again)
    assert set(back) == set(trained) and all(torch.equal(back[n], t) for n, t in trained.items())
