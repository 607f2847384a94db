"""Our checkpoint (universal, or a ZeRO checkpoint at any layout) written as a Megatron-Core torch_dist checkpoint.

    summary = write_torch_dist(source, out, target_tp=1)   # source: a ZeRO checkpoint or universal directory

`<out>/latest_checkpointed_iteration.txt` and `<out>/iter_{N:07d}/`: `.metadata` and `__0_0.distcp` written with
torch.distributed.checkpoint's FileSystemWriter, `common.pt` (Megatron-LM's args, iteration, the optimizer step)
and `metadata.json`, which is what Megatron-Core's `dist_checkpointing.load` (and Megatron-LM's `--load` with
`--ckpt-format torch_dist`) reads at any TP. Names and layouts are mcore_names.py's; each transformer layer is
one chunk of the stacked `decoder.layers.*` tensor, as Megatron-Core writes them, so the writer holds one
layer's tensor at a time (one expert's, for an MoE layer's experts): the save plan is made from shapes alone
and each chunk is read from the source when the writer asks for it, then dropped (dcp_stream.py). An output
holding a newer iteration, or a megatron_zero save directory, is refused unless forced (output_guard.py). The vocabulary is
padded with zero rows to make_vocab_size_divisible_by x `target_tp` (Megatron's rule; the padded size goes into
the args). Adam's moments go in as `optimizer.state.exp_avg|exp_avg_sq.<key>` and the step as
`optimizer.state.common_step` (FP32Optimizer's layout). MoE blocks: the router (and its expert bias,
`mlp.router.expert_bias` [L, E], a buffer: no moments), each expert
(`mlp.experts.experts.linear_fc1.weight` [L, E, ...], one chunk per layer and expert, under global ids:
Megatron-Core loads it at any EP) and the shared expert; dense and MoE blocks mixed (--moe-layer-freq N > 1)
are saved one key per layer (`decoder.layers.<i>.*`), as Megatron-Core's TransformerBlock saves them. The
linear layers' `_extra_state` (None, Megatron-Core's local layers) is written per layer (and expert), since
Megatron-Core's default strictness expects every key its model asks for.
"""
from __future__ import annotations

import io
import json
import os
import time
from argparse import Namespace

import torch

from ...model.architecture import gpt_config, model_settings
from ...model.params import param_names, param_spec
from ..errors import CheckpointError
from ..format import LATEST_ITERATION, STATE_KEYS, UNIVERSAL_CHECKPOINT_INFO, header_args
from ..model_buffers import saved_buffers
from ..reshape.universal_load import ReshapedFiles, UniversalFiles, find_universal_dir
from ..progress import Progress
from ..storage.reader import open_directory
from .dcp_stream import Chunk, save_streamed
from .mcore_names import EXPERTS, LAYERS, OPTIMIZER_PREFIX, expert_bias_names, mcore_location, refuse_moe_mtp
from .output_guard import check_output
from ..storage.commit import checkpoint_in

ATTENTION_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj")
DENSE_LINEARS = ("mlp.linear_fc1", "mlp.linear_fc2")
MOE_LINEARS = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
EXPERT_LINEARS = (EXPERTS + "linear_fc1", EXPERTS + "linear_fc2")
MCORE_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                  "common_backend_version": 1}


def open_source(path: str, verify: bool = True):
    """(per-parameter source, header) of a universal checkpoint or a ZeRO checkpoint directory."""
    universal = find_universal_dir(path)
    files = (UniversalFiles(open_directory(universal, verify)) if universal else
             ReshapedFiles(open_directory(checkpoint_in(path), verify)))
    head = files.model_states(0) or {}
    return files, head


def source_config(head: dict, where: str):
    args = header_args(head)
    info = head.get(UNIVERSAL_CHECKPOINT_INFO) or {}
    vocab = info.get("original_vocab_size")
    if not args.get("num_layers") or vocab is None:
        raise CheckpointError(f"{where} records no model args or original vocabulary size "
                              "(universal_checkpoint_info), so the model it holds is unknown")
    settings = {k: v for k, v in model_settings(args).items() if v is not None}
    return gpt_config({**args, **settings}, int(vocab)), args


