"""Multi-latent attention with YaRN (--multi-latent-attention and its flags; model/mla.py), fp32:
- one MLA layer is Megatron-Core 0.16.1's MLASelfAttention given the same weights (output and every weight
  gradient normwise within model_rtol of the layer's summation path), q latent or none, latent norms off or on,
  YaRN or plain RoPE. Megatron-Core's local spec cannot run MLA on the CPU as shipped: its DotProductAttention
  takes no `k_channels` / `v_channels` (MLA's core is Transformer Engine's), and `HAVE_TE` is true with
  `TELinear` None (its isinstance check fails); the peer keeps Megatron-Core's projections, norms, rotary
  tables, rope application and softmax scale, and its core attention is a causal SDPA taking the
  `softmax_scale` Megatron-Core computes;
- the flags reach GPTConfig, the catalogue names the module's parameters in module order, stray MLA flags are
  refused in one sentence;
- TP2 with and without sequence parallelism: loss and every gathered gradient of a 2-layer MLA toy within
  model_rtol of the one-process model (the replicated down-projections' gradients are the sums this checks);
- FP8 (torchao, emulated) converts MLA's five linear layers of each block and trains a step;
- the Hugging Face export of an MLA model is DeepseekV3ForCausalLM, never Llama (whose other switches it has); what
  that class cannot hold is refused in one sentence;
- pretrain_gpt.py (slow tier): TP2 x PP2 with sequence parallelism matches the one-process run, its checkpoint
  converted by tools/ds_to_universal.py (and as saved, reshaped while loading) resumes at TP1 with the loss
  continuing; CP2 (p2p, a2a) and DP2 ZeRO-3 with selective recomputation match too; FP8 at TP2 with sequence parallelism trains.
"""
import pytest
import torch
import torch.distributed as dist

from megatron_zero.model import reference_model
from megatron_zero.model.config import GPTConfig
from megatron_zero.testing import run_ranks
from megatron_zero.testing.tolerances import assert_close_normwise, assert_losses_close, gpt_path_length, model_rtol

# a DeepSeek-shaped toy: q latent 24, kv latent 16, heads of 12 + 8 rotary (q, k) and 10 (v), YaRN x4 over an
# original context of 8 (so positions 8..15 are interpolated), DeepSeek-V3's mscale 0.707 on both
MLA = dict(multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=12, qk_pos_emb_head_dim=8,
           v_head_dim=10, rope_type="yarn", rotary_scaling_factor=4.0, mscale=0.707, mscale_all_dim=0.707,
           original_max_position_embeddings=8)
LAYER = dict(hidden_size=64, num_attention_heads=4, seq_length=16)
CASES = [dict(qk_layernorm=True), dict(qk_layernorm=False), dict(qk_layernorm=True, q_lora_rank=None, rope_type="rope")]


def layer_config(**change) -> GPTConfig:
    return GPTConfig(vocab_size=128, num_layers=1, max_position_embeddings=16, normalization="RMSNorm",
                     add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, **LAYER, **{**MLA, **change})


def _megatron_core_layer(cfg: GPTConfig):
    """Megatron-Core's MLASelfAttention for `cfg` (local spec; the module docstring says what is replaced)."""
    import megatron.core.transformer.multi_latent_attention as mla_module
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    class CausalCore(torch.nn.Module):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None,
                     k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
            super().__init__()
            self.scale = softmax_scale

        def forward(self, q, k, v, mask, attn_mask_type=None, packed_seq_params=None):
            q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [s, b, heads, d] -> [b, heads, s, d]
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            return out.permute(2, 0, 1, 3).reshape(q.shape[2], q.shape[0], -1)

    mla_module.HAVE_TE = False
    keys = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
            "rotary_scaling_factor", "mscale", "mscale_all_dim", "original_max_position_embeddings", "beta_fast",
            "beta_slow", "rotary_base", "qk_layernorm", "hidden_size", "num_attention_heads", "num_layers")
    config = MLATransformerConfig(**{k: getattr(cfg, k) for k in keys}, normalization="RMSNorm",
                                  layernorm_epsilon=cfg.layernorm_epsilon, hidden_dropout=0.0, attention_dropout=0.0,
                                  use_cpu_initialization=True, add_bias_linear=False, masked_softmax_fusion=False,
                                  bias_dropout_fusion=False, apply_rope_fusion=False,
                                  gradient_accumulation_fusion=False, persist_layer_norm=False)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=cfg.qk_layernorm,
                                    normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = CausalCore
    return build_module(spec.submodules.self_attention, config=config, layer_number=1)


