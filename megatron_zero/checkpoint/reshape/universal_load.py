"""Load a universal checkpoint, or a plain ZeRO checkpoint of another layout, into any TP x PP x DP and ZeRO stage.

    client = load_universal_checkpoint(path, state, model, optimizer)   # path: <out> or its parent (latest_universal)
    client = load_reshaped_checkpoint(ckpt_dir, state, model, optimizer)  # a ZeRO checkpoint directory, any layout

For every parameter this rank's model holds: read its full (unpadded) fp32 master and both
Adam moments, re-pad the vocabulary (padded rows are never trained, so zeros are exact),
take this TP rank's slice on the dimension its layer type gives (model/params.py; SwiGLU's
[gate; up] block by block), and
narrow to this rank's ZeRO fragment. The split dimension recorded in the file must agree.
A reshaped load reads the source's optimizer files memory-mapped, so each rank touches only
the fragments of the parameters its stage holds. The client state (iteration, scheduler,
consumed samples, args) is returned. RNG states: when the source had the same TP x PP, this
rank gets the state saved by its own DP rank, or DP rank 0's where the source had fewer DP
ranks (every DP replica of a model-parallel rank is seeded alike); at another TP x PP it keeps
its seeded state (an RNG stream of another TP or PP rank would mean nothing here).
"""
from __future__ import annotations

import os
from typing import Dict, Optional

import torch

from ...model.params import param_spec
from ...model.sharding import shard_tensor
from ...zero.universal_state import set_state_from_params
from ..errors import CheckpointError
from ..format import LATEST_UNIVERSAL, STATE_KEYS, SUB_PARAMS_KEY, header_tp_pp, model_states_name, rank_rng_state
from ..megatron_deepspeed import client_from_megatron_deepspeed, is_megatron_deepspeed_client
from ..model_buffers import restore_buffers, saved_buffers
from ..storage.reader import Checkpoint, open_directory
from .universal_source import SourceCheckpoint



def find_universal_dir(path: str) -> Optional[str]:
    """The universal checkpoint directory `path` is or names (via latest_universal), else None."""
    if os.path.isfile(os.path.join(path, "zero", "optimizer_state.pt")):
        return path
    latest = os.path.join(path, LATEST_UNIVERSAL)
    if os.path.isfile(latest):
        with open(latest, "rb") as f:
            raw = f.read(4096)
        try:
            tag = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise CheckpointError(f"{latest} holds {len(raw)} bytes that are not UTF-8 text; it should hold the name "
                                  "of the universal checkpoint directory beside it") from None
        candidate = os.path.join(path, tag)
        if os.path.isfile(os.path.join(candidate, "zero", "optimizer_state.pt")):
            return candidate
        raise CheckpointError(f"{latest} names {tag!r} but {candidate}/zero/optimizer_state.pt does not exist")
    return None


class UniversalFiles:
    """Full tensors from `<dir>/zero/<name>/<key>.pt` of an opened universal checkpoint, each verified as it is
    read."""

    def __init__(self, files: Checkpoint):
        self.directory, self.files = files.directory, files

    def full(self, name: str, key: str):
        rel = f"zero/{name}/{key}.pt"
        if not self.files.has(rel):
            raise CheckpointError(f"the universal checkpoint {self.directory} has no {key} for parameter {name} "
                                  f"({self.files.path(rel)} is missing): it was written for another model")
        record = self.files.load(rel)
        return record["param"], record.get("cat_dim"), int(record.get(SUB_PARAMS_KEY, 1))

    def step(self, name: str) -> int:
        rel = f"zero/{name}/step.pt"
        return int(float(self.files.load(rel, mmap=False))) if self.files.has(rel) else 0

    def optimizer_state(self) -> dict:
        return self.files.load("zero/optimizer_state.pt", mmap=False)

    def model_states(self, mp_rank: int) -> Optional[dict]:
        for rel in (f"mp_rank_{mp_rank:02d}_model_states.pt",  # converted from ZeRO 0-2, or a ZeRO-3 source:
                    f"zero_pp_rank_0_mp_rank_{mp_rank:02d}_model_states.pt"):
            if self.files.has(rel):
                return self.files.load(rel, mmap=False)
        return None

    def close(self):
        pass


def source_model_states(src: SourceCheckpoint, mp_rank: int) -> Optional[dict]:
    """The model-states file of model-parallel rank `mp_rank` of a ZeRO checkpoint (DP rank 0's at ZeRO-3), or None."""
    name = src.model_files.get(mp_rank)
    if name is None and src.files.has(model_states_name(mp_rank, 3, 0)):  # a ZeRO-3 source
        name = model_states_name(mp_rank, 3, 0)
    return src.files.load(name, mmap=False) if name else None


