"""Interleaved 1F1B (--num-layers-per-virtual-pipeline-stage) against the single process, fp32.

The schedule on a toy pipeline (one Linear per virtual stage): every micro-batch runs forward then
backward on every chunk exactly once, in Megatron's order, and the loss and every gradient equal the
sequential model's (relative 1e-6). Then the GPT: PP2 x v2 (also with DP2 and overlapped gradient
reduction, and with TP2, sequence parallelism and full recomputation) trained with the ZeRO optimizer
for several AdamW steps, against torch's AdamW on the reference model: loss and gradient norm every
step to model_rtol of one step's path (~1.9e-5; the norm's sum of squares adds its own) and the final
weights within the reference's AdamWeightBound (megatron_zero/testing/tolerances.py: Adam turns a
roundoff-size difference of a near-zero gradient, such as the QKV key bias's, into up to 2 * lr per
step, elsewhere a small fraction of lr).
"""
import pytest
import torch
import torch.distributed as dist

from megatron_zero.model.gpt import reference_model
from megatron_zero.model.sharding import gather_state_dicts
from megatron_zero.pipeline.gpt_stage import activation_shape, build_gpt_stage, stage_p2p
from megatron_zero.pipeline.interleaved_schedule import (chunk_of, forward_backward_interleaved, micro_batch_of,
                                                         warmup_forwards)
from megatron_zero.pipeline.partition import virtual_stage_layer_ranges
from megatron_zero.pipeline.schedule import ScheduleStats, broadcast_loss
from megatron_zero.testing import run_ranks
from megatron_zero.testing.toy_pipeline import H, MB, toy_batches, toy_layers, toy_reference
from megatron_zero.testing.train_step import pipeline_train_step
from megatron_zero.testing.tiny_gpt import tiny_gpt_config
from megatron_zero.testing.tolerances import (AdamWeightBound, assert_losses_close, assert_within, global_norm_rtol,
                                              gpt_path_length, model_rtol)
from megatron_zero.distributed.topology import build_parallel_state
from megatron_zero.zero import ZeroOptimizer

# ---- the order ----------------------------------------------------------------------------------
@pytest.mark.parametrize("pp,v,m", [(2, 2, 4), (4, 2, 8), (3, 3, 6)])
def test_order_visits_each_chunk_once_per_micro_batch(pp, v, m):
    total = m * v
    forwards = [(micro_batch_of(k, pp, v), chunk_of(k, pp, v)) for k in range(total)]
    backwards = [(micro_batch_of(k, pp, v), chunk_of(k, pp, v, forward=False)) for k in range(total)]
    every = {(i, c) for i in range(m) for c in range(v)}
    assert set(forwards) == every and set(backwards) == every and len(forwards) == total
    for c in range(v):  # each chunk takes the micro-batches in order, forward and backward alike
        assert [i for i, cc in forwards if cc == c] == list(range(m))
        assert [i for i, cc in backwards if cc == c] == list(range(m))
    for i in range(m):  # a micro-batch's chunks forward in order and backward in reverse
        assert [c for ii, c in forwards if ii == i] == list(range(v))
        assert [c for ii, c in backwards if ii == i] == list(range(v))[::-1]
    assert [warmup_forwards(pp, v, r, m) for r in range(pp)] == [(pp - r - 1) * 2 + (v - 1) * pp for r in range(pp)]
    assert warmup_forwards(pp, v, 0, pp) == pp * v  # M = pp: every forward first


def test_layers_of_virtual_stages():
    # 8 layers, PP2, 2 per virtual stage: rank 0 holds blocks 0-1 and 4-5, rank 1 blocks 2-3 and 6-7
    assert virtual_stage_layer_ranges(8, 2, 2) == [[(0, 4), (6, 8)], [(4, 6), (8, 12)]]


