"""Megatron-LM's recompute switches: --recompute-activations (its selective recompute) and --moe-layer-recompute
(each MoE layer run again in backward, Megatron-Core's moe_layer_recompute; config/recompute.py).

The MoE layer recomputed runs the same operations on the same inputs under the same RNG states, so the loss,
every gradient and the logged aux losses are bit-identical to the run without it, while the layer's forward
runs twice per step (default tier, one process). Through pretrain_gpt.py each switch trains to the losses and
gradient norms of the run without it, digit for digit (slow); the flags map to the granularity Megatron-LM
gives them, and contradictions are refused in one sentence.
"""
import re

import pytest
import torch

from megatron_zero.arguments import parse_args
from megatron_zero.model import reference_model
from megatron_zero.model.architecture import gpt_config
from megatron_zero.moe import aux_losses, reset_aux_losses
from megatron_zero.moe.layer import DeepSpeedMoE
from megatron_zero.testing.cli import cli_flags, logged_losses, pretrain_cli, text_data
from megatron_zero.testing.flag_checks import BASE, refused, with_flags
from megatron_zero.testing.tiny_gpt import tiny_llama_config


def test_flags_mean_megatrons_granularity(capsys):
    args = parse_args(with_flags(BASE, recompute_activations=True), world_size=1)
    assert (args.recompute_granularity, args.recompute_method) == ("selective", None)
    assert gpt_config(args, 100).recompute_granularity == "selective"
    args = parse_args(with_flags(BASE, moe_layer_recompute=True, num_experts=4), world_size=1)
    cfg = gpt_config(args, 100)
    assert (cfg.recompute_granularity, cfg.moe_layer_recompute) == ("selective", True)
    assert not gpt_config(parse_args(with_flags(BASE, num_experts=4), world_size=1), 100).moe_layer_recompute
    line = refused(with_flags(BASE, recompute_activations=True, recompute_granularity="full",
                              recompute_method="uniform"), 1, capsys)
    assert "--recompute-activations" in line and "full" in line
    line = refused(with_flags(BASE, moe_layer_recompute=True), 1, capsys)
    assert "--moe-layer-recompute" in line and "--num-experts" in line
    line = refused(with_flags(BASE, moe_layer_recompute=True, num_experts=4, checkpoint_activations=True), 1, capsys)
    assert "--moe-layer-recompute" in line and "full" in line


def _step(recompute: bool):
    cfg = tiny_llama_config(num_layers=2, num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01,
                            moe_z_loss_coeff=1e-3, moe_shared_expert_intermediate_size=32,
                            moe_layer_recompute=recompute, recompute_granularity="selective" if recompute else None)
    model = reference_model(cfg).train()
    calls = []
    for m in model.modules():
        if isinstance(m, DeepSpeedMoE):
            m.register_forward_hook(lambda *_: calls.append(1))
    g = torch.Generator().manual_seed(7)
    text = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=g)
    reset_aux_losses()
    loss = model(text[:, :-1], labels=text[:, 1:])
    loss.backward()
    logged = {k: v.clone() for k, v in aux_losses().items()}
    reset_aux_losses()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, logged, len(calls)


def test_moe_layer_recompute_is_bit_identical_and_runs_again():
    loss, grads, logged, calls = _step(False)
    loss_r, grads_r, logged_r, calls_r = _step(True)
    assert (calls, calls_r) == (2, 4)  # two MoE layers, each run again in backward
    assert torch.equal(loss, loss_r)
    assert logged.keys() == logged_r.keys() and logged  # the aux losses are logged once
    assert all(torch.equal(logged[k], logged_r[k]) for k in logged)
    for name, grad in grads.items():
        assert torch.equal(grad, grads_r[name]), name


def _log_pairs(run):
    """{iteration: (lm loss, grad norm)} as logged."""
    found = re.findall(r"iteration +(\d+)/ *\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|.*?grad norm: ([0-9.]+)", run.stdout)
    return {int(it): (loss, norm) for it, loss, norm in found}


def _same_training(tmp_path, nproc, flags, switch):
    data = text_data(str(tmp_path / "text"))
    base = pretrain_cli(nproc, cli_flags(data, tmp_path / "cache", "llama", flags), timeout=900)
    again = pretrain_cli(nproc, cli_flags(data, tmp_path / "cache", "llama", flags, switch), timeout=900)
    want, got = _log_pairs(base), _log_pairs(again)
    assert sorted(want) == [1, 2, 3] and got == want, (got, want)
    assert logged_losses(again) == logged_losses(base)


@pytest.mark.slow  # default tier: test_flags_mean_megatrons_granularity (selective recompute: test_model_recompute.py)
def test_pretrain_gpt_recompute_activations_trains_as_without(tmp_path):
    _same_training(tmp_path, 2, {"tensor-model-parallel-size": 2, "train-iters": 3, "hidden-dropout": 0.1,
                                 "attention-dropout": 0.1, "attention-backend": "unfused"},
                   {"recompute-activations": True})


@pytest.mark.slow  # default tier: test_moe_layer_recompute_is_bit_identical_and_runs_again
def test_pretrain_gpt_moe_layer_recompute_trains_as_without(tmp_path):
    _same_training(tmp_path, 2, {"expert-model-parallel-size": 2, "num-experts": 4, "moe-router-topk": 2,
                                 "moe-aux-loss-coeff": 0.01, "train-iters": 3},
                   {"moe-layer-recompute": True})
