"""DeepSeek-V3's router (--moe-router-enable-expert-bias, --moe-router-bias-update-rate, --moe-router-num-groups,
--moe-router-group-topk) against megatron-core 0.16.1's own TopKRouter on the CPU, given the same router weight,
expert bias and tokens (its token order [s, b], ours [b, s]): the chosen experts and the router weights equal,
bit for bit (the same fp32 operations); the tokens per expert a training forward counts (none in evaluation) and
the bias update equal Megatron-Core's get_updated_expert_bias; the flags and their refusals."""
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from megatron_zero.arguments import parse_args
from megatron_zero.moe.expert_bias import ExpertBiasUpdate
from megatron_zero.moe.layer import MoELayer
from megatron_zero.model.transformer import ParallelMLP
from megatron_zero.testing import run_ranks
from megatron_zero.testing.expert_bias_runs import layer_bias_update
from megatron_zero.testing.flag_checks import BASE, refused, with_flags
from megatron_zero.testing.tiny_gpt import tiny_gpt_config

router_module = pytest.importorskip("megatron.core.transformer.moe.router")
moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")

S, B, H, E = 16, 2, 32, 8
RATE = 1e-3
# (score function, pre-softmax, top-k, groups, group top-k, expert bias, scaling factor)
ROUTERS = {
    "deepseek-v3": ("sigmoid", False, 4, 4, 2, True, 2.5),
    "sigmoid-bias": ("sigmoid", False, 2, None, None, True, None),
    "sigmoid-groups": ("sigmoid", False, 2, 2, 1, False, None),
    "softmax-groups": ("softmax", False, 4, 4, 2, False, None),
    "pre-softmax-groups": ("softmax", True, 2, 4, 1, False, None),
}


def megatron_core_router(score, pre, topk, groups, group_topk, bias, scale):
    """TopKRouter on the CPU: its buffers and gate ask for the current CUDA device and Transformer Engine's GEMM
    (absent: torch.mm), both answered within `_on_cpu()` only."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, num_moe_experts=E,
                            moe_router_topk=topk, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                            add_bias_linear=False, moe_router_dtype="fp32", moe_ffn_hidden_size=H,
                            moe_router_score_function=score, moe_router_pre_softmax=pre,
                            moe_router_num_groups=groups, moe_router_group_topk=group_topk,
                            moe_router_enable_expert_bias=bias, moe_router_bias_update_rate=RATE,
                            moe_router_topk_scaling_factor=scale)
    return router_module.TopKRouter(cfg, pg_collection=SimpleNamespace(tp=None, cp=None, tp_cp=None, tp_dp_cp=None))


def _on_cpu():
    return (mock.patch("torch.cuda.current_device", lambda: "cpu"),
            mock.patch.object(moe_utils, "te_general_gemm", None, create=True))


def our_layer(score, pre, topk, groups, group_topk, bias, scale):
    cfg = tiny_gpt_config(hidden_size=H, num_experts=E, moe_router_topk=topk, moe_router_load_balancing_type="none",
                          moe_router_score_function=score, moe_router_pre_softmax=pre, moe_router_num_groups=groups,
                          moe_router_group_topk=group_topk, moe_router_enable_expert_bias=bias,
                          moe_router_bias_update_rate=RATE, moe_router_topk_scaling_factor=scale,
                          moe_ffn_hidden_size=H)
    return MoELayer(cfg, mlp_class=ParallelMLP)


def _routed(layer, x):
    """(dense router weights [b s, E], chosen [b s, E]) of our layer's router on x [b, s, h]."""
    seen = {}
    import megatron_zero.moe.layer as layer_module
    route = layer_module.route

    def spy(*args, **kwargs):
        seen["out"] = route(*args, **kwargs)
        return seen["out"]

    with mock.patch.object(layer_module, "route", spy):
        layer(x)
    weights, ids = seen["out"]
    dense = torch.zeros(ids.shape[0], E).scatter(1, ids, weights.detach())
    return dense, dense != 0


def _megatron_order(t):
    return t.view(B, S, E).transpose(0, 1).reshape(S * B, E)


