"""The output layer and the vocab-parallel cross-entropy in one, by vocabulary chunks: the [tokens, vocab]
logits never exist at once (--cross-entropy-loss-fusion, on by default: GPTModel.fused_output_loss, set by
model/output_loss_converter.py).

    losses = vocab_parallel_linear_cross_entropy(hidden, weight, target, group, vocab_size, sequence_parallel)
    # the same per-token losses as
    # vocab_parallel_cross_entropy(<the column-parallel linear of hidden by weight>, target, group, vocab_size)

Forward: this rank's vocabulary slice (the weight's rows) is cut into chunks of CHUNKS-th of its columns
(at least MIN_CHUNK_COLUMNS). Each chunk's logits, hidden @ W_c^T (in the model dtype, as F.linear, then
fp32), update a running max and a running sum of exp(logit - max) per token (the online softmax) and give
the target's logit where the chunk holds it. Columns at or beyond `vocab_size` (padding) are never
computed: their logits never count and their weight gradient is zero. Across TP ranks the combination
of cross_entropy.py: one all-reduce of the max, one of [the target's logit, the sum rescaled to that max].
Saved for backward: the hidden states, the weight, the targets and two fp32 numbers per token.

Backward: each chunk's logits again (one GEMM), softmax - one_hot scaled by the loss gradient, cast to
the model dtype (as the unfused backward does); the chunk's weight-gradient rows are one GEMM over all
tokens written in place (its accumulation is the GEMM's, fp32); the hidden gradient sums the chunks'
products in an fp32 buffer. Summing it over TP is the caller's mapping of `hidden`: the all-reduce of
copy_to_tensor_model_parallel_region, or the sequence-parallel gather's reduce-scatter.

Memory beyond the inputs and the weight gradient: one chunk's fp32 logits (which become its gradient in
place), a model-dtype copy of it in bf16/fp16, and [tokens, hidden] fp32 for the hidden gradient; the
unfused path holds the whole logits and their exponentials (bench/bench_output_loss.py measures both).
No host reads: chunk bounds come from shapes, targets are tested on the device.

Small logits take the unchunked path (`chunked=None`, the default, decides by size): below UNCHUNKED_BELOW_BYTES
of fp32 logits per rank, the memory saved is small next to the activations while the backward's recompute
of the logits is a whole extra output-layer GEMM (at the CPU bench's 1024 tokens x 1024 columns a step took
about 3.5 % longer fused); there the output layer is a plain F.linear and the loss cross_entropy.py's.

Why PyTorch ops and not a Triton kernel (Liger-Kernel's fused linear cross-entropy): the time is in the
GEMMs, which here are all tokens x V/16 columns (cuBLAS-sized on a GPU; a token-chunked kernel runs
small-M GEMMs), the same code is exact against the unfused loss and runs on the CPU test machines, and it
is vocab-parallel under TP, which Liger's kernel is not. The cost is the backward's recompute of the logits.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .cross_entropy import all_reduce_over_tp, vocab_parallel_cross_entropy
from .mappings import copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region
from .utils import tp_rank_in, tp_world_size

CHUNKS = 16  # a chunk is 1/16 of the rank's logits: 0.06x their bytes, GEMMs of all tokens x V/16 columns
MIN_CHUNK_COLUMNS = 256
UNCHUNKED_BELOW_BYTES = 64 << 20  # a rank's fp32 logits under 64 MiB: computed whole (the module's docstring)


def chunk_columns(local_vocab: int) -> int:
    """Columns per chunk of a rank's `local_vocab`: a 1/CHUNKS share rounded up to 128, at least MIN_CHUNK_COLUMNS."""
    share = -(-local_vocab // CHUNKS)
    return max(MIN_CHUNK_COLUMNS, -(-share // 128) * 128)


def _valid_columns(local: int, start: int, vocab_size) -> int:
    """How many of this rank's columns [start, start + local) lie below the unpadded vocabulary."""
    return local if vocab_size is None else max(0, min(local, vocab_size - start))


def _target_in_chunk(local_target, c0: int, c1: int):
    """(whether each token's target is in columns [c0, c1), its column there, clamped in range)."""
    inside = (local_target >= c0) & (local_target < c1)
    return inside, (local_target - c0).clamp(0, c1 - c0 - 1).unsqueeze(-1)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, group, vocab_size):
        x, t = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
        local = weight.shape[0]
        start = tp_rank_in(group) * local
        valid, width = _valid_columns(local, start, vocab_size), chunk_columns(local)
        local_t = t - start
        run_max = torch.full(t.shape, float("-inf"), dtype=torch.float32, device=x.device)
        run_sum = torch.zeros(t.shape, dtype=torch.float32, device=x.device)
        target_logit = torch.zeros(t.shape, dtype=torch.float32, device=x.device)
        for c0 in range(0, valid, width):
            c1 = min(c0 + width, valid)
            logits = F.linear(x, weight[c0:c1]).float()
            inside, column = _target_in_chunk(local_t, c0, c1)
            target_logit = torch.where(inside, logits.gather(-1, column).squeeze(-1), target_logit)
            new_max = torch.maximum(run_max, logits.amax(dim=-1))
            chunk_sum = logits.sub_(new_max.unsqueeze(-1)).exp_().sum(dim=-1)
            run_sum = run_sum.mul_((run_max - new_max).exp_()).add_(chunk_sum)
            run_max = new_max
            del logits
        global_max = all_reduce_over_tp(run_max.clone(), group, dist.ReduceOp.MAX)
        rescaled = run_sum.mul_((run_max - global_max).exp_())  # a rank without columns: 0 * exp(-inf) = 0
        mine = (local_t >= 0) & (local_t < valid)
        predicted = torch.where(mine, target_logit - global_max, torch.zeros_like(target_logit))
        predicted, sum_exp = all_reduce_over_tp(torch.stack([predicted, rescaled]), group).unbind(0)
        loss = sum_exp.log() - predicted
        ctx.save_for_backward(hidden, weight, target, global_max, sum_exp)
        ctx.group, ctx.start, ctx.valid, ctx.width = group, start, valid, width
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, target, global_max, sum_exp = ctx.saved_tensors
        x, local_t = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1) - ctx.start
        g = grad_loss.reshape(-1).float()
        scale = (g / sum_exp).unsqueeze(-1)
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if want_x else None
        grad_w = None
        if want_w:
            grad_w = torch.empty_like(weight)
            grad_w[ctx.valid:].zero_()  # the padding's rows
        for c0 in range(0, ctx.valid, ctx.width):
            c1 = min(c0 + ctx.width, ctx.valid)
            w_c = weight[c0:c1]
            # (softmax - one_hot(target)) * grad_loss, the softmax's division riding in the scale
            grad = F.linear(x, w_c).float().sub_(global_max.unsqueeze(-1)).exp_().mul_(scale)
            inside, column = _target_in_chunk(local_t, c0, c1)
            grad.scatter_add_(-1, column, -(g * inside).unsqueeze(-1))
            grad = grad.to(x.dtype)
            if want_x:
                if grad.dtype == torch.float32:
                    grad_x.addmm_(grad, w_c)
                else:
                    grad_x.add_(grad.mm(w_c))
            if want_w:
                torch.mm(grad.t(), x, out=grad_w[c0:c1])
            del grad
        grad_x = grad_x.to(hidden.dtype).view(hidden.shape) if want_x else None
        return grad_x, grad_w, None, None, None


def worth_chunking(tokens: int, local_vocab: int) -> bool:
    """Whether a rank's [tokens, local_vocab] fp32 logits are big enough to compute by chunks."""
    return 4 * tokens * local_vocab >= UNCHUNKED_BELOW_BYTES


def vocab_parallel_linear_cross_entropy(hidden, weight, target, group=None, vocab_size=None,
                                        sequence_parallel: bool = False, chunked=None):
    """Per-token loss [*] of the output layer `weight` [V/tp, h] (this rank's vocabulary rows) applied to
    `hidden` [*, h] ([b, s/tp, h] sequence-parallel: gathered here) against `target` [*].

    `vocab_size` is the unpadded vocabulary; rows at or beyond it are ignored (their gradient is zero).
    `chunked`: by vocabulary chunks (True), the whole logits (False), or by their size (None: worth_chunking)."""
    if sequence_parallel and tp_world_size(group) > 1:
        hidden = gather_from_sequence_parallel_region(hidden, group)
    elif tp_world_size(group) > 1:
        hidden = copy_to_tensor_model_parallel_region(hidden, group)
    if chunked is None:
        chunked = worth_chunking(target.numel(), weight.shape[0])
    if not chunked:
        return vocab_parallel_cross_entropy(F.linear(hidden, weight), target, group, vocab_size)
    return _LinearCrossEntropy.apply(hidden, weight, target, group, vocab_size)
