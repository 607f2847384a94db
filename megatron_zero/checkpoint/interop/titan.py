"""torchtitan's Llama checkpoints (torch DCP, `<dump>/checkpoint/step-N/`) to and from our parameters.

    files = TitanFiles(step_dir, config)            # the per-parameter source reshape/universal_load.load_from takes
    write_titan(files, config, step_dir, step)      # any per-parameter source (universal, ZeRO, torch_dist) out

The layout follows torchtitan 0.3.0's code (components/checkpointer/dcp.py, components/optimizer/utils.py,
models/llama3): model tensors at the top level of the DCP state dict, the optimizer flattened by parameter name
(`optimizer.state.<fqn>.exp_avg|exp_avg_sq|step`, `optimizer.param_groups.<fqn>.<key>`), `train_state.step`.

    ours                                 torchtitan (0.3.0; earlier releases' names are read too)
    1.word_embeddings.weight             tok_embeddings.weight
    {i}.input_layernorm.weight           layers.{i-2}.attention_norm.weight
    {i}.self_attention.query_key_value   layers.{i-2}.attention.qkv_linear.wq|wk|wv.weight  (attention.wq|wk|wv)
    {i}.self_attention.dense.weight      layers.{i-2}.attention.wo.weight
    {i}.post_attention_layernorm.weight  layers.{i-2}.ffn_norm.weight
    {i}.mlp.dense_h_to_4h.weight         layers.{i-2}.feed_forward.w1.weight (gate) and w3.weight (up)
    {i}.mlp.dense_4h_to_h.weight         layers.{i-2}.feed_forward.w2.weight
    {L+2}.weight                         norm.weight
    {L+3}.lm_head.weight                 lm_head.weight  (output.weight)

torchtitan's Llama rotates interleaved pairs (ComplexRoPE: Meta's layout); ours rotates halves (Hugging Face's),
so wq and wk rows are permuted per head both ways, exactly as torchtitan's own Hugging Face adapter does, and
the Adam moments with them (they are elementwise). Only the Llama family maps (RMSNorm, RoPE, SwiGLU, no
biases); another architecture is refused in one sentence.
"""
from __future__ import annotations

import warnings
from typing import List, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp

from ...model.layer_indices import block_number, final_norm_index, is_block_index
from ...model.params import lm_head_name, param_names, param_spec, word_embeddings_name
from ..errors import CheckpointError
from .dcp_reader import DcpReader

OLD_NAMES = {"attention.qkv_linear.wq.weight": "attention.wq.weight", "attention.qkv_linear.wk.weight":
             "attention.wk.weight", "attention.qkv_linear.wv.weight": "attention.wv.weight",
             "lm_head.weight": "output.weight"}
SIMPLE = {"input_layernorm.weight": "attention_norm.weight", "self_attention.dense.weight": "attention.wo.weight",
          "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.dense_4h_to_h.weight": "feed_forward.w2.weight"}


def check_llama(config, where: str) -> None:
    if not (config.swiglu and config.normalization == "RMSNorm" and config.position_embedding_type == "rope"
            and not config.add_bias_linear):
        raise CheckpointError(f"{where}: torchtitan's Llama layout holds RMSNorm, RoPE, SwiGLU models without "
                              "biases; this model is not one (--swiglu --normalization RMSNorm "
                              "--position-embedding-type rope --disable-bias-linear)")
    if config.apply_layernorm_1p:
        raise CheckpointError(f"{where}: torchtitan's Llama holds each norm's gamma itself, and this model's norm "
                              "weights are zero-centred (--apply-layernorm-1p); export it to Hugging Face "
                              "(tools/convert_to_hf.py), which writes gamma = 1 + w")


