"""Checkpoint state: offline bookkeeping, DeepSpeed's zero_to_fp32 reads our files, resume and NVMe offload."""
import os
import pickle
import types
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist

from megatron_zero.testing import run_ranks
from megatron_zero.zero import ZeroOptimizer, param_slice_mappings, partition_group, zero3_group_offsets
from megatron_zero.zero.partition import fragment_address, zero3_param_partition
from megatron_zero.testing.toy_zero import GLOBAL_BATCH, HP, ZERO3_PERSIST, ToyGPT, batch, full_masters


def test_partition_bookkeeping_offline():
    named = [("a", 5), ("b", 7), ("c", 3)]           # 15 elements, DP 2 -> aligned to 4 -> 16
    part = partition_group(named, 2)
    assert (part.padded_numel, part.partition_size) == (16, 8)
    assert [part.padding(r) for r in range(2)] == [0, 1]
    maps = param_slice_mappings([named], 2, 1)[0]
    assert list(maps.items()) == [("b", fragment_address(numel=4, start=0)), ("c", fragment_address(numel=3, start=4))]
    for dp in (1, 2, 3, 4, 8):  # every element of every parameter sits in exactly one fragment
        p = partition_group(named, dp)
        assert p.padded_numel % (2 * dp) == 0
        covered = {n: 0 for n, _ in named}
        for r in range(dp):
            for n, f in p.fragments(r).items():
                covered[n] += f.numel
                assert 0 <= f.start and f.start + f.numel <= p.partition_size
        assert covered == dict(named)
    assert zero3_param_partition(7, 4) == (2, 1)
    assert zero3_group_offsets(named, 4) == OrderedDict(a=(0, 2), b=(2, 2), c=(4, 1))
    loaded = pickle.loads(pickle.dumps(fragment_address(numel=3, start=4)))
    assert type(loaded) is types.SimpleNamespace and (loaded.start, loaded.numel) == (4, 3)


def train_and_save(stage, path, offload, nvme_path, steps=3, resume_from=None):
    dp, rank = dist.get_world_size(), dist.get_rank()
    model = ToyGPT()
    opt = ZeroOptimizer(list(model.named_parameters()), dp_group=dist.group.WORLD, stage=stage, module=model,
                        offload=offload, nvme_path=nvme_path, bucket_size=500, **ZERO3_PERSIST, **HP)
    start = 0
    if resume_from:
        opt.load_state_dict(torch.load(os.path.join(resume_from, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"),
                                       weights_only=False)["optimizer_state_dict"])
        start = steps
    per, losses = GLOBAL_BATCH // dp, []
    for s in range(start, start + steps):
        tokens, labels = batch(s)
        loss = model(tokens[rank * per:(rank + 1) * per], labels[rank * per:(rank + 1) * per])
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    if path:
        sd = opt.state_dict()
        torch.save({"optimizer_state_dict": sd}, os.path.join(path, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
        if rank == 0:
            shapes = OrderedDict((n, p.ds_shape if stage == 3 else p.shape) for n, p in model.named_parameters())
            torch.save({"module": {}, "buffer_names": [], "param_shapes": [shapes], "shared_params": {},
                        "frozen_param_shapes": None, "ds_version": "0.19.8"},
                       os.path.join(path, "mp_rank_00_model_states.pt"))
    return {"losses": losses, "weights": full_masters(opt)}


def save_and_resume(root):
    out = {}
    for stage in (1, 2, 3):
        ckpt = os.path.join(root, f"stage{stage}")
        if dist.get_rank() == 0:
            os.makedirs(ckpt)
        dist.barrier()
        first = train_and_save(stage, ckpt, "none", None)
        dist.barrier()
        straight = train_and_save(stage, None, "none", None, 6)
        resumed = train_and_save(stage, None, "none", None, 3, ckpt)
        out[stage] = (first, straight, resumed)
    return out


def test_deepspeed_zero_to_fp32_reads_ours_and_resume_is_exact(tmp_path):
    z = pytest.importorskip("deepspeed.utils.zero_to_fp32")
    runs = run_ranks(save_and_resume, 2, str(tmp_path), timeout=180)[0]
    for stage, (first, straight, resumed) in runs.items():
        ckpt = str(tmp_path / f"stage{stage}")
        sd = torch.load(os.path.join(ckpt, "zero_pp_rank_1_mp_rank_00_optim_states.pt"), weights_only=False)
        keys = {"zero_stage", "partition_count", "loss_scaler", "dynamic_loss_scale", "overflow"} | (
            {"fp32_flat_groups", "optimizer_state_dict"} if stage == 3 else
            {"base_optimizer_state", "single_partition_of_fp32_groups", "param_slice_mappings", "group_paddings",
             "clip_grad"})
        assert keys <= set(sd["optimizer_state_dict"])
        full = z._get_fp32_state_dict_from_zero_checkpoint(ckpt, exclude_frozen_parameters=False)
        for name, want in first["weights"].items():
            got = full[name].contiguous() if hasattr(full[name], "contiguous") else full[name]
            assert torch.equal(got, want), (stage, name)
        assert resumed["losses"] == straight["losses"][3:], stage  # resume from the files is exact


def offload_runs(root):
    out = {"none": train_and_save(2, None, "none", None)}
    for offload in ("cpu", "nvme"):
        ckpt = os.path.join(root, offload)
        if dist.get_rank() == 0:
            os.makedirs(ckpt)
        dist.barrier()
        out[offload] = train_and_save(2, ckpt, offload, os.path.join(root, "swap"))
    return out


def test_nvme_offload_matches_and_checkpoints(tmp_path):
    runs = run_ranks(offload_runs, 2, str(tmp_path), timeout=120)[0]
    for offload in ("cpu", "nvme"):
        for name, want in runs["none"]["weights"].items():
            assert torch.allclose(runs[offload]["weights"][name], want, rtol=1e-5, atol=1e-7), (offload, name)
        sd = torch.load(tmp_path / offload / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
        state = sd["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
        assert float(state["step"]) == 3 and state["exp_avg_sq"].abs().sum() > 0
    assert any(f.endswith("exp_avg.bin") for f in os.listdir(tmp_path / "swap"))