@pytest.mark.parametrize("name", list(ROUTERS))
def test_router_and_bias_update_match_megatron_core(name):
    settings = ROUTERS[name]
    cuda_device, te_gemm = _on_cpu()
    g = torch.Generator().manual_seed(len(name))
    with cuda_device, te_gemm:
        mc = megatron_core_router(*settings)
        with torch.no_grad():
            mc.weight.copy_(torch.randn(E, H, generator=g))
            if mc.expert_bias is not None:  # large enough to move choices: the test tells biased from unbiased
                mc.expert_bias.copy_(torch.randn(E, generator=g) * 0.3)
        x = torch.randn(S, B, H, generator=g)
        mc.train()
        probs, routing_map = mc(x)
        with torch.no_grad():
            mc.eval()
            mc(x)  # evaluation counts nothing

    ours = our_layer(*settings)
    with torch.no_grad():
        ours.deepspeed_moe.gate.wg.weight.copy_(mc.weight)
        if settings[5]:
            ours.deepspeed_moe.gate.expert_bias.copy_(mc.expert_bias)
    ours.train()
    dense, chosen = _routed(ours, x.transpose(0, 1).contiguous())
    with torch.no_grad():
        ours.eval()
        ours(x.transpose(0, 1).contiguous())
    assert torch.equal(_megatron_order(chosen), routing_map)
    assert torch.equal(_megatron_order(dense), probs)
    if settings[3]:  # groups: every token's experts lie in its group-topk groups, not all as the plain top-k's
        per_group = E // settings[3]
        assert all(len({int(e) // per_group for e in row.nonzero()}) <= settings[4] for row in chosen)
        plain = mock.patch.object(ours.deepspeed_moe.config, "moe_router_group_topk", None)
        with plain, torch.no_grad():
            assert not torch.equal(_routed(ours, x.transpose(0, 1).contiguous())[1], chosen)
    if not settings[5]:
        return
    gate = ours.deepspeed_moe.gate
    assert torch.equal(gate.tokens_per_expert, mc.local_tokens_per_expert)
    unbiased = torch.topk(torch.sigmoid(x.reshape(-1, H) @ mc.weight.detach().T), settings[2], dim=1)[1]
    assert not torch.equal(torch.zeros(S * B, E).scatter(1, unbiased, 1.0).sum(0), gate.tokens_per_expert)
    with mock.patch("torch.distributed.all_reduce", lambda *a, **k: None), \
            mock.patch.object(moe_utils.parallel_state, "get_tensor_and_data_parallel_group", lambda **k: None):
        want = moe_utils.get_updated_expert_bias(mc.local_tokens_per_expert.clone(), mc.expert_bias, RATE)
    ExpertBiasUpdate(ours, RATE).step()
    assert torch.equal(gate.expert_bias, want)
    assert not torch.equal(want, mc.expert_bias)
    assert torch.equal(gate.tokens_per_expert, torch.zeros(E))
    assert "mlp" not in gate.state_dict() and set(ours.state_dict()) >= {"deepspeed_moe.gate.expert_bias"}
    assert "deepspeed_moe.gate.tokens_per_expert" not in ours.state_dict()


DEEPSEEK = dict(num_experts=8, moe_router_topk=4, moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True, moe_router_num_groups=4, moe_router_group_topk=2)


def test_deepseek_router_flags_parse():
    args = parse_args(with_flags(BASE, **DEEPSEEK, moe_router_bias_update_rate=0.01))
    assert (args.moe_router_enable_expert_bias, args.moe_router_bias_update_rate, args.moe_router_num_groups,
            args.moe_router_group_topk) == (True, 0.01, 4, 2)
    assert parse_args(with_flags(BASE, **DEEPSEEK)).moe_router_bias_update_rate == 1e-3  # Megatron-Core's default


@pytest.mark.parametrize("changes,message", [
    ({"moe_router_score_function": "softmax"}, "--moe-router-enable-expert-bias biases the sigmoid scores"),
    ({"moe_router_group_topk": None}, "--moe-router-num-groups 4 needs --moe-router-group-topk"),
    ({"moe_router_num_groups": None}, "--moe-router-group-topk 2 needs --moe-router-num-groups"),
    ({"moe_router_num_groups": 3}, "--moe-router-num-groups 3 must divide --num-experts 8"),
    ({"moe_router_group_topk": 5}, "--moe-router-group-topk 5 must lie in 1..--moe-router-num-groups 4"),
    ({"moe_router_group_topk": 1}, "the chosen groups must hold topk experts"),
    ({"moe_router_bias_update_rate": -1.0}, "--moe-router-bias-update-rate -1.0 must not be negative"),
])
def test_deepseek_router_flags_refused(changes, message, capsys):
    flags = {k: v for k, v in {**DEEPSEEK, **changes}.items() if v is not None}
    assert message in refused(with_flags(BASE, **flags), 1, capsys)
    dense = with_flags(BASE, moe_router_enable_expert_bias=True)
    assert "configure the router of MoE layers; give --num-experts" in refused(dense, 1, capsys)


def test_hugging_face_export_refuses_a_router_its_models_lack():
    """Mixtral / Qwen2-MoE / Qwen3-MoE route by softmax without a bias: a DeepSeek-V3 router has no export there."""
    from megatron_zero.checkpoint.errors import CheckpointError
    from megatron_zero.checkpoint.export.hf import for_config
    from megatron_zero.testing.tiny_gpt import tiny_llama_config

    assert for_config(tiny_llama_config(num_experts=8)).HF_ARCHITECTURE == "MixtralForCausalLM"
    for router in ({"moe_router_enable_expert_bias": True}, {"moe_router_num_groups": 4, "moe_router_group_topk": 2}):
        with pytest.raises(CheckpointError, match="no Hugging Face architecture holds this model"):
            for_config(tiny_llama_config(num_experts=8, moe_router_score_function="sigmoid", **router))


def test_counts_once_under_full_recompute():
    """A layer run again by full recompute in backward adds no tokens a second time (Megatron-Core counts only
    with grad on, its recompute's first pass runs without); an evaluation forward adds none."""
    from megatron_zero.model.gpt import reference_model
    from megatron_zero.moe.expert_bias import ExpertBiasUpdate as Update

    counts = []
    for recompute in ({}, {"recompute_granularity": "full", "recompute_method": "uniform"}):
        torch.manual_seed(0)
        model = reference_model(tiny_gpt_config(num_layers=2, **{k: v for k, v in DEEPSEEK.items()}, **recompute))
        tokens = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
        model.train()
        model(tokens, tokens).sum().backward()
        with torch.no_grad():
            model(tokens, tokens)
        counts.append([r.tokens_per_expert.clone() for r in Update(model, RATE).routers])
    assert all(float(c.sum()) == 2 * 8 * DEEPSEEK["moe_router_topk"] for c in counts[0])
    assert all(torch.equal(a, b) for a, b in zip(*counts))


def test_update_sums_the_tokens_over_data_parallel_ranks():
    """Two ranks each routing half the tokens make the one-process update on all of them, bit for bit (the
    counts summed in one all-reduce), step after step (the second step routes with the first's bias)."""
    cfg = tiny_gpt_config(num_layers=1, **DEEPSEEK, moe_router_bias_update_rate=0.05)
    want = layer_bias_update(cfg, 4, 0.05)
    assert not torch.equal(want[0], torch.zeros(E)) and not torch.equal(want[1], want[0])
    for got in run_ranks(layer_bias_update, 2, cfg, 4, 0.05):
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_checkpoint_buffers_found_in_any_saved_stage():
    """A reshaped load takes each expert bias from whichever saved stage's model-states file holds it (TP rank 0's
    of each stage), the bytes as saved; a bias of this rank's layers the model has no place for is refused."""
    from megatron_zero.checkpoint.errors import CheckpointError
    from megatron_zero.checkpoint.model_buffers import restore_buffers, saved_buffers
    from megatron_zero.model.gpt import reference_model

    model = reference_model(tiny_gpt_config(num_layers=2, **DEEPSEEK))
    names = ["2.mlp.deepspeed_moe.gate.expert_bias", "3.mlp.deepspeed_moe.gate.expert_bias"]
    values = [torch.randn(E, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    files = {mp: {"module": {n: v}, "buffer_names": [n], "checkpoint_parallel_dimensions": {"tp_degree": 2,
                                                                                         "pp_degree": 2}}
             for mp, n, v in ((0, names[0], values[0]), (2, names[1], values[1]))}
    saved = saved_buffers(files.get)  # saved at TP2 x PP2: model-parallel ranks 0 and 2 are TP rank 0's
    restore_buffers(model, saved, "ckpt")
    got = {n: b for n, b in model.named_buffers() if n.endswith("expert_bias")}
    assert all(torch.equal(got[n], v) for n, v in zip(names, values))
    plain = reference_model(tiny_gpt_config(num_layers=2, **{**DEEPSEEK, "moe_router_enable_expert_bias": False}))
    with pytest.raises(CheckpointError, match="ckpt holds 2.mlp.deepspeed_moe.gate.expert_bias and 1 more, state"):
        restore_buffers(plain, saved, "ckpt")


@pytest.mark.parametrize("freq", [1, 2], ids=["stacked", "per-layer"])
def test_torch_dist_carries_the_bias_both_ways(tmp_path, freq):
    """Ours -> torch_dist (write_torch_dist): each MoE block's bias under Megatron-Core's `mlp.router.expert_bias`
    (stacked [L, E] when every block is MoE, else one key per layer), read back by TorchDistFiles exactly into the
    model-states buffers a load restores; without --moe-router-enable-expert-bias the key is refused by name."""
    from megatron_zero.checkpoint.interop.convert import config_args
    from megatron_zero.checkpoint.interop.dcp_reader import DcpReader
    from megatron_zero.checkpoint.interop.mcore_names import expert_bias_names
    from megatron_zero.checkpoint.interop.torch_dist import TorchDistFiles
    from megatron_zero.checkpoint.interop.to_universal import write_universal
    from megatron_zero.checkpoint.interop.torch_dist_write import write_torch_dist
    from megatron_zero.checkpoint.errors import CheckpointError
    from megatron_zero.model.gpt import reference_model
    from megatron_zero.model.sharding import gather_state_dicts

    cfg = tiny_gpt_config(num_layers=2, **DEEPSEEK, moe_layer_freq=freq, add_bias_linear=False)
    torch.manual_seed(0)
    model = reference_model(cfg)
    full = gather_state_dicts([{n: p.detach() for n, p in model.named_parameters()}], cfg)
    names = expert_bias_names(cfg)
    biases = {n: torch.randn(E, generator=torch.Generator().manual_seed(i)) for i, n in enumerate(names)}
    assert len(names) == (2 if freq == 1 else 1)

    class Source:
        has_optimizer = True

        def full(self, name, which):
            return full[name], None, 1

        def step(self, name):
            return 3
    args = dict(config_args(cfg), **{k: getattr(cfg, k) for k in ("num_experts", "moe_router_topk", "moe_layer_freq",
                                                                    "moe_router_enable_expert_bias")})
    head = {"iteration": 3, "args": args, "universal_checkpoint_info": {"original_vocab_size": cfg.vocab_size},
            "module": biases, "buffer_names": list(biases)}
    write_universal(Source(), cfg, head, str(tmp_path / "u" / "src"), "test")
    write_torch_dist(str(tmp_path / "u" / "src"), str(tmp_path / "mc"))
    directory = str(tmp_path / "mc" / "iter_0000003")
    keys = DcpReader(directory).tensors
    key = "decoder.layers.mlp.router.expert_bias" if freq == 1 else "decoder.layers.0.mlp.router.expert_bias"
    assert tuple(keys[key].size) == ((2, E) if freq == 1 else (E,))
    states = TorchDistFiles(directory, cfg).model_states(0)
    assert states["buffer_names"] == names and all(torch.equal(states["module"][n], biases[n]) for n in names)
    plain = tiny_gpt_config(num_layers=2, **{**DEEPSEEK, "moe_router_enable_expert_bias": False}, moe_layer_freq=freq,
                            add_bias_linear=False)
    with pytest.raises(CheckpointError, match="give --moe-router-enable-expert-bias"):
        TorchDistFiles(directory, plain)
