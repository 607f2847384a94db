"""The command blocks of the README (the main job and tests, the example) and of docs/huggingface.md (the
fine-tuning example) do what the text says, so the documentation cannot drift from the code.

Default tier (cheap): every command of every fenced block names a script or tool that exists, every script
passes `bash -n`, every tool's arguments parse with that tool's own parser, pretrain_gpt.py's flags (through
the launch scripts) parse with its parser, and every `scripts/...` / `tools/....py` the two pages name exists.

A command `NAME="..."` sets a variable the later commands of its block use as `$NAME` (expanded here as bash
expands an unquoted variable: its words).

Slow tier: each block is run, command by command in one bash, in a fresh copy of the tree, and what the README
says of it is checked. The commands are the README's; only sizes are shrunk, by replacing the listed flag
values (each replacement must match, so a changed README fails here until this list follows it).
`bash scripts/test.sh` (in the first block) is the suite itself and is checked for existence only.
"""
import argparse
import importlib
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from megatron_zero.arguments import build_parser
from megatron_zero.testing.launch import ROOT
from megatron_zero.testing.readme import command_blocks, fresh_tree, program

README = open(os.path.join(ROOT, "README.md")).read()
HF_DOC = open(os.path.join(ROOT, "docs", "huggingface.md")).read()
BLOCKS = command_blocks(README) + command_blocks(HF_DOC)  # 0: main job and tests, 1: example, 2: Hugging Face
LAUNCHERS = ("scripts/pretrain_local.sh", "scripts/pretrain_torchrun.sh", "scripts/torchrun_node.sh")


IMPORTED_FLAGS = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32"


class _Parsed(Exception):
    pass


def _tool_parses(path, argv):
    """Run the tool's main() only as far as its argument parser; SystemExit(2) if the arguments do not parse."""
    module = importlib.import_module(path[:-3].replace("/", "."))
    real = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        real(self, args, namespace)
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse_only
    try:
        module.main(argv)
    except _Parsed:
        return
    finally:
        argparse.ArgumentParser.parse_args = real
    raise AssertionError(f"{path} did not parse its arguments")


ASSIGNMENT = re.compile(r"^([A-Z_]+)=")
VARIABLE = re.compile(r"\$(?:\{([A-Z_]+)\}|([A-Z_]+))")


def _expanded(block):
    """The block's commands other than variable assignments, with `$NAME` replaced by the assigned value."""
    variables = {}
    for command in BLOCKS[block]:
        words = shlex.split(command, comments=True)
        if words and all(ASSIGNMENT.match(w) for w in words):
            variables.update(w.split("=", 1) for w in words)
            continue
        yield VARIABLE.sub(lambda m: variables[m.group(1) or m.group(2)], command)


def test_the_readme_and_the_hugging_face_page_have_their_command_blocks():
    assert len(command_blocks(README)) == 2 and len(command_blocks(HF_DOC)) == 1 and all(BLOCKS)


@pytest.mark.parametrize("block", range(len(BLOCKS)))
def test_every_command_names_what_exists_and_parses(block):
    for command in _expanded(block):
        # $(cat <import>/megatron_flags.txt) is convert_from_hf.py's output (tests/test_hf_import_flags.py): sizes
        words = shlex.split(re.sub(r"\$\(cat [^)]*megatron_flags.txt\)", IMPORTED_FLAGS, command), comments=True)
        kind, path, args = program(words)
        assert kind in ("script", "tool", "python-c"), command
        if kind == "python-c":
            compile(args[0], "<README>", "exec")
            continue
        assert os.path.isfile(os.path.join(ROOT, path)), f"{path} (README) does not exist"
        if kind == "tool":
            _tool_parses(path, args)
            continue
        assert subprocess.run(["bash", "-n", os.path.join(ROOT, path)]).returncode == 0, path
        if path in LAUNCHERS:  # what follows is pretrain_gpt.py's flags
            build_parser().parse_args(args)


def test_what_the_readme_commands_write_is_ignored_by_git():
    """Every directory a README command writes in the tree (--output-dir, --save, --tensorboard-dir, the HF
    example's directories, demo.sh's runs/) is in .gitignore, so `git status` stays clean."""
    written = set()
    for command in (c for block in range(len(BLOCKS)) for c in _expanded(block)):
        words = shlex.split(re.sub(r"\$\([^)]*\)", "", command), comments=True)
        for flag in ("--output-dir", "--output_folder", "--save", "--tensorboard-dir"):
            written |= {words[i + 1] for i, w in enumerate(words[:-1]) if w == flag}
        written |= set(re.findall(r"save_pretrained\('([^']+)'\)", command))
        kind, path, args = program(words)
        if path == "tools/convert_to_hf.py":
            written.add(args[1])
    tops = sorted({w.split("/")[0] + "/" for w in written} | {"runs/"})
    assert "ckpt/" in tops and "tb/" in tops
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *tops], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    assert sorted(ignored) == tops


