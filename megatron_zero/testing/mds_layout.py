"""Megatron-DeepSpeed checkpoints built from the format, for tests that need no Megatron-DeepSpeed install.

    write_mds_checkpoint(directory, config, full, kind)   # full: {our name: (fp32, exp_avg, exp_avg_sq)}

kinds, as Megatron-DeepSpeed 0.19-era writes them (checked against files its pretrain_gpt.py saved):
  "module_zero1_dp2"     --no-pipeline-parallel, DP 2, ZeRO-1: weights nested in mp_rank_00's `module`, ZeRO
                         files naming parameters language_model.*, DeepSpeed's fragment_address / LossScaler
  "module_dense_tp2"     --no-pipeline-parallel, TP 2, ZeRO stage 0: mp_rank_{00,01} with `module` and a torch
                         Adam state_dict in `optimizer` (per parameter index, Megatron's param groups)
  "pipeline_dense_pp2"   the pipeline engine, PP 2, ZeRO stage 0: layer files, `module` None, `optimizer` per stage
Every fused QKV is written in Megatron-DeepSpeed's order, [Q; K; V] per TP rank; args hold Megatron's ModelType.
"""
from __future__ import annotations

import argparse
import os
from collections import OrderedDict

import torch

from ..checkpoint.deepspeed_layout import EMBED_PREFIX, layer_of
from ..checkpoint.megatron_deepspeed import QKV_SUFFIXES, module_name_from_ours, nest_module, qkv_from_ours
from ..checkpoint.storage.safe_pickle import LossScaler, ModelType, fragment_address
from ..checkpoint.storage.tensor_io import save_file
from ..model.params import param_names, param_spec
from ..model.sharding import shard_tensor
from ..pipeline.partition import stage_layer_ranges
from ..zero.partition import partition_group

KINDS = {"module_zero1_dp2": (1, 1, 2), "module_dense_tp2": (2, 1, 1), "pipeline_dense_pp2": (1, 2, 1)}
ITERATION, GBS = 6, 16


def mds_args(config, tp: int, pp: int, gbs: int = GBS) -> argparse.Namespace:
    return argparse.Namespace(
        num_layers=config.num_layers, hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads, seq_length=config.seq_length,
        max_position_embeddings=config.max_position_embeddings, ffn_hidden_size=config.ffn_hidden_size,
        make_vocab_size_divisible_by=config.make_vocab_size_divisible_by, padded_vocab_size=config.padded_vocab_size(tp),
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, normalization="layernorm",
        untie_embeddings_and_output_weights=False, consumed_train_samples=ITERATION * gbs, global_batch_size=gbs,
        model_type=ModelType.encoder_or_decoder, params_dtype=torch.float32)


