"""Megatron-Core 0.16.1 itself, on gloo ranks on the CPU, as the peer the torch_dist interop tests check against.

    python -m megatron_zero.testing.mcore_peer save DIR --arch gpt|llama --tp 2
        builds a tiny GPTModel, takes one FP32Optimizer (AdamW) step on batch(0), and writes, as Megatron-LM's
        training loop would, a torch_dist checkpoint DIR/iter_0000001 (model, optimizer state, args, iteration)
        with DIR/latest_checkpointed_iteration.txt, and the same state as a legacy checkpoint (--ckpt-format torch)
        in DIR/legacy; then DIR/reference.pt: its logits on batch(1), and after one
        more step on batch(1) the logits on batch(2); and DIR/after_step: the model after that step (torch_dist).
    python -m megatron_zero.testing.mcore_peer load DIR OUT --arch gpt|llama --tp 2
        loads the torch_dist checkpoint DIR with megatron-core's dist_checkpointing.load at that TP and writes
        its logits on batch(1) to OUT.
    --moe --ep N (with save or load): the mixture-of-experts variant (`MOE`: 4 experts, top-2, the allgather
        dispatcher, no biases; GPT: MoE in every other layer, Llama: in every layer with a gated shared
        expert) on N expert-parallel ranks (TP 1, DP N). save then also writes DIR/singleton: the same model
        saved with Megatron-Core's `singleton_local_shards` metadata (one key per expert, SwiGLU halves apart).
        With EP > 1 the two steps are not a data-parallel run's (FP32Optimizer reduces no gradients): the
        checkpoint and the logits are Megatron-Core's all the same, the step after loading is not compared.

The model (`SIZES`, `ARCH`) and the batches are what the tests build on our side too. Megatron-Core needs CUDA
in places where a CPU run does not: `torch.cuda.current_device` and `torch.cuda.synchronize` are replaced in
this process only, and tensors asked for on 'cuda' are made on the CPU (the FP32Optimizer's loss scale).
"""
from __future__ import annotations

import argparse
import os
import sys
from argparse import Namespace
from functools import partial

import torch

SIZES = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=128, seq_length=16,
             batch=2)
ARCH = {
    "gpt": dict(normalization="LayerNorm", position_embedding_type="learned_absolute", swiglu=False,
                num_query_groups=4, untie_embeddings_and_output_weights=False, add_bias_linear=True),
    "llama": dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True, num_query_groups=2,
                  untie_embeddings_and_output_weights=True, add_bias_linear=False),
}
LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.95), 1e-8, 0.0
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
MOE_ARCH = {"gpt": dict(moe_layer_freq=2), "llama": dict(moe_layer_freq=1, moe_shared_expert_intermediate_size=48,
                                                       moe_shared_expert_gate=True)}


def arch_settings(arch: str, moe: bool) -> dict:
    """The model's settings (our GPTConfig's names): ARCH, and with `moe` MOE and MOE_ARCH, without biases."""
    return {**ARCH[arch], **(dict(MOE, **MOE_ARCH[arch], add_bias_linear=False) if moe else {})}