def megatron_args(config, args: dict, target_tp: int) -> Namespace:
    """Megatron-LM's args for common.pt: the model's settings in its names, at `target_tp`."""
    c = config
    return Namespace(**{**{k: v for k, v in args.items() if isinstance(v, (int, float, str, bool, type(None)))},
                        "num_layers": c.num_layers, "hidden_size": c.hidden_size,
                        "num_attention_heads": c.num_attention_heads, "ffn_hidden_size": c.ffn_hidden_size,
                        "num_query_groups": c.num_query_groups,
                        "group_query_attention": c.num_query_groups != c.num_attention_heads,
                        "seq_length": c.seq_length, "max_position_embeddings": c.max_position_embeddings,
                        "normalization": c.normalization, "apply_layernorm_1p": c.apply_layernorm_1p,
                        "position_embedding_type": c.position_embedding_type,
                        "swiglu": c.swiglu, "add_bias_linear": c.add_bias_linear,
                        "untie_embeddings_and_output_weights": c.untie_embeddings_and_output_weights,
                        "rotary_base": c.rotary_base, "rotary_percent": c.rotary_percent,
                        "norm_epsilon": c.layernorm_epsilon, "layernorm_epsilon": c.layernorm_epsilon,
                        "make_vocab_size_divisible_by": c.make_vocab_size_divisible_by,
                        "padded_vocab_size": c.padded_vocab_size(target_tp),
                        "tensor_model_parallel_size": target_tp, "pipeline_model_parallel_size": 1,
                        "ckpt_format": "torch_dist", **moe_args(c)})


def moe_args(config) -> dict:
    """Megatron-LM's MoE args: its --moe-layer-freq counts from layer 0, so another first MoE layer is a list."""
    c = config
    if not c.num_experts:
        return {"num_experts": None}
    freq = c.moe_layer_freq if isinstance(c.moe_layer_freq, int) and c.moe_layer_offset == 0 else \
        [int(c.is_moe_layer(i)) for i in range(c.num_layers)]
    return {"num_experts": c.num_experts, "moe_layer_freq": freq, "moe_ffn_hidden_size": c.moe_ffn_hidden_size,
            "moe_router_topk": c.moe_router_topk,
            "moe_shared_expert_intermediate_size": c.moe_shared_expert_intermediate_size,
            "moe_shared_expert_gate": c.moe_shared_expert_gate, "expert_model_parallel_size": 1}


def per_layer(config) -> bool:
    """Whether Megatron-Core saves this model's blocks one key per layer (`decoder.layers.<i>.*`): dense and MoE
    blocks mixed (its TransformerBlock's non-homogeneous layers: --moe-layer-freq other than 1), else stacked."""
    return bool(config.num_experts) and config.moe_layer_freq != 1


def saved_location(name: str, config, shape: tuple):
    """(key, index, global size) under which Megatron-Core saves our parameter `name` of full shape `shape`."""
    key, index = mcore_location(name, config)
    lead = (config.num_layers, config.num_experts)[:len(index)]
    if index and per_layer(config):
        key, index, lead = f"{LAYERS}{index[0]}.{key[len(LAYERS):]}", index[1:], lead[1:]
    return key, index, tuple(lead) + shape


def extra_state_keys(config) -> list:
    """The `_extra_state` objects Megatron-Core's local linear layers save (each a ShardedObject key)."""
    L, E, out = config.num_layers, config.num_experts, []
    for layer in range(L):
        moe = config.is_moe_layer(layer)
        linears = ATTENTION_LINEARS + ((MOE_LINEARS[:2] if config.moe_shared_expert_intermediate_size else ())
                                       if moe else DENSE_LINEARS)
        for linear in linears:
            out.append(f"{LAYERS}{layer}.{linear}._extra_state/shard_0_1" if per_layer(config)
                       else f"{LAYERS}{linear}._extra_state/shard_{layer}_{L}")
        for linear in (EXPERT_LINEARS if moe else ()):
            for e in range(E):
                out.append(f"{LAYERS}{layer}.{linear}._extra_state/shard_{e}_{E}" if per_layer(config)
                           else f"{LAYERS}{linear}._extra_state/shard_{layer}.{e}_{L}.{E}")
    return out


