"""AdamW on the CPU: the fused C++ step (csrc/cpu) or the same math in PyTorch.

`adamw_step_` is what a ZeRO-Offload optimizer calls on its flat fp32
partition; it can also write the bf16/fp16 copy of the new weights in the same
pass. `CPUAdamW` wraps it as a torch.optim.Optimizer with torch.optim.AdamW's
state keys (step, exp_avg, exp_avg_sq), so checkpoints are interchangeable.

The fused step runs on as many threads as its caller says (`threads`): ZeRO-Offload
passes --cpu-optimizer-threads, whose default `default_offload_threads()` is this
rank's share of the node's cores (torch's own intra-op count is 1 per rank under
torchrun). The result does not depend on the thread count, bit for bit.
"""
import os

import torch

from ..distributed.device import HOST
from .fusion_flags import use_fused
from .registry import load, warn_fallback_once

_EXT = "megatron_zero._C_cpu_adam"


def adamw_reference_(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps,
                     weight_decay, low_out=None):
    """torch.optim.AdamW's single-tensor update, op for op (the fallback)."""
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    if low_out is not None:
        low_out.copy_(param.view_as(low_out))


def default_offload_threads(environ=None) -> int:
    """This rank's share of the cores it may run on: the CPUs in its affinity mask, divided among the
    ranks on this node (LOCAL_WORLD_SIZE from torchrun, SLURM_NTASKS_PER_NODE) unless a launcher has
    already bound the rank to fewer CPUs than the machine has (then the mask is its share)."""
    env = os.environ if environ is None else environ
    mine = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if mine < (os.cpu_count() or mine):
        return max(1, mine)
    local = env.get("LOCAL_WORLD_SIZE") or env.get("SLURM_NTASKS_PER_NODE") or "1"
    ranks = int(local) if local.isdigit() and int(local) > 0 else 1
    return max(1, mine // ranks)


def _kernel_fits(*tensors):
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
               for t in tensors)


def adamw_step_(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1=0.9, beta2=0.999,
                eps=1e-8, weight_decay=0.0, low_out=None, fused=None, threads=None):
    """One in-place AdamW step; `step` counts this update (1 on the first).

    low_out, if given, is a bf16/fp16 tensor with param's number of elements
    that receives param's new value cast to its dtype. threads: how many threads
    the fused kernel runs on (default: torch's intra-op thread count).
    """
    step = int(step)
    if step < 1:
        raise ValueError(f"adamw_step_: step must be >= 1 (this update's count), got {step}")
    threads = torch.get_num_threads() if threads is None else int(threads)
    if threads < 1:
        raise ValueError(f"adamw_step_: threads must be at least 1, got {threads}")
    if use_fused("cpu_adam_fusion", fused) and _kernel_fits(param, grad, exp_avg, exp_avg_sq):
        ext = load(_EXT)
        if ext is not None:
            ext.adam_step(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps,
                          weight_decay, low_out, threads)
            return
        warn_fallback_once("cpu_adam", "the C++ extension was not built")
    adamw_reference_(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1,
                     beta2=beta2, eps=eps, weight_decay=weight_decay, low_out=low_out)


class AdamWBase(torch.optim.Optimizer):
    """torch.optim.AdamW's hyper-parameters and state keys (step on the host, exp_avg, exp_avg_sq);
    subclasses say how `_update(group, params, states)` steps a group's parameters that have a gradient."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 fused=None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.fused = fused

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=HOST)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
            self._update(group, params, [self.state[p] for p in params])
        return loss

    def _update(self, group, params, states):
        raise NotImplementedError


class CPUAdamW(AdamWBase):
    """torch.optim.AdamW for CPU fp32 parameters, stepped by the fused kernel."""

    def _update(self, group, params, states):
        beta1, beta2 = group["betas"]
        for p, state in zip(params, states):
            adamw_step_(p, p.grad, state["exp_avg"], state["exp_avg_sq"],
                        step=int(state["step"].item()), lr=group["lr"], beta1=beta1,
                        beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                        fused=self.fused)