def _layer_against_megatron_core():
    torch.cuda.current_device = lambda: "cpu"  # Megatron-Core asks in places a CPU run does not need it
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mc_random

    from megatron_zero.model.mla import MultiLatentAttention

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    mc_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    out = []
    for change in CASES:
        cfg = layer_config(**change)
        ours, theirs = MultiLatentAttention(cfg), _megatron_core_layer(cfg)
        their_params = dict(theirs.named_parameters())
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for name, p in ours.named_parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if "layernorm" in name else 0.0))
                their_params[name.replace("dense.", "linear_proj.")].copy_(p)
        assert len(their_params) == len(list(ours.parameters())), sorted(their_params)
        x = torch.randn(2, 16, cfg.hidden_size, generator=g)
        w = torch.randn(2, 16, cfg.hidden_size, generator=g)
        y = ours(x)
        (y * w).sum().backward()
        y_theirs = theirs(x.transpose(0, 1).contiguous(), None)[0].transpose(0, 1)
        (y_theirs * w).sum().backward()
        grads = {n: (p.grad, their_params[n.replace("dense.", "linear_proj.")].grad) for n, p in ours.named_parameters()}
        out.append((y.detach(), y_theirs.detach(), grads))
    return out


def _layer_path(cfg: GPTConfig) -> int:
    """Terms along the layer's longest path: the down-projection (h), up-projection (latent), scores (q head),
    context (s), output (heads v); the backward retraces it and the weight gradients sum the tokens."""
    forward = cfg.hidden_size + max(cfg.q_lora_rank or 0, cfg.kv_lora_rank) + cfg.qk_head_dim + \
        cfg.qk_pos_emb_head_dim + cfg.seq_length + cfg.num_attention_heads * cfg.v_head_dim
    return 2 * forward + 2 * cfg.seq_length


@pytest.mark.slow  # importing megatron-core alone takes tens of seconds here; default tier: the TP2 test below
def test_layer_is_megatron_cores_mla_self_attention():
    for change, (y, y_theirs, grads) in zip(CASES, run_ranks(_layer_against_megatron_core, 1, timeout=300)[0]):
        rtol = model_rtol(_layer_path(layer_config(**change)))
        assert_close_normwise(y, y_theirs, rtol, f"output {change}")
        for name, (g, g_theirs) in grads.items():
            assert_close_normwise(g, g_theirs, rtol, f"{name} {change}")


