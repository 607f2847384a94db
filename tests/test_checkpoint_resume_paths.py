"""What --load and --save mean, and what a run refuses before its first iteration.

- A DP2 checkpoint resumes on one rank (same TP x PP), plain or converted to universal: the loss curve
  continues (fp32, dropout 0: equal to the DP2 run's to 1e-6 relative) and the RNG state is DP rank 0's.
- --load accepts a tag directory; without `latest`, the newest checkpoint that verifies is taken, with
  one line saying so (a damaged newer one is skipped, named).
- A resume opens the checkpoint it chose once (manifest read, sizes checked): the model check and the loader
  (same layout, reshaped, universal) read that opened checkpoint.
- A fresh start while --save holds checkpoints is refused unless --overwrite-checkpoints.
- --save through a file, on a read-only filesystem, or without room for one checkpoint: one sentence.
"""
import os
import shutil
import subprocess

import pytest
import torch
import torch.distributed as dist

from megatron_zero.checkpoint.storage.tensor_io import load_file
from megatron_zero.checkpoint.reshape.universal_convert import convert_to_universal
from megatron_zero.testing.multirank import run_ranks
from megatron_zero.testing.trainer_losses import resume_flags, train_losses


def _start(argv):
    """Build the Trainer (load, checks) without training: (first iteration, logged lines) or the error."""
    from megatron_zero.arguments import parse_args
    from megatron_zero.config import from_args
    from megatron_zero.checkpoint import CheckpointError
    from megatron_zero.tensor_parallel.rng_state import get_rng_state
    from megatron_zero.distributed.topology import build_parallel_state
    from megatron_zero.training import Trainer

    lines = []
    Trainer._log = lambda self, line: lines.append(line)
    args = parse_args(argv, world_size=dist.get_world_size())
    try:
        trainer = Trainer(from_args(args), build_parallel_state(1, 1))
    except CheckpointError as e:
        return str(e)
    return trainer.progress.iteration, lines, get_rng_state()["torch_rng_state"]


def _argv(corpus, tmp_path, **extra):
    return resume_flags(corpus, tmp_path, 1, 1, 1, **{"train-iters": 4, "hidden-dropout": 0.0, "attention-dropout": 0.0,
                                                **extra})


@pytest.fixture(scope="module")
def dp2_run(builtin_corpus, tmp_path_factory):
    """DP2 losses of 4 iterations, saved at 2 and 4."""
    tmp = tmp_path_factory.mktemp("dp2")
    save = str(tmp / "ckpt")
    losses = run_ranks(train_losses, 2, _argv(builtin_corpus, tmp, save=save, **{"save-interval": 2}), 1, 1,
                       timeout=300)[0]
    return save, losses


def test_dp2_checkpoint_resumes_on_one_rank_plain_and_universal(builtin_corpus, tmp_path, dp2_run):
    save, whole = dp2_run
    saved_rng = load_file(os.path.join(save, "global_step2", "mp_rank_00_model_states.pt"))["rng_state"]
    assert isinstance(saved_rng, list) and len(saved_rng) == 2
    universal = str(tmp_path / "u" / "global_step2_universal")
    convert_to_universal(os.path.join(save, "global_step2"), universal, merge_workers=1, progress=False)
    for load, extra in ((os.path.join(save, "global_step2"), {}),  # the tag directory itself
                        (str(tmp_path / "u"), {"universal-checkpoint": True})):
        start = run_ranks(_start, 1, _argv(builtin_corpus, tmp_path, load=load, **extra), timeout=300)[0]
        assert start[0] == 2 and torch.equal(start[2], saved_rng[0]["torch_rng_state"])
        resumed = run_ranks(train_losses, 1, _argv(builtin_corpus, tmp_path, load=load, **extra), 1, 1, timeout=300)[0]
        assert len(resumed) == 2
        assert resumed == pytest.approx(whole[2:], rel=1e-6), (load, resumed, whole)


