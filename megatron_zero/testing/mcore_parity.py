"""Our side of the Megatron-Core checkpoint tests: load a torch_dist checkpoint written by megatron-core
(mcore_peer.py) at a TP x PP x ZeRO-stage layout, take one training step on the batch Megatron-Core stepped
on, and return this rank's weights before and after it (the test gathers them into full form)."""
import torch
import torch.distributed as dist

from ..checkpoint import save_checkpoint
from ..checkpoint.interop.megatron_legacy import LegacyFiles
from ..checkpoint.interop.torch_dist import TorchDistFiles
from ..checkpoint.reshape.universal_load import load_from, load_universal_checkpoint
from ..model.config import GPTConfig
from ..model.gpt import reference_model
from ..model.sharding import gather_state_dicts, shard_state_dict
from ..pipeline.gpt_stage import (activation_shape, build_gpt_stage, grad_reduce_arming, make_forward_step,
                                  sync_tied_embedding_grads)
from ..pipeline.p2p import P2P
from ..pipeline.schedule import forward_backward
from ..distributed.topology import build_parallel_state
from ..training.trainer import param_groups
from ..zero import ZeroOptimizer
from .mcore_peer import BETAS, EPS, LR, SIZES, WEIGHT_DECAY, arch_settings, batch


def config(arch: str, moe: bool = False) -> GPTConfig:
    """Our config of the model mcore_peer.py builds (`moe`: its mixture-of-experts variant)."""
    s = SIZES
    return GPTConfig(vocab_size=s["vocab_size"], hidden_size=s["hidden_size"], num_layers=s["num_layers"],
                     num_attention_heads=s["num_attention_heads"], ffn_hidden_size=s["ffn_hidden_size"],
                     seq_length=s["seq_length"], max_position_embeddings=s["seq_length"],
                     make_vocab_size_divisible_by=1, hidden_dropout=0.0, attention_dropout=0.0,
                     **arch_settings(arch, moe))


def _weights(model, opt):
    if opt.stage == 3:
        with opt.impl.gathered():
            return {n: p.detach().clone() for n, p in model.named_parameters()}
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def load_and_step(tp, pp, stage, ckpt, arch, mb=1, source="torch_dist", save_dir=None, moe=False, ep=1):
    """-> (coords, iteration loaded, weights after loading, weights after one step on batch(1)); `ckpt`: the
    torch_dist checkpoint (source 'torch_dist'), its conversion by tools/convert_checkpoint.py ('universal'), or
    the legacy checkpoint ('legacy'); `save_dir`: where
    the state after the step is saved, in our layout, as iteration 2. `moe`, `ep`: the MoE variant on `ep`
    expert-parallel ranks."""
    state = build_parallel_state(tp=tp, pp=pp, ep=ep)
    cfg = config(arch, moe)
    model = build_gpt_stage(cfg, state)
    opt = ZeroOptimizer(param_groups(model, WEIGHT_DECAY), dp_group=state.dp_group, stage=stage, lr=LR,
                        betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, mp_group=state.mp_group,
                        tp_rank=state.tp_rank, module=model, expert_dp_group=state.expert_dp_group)
    if source == "universal":
        client = load_universal_checkpoint(ckpt, state, model, opt)
    elif source == "legacy":
        client = load_from(LegacyFiles(ckpt, cfg), state, model, opt)
    else:
        client = load_from(TorchDistFiles(ckpt, cfg), state, model, opt)
    loaded = _weights(model, opt)
    tokens, labels = batch(1)
    dp, r = state.dp_size, state.dp_rank
    m = tokens.shape[0] // (mb * dp)
    micro = [{"tokens": tokens[j * mb * dp + r * mb:][:mb], "labels": labels[j * mb * dp + r * mb:][:mb]}
             for j in range(m)]
    p2p = P2P(state.prev_rank, state.next_rank, activation_shape(mb, cfg), torch.float32)
    forward_backward(make_forward_step(model, micro, state), m, p2p, state.pp_rank, pp, backward_loss=opt.backward,
                     before_last_backward=grad_reduce_arming(model, opt))  # as training/trainer.py steps
    sync_tied_embedding_grads(model, state)
    updated, _ = opt.step(lr=LR)
    assert updated
    stepped = _weights(model, opt)
    if save_dir is not None:
        args = {f: getattr(cfg, f) for f in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                                             "seq_length", "max_position_embeddings", "make_vocab_size_divisible_by",
                                             "normalization", "position_embedding_type", "swiglu", "num_query_groups",
                                             "untie_embeddings_and_output_weights", "add_bias_linear",
                                             "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
                                             "moe_shared_expert_intermediate_size", "moe_shared_expert_gate")}
        args.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, global_batch_size=SIZES["batch"])
        save_checkpoint(save_dir, 2, state, model, opt, {"iteration": 2, "consumed_train_samples": 2 * SIZES["batch"],
                                                         "args": args, "lr_scheduler": {"num_steps": 2}})
    dist.barrier()
    return state.layout.coords(state.rank), client["iteration"], loaded, stepped


def reference_logits(full: dict, cfg: GPTConfig, k: int) -> torch.Tensor:
    """The single-process model's logits on batch(k) with full-form weights `full` (padding cut)."""
    model = reference_model(cfg)
    model.load_state_dict(shard_state_dict(full, cfg, 1, 0))
    with torch.no_grad():
        return model(batch(k)[0])[..., :cfg.vocab_size]


def gathered(results, cfg: GPTConfig, which: int) -> dict:
    """Full-form weights from every rank's load_and_step result (`which`: 2 loaded, 3 stepped): each
    (pipeline stage, DP rank)'s TP shards gathered, the DP ranks' together, so expert-parallel ranks
    each add their own experts (the dense parameters are the same on every DP rank)."""
    groups = {}
    for r in sorted(results, key=lambda r: r[0][2]):
        groups.setdefault((r[0][0], r[0][1]), []).append(r[which])
    full = {}
    for shards in groups.values():
        full.update(gather_state_dicts(shards, cfg))
    return full