def test_flags_reach_the_model_and_the_catalogue_names_its_parameters(capsys):
    from megatron_zero.arguments import parse_args
    from megatron_zero.model.architecture import gpt_config
    from megatron_zero.model.params import param_names, param_spec
    from megatron_zero.testing.flag_checks import BASE, refused

    mla = ["--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim", "12",
           "--qk-pos-emb-head-dim", "8", "--v-head-dim", "10", "--rotary-scaling-factor", "4", "--mscale", "0.707",
           "--mscale-all-dim", "0.707", "--qk-layernorm", "--normalization", "RMSNorm",
           "--position-embedding-type", "rope", "--disable-bias-linear"]
    cfg = gpt_config(parse_args(BASE + mla, world_size=1), 100)
    assert (cfg.multi_latent_attention, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.v_head_dim) == (True, 24, 16, 10)
    assert (cfg.rope_type, cfg.mscale, cfg.mscale_all_dim, cfg.rotary_scaling_factor) == ("yarn", 0.707, 0.707, 4.0)
    model = reference_model(cfg)
    got = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert list(got) == param_names(cfg)
    assert got["2.self_attention.linear_q_down_proj.weight"] == (24, 64)
    assert got["2.self_attention.linear_q_up_proj.weight"] == (4 * 20, 24)
    assert got["2.self_attention.linear_kv_down_proj.weight"] == (16 + 8, 64)
    assert got["2.self_attention.linear_kv_up_proj.weight"] == (4 * 22, 16)
    assert got["2.self_attention.q_layernorm.weight"] == (24,) and got["2.self_attention.kv_layernorm.weight"] == (16,)
    assert got["2.self_attention.dense.weight"] == (64, 40)
    assert not any("query_key_value" in n for n in got)
    assert param_spec("2.self_attention.linear_kv_down_proj.weight", cfg).partition_dim is None
    assert param_spec("2.self_attention.linear_kv_up_proj.weight", cfg).partition_dim == 0
    for stray in (["--kv-lora-rank", "16"], ["--rope-type", "yarn"]):
        assert "add --multi-latent-attention or drop them" in refused(BASE + stray, 1, capsys)
    assert "--multi-latent-attention replaces" in refused(BASE + mla + ["--qk-clip", "--optimizer", "muon"], 1, capsys)
    line = refused(BASE + mla + ["--v-head-dim", "32", "--context-parallel-size", "2", "--cp-comm-type", "p2p"], 2,
                   capsys)
    assert "--v-head-dim 32 above --qk-head-dim + --qk-pos-emb-head-dim 20" in line
    line = refused(BASE + mla + ["--v-head-dim", "32", "--attention-backend", "flash"], 1, capsys)
    assert "--v-head-dim 32 above" in line and "--attention-backend flash" in line


# ---- tensor parallelism against the one-process model ---------------------------------------------------------
TOY = dict(vocab_size=96, make_vocab_size_divisible_by=1, num_layers=2, max_position_embeddings=16, normalization="RMSNorm", add_bias_linear=False,
           hidden_dropout=0.0, attention_dropout=0.0, swiglu=True, untie_embeddings_and_output_weights=True,
           position_embedding_type="rope", qk_layernorm=True, **LAYER, **MLA)


def _batch():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 96, (2, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:].contiguous()


def _loss_and_grads(model):
    tokens, labels = _batch()
    loss = model(tokens, labels=labels)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _tp2(sequence_parallel: bool):
    from megatron_zero.model.params import param_spec
    from megatron_zero.model.sharding import gather_tensor
    from megatron_zero.pipeline.gpt_stage import build_gpt_stage
    from megatron_zero.distributed.topology import build_parallel_state

    state = build_parallel_state(tp=2, pp=1)
    cfg = GPTConfig(**TOY, sequence_parallel=sequence_parallel)
    loss, grads = _loss_and_grads(build_gpt_stage(cfg, state))
    full = {}
    for name, g in grads.items():
        shards = [torch.empty_like(g) for _ in range(2)]
        dist.all_gather(shards, g.contiguous(), group=state.tp_group)
        full[name] = gather_tensor(shards, param_spec(name, cfg), cfg)
    return loss, full


def _tp2_both():
    return [_tp2(False), _tp2(True)]


def test_tp2_with_and_without_sequence_parallelism_matches_one_process():
    cfg = GPTConfig(**TOY)
    ref_loss, ref_grads = _loss_and_grads(reference_model(cfg))
    rtol = model_rtol(gpt_path_length(cfg, 32))
    for rank_results in run_ranks(_tp2_both, 2, timeout=300):
        for what, (loss, grads) in zip(("TP2", "TP2 with sequence parallelism"), rank_results):
            assert_losses_close([loss.item()], [ref_loss.item()], rtol, f"{what} loss")
            assert set(grads) == set(ref_grads)
            for name, g in grads.items():
                assert_close_normwise(g, ref_grads[name], rtol, f"{what} {name}")


def test_flash_backend_pads_v_and_equals_the_unfused_core():
    from megatron_zero.model.mla import MultiLatentAttention

    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(5))
    outs = {}
    for backend in ("flash", "unfused"):
        torch.manual_seed(0)
        layer = MultiLatentAttention(layer_config(attention_backend=backend))
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0, 0.2)
        outs[backend] = layer(x).detach()
    assert_close_normwise(outs["flash"], outs["unfused"], model_rtol(_layer_path(layer_config())), "flash")


