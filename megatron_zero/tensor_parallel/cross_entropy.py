"""Cross-entropy over logits whose vocabulary dimension is split across TP ranks.

Numerically stable without gathering the logits: two all-reduces over the TP
group (max of the logits; the target's logit and the sum of exp(logit - max) stacked in one).
Columns whose global index is >= `vocab_size` (vocabulary padding) are set to
-inf first, so they never count in the loss and their gradient is exactly zero.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed import shm_comm
from ..ops.exp_rows import exp_shifted_rows
from .utils import tp_rank_in, tp_world_size


def all_reduce_over_tp(x, group, op=dist.ReduceOp.SUM):
    """x reduced over the TP group in place (nothing to do at TP 1); returns x."""
    if tp_world_size(group) > 1:
        shm_comm.all_reduce(x, group, op)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size):
        ctx.input_dtype = logits.dtype
        local = logits.shape[-1]
        start = tp_rank_in(group) * local
        logits = logits.float()
        if vocab_size is not None and start + local > vocab_size:
            padded = torch.arange(start, start + local, device=logits.device) >= vocab_size
            logits = logits.masked_fill(padded, float("-inf"))

        logits_max = all_reduce_over_tp(logits.amax(dim=-1), group, dist.ReduceOp.MAX)

        outside = (target < start) | (target >= start + local)
        local_target = (target - start).masked_fill(outside, 0)
        predicted = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) - logits_max
        predicted = predicted.masked_fill(outside, 0.0)
        exp_logits, sum_exp = exp_shifted_rows(logits, logits_max)  # a new tensor, this function's own
        predicted, sum_exp = all_reduce_over_tp(torch.stack([predicted, sum_exp]), group).unbind(0)
        loss = sum_exp.log() - predicted

        ctx.save_for_backward(exp_logits, sum_exp, outside, local_target)
        ctx.backward_done = False
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.backward_done:
            raise RuntimeError("vocab_parallel_cross_entropy: its backward turns the saved exponentials into the "
                               "gradient in place, so it runs once (no retain_graph through the loss)")
        ctx.backward_done = True
        exp_logits, sum_exp, outside, local_target = ctx.saved_tensors
        # (softmax - one_hot(target)) * grad_loss, in place as Megatron's (saves a copy of the logits' size);
        # the softmax's division by sum_exp rides in the same pass as the scaling
        grad = exp_logits.mul_((grad_loss / sum_exp).unsqueeze(-1))
        hit = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(hit * grad_loss).unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, group=None, vocab_size=None):
    """Per-token loss [*] from logits [*, V/tp] (this rank's vocabulary slice) and targets [*].

    `vocab_size` is the unpadded vocabulary; columns at or beyond it are ignored.
    """
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, group, vocab_size)
