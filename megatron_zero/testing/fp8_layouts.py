"""FP8 (emulated) training at one layout against the one-process FP8 reference, for tests/test_fp8_parity.py.

`fp8_layout_run(layout, broken)` runs on every rank of a run_ranks world: the tiny Llama converted to FP8,
STEPS steps of ZeRO at the layout, and on each rank the one-process FP8 model (reference_model, converted the
same way, torch.optim.AdamW) on the same micro-batches in the same order. Every FP8 cast's scale is recorded
(torchao's amax_to_scale, wrapped) in call order, for both. `broken`: the amaxes are not reduced over the
groups that split them (the bug the tests must catch). With delayed scaling (`settings`' recipe "delayed")
the scales come from the layers' amax histories, not amax_to_scale: the run returns each layer's final
scales instead, and the reference takes each micro-batch of every DP rank together, as one micro-batch
(the DP ranks' amaxes are reduced over DP: one history entry for all of them).
`param_gather` (--fp8-param-gather, optionally `overlap`ped) has ZeRO gather the FP8 weights in FP8 (the
experts' too; the run says which layers it gathered so, `fp8_gathered`); `broken_gather` then leaves each
weight's amax unreduced over DP (each rank scales its own shard). The
reference with `settings.param_gather` casts each FP8 weight once per step after the optimizer's step
(and once before the first), with fp8/param_gather.py's scales: the flag's FP8 weights, one process.

With `moe` (moe_config's overrides) the blocks' MLPs are MoE layers, at EP `ep` and expert TP `etp`. An
expert's scale is that of every token of the micro-batch routed to it, over every DP rank's micro-batch
(fp8/experts.py): the reference then takes each micro-batch of every DP rank together, as delayed scaling
does, and under tensorwise or rowwise scaling runs the blocks' other layers on each sample alone
(`_PerSample`), as each DP rank casts its own. `broken="block_groups"`: the experts' amaxes reduced over
the blocks' DP group instead of the expert-DP group (its ranks hold other experts).
"""
import dataclasses

import torch
import torch.distributed as dist

from ..fp8 import matmul
from ..fp8.convert import Float8Converter
from ..fp8.delayed import histories
from ..fp8.experts import is_expert
from ..fp8.settings import Float8Settings
from ..context_parallel import slice_batch_for_cp
from ..model import reference_model
from ..zero.build import weight_gathers
from ..pipeline.gpt_stage import activation_shape, build_gpt_stage
from ..pipeline.p2p import P2P
from ..distributed.topology import build_parallel_state
from ..zero import ZeroOptimizer
from .tiny_gpt import tiny_llama_config
from .train_step import pipeline_train_step

STEPS, GLOBAL_BATCH = 2, 2
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
CPU = torch.device("cpu")


def config(sequence_parallel=False, **moe):
    return tiny_llama_config(num_layers=2, seq_length=16, max_position_embeddings=16,
                             sequence_parallel=sequence_parallel, **moe)


def moe_config(sequence_parallel=False, **overrides):
    """config() with an MoE layer for each block's MLP: 4 SwiGLU experts, top-2, dropless, no aux loss (the
    load-balancing loss is a function of the micro-batch's token set, which DP splits)."""
    return config(sequence_parallel, **{**dict(num_experts=4, moe_router_topk=2), **overrides})


