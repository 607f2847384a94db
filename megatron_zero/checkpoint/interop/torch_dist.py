"""A Megatron-Core torch_dist checkpoint as full tensors under our parameter names, read with plain torch.

    files = TorchDistFiles(directory, config)     # .metadata and common.pt read; keys checked against the model
    files.full(name, "fp32" | "exp_avg" | "exp_avg_sq") -> (tensor, None, sub_params)
    head = files.model_states(0)                  # args, iteration, scheduler: the client state ours resumes

This is the interface `reshape/universal_load.py:load_from` reads a universal checkpoint through, so a torch_dist
checkpoint loads at any TP x PP x DP and ZeRO stage the same way: every rank reads, for each parameter it holds,
one layer's slice of the stacked tensor (dcp_reader.py), takes its TP slice and its ZeRO fragment. Host memory
is bounded by one layer's tensor (plus the saved chunks it overlaps), never the model.

What is read, and from where:
- weights: the model keys (mcore_names.py), in whichever of Megatron-Core's forms the checkpoint has them
  (stacked, per layer, per expert, GLU halves: mcore_forms.py); experts under their global ids, whatever
  expert-parallel layout wrote them; the fp32 master is `optimizer.state.fp32_param.<key>` where a
  mixed-precision run saved one, else the weight itself (FP32Optimizer: the weights are the masters);
- Adam moments: `optimizer.state.exp_avg.<key>`, `optimizer.state.exp_avg_sq.<key>`; a checkpoint without
  them (saved with --no-save-optim) loads weights only, with fresh moments, as an import does;
- the step: common.pt's optimizer `state.common_step` (or a param group's `step`);
- iteration, args (Megatron-LM's names, which are ours), consumed samples: common.pt. Megatron-LM's
  scheduler counts samples; ours counts iterations, so the schedule resumes at `iteration` steps.
- the vocabulary: Megatron pads it with rows it trains (its loss includes their logits); ours keeps the
  unpadded rows (the tokenizer's vocabulary), so the padded rows are dropped.
common.pt is unpickled through the safe loader: it needs argparse.Namespace (args) and nothing beyond the
allow-list. RNG states restart from the seed (Megatron-LM keeps them in `rng_state` sharded per rank).
"""
from __future__ import annotations

import os

from ...model.params import param_spec
from ..errors import CheckpointError
from ..format import header_args
from ..storage.safe_pickle import RefusedGlobal, safe_load
from .dcp_reader import DcpReader
import torch

from ...model.params import param_names
from .mcore_forms import locate
from .mcore_names import OPTIMIZER_PREFIX, expert_bias_names, mcore_location, refuse_moe_mtp, refusal, unmapped


