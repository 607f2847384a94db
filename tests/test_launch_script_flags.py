"""Six public Megatron-LM / Megatron-DeepSpeed launch scripts through pretrain_gpt.py's parser and validate_args.

Every flag of each script either parses or is refused in one sentence of its own naming it and why
(never argparse's "unrecognized arguments", never an abbreviation match); the refused flags are
exactly those expected here, every one of them in the table of docs/coming_from_megatron.md, and
that table is megatron_zero/arguments/flag_refusals.py's. With the refused flags removed, each script passes
validate_args at the world size it launches.
"""
import os
import re

import pytest

from megatron_zero.arguments import ArgumentError, parse_args, parse_command_line, validate_args
from megatron_zero.arguments.flag_refusals import REFUSED, refusals
from megatron_zero.testing.launch_scripts import script_argv, scripts

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "coming_from_megatron.md")
EXPECTED_REFUSED = {
    "megatron_lm_gpt3_175b": set(),
    "megatron_lm_llama3_8b_fp8": set(),
    "megatron_lm_mixtral_8x7b": set(),
    "mds_llama2": set(),
    "mds_universal_bf16": set(),
    "mds_moe64": set(),
}

# the refused flags removed, what validate_args still refuses (docs/coming_from_megatron.md says so too)
REFUSED_WHEN_CHECKED = {
}


def _paths(tmp_path):
    names = ("CKPT", "LOAD_CKPT", "TENSORBOARD", "DATA_PATH", "VOCAB_FILE", "MERGE_FILE", "TOKENIZER_MODEL",
             "DATA_CACHE")
    paths = {n: str(tmp_path / n.lower()) for n in names}
    for n in ("CKPT", "LOAD_CKPT"):
        os.makedirs(paths[n], exist_ok=True)
    return paths


def _refused_flags(sentences):
    return {s.split(" ", 1)[0] for s in sentences}


def test_six_scripts_are_recorded():
    assert set(scripts()) == set(EXPECTED_REFUSED)
    total = sum(sum(t.startswith("--") for t in script_argv(n, {})) for n in scripts())
    assert total == 305  # the flags of the six scripts, as counted when they were first tried


@pytest.mark.parametrize("name", sorted(EXPECTED_REFUSED))
def test_script_flags_parse_or_are_refused_with_reason(name, tmp_path):
    argv = script_argv(name, _paths(tmp_path))
    sentences, kept = refusals(argv)
    assert _refused_flags(sentences) == EXPECTED_REFUSED[name]
    for sentence in sentences:  # one sentence each, with the table's reason
        flag = sentence.split(" ", 1)[0]
        assert f"is refused: {REFUSED[flag].reason}." in sentence
    if sentences:
        with pytest.raises(ArgumentError) as err:
            parse_command_line(argv)
        lines = str(err.value).splitlines()
        assert lines == sentences  # all together, nothing else (no generic or unknown-flag line)
    if name in REFUSED_WHEN_CHECKED:  # a combination validate_args refuses, in one sentence
        with pytest.raises(ArgumentError, match=REFUSED_WHEN_CHECKED[name]):
            validate_args(parse_command_line(kept), scripts()[name]["world_size"])
        return
    args = validate_args(parse_command_line(kept), scripts()[name]["world_size"])
    assert args.world_size == scripts()[name]["world_size"]


def _documented_refusals():
    text = open(DOC).read()
    section = text.split("## Refused flags", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(--[^`]+)` \| ([^|]*) \| ([^|]+) \|$", section, flags=re.M)
    return {flag: (cond.strip(), reason.strip()) for flag, cond, reason in rows}


def test_documented_refusals_are_the_table():
    documented = _documented_refusals()
    assert set(documented) == set(REFUSED)
    for flag, (condition, reason) in documented.items():
        assert condition == (REFUSED[flag].condition or "always"), flag
        assert reason == REFUSED[flag].reason, flag


def test_unknown_and_refused_flags_are_reported_together(capsys):
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "1", "--ckpt-format", "zarr",
            "--no-such-flag", "3", "--fp8-recipe", "mxfp8", "--deepspeed"]
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and all(line.startswith("pretrain_gpt.py: error: ") for line in lines)
    assert "--ckpt-format zarr is refused" in lines[0] and "--fp8-recipe mxfp8 is refused" in lines[1]
    assert "--no-such-flag is not a flag" in lines[2]
    assert not any("unrecognized arguments" in line or "ambiguous" in line for line in lines)


def test_no_abbreviations_and_deepspeed_is_a_switch(tmp_path):
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "1"]
    with pytest.raises(ArgumentError, match="--num-lay is not a flag"):
        parse_command_line(base + ["--num-lay", "2"])
    args = parse_command_line(base + ["--deepspeed"])
    assert args.deepspeed is True and args.deepspeed_config is None
    with pytest.raises(ArgumentError, match="--deepspeed switches on the DeepSpeed engine"):
        validate_args(args, 1)


def test_unknown_flag_reported_beside_a_missing_required_one():
    with pytest.raises(ArgumentError) as err:
        parse_command_line(["--num-layers", "2", "--fp8-recipe", "blockwise", "--foo=3"])
    lines = str(err.value).splitlines()
    assert lines[0].startswith("--fp8-recipe blockwise is refused") and lines[1].startswith("--foo is not a flag")
    assert "required" in lines[2] and len(lines) == 3
