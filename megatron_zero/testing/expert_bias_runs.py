"""DeepSeek-V3-router runs for the expert-bias tests: the flags (sigmoid scores, the expert bias at a rate large
enough to move the choices in a few steps, 4 groups of 2 experts, 2 groups a token), the Trainer run in-process
on this rank's group returning each iteration's loss and the biases it ends with, and the biases a checkpoint
holds."""
from __future__ import annotations

import glob
import os
from typing import Dict

import torch

from ..moe.expert_bias import ExpertBiasUpdate

DEEPSEEK_ROUTER = {"num-experts": 8, "moe-router-topk": 2, "moe-router-score-function": "sigmoid",
                   "moe-router-enable-expert-bias": True, "moe-router-bias-update-rate": 0.01,
                   "moe-router-num-groups": 4, "moe-router-group-topk": 2, "moe-router-topk-scaling-factor": 2.5,
                   "moe-aux-loss-coeff": 0.0}


def expert_biases(model) -> Dict[str, torch.Tensor]:
    """name -> a copy of each expert bias of a model (stage)."""
    from ..checkpoint.deepspeed_layout import persistent_buffers

    return {n: b.detach().clone() for n, b in persistent_buffers(model).items() if n.endswith("expert_bias")}


def train_with_biases(argv):
    """Train with pretrain_gpt.py's flags `argv` on this rank's group (the layout the flags give); -> (each
    iteration's loss, this rank's expert biases at the end)."""
    from .trainer_losses import recorded_training

    trainer, losses = recorded_training(argv)
    return losses, expert_biases(trainer.model)


def saved_expert_biases(checkpoint: str) -> Dict[str, torch.Tensor]:
    """name -> tensor of every expert bias in a checkpoint directory's model-states files (all stages)."""
    out = {}
    for path in sorted(glob.glob(os.path.join(checkpoint, "*model_states.pt"))):
        if os.path.basename(path).startswith("layer_"):
            continue
        states = torch.load(path, map_location="cpu", weights_only=False)
        out.update((n, t) for n, t in (states.get("module") or {}).items() if n.endswith("expert_bias"))
    return out


def layer_bias_update(config, rows: int, rate: float, steps: int = 2):
    """An MoE layer of `config` (the same router weight on every rank) routing this rank's share of `rows`
    random tokens (all of them without torch.distributed) and updating its bias over the world group, `steps` times; -> the
    bias after each step."""
    import torch.distributed as dist

    from ..model.transformer import ParallelMLP
    from ..moe.layer import MoELayer

    torch.manual_seed(0)
    layer = MoELayer(config, mlp_class=ParallelMLP)
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.normal_()
    ranks = dist.is_initialized()
    update = ExpertBiasUpdate(layer, rate, dist.group.WORLD if ranks else None)
    world, rank = (dist.get_world_size(), dist.get_rank()) if ranks else (1, 0)
    out = []
    for step in range(steps):
        x = torch.randn(rows, config.seq_length, config.hidden_size, generator=torch.Generator().manual_seed(step))
        layer(x[rank * rows // world:(rank + 1) * rows // world]).sum().backward()
        update.step()
        out.append(layer.deepspeed_moe.gate.expert_bias.clone())
    return out