def read_common(directory: str) -> dict:
    path = os.path.join(directory, "common.pt")
    try:
        common = safe_load(path, where=path)
    except RefusedGlobal:
        raise
    except (OSError, RuntimeError, EOFError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    return common if isinstance(common, dict) else {}


def common_step(common: dict) -> int:
    """The optimizer step Megatron-Core saved in common.pt (0 when none)."""
    opt = common.get("optimizer")
    opts = opt if isinstance(opt, list) else [opt]
    for o in opts:
        if not isinstance(o, dict):
            continue
        state = o.get("optimizer", o)  # a MixedPrecisionOptimizer nests the torch state dict one level deeper
        step = (state.get("state") or {}).get("common_step") if isinstance(state, dict) else None
        if step is None and isinstance(state, dict):
            step = next((g.get("step") for g in state.get("param_groups") or [] if g.get("step") is not None), None)
        if step is not None:
            return int(float(step))
    return 0


def megatron_head(common: dict, has_optimizer: bool = True) -> dict:
    """The client state (our model-states header's keys) a Megatron-LM checkpoint's common state gives."""
    args = header_args(common)
    iteration = int(common.get("iteration", 0) or 0)
    consumed = args.get("consumed_train_samples")
    if consumed is None:
        consumed = iteration * int(args.get("global_batch_size") or 0)
    head = {"args": args, "iteration": iteration, "checkpoint_version": common.get("checkpoint_version"),
            "train_state": {"iteration": iteration, "consumed_train_samples": int(consumed)},
            "consumed_train_samples": int(consumed), "lr_scheduler": {"num_steps": iteration}, "rng_state": None}
    if not has_optimizer:
        head["weights_only"] = True
    return head


class TorchDistFiles:
    def __init__(self, directory: str, config):
        self.directory, self.config = directory, config
        self.reader = DcpReader(directory)
        self.common = read_common(directory)
        where = f"the torch_dist checkpoint {directory}"
        refuse_moe_mtp(config, where)
        self.parts = {}  # our name -> where its weight is (mcore_forms.locate)
        for name in param_names(config):
            key, index = mcore_location(name, config)
            found = locate(self.reader.tensors, key, index, config.num_layers, config.num_experts)
            if found is not None:
                self.parts[name] = found
        known = {f for parts in self.parts.values() for f, _, _ in parts}
        self.buffers = {}  # the routers' expert biases (buffers: the model-states' `module`, model_buffers.py)
        for name in expert_bias_names(config):
            key, index = mcore_location(name, config)
            found = locate(self.reader.tensors, key, index, config.num_layers, config.num_experts)
            if found is not None:  # one a checkpoint lacks keeps its initial zeros
                (fqn, idx, dims), = found
                self.buffers[name] = self._read(fqn, idx, dims, name).reshape(config.num_experts)
                known.add(fqn)
        extra = unmapped(self.reader.tensors, config, known)
        if extra:
            raise CheckpointError(refusal(extra[0], where) + (f" (and {len(extra) - 1} more keys)" if len(extra) > 1
                                                              else ""))
        self.has_optimizer = any(k.startswith(OPTIMIZER_PREFIX + "exp_avg.") for k in self.reader.tensors)
        self.step_value = common_step(self.common)

    def _fqn(self, key: str, which: str) -> str:
        if which == "exp_avg" or which == "exp_avg_sq":
            return f"{OPTIMIZER_PREFIX}{which}.{key}"
        master = f"{OPTIMIZER_PREFIX}fp32_param.{key}"
        return master if master in self.reader.tensors else key

    def _read(self, fqn: str, index, dims, name: str) -> torch.Tensor:
        shape = self.reader.shape(fqn)
        if shape is None:
            raise CheckpointError(f"the torch_dist checkpoint {self.directory} has no {fqn} (for our {name})")
        for saved, want, what, flag in zip(shape[:len(dims)], dims, ("layers", "experts"),
                                           ("--num-layers", "--num-experts")):
            if saved != want:
                raise CheckpointError(f"{self.directory}: {fqn} stacks {saved} {what} but this model has {want} "
                                      f"({flag} differs from the checkpoint's)")
        return self.reader.read(fqn, index).float()

    def full(self, name: str, which: str):
        spec = param_spec(name, self.config)
        parts = self.parts.get(name)
        if parts is None:
            key, _ = mcore_location(name, self.config)
            raise CheckpointError(f"the torch_dist checkpoint {self.directory} has no {self._fqn(key, which)} "
                                  f"(for our {name})")
        t = torch.cat([self._read(self._fqn(f, which), index, dims, name) for f, index, dims in parts])
        fqn = self._fqn(parts[0][0], which)
        if spec.is_vocab:
            if t.shape[0] < spec.full_shape[0]:
                raise CheckpointError(f"{self.directory}: {fqn} has {t.shape[0]} vocabulary rows, fewer than this "
                                      f"run's vocabulary of {spec.full_shape[0]}")
            t = t[:spec.full_shape[0]]  # Megatron's padded rows
        if tuple(t.shape) != spec.full_shape:
            raise CheckpointError(f"{self.directory}: {fqn} is {tuple(t.shape)} per layer but our {name} is "
                                  f"{spec.full_shape} (the flags describe another model)")
        return t, None, spec.sub_params

    def step(self, name: str) -> int:
        return self.step_value

    def optimizer_state(self) -> dict:
        return {}  # no loss scaler to carry over: an FP32 run has none, a mixed-precision one starts its own

    def model_states(self, mp_rank: int) -> dict:
        return {**megatron_head(self.common, self.has_optimizer), "module": dict(self.buffers),
                "buffer_names": list(self.buffers)}

    def close(self):
        pass
