"""A Megatron-LM legacy checkpoint (`--ckpt-format torch`) as full tensors under our names, through the safe loader.

    files = LegacyFiles(iter_dir, config)    # iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt, each memory-mapped
    files.full(name, "fp32" | "exp_avg" | "exp_avg_sq") -> (tensor, None, sub_params)

Each file holds one model-parallel rank's `model` (Megatron-Core's module state dict: TP shards, this
stage's layers numbered from 0 as `decoder.layers.<local>.*`), `optimizer` (torch's state dict: state by
parameter index) and `args` / `iteration`. A full tensor is the TP shards concatenated on the split
dimension of its layer type (SwiGLU's [gate_r; up_r] shards are merged half by half into [gate; up];
Megatron-Core's per-group QKV shards are whole groups), layers are placed by stage (num_layers / PP each).
The norms are `input_layernorm` / `pre_mlp_layernorm` (local spec) or `linear_qkv.layer_norm_weight` /
`linear_fc1.layer_norm_weight` (Transformer-Engine spec).

Optimizer state is indexed by position in torch's param groups; Megatron builds them with its default
overrides as one group of the weight-decayed parameters (matrices, embeddings) and then one of the others
(biases, norms), each in module order. That order is rebuilt from the `model` keys and checked shape by shape;
a file whose groups follow another order, or that was trained with --decoupled-lr (a third group), is refused
in one sentence when its optimizer state is read (load it with --no-load-optim).
Unpickling needed nothing beyond the allow-list (argparse.Namespace for `args`; numpy for `rng_state`).
The Megatron-LM DistributedOptimizer's separate `distrib_optim.pt` is not read: such a checkpoint loads with
--no-load-optim only.
"""
from __future__ import annotations

import os
from typing import Dict, Tuple

import torch

from ...model.params import param_names, param_spec
from ..errors import CheckpointError
from ..storage.safe_pickle import safe_load
from .mcore_names import LAYERS, mcore_key, refusal
from .megatron_layout import LEGACY_DIR, LEGACY_FILE
from .torch_dist import megatron_head

LOCAL_NORMS = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
               "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
               "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
               "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}


def legacy_files(directory: str) -> Dict[Tuple[int, int], str]:
    """(tp, pp) -> model_optim_rng.pt path of every model-parallel rank of a legacy checkpoint directory."""
    out = {}
    for n in sorted(os.listdir(directory)):
        m = LEGACY_DIR.match(n)
        if not m:
            continue
        if m.group(3) is not None:
            raise CheckpointError(f"{os.path.join(directory, n)} is an expert-parallel rank's file; legacy "
                                  "mixture-of-experts checkpoints are not read (save with --ckpt-format torch_dist)")
        out[(int(m.group(1)), int(m.group(2) or 0))] = os.path.join(directory, n, LEGACY_FILE)
    tps = sorted({t for t, _ in out})
    pps = sorted({p for _, p in out})
    if not out or tps != list(range(len(tps))) or pps != list(range(len(pps))) or len(out) != len(tps) * len(pps):
        raise CheckpointError(f"the mp_rank_* files in {directory} do not form a complete TP x PP grid")
    return out


def legacy_head(directory: str) -> dict:
    sd = safe_load(legacy_files(directory)[(0, 0)], mmap=True, where=directory)
    return megatron_head(sd, isinstance(sd.get("optimizer"), dict) and bool(sd["optimizer"].get("state")))


