"""tools/convert_checkpoint.py as a user drives it: outputs that would move a checkpoint pointer back are refused
(one sentence naming --force), the format an --input holds is named, the pairs it makes are what --help offers,
the data position survives the torchtitan (DCP) round trip, and the progress lines and closing summary.

Each tool runs through its main(argv) in this process (its argument parsing and messages as on the command
line, without a fresh interpreter's import time); stderr is captured, so it is not a terminal: the plain lines.
"""
import os
import re

import pytest
import torch

from megatron_zero.checkpoint.interop.convert import config_args
import torch.distributed.checkpoint as dcp

from megatron_zero.checkpoint.interop.to_universal import write_universal
from megatron_zero.checkpoint.reshape.universal_load import UniversalFiles
from megatron_zero.checkpoint.storage.reader import open_directory
from megatron_zero.model.params import param_names, param_spec
from megatron_zero.testing.tiny_gpt import tiny_llama_config
from tools import convert_checkpoint

CFG = tiny_llama_config(num_layers=2, num_query_groups=2, make_vocab_size_divisible_by=1)
PROGRESS = re.compile(r"^convert_checkpoint: (\d+)/(\d+) tensors \((\d+)% of the bytes\), [\d.]+/[\d.]+ (GiB|MiB), [\d.]+ MiB/s, "
                      r"ETA \d+:\d\d:\d\d$")


class _Source:
    has_optimizer = True

    def full(self, name, which):
        g = torch.Generator().manual_seed(len(name) * 3 + len(which))
        return torch.randn(param_spec(name, CFG).full_shape, generator=g), None, param_spec(name, CFG).sub_params

    def step(self, name):
        return 5


def _universal(path, iteration, consumed=None):
    head = {"iteration": iteration, "args": config_args(CFG),
            "universal_checkpoint_info": {"original_vocab_size": CFG.vocab_size}}
    if consumed is not None:
        head.update(consumed_train_samples=consumed,
                    train_state={"iteration": iteration, "consumed_train_samples": consumed})
    write_universal(_Source(), CFG, head, str(path), "test")
    return str(path)


def _run(capsys, *argv):
    code = convert_checkpoint.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _titan_flags():
    return ["--num-attention-heads", str(CFG.num_attention_heads), "--seq-length", str(CFG.seq_length),
            "--make-vocab-size-divisible-by", "1"]


def test_outputs_that_would_move_a_pointer_back_are_refused(tmp_path, capsys):
    """--to torch_dist, dcp and universal: an older iteration into an output holding a newer one, and a megatron_zero
    save directory as the output, are one sentence naming --force; nothing is written. (Before: torch_dist's
    tracker went from 6 back to 4 silently, dcp wrote step-4 beside step-6, universal's pointer went back.)"""
    new, old = _universal(tmp_path / "u6" / "a", 6), _universal(tmp_path / "u4" / "a", 4)
    td = tmp_path / "megatron"
    assert _run(capsys, "--from", "universal", "--to", "torch_dist", "--input", new, "--output", str(td))[0] == 0
    code, _, err = _run(capsys, "--from", "universal", "--to", "torch_dist", "--input", old, "--output", str(td))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--force" in err and "iteration 6" in err, err
    assert (td / "latest_checkpointed_iteration.txt").read_text() == "6" and not (td / "iter_0000004").exists()
    assert _run(capsys, "--from", "universal", "--to", "torch_dist", "--input", old, "--output", str(td), "--force")[0] == 0
    assert (td / "latest_checkpointed_iteration.txt").read_text() == "4"

    ours = tmp_path / "save"
    ours.mkdir()
    (ours / "latest").write_text("global_step6")
    for to in ("torch_dist", "dcp"):
        code, _, err = _run(capsys, "--from", "universal", "--to", to, "--input", old, "--output", str(ours))
        assert code == 2 and "megatron_zero save directory" in err and "--force" in err, err
    assert os.listdir(ours) == ["latest"]

    titan = tmp_path / "titan"
    assert _run(capsys, "--from", "universal", "--to", "dcp", "--input", new, "--output", str(titan))[0] == 0
    code, _, err = _run(capsys, "--from", "universal", "--to", "dcp", "--input", old, "--output", str(titan))
    assert code == 2 and "holds iteration 6" in err and "--force" in err and not (titan / "step-4").exists(), err

    hub = tmp_path / "u6"  # holds a (iteration 6) and latest_universal naming it
    code, _, err = _run(capsys, "--from", "dcp", "--to", "universal", "--input", str(titan / "step-6"), "--output",
                        str(hub / "older"), *_titan_flags())
    assert code == 0, err  # iteration 6 beside iteration 6: allowed
    (hub / "latest_universal").write_text("a")
    code, _, err = _run(capsys, "--from", "torch_dist", "--to", "universal", "--input", str(td), "--output",
                        str(hub / "b"), "--vocab-size", str(CFG.vocab_size))
    assert code == 2 and "latest_universal" in err and "--force" in err and not (hub / "b").exists(), err
    assert (hub / "latest_universal").read_text() == "a"


