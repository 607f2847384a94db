"""--use-distributed-optimizer, --overlap-grad-reduce and --overlap-param-gather: what they set,
and the ZeRO stages they are refused with (one sentence naming the flags)."""
import json

import pytest

from megatron_zero.arguments import parse_args
from megatron_zero.testing.flag_checks import BASE, refused, with_flags


def test_overlap_flags_reach_the_args():
    args = parse_args(BASE + ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
                      world_size=2)
    assert (args.zero_stage, args.overlap_grad_reduce, args.overlap_param_gather) == (1, True, True)
    assert parse_args(BASE, world_size=2).overlap_param_gather is False
    assert parse_args(with_flags(BASE, zero_stage=3), world_size=2).overlap_param_gather is True  # prefetch


@pytest.mark.parametrize("changes,words", [
    (dict(use_distributed_optimizer=True, zero_stage=0), ["--use-distributed-optimizer", "--zero-stage 0"]),
    (dict(overlap_grad_reduce=True, zero_stage=3), ["--overlap-grad-reduce", "--zero-stage"]),
    (dict(overlap_param_gather=True, zero_stage=0), ["--overlap-param-gather", "--zero-stage 0"]),
])
def test_overlap_flags_refused_with_the_wrong_stage(changes, words, capsys):
    err = refused(with_flags(BASE, **changes), 2, capsys)
    for word in words:
        assert word in err, (word, err)


def test_zeropp_keys_from_the_deepspeed_config(tmp_path, capsys):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                                                     "zero_quantized_gradients": True, "zero_hpz_partition_size": 2}}))
    args = parse_args(with_flags(BASE, deepspeed_config=cfg), world_size=4)
    assert (args.zero_quantized_weights, args.zero_quantized_gradients, args.zero_hpz_partition_size) == (True, True, 2)
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 2, "zero_quantized_weights": True}}))
    err = refused(with_flags(BASE, deepspeed_config=cfg), 2, capsys)
    assert "--zero-quantized-weights" in err and "--zero-stage 3" in err
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}}))
    assert "must divide the data-parallel size 4" in refused(with_flags(BASE, deepspeed_config=cfg), 4, capsys)
