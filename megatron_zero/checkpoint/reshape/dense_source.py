"""A checkpoint DeepSpeed's engine wrote without a ZeRO optimizer (stage 0), read like a ZeRO one.

Megatron-DeepSpeed at ZeRO stage 0 keeps its weights in the layer files (pipeline engine) or nested
in mp_rank_*'s `module` (--no-pipeline-parallel), and its optimizer state as a torch optimizer
state_dict in mp_rank_*'s `optimizer`: per parameter index, the indices running over Megatron's
param groups (weight-decayed parameters, then biases and 1-D ones, each in module order). This
module names every index (from the weights' names and shapes, each one checked against the state
it pairs with); universal_source's DenseStageReader serves TP slices of it to StageReader.assemble.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Optional

import torch

from ..deepspeed_layout import EMBED_PREFIX
from ..errors import CheckpointError
from ..format import LAYER_FILE, header_args, layer_file_name
from ..megatron_deepspeed import flatten_module, ours_names

_STATE_KEYS = ("exp_avg", "exp_avg_sq")


def _groups(named: "OrderedDict[str, torch.Tensor]") -> List[List[str]]:
    """Megatron's param groups: weight-decayed, then biases and 1-D parameters (empty ones dropped)."""
    no_wd = [n for n, t in named.items() if n.endswith(".bias") or t.dim() == 1]
    wd = [n for n in named if n not in set(no_wd)]
    return [g for g in (wd, no_wd) if g]


class DenseStates:
    """Weights and per-index optimizer states of every model-parallel rank, named."""

    def __init__(self):
        self.weights: Dict[int, Dict[str, torch.Tensor]] = {}
        self.state: Dict[int, dict] = {}
        self.index: Dict[int, Dict[str, int]] = {}

    @classmethod
    def find(cls, src) -> Optional["DenseStates"]:
        if not src.model_files:
            return None
        sd = src.files.load(src.model_files[min(src.model_files)])
        opt = sd.get("optimizer")
        return cls() if isinstance(opt, dict) and "state" in opt and "param_groups" in opt else None

    def _pipeline_stage(self, src, tp: int, pp: int, count: int, cursor: List[int], tied: bool):
        """(our name -> weight) of stage pp's `count` parameters from the layer files, in module order."""
        named: "OrderedDict[str, torch.Tensor]" = OrderedDict()
        indices = sorted({int(m.group(1)) for m in map(LAYER_FILE.match, src.layer_files)
                          if m and int(m.group(2)) == tp})

        def add(i):
            prefix = EMBED_PREFIX if (i == 1 and tied) else f"{i}."
            for k, v in src.files.load(layer_file_name(i, tp)).items():
                named[prefix + k] = v

        if pp == src.layout.pp - 1 and pp > 0 and tied and 1 in indices:
            add(1)  # the last stage's copy of the tied embedding comes first in its module order
        while len(named) < count and cursor[0] < len(indices):
            add(indices[cursor[0]])
            cursor[0] += 1
        if len(named) != count:
            raise CheckpointError(f"the layer files of {src.directory} for TP rank {tp} do not add up to the "
                                  f"{count} parameters of pipeline stage {pp}'s optimizer state")
        return named

    def read_layout(self, src, mps) -> None:
        """Name each rank's optimizer indices; set src.param_shapes (per group, our names)."""
        head, lay = src.head, src.layout
        tied = not header_args(head).get("untie_embeddings_and_output_weights")
        cursors = {t: [0] for t in range(lay.tp)}
        for mp in mps:
            tp, pp = mp % lay.tp, mp // lay.tp
            sd = src.files.load(src.model_files[mp])
            opt, module = sd["optimizer"], sd.get("module")
            count = sum(len(g["params"]) for g in opt["param_groups"])
            if isinstance(module, dict) and module:
                buffers = set(sd.get("buffer_names") or ())
                flat = OrderedDict((n, t) for n, t in flatten_module(module).items() if n not in buffers)
                named = OrderedDict((ours, flat[saved]) for ours, saved in ours_names(head, flat).items())
            else:
                named = self._pipeline_stage(src, tp, pp, count, cursors[tp], tied)
            groups = _groups(named)
            saved_groups = [list(g["params"]) for g in opt["param_groups"]]
            if [len(g) for g in groups] != [len(g) for g in saved_groups]:
                raise CheckpointError(f"the optimizer state in {src.files.path(src.model_files[mp])} has param groups "
                                      f"of {[len(g) for g in saved_groups]} parameters, its weights "
                                      f"{[len(g) for g in groups]}; it was not written by Megatron-DeepSpeed's GPT")
            index = {}
            for names, ids in zip(groups, saved_groups):
                for name, i in zip(names, ids):
                    st = opt["state"].get(i, {})
                    if "exp_avg" in st and tuple(st["exp_avg"].shape) != tuple(named[name].shape):
                        raise CheckpointError(f"the optimizer state {i} in {src.files.path(src.model_files[mp])} has "
                                              f"shape {tuple(st['exp_avg'].shape)} but the parameter it pairs with, "
                                              f"{name}, has {tuple(named[name].shape)}")
                    index[name] = i
            self.weights[mp], self.state[mp], self.index[mp] = dict(named), opt["state"], index
            src.param_shapes[mp] = [OrderedDict((n, named[n].shape) for n in g) for g in groups]