def batch(step):
    g = torch.Generator().manual_seed(700 + step)
    tokens = torch.randint(0, 100, (GLOBAL_BATCH, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:].contiguous()


class _ScaleLog:
    """Every scale torchao's amax_to_scale returns, in call order, while installed."""

    def __init__(self):
        self.scales, self._inner = [], matmul.amax_to_scale

    def __enter__(self):
        def record(*args, **kwargs):
            scale = self._inner(*args, **kwargs)
            self.scales.append(scale.detach().clone())
            return scale
        matmul.amax_to_scale = record
        return self

    def __exit__(self, *exc):
        matmul.amax_to_scale = self._inner


class _PerSample:
    """A block's (non-expert) FP8 matmul applied to each sample of a micro-batch [b, s, K] alone."""

    def __init__(self, mm):
        self.mm = mm

    def __call__(self, x, weight):
        return torch.cat([self.mm(sample, weight) for sample in x.split(1)])


def reference_run(settings, dp=1, cp=1, steps=STEPS, moe=None):
    """The one-process FP8 model on every step's global batch, forward then backward per micro-batch (as the
    schedule at PP 1): per step the loss and gradient norm, per step and micro-batch the scales (with delayed
    scaling, the layers' final scales instead). A micro-batch is one sample, or under delayed scaling the dp
    samples the DP ranks take together. The loss is normalised as a DP rank of a `dp`-way run does (by its
    micro-batch count; the gradients then averaged over DP), and with `cp` as a CP rank's (its tokens' loss
    counted cp times, the gradients averaged over DP x CP), so the output gradients, and their scales, are
    that rank's; the sums are the same (dp and cp powers of 2: exactly). `moe`: the module docstring's."""
    model = reference_model(moe_config(**moe) if moe is not None else config())
    Float8Converter(settings, CPU)(model)
    combined = settings.delayed or moe is not None
    if combined and not settings.delayed:
        for m in model.modules():
            if getattr(m, "fp8", None) is not None and not is_expert(m):
                m.fp8 = _PerSample(m.fp8)
    opt = torch.optim.AdamW(model.parameters(), **HP)
    publish = _fp8_weights(model) if settings.param_gather else (lambda: None)
    publish()
    per_rank = GLOBAL_BATCH // dp
    together = dp if combined else 1
    micro = [[r * per_rank + j for r in range(dp)] for j in range(per_rank)] if combined else \
        [[j] for j in range(GLOBAL_BATCH)]
    losses, norms, scales = [], [], []
    for step in range(steps):
        tokens, labels = batch(step)
        opt.zero_grad()
        total, per_micro = 0.0, []
        for rows in micro:
            with _ScaleLog() as log:
                loss = model(tokens[rows], labels=labels[rows]) * together * cp / per_rank
                loss.backward()
            total += loss.item() / (dp * cp)
            per_micro.append(log.scales)
        for p in model.parameters():
            p.grad /= dp * cp
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item())
        opt.step()
        publish()
        losses.append(total)
        scales.append(per_micro)
    if settings.delayed:
        scales = [s.scale.clone() for _, s in histories(model)]
    return losses, norms, scales


def _fp8_weights(model):
    """-> publish(): every FP8 layer's weight cast to FP8 whole (fp32: the weight is its own master)."""
    from ..fp8.param_gather import Float8ParamGather, gathered_layers

    gather = Float8ParamGather(gathered_layers(model), None, CPU)

    def publish():
        with torch.no_grad():
            gather.set_scales(torch.stack([m.weight.abs().max() for m in gather.layers]))
            for i, m in enumerate(gather.layers):
                gather.bytes_of(i).copy_(gather.cast(i, m.weight.reshape(-1)))
    return publish


def expected_scales(reference_scales, dp_rank, dp_size):
    """The scales a DP rank casts with, in its call order at PP 1: its micro-batches' in the reference."""
    per_rank = GLOBAL_BATCH // dp_size
    return [s for step in reference_scales for j in range(dp_rank * per_rank, (dp_rank + 1) * per_rank)
            for s in step[j]]


def delayed_settings(history=4, algo="max"):
    return Float8Settings("hybrid", "delayed", 0, True, history, algo)