def test_hugging_face_export_is_deepseek_v3_and_refuses_what_it_cannot_hold_in_one_sentence():
    """An MLA model exports as DeepseekV3ForCausalLM (tests/test_hf_deepseek_v3.py: the logits), never as the Llama
    whose other switches it has; what that class cannot hold is refused in one sentence."""
    from megatron_zero.checkpoint.errors import CheckpointError
    from megatron_zero.checkpoint.export.hf import for_config

    toy = {**TOY, "layernorm_epsilon": 1e-6}
    assert for_config(GPTConfig(**toy)).HF_ARCHITECTURE == "DeepseekV3ForCausalLM"
    for change, words in (({"qk_layernorm": False}, "no latent norms"), ({"layernorm_epsilon": 1e-5}, "norm epsilon")):
        with pytest.raises(CheckpointError, match=f"multi-latent attention with {words}.*DeepseekV3ForCausalLM"):
            for_config(GPTConfig(**{**toy, **change}))
    with pytest.raises(CheckpointError, match="--architecture LlamaForCausalLM cannot hold"):
        for_config(GPTConfig(**toy), "LlamaForCausalLM")


def test_fp8_converts_mla_linear_layers_and_trains():
    pytest.importorskip("torchao")
    from megatron_zero.fp8.convert import Float8Converter
    from megatron_zero.fp8.settings import Float8Settings

    model = reference_model(GPTConfig(**TOY))
    line = Float8Converter(Float8Settings("hybrid", "tensorwise", emulate=True), torch.device("cpu"))(model)
    attention = model.get_submodule("2.self_attention")
    names = ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "dense")
    assert all(type(getattr(attention, n)).__name__.startswith("Float8") for n in names), line
    assert "14 linear layers" in line  # 2 blocks x (5 attention + 2 MLP)
    loss, grads = _loss_and_grads(model)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())


# ---- pretrain_gpt.py --------------------------------------------------------------------------------------------
# the toy on the command line: Megatron-LM's DeepSeek flags (YaRN by default with MLA) on the tiny Llama of cli.py
CLI_MLA = {"multi-latent-attention": True, "q-lora-rank": 16, "kv-lora-rank": 12, "qk-head-dim": 8,
           "qk-pos-emb-head-dim": 4, "v-head-dim": 6, "qk-layernorm": True, "rotary-scaling-factor": 4.0,
           "mscale": 0.707, "mscale-all-dim": 0.707, "original-max-position-embeddings": 8,
           "group-query-attention": None, "num-query-groups": None}
CLI_ITERS, CLI_SAVE_AT = 4, 2


def _cli_flags(data, root, *changes):
    from megatron_zero.testing.cli import cli_flags
    return cli_flags(data, root / "cache", "llama", CLI_MLA, *changes)


def _cli_rtol(data, root):
    """The losses' tolerance: the step's summation path of the toy pretrain_gpt.py builds."""
    from megatron_zero.arguments import parse_args
    from megatron_zero.model.architecture import gpt_config
    from megatron_zero.testing.cli import TINY

    cfg = gpt_config(parse_args(_cli_flags(data, root, {"train-iters": CLI_ITERS}), world_size=1), 257)
    return model_rtol(gpt_path_length(cfg, TINY["global-batch-size"] * TINY["seq-length"]))


@pytest.fixture(scope="module")
def cli_reference(tmp_path_factory):
    """The corpus and the one-process run's losses."""
    from megatron_zero.testing.cli import logged_losses, pretrain_cli, text_data

    root = tmp_path_factory.mktemp("mla_cli")
    data = text_data(root / "text")
    run = pretrain_cli(1, _cli_flags(data, root, {"train-iters": CLI_ITERS}), timeout=600)
    return data, root, logged_losses(run)


def _in_order(losses):
    return [losses[i] for i in sorted(losses)]