def _param_order(model: dict) -> list:
    """Megatron's optimizer order of a rank's parameters: weight-decayed first, then biases and norms."""
    params = [(k, v) for k, v in model.items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")]
    no_wd = lambda k, v: k.endswith(".bias") or v.ndim == 1  # noqa: E731 (Megatron's default rule)
    return [k for k, v in params if not no_wd(k, v)] + [k for k, v in params if no_wd(k, v)]


class LegacyFiles:
    def __init__(self, directory: str, config):
        self.directory, self.config = directory, config
        if config.num_experts:
            raise CheckpointError(f"{directory} is a legacy checkpoint of a mixture-of-experts model "
                                  "(decoder.layers.N.mlp.experts.local_experts.*), which is not read; save it with "
                                  "--ckpt-format torch_dist, whose expert tensors are")
        paths = legacy_files(directory)
        self.tp = 1 + max(t for t, _ in paths)
        self.pp = 1 + max(p for _, p in paths)
        if config.num_layers % self.pp:
            raise CheckpointError(f"{directory} has {self.pp} pipeline stages, which do not divide this model's "
                                  f"{config.num_layers} layers")
        self.per_stage = config.num_layers // self.pp
        self.sds = {k: safe_load(p, mmap=True, where=p) for k, p in paths.items()}
        head = self.sds[(0, 0)]
        self.head = megatron_head(head, isinstance(head.get("optimizer"), dict) and bool(head["optimizer"].get("state")))
        self.has_optimizer = not self.head.get("weights_only")
        self._check_keys()
        self.index = {}  # (tp, pp) -> {model key: optimizer state index}
        self.step_value = 0
        # --decoupled-lr's param group orders the state otherwise than the two default groups: weights only
        self.decoupled = self.has_optimizer and self.head["args"].get("decoupled_lr") is not None
        if self.has_optimizer and not self.decoupled:
            for (t, p), sd in self.sds.items():
                self.index[(t, p)] = self._optimizer_index(sd, paths[(t, p)])

    def _check_keys(self):
        used = {(t, p): set() for t, p in self.sds}
        for name in param_names(self.config):
            for t in range(self.tp):
                p, key = self._where(name)
                used[(t, p)].add(key)
        for (t, p), sd in self.sds.items():
            extra = [k for k, v in sd["model"].items() if not k.endswith("_extra_state") and k not in used[(t, p)]
                     and not (k == "output_layer.weight" and not self.config.untie_embeddings_and_output_weights)]
            if extra:
                raise CheckpointError(refusal(extra[0], f"the legacy checkpoint {self.directory}"))

    def _optimizer_index(self, sd: dict, path: str) -> dict:
        opt = sd["optimizer"]
        opt = opt.get("optimizer", opt)  # a mixed-precision optimizer nests torch's state dict one level deeper
        order = _param_order(sd["model"])
        ids = [i for g in opt["param_groups"] for i in g["params"]]
        if len(ids) != len(order):
            raise CheckpointError(f"{path} holds optimizer state for {len(ids)} parameters but its model has "
                                  f"{len(order)}; load it with --no-load-optim")
        index = dict(zip(order, ids))
        for key, i in index.items():
            state = opt["state"].get(i, {})
            if "exp_avg" not in state or tuple(state["exp_avg"].shape) != tuple(sd["model"][key].shape):
                raise CheckpointError(f"{path}: the optimizer state's parameter order does not match Megatron's "
                                      f"default groups at {key}; load it with --no-load-optim")
            self.step_value = int(float(state.get("step", 0)))
        return index

    def _where(self, name: str) -> Tuple[int, str]:
        """(pipeline stage, key in that stage's file) of our parameter `name`."""
        key, layer = mcore_key(name, self.config)
        if layer is None:
            first = key.startswith("embedding.")
            return (0 if first else self.pp - 1), key
        p, local = divmod(layer, self.per_stage)
        suffix = key[len(LAYERS):]
        local_key = f"{LAYERS}{local}.{suffix}"
        if suffix in LOCAL_NORMS and local_key not in self.sds[(0, p)]["model"]:
            local_key = f"{LAYERS}{local}.{LOCAL_NORMS[suffix]}"
        return p, local_key

    def _shard(self, t: int, p: int, key: str, which: str) -> torch.Tensor:
        sd = self.sds[(t, p)]
        if which == "fp32":
            return sd["model"][key]
        if self.decoupled:
            raise CheckpointError(f"{self.directory} was trained with --decoupled-lr, whose param group orders "
                                  "Megatron's optimizer state otherwise than its default two; load its weights with "
                                  "--no-load-optim")
        opt = sd["optimizer"].get("optimizer", sd["optimizer"])
        return opt["state"][self.index[(t, p)][key]][which]

    def full(self, name: str, which: str):
        spec = param_spec(name, self.config)
        p, key = self._where(name)
        if key not in self.sds[(0, p)]["model"]:
            raise CheckpointError(f"the legacy checkpoint {self.directory} has no {key} (for our {name})")
        if spec.partition_dim is None:
            t = self._shard(0, p, key, which)
        else:
            shards = [self._shard(tp, p, key, which) for tp in range(self.tp)]
            if spec.sub_params > 1:
                halves = [s.chunk(spec.sub_params, dim=spec.partition_dim) for s in shards]
                t = torch.cat([h[i] for i in range(spec.sub_params) for h in halves], dim=spec.partition_dim)
            else:
                t = torch.cat(shards, dim=spec.partition_dim)
        t = t.float()
        if spec.is_vocab:
            t = t[:spec.full_shape[0]]
        if tuple(t.shape) != spec.full_shape:
            raise CheckpointError(f"{self.directory}: {key} merges to {tuple(t.shape)} but our {name} is "
                                  f"{spec.full_shape} (the flags describe another model)")
        return t, None, spec.sub_params

    def step(self, name: str) -> int:
        return self.step_value

    def optimizer_state(self) -> dict:
        return {}

    def model_states(self, mp_rank: int) -> dict:
        return self.head

    def close(self):
        self.sds.clear()