def test_every_script_and_tool_the_readme_names_exists():
    named = set(re.findall(r"\b((?:scripts|tools|examples|bench)/[\w./-]+\.(?:sh|py|sbatch))", README + HF_DOC))
    assert named and sorted(n for n in named if not os.path.isfile(os.path.join(ROOT, n))) == []


# --- the slow tier: run them ------------------------------------------------------------------------------
SHRINK = {  # README text -> the same command at a test's size
    1: [("--hidden-size 256", "--hidden-size 64"), ("--seq-length 256", "--seq-length 32"),
        ("--micro-batch-size 4 --global-batch-size 16", "--micro-batch-size 2 --global-batch-size 8"),
        ("--train-iters 150", "--train-iters 6"), ("--exit-interval 100", "--exit-interval 4"),
        ("--save-interval 50", "--save-interval 2"), ("global_step100", "global_step4")],
    2: [("n_positions=256", "n_positions=32"), ("n_embd=256", "n_embd=64"),
        ("--micro-batch-size 4 --global-batch-size 16", "--micro-batch-size 2 --global-batch-size 4"),
        ("--train-iters 20", "--train-iters 2")],
}


def _run_block(tree, block, skip=()):
    """Run the block's commands but those containing a `skip` string; only a whole block is shrunk (SHRINK)."""
    script = "\n".join(c for c in BLOCKS[block] if not any(s in c for s in skip))
    for old, new in SHRINK.get(block, []) if not skip else []:
        assert old in script, f"README block {block} no longer says {old!r}: update SHRINK"
        script = script.replace(old, new)
    env = {**{k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONPATH")},
           "PYTHONPATH": tree}
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tree, capture_output=True, text=True,
                         env=env, timeout=1500)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return run.stdout + run.stderr


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return fresh_tree(tmp_path_factory.mktemp("readme"))


@pytest.mark.slow  # test_every_command_names_what_exists_and_parses checks the same commands in the default tier
def test_the_main_job_runs_as_the_readme_says(tree):
    out = _run_block(tree, 0, skip=("scripts/test.sh",))
    assert re.search(r"iteration 35 \(TP1 x DP4, resumed from universal\): +lm loss: [0-9.E+-]+", out), out[-3000:]
    assert "demo finished" in out and "OMP_NUM_THREADS" not in out
    assert re.search(r"^loss curve: runs/demo/loss\.png$", out, re.M), out[-3000:]  # matplotlib: requirements-test
    with open(os.path.join(tree, "runs", "demo", "loss.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # test_every_command_names_what_exists_and_parses checks the same commands in the default tier
def test_running_your_own_job_runs_as_the_readme_says(tree):
    out = _run_block(tree, 1)
    ckpt = os.path.join(tree, "ckpt")
    assert open(os.path.join(ckpt, "latest")).read().strip() == "global_step6"
    assert {"global_step2", "global_step4", "global_step4_universal", "global_step6"} <= set(os.listdir(ckpt))
    for step in (2, 4, 6):
        assert re.search(rf"^saved checkpoint ckpt/global_step{step} in [0-9.]+ s \(", out, re.M), out[-3000:]
    assert re.search(r"^loaded checkpoint global_step4_universal \(universal, iteration 4, saved at TP=2 x PP=2 "
                     r"x DP=1, ZeRO-1\) from .*, reshaped to TP=1 x PP=1 x DP=2, ZeRO-1$", out, re.M), out[-3000:]
    assert any(f.startswith("events.") for f in os.listdir(os.path.join(tree, "tb"))), "no TensorBoard events"


@pytest.mark.slow  # test_every_command_names_what_exists_and_parses checks the same commands in the default tier
def test_the_hugging_face_example_runs_as_the_readme_says(tree):
    pytest.importorskip("transformers")
    if not os.path.isdir(os.path.join(tree, "data", "builtin")):
        _run_block(tree, 1, skip=("pretrain_local.sh", "ds_to_universal.py", "ARGS="))  # the corpus it trains on
    out = _run_block(tree, 2)
    assert "loaded the Hugging Face import ckpt_gpt2 (GPT2LMHeadModel, weights only" in out, out[-3000:]
    flags = open(os.path.join(tree, "ckpt_gpt2", "megatron_flags.txt")).read().split()
    assert flags[flags.index("--hidden-dropout") + 1] == "0.1"  # GPT2Config's resid_pdrop, printed
    config = json.load(open(os.path.join(tree, "out_hf", "config.json")))
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["torch_dtype"] == "bfloat16"
    assert os.path.isfile(os.path.join(tree, "out_hf", "model.safetensors"))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