@pytest.mark.slow  # default tier: test_tp2_with_and_without_sequence_parallelism_matches_one_process
def test_cli_tp2_pp2_sequence_parallel_matches_one_process_and_resumes_at_tp1(cli_reference, tmp_path):
    from megatron_zero.testing.cli import CliResume

    data, root, want = cli_reference
    layout = {"tensor-model-parallel-size": 2, "pipeline-model-parallel-size": 2, "sequence-parallel": True}
    run = CliResume(str(tmp_path), lambda *changes: _cli_flags(data, root, *changes), layout, nproc=4,
                    iters=CLI_ITERS, save_at=CLI_SAVE_AT)
    rtol = _cli_rtol(data, root)
    assert_losses_close(_in_order(run.losses), _in_order(want), rtol, "TP2 x PP2 with sequence parallelism")
    at_tp1 = {"tensor-model-parallel-size": 1, "pipeline-model-parallel-size": 1, "sequence-parallel": None}
    run.assert_matches(run.resume("universal", at_tp1), rtol)
    run.assert_matches(run.resume("reshaped", at_tp1), rtol)  # loaded at TP1 directly, without the conversion


@pytest.mark.slow  # default tier: test_tp2_with_and_without_sequence_parallelism_matches_one_process
@pytest.mark.parametrize("comm", ["p2p", "a2a"])
def test_cli_context_parallel_matches_one_process(cli_reference, comm):
    from megatron_zero.testing.cli import logged_losses, pretrain_cli

    data, root, want = cli_reference
    run = pretrain_cli(2, _cli_flags(data, root, {"train-iters": CLI_ITERS, "context-parallel-size": 2,
                                                  "cp-comm-type": comm}), timeout=600)
    assert_losses_close(_in_order(logged_losses(run)), _in_order(want), _cli_rtol(data, root), f"CP2 {comm}")


@pytest.mark.slow  # default tier: test_tp2_with_and_without_sequence_parallelism_matches_one_process
def test_cli_zero3_dp2_with_selective_recompute_matches_one_process(cli_reference):
    from megatron_zero.testing.cli import logged_losses, pretrain_cli

    data, root, want = cli_reference
    run = pretrain_cli(2, _cli_flags(data, root, {"train-iters": CLI_ITERS, "zero-stage": 3,
                                                  "recompute-granularity": "selective"}), timeout=600)
    assert_losses_close(_in_order(logged_losses(run)), _in_order(want), _cli_rtol(data, root),
                        "DP2 ZeRO-3, selective recompute")


@pytest.mark.slow  # default tier: test_fp8_converts_mla_linear_layers_and_trains
def test_cli_fp8_trains_mla_at_tp2_with_sequence_parallelism(cli_reference):
    pytest.importorskip("torchao")
    from megatron_zero.testing.cli import logged_losses, pretrain_cli

    data, root, want = cli_reference
    run = pretrain_cli(2, _cli_flags(data, root, {"train-iters": CLI_ITERS, "tensor-model-parallel-size": 2,
                                                  "sequence-parallel": True, "fp8-format": "hybrid",
                                                  "fp8-emulate": True}), timeout=600)
    assert "14 linear layers of this stage's blocks" in run.stdout + run.stderr  # 2 blocks x (5 MLA + 2 MLP)
    losses = logged_losses(run)
    assert sorted(losses) == list(range(1, CLI_ITERS + 1))
    assert losses[CLI_ITERS] < losses[1]  # it learns


def test_flops_per_iteration_counts_mla_matmuls():
    """throughput's count with MLA's sizes is torch's FlopCounterMode count of the layer's matmuls (forward; the
    unfused core multiplies the whole s x s: the count's causal=False; the log's counts the causal half, as
    Megatron-LM does)."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_zero.model.mla import MultiLatentAttention, mla_flop_sizes
    from megatron_zero.metrics.throughput import gpt_flops_per_iteration

    for change in CASES:
        cfg = layer_config(**change, attention_backend="unfused")
        with FlopCounterMode(display=False) as counter:
            MultiLatentAttention(cfg)(torch.randn(2, cfg.seq_length, cfg.hidden_size))
        def count(attention):
            return gpt_flops_per_iteration(2, cfg.seq_length, 1, cfg.hidden_size, 0, attention=attention, causal=False)
        attention = count(mla_flop_sizes(cfg)) - count((0, 0))  # the count less its MLP's
        assert attention == 3 * counter.get_total_flops(), change  # forward + backward (twice the forward)