def _local(full, name, config, tp, rank, heads, groups):
    t = shard_tensor(full, param_spec(name, config), config, tp, rank)
    return qkv_from_ours(t, heads // tp, groups // tp) if name.endswith(QKV_SUFFIXES) else t


def _groups(names, shapes):
    no_wd = [n for n in names if n.endswith(".bias") or len(shapes[n]) == 1]
    return [g for g in ([n for n in names if n not in no_wd], no_wd) if g]


def _header(config, tp, pp, dp, stage, gbs=GBS):
    return {"buffer_names": [], "frozen_param_shapes": None, "frozen_param_fragments": None,
            "lr_scheduler": {"max_lr": 1e-3, "lr_warmup_steps": 2 * GBS, "lr_warmup_tokens": None,
                             "num_steps": ITERATION * GBS, "num_tokens": (ITERATION - 1) * GBS * config.seq_length,
                             "lr_decay_style": "linear", "lr_decay_steps": 20 * GBS, "lr_decay_tokens": None,
                             "min_lr": 1e-4, "start_wd": 0.0, "end_wd": 0.0, "wd_incr_style": "constant",
                             "wd_incr_steps": 7 * GBS},
            "data_sampler": None, "random_ltd": None, "skipped_steps": 0, "global_steps": ITERATION,
            "global_samples": ITERATION * GBS, "dp_world_size": dp, "mp_world_size": tp * pp,
            "checkpoint_parallel_dimensions": {"pp_degree": pp, "tp_degree": tp},
            "ds_config": {"zero_optimization": {"stage": stage}}, "ds_version": "0.19.8",
            "universal_checkpoint_info": {"universal_checkpoint_version": 0.4,
                                          "original_vocab_size": config.vocab_size,
                                          "padded_vocab_size": config.padded_vocab_size(tp)},
            "args": mds_args(config, tp, pp, gbs), "checkpoint_version": 3.0, "iteration": ITERATION,
            "tokens": ITERATION * GBS * config.seq_length,
            "rng_state": [{"random_rng_state": (3, tuple(range(625)), None), "torch_rng_state": torch.get_rng_state(),
                           "cuda_rng_state": torch.get_rng_state(),
                           "rng_tracker_states": {"model-parallel-rng": torch.get_rng_state()}}]}


def _adam(group_names, locals_, step):
    state, groups, index = {}, [], 0
    for g, names in enumerate(group_names):
        ids = []
        for n in names:
            _, m, v = locals_[n]
            state[index] = {"step": torch.tensor(float(step)), "exp_avg": m, "exp_avg_sq": v}
            ids.append(index)
            index += 1
        groups.append({"name": ("wd_no_scale_lr", "no_wd_no_scale_lr")[g], "wd_mult": float(g == 0), "lr_mult": 1.0,
                       "lr": 8e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": ids})
    return {"state": state, "param_groups": groups}


def write_mds_checkpoint(directory: str, config, full: dict, kind: str, gbs: int = GBS) -> str:
    """Write one Megatron-DeepSpeed checkpoint of `kind` holding `full` (our names, full unpadded tensors) at
    global_step6 under `directory`, trained with global batch `gbs`; returns the checkpoint's directory."""
    tp, pp, dp = KINDS[kind]
    heads = config.num_attention_heads
    groups = config.num_query_groups or heads
    tag = os.path.join(directory, f"global_step{ITERATION}")
    os.makedirs(tag, exist_ok=True)
    with open(os.path.join(directory, "latest"), "w") as f:
        f.write(f"global_step{ITERATION}")
    if kind.startswith("module"):
        names = param_names(config)
        for rank in range(tp):
            loc = {n: tuple(_local(t, n, config, tp, rank, heads, groups) for t in full[n]) for n in names}
            head = _header(config, tp, 1, dp, 1 if dp > 1 else 0, gbs)
            head["module"] = nest_module(OrderedDict((module_name_from_ours(n, config.num_layers), loc[n][0])
                                                     for n in names))
            grouped = _groups(names, {n: loc[n][0].shape for n in names})
            if dp == 1:
                head.update(optimizer=_adam(grouped, loc, ITERATION), param_shapes=None, shared_params=None)
            else:
                mds = lambda n: module_name_from_ours(n, config.num_layers)  # noqa: E731
                head.update(optimizer=None, shared_params={}, param_shapes=[
                    OrderedDict((mds(n), loc[n][0].shape) for n in g) for g in grouped])
                parts = [partition_group([(n, loc[n][0].numel()) for n in g], dp) for g in grouped]
                for d in range(dp):
                    flat = [[torch.cat([loc[n][k].reshape(-1) for n in g] +
                                       [torch.zeros(p.padded_numel - p.numel)])[slice(*p.bounds(d))]
                             for g, p in zip(grouped, parts)] for k in range(3)]
                    osd = {"loss_scaler": LossScaler(cur_scale=1.0, dynamic=False), "dynamic_loss_scale": False,
                           "overflow": False, "clip_grad": 1.0, "zero_stage": 1, "ds_version": "0.19.8",
                           "base_optimizer_state": {"state": {g: {"step": torch.tensor(float(ITERATION)),
                                                                  "exp_avg": flat[1][g], "exp_avg_sq": flat[2][g]}
                                                              for g in range(len(grouped))},
                                                    "param_groups": [{**grp, "params": [g]} for g, grp in enumerate(
                                                        _adam(grouped, loc, 0)["param_groups"])]},
                           "single_partition_of_fp32_groups": [x[:p.partition_size - p.padding(d)]
                                                               for x, p in zip(flat[0], parts)],
                           "group_paddings": [p.padding(d) for p in parts], "partition_count": [dp] * len(parts),
                           "param_slice_mappings": [OrderedDict((mds(n), fragment_address(numel=f.numel, start=f.start))
                                                                for n, f in p.fragments(d).items()) for p in parts]}
                    save_file({"optimizer_state_dict": osd, "ds_config": head["ds_config"], "ds_version": "0.19.8"},
                              os.path.join(tag, f"zero_pp_rank_{d}_mp_rank_{rank:02d}_optim_states.pt"), fsync=False)
            save_file(head, os.path.join(tag, f"mp_rank_{rank:02d}_model_states.pt"), fsync=False)
        return tag
    for s, (start, end) in enumerate(stage_layer_ranges(config.num_layers, pp)):
        names = param_names(config, range(start, end))
        loc = {n: tuple(_local(t, n, config, 1, 0, heads, groups) for t in full[n]) for n in names}
        head = _header(config, 1, pp, 1, 0, gbs)
        head.update(module=None, param_shapes=None, shared_params=None,
                    optimizer=_adam(_groups(names, {n: loc[n][0].shape for n in names}), loc, ITERATION))
        save_file(head, os.path.join(tag, f"mp_rank_{s:02d}_model_states.pt"), fsync=False)
        for index in range(max(start, 1), end):
            layer = OrderedDict()
            for n in names:
                i, local = layer_of(n)
                if i == index and not (s > 0 and n.startswith(EMBED_PREFIX)):
                    layer[local] = loc[n][0]
            if layer:
                save_file(layer, os.path.join(tag, f"layer_{index:02d}-model_00-model_states.pt"), fsync=False)
    return tag


def save_both_layouts(tp: int, pp: int, stage: int, ours_dir: str, mds_dir: str) -> None:
    """(On gloo ranks) train a tiny GPT two steps at TP x PP (DP the rest) and ZeRO `stage`, then save the same
    state twice: in our layout to ours_dir, with megatron_deepspeed=True to mds_dir (both at iteration 2)."""
    import torch.distributed as dist

    from ..checkpoint import save_checkpoint
    from ..checkpoint.resume import resume_checkpoint
    from ..pipeline.gpt_stage import activation_shape, build_gpt_stage, make_forward_step, sync_tied_embedding_grads
    from ..pipeline.p2p import P2P
    from ..pipeline.schedule import forward_backward
    from ..tensor_parallel.rng_state import get_rng_state
    from ..tensor_parallel.random import model_parallel_seed
    from ..distributed.topology import build_parallel_state
    from ..training.trainer import param_groups
    from ..zero import ZeroOptimizer
    from .layout_train import global_batch
    from .tiny_gpt import tiny_gpt_config

    state = build_parallel_state(tp=tp, pp=pp)
    model_parallel_seed(1234, state.tp_rank, state.pp_rank)
    cfg = tiny_gpt_config()
    model = build_gpt_stage(cfg, state)
    opt = ZeroOptimizer(param_groups(model, 0.0), dp_group=state.dp_group, stage=stage, lr=1e-2, weight_decay=0.0,
                        mp_group=state.mp_group, tp_rank=state.tp_rank, module=model)
    p2p = P2P(state.prev_rank, state.next_rank, activation_shape(2, cfg), torch.float32)
    dp, r = state.dp_size, state.dp_rank
    m = 8 // (2 * dp)
    for it in range(2):
        tokens, labels = global_batch(it)
        micro = [{"tokens": tokens[j * 2 * dp + r * 2:][:2], "labels": labels[j * 2 * dp + r * 2:][:2]}
                 for j in range(m)]
        forward_backward(make_forward_step(model, micro, state), m, p2p, state.pp_rank, pp, backward_loss=opt.backward)
        opt.impl.finish_backward()
        sync_tied_embedding_grads(model, state)
        opt.step(lr=1e-2)
    args = {"num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "num_attention_heads": 4,
            "seq_length": cfg.seq_length, "max_position_embeddings": cfg.max_position_embeddings,
            "global_batch_size": 8, "micro_batch_size": 2, "train_iters": 10, "weight_decay": 0.0,
            "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp}
    client = {"iteration": 2, "consumed_train_samples": 16, "args": args, "rng_state": get_rng_state(),
              "train_state": {"iteration": 2, "consumed_train_samples": 16, "skipped_iterations": 0,
                              "nan_iterations": 0},
              "lr_scheduler": {"max_lr": 1e-2, "min_lr": 0.0, "lr_warmup_steps": 1, "lr_decay_steps": 10,
                               "lr_decay_style": "linear", "num_steps": 2}}
    save_checkpoint(ours_dir, 2, state, model, opt, client)
    save_checkpoint(mds_dir, 2, state, model, opt, client, megatron_deepspeed=True)
    dist.barrier()
    # ours resumes its own Megatron-DeepSpeed-layout save: the same weights, iteration and data position
    fresh = build_gpt_stage(cfg, state)
    fresh_opt = ZeroOptimizer(param_groups(fresh, 0.0), dp_group=state.dp_group, stage=stage, lr=1e-2,
                              weight_decay=0.0, mp_group=state.mp_group, tp_rank=state.tp_rank, module=fresh)
    loaded = resume_checkpoint(mds_dir, state, fresh, fresh_opt, log=lambda *a: None)
    assert loaded["train_state"]["consumed_train_samples"] == 16 and loaded["lr_scheduler"]["num_steps"] == 2
    trained = dict(model.named_parameters())
    for name, p in fresh.named_parameters():
        assert torch.equal(p, trained[name]), name
