"""The shared expert (--moe-shared-expert-intermediate-size, --moe-shared-expert-gate): the MoE layer's output
against a dense evaluation (every routed expert on every token, masked by the router's top-k weights, plus
sigmoid(x g^T) times the shared MLP written out with F.linear), the parameter catalogue (the shared expert is
a dense, TP-split parameter in the layer's file, not an expert one), the flags and their refusals, the resume
check refusing another width, and the parity of EP2 x DP2 (and, slow, EP2 x TP2) runs against the
single-process reference."""
import pytest
import torch
import torch.nn.functional as F

from megatron_zero.checkpoint.compat import disagreements
from megatron_zero.checkpoint.expert_layout import is_expert_param
from megatron_zero.model.gpt import reference_model
from megatron_zero.model.params import param_names, param_spec
from megatron_zero.testing import run_ranks
from megatron_zero.testing.flag_checks import BASE, refused, with_flags
from megatron_zero.testing.moe_train import GBS, moe_config, parallel_run, reference_run
from megatron_zero.testing.tolerances import (assert_close_scaled, assert_losses_close, global_norm_rtol,
                                              gpt_path_length, model_rtol)

SHARED = dict(moe_shared_expert_intermediate_size=24)


def _mlp(x, w1, w2, swiglu):
    y = F.linear(x, w1)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w2)
    return F.linear(F.gelu(y, approximate="tanh"), w2)


@pytest.mark.parametrize("llama,gated", [(False, False), (True, True)])
@torch.no_grad()
def test_shared_expert_layer_matches_dense_evaluation(llama, gated):
    cfg = moe_config(llama, add_bias_linear=False, moe_shared_expert_gate=gated, **SHARED)
    layer = reference_model(cfg)._modules["2"].mlp
    x = torch.randn(2, 8, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    tokens = x.reshape(-1, cfg.hidden_size)
    moe = layer.deepspeed_moe
    logits = F.linear(tokens, moe.gate.wg.weight).float()
    top, ids = torch.topk(logits, cfg.moe_router_topk)
    mask = torch.zeros_like(logits).scatter(1, ids, torch.softmax(top, dim=-1))
    experts = list(moe.experts.deepspeed_experts.values())
    routed = sum(mask[:, e:e + 1] * _mlp(tokens, m.dense_h_to_4h.weight, m.dense_4h_to_h.weight, cfg.swiglu)
                 for e, m in enumerate(experts))
    s = layer.shared_expert
    shared = _mlp(tokens, s.dense_h_to_4h.weight, s.dense_4h_to_h.weight, cfg.swiglu)
    if gated:
        shared = torch.sigmoid(F.linear(tokens, layer.shared_expert_gate.weight)) * shared
    out = layer(x).reshape(-1, cfg.hidden_size)
    assert_close_scaled(out, routed + shared, model_rtol(4), "MoE layer with a shared expert")


def test_catalogue_names_the_shared_expert_as_a_dense_parameter():
    cfg = moe_config(True, moe_shared_expert_gate=True, **SHARED)
    names = [n for n in param_names(cfg) if ".shared_expert" in n]
    block = [n for n in names if n.startswith("2.")]
    assert block == ["2.mlp.shared_expert.dense_h_to_4h.weight", "2.mlp.shared_expert.dense_4h_to_h.weight",
                     "2.mlp.shared_expert_gate.weight"]
    fc1, fc2, gate = (param_spec(n, cfg) for n in block)
    assert (fc1.full_shape, fc1.partition_dim, fc1.sub_params) == ((48, cfg.hidden_size), 0, 2)
    assert (fc2.full_shape, fc2.partition_dim) == ((cfg.hidden_size, 24), 1)
    assert (gate.full_shape, gate.partition_dim) == ((1, cfg.hidden_size), None)
    assert not any(is_expert_param(n) for n in names)
    model = reference_model(cfg)
    assert [n for n, _ in model.named_parameters()] == param_names(cfg)
    assert not any(getattr(p, "expert_parallel", False) for n, p in model.named_parameters() if ".shared_" in n)


MOE = {"num_experts": 4}


@pytest.mark.parametrize("changes,world,message", [
    ({**MOE, "moe_shared_expert_overlap": True}, 1, "give --moe-shared-expert-intermediate-size or drop the flag"),
    ({**MOE, "moe_shared_expert_gate": True}, 1, "give --moe-shared-expert-intermediate-size"),
    ({"moe_shared_expert_intermediate_size": 32}, 1, "give --num-experts"),
    ({**MOE, "moe_shared_expert_intermediate_size": 33, "tensor_model_parallel_size": 2}, 2,
     "--moe-shared-expert-intermediate-size 33 is not a positive multiple"),
])
def test_shared_expert_flags_outside_the_implemented_are_refused(changes, world, message, capsys):
    assert message in refused(with_flags(BASE, **changes), world, capsys)


def test_resume_with_another_shared_expert_is_refused():
    saved = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_experts": 4,
             "moe_shared_expert_intermediate_size": 32, "moe_shared_expert_gate": True}
    here = {**saved, "moe_shared_expert_intermediate_size": 64}
    found = disagreements({"args": saved}, here, 100, lambda tp: 128)
    assert found == ["moe_shared_expert_intermediate_size 32 in the checkpoint vs 64 here"]
    assert len(disagreements({"args": saved}, {**saved, "moe_shared_expert_gate": False}, 100, lambda tp: 128)) == 1
    assert disagreements({"args": saved}, saved, 100, lambda tp: 128) == []


LAYOUTS = {"ep2_dp2_zero1": (1, 2, 2, 1, False), "ep2_tp2_zero2_llama": (2, 2, 2, 2, True)}  # tp, dp, ep, stage, llama


@pytest.mark.multirank
@pytest.mark.slow  # 4 ranks, > 30 s each; the default tier runs an imported MoE at EP2 (tests/test_hf_moe.py)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_shared_expert_parity_with_the_reference(name):
    tp, dp, ep, stage, llama = LAYOUTS[name]
    cfg = moe_config(llama, moe_shared_expert_gate=llama, **SHARED)
    ref_losses, ref_norms = reference_run(cfg, dp, 2, steps=5)
    results = run_ranks(parallel_run, tp * dp, cfg, tp, 1, ep, stage, 2, 5, timeout=600)
    rtol = model_rtol(gpt_path_length(cfg, GBS * cfg.seq_length))
    count = sum(p.numel() for p in reference_model(cfg).parameters())
    for losses, norms in results:
        assert_losses_close(losses, ref_losses, rtol, f"{name} loss")
        assert_losses_close(norms, ref_norms, global_norm_rtol(rtol, count), f"{name} grad norm")
