"""--moe-token-dispatcher-type allgather (moe/allgather_dispatch.py, Megatron-Core's all-gather dispatcher):
the MoE layer at EP2 against the same layer with the all-to-all (outputs and every gradient, the aux and z
losses in them; dropless, with Megatron-Core's capacity and with DeepSpeed-MoE's capacity gating, each
dropping the same pairs as the all-to-all since dropping is decided before dispatch), then training at EP2 x
DP2 ZeRO-1 (GPT) and, slow, EP2 x TP2 ZeRO-2 (Llama, grouped GEMM) and EP2 x DP2 with capacity, against the
single-process reference: each step's loss and global gradient norm to model_rtol of one step's path."""
import dataclasses
import zlib

import pytest
import torch

from megatron_zero.arguments import parse_args
from megatron_zero.model.gpt import reference_model
from megatron_zero.model.transformer import ParallelMLP
from megatron_zero.moe import reset_aux_losses, set_aux_loss_scale
from megatron_zero.moe.layer import MoELayer
from megatron_zero.testing import run_ranks
from megatron_zero.testing.flag_checks import BASE, with_flags
from megatron_zero.testing.moe_train import GBS, moe_config, parallel_run, reference_run
from megatron_zero.testing.tolerances import (assert_close_scaled, assert_losses_close, global_norm_rtol,
                                              gpt_path_length, model_rtol)
from megatron_zero.distributed.topology import build_parallel_state

pytestmark = pytest.mark.multirank

TOKENS = 32  # a rank's tokens: 2 x 16
VARIANTS = {
    "dropless": {},
    "core_capacity": dict(moe_expert_capacity_factor=0.5),  # each expert keeps 8 of the 32 x 2 / 4 = 16 it gets
    "deepspeed_capacity": dict(moe_z_loss_coeff=None, moe_capacity_factor=0.5, moe_min_capacity=0, moe_use_rts=False,
                               moe_top2_2nd_expert_sampling=False),
}


def _layer_both_ways(state, overrides):
    """On each of 2 ranks (EP2): the layer's output and the gradients of x and of every parameter this rank
    holds, with the all-to-all and with the all-gather dispatcher, on the same weights and tokens."""
    cfg = moe_config(False, **overrides)
    layer = MoELayer(cfg, None, state.ep_group, ParallelMLP)
    with torch.no_grad():
        for name, p in layer.named_parameters():  # by name: the router the same on both ranks, each expert its own
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))) * 0.3)
    x = torch.randn(2, TOKENS // 2, cfg.hidden_size, generator=torch.Generator().manual_seed(state.rank))
    x.requires_grad_()
    results = {}
    set_aux_loss_scale(0.5)
    for dispatcher in ("alltoall", "allgather"):
        layer.deepspeed_moe.config = dataclasses.replace(cfg, moe_token_dispatcher_type=dispatcher)
        out = layer(x)
        grads = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
        results[dispatcher] = [out.detach(), *grads]
    reset_aux_losses()
    return results, cfg


def _every_variant():
    state = build_parallel_state(ep=2)
    return {variant: _layer_both_ways(state, overrides) for variant, overrides in VARIANTS.items()}


def test_allgather_dispatch_matches_alltoall():
    for per_variant in run_ranks(_every_variant, 2):
        for variant, (results, cfg) in per_variant.items():
            # a token's output: k expert rows summed in another order (per rank, then over ranks): fp32
            # reordering along the path h (router, fc1) + ffn (fc2) + k; gradients also sum over the EP x T tokens
            rtol = model_rtol(2 * (cfg.hidden_size + cfg.moe_ffn_hidden_size + cfg.moe_router_topk) + 2 * TOKENS)
            for i, (got, want) in enumerate(zip(results["allgather"], results["alltoall"])):
                assert_close_scaled(got, want, rtol, f"{variant}: {'output' if i == 0 else f'gradient {i - 1}'}")


LAYOUTS = {  # name: (tp, dp, ep, zero stage, llama, overrides)
    "ep2_dp2_zero1": (1, 2, 2, 1, False, {}),
    "ep2_tp2_zero2_llama_grouped": (2, 2, 2, 2, True, dict(moe_grouped_gemm=True)),
    "ep2_dp2_core_capacity": (1, 2, 2, 1, False, dict(moe_expert_capacity_factor=0.5)),
}


@pytest.mark.slow  # the default tier: test_allgather_dispatch_matches_alltoall, and test_moe_parity's alltoall
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_allgather_training_matches_reference(name):
    tp, dp, ep, stage, llama, overrides = LAYOUTS[name]
    mb, steps = 2, 4
    cfg = moe_config(llama, moe_token_dispatcher_type="allgather", **overrides)
    ref_losses, ref_norms = reference_run(cfg, dp, mb, steps)
    results = run_ranks(parallel_run, tp * dp, cfg, tp, 1, ep, stage, mb, steps, timeout=600)
    rtol = model_rtol(gpt_path_length(cfg, GBS * cfg.seq_length))
    count = sum(p.numel() for p in reference_model(cfg).parameters())
    for losses, norms in results:
        assert_losses_close(losses, ref_losses, rtol, f"{name} loss")
        assert_losses_close(norms, ref_norms, global_norm_rtol(rtol, count), f"{name} grad norm")


def test_allgather_flag_parses():
    args = parse_args(with_flags(BASE, num_experts=4, expert_model_parallel_size=2,
                                 moe_token_dispatcher_type="allgather"), world_size=2)
    assert args.moe_token_dispatcher_type == "allgather"
