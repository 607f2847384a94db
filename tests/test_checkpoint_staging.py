"""Saves stream through a bounded host staging buffer; loads go straight to the state's device.

The host-memory bounds are measured with RSS sampled every 2 ms (megatron_zero.testing.host_memory).
On a machine without a GPU the tensors are host tensors: `HostStaging(copy_host_tensors=True)`
sends them through the same ring of host slots a GPU's tensors go through (the same code, with
the CPU as the device and synchronous copies instead of a side stream); what this shows is the
ring's bound and that a tensor far larger than the buffer is cut into pieces. That the copies
come from GPU memory into pinned slots is shown by the `gpu` tests, which skip here.
"""
import os

import pytest
import torch

from megatron_zero.checkpoint.storage.staging import HostStaging
from megatron_zero.checkpoint.storage.tensor_io import load_file, save_file
from megatron_zero.distributed.device import HOST
from megatron_zero.testing.host_memory import anon_and_rss, measured
from test_gpu_training import device as gpu_device  # noqa: F401 (the gpu tier's fixture, as gpu_device)

MIB = 1 << 20


def _nested_state(dev=HOST):
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(300_000, generator=g).to(dev)
    shared = torch.arange(7.0, device=dev)
    return {"views": [flat[:1000].view(10, 100), flat[5000:9000]], "shared": shared, "again": shared,
            "bf16": torch.randn(33, 5, generator=g).to(dev, torch.bfloat16),
            "strided": torch.randn(8, 6, generator=g).to(dev).t(), "scalar": torch.tensor(3.5, device=dev),
            "ints": torch.arange(10, dtype=torch.int64, device=dev), "empty": torch.zeros(0, device=dev),
            "meta": {"step": 4, "name": "x", "tuple": (1, 2.0), "lr": [0.1, None]}}


def _equal(a, b):
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_staged_and_direct_saves_write_the_same_file(tmp_path):
    """The ring (tiny slots, so every tensor spans several) writes byte for byte what the direct path
    writes; torch.load reads it back equal, views as their own bytes, shared tensors shared."""
    state = _nested_state()
    direct = save_file(state, str(tmp_path / "direct.pt"))
    staged = save_file(state, str(tmp_path / "staged.pt"),
                       staging=HostStaging(nbytes=3 * 4096, chunk_bytes=4096, copy_host_tensors=True))
    assert direct == staged
    assert open(tmp_path / "direct.pt", "rb").read() == open(tmp_path / "staged.pt", "rb").read()
    loaded = load_file(str(tmp_path / "staged.pt"))
    assert _equal(state, loaded)
    assert loaded["shared"].data_ptr() == loaded["again"].data_ptr()
    plain = torch.load(str(tmp_path / "staged.pt"), weights_only=True)  # torch's own reader, no allow-list
    assert _equal(state, plain)
    assert os.path.getsize(tmp_path / "staged.pt") < 6000 * 4 + 8192  # not the 300k-element flat buffer


def test_save_through_the_staging_ring_keeps_host_memory_to_the_buffer(tmp_path):
    """Save 192 MiB (one 128 MiB tensor, larger than the buffer, and four 16 MiB views) through a
    16 MiB ring: anonymous host memory grows by at most the ring plus 8 MiB (the sampler's and the
    allocator's slack), where copying the largest tensor to the host (torch.save's way from a GPU)
    would take 128 MiB. The sampler is shown to see such a copy first."""
    big = torch.randn(32 * MIB)
    flat = torch.randn(16 * MIB)
    state = {"big": big, "views": [flat[i * 4 * MIB:(i + 1) * 4 * MIB] for i in range(4)]}
    _, copied, _ = measured(lambda: big.clone().add_(1), anon_and_rss)
    assert copied >= 100 * MIB, f"the sampler missed a 128 MiB copy ({copied >> 20} MiB)"
    staging = HostStaging(nbytes=16 * MIB, chunk_bytes=2 * MIB, copy_host_tensors=True)
    path = str(tmp_path / "state.pt")
    _, anon, _ = measured(lambda: save_file(state, path, fsync=False, staging=staging), anon_and_rss)
    assert anon <= 16 * MIB + 8 * MIB, f"host memory grew by {anon >> 20} MiB during a save through a 16 MiB ring"
    loaded = load_file(path)
    assert torch.equal(loaded["big"], big) and all(torch.equal(a, b) for a, b in zip(loaded["views"], state["views"]))


def test_staging_refuses_a_buffer_smaller_than_a_chunk():
    with pytest.raises(ValueError, match="cannot hold one"):
        HostStaging(nbytes=MIB, chunk_bytes=2 * MIB)