def write_torch_dist(source: str, out: str, target_tp: int = 1, verify: bool = True, force: bool = False,
                     progress: bool = False) -> dict:
    start = time.monotonic()
    files, head = open_source(source, verify)
    config, args = source_config(head, source)
    refuse_moe_mtp(config, source)
    config.check_tp(target_tp)
    iteration = int(head.get("iteration", 0) or 0)
    check_output("torch_dist", out, iteration, force)
    directory = os.path.join(out, f"iter_{iteration:07d}")
    if os.path.exists(directory):
        raise CheckpointError(f"{directory} already exists; choose another --output or remove it")
    names = param_names(config)
    padded = config.padded_vocab_size(target_tp)
    by_key, chunks, total = {}, [], 0  # (fqn, index) -> our name; every saved chunk; their bytes
    for name in names:
        spec = param_spec(name, config)
        shape = (padded,) + spec.full_shape[1:] if spec.is_vocab else spec.full_shape
        fqn, index, size = saved_location(name, config, tuple(shape))
        by_key[(fqn, index)] = name
        for prefix in ("", f"{OPTIMIZER_PREFIX}exp_avg.", f"{OPTIMIZER_PREFIX}exp_avg_sq."):
            chunks.append(Chunk(prefix + fqn, index, size))
            total += 4 * torch.Size(shape).numel()
    biases = saved_buffers(files.model_states)  # the routers' expert biases: no moments
    for name in expert_bias_names(config):
        if name not in biases:
            raise CheckpointError(f"{source} has no {name} in its model-states files, though its args say "
                                  "--moe-router-enable-expert-bias; it was not written by this trainer")
        fqn, index, size = saved_location(name, config, (config.num_experts,))
        by_key[(fqn, index)] = name
        chunks.append(Chunk(fqn, index, size))
    blobs = {}
    buf = io.BytesIO()
    torch.save([None], buf)  # what Megatron-Core writes for a local linear layer (a list of its replicas)
    for key in extra_state_keys(config):
        blobs[key] = buf.getvalue()
    step = [0]

    def produce(fqn, index):
        which = "fp32"
        for k in STATE_KEYS[1:]:
            if fqn.startswith(f"{OPTIMIZER_PREFIX}{k}."):
                which, fqn = k, fqn[len(f"{OPTIMIZER_PREFIX}{k}."):]
        name = by_key[(fqn, index)]
        if name in biases:
            return biases[name].float().reshape((1,) * len(index) + (config.num_experts,))
        full, _, _ = files.full(name, which)
        step[0] = files.step(name)
        if param_spec(name, config).is_vocab and full.shape[0] < padded:
            full = torch.cat([full, full.new_zeros((padded - full.shape[0],) + tuple(full.shape[1:]))])
        return full.float().reshape((1,) * len(index) + tuple(full.shape))

    bar = Progress("convert_checkpoint", len(chunks), progress, total_bytes=total)
    os.makedirs(directory)
    try:
        save_streamed(directory, chunks, blobs, produce, lambda fqn, n: bar.update(1, n))
    finally:
        bar.close()
        files.close()
    common = {"args": megatron_args(config, args, target_tp), "iteration": iteration, "checkpoint_version": 3.0,
              "optimizer": {"state": {"common_step": torch.tensor(float(step[0]))},
                            "param_groups": []},
              "num_floating_point_operations_so_far": 0}
    torch.save(common, os.path.join(directory, "common.pt"))
    with open(os.path.join(directory, "metadata.json"), "w") as f:
        json.dump(MCORE_METADATA, f)
    with open(os.path.join(out, LATEST_ITERATION), "w") as f:
        f.write(str(iteration))
    return {"params": len(names), "iteration": iteration, "directory": directory, "tensors": bar.done,
            "bytes": sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)),
            "seconds": time.monotonic() - start}
