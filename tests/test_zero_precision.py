"""Mixed precision: bf16 tracks fp32; fp16 with a forced overflow skips that step on every rank,
lowers the scale, and continues; the dynamic loss scaler follows DeepSpeed's rule."""
import math

import torch.distributed as dist

from megatron_zero.testing import run_ranks
from megatron_zero.zero import LossScaler, ZeroOptimizer
from megatron_zero.testing.toy_zero import GLOBAL_BATCH, HP, ZERO3_PERSIST, ToyGPT, batch, reference, zero_run

BF16_TOLERANCE = 0.03  # relative, per step: bf16 weights/activations against the fp32 reference


def bf16_stages():
    return {stage: zero_run(stage, dtype="bf16")["losses"] for stage in (1, 2, 3)}


def test_bf16_tracks_fp32():
    ref, _ = reference()
    for stage, losses in run_ranks(bf16_stages, 2, timeout=120)[0].items():
        for got, want in zip(losses, ref):
            assert abs(got - want) <= BF16_TOLERANCE * want, (stage, got, want)
        assert losses[-1] < losses[0] - 0.1


def fp16_forced_overflow(stage, bad_step):
    dp, rank = dist.get_world_size(), dist.get_rank()
    model = ToyGPT()
    opt = ZeroOptimizer(list(model.named_parameters()), dp_group=dist.group.WORLD, stage=stage, dtype="fp16",
                        module=model, loss_scaler={"initial_scale_power": 8, "hysteresis": 1}, **ZERO3_PERSIST,
                        **HP)
    per = GLOBAL_BATCH // dp
    record = []
    for s in range(8):
        tokens, labels = batch(s)
        loss = model(tokens[rank * per:(rank + 1) * per], labels[rank * per:(rank + 1) * per])
        if s == bad_step and rank == dp - 1:
            loss = loss * 1e30  # only the last rank overflows
        before = opt.state_dict()["optimizer_state_dict" if stage == 3 else "base_optimizer_state"]
        step_before = float(before["state"][0]["step"])
        scale = opt.loss_scale
        opt.backward(loss)
        updated, norm = opt.step()
        record.append((updated, scale, step_before, math.isfinite(norm), loss.item()))
    return record


def test_fp16_overflow_skips_on_every_rank():
    for stage in (2, 3):
        records = run_ranks(fp16_forced_overflow, 2, stage, 3, timeout=120)
        for rec in records:
            assert [u for u, *_ in rec] == [True, True, True, False, True, True, True, True], stage
            assert rec[3][1] == 256.0 and rec[4][1] == 128.0  # the scale halves after the overflow
            assert rec[4][2] == 3.0  # the skipped step did not advance Adam
            assert all(math.isfinite(r[4]) for i, r in enumerate(rec) if i != 3) and rec[-1][3]


def test_dynamic_loss_scaler_rule():
    s = LossScaler({"initial_scale_power": 4, "scale_window": 3, "hysteresis": 2})
    s.update(True)
    assert s.loss_scale == 16.0  # hysteresis absorbs the first overflow
    s.update(True)
    assert s.loss_scale == 8.0
    for _ in range(3):
        s.update(False)
    assert s.loss_scale == 16.0  # a window of good steps raises it
    restored = LossScaler({"initial_scale_power": 4})
    restored.load_state_dict(s.state_dict())
    assert (restored.loss_scale, restored.cur_iter) == (16.0, 5)
    assert LossScaler(None, enabled=False).loss_scale == 1.0