def test_without_latest_the_newest_verified_checkpoint_is_resumed(builtin_corpus, tmp_path, dp2_run):
    save = str(tmp_path / "ckpt")
    shutil.copytree(dp2_run[0], save)
    os.remove(os.path.join(save, "latest"))  # a crash between the rename and `latest`
    start, lines, _ = run_ranks(_start, 1, _argv(builtin_corpus, tmp_path, load=save), timeout=300)[0]
    assert start == 4 and any("no `latest` file; resuming from its newest verified checkpoint global_step4" in line
                              for line in lines), lines
    damaged = os.path.join(save, "global_step4", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with open(damaged, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    start, lines, _ = run_ranks(_start, 1, _argv(builtin_corpus, tmp_path, load=save), timeout=300)[0]
    assert start == 2 and any(f"global_step2, skipping global_step4 (the checkpoint file {damaged} fails its "
                              "checksum" in line for line in lines), lines


def _opened(argv):
    """Build the Trainer (load, checks) counting how often each checkpoint directory is opened."""
    from collections import Counter

    from megatron_zero.checkpoint.storage.reader import Checkpoint

    opened, init = Counter(), Checkpoint.__init__

    def counting(self, directory, manifest):
        opened[os.path.normpath(directory)] += 1
        init(self, directory, manifest)

    Checkpoint.__init__ = counting
    try:
        _start(argv)
    finally:
        Checkpoint.__init__ = init
    return dict(opened)


def test_a_resume_opens_the_checkpoint_it_loads_once(builtin_corpus, tmp_path, dp2_run):
    save = dp2_run[0]
    universal = str(tmp_path / "u" / "global_step2_universal")
    convert_to_universal(os.path.join(save, "global_step2"), universal, merge_workers=1, progress=False)
    without_latest = str(tmp_path / "no_latest")
    shutil.copytree(save, without_latest)
    os.remove(os.path.join(without_latest, "latest"))
    for load, extra, chosen in ((save, {}, os.path.join(save, "global_step4")),  # DP2 -> DP1: reshaped
                                (os.path.join(save, "global_step2"), {}, os.path.join(save, "global_step2")),
                                (without_latest, {}, os.path.join(without_latest, "global_step4")),
                                (str(tmp_path / "u"), {"universal-checkpoint": True}, universal)):
        opened = run_ranks(_opened, 1, _argv(builtin_corpus, tmp_path, load=load, **extra), timeout=300)[0]
        assert opened == {chosen: 1}, (load, opened)


def test_fresh_start_over_saved_checkpoints_is_refused(builtin_corpus, tmp_path, dp2_run):
    save = dp2_run[0]
    refused = run_ranks(_start, 1, _argv(builtin_corpus, tmp_path, save=save), timeout=300)[0]
    assert refused == (f"--save {save} already holds checkpoints (newest global_step4) but this run starts from "
                       f"scratch and would overwrite them; pass --load {save} to resume, or --overwrite-checkpoints "
                       "to train anew over them")
    start, _, _ = run_ranks(_start, 1, _argv(builtin_corpus, tmp_path, save=save, load=save), timeout=300)[0]
    assert start == 4  # Megatron's habit, --load == --save: resumed, nothing refused
    fresh = str(tmp_path / "fresh")
    shutil.copytree(save, fresh)
    assert run_ranks(_start, 1, _argv(builtin_corpus, tmp_path, save=fresh, **{"overwrite-checkpoints": True}),
                     timeout=300)[0][0] == 0


def _mount_tmpfs(path, options):
    os.makedirs(path, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    return done.returncode == 0


def test_save_dir_checked_before_the_first_iteration(builtin_corpus, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    refused = run_ranks(_start, 1, _argv(builtin_corpus, tmp_path, save=str(blocker / "ckpt")), timeout=300)[0]
    assert refused.startswith(f"--save {blocker / 'ckpt'} is not writable (Not a directory") and "\n" not in refused
    small, readonly = tmp_path / "small", tmp_path / "ro"
    if not (_mount_tmpfs(small, "size=64k") and _mount_tmpfs(readonly, "ro,size=64k")):
        pytest.skip("mounting a tmpfs needs root; the ENOSPC test injects the error instead")
    try:
        refused = run_ranks(_start, 1, _argv(builtin_corpus, tmp_path, save=str(readonly / "ckpt")), timeout=300)[0]
        assert refused.startswith(f"--save {readonly / 'ckpt'} is not writable (Read-only file system")
        refused = run_ranks(_start, 1, _argv(builtin_corpus, tmp_path, save=str(small)), timeout=300)[0]
        assert refused.startswith(f"--save {small} has ") and "bytes free but one checkpoint of this model takes " \
            "about " in refused, refused
    finally:
        subprocess.run(["umount", str(small)])
        subprocess.run(["umount", str(readonly)])
