"""tools/ds_to_universal.py and tools/zero_to_fp32.py as a user runs them with output to a file (not a terminal):
a plain progress line per tenth of the work (parameters done, bytes, rate, ETA), ending at 100%, and a closing
summary with the time and rate; ds_to_universal.py refuses to point latest_universal back to an older checkpoint
unless --force. (Before: lines without rate or ETA, summaries without a rate, and the pointer moved back.)
"""
import json
import os
import re

from megatron_zero.checkpoint import save_checkpoint
from megatron_zero.testing.checkpoint_stage import build_stage, random_train_step
from megatron_zero.testing.multirank import run_ranks
from tools import ds_to_universal, zero_to_fp32

LINE = r"^{}: (\d+)/(\d+) parameters \((\d+)% of the bytes\), [\d.]+/[\d.]+ (GiB|MiB), [\d.]+ MiB/s, ETA \d+:\d\d:\d\d$"


def _save_tiny(save_dir):
    state, config, model, opt = build_stage(1, 1, 1)
    random_train_step(state, config, model, opt)
    save_checkpoint(save_dir, 1, state, model, opt, {"iteration": 1})


def _lines(err, tool):
    lines = err.strip().splitlines()
    matches = [re.match(LINE.format(tool), line) for line in lines]
    assert lines and all(matches), err
    last = matches[-1]
    assert last.group(1) == last.group(2) and last.group(3) == "100", lines[-1]
    return lines


def test_progress_lines_summaries_and_the_universal_pointer(tmp_path, capsys):
    save = str(tmp_path / "ckpt")
    run_ranks(_save_tiny, 1, save, timeout=300)

    newer = tmp_path / "ckpt" / "global_step9_universal"  # a newer universal checkpoint latest_universal names
    newer.mkdir()
    (newer / "manifest.json").write_text(json.dumps({"iteration": 9, "files": {}}))
    (tmp_path / "ckpt" / "latest_universal").write_text(newer.name)
    argv = ["--input_folder", os.path.join(save, "global_step1"), "--output_folder",
            os.path.join(save, "global_step1_universal"), "--num_merge_workers", "1"]
    assert ds_to_universal.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "iteration 9" in err and "--force" in err, err
    assert (tmp_path / "ckpt" / "latest_universal").read_text() == newer.name

    assert ds_to_universal.main(argv + ["--force"]) == 0
    out, err = capsys.readouterr()
    assert len(_lines(err, "ds_to_universal")) <= 12
    assert re.search(r" in [\d.]+ s, [\d.]+ MiB/s$", out.strip()), out
    assert (tmp_path / "ckpt" / "latest_universal").read_text() == "global_step1_universal"

    assert zero_to_fp32.main([save, str(tmp_path / "fp32"), "-t", "global_step1"]) == 0
    out, err = capsys.readouterr()
    _lines(err, "zero_to_fp32")
    assert re.search(r" in [\d.]+ s, [\d.]+ MiB/s: pytorch_model.bin$", out.strip()), out