# ---- the toy pipeline ---------------------------------------------------------------------------
def toy_interleaved(v, m, forward_only):
    state = build_parallel_state(tp=1, pp=dist.get_world_size())
    r, pp = state.pp_rank, state.pp_size
    layers = toy_layers(pp * v)
    mine = [layers[c * pp + r] for c in range(v)]  # chunk c: virtual stage c * pp + r
    batches, events = toy_batches(m), []

    def forward_step(i, x, chunk):
        events.append(("F", i, chunk))
        y = torch.tanh(mine[chunk](batches[i][0] if r == 0 and chunk == 0 else x))
        if state.is_last_stage and chunk == v - 1:
            y = torch.nn.functional.mse_loss(y, batches[i][1]) / m
        if y.requires_grad:
            y.register_hook(lambda g, i=i, chunk=chunk: events.append(("B", i, chunk)))
        return y

    stats = ScheduleStats()
    p2p = stage_p2p(state, (MB, H), torch.float32, virtual_stages=v)
    with torch.set_grad_enabled(not forward_only):
        losses = forward_backward_interleaved(forward_step, m, p2p, r, pp, v, forward_only=forward_only,
                                              stats=stats)
    loss = broadcast_loss(losses, state.is_last_stage, state.layout.pp_group(state.rank)[-1], state.pp_group)
    grads = [None if forward_only else layer.weight.grad for layer in mine]
    return loss, grads, events, stats.max_in_flight


@pytest.mark.parametrize("pp,v,m,forward_only", [
    (2, 2, 4, False), (2, 2, 6, False),
    (2, 3, 2, False),   # M = PP: all forwards first
    (4, 2, 8, False),
    (2, 2, 4, True),    # evaluation
])
def test_interleaved_matches_single_process(pp, v, m, forward_only):
    ref_loss, ref_grads = toy_reference(pp * v, m)
    results = run_ranks(toy_interleaved, pp, v, m, forward_only, timeout=120)
    every = {(i, c) for i in range(m) for c in range(v)}
    for r, (loss, grads, events, in_flight) in enumerate(results):
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        fwd = [(i, c) for kind, i, c in events if kind == "F"]
        assert fwd == [(micro_batch_of(k, pp, v), chunk_of(k, pp, v)) for k in range(m * v)]  # Megatron's order
        if forward_only:
            assert set(events) == {("F", i, c) for i, c in every}
            continue
        bwd = [(i, c) for kind, i, c in events if kind == "B"]
        assert sorted(bwd) == sorted(every)  # once each
        assert all(events.index(("F", i, c)) < events.index(("B", i, c)) for i, c in every)
        assert in_flight == min(warmup_forwards(pp, v, r, m) + 1, m * v)  # the activations held at most
        for c, grad in enumerate(grads):
            torch.testing.assert_close(grad, ref_grads[c * pp + r], rtol=1e-6, atol=1e-7)