def test_input_format_is_named_and_pairs_listed(tmp_path, capsys):
    """An empty --input is one line (no manifest warning first); a torch_dist checkpoint given to --from deepspeed
    is named as torch_dist; hf is not offered (--help lists the pairs) and is refused pointing to the HF tools."""
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = _run(capsys, "--from", "deepspeed", "--to", "universal", "--input", str(empty), "--output",
                        str(tmp_path / "x"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "empty" in err and "warning" not in err, err

    src = _universal(tmp_path / "u" / "a", 3)
    assert _run(capsys, "--from", "universal", "--to", "torch_dist", "--input", src, "--output", str(tmp_path / "td"),
                "--quiet")[0] == 0
    code, _, err = _run(capsys, "--from", "deepspeed", "--to", "universal", "--input", str(tmp_path / "td"),
                        "--output", str(tmp_path / "y"))
    assert code == 2 and "torch_dist checkpoint" in err and "pass --from torch_dist" in err, err
    assert len(err.strip().splitlines()) == 1

    for argv in (["--from", "hf", "--to", "universal"], ["--from", "universal", "--to", "hf"]):
        code, _, err = _run(capsys, *argv, "--input", src, "--output", str(tmp_path / "z"))
        assert code == 2 and "convert_from_hf.py" in err and "deepspeed | universal -> torch_dist" in err, err
    code, _, err = _run(capsys, "--from", "dcp", "--to", "torch_dist", "--input", src, "--output", str(tmp_path / "z"))
    assert code == 2 and "not a conversion this tool makes" in err and "-> dcp" in err, err

    with pytest.raises(SystemExit):
        convert_checkpoint.main(["--help"])
    text = capsys.readouterr().out
    assert "Conversions: deepspeed | torch_dist | megatron_legacy | dcp -> universal" in text
    assert "hf" not in re.search(r"--from (\S+)", text).group(1)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_round_trip_keeps_the_data_position_and_progress(tmp_path, capsys):
    """universal -> dcp -> universal carries the samples consumed (before: 0 after the round trip); a torchtitan
    checkpoint that records none gets iteration x --global-batch-size, said so. The progress lines (not a terminal)
    count tensors up to 100% with bytes, rate and ETA, and the tool closes with a summary."""
    src = _universal(tmp_path / "u" / "a", 4, consumed=32)
    code, out, err = _run(capsys, "--from", "universal", "--to", "dcp", "--input", src, "--output",
                          str(tmp_path / "titan"))
    assert code == 0, err
    lines = err.strip().splitlines()
    assert lines and all(PROGRESS.match(line) for line in lines), err
    done = PROGRESS.match(lines[-1])
    n = 3 * sum(len(k) for k in (["q", "k", "v"] if "query_key_value" in name else ["a", "b"]
                                 if "dense_h_to_4h" in name else ["x"] for name in param_names(CFG)))
    assert done.group(1) == done.group(2) == str(n) and done.group(3) == "100", lines[-1]
    assert 2 <= len(lines) <= 12  # a line per tenth (and where it ended), not per tensor
    assert re.search(rf"converted {len(param_names(CFG))} parameters \({n} tensors; universal -> dcp, iteration 4\) "
                     r".* in [\d.]+ s, [\d.]+ MiB/s$", out.strip()), out

    code, out, err = _run(capsys, "--from", "dcp", "--to", "universal", "--input", str(tmp_path / "titan" / "step-4"),
                          "--output", str(tmp_path / "v" / "b"), "--quiet", *_titan_flags())
    assert code == 0 and err == "", err
    assert "data position: 32 samples consumed, as the checkpoint records them" in out
    head = UniversalFiles(open_directory(str(tmp_path / "v" / "b"))).model_states(0)
    assert head["train_state"]["consumed_train_samples"] == 32 and head["iteration"] == 4

    foreign = tmp_path / "theirs" / "step-4"  # torchtitan's own: its model and train_state (step, ntokens_seen)
    dcp.save({**_titan_model(), "train_state": {"step": 4, "ntokens_seen": 1024}},
             storage_writer=dcp.FileSystemWriter(str(foreign)), no_dist=True)
    code, out, err = _run(capsys, "--from", "dcp", "--to", "universal", "--input", str(foreign), "--output",
                          str(tmp_path / "w" / "c"), "--quiet", "--global-batch-size", "8", *_titan_flags())
    assert code == 0, err
    assert "32 samples consumed, derived as iteration 4 x --global-batch-size 8" in out, out
    assert UniversalFiles(open_directory(str(tmp_path / "w" / "c"))).model_states(0)["consumed_train_samples"] == 32


def _titan_model():
    """A torchtitan Llama's model tensors (zeros) in its names, for CFG."""
    from megatron_zero.checkpoint.interop.titan import titan_keys, to_titan
    out = {}
    for name in param_names(CFG):
        full = torch.zeros(param_spec(name, CFG).full_shape)
        out.update(zip(titan_keys(name, CFG), (t.contiguous() for t in to_titan(name, full, CFG))))
    return out
