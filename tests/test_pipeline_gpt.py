"""GPT over pipeline stages (with TP and DP) against the single-process reference, fp32, dropout 0.

Each case runs several SGD steps of one global batch split into micro-batches
(gradient accumulation inside the 1F1B schedule); the loss of every step to model_rtol of one
step's path (megatron_zero/testing/tolerances.py, ~1.9e-5 for 64 tokens), and each element of every
gathered gradient within that times (|its value| + its tensor's largest), the size of the terms its
roundoff comes from (SGD passes a gradient difference on as lr times it: no amplification).
"""
import pytest
import torch
import torch.distributed as dist

from megatron_zero.model.gpt import reference_model
from megatron_zero.model.sharding import gather_state_dicts
from megatron_zero.pipeline.gpt_stage import (activation_shape, build_gpt_stage, make_forward_step,
                                              sync_tied_embedding_grads)
from megatron_zero.pipeline.p2p import P2P
from megatron_zero.pipeline.schedule import broadcast_loss, forward_backward
from megatron_zero.testing import run_ranks
from megatron_zero.testing.tiny_gpt import tiny_gpt_config
from megatron_zero.testing.tolerances import assert_close_scaled, assert_losses_close, gpt_path_length, model_rtol
from megatron_zero.distributed.topology import build_parallel_state

STEPS, LR, MB = 3, 0.5, 2


def config(**overrides):
    return tiny_gpt_config(**overrides)


def global_batch(step, size):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 100, (size, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:].contiguous()


def reference_run(m, dp):
    model = reference_model(config())
    losses = []
    for step in range(STEPS):
        tokens, labels = global_batch(step, m * MB * dp)
        model.zero_grad()
        loss = model(tokens, labels=labels)
        loss.backward()
        losses.append(loss.item())
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return losses, gather_state_dicts([grads], config())


def pipelined_run(tp, pp, m, explicit, overrides=None):
    state = build_parallel_state(tp=tp, pp=pp)
    cfg = config(**(overrides or {}))
    model = build_gpt_stage(cfg, state, explicit_partition=explicit)
    p2p = P2P(state.prev_rank, state.next_rank, activation_shape(MB, cfg, tp), torch.float32)
    dp, r = state.dp_size, state.dp_rank
    losses = []
    for step in range(STEPS):
        tokens, labels = global_batch(step, m * MB * dp)
        micro = []
        for j in range(m):  # Megatron's order: micro-step j, then this DP rank's slice of it
            lo = j * MB * dp + r * MB
            micro.append({"tokens": tokens[lo:lo + MB], "labels": labels[lo:lo + MB]})
        model.zero_grad()
        out = forward_backward(make_forward_step(model, micro, state), m, p2p, state.pp_rank, pp)
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=state.dp_group)
                p.grad /= dp
        sync_tied_embedding_grads(model, state)
        last = state.layout.pp_group(state.rank)[-1]
        losses.append(broadcast_loss(out, state.is_last_stage, last, state.pp_group, state.dp_group))
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return state.layout.coords(state.rank), losses, grads, weights


@pytest.mark.parametrize("tp,pp,dp,m,explicit,sequence_parallel", [
    (1, 2, 1, 4, None, False), (1, 4, 1, 4, None, False), (2, 2, 1, 3, None, False), (2, 2, 2, 2, None, False),
    (1, 3, 1, 3, None, False),          # 4 layers over 3 stages: uneven
    (1, 2, 1, 2, [1, 3], False),        # an explicit partition
    (2, 1, 1, 2, None, True), (2, 2, 1, 3, None, True),  # sequence parallelism (stages pass [b, s/tp, h])
])
def test_pipeline_matches_reference(tp, pp, dp, m, explicit, sequence_parallel):
    ref_losses, ref_grads = reference_run(m, dp)
    results = run_ranks(pipelined_run, tp * pp * dp, tp, pp, m, explicit, {"sequence_parallel": sequence_parallel},
                        timeout=240)
    rtol = model_rtol(gpt_path_length(config(), m * MB * dp * 8))
    for _, losses, _, _ in results:
        assert_losses_close(losses, ref_losses, rtol, "loss")
    seen = set()
    for stage in range(pp):
        for d in range(dp):
            shards = [res[2] for res in results if res[0][0] == stage and res[0][1] == d]
            full = gather_state_dicts(shards, config())
            for name, grad in full.items():
                assert_close_scaled(grad, ref_grads[name], rtol, name)
                seen.add(name)
    assert seen == set(ref_grads)
    # The tied embedding copies on the first and last stage stay bit-identical.
    if pp > 1:
        for res_first in results:
            if res_first[0][0] != 0:
                continue
            twin = [r for r in results if r[0] == (pp - 1, res_first[0][1], res_first[0][2])][0]
            for name, w in res_first[3].items():
                if name.startswith("tied_modules."):
                    assert torch.equal(w, twin[3][name]), name
