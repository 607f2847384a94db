"""--overlap-grad-reduce and --overlap-param-gather (zero/stage12_overlap.py) train bit-identically to
the blocking ZeRO 0/1/2 (whose parity with the single-process reference the other test_zero_* files
hold): same losses and same final weights, torch.equal, at DP2, TP2 x DP2 and PP2 x DP2, with
gradient accumulation (2 micro-batches), clipping, and buckets small enough that several are in
flight. At DP 2 each gradient element is one sum of two numbers, so the order of the collectives
cannot change it: equality is exact."""
import glob

import pytest
import torch

from megatron_zero.pipeline.gpt_stage import (activation_shape, build_gpt_stage, make_forward_step,
                                              sync_tied_embedding_grads)
from megatron_zero.pipeline.p2p import P2P
from megatron_zero.pipeline.schedule import broadcast_loss, forward_backward
from megatron_zero.testing import run_ranks
from megatron_zero.testing.tiny_gpt import tiny_gpt_config
from megatron_zero.distributed.topology import build_parallel_state
from megatron_zero.zero import ZeroOptimizer

STEPS, MB, M, DP = 4, 2, 2, 2
HP = dict(lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, clip_grad=0.3)


def batch(step):
    g = torch.Generator().manual_seed(700 + step)
    tokens = torch.randint(0, 100, (M * MB * DP, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:].contiguous()


def train(state, stage, overlap):
    cfg = tiny_gpt_config()
    model = build_gpt_stage(cfg, state)
    opt = ZeroOptimizer(list(model.named_parameters()), dp_group=state.dp_group, stage=stage,
                        mp_group=state.mp_group, tp_rank=state.tp_rank, bucket_size=3000, module=model,
                        overlap_grad_reduce=overlap, overlap_param_gather=overlap and stage > 0, **HP)
    p2p = P2P(state.prev_rank, state.next_rank, activation_shape(MB, cfg), torch.float32)
    r, losses, launched = state.dp_rank, [], 0
    for step in range(STEPS):
        tokens, labels = batch(step)
        micro = [{"tokens": tokens[j * MB * DP + r * MB:][:MB], "labels": labels[j * MB * DP + r * MB:][:MB]}
                 for j in range(M)]
        out = forward_backward(make_forward_step(model, micro, state), M, p2p, state.pp_rank, state.pp_size,
                               backward_loss=opt.backward, before_last_backward=opt.arm_grad_reduce)
        launched += len(getattr(opt.impl, "_in_flight", ()))  # buckets still under way after backward
        sync_tied_embedding_grads(model, state)
        updated, _ = opt.step()
        assert updated
        losses.append(broadcast_loss(out, state.is_last_stage, state.layout.pp_group(state.rank)[-1],
                                     state.pp_group, state.dp_group))
    opt.wait_params()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, launched


def compare(tp, pp, stages):
    state = build_parallel_state(tp=tp, pp=pp)
    out = []
    for stage in stages:
        base_losses, base_weights, _ = train(state, stage, False)
        losses, weights, launched = train(state, stage, True)
        differing = [n for n in base_weights if not torch.equal(base_weights[n], weights[n])]
        out.append((base_losses, losses, differing, launched))
    return out


@pytest.mark.parametrize("tp,pp,stages", [(1, 1, (0, 1, 2)), (2, 1, (1, 2)), (1, 2, (1, 2))])
def test_overlap_is_bit_identical(tp, pp, stages):
    results = run_ranks(compare, tp * pp * DP, tp, pp, stages, timeout=300)
    for i, stage in enumerate(stages):
        for rank_results in results:
            base_losses, losses, differing, _ = rank_results[i]
            assert losses == base_losses, stage
            assert differing == [], stage
        assert sum(r[i][3] for r in results) > 0, stage  # communication still under way after backward


def _wait_counts(stage):
    """Per forward: how many gathers each unit waited for, and how many were left after the first unit."""
    state = build_parallel_state(tp=1, pp=1)
    cfg = tiny_gpt_config()
    model = build_gpt_stage(cfg, state)
    opt = ZeroOptimizer(list(model.named_parameters()), dp_group=state.dp_group, stage=stage, bucket_size=2000,
                        module=model, overlap_param_gather=True, **HP)
    tokens, labels = batch(0)
    opt.backward(model(tokens[:MB], labels=labels[:MB]))
    opt.step()
    total = len(opt.impl._gathers)
    model.tied_modules["embed"](tokens[:MB])  # the first unit waits only for its own chunks
    return total, len(opt.impl._gathers)


def test_param_gather_waits_for_first_units_chunks_only():
    for total, left in run_ranks(_wait_counts, DP, 1):
        assert total > 2 and 0 < left < total


def test_pretrain_with_overlap_flags_logs_the_same_losses(builtin_corpus, tmp_path):
    """The flags reach the optimizer through pretrain_gpt.py (PP2 x DP2, ZeRO-2, tied embedding), and a
    checkpoint saved while the updated weights are being gathered holds them: its layer files equal the
    blocking run's."""
    from megatron_zero.testing.launch import losses_from_log, model_flags, torchrun

    data, tok = builtin_corpus
    runs = {}
    for name, extra in (("blocking", {}), ("overlap", {"overlap-grad-reduce": True, "overlap-param-gather": True})):
        argv = model_flags(data, tok, **{"pipeline-model-parallel-size": 2, "zero-stage": 2, "train-iters": 3,
                                         "eval-iters": 0, "data-cache-path": tmp_path / "cache",
                                         "save": tmp_path / name, "save-interval": 2, **extra})
        run = torchrun(4, argv)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        runs[name] = losses_from_log(run.stdout)
    assert len(runs["blocking"]) == 3 and runs["overlap"] == runs["blocking"]
    layer_files = sorted(glob.glob(str(tmp_path / "blocking" / "global_step2" / "layer_*-model_states.pt")))
    assert layer_files
    for path in layer_files:
        blocking = torch.load(path, weights_only=True)
        overlap = torch.load(path.replace("blocking", "overlap"), weights_only=True)
        assert blocking.keys() == overlap.keys()
        assert all(torch.equal(blocking[k], overlap[k]) for k in blocking), path
