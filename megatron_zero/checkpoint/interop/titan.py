"""torchtitan's Llama checkpoints (torch DCP, `<dump>/checkpoint/step-N/`) to and from our parameters.

    files = TitanFiles(step_dir, config)            # the per-parameter source reshape/universal_load.load_from takes
    write_titan(files, config, step_dir, step, consumed_samples)   # any per-parameter source out, tensor by tensor

The layout follows torchtitan 0.3.0's code (components/checkpointer/dcp.py, components/optimizer/utils.py,
models/llama3): model tensors at the top level of the DCP state dict, the optimizer flattened by parameter name
(`optimizer.state.<fqn>.exp_avg|exp_avg_sq|step`, `optimizer.param_groups.<fqn>.<key>`), `train_state.step` and
`train_state.ntokens_seen` (ints, saved as bytes). The data position goes as `train_state.consumed_train_samples`
(ours; torchtitan's load reads only the keys it asks for); a checkpoint without it (torchtitan's own) gives
iteration x global batch when the batch is given, said so, as for torch_dist.

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

from typing import List, Optional, Tuple

import torch

from ...model.layer_indices import block_number, final_norm_index, is_block_index
from ...model.params import lm_head_name, param_names, param_spec, word_embeddings_name
from ..errors import CheckpointError
from .dcp_reader import DcpReader
from .dcp_stream import Chunk, object_bytes, save_streamed

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
    def __init__(self, directory: str, config, global_batch_size: Optional[int] = None):
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
        self.iteration = int(self._train_state("step") or 0)
        self.consumed, self.consumed_note = self._consumed(global_batch_size)

    def _train_state(self, key: str):
        """train_state.<key>: torchtitan saves its ints as bytes (earlier writers here: a tensor); None if absent."""
        fqn = f"train_state.{key}"
        if fqn in self.reader.objects:
            return self.reader.read_object(fqn)
        return self.reader.read(fqn).item() if self.reader.shape(fqn) is not None else None

    def _consumed(self, global_batch_size: Optional[int]) -> Tuple[int, str]:
        """(samples consumed, how that number was found): recorded by our writer, else iteration x global batch."""
        recorded = self._train_state("consumed_train_samples")
        if recorded is not None:
            return int(recorded), f"{int(recorded)} samples consumed, as the checkpoint records them"
        if global_batch_size:
            n = self.iteration * global_batch_size
            return n, (f"{n} samples consumed, derived as iteration {self.iteration} x --global-batch-size "
                       f"{global_batch_size} (the checkpoint records no sample count)")
        return 0, ("the checkpoint records no sample count, so a resume starts the data from its beginning; pass "
                   "--global-batch-size to derive it as iteration x global batch")

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
        head = {"iteration": self.iteration, "consumed_train_samples": self.consumed,
                "train_state": {"iteration": self.iteration, "consumed_train_samples": self.consumed},
                "lr_scheduler": {"num_steps": self.iteration}, "rng_state": None, "args": {}}
        if not self.has_optimizer:
            head["weights_only"] = True
        return head

    def close(self):
        pass


def titan_chunks(config) -> List[Tuple[str, str, int, Chunk]]:
    """(our name, which state, part, the DCP chunk) for every tensor torchtitan's layout holds, from shapes alone."""
    out = []
    for name in param_names(config):
        meta = torch.empty(param_spec(name, config).full_shape, device="meta")
        shapes = [tuple(t.shape) for t in to_titan(name, meta, config)]
        for which in ("fp32", "exp_avg", "exp_avg_sq"):
            for part, (key, shape) in enumerate(zip(titan_keys(name, config), shapes)):
                out.append((name, which, part, Chunk(_state_key(key, which), (), shape)))
    return out


def write_titan(files, config, directory: str, step: int, consumed_samples: int = 0, progress=None) -> int:
    """torchtitan's step-N directory from a per-parameter source (weights, moments, the Adam step), streamed one
    tensor at a time (dcp_stream.py). train_state holds torchtitan's `step` and `ntokens_seen` (the run's tokens,
    consumed samples x sequence length) and our `consumed_train_samples`, which torchtitan's load ignores."""
    check_llama(config, directory)
    chunks, steps = titan_chunks(config), {}
    where = {c.fqn: (name, which, part) for name, which, part, c in chunks}
    for name in param_names(config):
        for key in titan_keys(name, config):
            fqn = f"optimizer.state.{key}.step"
            where[fqn] = (name, "step", 0)
            chunks.append((name, "step", 0, Chunk(fqn, (), ())))
    held = {}  # the parts of the one full tensor being written, each dropped once written

    def produce(fqn, index):
        name, which, part = where[fqn]
        if which == "step":
            if name not in steps:
                steps[name] = float(files.step(name))
            return torch.tensor(steps[name])
        if (name, which) not in held:
            held.clear()
            full, _, _ = files.full(name, which)
            held[(name, which)] = dict(enumerate(t.contiguous() for t in to_titan(name, full, config)))
            del full
        return held[(name, which)].pop(part)

    blobs = {"train_state.step": object_bytes(int(step)),
             "train_state.ntokens_seen": object_bytes(int(consumed_samples) * config.seq_length),
             "train_state.consumed_train_samples": object_bytes(int(consumed_samples))}
    def on_written(fqn, nbytes):
        if progress is not None and not fqn.endswith(".step"):  # the weights and moments are what is counted
            progress.update(1, nbytes)

    save_streamed(directory, [c for *_, c in chunks], blobs, produce, on_written)
    return len(param_names(config))