def fp8_layout_run(tp=1, pp=1, cp=1, stage=1, sequence_parallel=False, recipe="tensorwise", broken=False,
                   moe=None, ep=1, etp=None, param_gather=False, overlap=False, broken_gather=False,
                   persistence_threshold=100_000):
    """-> this rank's DP rank, per-step losses and gradient norms, and its scales in call order (delayed
    scaling: each layer's final scales)."""
    state = build_parallel_state(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
    settings = delayed_settings() if recipe == "delayed" else Float8Settings("hybrid", recipe, 0, emulate=True)
    settings = dataclasses.replace(settings, param_gather=param_gather)
    sp = sequence_parallel and tp > 1
    cfg = moe_config(sp, **moe) if moe is not None else config(sp)
    model = build_gpt_stage(cfg, state)
    dp_group = state.dp_group if state.dp_size > 1 else None
    converter = Float8Converter(settings, CPU, state.cp_group if cp > 1 else None, dp_group,
                                state.expert_dp_group if state.expert_dp_group is not None else dp_group)
    converter.convert(model)
    opt = ZeroOptimizer(list(model.named_parameters()), dp_group=state.dp_group, stage=stage, clip_grad=1e9,
                        mp_group=state.mp_group, tp_rank=state.tp_rank, module=model,
                        expert_dp_group=state.expert_dp_group, overlap_grad_reduce=overlap,
                        overlap_param_gather=overlap, persistence_threshold=persistence_threshold,
                        **weight_gathers(converter, model, state.dp_group, state.expert_dp_group, CPU), **HP)
    if broken_gather:  # each rank's weight scale from its own master fragments only
        opt.fp8_gather.groups = [g for g in opt.fp8_gather.groups if g is not state.dp_group]
    p2p = P2P(state.prev_rank, state.next_rank, activation_shape(1, cfg, state.tp_size, state.cp_size),
              torch.float32)
    saved = dict(matmul.TP_SPLIT)
    if broken == "block_groups":  # the experts' amaxes over the blocks' DP group, whose ranks hold other experts
        for m in model.modules():
            if getattr(m, "fp8", None) is not None and is_expert(m):
                m.fp8.cp_group = state.dp_group
    elif broken:  # the amax of every shard its own: no reduction over TP (nor CP, nor expert-DP)
        matmul.TP_SPLIT.update({k: {"x": None, "w": None, "g": None} for k in matmul.TP_SPLIT})
        for m in model.modules():
            if getattr(m, "fp8", None) is not None:
                m.fp8.cp_group = m.fp8.dp_group = None
    per_replica = GLOBAL_BATCH // state.data_parallel_size
    first = state.data_parallel_rank * per_replica
    losses, norms = [], []
    try:
        with _ScaleLog() as log:
            for step in range(STEPS):
                tokens, labels = batch(step)
                micro = [slice_batch_for_cp({"tokens": tokens[j:j + 1], "labels": labels[j:j + 1],
                                             "loss_mask": torch.ones(1, labels.shape[1])}, cp, state.cp_rank)
                         for j in range(first, first + per_replica)]
                loss, norm = pipeline_train_step(model, opt, state, p2p, micro)
                losses.append(loss)
                norms.append(norm)
    finally:
        matmul.TP_SPLIT.clear()
        matmul.TP_SPLIT.update(saved)
    dist.barrier()
    scales = [s.scale.clone() for _, s in histories(model)] if settings.delayed else log.scales
    return {"dp_rank": state.data_parallel_rank, "losses": losses, "norms": norms, "scales": scales,
            "fp8_gathered": _gathered_in_fp8(model, stage) if param_gather else None}


def _gathered_in_fp8(model, stage):
    """Per FP8 layer (name -> (an expert's, gathered)): whether ZeRO gathers its weight in FP8 (stage 3: holds
    an FP8 chunk of it) and, at stage 1/2, holds no copy of it in the training dtype between steps."""
    from ..fp8.param_gather import holds_bytes

    return {n: (is_expert(m), getattr(m.weight, "ds_shard8", None) is not None if stage == 3 else
                m.fp8.weight8 is not None and not holds_bytes(m.weight))
            for n, m in model.named_modules() if getattr(m, "fp8", None) is not None}

