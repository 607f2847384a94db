"""ZeroOptimizer: AdamW with ZeRO stage 0/1/2/3 partitioning, mixed precision, loss scaling,
global-norm clipping and CPU/NVMe offload. The training loop calls

    opt.backward(loss); ...; updated, grad_norm = opt.step(lr=..., decoupled_lr=...); opt.zero_grad()

A param group given with `is_decoupled_lr: True` (training.param_groups with --decoupled-lr: the word
embedding and output layer, Megatron's key) steps at `decoupled_lr`, every other group at `lr`.

`step` reads the device once (the global norm and the overflow test, one fp64 all-reduce pair: the
skip and clip decisions need them on the host, as Megatron's clip does); `step(votes=...)` adds
numbers to that same all-reduce, summed over every rank and kept in ``summed_votes`` (the exit
policy's signal and time-limit votes, so stopping costs no collective of its own).

The checkpoint code calls ``state_dict()`` / ``load_state_dict()`` (DeepSpeed's ZeRO layout,
see checkpoint_state.py).

`fp8_gather` and `expert_fp8_gather` (what the model converters' `weight_gather` gives, model/converters.py:
with --fp8-param-gather fp8/param_gather.py's Float8ParamGather, the experts' over the expert-data-parallel group)
have the layers they hold gathered with their weights in FP8 at stage 1/2 (packed_gather.py) and 3 (stage3_fp8.py):
published once when the optimizer is made (the first forward's FP8 weights) and after every step, always cast from
the fp32 masters (with an offloaded optimizer too: they are not uploaded in the training dtype first);
``state_dict()`` republishes the weights in the training dtype first, so a checkpoint is a bf16 run's, and
``refresh_fp8_weights()`` recasts them after a resume has restored the FP8 scaling state. At stage 1/2 the FP8
layers' weights in the training dtype are held from the optimizer's making (a resume loads into them) and from each
``state_dict()`` until the next step publishes: the FP8 weight is their one copy in training.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from ..distributed.device import HOST
from . import checkpoint_state
from .clip_grad import clip_coefficient, counts_in_norm, local_sums, norm_and_overflow, reduce_sums
from .loss_scaler import LossScaler, LossScalerConfig
from .offload import FlatAdamW
from .stage12 import Stage12

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def _dtype(d) -> torch.dtype:
    if isinstance(d, torch.dtype):
        if d not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be fp32, bf16 or fp16, got {d}")
        return d
    if d not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {d!r}")
    return DTYPES[d]


def _groups(named_params, defaults: dict):
    """Normalise to ([[(name, param)] per group], [hyper-parameters per group]); a group marked `muon` keeps the
    mark (optimizer/muon_zero.py steps it)."""
    items = list(named_params)
    if items and isinstance(items[0], dict):
        groups, hparams = [], []
        for g in items:
            groups.append([(n, p) for n, p in g["params"] if p.requires_grad])
            hparams.append({k: g.get(k, v) for k, v in defaults.items()} | ({"muon": True} if g.get("muon") else {}))
        return groups, hparams
    return [[(n, p) for n, p in items if p.requires_grad]], [dict(defaults)]


class ZeroOptimizer:
    def __init__(self, named_params, dp_group=None, stage: int = 1, lr: float = 1e-3,
                 betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 clip_grad: float = 0.0, mp_group=None, tp_rank: int = 0, dtype="fp32",
                 loss_scaler=None, offload: str = "none", nvme_path: Optional[str] = None,
                 bucket_size: int = 50_000_000, module: Optional[torch.nn.Module] = None,
                 layers=None, prefetch: bool = True, persistence_threshold: int = 100_000,
                 overlap_grad_reduce: bool = False, overlap_param_gather: bool = False,
                 quantized_weights: bool = False, quantized_gradients: bool = False, hpz_group=None,
                 device: Optional[torch.device] = None, grad_reduce_in_bf16: bool = False,
                 cpu_optimizer_threads: Optional[int] = None, expert_dp_group=None, muon=None, tp_group=None,
                 expert_tp_group=None, fp8_gather=None, expert_fp8_gather=None):
        if stage not in (0, 1, 2, 3):  # the stage picks the implementation below; no other value has one
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
        self.stage, self.dtype, self.clip_grad = stage, _dtype(dtype), float(clip_grad or 0.0)
        self.dp_group, self.mp_group, self.tp_rank = dp_group, mp_group, tp_rank
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, is_decoupled_lr=False)
        self.named_groups, hparams = _groups(named_params, defaults)
        self.names = [[n for n, _ in g] for g in self.named_groups]
        # every buffer lives beside the parameters (the model was built on the rank's device)
        self.device = device if device is not None else next(
            (p.device for g in self.named_groups for _, p in g), HOST)
        # --fp8-param-gather: the dense FP8 layers' gather over DP; with expert parallelism the experts' over expert-DP
        self.fp8_gather, self.expert_fp8_gather = fp8_gather, expert_fp8_gather
        self._fp8_gathers = [g for g in (self.fp8_gather, self.expert_fp8_gather) if g is not None]
        # --grad-reduce-in-bf16: stages 0-2 reduce gradient buckets in bf16 (the sums stay fp32)
        reduce_dtype = torch.bfloat16 if grad_reduce_in_bf16 else torch.float32
        # offload (ZeRO-Offload): the reduced fp32 gradient partitions live in host memory, beside the masters
        # the CPU Adam steps (zero/host_grads.py), not on the device
        grads_to_host = offload != "none"
        if expert_dp_group is not None:  # expert parallelism: expert parameters over their own group
            from .expert_stage import ExpertParallelStage, split_expert_groups
            dense, hparams, expert, expert_hp = split_expert_groups(self.named_groups, hparams)
            self.named_groups, hparams = dense + expert, hparams + expert_hp
            self.names = [[n for n, _ in g] for g in self.named_groups]
            if stage == 3:
                from .expert_stage3 import ExpertParallelStage3
                self.impl = ExpertParallelStage3(dense, expert, dp_group, expert_dp_group, self.dtype, bucket_size,
                                                 module, self.device, layers=layers, prefetch=prefetch,
                                                 persistence_threshold=persistence_threshold,
                                                 fp8_gather=self.fp8_gather, expert_fp8_gather=self.expert_fp8_gather,
                                                 grads_to_host=grads_to_host)
            else:
                self.impl = ExpertParallelStage(dense, expert, dp_group, expert_dp_group, stage, self.dtype,
                                                bucket_size, self.device, grad_reduce_dtype=reduce_dtype,
                                                overlap_grad_reduce=overlap_grad_reduce,
                                                overlap_param_gather=overlap_param_gather, module=module,
                                                fp8_gather=self.fp8_gather, expert_fp8_gather=self.expert_fp8_gather,
                                                grads_to_host=grads_to_host)
        elif stage == 3:
            from .stage3 import Stage3
            from .stage3_zeropp import Stage3ZeroPP
            zeropp = {"quantized_weights": quantized_weights, "quantized_gradients": quantized_gradients,
                      "hpz_group": hpz_group}
            cls, extra = (Stage3ZeroPP, zeropp) if any(zeropp.values()) else (Stage3, {})
            if self.fp8_gather is not None:
                from .stage3_fp8 import Stage3Float8
                cls, extra = Stage3Float8, {"fp8_gather": self.fp8_gather}
            self.impl = cls(self.named_groups, dp_group, self.dtype, bucket_size, module=module, layers=layers,
                            prefetch=prefetch, persistence_threshold=persistence_threshold, device=self.device,
                            grads_to_host=grads_to_host, **extra)
        elif overlap_grad_reduce or overlap_param_gather:
            from .stage12_overlap import Stage12Overlap
            self.impl = Stage12Overlap(self.named_groups, dp_group, stage, self.dtype, bucket_size,
                                       overlap_grad_reduce, overlap_param_gather, module=module, device=self.device,
                                       grad_reduce_dtype=reduce_dtype, fp8_gather=self.fp8_gather,
                                       grads_to_host=grads_to_host)
        else:
            self.impl = Stage12(self.named_groups, dp_group, stage, self.dtype, bucket_size, self.device,
                                grad_reduce_dtype=reduce_dtype, fp8_gather=self.fp8_gather,
                                grads_to_host=grads_to_host)
        self.partition_count = self.impl.dp
        self.dp_rank = self.impl.rank
        tag = f"dp{dist.get_rank(dp_group) if dp_group is not None else 0}" + (
            f"_rank{dist.get_rank()}" if dist.is_initialized() else "")
        # offloaded from a GPU: each stepped chunk goes up straight into the stage's weight buffers (in the
        # training dtype: not with --fp8-param-gather, whose FP8 weights are cast from the fp32 masters)
        uploads = (self.impl.weight_slices() if offload != "none" and self.device != HOST and not self._fp8_gathers
                   else None)
        self.optimizer = FlatAdamW(self.impl.initial_masters, hparams, offload, nvme_path, tag=tag,
                                   device=self.device, weight_slices=uploads, cpu_threads=cpu_optimizer_threads,
                                   host_grads=getattr(self.impl, "grads_on_host", False))
        del self.impl.initial_masters
        self.offload = offload
        self.muon = None  # `muon` (optimizer/muon.py's MuonSettings): the groups marked `muon` step by Muon
        if muon is not None:
            from ..optimizer.muon_zero import MuonStep
            self.muon = MuonStep(muon, self.impl, self.named_groups,
                                 [gi for gi, h in enumerate(self.optimizer.param_groups) if h.get("muon")],
                                 tp_group, expert_tp_group)
        # fp16: dynamic or static; bf16: a static scale when one is given (Megatron-LM's --loss-scale with --bf16)
        static = not LossScalerConfig.from_any(loss_scaler).dynamic
        self.loss_scaler = LossScaler(loss_scaler, enabled=self.dtype == torch.float16 or
                                      (self.dtype == torch.bfloat16 and static))
        self.overflow = False
        self.summed_votes: List[float] = []  # the last step's votes, summed over every rank
        self._before_step = []  # callables run before the state next changes (async checkpoint readers)
        self.after_update = []  # callables given the updated masters before a step publishes them
        # (offset in partition, numel) of the fragments that count in the global norm
        here = getattr(self.impl, "counts_in_norm_here", lambda gi: True)  # whole replicas: one of them counts
        self.counted = [[(s, n) for p, _, s, n in self.impl.owned_ranges(gi) if counts_in_norm(p, tp_rank)]
                        if here(gi) else [] for gi in range(len(self.named_groups))]
        self.norm_groups = [self.dp_group if self.impl.dp > 1 or getattr(self.impl, "norm_over_dp", False) else None,
                            self.mp_group]
        if self._fp8_gathers:  # the first forward's FP8 weights
            with self.optimizer.paged():
                self.impl.write_weights(self.optimizer.weights())

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    # ---- the training-loop face ---------------------------------------------------
    def backward(self, loss: torch.Tensor, retain_graph: bool = False):
        """loss.backward(), scaled by the loss scale for fp16; stage 2/3 reduce their last bucket."""
        scale = self.loss_scaler.loss_scale
        (loss.float() * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
        self.impl.finish_backward()

    def before_next_step(self, fn) -> None:
        """Call fn() at the start of the next step(), before any saved state changes (an async save reading it)."""
        self._before_step.append(fn)

    def arm_grad_reduce(self, params=None):
        """Called before the global batch's last backward (of `params`; None: of every parameter): with
        overlap_grad_reduce, stage 0/1 reduce each gradient as soon as that backward has produced it."""
        if hasattr(self.impl, "arm"):
            self.impl.arm(params)

    def wait_params(self):
        """With overlap_param_gather, wait for the weights the last step is still gathering."""
        if hasattr(self.impl, "wait_params"):
            self.impl.wait_params()

    def step(self, lr: Optional[float] = None, votes: Sequence[float] = (), decoupled_lr: Optional[float] = None,
             riders: Optional[torch.Tensor] = None, gate=None):
        """Reduce, unscale, check overflow, clip, step, publish weights. -> (updated, grad_norm).
        `votes`: summed over every rank with the gradient norm, into ``summed_votes``; `decoupled_lr`: the lr
        of the groups marked is_decoupled_lr (required when there are any and `lr` is given). `riders` (a
        device tensor) are summed the same way and handed, with the norm and the overflow test, to
        `gate(norm, overflow, summed_riders)`: False leaves weights, optimizer state and loss scale as they
        were (the gradients dropped) and returns (False, norm) (reliability/rerun.py)."""
        self._state_about_to_change()
        self.impl.finish_backward()  # idempotent: for schedules that call loss.backward() themselves
        grads = self.impl.grad_partitions()
        inv = 1.0 / (self.loss_scaler.loss_scale * self.impl.reduce_dp)
        for g in grads:
            g.mul_(inv)
        sums = reduce_sums(local_sums(grads, self.counted, self.device, votes, riders), self.norm_groups)
        norm, overflow, summed = norm_and_overflow(sums)
        self.summed_votes = summed[:len(votes)]
        self.overflow = overflow
        if gate is not None and not gate(norm, overflow, summed[len(votes):]):
            self.zero_grad()
            return False, norm
        if overflow:
            self.loss_scaler.update(True)
            self.zero_grad()
            return False, norm
        coef = clip_coefficient(norm, self.clip_grad)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        if lr is not None:
            for group in self.optimizer.param_groups:
                if group.get("is_decoupled_lr") and decoupled_lr is None:
                    raise ValueError("this optimizer has a decoupled-lr param group; step(lr=...) needs decoupled_lr")
                group["lr"] = decoupled_lr if group.get("is_decoupled_lr") else lr
        self.wait_params()  # the step writes this rank's weights, which the last gathers read
        with self.optimizer.paged():
            if self.muon is not None:
                self.muon.step(self.optimizer, grads)
                grads = self.muon.adam_grads(grads)
            self.optimizer.step(grads)
            for update in self.after_update:  # e.g. QK-clip's scaling of q and k (optimizer/qk_clip.py)
                update(self.optimizer.params)
            self.impl.write_weights(self.optimizer.weights())
        self._release_fp8_weights()
        self.loss_scaler.update(False)
        self.zero_grad()
        return True, norm

    def params_norm(self) -> float:
        """L2 norm of the whole model's fp32 master weights, each element once (Megatron's params-norm).

        A collective over the DP and model-parallel groups, counted as the gradient norm is; it runs on the
        device even where the masters live in host memory (--cpu-optimizer, NVMe)."""
        with self.optimizer.paged() as masters:
            sums = local_sums(masters, self.counted, self.device)
        return norm_and_overflow(reduce_sums(sums, self.norm_groups))[0]

    def zero_grad(self, set_to_none: bool = True):
        self.impl.zero_grad()

    # ---- checkpoints ----------------------------------------------------------------
    def state_dict(self) -> dict:
        self.wait_params()  # the checkpoint's model files are read next
        if self._fp8_gathers:  # a bf16 run's weights in those files, not the FP8 ones dequantized
            with self.optimizer.paged():
                self.impl.write_weights(self.optimizer.weights(), fp8=False)
        return checkpoint_state.state_dict(self)

    def refresh_fp8_weights(self) -> None:
        """--fp8-param-gather: cast and gather the FP8 weights again from the masters, recording no amax (a
        resume, after the FP8 scaling state was restored: the FP8 weights the saved run had)."""
        if not self._fp8_gathers:
            return
        self.wait_params()
        with contextlib.ExitStack() as stack:
            for g in self._fp8_gathers:
                stack.enter_context(g.without_recording())
            with self.optimizer.paged():
                self.impl.write_weights(self.optimizer.weights())
        self._release_fp8_weights()

    def _release_fp8_weights(self) -> None:
        """Stage 1/2 with --fp8-param-gather: the FP8 layers' weights in the training dtype dropped, once the
        FP8 weights are published (stage 3 holds them only while its units are gathered)."""
        if self.stage < 3:
            for g in self._fp8_gathers:
                g.release()

    def load_state_dict(self, state: dict):
        self._state_about_to_change()
        checkpoint_state.load_state_dict(self, state)

    def _state_about_to_change(self) -> None:
        while self._before_step:
            self._before_step.pop(0)()

    def param_slice_mappings(self):
        """Per group: OrderedDict name -> fragment_address(numel, start) in this rank's partition."""
        return self.impl.slice_mappings(self.names)

    # ---- measurement -----------------------------------------------------------------
    def memory_bytes(self) -> dict:
        """Bytes of tensors this rank holds now: model parameters, gradients (on the device), optimizer state,
        and under offload the gradients held on the host."""
        out = {"params": self.impl.param_bytes(), "grads": self.impl.grad_bytes(),
               "optimizer_state": self.optimizer.state_bytes()}
        if getattr(self.impl, "grads_on_host", False):  # offload: the gradient partitions (and slots) on the host
            out["host_grads"] = self.impl.host_grad_bytes()
        return out
