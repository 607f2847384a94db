"""The MoE layer on one process: the sort-based dispatch computes sum_j w_tj expert_{e_tj}(x_t) (checked against
a dense evaluation: every expert on every token, masked), the aux and z losses reach the gradients with
the scale the training step sets (Megatron's MoEAuxLossAutoScaler), the parameter catalogue names the
experts, the expert-parallel groups are Megatron-Core's, and the layouts and flags outside what is
implemented are refused in one sentence."""
import pytest
import torch
import torch.nn.functional as F

from megatron_zero.arguments import parse_args
from megatron_zero.model.gpt import reference_model
from megatron_zero.model.params import param_names, param_spec
from megatron_zero.moe import reset_aux_losses, set_aux_loss_scale
from megatron_zero.moe.router import switch_load_balancing_loss, z_loss
from megatron_zero.testing.flag_checks import BASE, refused, with_flags
from megatron_zero.testing.moe_train import moe_config
from megatron_zero.testing.tolerances import assert_close_scaled, model_rtol
from megatron_zero.distributed.topology import Layout, TopologyError

TOKENS = 16


def _moe_and_input(llama, pre_softmax=False, **overrides):
    cfg = moe_config(llama, moe_router_pre_softmax=pre_softmax, **overrides)
    moe = reference_model(cfg)._modules["2"].mlp.deepspeed_moe
    x = torch.randn(2, TOKENS // 2, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    return cfg, moe, x.requires_grad_()


def _dense_evaluation(cfg, moe, x):
    """Every expert on every token; each token keeps its top-k, weighted; plus the losses it implies."""
    tokens = x.reshape(-1, cfg.hidden_size)
    logits = F.linear(tokens, moe.gate.wg.weight).float()
    probs = torch.softmax(logits, dim=-1)
    if cfg.moe_router_pre_softmax:
        weights, ids = torch.topk(probs, cfg.moe_router_topk)
    else:
        top, ids = torch.topk(logits, cfg.moe_router_topk)
        weights = torch.softmax(top, dim=-1)
    mask = torch.zeros_like(logits).scatter(1, ids, weights)  # [T, E]: a token's weight on each expert
    outs = torch.stack([e(tokens) for e in moe.experts.deepspeed_experts.values()], dim=1)  # [T, E, h]
    out = (mask.unsqueeze(-1) * outs).sum(1).view_as(x)
    counts = torch.zeros(cfg.num_experts).scatter_add(0, ids.reshape(-1), torch.ones(ids.numel()))
    aux = switch_load_balancing_loss(probs, counts, cfg.moe_router_topk, cfg.moe_aux_loss_coeff)
    return out, aux + z_loss(logits, cfg.moe_z_loss_coeff)


@pytest.mark.parametrize("llama,pre_softmax", [(False, False), (True, True)])
def test_moe_layer_matches_dense_evaluation_and_aux_gradients(llama, pre_softmax):
    cfg, moe, x = _moe_and_input(llama, pre_softmax)
    scale = 0.25  # loss scale / micro-batches
    set_aux_loss_scale(scale)
    try:
        out = moe(x)
        grads = torch.autograd.grad(out.square().sum(), [x, *moe.parameters()])
    finally:
        set_aux_loss_scale(1.0)
        reset_aux_losses()
    want_out, losses = _dense_evaluation(cfg, moe, x)
    want = torch.autograd.grad(want_out.square().sum() + scale * losses, [x, *moe.parameters()])
    rtol = model_rtol(4 * (cfg.hidden_size + cfg.moe_ffn_hidden_size) + 2 * TOKENS)  # two layers, and back
    assert_close_scaled(out.detach(), want_out.detach(), rtol, "output")
    for (name, _), got, exp in zip([("x", x), *moe.named_parameters()], grads, want):
        assert_close_scaled(got, exp, rtol, f"gradient of {name}")
    assert grads[1].abs().sum() > 0  # the router learns (through the weights and the losses)


def test_aux_losses_reach_the_router_only_through_their_scale():
    cfg, moe, x = _moe_and_input(False)
    grads = {}
    for scale in (0.0, 1.0):
        set_aux_loss_scale(scale)
        grads[scale] = torch.autograd.grad(moe(x).sum(), moe.gate.wg.weight)[0]
    set_aux_loss_scale(1.0)
    reset_aux_losses()
    assert not torch.equal(grads[0.0], grads[1.0])


def test_catalogue_names_every_expert():
    cfg = moe_config(True)  # MoE in blocks 0 and 2 (layers 2 and 4)
    names = param_names(cfg)
    experts = [n for n in names if ".deepspeed_experts." in n]
    assert len(experts) == 2 * cfg.num_experts * 2  # two MoE layers, two matrices per SwiGLU expert
    assert "3.mlp.dense_h_to_4h.weight" in names and "2.mlp.dense_h_to_4h.weight" not in names
    spec = param_spec("4.mlp.deepspeed_moe.experts.deepspeed_experts.3.dense_h_to_4h.weight", cfg)
    assert spec.full_shape == (2 * cfg.moe_ffn_hidden_size, cfg.hidden_size) and spec.sub_params == 2
    assert param_spec("2.mlp.deepspeed_moe.gate.wg.weight", cfg).full_shape == (cfg.num_experts, cfg.hidden_size)


def test_expert_groups_are_carved_out_of_data_parallel():
    layout = Layout(tp=2, pp=1, dp=4)  # rank = dp * 2 + tp
    assert layout.ep_group(2, 2) == [0, 2] and layout.ep_group(5, 2) == [5, 7]
    assert layout.expert_dp_group(2, 2) == [2, 6] and layout.expert_dp_group(5, 2) == [1, 5]
    assert sorted(r for g in layout.all_groups("ep", 2) for r in g) == list(range(8))
    with pytest.raises(TopologyError, match="must divide the data-parallel size 4"):
        layout.check_expert_parallel(3)


MOE_ARGS = {"num_experts": 4, "moe_aux_loss_coeff": 0.01}


@pytest.mark.parametrize("changes,world,message", [
    ({"expert_model_parallel_size": 2}, 2, "needs MoE layers"),
    ({**MOE_ARGS, "expert_model_parallel_size": 4}, 2, "must divide the data-parallel size 2"),
    ({"num_experts": 3, "expert_model_parallel_size": 2}, 2, "multiple of --expert-model-parallel-size 2"),
    ({**MOE_ARGS, "moe_router_topk": 5}, 1, "--moe-router-topk 5"),
    ({**MOE_ARGS, "expert_model_parallel_size": 2, "zero_stage": 3, "zero_quantized_weights": True}, 2,
     "runs without ZeRO++"),
    ({**MOE_ARGS, "tensor_model_parallel_size": 2, "sequence_parallel": True,
      "moe_expert_capacity_factor": 1.0}, 2, "--sequence-parallel"),
    ({**MOE_ARGS, "tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_model_parallel_size": 2,
      "moe_token_dispatcher_type": "allgather"}, 4, "with --sequence-parallel use alltoall"),
])
def test_moe_layouts_outside_the_implemented_are_refused(changes, world, message, capsys):
    assert message in refused(with_flags(BASE, **changes), world, capsys)


def test_moe_flags_parse():
    args = parse_args(with_flags(BASE, **MOE_ARGS, expert_model_parallel_size=2, moe_ffn_hidden_size=32),
                      world_size=2)
    assert (args.num_experts, args.expert_model_parallel_size, args.moe_ffn_hidden_size) == (4, 2, 32)


def test_expert_parallel_stage_implements_the_protocol():
    from megatron_zero.distributed.device import HOST
    from megatron_zero.zero.expert_stage import ExpertParallelStage, split_expert_groups
    from megatron_zero.zero.stage_interface import ZeroStage

    model = reference_model(moe_config())
    dense, _, expert, _ = split_expert_groups([list(model.named_parameters())], [{}])
    assert all(".deepspeed_experts." in n for g in expert for n, _ in g)
    assert not any(".deepspeed_experts." in n for g in dense for n, _ in g)
    stage = ExpertParallelStage(dense, expert, None, None, 1, torch.float32, 4000, HOST)
    assert isinstance(stage, ZeroStage)
    assert len(stage.initial_masters) == 2 and stage.group_partition_counts() == [1, 1]
