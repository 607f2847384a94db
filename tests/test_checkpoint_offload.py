"""NVMe-offloaded optimizer state goes into the checkpoint and comes back into another NVMe directory."""
import os

import torch
import torch.distributed as dist

from megatron_zero.checkpoint import load_checkpoint, save_checkpoint
from megatron_zero.model.config import GPTConfig
from megatron_zero.pipeline.gpt_stage import build_gpt_stage
from megatron_zero.testing.checkpoint_stage import CONFIG, random_train_step
from megatron_zero.testing.multirank import run_ranks
from megatron_zero.distributed.topology import build_parallel_state
from megatron_zero.zero import ZeroOptimizer


def _build(state, nvme):
    config = GPTConfig(**CONFIG)
    model = build_gpt_stage(config, state)
    opt = ZeroOptimizer(list(model.named_parameters()), dp_group=state.dp_group, stage=2, lr=1e-2,
                        offload="nvme", nvme_path=nvme, module=model)
    return config, model, opt


def _flat_opt_state(opt):
    sd = opt.state_dict()
    st = sd["base_optimizer_state"]["state"]
    return [torch.cat([st[g]["exp_avg"].reshape(-1), st[g]["exp_avg_sq"].reshape(-1)]).clone() for g in st] + \
        [t.clone() for t in sd["single_partition_of_fp32_groups"]]


def _roundtrip(save_dir, nvme_root):
    state = build_parallel_state(1, 1)
    r = dist.get_rank()
    config, model, opt = _build(state, os.path.join(nvme_root, f"a{r}"))
    random_train_step(state, config, model, opt)
    save_checkpoint(save_dir, 1, state, model, opt, {"iteration": 1})
    saved = _flat_opt_state(opt)
    _, model2, opt2 = _build(state, os.path.join(nvme_root, f"b{r}"))
    load_checkpoint(save_dir, state, model2, opt2)
    loaded = _flat_opt_state(opt2)
    assert all(torch.equal(a, b) for a, b in zip(saved, loaded)) and any(a.abs().sum() > 0 for a in saved)
    # one more step on both: identical weights afterwards
    random_train_step(state, config, model, opt)
    random_train_step(state, config, model2, opt2)
    return all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))


def test_nvme_offload_state_round_trips(tmp_path):
    assert run_ranks(_roundtrip, 2, str(tmp_path / "ckpt"), str(tmp_path / "nvme"), timeout=120) == [True, True]