def _to_meta(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Hugging Face's half rotation -> Meta's interleaved pairs (torchtitan's _reverse_permute)."""
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _from_meta(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Meta's interleaved pairs -> Hugging Face's half rotation (torchtitan's _permute)."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def titan_keys(name: str, config) -> List[str]:
    """torchtitan's model keys (0.3.0 names) holding our parameter `name`, in the order they compose it."""
    if name == word_embeddings_name(config):
        return ["tok_embeddings.weight"]
    if name == lm_head_name(config):
        return ["lm_head.weight"]
    index, _, suffix = name.partition(".")
    if index.isdigit() and int(index) == final_norm_index(config.num_layers):
        return ["norm.weight"]
    if index.isdigit() and is_block_index(int(index), config.num_layers):
        layer = f"layers.{block_number(int(index))}."
        if suffix in SIMPLE:
            return [layer + SIMPLE[suffix]]
        if suffix == "self_attention.query_key_value.weight":
            return [layer + f"attention.qkv_linear.w{x}.weight" for x in "qkv"]
        if suffix == "mlp.dense_h_to_4h.weight":
            return [layer + "feed_forward.w1.weight", layer + "feed_forward.w3.weight"]
    raise CheckpointError(f"our parameter {name} has no torchtitan Llama name")


def _split_qkv(full: torch.Tensor, config) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, hd = config.num_query_groups, config.head_dim
    per = config.num_attention_heads // g
    blocks = full.view(g, per + 2, hd, -1)
    q = blocks[:, :per].reshape(g * per * hd, -1)
    return q, blocks[:, per].reshape(g * hd, -1), blocks[:, per + 1].reshape(g * hd, -1)


def _merge_qkv(q, k, v, config) -> torch.Tensor:
    g, hd = config.num_query_groups, config.head_dim
    per = config.num_attention_heads // g
    cols = q.shape[1]
    return torch.cat([q.view(g, per, hd, cols), k.view(g, 1, hd, cols), v.view(g, 1, hd, cols)], dim=1).reshape(-1, cols)


def to_titan(name: str, full: torch.Tensor, config) -> List[torch.Tensor]:
    """Our full tensor (weight or an elementwise moment) as torchtitan's tensors, titan_keys' order."""
    if name.endswith("query_key_value.weight"):
        q, k, v = _split_qkv(full, config)
        return [_to_meta(q, config.num_attention_heads), _to_meta(k, config.num_query_groups), v]
    if name.endswith("dense_h_to_4h.weight"):
        return list(full.chunk(2, dim=0))
    return [full]


def from_titan(name: str, parts: List[torch.Tensor], config) -> torch.Tensor:
    if name.endswith("query_key_value.weight"):
        q, k, v = parts
        return _merge_qkv(_from_meta(q, config.num_attention_heads), _from_meta(k, config.num_query_groups), v, config)
    if name.endswith("dense_h_to_4h.weight"):
        return torch.cat(parts, dim=0)
    return parts[0]


def _state_key(key: str, which: str) -> str:
    return key if which == "fp32" else f"optimizer.state.{key}.{which}"


class TitanFiles:
    def __init__(self, directory: str, config):
        check_llama(config, directory)
        self.directory, self.config = directory, config
        self.reader = DcpReader(directory)
        self.old = "tok_embeddings.weight" in self.reader.tensors and \
            "layers.0.attention.wq.weight" in self.reader.tensors
        used = {k for n in param_names(config) for k in titan_keys(n, config)}
        for key in self.reader.tensors:
            model_key = self._ours(key)
            if not key.startswith(("optimizer.", "train_state.", "lr_scheduler.", "dataloader.")) and model_key not in used:
                raise CheckpointError(f"the torchtitan checkpoint {directory} holds {key}, which no parameter of this "
                                      "model maps to (another architecture, or flags that describe another model)")
        self.has_optimizer = any(k.startswith("optimizer.state.") and k.endswith(".exp_avg") for k in self.reader.tensors)
        step = self.reader.shape("train_state.step")
        self.iteration = int(self.reader.read("train_state.step")) if step is not None else 0

    def _ours(self, key: str) -> str:
        inverse = {v: k for k, v in OLD_NAMES.items()}
        for old, new in inverse.items():
            if key.endswith(old) and self.old:
                return key[:-len(old)] + new
        return key

    def _theirs(self, key: str) -> str:
        if not self.old:
            return key
        for new, old in OLD_NAMES.items():
            if key.endswith(new):
                return key[:-len(new)] + old
        return key

    def full(self, name: str, which: str):
        spec = param_spec(name, self.config)
        parts = []
        for key in titan_keys(name, self.config):
            fqn = _state_key(self._theirs(key), which)
            if self.reader.shape(fqn) is None:
                raise CheckpointError(f"the torchtitan checkpoint {self.directory} has no {fqn} (for our {name})")
            parts.append(self.reader.read(fqn).float())
        t = from_titan(name, parts, self.config)
        if tuple(t.shape) != spec.full_shape:
            raise CheckpointError(f"{self.directory}: our {name} would be {tuple(t.shape)} from its tensors but is "
                                  f"{spec.full_shape} here (the flags describe another model)")
        return t, None, spec.sub_params

    def step(self, name: str) -> int:
        fqn = f"optimizer.state.{self._theirs(titan_keys(name, self.config)[0])}.step"
        return int(float(self.reader.read(fqn))) if self.reader.shape(fqn) is not None else 0

    def optimizer_state(self) -> dict:
        return {}

    def model_states(self, mp_rank: int) -> dict:
        head = {"iteration": self.iteration, "train_state": {"iteration": self.iteration,
                                                             "consumed_train_samples": 0},
                "lr_scheduler": {"num_steps": self.iteration}, "rng_state": None, "args": {}}
        if not self.has_optimizer:
            head["weights_only"] = True
        return head

    def close(self):
        pass


def write_titan(files, config, directory: str, step: int, lr: Optional[float] = None) -> int:
    """torchtitan's step-N directory from a per-parameter source (weights, moments, the Adam step)."""
    check_llama(config, directory)
    state = {}
    for name in param_names(config):
        keys = titan_keys(name, config)
        for which in ("fp32", "exp_avg", "exp_avg_sq"):
            full, _, _ = files.full(name, which)
            for key, t in zip(keys, to_titan(name, full, config)):
                state[_state_key(key, which)] = t.contiguous()
        for key in keys:
            state[f"optimizer.state.{key}.step"] = torch.tensor(float(files.step(name)))
            if lr is not None:
                state[f"optimizer.param_groups.{key}.lr"] = lr
    state["train_state.step"] = torch.tensor(step, dtype=torch.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(directory), no_dist=True)
    return len(param_names(config))
