"""A full disk during a save: one sentence (file, bytes needed, bytes free) on every rank, the partial
directory removed, earlier checkpoints and `latest` intact; a stale .tmp of a crashed save does not stop
the next save. On a small tmpfs where we may mount one (root), else with ENOSPC injected at the write."""
import errno
import os
import re
import subprocess

import pytest
import torch

from megatron_zero.checkpoint.storage.commit import read_latest
from megatron_zero.checkpoint.format import LATEST
from megatron_zero.checkpoint.errors import CheckpointError
from megatron_zero.checkpoint.storage.reader import open_checkpoint
from megatron_zero.checkpoint.storage.writer import CheckpointWriter
from megatron_zero.testing.multirank import run_ranks

KIB = 1024


def _plan(rank, kib):
    return [(f"rank{rank}.pt", {"w": torch.full((kib * KIB // 4,), float(rank))})]


def _saves(save_dir, inject):
    """Save 100 KiB per rank, then 2 MiB per rank (too much), then 100 KiB again; outcomes per save."""
    rank = torch.distributed.get_rank()
    if inject:  # no tmpfs: the 2 MiB files hit ENOSPC once past 1 MiB, as on a disk that size
        import megatron_zero.checkpoint.storage.tensor_io as tio
        real = tio._ChecksumWriter._write

        def full(self, data):
            if self.size + memoryview(data).nbytes > KIB * KIB:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(self, data)
        tio._ChecksumWriter._write = full
    writer, out = CheckpointWriter(), []
    for step, kib in ((1, 100), (2, 2048), (3, 100)):
        if step == 3 and rank == 0:  # a crashed earlier save left this behind
            os.makedirs(os.path.join(save_dir, "global_step9.tmp-0123456789ab"))
        try:
            writer.save(save_dir, f"global_step{step}", _plan(rank, kib), iteration=step)
            out.append(None)
        except CheckpointError as e:
            out.append(str(e))
        if step == 2:
            out.append(sorted(os.listdir(save_dir)))
            torch.distributed.barrier()  # every rank has listed before rank 0 plants step 3's stale directory
    return out


@pytest.fixture
def small_disk(tmp_path):
    path = tmp_path / "disk"
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(path)],
                             capture_output=True).returncode == 0
    yield str(path), not mounted
    if mounted:
        subprocess.run(["umount", str(path)])


def test_disk_full_during_a_save_is_one_sentence_and_loses_nothing(small_disk):
    save_dir, inject = small_disk
    results = run_ranks(_saves, 2, save_dir, inject, timeout=120)
    for first, failed, listing, third in results:
        assert first is None and third is None
        assert re.fullmatch(rf"saving checkpoint global_step2 into {re.escape(save_dir)} failed writing "
                            rf"{re.escape(save_dir)}/global_step2\.tmp-[0-9a-f]+/rank\d\.pt: No space left on device; "
                            r"the checkpoint needs about \d+ bytes and \d+ bytes are free; the partial checkpoint "
                            r"was removed, earlier checkpoints and `latest` are intact", failed), failed
        needed = int(re.search(r"needs about (\d+)", failed).group(1))
        assert needed >= 2 * 2048 * KIB
        assert listing == ["global_step1", LATEST, "latest_checkpointed_iteration.txt"]
    assert results[0][1] == results[1][1]  # every rank says the same one sentence
    assert read_latest(save_dir) == "global_step3" and sorted(os.listdir(save_dir)) == [
        "global_step1", "global_step3", LATEST, "latest_checkpointed_iteration.txt"]
    ckpt = open_checkpoint(save_dir)
    assert torch.equal(ckpt.load("rank1.pt")["w"], torch.ones(100 * KIB // 4))
