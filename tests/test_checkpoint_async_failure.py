"""An async save that fails on a rank other than 0: rank 0 learns it from that rank's failure marker
at once (not at the commit timeout), says one sentence naming the rank and the file, removes the
partial directory and commits nothing; `latest` keeps naming the previous checkpoint."""
import errno
import os
import re
import time

import torch

from megatron_zero.checkpoint.errors import CheckpointError
from megatron_zero.checkpoint.format import LATEST
from megatron_zero.checkpoint.storage.commit import read_latest
from megatron_zero.checkpoint.storage.manifest import failed_ranks, failure_path, write_failure
from megatron_zero.checkpoint.storage.writer import CheckpointWriter
from megatron_zero.testing.multirank import run_ranks

PROMPT_S = 5.0  # the commit timeout below is 600 s


def _plan(rank):
    return [(f"rank{rank}.pt", {"w": torch.full((64 * 1024,), float(rank))})]


def _saves(save_dir):
    import megatron_zero.checkpoint.storage.tensor_io as tio

    rank = torch.distributed.get_rank()
    writer = CheckpointWriter()
    writer.commit_timeout = 600.0
    writer.save(save_dir, "global_step1", _plan(rank), iteration=1, async_save=True)
    writer.wait()
    torch.distributed.barrier()
    real = tio._ChecksumWriter._write
    out = []
    for tag, error in (("global_step2", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))), ("global_step3", RuntimeError())):
        if rank == 1:  # this rank's disk is full (then: an error that names no file and says nothing)
            def fail(self, data, error=error):
                raise error
            tio._ChecksumWriter._write = fail
        start = time.monotonic()
        writer.save(save_dir, tag, _plan(rank), iteration=int(tag[-1]), async_save=True)
        try:
            writer.wait()
            sentence = None
        except CheckpointError as e:
            sentence = str(e)
        out.append((sentence, time.monotonic() - start))
        tio._ChecksumWriter._write = real
        torch.distributed.barrier()
    return out, sorted(os.listdir(save_dir))


def test_a_failed_write_on_rank_1_fails_the_async_save_on_rank_0_promptly(tmp_path):
    save_dir = str(tmp_path)
    (out0, listing), (out1, _) = run_ranks(_saves, 2, save_dir, timeout=120)
    tail = (r"; rank 1's files need about \d+ bytes and \d+ bytes are free; the partial checkpoint was "
            r"removed, earlier checkpoints and `latest` are intact")
    patterns = [rf"saving checkpoint global_step2 into {re.escape(save_dir)} failed on rank 1 writing "
                rf"{re.escape(save_dir)}/global_step2\.tmp-[0-9a-f]+/rank1\.pt: No space left on device" + tail,
                rf"saving checkpoint global_step3 into {re.escape(save_dir)} failed on rank 1 writing "
                rf"{re.escape(save_dir)}: RuntimeError" + tail]
    for pattern, (s0, t0), (s1, _) in zip(patterns, out0, out1):
        assert s0 is not None and re.fullmatch(pattern, s0), s0
        assert s1 is not None and re.fullmatch(pattern, s1), s1  # rank 1 says the same
        assert t0 < PROMPT_S, f"rank 0 took {t0:.1f} s to see rank 1's failure"
    assert listing == ["global_step1", LATEST, "latest_checkpointed_iteration.txt"]
    assert read_latest(save_dir) == "global_step1"


def test_failure_markers_are_read_back_and_never_create_the_directory(tmp_path):
    tmp = str(tmp_path / "global_step3.tmp-0123456789ab")
    write_failure(tmp, 1, {"file": "x", "what": "y", "needed": 3})
    assert not os.path.exists(tmp)  # rank 0 removed it already: nothing is recreated
    os.makedirs(tmp)
    assert failed_ranks(tmp, 4) == {}
    write_failure(tmp, 1, {"file": "x", "what": "y", "needed": 3})
    open(failure_path(tmp, 3), "w").close()  # a rank whose disk took only the name
    assert failed_ranks(tmp, 4) == {1: {"file": "x", "what": "y", "needed": 3}, 3: None}
