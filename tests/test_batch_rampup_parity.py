"""A global batch that grows (--rampup-batch-size, --step-batch-size-schedule) at DP2 (ZeRO-1, ZeRO-2) and PP2
against the single-process reference with torch.optim.AdamW, fp32.

Each step k takes global batch [C_k, C_k + G_k) of a fixed sample table, G_k from the schedule
(megatron_zero/config/batch_schedule.py) at C_k consumed samples; every rank reads its part through the
sampler with that schedule (megatron_zero/data/sampler.py) and the pipeline schedule and ZeRO run that
step's micro-batch count (1 to 8 here; the interleaved schedule, 2 model chunks per rank, 2 to 4). The
reference takes the whole global batch in one forward.
Per step the loss and the global gradient norm match within megatron_zero/testing/tolerances.py's
bounds derived from the computation (the largest global batch's path), with clipping active."""
import pytest
import torch

from megatron_zero.config.batch_schedule import BatchSchedule, parse_step_schedule
from megatron_zero.data import GlobalBatchSampler
from megatron_zero.model import reference_model
from megatron_zero.pipeline.gpt_stage import activation_shape, build_gpt_stage, stage_p2p
from megatron_zero.testing import run_ranks
from megatron_zero.testing.tiny_gpt import tiny_gpt_config
from megatron_zero.testing.tolerances import assert_losses_close, global_norm_rtol, gpt_path_length, model_rtol
from megatron_zero.testing.train_step import pipeline_train_step
from megatron_zero.distributed.topology import build_parallel_state
from megatron_zero.zero import ZeroOptimizer

STEPS, SEQ, FINAL, WORLD = 6, 8, 8, 2
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
CLIP = 0.5
RAMP = (2, 2, 12)  # --rampup-batch-size 2 2 12 --global-batch-size 8: 2, 2, 4, 6, 8, 8
STEP_SCHEDULE = "0:2 64:4 128:8"  # tokens at --seq-length 8: from sample 8 on 4, from 16 on 8: 2, 2, 2, 2, 4, 4
# (pp, zero stage, schedule, model chunks per pipeline rank); DP = 2 / pp
LAYOUTS = [(1, 1, "ramp", 1), (1, 2, "step", 1), (2, 1, "ramp", 1), (2, 0, "step", 1), (2, 1, "step", 2)]


def schedule(kind, dp):
    if kind == "ramp":
        return BatchSchedule(FINAL, 1, dp, rampup=RAMP)
    steps = parse_step_schedule(STEP_SCHEDULE, SEQ)
    return BatchSchedule(steps[-1][1], 1, dp, steps=steps)


def batch_sizes(kind):
    return list(schedule(kind, 1).sizes(0, STEPS))


def config(chunks=1):
    return tiny_gpt_config(num_layers=2 * chunks, seq_length=SEQ, max_position_embeddings=SEQ)


def sample(i):
    return torch.randint(0, 100, (SEQ + 1,), generator=torch.Generator().manual_seed(900 + i))


def rtol(chunks):
    return model_rtol(gpt_path_length(config(chunks), FINAL * SEQ))


def norm_rtol(chunks):
    count = sum(p.numel() for p in reference_model(config(chunks)).parameters())
    return global_norm_rtol(rtol(chunks), count)


def reference_run(kind, chunks):
    net = reference_model(config(chunks))
    opt = torch.optim.AdamW(net.parameters(), **HP)
    losses, norms, start = [], [], 0
    for size in batch_sizes(kind):
        rows = torch.stack([sample(i) for i in range(start, start + size)])
        start += size
        opt.zero_grad()
        loss = net(rows[:, :-1], labels=rows[:, 1:].contiguous())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP).item())
        opt.step()
        losses.append(loss.item())
    return losses, norms


def train_layout(states, pp, stage, kind, chunks):
    if pp not in states:
        states[pp] = build_parallel_state(tp=1, pp=pp)
    state, cfg = states[pp], config(chunks)
    net = build_gpt_stage(cfg, state, virtual_stages=chunks)  # 2: the interleaved schedule
    opt = ZeroOptimizer(list(net.named_parameters()), dp_group=state.dp_group, stage=stage, clip_grad=CLIP,
                        mp_group=state.mp_group, tp_rank=state.tp_rank, bucket_size=3000, module=net,
                        dtype="fp32", loss_scaler={"dynamic": False, "static_scale": 1.0}, **HP)
    p2p = stage_p2p(state, activation_shape(1, cfg), torch.float32, virtual_stages=chunks)
    plan = schedule(kind, state.data_parallel_size)
    sampler = GlobalBatchSampler(10 ** 6, 0, 1, FINAL, state.data_parallel_rank, state.data_parallel_size,
                                 batch_size_at=plan.global_batch_size)
    losses, norms, counts, start = [], [], [], 0
    for _ in range(STEPS):
        micro = []
        for idx in sampler.global_batch(start):
            rows = torch.stack([sample(i) for i in idx])
            micro.append({"tokens": rows[:, :-1], "labels": rows[:, 1:].contiguous()})
        counts.append(len(micro))
        start += plan.global_batch_size(start)
        loss, norm = pipeline_train_step(net, opt, state, p2p, micro)
        losses.append(loss)
        norms.append(norm)
    return losses, norms, counts


def every_layout():
    states = {}
    return {layout: train_layout(states, *layout) for layout in LAYOUTS}


@pytest.fixture(scope="module")
def runs():
    return run_ranks(every_layout, WORLD, timeout=600)


def test_schedules_grow():
    assert batch_sizes("ramp") == [2, 2, 4, 6, 8, 8]
    assert batch_sizes("step") == [2, 2, 2, 2, 4, 4]


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"pp{p}-zero{z}-{k}" + ("-interleaved" if c > 1 else "")
                                                 for p, z, k, c in LAYOUTS])
def test_growing_batch_matches_reference(runs, layout):
    pp, _, kind, chunks = layout
    ref_losses, ref_norms = reference_run(kind, chunks)
    assert max(ref_norms) > CLIP  # clipping was active
    dp = WORLD // pp
    for rank_results in runs:
        losses, norms, counts = rank_results[layout]
        assert counts == [size // dp for size in batch_sizes(kind)]  # this step's micro-batches on every rank
        assert_losses_close(losses, ref_losses, rtol(chunks), "loss")
        assert_losses_close(norms, ref_norms, norm_rtol(chunks), "gradient norm")
