"""Muon runs of a tiny GPT / Llama for the parity tests: one rank of a TP x PP x DP ZeRO run (`parallel_run`,
under run_ranks; with `ep` an MoE model's experts over EP), and the single-process reference (`reference_run`):
the reference model stepped by emerging-optimizers' Newton-Schulz and scale (Megatron-Core's Muon; test-only) on
the blocks' matrices, orthogonalized whole or, for `blocks` > 1, per TP block as a `blockwise` run at that TP does,
and torch.optim.AdamW on the rest. Both take the same global batch (micro-batches of each DP rank in turn)."""
import torch
import torch.distributed as dist

from ..model.gpt import reference_model
from ..model.params import param_spec
from ..model.sharding import gather_tensor, shard_tensor
from ..moe import reset_aux_losses
from ..optimizer.muon import MuonSettings, is_qkv, qkv_joined, qkv_pieces, takes_muon
from ..optimizer_setup import param_groups
from ..pipeline.gpt_stage import activation_shape, build_gpt_stage
from ..pipeline.p2p import P2P
from ..topology import build_parallel_state
from .moe_train import reference_backward, train_step
from .muon_reference import tensor_parallel_muon
from .toy_zero import ZERO3_PERSIST

STEPS, LR, WD = 6, 5e-3, 0.1
ADAM = dict(betas=(0.9, 0.999), eps=1e-8)


def settings(cfg, tp_mode="duplicated", **changes) -> MuonSettings:
    """Nesterov, fp32 Newton-Schulz, a scale other than 1; the QKV split of `cfg`'s attention."""
    q_rows = cfg.num_attention_heads // cfg.num_query_groups * cfg.head_dim
    fields = dict(momentum=0.9, nesterov=True, split_qkv=True, scale_mode="spectral", fp32_matmul_prec="highest",
                  num_ns_steps=5, tp_mode=tp_mode, extra_scale_factor=0.5,
                  qkv_split_rows=(q_rows, cfg.head_dim, cfg.head_dim))
    fields.update(changes)
    return MuonSettings(**fields)


def parallel_run(cfg, tp, pp, stage, mb=1, tp_mode="duplicated", steps=STEPS, ep=1, **muon):
    """This rank's (coords, losses, TP-form weights, the optimizer's Newton-Schulz work)."""
    state = build_parallel_state(tp=tp, pp=pp, ep=ep)
    model = build_gpt_stage(cfg, state)
    opt = _optimizer(model, state, stage, settings(cfg, tp_mode, **muon))
    p2p = P2P(state.prev_rank, state.next_rank, activation_shape(mb, cfg), torch.float32)
    losses = [train_step(model, opt, state, p2p, it, mb)[0] for it in range(steps)]
    if stage == 3:
        with opt.impl.gathered():
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    else:
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    reset_aux_losses()
    dist.barrier()
    return state.layout.coords(state.rank), losses, weights, opt.muon.work()


def _optimizer(model, state, stage, muon: MuonSettings):
    from ..zero import ZeroOptimizer
    extra = ZERO3_PERSIST if stage == 3 else {}
    return ZeroOptimizer(param_groups(model, WD, muon=True), dp_group=state.dp_group, stage=stage, lr=LR,
                         weight_decay=WD, mp_group=state.mp_group, tp_rank=state.tp_rank, module=model, muon=muon,
                         tp_group=state.tp_group, expert_tp_group=state.expert_tp_group,
                         expert_dp_group=state.expert_dp_group, **ADAM, **extra)


def reference_run(cfg, dp, mb=1, blocks=1, steps=STEPS, **muon):
    """(losses, full-form weights) of the one-process reference (see the module docstring)."""
    s = settings(cfg, **muon)
    model = reference_model(cfg)
    named = dict(model.named_parameters())
    matrices = {n: p for n, p in named.items() if takes_muon(n, p.shape)}
    adam_decay = [p for n, p in named.items() if n not in matrices and p.ndim > 1]
    adam_plain = [p for n, p in named.items() if p.ndim == 1]
    adam = torch.optim.AdamW([{"params": adam_decay, "weight_decay": WD}, {"params": adam_plain, "weight_decay": 0.0}],
                             lr=LR, **ADAM)
    momenta = {n: torch.zeros_like(p) for n, p in matrices.items()}
    losses = []
    for it in range(steps):
        total = reference_backward(model, it, dp, mb)
        with torch.no_grad():
            for n, p in matrices.items():
                g = p.grad
                p.mul_(1 - LR * WD)
                momenta[n].lerp_(g, 1 - s.momentum)
                d = g.lerp(momenta[n], s.momentum) if s.nesterov else momenta[n]
                p.add_(_blockwise(n, d, cfg, s, blocks), alpha=-LR)
                p.grad = None
        adam.step()
        adam.zero_grad()
        losses.append(total)
    reset_aux_losses()
    return losses, {n: p.detach().clone() for n, p in named.items()}


def _blockwise(name, d, cfg, s: MuonSettings, blocks: int):
    spec = param_spec(name, cfg)
    if blocks == 1 or spec.partition_dim is None:
        return _reference_update(name, d, s)
    shards = [_reference_update(name, shard_tensor(d, spec, cfg, blocks, r), s) for r in range(blocks)]
    return gather_tensor(shards, spec, cfg)


def _reference_update(name, d, s: MuonSettings):
    """emerging-optimizers' newton_schulz and get_muon_scale_factor (what TensorParallelMuon calls), QKV split."""
    tensor_parallel_muon()  # imports emerging-optimizers on this Python
    from emerging_optimizers.orthogonalized_optimizers import get_muon_scale_factor
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz

    def one(x):
        scale = get_muon_scale_factor(x.shape[0], x.shape[1], mode=s.scale_mode) * s.extra_scale_factor
        return newton_schulz(x, s.num_ns_steps, "quintic") * scale
    if s.split_qkv and is_qkv(name):
        return qkv_joined([one(p) for p in qkv_pieces(d, s.qkv_split_rows)], d.shape, s.qkv_split_rows)
    return one(d)