# ---- the GPT with the ZeRO optimizer ------------------------------------------------------------
STEPS, GPT_MB, M = 4, 2, 4
HP = dict(lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
CLIP = 1.0


def batch(step, dp):
    g = torch.Generator().manual_seed(700 + step)
    tokens = torch.randint(0, 100, (M * GPT_MB * dp, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:].contiguous()


def gpt_rtol(dp):
    return model_rtol(gpt_path_length(tiny_gpt_config(), M * GPT_MB * dp * 8))


def gpt_reference(dp):
    model = reference_model(tiny_gpt_config())
    opt = torch.optim.AdamW(model.parameters(), **HP)
    bound = AdamWeightBound(gpt_rtol(dp), HP["lr"], HP["betas"], HP["eps"])
    losses, norms = [], []
    for step in range(STEPS):
        tokens, labels = batch(step, dp)
        opt.zero_grad()
        loss = model(tokens, labels=labels)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        bound.step({n: p.grad for n, p in model.named_parameters()}, dict(model.named_parameters()))
        losses.append(loss.item())
    params = sum(p.numel() for p in model.parameters())
    weights = gather_state_dicts([{n: p.detach() for n, p in model.named_parameters()}], tiny_gpt_config())
    return losses, norms, weights, gather_state_dicts([bound.bounds()], tiny_gpt_config()), params


def gpt_interleaved(tp, pp, stage, overrides, overlap, v=2):
    state = build_parallel_state(tp=tp, pp=pp)
    cfg = tiny_gpt_config(**overrides)
    model = build_gpt_stage(cfg, state, virtual_stages=v)
    assert len(model.chunks) == v
    opt = ZeroOptimizer(list(model.named_parameters()), dp_group=state.dp_group, stage=stage, clip_grad=CLIP,
                        mp_group=state.mp_group, tp_rank=state.tp_rank, bucket_size=2000, module=model,
                        overlap_grad_reduce=overlap, **HP)
    p2p = stage_p2p(state, activation_shape(GPT_MB, cfg, tp), torch.float32, virtual_stages=v)
    r, dp, losses, norms = state.dp_rank, state.dp_size, [], []
    armed, arm = [], opt.impl.arm if overlap else None
    if overlap:  # record which parameters each chunk's last backward arms
        opt.impl.arm = lambda params=None: (armed.append(None if params is None else len(params)), arm(params))
    for step in range(STEPS):
        tokens, labels = batch(step, dp)
        micro = [{"tokens": tokens[j * GPT_MB * dp + r * GPT_MB:][:GPT_MB],
                  "labels": labels[j * GPT_MB * dp + r * GPT_MB:][:GPT_MB]} for j in range(M)]
        loss, norm = pipeline_train_step(model, opt, state, p2p, micro)
        losses.append(loss)
        norms.append(float(norm))
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return state.layout.coords(state.rank), losses, norms, weights, armed


def gathered(results):
    """The full-form weights of DP rank 0's stages."""
    cfg, full = tiny_gpt_config(), {}
    for pp in range(2):
        shards = [res[3] for res in sorted(results, key=lambda res: res[0][2]) if res[0][:2] == (pp, 0)]
        full.update(gather_state_dicts(shards, cfg))
    return full


@pytest.mark.parametrize("tp,dp,stage,overrides,overlap", [
    (1, 1, 1, {}, False),
    (1, 2, 1, {}, True),     # DP2, --overlap-grad-reduce armed before the last backward
    (2, 1, 2, {"sequence_parallel": True, "recompute_granularity": "full", "recompute_method": "uniform"}, False),
], ids=["pp2-v2", "pp2-dp2-v2-overlap", "tp2-pp2-v2-sp-recompute-zero2"])
def test_gpt_interleaved_matches_reference(tp, dp, stage, overrides, overlap):
    ref_losses, ref_norms, ref_weights, bounds, params = gpt_reference(dp)
    results = run_ranks(gpt_interleaved, tp * 2 * dp, tp, 2, stage, overrides, overlap, timeout=300)
    for _, losses, norms, _, armed in results:
        assert_losses_close(losses, ref_losses, gpt_rtol(dp), "loss")
        assert_losses_close(norms, ref_norms, global_norm_rtol(gpt_rtol(dp), params), "gradient norm")
        if overlap:  # each step armed each of the 2 chunks' own parameters, once
            assert len(armed) == 2 * STEPS and all(n for n in armed), armed
    weights = gathered(results)
    assert set(weights) == set(ref_weights)
    for name, w in weights.items():
        assert_within(w, ref_weights[name], bounds[name], name)
    first = [res[3] for res in results if res[0] == (0, 0, 0)][0]
    last = [res[3] for res in results if res[0] == (1, 0, 0)][0]
    for name in first:  # the tied embedding's two copies stayed identical
        if name.startswith("tied_modules."):
            assert torch.equal(first[name], last[name]), name


# ---- flags ----------------------------------------------------------------------------------------
GOOD = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--train-iters", "10",
        "--pipeline-model-parallel-size", "2"]


def validated(argv, world):
    from megatron_zero.arguments import ArgumentError, build_parser, validate_args
    try:
        return validate_args(build_parser().parse_args(argv), world)
    except ArgumentError as err:
        return str(err)


def test_flag_gives_chunks_per_rank():
    assert validated(GOOD + ["--num-layers-per-virtual-pipeline-stage", "2"], 2).virtual_pipeline_model_parallel_size == 2
    assert validated(GOOD + ["--num-layers-per-virtual-pipeline-stage", "4"], 2).virtual_pipeline_model_parallel_size == 1
    assert validated(GOOD, 2).virtual_pipeline_model_parallel_size == 1


@pytest.mark.parametrize("extra,world,words", [
    (["--pipeline-model-parallel-size", "1"], 1, ["--pipeline-model-parallel-size of at least 2, not 1"]),
    (["--num-layers-per-virtual-pipeline-stage", "3"], 2, ["--num-layers 8", "x --num-layers-per-virtual"]),
    (["--global-batch-size", "6"], 2, ["3 micro-batches", "not divisible by --pipeline-model-parallel-size 2"]),
    (["--pipeline-partition", "3,5"], 2, ["--pipeline-partition"]),
])
def test_bad_combinations_are_one_sentence(extra, world, words):
    argv = GOOD + ["--num-layers-per-virtual-pipeline-stage", "2"] + extra
    err = validated(argv, world)
    assert isinstance(err, str) and "\n" not in err, err
    for word in words:
        assert word in err, err


# ---- pretrain_gpt.py: save interleaved, resume elsewhere and back ----------------------------------
# the default run: interleaved -> plain PP4 (reshaped) and interleaved -> interleaved (same layout); the slow one
# adds plain PP4 -> interleaved (reshaped) and interleaved -> universal -> plain PP2, whose loads
# tests/test_universal_checkpoint.py (test_direct_reshaped_resume, test_universal_resume) cover for plain PP
@pytest.mark.parametrize("every_resume", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["default", "all"])
def test_pretrain_saves_and_resumes_across_layouts(builtin_corpus, tmp_path, every_resume):
    """Interleaved PP2 x v2 (with --overlap-grad-reduce) trains 8 iterations, saving at 3, 6 and 8. From its checkpoints: plain PP4
    (reshaped), then interleaved PP2 from PP4's (reshaped), the same layout, and plain PP2 from
    tools/ds_to_universal.py's conversion each continue its losses to relative 1e-5."""
    import os
    import subprocess
    import sys

    from megatron_zero.testing.launch import ROOT, losses_from_log, model_flags, torchrun

    data, tok = builtin_corpus

    def run(nproc, start, pp, interleaved, **extra):
        flags = {"num-layers": 4, "train-iters": 8, "pipeline-model-parallel-size": pp,
                 "num-layers-per-virtual-pipeline-stage": 1 if interleaved else None,
                 "data-cache-path": tmp_path / "cache", **extra}
        out = torchrun(nproc, model_flags(data, tok, **flags), timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        losses = losses_from_log(out.stdout)
        assert len(losses) == 8 - start, out.stdout[-2000:]
        return losses

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    whole = run(2, 0, 2, True, save=a, **{"save-interval": 3, "overlap-grad-reduce": True})

    def continues(losses, start):
        assert losses == pytest.approx(whole[start:], rel=1e-5)

    continues(run(4, 3, 4, False, load=os.path.join(a, "global_step3"), save=b, **{"save-interval": 4}), 3)
    continues(run(2, 6, 2, True, load=os.path.join(a, "global_step6")), 6)
    if not every_resume:
        return
    continues(run(2, 4, 2, True, load=os.path.join(b, "global_step4")), 4)
    universal = os.path.join(a, "global_step6_universal")
    conv = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "ds_to_universal.py"), "--input_folder",
                           os.path.join(a, "global_step6"), "--output_folder", universal],
                          capture_output=True, text=True, timeout=120)
    assert conv.returncode == 0, conv.stderr
    continues(run(2, 6, 2, False, load=universal, **{"universal-checkpoint": True}), 6)
