"""Megatron-LM's pretraining flags (its arguments.py at d98e8a64dd) that this build does not have are refused each in
one sentence with its reason, all together, from the command line pretrain_gpt.py parses; the ones taken as
documented no-ops parse and change nothing else, and one that would be ignored is refused.
(tests/test_launch_script_flags.py holds docs/coming_from_megatron.md's refusal table equal to the code's.)"""
import os

import pytest

from megatron_zero.arguments import ArgumentError, parse_args, parse_command_line, validate_args
from megatron_zero.config.compat_noops import SWITCHES
from megatron_zero.testing.flag_checks import BASE
from megatron_zero.arguments.megatron_unsupported import UNSUPPORTED

NOOPS = ["--attention-softmax-in-fp32", "--accumulate-allreduce-grads-in-fp32", "--no-bias-dropout-fusion",
         "--disable-jit-fuser", "--auto-detect-ckpt-format", "--use-pytorch-profiler", "--dataloader-type", "single"]


def test_every_unsupported_flag_is_refused_with_its_reason(capsys):
    argv = list(BASE)
    for flag in UNSUPPORTED:
        argv += [flag, "1"]  # a value for those that take one (a switch's is not read: the flag is dropped whole)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == len(UNSUPPORTED), lines
    for line, (flag, reason) in zip(lines, UNSUPPORTED.items()):
        assert line == f"pretrain_gpt.py: error: {flag} 1 is refused: {reason}.", line


def test_the_no_ops_parse_and_change_nothing_else():
    plain = vars(validate_args(parse_command_line(BASE), 1))
    given = vars(validate_args(parse_command_line(BASE + NOOPS), 1))
    own = {"attention_softmax_in_fp32", "accumulate_allreduce_grads_in_fp32", "bias_dropout_fusion",
           "disable_jit_fuser", "auto_detect_ckpt_format", "use_pytorch_profiler"}
    assert {k for k in plain if plain[k] != given[k]} == own


@pytest.mark.parametrize("extra,words", [
    (["--dataloader-type", "cyclic"], "--dataloader-type cyclic is refused: the sampler here is Megatron-LM's single"),
    (["--accumulate-allreduce-grads-in-fp32", "--grad-reduce-in-bf16", "--bf16"],
     "--accumulate-allreduce-grads-in-fp32 and --grad-reduce-in-bf16 ask for opposite gradient reductions"),
])
def test_a_no_op_that_would_be_ignored_is_refused(extra, words):
    with pytest.raises(ArgumentError, match=words):
        validate_args(parse_command_line(BASE + extra), 1)


def test_the_no_ops_are_in_the_documented_table():
    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "coming_from_megatron.md")).read()
    table = doc.split("Documented no-ops", 1)[1].split("\n## ", 1)[0]
    for flag in [*SWITCHES, "--no-bias-dropout-fusion", "--dataloader-type single"]:
        assert f"| `{flag}` |" in table, flag
