"""Multi-tensor AdamW: every parameter of a group updated by one CUDA launch.

On the CPU, fp32 tensors are stepped one by one by the C++ kernel of cpu_adam (one pass
over each tensor). Fallback: the same per-tensor math as torch.optim.AdamW (cpu_adam's reference).
All tensors are updated in place; `step` counts this update (1 on the first).
`MultiTensorAdamW` is the torch.optim.Optimizer face the on-device ZeRO step uses.
"""
import torch

from .cpu_adam import AdamWBase, adamw_step_
from .fusion_flags import use_fused
from .registry import load, warn_fallback_once

_EXT = "megatron_zero._C_cuda"


def _kernel_fits(lists):
    return all(t.is_cuda and t.dtype == torch.float32 and t.is_contiguous()
               for ts in lists for t in ts)


def multi_tensor_adamw_(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1=0.9,
                        beta2=0.999, eps=1e-8, weight_decay=0.0, fused=None):
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    if len({len(x) for x in lists}) != 1:
        raise ValueError("multi_tensor_adamw_: params, grads, exp_avgs and exp_avg_sqs "
                         f"must have equal lengths, got {[len(x) for x in lists]}")
    if not params:
        return
    if use_fused("multi_tensor_adam_fusion", fused) and _kernel_fits(lists):
        if load(_EXT) is None:
            warn_fallback_once("multi_tensor_adam", "megatron_zero._C_cuda is not built")
        else:
            return load(_EXT).multi_tensor_adamw(list(params), list(grads), list(exp_avgs),
                                                 list(exp_avg_sqs), int(step), lr, beta1,
                                                 beta2, eps, weight_decay)
    for p, g, m, v in zip(*lists):  # cpu_adam's C++ step where it fits, its reference elsewhere
        adamw_step_(p, g, m, v, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                    weight_decay=weight_decay, fused=fused)


class MultiTensorAdamW(AdamWBase):
    """torch.optim.AdamW (same update, same state keys) stepping each param group with one
    `multi_tensor_adamw_` call: the CUDA kernel where the tensors fit it, the fallback elsewhere."""

    def _update(self, group, params, states):
        beta1, beta2 = group["betas"]
        by_step = {}  # parameters whose step counts agree go in one launch
        for p, state in zip(params, states):
            by_step.setdefault(int(state["step"].item()), []).append((p, state))
        for step, pairs in by_step.items():
            multi_tensor_adamw_([p for p, _ in pairs], [p.grad for p, _ in pairs],
                                [s["exp_avg"] for _, s in pairs], [s["exp_avg_sq"] for _, s in pairs],
                                step=step, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                                weight_decay=group["weight_decay"], fused=self.fused)
