"""--grad-reduce-in-bf16 (Megatron's flag): what it sets, the stage it is refused with, and a bf16 run of
pretrain_gpt.py at PP2 x DP2 (tied embedding summed over the stages, ZeRO-1 buckets reduced in bf16, sums
kept in fp32) whose loss falls. The bytes it saves: tests/test_zero_comm_bytes.py."""
import pytest

from megatron_zero.arguments import parse_args
from megatron_zero.testing.flag_checks import BASE, refused, with_flags
from megatron_zero.testing.launch import losses_from_log, model_flags, torchrun


def test_flag_reaches_the_args():
    assert parse_args(BASE + ["--grad-reduce-in-bf16"], world_size=2).grad_reduce_in_bf16 is True
    assert parse_args(BASE, world_size=2).grad_reduce_in_bf16 is False


def test_refused_at_zero3(capsys):
    err = refused(with_flags(BASE, grad_reduce_in_bf16=True, zero_stage=3), 2, capsys)
    assert "--grad-reduce-in-bf16" in err and "--zero-stage" in err


@pytest.mark.slow
def test_bf16_reduction_trains_at_pp2_dp2(builtin_corpus, tmp_path):
    data, tok = builtin_corpus
    run = torchrun(4, model_flags(data, tok, **{"pipeline-model-parallel-size": 2, "bf16": True,
                                                "grad-reduce-in-bf16": True, "data-cache-path": tmp_path / "cache"}))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    losses = losses_from_log(run.stdout)
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.3, losses
