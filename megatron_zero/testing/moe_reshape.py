"""One rank of a tiny MoE run that saves a checkpoint, or resumes from a universal or plain one at
another layout, for the MoE reshape tests (tests/test_moe_universal.py). The run is moe_train's
`parallel_run` (the same batches, hyperparameters and clipping) with a save and a load; it reports the
loss of each step by its index, and at the save the fp32 fragments this rank's optimizer owned."""
import os

import torch
import torch.distributed as dist

from ..checkpoint import load_checkpoint, save_checkpoint
from ..checkpoint.reshape.universal_load import load_reshaped_checkpoint, load_universal_checkpoint
from ..moe import reset_aux_losses
from ..zero.build import param_groups
from ..pipeline.gpt_stage import activation_shape, build_gpt_stage
from ..pipeline.p2p import P2P
from ..distributed.topology import build_parallel_state
from ..zero import ZeroOptimizer
from .moe_train import CLIP, GBS, HP, STEPS, reference_run, train_step
from .toy_zero import ZERO3_PERSIST

SAVE_AT = 5


def owned_state(opt) -> dict:
    """{name: [(offset in the parameter, {'fp32', 'exp_avg', 'exp_avg_sq'} fragment)]} this rank owns."""
    out = {}
    with opt.optimizer.paged() as masters:
        for gi, group in enumerate(opt.named_groups):
            name_of = {id(p): n for n, p in group}
            st = opt.optimizer.state(gi)
            for p, in_param, in_part, numel in opt.impl.owned_ranges(gi):
                frag = {"fp32": masters[gi].narrow(0, in_part, numel).clone(),
                        **{k: st[k].narrow(0, in_part, numel).clone() for k in ("exp_avg", "exp_avg_sq")}}
                out.setdefault(name_of[id(p)], []).append((in_param, frag))
    return out


def moe_run(cfg, tp: int, pp: int, ep: int, stage: int, mb: int, save_dir=None, load=None, load_kind="universal",
            steps: int = STEPS, offload: str = "none", nvme_path=None, muon=None):
    """`load_kind`: "universal", "reshaped" (another layout) or "same" (load_checkpoint at the layout saved);
    `offload`: the optimizer's ("cpu", "nvme" with `nvme_path`); `muon` (optimizer/muon.py's MuonSettings): the
    blocks' matrices, every expert's included, step by Muon.
    -> (per-step losses {step: loss}, the fragments owned at the save or None, this rank's coordinates)."""
    state = build_parallel_state(tp=tp, pp=pp, ep=ep)
    model = build_gpt_stage(cfg, state)
    params = param_groups(model, HP["weight_decay"], muon=True) if muon else list(model.named_parameters())
    opt = ZeroOptimizer(params, dp_group=state.dp_group, stage=stage, clip_grad=CLIP,
                        mp_group=state.mp_group, tp_rank=state.tp_rank, module=model, bucket_size=4000,
                        expert_dp_group=state.expert_dp_group, offload=offload, nvme_path=nvme_path, muon=muon,
                        tp_group=state.tp_group, expert_tp_group=state.expert_tp_group,
                        **(ZERO3_PERSIST if stage == 3 else {}), **HP)
    p2p = P2P(state.prev_rank, state.next_rank, activation_shape(mb, cfg), torch.float32)
    start = 0
    if load is not None:
        loader = {"universal": load_universal_checkpoint, "reshaped": load_reshaped_checkpoint,
                  "same": lambda d, *a: load_checkpoint(os.path.dirname(d), *a, tag=os.path.basename(d))}[load_kind]
        start = loader(load, state, model, opt)["iteration"]
    losses, saved = {}, None
    for step in range(start, steps):
        losses[step] = train_step(model, opt, state, p2p, step, mb)[0]
        if save_dir is not None and step + 1 == SAVE_AT:
            save_checkpoint(save_dir, step + 1, state, model, opt,
                            {"iteration": step + 1, "consumed_train_samples": (step + 1) * GBS,
                             "args": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                                      "expert_model_parallel_size": ep, "global_batch_size": GBS,
                                      "micro_batch_size": mb, "num_experts": cfg.num_experts,
                                      "optimizer": "muon" if muon else "adamw"}})
            saved = owned_state(opt)
    opt.wait_params()
    reset_aux_losses()
    dist.barrier()
    return losses, saved, state.layout.coords(state.rank)


def reference_resumed(cfg, saved: tuple, resumed: tuple, steps: int = STEPS):
    """The single-process reference of a run saved at (DP, micro-batch) `saved` and resumed at `resumed`:
    the aux losses are per micro-batch of a DP rank's tokens, so each step sums the micro-batches its
    layout had (the slicing switched at SAVE_AT). -> per-step losses."""
    return reference_run(cfg, *saved, steps, layout_at=lambda step: saved if step < SAVE_AT else resumed)[0]