@pytest.mark.gpu
def test_save_from_gpu_goes_through_pinned_slots_and_loads_onto_the_gpu(tmp_path):
    """1 GiB on the GPU (a 512 MiB tensor, twice the 256 MiB default buffer, and views of a flat
    buffer): host RSS grows by at most the buffer plus 32 MiB; the slots are pinned; a load with
    device=cuda puts every tensor on the GPU, bit-exact."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    dev = torch.device("cuda", 0)
    n = 64 * MIB  # 256 MiB of fp32
    flat = torch.randn(2 * n, device=dev)
    state = {"big": torch.randn(2 * n, device=dev), "views": [flat[:n], flat[n:]]}
    staging = HostStaging()
    path = str(tmp_path / "state.pt")
    _, grown = measured(lambda: save_file(state, path, staging=staging))
    assert grown <= staging.nbytes + 32 * MIB, f"host RSS grew by {grown >> 20} MiB"
    assert all(s.is_pinned() for s in staging._slots)
    loaded = load_file(path, device=dev)
    assert loaded["big"].device == dev and all(v.device == dev for v in loaded["views"])
    assert torch.equal(loaded["big"], state["big"]) and torch.equal(loaded["views"][1], state["views"][1])


def _load_memory(save_dir):
    """(anonymous growth, total RSS growth, optimizer-file bytes, state bytes, every tensor equal)."""
    import torch.distributed as dist
    from megatron_zero.checkpoint import load_checkpoint, save_checkpoint
    from megatron_zero.testing.checkpoint_stage import build_stage, random_train_step
    state, config, model, opt = build_stage(1, 1, 2, hidden=768)
    random_train_step(state, config, model, opt)
    save_checkpoint(save_dir, 1, state, model, opt, {"iteration": 1})
    _, _, model2, opt2 = build_stage(1, 1, 2, hidden=768)
    random_train_step(state, config, model2, opt2)  # a run's state exists before it resumes
    _, anon, total = measured(lambda: load_checkpoint(save_dir, state, model2, opt2), anon_and_rss)
    sd, sd2 = opt.state_dict(), opt2.state_dict()
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    same = same and all(torch.equal(a, b) for a, b in zip(sd["single_partition_of_fp32_groups"],
                                                          sd2["single_partition_of_fp32_groups"]))
    opt_file = [f for f in os.listdir(os.path.join(save_dir, "global_step1")) if "optim_states" in f][0]
    state_bytes = sum(t.numel() * 4 for t in model.state_dict().values()) + opt2.optimizer.state_bytes()
    dist.barrier()
    return anon, total, os.path.getsize(os.path.join(save_dir, "global_step1", opt_file)), state_bytes, same


def test_load_copies_each_file_into_the_state_without_a_host_copy(tmp_path):
    """Resume a ZeRO-2 state of about 220 MiB (weights, masters, moments; its optimizer file about 165 MiB)
    into a run whose state exists: anonymous host memory grows by at most 16 MiB (measured: 0.1 MiB;
    the files are memory-mapped and copied tensor by tensor into the state), total RSS, which counts
    the mapped file pages, by less than the state (measured: about the optimizer file, page
    cache the kernel can drop). Reading a file into memory would cost its size in anonymous memory."""
    from megatron_zero.testing.multirank import run_ranks
    anon, total, opt_file, state_bytes, same = run_ranks(_load_memory, 1, str(tmp_path / "ckpt"), timeout=300)[0]
    assert same
    assert opt_file > 64 * MIB
    assert anon <= 16 * MIB, f"anonymous host memory grew by {anon >> 20} MiB during the load"
    assert total < state_bytes, f"RSS grew by {total >> 20} MiB, the state is {state_bytes >> 20} MiB"


@pytest.mark.gpu
def test_load_puts_every_file_straight_onto_the_gpu(builtin_corpus, tmp_path, gpu_device, monkeypatch):  # noqa: F811
    """Save from a trainer on the GPU, resume another: every tensor the layer and optimizer files
    give is on the GPU as torch.load returns it (map_location), and the weights come back equal."""
    import megatron_zero.checkpoint.storage.reader as reader
    from test_gpu_training import _args, _params, _save, _train, _trainer
    device = gpu_device
    if device.type != "cuda":
        pytest.skip("the placement is about a CUDA device")
    gpu = _trainer(_args(builtin_corpus, tmp_path), device)
    _train(gpu, 2)
    _save(gpu, tmp_path / "a")
    seen, real = {}, reader.load_file

    def spy(path, **kw):
        obj = real(path, **kw)
        found = []
        from megatron_zero.checkpoint.storage.tensor_io import map_tensors
        map_tensors(obj, lambda t: found.append(t.device))
        seen[os.path.basename(path)] = found
        return obj
    monkeypatch.setattr(reader, "load_file", spy)
    back = _trainer(_args(builtin_corpus, tmp_path, load=tmp_path / "a"), device)
    heavy = {n: d for n, d in seen.items() if "layer_" in n or "optim_states" in n}
    assert heavy and all(d.type == "cuda" for ds in heavy.values() for d in ds), heavy
    assert all(torch.equal(x, y) for x, y in zip(_params(gpu).values(), _params(back).values()))
