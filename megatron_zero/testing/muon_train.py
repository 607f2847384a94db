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
from ..model.transformer import ParallelAttention
from ..optimizer.muon import MuonSettings, is_qkv, qkv_joined, qkv_pieces, takes_muon
from ..optimizer.qk_clip import FusedQKVTarget, QKClip
from ..zero.build import param_groups
from ..pipeline.gpt_stage import activation_shape, build_gpt_stage
from ..pipeline.p2p import P2P
from ..distributed.topology import build_parallel_state
from .moe_train import reference_backward, train_step
from .muon_reference import emerging_muon_utils
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


def parallel_run(cfg, tp, pp, stage, mb=1, tp_mode="duplicated", steps=STEPS, ep=1, qk_clip=None, **muon):
    """This rank's (coords, losses, TP-form weights, the optimizer's Newton-Schulz work; with `qk_clip`, (alpha,
    threshold), QK-clip on and the work's "max_logits": each step's max attention logit over the model)."""
    state = build_parallel_state(tp=tp, pp=pp, ep=ep)
    model = build_gpt_stage(cfg, state)
    opt = _optimizer(model, state, stage, settings(cfg, tp_mode, **muon))
    clip = QKClip(model, opt, state.dp_group, True, *qk_clip) if qk_clip else None
    p2p = P2P(state.prev_rank, state.next_rank, activation_shape(mb, cfg), torch.float32)
    losses, max_logits = [], []
    for it in range(steps):
        losses.append(train_step(model, opt, state, p2p, it, mb)[0])
        if clip is not None:
            max_logits.append(clip.report(state.mp_group))
    if stage == 3:
        with opt.impl.gathered():
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    else:
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    reset_aux_losses()
    dist.barrier()
    return state.layout.coords(state.rank), losses, weights, {**opt.muon.work(), "max_logits": max_logits}


def _optimizer(model, state, stage, muon: MuonSettings):
    from ..zero import ZeroOptimizer
    extra = ZERO3_PERSIST if stage == 3 else {}
    return ZeroOptimizer(param_groups(model, WD, muon=True), dp_group=state.dp_group, stage=stage, lr=LR,
                         weight_decay=WD, mp_group=state.mp_group, tp_rank=state.tp_rank, module=model, muon=muon,
                         tp_group=state.tp_group, expert_tp_group=state.expert_tp_group,
                         expert_dp_group=state.expert_dp_group, **ADAM, **extra)


def reference_run(cfg, dp, mb=1, blocks=1, steps=STEPS, qk_clip=None, **muon):
    """(losses, full-form weights[, each step's max attention logit]) of the one-process reference (see the module
    docstring); `qk_clip` (alpha, threshold): after each step Megatron-Core's SelfAttention._clip_linear_qkv on every
    layer's QKV weight, with its group-wise eta from the step's max logits."""
    s = settings(cfg, **muon)
    model = reference_model(cfg)
    logits = [FusedQKVTarget(m) for m in model.modules() if isinstance(m, ParallelAttention)] if qk_clip else []
    max_logits = []
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
        if qk_clip:
            max_logits.append(max(float(t.max_logit.value.max()) for t in logits))
            for target in logits:
                _megatron_core_clip(target, cfg, *qk_clip)
    reset_aux_losses()
    weights = {n: p.detach().clone() for n, p in named.items()}
    return (losses, weights, max_logits) if qk_clip else (losses, weights)


@torch.no_grad()
def _megatron_core_clip(target, cfg, alpha, threshold):
    """Megatron-Core 0.16.1's Attention.clip_qk on one layer's QKV weight (its own code, on its attributes)."""
    from types import SimpleNamespace

    from megatron.core.transformer.attention import SelfAttention
    groups = cfg.num_query_groups
    grouped = target.max_logit.value.view(groups, -1).max(dim=1).values
    core = SimpleNamespace(num_query_groups_per_partition=groups, query_projection_size=cfg.hidden_size,
                           kv_projection_size=groups * cfg.head_dim, config=SimpleNamespace(qk_clip_alpha=alpha))
    if torch.any(grouped > threshold):
        core.qk_clip_balancing_eta = torch.clamp(threshold / grouped, max=1.0).view(groups, 1, 1)
        target.weight.data.copy_(SelfAttention._clip_linear_qkv(core, target.weight.data))
    target.max_logit.reset()


def _blockwise(name, d, cfg, s: MuonSettings, blocks: int):
    spec = param_spec(name, cfg)
    if blocks == 1 or spec.partition_dim is None:
        return _reference_update(name, d, s)
    shards = [_reference_update(name, shard_tensor(d, spec, cfg, blocks, r), s) for r in range(blocks)]
    return gather_tensor(shards, spec, cfg)


def _reference_update(name, d, s: MuonSettings):
    """emerging-optimizers' newton_schulz and get_muon_scale_factor (what TensorParallelMuon calls), QKV split."""
    newton_schulz = emerging_muon_utils().newton_schulz
    from emerging_optimizers.orthogonalized_optimizers import get_muon_scale_factor

    def one(x):
        scale = get_muon_scale_factor(x.shape[0], x.shape[1], mode=s.scale_mode) * s.extra_scale_factor
        return newton_schulz(x, s.num_ns_steps, "quintic") * scale
    if s.split_qkv and is_qkv(name):
        return qkv_joined([one(p) for p in qkv_pieces(d, s.qkv_split_rows)], d.shape, s.qkv_split_rows)
    return one(d)
