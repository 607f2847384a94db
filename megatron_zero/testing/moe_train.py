"""Tiny MoE GPT / Llama runs for the expert-parallel parity tests: the single-process reference model
fed the same micro-batches (`reference_run`), and one rank of a TP x PP x DP (EP carved out of DP) ZeRO
1/2/3 run (`parallel_run`, under run_ranks). Both report the loss and the global gradient norm (before
clipping) of every step; clipping is on, so the norm also moves the update."""
import torch

from ..model.gpt import reference_model
from ..moe import reset_aux_losses, set_aux_loss_scale
from ..pipeline.gpt_stage import activation_shape, build_gpt_stage, make_forward_step, sync_tied_embedding_grads
from ..pipeline.p2p import P2P
from ..pipeline.schedule import broadcast_loss, forward_backward
from ..distributed.topology import build_parallel_state
from ..zero import ZeroOptimizer
from .tiny_gpt import tiny_gpt_config, tiny_llama_config
from .toy_zero import ZERO3_PERSIST

GBS, STEPS, CLIP = 8, 10, 0.5
HP = dict(lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MOE = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)


def moe_config(llama: bool = False, **overrides):
    """4 layers, 4 experts (top-2, aux and z losses on); GPT-2 (GeLU experts, MoE in every layer) or
    Llama (SwiGLU experts, MoE in every other layer)."""
    if llama:
        return tiny_llama_config(num_layers=4, **{**MOE, "moe_layer_freq": 2, **overrides})
    return tiny_gpt_config(num_layers=4, **{**MOE, **overrides})


def global_batch(step):
    g = torch.Generator().manual_seed(300 + step)
    tokens = torch.randint(0, 100, (GBS, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:].contiguous()


def micro_slices(dp: int, mb: int):
    """[(micro-batch j, DP rank r) -> rows of the global batch], the order every layout splits it in."""
    m = GBS // (mb * dp)
    return {(j, r): slice(j * mb * dp + r * mb, j * mb * dp + (r + 1) * mb) for j in range(m) for r in range(dp)}


def reference_run(cfg, dp: int, mb: int, steps: int = STEPS, seed=None, layout_at=None):
    """The reference model on one process: each micro-batch of each DP rank in turn, loss / (DP x M).
    `seed`: the default generator's seed once the model is built (what random token selection draws).
    `layout_at(step)`: that step's (DP, micro-batch) when it changes along the run (a resume elsewhere)."""
    model = reference_model(cfg)
    if seed is not None:
        torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), **HP)
    losses, norms = [], []
    for step in range(steps):
        total = reference_backward(model, step, *(layout_at(step) if layout_at else (dp, mb)))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    reset_aux_losses()
    return losses, norms


def reference_backward(model, step: int, dp: int, mb: int) -> float:
    """Global batch `step` through the reference model, each micro-batch of each DP rank in turn, loss / (DP x M),
    the gradients accumulated; -> the loss."""
    slices = micro_slices(dp, mb)
    tokens, labels = global_batch(step)
    set_aux_loss_scale(1.0 / len(slices))
    total = 0.0
    for rows in slices.values():
        loss = model(tokens[rows], labels=labels[rows]) / len(slices)
        loss.backward()
        total += loss.item()
    return total


def train_step(model, opt, state, p2p, step: int, mb: int):
    """One step of global batch `step` on this stage: this DP rank's micro-batches of `mb` samples through the
    pipeline schedule, the aux losses scaled as training/trainer.py does, the ZeRO step. -> (loss on every rank, norm)."""
    tokens, labels = global_batch(step)
    slices = micro_slices(state.dp_size, mb)
    m = GBS // (mb * state.dp_size)
    micro = [{"tokens": tokens[slices[j, state.dp_rank]], "labels": labels[slices[j, state.dp_rank]]}
             for j in range(m)]
    set_aux_loss_scale(opt.loss_scale / m)
    out = forward_backward(make_forward_step(model, micro, state), m, p2p, state.pp_rank, state.pp_size,
                           backward_loss=opt.backward, before_last_backward=opt.arm_grad_reduce)
    sync_tied_embedding_grads(model, state)
    updated, norm = opt.step()
    assert updated
    loss = broadcast_loss(out, state.is_last_stage, state.layout.pp_group(state.rank)[-1], state.pp_group,
                          state.dp_group)
    return loss, norm


def parallel_run(cfg, tp: int, pp: int, ep: int, stage: int, mb: int, steps: int = STEPS, overlap: bool = False,
                 bucket_size: int = 4000, seed=None, prefetch: bool = True, offload: str = "none", nvme_path=None,
                 etp=None):
    """`overlap`: --overlap-grad-reduce and --overlap-param-gather. `seed`: as reference_run's. ZeRO-3: the
    weight matrices gathered per unit (ZERO3_PERSIST), the next unit's prefetched unless `prefetch` is off.
    `offload`: the optimizer's ("cpu", "nvme" with `nvme_path`). `etp`: --expert-tensor-parallel-size (None: TP)."""
    state = build_parallel_state(tp=tp, pp=pp, ep=ep, etp=etp)
    model = build_gpt_stage(cfg, state)
    if seed is not None:
        torch.manual_seed(seed)
    opt = ZeroOptimizer(list(model.named_parameters()), dp_group=state.dp_group, stage=stage, clip_grad=CLIP,
                        mp_group=state.mp_group, tp_rank=state.tp_rank, module=model,
                        bucket_size=bucket_size, expert_dp_group=state.expert_dp_group,
                        overlap_grad_reduce=overlap, overlap_param_gather=overlap, prefetch=prefetch,
                        offload=offload, nvme_path=nvme_path, **(ZERO3_PERSIST if stage == 3 else {}), **HP)
    p2p = P2P(state.prev_rank, state.next_rank, activation_shape(mb, cfg), torch.float32)
    losses, norms = [], []
    for step in range(steps):
        loss, norm = train_step(model, opt, state, p2p, step, mb)
        losses.append(loss)
        norms.append(norm)
    opt.wait_params()
    reset_aux_losses()
    return losses, norms