class ReshapedFiles:
    """Full tensors assembled on the fly from a plain ZeRO checkpoint's optimizer files."""

    def __init__(self, files: Checkpoint):
        self.src = SourceCheckpoint(files.directory, files=files)
        self.directory = files.directory
        self.stage_of = dict(self.src.params)
        self.readers = {}

    def _reader(self, name: str):
        if name not in self.stage_of:
            raise CheckpointError(f"the checkpoint {self.directory} holds no parameter {name}: it was written for "
                                  "another model")
        pp = self.stage_of[name]
        if pp not in self.readers:
            self.readers[pp] = self.src.stage(pp)
        return self.readers[pp]

    def full(self, name: str, key: str):
        t, rule = self._reader(name).assemble(name, key)
        return t, rule.cat_dim, rule.sub_params

    def step(self, name: str) -> int:
        s = self._reader(name).step(name)
        return int(float(s)) if s is not None else 0

    def optimizer_state(self) -> dict:
        if self.src.dense is not None:  # no ZeRO optimizer: no loss scaler saved
            return {}
        sd = self.src.files.load(self.src.zero_files[(0, 0)])["optimizer_state_dict"]
        return {"loss_scaler": sd.get("loss_scaler")}

    def model_states(self, mp_rank: int) -> Optional[dict]:
        return source_model_states(self.src, mp_rank)

    def close(self):
        for r in self.readers.values():
            r.close()
        mismatched = [m for r in self.readers.values() for m in r.mismatched]
        self.readers.clear()
        if mismatched:
            raise CheckpointError(f"TP-replicated parameters differ across TP ranks in {self.directory}: "
                                  f"{', '.join(mismatched)}")


def _local_tensors(files, name: str, config, tp: int, tp_rank: int, keys=STATE_KEYS) -> Dict[str, torch.Tensor]:
    spec = param_spec(name, config)
    out = {}
    for key in keys:
        full, cat_dim, sub_params = files.full(name, key)
        if cat_dim is not None and spec.partition_dim is not None and cat_dim != spec.partition_dim:
            raise CheckpointError(f"{files.directory} records cat_dim {cat_dim} for {name} but its layer type splits "
                                  f"on dim {spec.partition_dim}; the file was converted with a wrong merge rule")
        if spec.partition_dim is not None and sub_params != spec.sub_params:
            raise CheckpointError(f"{files.directory} holds {name} as {sub_params} sub-parameter(s) but this model's "
                                  f"has {spec.sub_params} (--swiglu differs between the checkpoint and this run)")
        try:
            out[key] = shard_tensor(full.float(), spec, config, tp, tp_rank)
        except ValueError as e:
            raise CheckpointError(f"cannot load {name} from {files.directory}: {e}") from e
    return out


def load_from(files, state, model, optimizer, load_optimizer: bool = True) -> dict:
    config, tp, tp_rank = model.config, state.tp_size, state.tp_rank
    try:
        head = files.model_states(state.mp_rank) or files.model_states(0) or {}
        load_optimizer = load_optimizer and not head.get("weights_only")  # e.g. an import from Hugging Face
        names = [n for g in optimizer.named_groups for n, _ in g]
        step = files.step(names[0]) if names else 0
        local = lambda name: _local_tensors(files, name, config, tp, tp_rank)  # noqa: E731
        if load_optimizer:
            set_state_from_params(optimizer, local, step)
            scaler = files.optimizer_state().get("loss_scaler")
            if scaler is not None:  # our dict, or DeepSpeed's LossScaler object (a stand-in)
                optimizer.loss_scaler.load_state_dict(scaler)
        else:  # weights only: masters from fp32, moments and step zero
            def weights(n):
                fp32 = _local_tensors(files, n, config, tp, tp_rank, ("fp32",))["fp32"]
                return {"fp32": fp32, "exp_avg": torch.zeros_like(fp32), "exp_avg_sq": torch.zeros_like(fp32)}
            set_state_from_params(optimizer, weights, 0)
        restore_buffers(model, saved_buffers(files.model_states), files.directory)
    finally:
        files.close()
    client = {k: v for k, v in head.items() if k not in ("module", "param_shapes", "optimizer")}
    same_tp_pp = header_tp_pp(head) == (state.tp_size, state.pp_size)
    client["rng_state"] = rank_rng_state(client.get("rng_state"), state.dp_rank) if same_tp_pp else None
    return client_from_megatron_deepspeed(client) if is_megatron_deepspeed_client(client) else client


def require_universal_dir(path: str) -> str:
    """find_universal_dir, or one sentence saying `path` is no universal checkpoint."""
    directory = find_universal_dir(path)
    if directory is None:
        raise CheckpointError(f"{path} is not a universal checkpoint: it has neither zero/optimizer_state.pt nor "
                              f"a {LATEST_UNIVERSAL} file; convert it with tools/ds_to_universal.py")
    return directory


def load_universal_checkpoint(path: str, state, model, optimizer, load_optimizer: bool = True,
                              verify: bool = True, checkpoint: Optional[Checkpoint] = None) -> dict:
    """`checkpoint`: the universal directory opened already (then `path` is not read)."""
    files = checkpoint if checkpoint is not None else open_directory(require_universal_dir(path), verify)
    return load_from(UniversalFiles(files), state, model, optimizer, load_optimizer)


def load_reshaped_checkpoint(ckpt_dir: str, state, model, optimizer, load_optimizer: bool = True,
                             verify: bool = True, checkpoint: Optional[Checkpoint] = None) -> dict:
    """Resume a plain ZeRO checkpoint (any TP/PP/DP/stage) directly into this layout; `checkpoint`: the
    directory opened already."""
    files = checkpoint if checkpoint is not None else open_directory(ckpt_dir, verify)
    return load_from(ReshapedFiles(files), state, model, optimizer, load_optimizer)