def batch(k: int):
    """Tokens and labels [batch, seq] of step k, the same on every rank and on our side."""
    g = torch.Generator().manual_seed(4321 + k)
    seq = torch.randint(0, SIZES["vocab_size"], (SIZES["batch"], SIZES["seq_length"] + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def megatron_args(arch: str, tp: int, moe: bool = False, ep: int = 1) -> Namespace:
    """The args Megatron-LM records in common.pt, as much of them as describes this model and run."""
    a = arch_settings(arch, moe)
    extra = dict(MOE, **MOE_ARCH[arch], expert_model_parallel_size=ep, moe_token_dispatcher_type="allgather",
                 data_parallel_size=ep) if moe else {}
    return Namespace(**extra, **{k: v for k, v in _dense_args(a, tp).items() if k not in extra})


def _dense_args(a: dict, tp: int) -> dict:
    return dict(num_layers=SIZES["num_layers"], hidden_size=SIZES["hidden_size"],
                num_attention_heads=SIZES["num_attention_heads"], ffn_hidden_size=SIZES["ffn_hidden_size"],
                seq_length=SIZES["seq_length"], max_position_embeddings=SIZES["seq_length"],
                padded_vocab_size=SIZES["vocab_size"], make_vocab_size_divisible_by=1,
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, data_parallel_size=1,
                normalization=a["normalization"], position_embedding_type=a["position_embedding_type"],
                swiglu=a["swiglu"], group_query_attention=a["num_query_groups"] < SIZES["num_attention_heads"],
                num_query_groups=a["num_query_groups"], add_bias_linear=a["add_bias_linear"],
                untie_embeddings_and_output_weights=a["untie_embeddings_and_output_weights"],
                rotary_base=10000, rotary_percent=1.0, layernorm_epsilon=1e-5, norm_epsilon=1e-5,
                lr=LR, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=EPS, weight_decay=WEIGHT_DECAY,
                micro_batch_size=SIZES["batch"], global_batch_size=SIZES["batch"], iteration=1,
                ckpt_format="torch_dist", use_distributed_optimizer=False)


def _shim_cuda():
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    real_tensor = torch.tensor

    def tensor(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return real_tensor(*args, **kwargs)
    torch.tensor = tensor


def build(arch: str, moe: bool = False):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    a = arch_settings(arch, moe)
    moe_config = {}
    if moe:
        from megatron.core.transformer.moe import moe_utils
        moe_utils.te_general_gemm = None  # Transformer Engine's GEMM: not on this machine
        moe_config = dict(num_moe_experts=MOE["num_experts"], moe_router_topk=MOE["moe_router_topk"],
                          moe_ffn_hidden_size=MOE["moe_ffn_hidden_size"], moe_token_dispatcher_type="allgather",
                          moe_layer_freq=a["moe_layer_freq"], moe_aux_loss_coeff=0.0,
                          moe_shared_expert_intermediate_size=a.get("moe_shared_expert_intermediate_size"),
                          moe_shared_expert_gate=a.get("moe_shared_expert_gate", False))
    gelu = partial(torch.nn.functional.gelu, approximate="tanh")
    config = TransformerConfig(
        num_layers=SIZES["num_layers"], hidden_size=SIZES["hidden_size"],
        num_attention_heads=SIZES["num_attention_heads"], ffn_hidden_size=SIZES["ffn_hidden_size"],
        num_query_groups=a["num_query_groups"], normalization=a["normalization"], layernorm_epsilon=1e-5,
        gated_linear_unit=a["swiglu"], activation_func=torch.nn.functional.silu if a["swiglu"] else gelu,
        add_bias_linear=a["add_bias_linear"], hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, init_method_std=0.02, **moe_config)
    spec = (get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=a["normalization"])
            if moe else get_gpt_layer_local_spec(normalization=a["normalization"]))
    model = GPTModel(config, spec,
                     vocab_size=SIZES["vocab_size"], max_sequence_length=SIZES["seq_length"],
                     share_embeddings_and_output_weights=not a["untie_embeddings_and_output_weights"],
                     position_embedding_type=a["position_embedding_type"])
    return model


def _inputs(tokens):
    s = tokens.shape[1]
    pos = torch.arange(s).unsqueeze(0).expand_as(tokens)
    return tokens, pos, torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]  # True: masked


def logits(model, k: int):
    tokens, _ = batch(k)
    with torch.no_grad():
        return model(*_inputs(tokens), runtime_gather_output=True).float()


def train_step(model, opt, k: int):
    tokens, labels = batch(k)
    opt.zero_grad()
    loss = model(*_inputs(tokens), labels=labels).float().mean()
    loss.backward()
    ok, _, _ = opt.step()
    assert ok
    return float(loss)


def _save_legacy(root: str, model, opt, arch: str, tp: int, rank: int):
    """What Megatron-LM's save_checkpoint writes with --ckpt-format torch: one file per model-parallel rank."""
    import torch.distributed as dist
    path = os.path.join(root, "iter_0000001", f"mp_rank_{rank:02d}")
    os.makedirs(path, exist_ok=True)
    torch.save({"args": megatron_args(arch, tp), "checkpoint_version": 3.0, "iteration": 1,
                "model": model.state_dict_for_save_checkpoint(), "optimizer": opt.state_dict(),
                "opt_param_scheduler": {"num_steps": SIZES["batch"]}, "num_floating_point_operations_so_far": 0},
               os.path.join(path, "model_optim_rng.pt"))
    if rank == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("1")
    dist.barrier()


def _save_singleton(root: str, model, opt, arch: str, world: int, rank: int):
    """The same state with `singleton_local_shards` (Megatron-LM's fully reshardable layout): per-layer and
    per-expert keys, SwiGLU's halves as `_w` / `_v`."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    ckpt = os.path.join(root, "iter_0000001")
    if rank == 0:
        os.makedirs(ckpt, exist_ok=True)
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("1")
    dist.barrier()
    model_sd = model.sharded_state_dict(metadata={"singleton_local_shards": True})
    dist_checkpointing.save({"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd),
                             "args": megatron_args(arch, 1, True, world), "iteration": 1, "checkpoint_version": 3.0,
                             "num_floating_point_operations_so_far": 0}, ckpt)


def _rank(rank: int, world: int, port: int, mode: str, directory: str, out: str, arch: str, moe: bool = False):
    _shim_cuda()
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups
    from megatron.core.optimizer.optimizer import FP32Optimizer
    from megatron.core.tensor_parallel import random as mc_random

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if moe:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=world)
    else:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    torch.manual_seed(1234)
    mc_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    model = build(arch, moe)
    tp = 1 if moe else world
    if mode == "load":
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, directory)
        model.load_state_dict(state["model"])
        out_logits = logits(model, 1)
        if rank == 0:
            torch.save({"logits": out_logits}, out)
        dist.barrier()
        dist.destroy_process_group()
        return
    config = OptimizerConfig(optimizer="adam", lr=LR, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=EPS,
                             weight_decay=WEIGHT_DECAY, clip_grad=0.0)
    groups = _get_param_groups([model], config, None)  # Megatron's groups (weight decay, then none), in its order
    inner = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)

    def init_state(opt, config=None):
        for group in opt.param_groups:
            for p in group["params"]:
                if len(opt.state[p]) == 0:
                    opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)
    opt = FP32Optimizer(inner, config, init_state)
    train_step(model, opt, 0)
    if not moe:
        _save_legacy(os.path.join(directory, "legacy"), model, opt, arch, world, rank)
    model_sd = model.sharded_state_dict()
    ckpt = os.path.join(directory, "iter_0000001")
    if rank == 0:
        os.makedirs(ckpt, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd),
                             "args": megatron_args(arch, tp, moe, world if moe else 1), "iteration": 1, "checkpoint_version": 3.0,
                             "num_floating_point_operations_so_far": 0}, ckpt)
    if moe:
        _save_singleton(os.path.join(directory, "singleton"), model, opt, arch, world, rank)
    before = logits(model, 1)
    loss = train_step(model, opt, 1)
    after = logits(model, 2)
    after_dir = os.path.join(directory, "after_step")
    if rank == 0:
        os.makedirs(after_dir, exist_ok=True)
        with open(os.path.join(directory, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("1")
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict()}, after_dir)
    if rank == 0:
        torch.save({"logits": before, "loss": loss, "logits_after_step": after}, os.path.join(directory, "reference.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("save", "load"))
    p.add_argument("directory")
    p.add_argument("out", nargs="?")
    p.add_argument("--arch", choices=tuple(ARCH), default="gpt")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--port", type=int, default=29517)
    p.add_argument("--moe", action="store_true")
    p.add_argument("--ep", type=int, default=1)
    a = p.parse_args(argv)
    world = a.ep if a.moe else a.tp
    torch.multiprocessing.spawn(_rank, args=(world, a.port, a.mode, a.directory, a.out, a.arch, a.moe), nprocs=world)


if __name__ == "__main__":
    sys.exit(main())
