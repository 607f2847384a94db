"""The model-agnostic checkpoint storage: streaming files, manifest, commit, keep-last-k, async, damage."""
import os

import pytest
import torch

from megatron_zero.checkpoint.storage.commit import committed_tags, read_latest
from megatron_zero.checkpoint.errors import CheckpointError
from megatron_zero.checkpoint.format import LATEST, LATEST_ITERATION
from megatron_zero.checkpoint.storage.reader import open_checkpoint
from megatron_zero.checkpoint.storage.tensor_io import clone_tensors_for_torch_save, load_file, save_file
from megatron_zero.checkpoint.storage.writer import CheckpointWriter
from megatron_zero.testing.multirank import run_ranks


def _state(rank, step):
    g = torch.Generator().manual_seed(rank * 1000 + step)
    flat = torch.randn(10_000, generator=g)
    return {"flat_part": flat[2_000:4_000], "w": torch.randn(8, 8, generator=g), "step": step,
            "nested": [{"t": torch.arange(5) + step}]}


def test_views_are_written_without_their_whole_storage(tmp_path):
    big = torch.randn(1_000_000)
    view = big[10:1010].view(10, 100)
    size, checksum = save_file({"v": view}, str(tmp_path / "v.pt"))
    assert size == os.path.getsize(tmp_path / "v.pt") and size < 4 * 1000 + 4096
    assert checksum.startswith("crc32c:")
    assert torch.equal(load_file(str(tmp_path / "v.pt"))["v"], view)
    cloned = clone_tensors_for_torch_save({"a": view, "b": view})
    assert cloned["a"] is cloned["b"] and cloned["a"].untyped_storage().nbytes() == 4000
    assert cloned["a"].data_ptr() != view.data_ptr()


def _save_twice(save_dir, async_save):
    rank = torch.distributed.get_rank()
    writer = CheckpointWriter()
    for step in (1, 2, 3):
        live = _state(rank, step)
        writer.save(save_dir, f"global_step{step}", [(f"rank{rank}.pt", live)], iteration=step,
                    async_save=async_save, keep_last_k=2)
        writer.wait_until_state_read()  # what the optimizer's next step does before changing the state
        live["w"].add_(100.0)  # training goes on
        live["flat_part"].zero_()
    writer.wait()
    torch.distributed.barrier()
    ckpt = open_checkpoint(save_dir)
    got = ckpt.load(f"rank{rank}.pt")
    want = _state(rank, 3)
    return all(torch.equal(got[k], want[k]) for k in ("flat_part", "w")) and got["step"] == 3


@pytest.mark.parametrize("async_save", [False, True])
def test_two_ranks_commit_latest_and_keep_last_k(tmp_path, async_save):
    save_dir = str(tmp_path / "ckpt")
    assert run_ranks(_save_twice, 2, save_dir, async_save, timeout=120) == [True, True]
    assert read_latest(save_dir) == "global_step3"
    assert open(os.path.join(save_dir, LATEST_ITERATION)).read() == "3"
    assert committed_tags(save_dir) == ["global_step2", "global_step3"]  # keep_last_k=2
    assert sorted(os.listdir(save_dir)) == sorted(["global_step2", "global_step3", LATEST, LATEST_ITERATION])
    ckpt = open_checkpoint(save_dir)
    assert sorted(ckpt.manifest["files"]) == ["rank0.pt", "rank1.pt"]
    assert ckpt.manifest["files"]["rank1.pt"]["rank"] == 1 and ckpt.meta["iteration"] == 3


def _single_save(tmp_path, step=1):
    save_dir = str(tmp_path / "ckpt")
    CheckpointWriter().save(save_dir, f"global_step{step}", [("a.pt", _state(0, step)), ("b.pt", _state(1, step))],
                            iteration=step)
    return save_dir


def test_load_refuses_a_flipped_byte_naming_the_file(tmp_path):
    save_dir = _single_save(tmp_path)
    path = os.path.join(save_dir, "global_step1", "a.pt")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    ckpt = open_checkpoint(save_dir)  # sizes still fine
    assert ckpt.load("b.pt")["step"] == 1
    with pytest.raises(CheckpointError, match=r"a\.pt fails its checksum"):
        ckpt.load("a.pt")


def test_load_refuses_a_truncated_or_missing_file_naming_it(tmp_path, capsys):
    save_dir = _single_save(tmp_path)
    path = os.path.join(save_dir, "global_step1", "b.pt")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(CheckpointError, match=r"b\.pt is \d+ bytes but its manifest records \d+"):
        open_checkpoint(save_dir)
    os.remove(path)
    with pytest.raises(CheckpointError, match=r"b\.pt listed in its manifest is missing"):
        open_checkpoint(save_dir)
    os.remove(os.path.join(save_dir, "global_step1", "manifest.json"))  # as DeepSpeed writes: read, with a warning
    assert open_checkpoint(save_dir).load("a.pt")["step"] == 1
    assert "global_step1 has no manifest.json" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match=r"latest does not exist"):
        open_checkpoint(str(tmp_path))


def test_resaving_a_tag_replaces_it_whole(tmp_path):
    save_dir = _single_save(tmp_path)
    CheckpointWriter().save(save_dir, "global_step1", [("c.pt", {"x": torch.ones(3)})], iteration=1)
    ckpt = open_checkpoint(save_dir)
    assert sorted(ckpt.manifest["files"]) == ["c.pt"] and sorted(os.listdir(ckpt.directory)) == ["c.pt",
                                                                                                 "manifest.json"]
