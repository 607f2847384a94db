"""Megatron's interleaved 1F1B: each rank runs v model chunks (virtual stages) of the pipeline.

With pp ranks and v chunks per rank, the k-th forward of a rank runs chunk (k mod pp v) // pp on
micro-batch (k // pp v) pp + k mod pp, so micro-batches go through the chunks in groups of pp; the
backwards walk the chunks in reverse (`chunk_of`, `micro_batch_of`). Rank r first runs
(pp - r - 1) 2 + (v - 1) pp forwards (warm-up; all M v when M = pp), then one forward one backward,
then the cool-down backwards. The bubble shrinks by v against plain 1F1B (schedule.py) for v times
the transfers; the number of micro-batches M must be a multiple of pp (config/parallel.py refuses others).

Transfers go around the ring of pipeline ranks (gpt_stage.stage_p2p): the last rank's chunk k feeds
the first rank's chunk k + 1. Each step is one `P2P.communicate` batch (send the output and the
input gradient just computed, receive the next step's input and output gradient), with Megatron's
rules for who sends and receives, so every rank's batches pair up with its neighbours'.

`forward_step(i, x, chunk)` runs chunk `chunk` on micro-batch i (x: the received activation, None on
the first rank's chunk 0) and returns its output, or on the last rank's last chunk the loss / M.
`backward_loss(loss)` starts that chunk's backward (the optimizer's). `before_last_backward(chunk)`
runs just before each chunk's last backward (micro-batch M - 1): Megatron's per-chunk grad-sync
switch, with --overlap-grad-reduce each chunk's gradients are reduced during that backward.
"""
from __future__ import annotations

import functools
from typing import Callable, List, Optional

import torch

from .p2p import P2P
from .schedule import ScheduleStats, forward_backward


def chunk_of(k: int, pp: int, v: int, forward: bool = True) -> int:
    """The model chunk of a rank's k-th forward (or backward)."""
    chunk = (k % (pp * v)) // pp
    return chunk if forward else v - 1 - chunk


def micro_batch_of(k: int, pp: int, v: int) -> int:
    """The micro-batch of a rank's k-th forward (or backward) on its chunk."""
    return (k // (pp * v)) * pp + k % pp


def warmup_forwards(pp: int, v: int, rank: int, m: int) -> int:
    """Forwards before the first backward: Megatron's (pp - rank - 1) 2 + (v - 1) pp, or all when M = pp."""
    if m == pp:
        return m * v
    return min((pp - rank - 1) * 2 + (v - 1) * pp, m * v)


def forward_backward_interleaved(forward_step: Callable, num_micro_batches: int, p2p: P2P, stage: int,
                                 num_stages: int, num_chunks: int, backward_loss: Callable = None,
                                 forward_only: bool = False, stats: Optional[ScheduleStats] = None,
                                 before_last_backward: Optional[Callable] = None) -> List[torch.Tensor]:
    """Run the schedule; returns the (detached) micro-batch losses on the last rank, [] elsewhere."""
    pp, v, m = num_stages, num_chunks, num_micro_batches
    if m % pp:
        raise ValueError(f"the interleaved schedule needs the number of micro-batches ({m}) to be a multiple "
                         f"of the pipeline size ({pp})")
    backward_loss = backward_loss or (lambda loss: loss.backward())
    stats = stats or ScheduleStats()
    first, last = stage == 0, stage == num_stages - 1
    total = m * v
    warmup = total if forward_only else warmup_forwards(pp, v, stage, m)
    steady = total - warmup
    inputs: List[list] = [[] for _ in range(v)]
    outputs: List[list] = [[] for _ in range(v)]
    grads: List[list] = [[] for _ in range(v)]
    losses: List[torch.Tensor] = []

    def virtual_first(chunk):
        return first and chunk == 0

    def virtual_last(chunk):
        return last and chunk == v - 1

    def run_forward(k):
        chunk = chunk_of(k, pp, v)
        if len(inputs[chunk]) == len(outputs[chunk]):  # nothing received: the first rank's chunk 0
            inputs[chunk].append(None)
        y = forward_step(micro_batch_of(k, pp, v), inputs[chunk][-1], chunk)
        outputs[chunk].append(y)
        if virtual_last(chunk):
            losses.append(y.detach())
        if forward_only:
            inputs[chunk].pop()
            outputs[chunk].pop()
        stats.max_in_flight = max(stats.max_in_flight, sum(len(o) for o in outputs))
        return None if virtual_last(chunk) else y

    def run_backward(k):
        chunk = chunk_of(k, pp, v, forward=False)
        if virtual_last(chunk) and not grads[chunk]:
            grads[chunk].append(None)
        x, y, grad_y = inputs[chunk].pop(0), outputs[chunk].pop(0), grads[chunk].pop(0)
        if micro_batch_of(k, pp, v) == m - 1 and before_last_backward is not None:
            before_last_backward(chunk)
        if virtual_last(chunk):
            backward_loss(y)
        else:
            torch.autograd.backward(y, grad_tensors=grad_y)
        return None if virtual_first(chunk) else x.grad

    inputs[0].append(None if first else p2p.communicate(recv_prev=True)[0])
    for k in range(warmup):
        y = run_forward(k)
        next_chunk = chunk_of(k + 1, pp, v)
        recv_prev = not (first and next_chunk == 0) and k != total - 1
        if k == warmup - 1 and steady > 0:  # the last warm-up step also receives the first output gradient
            x, grad_y = p2p.communicate(send_next=y, recv_prev=recv_prev, recv_next=not last)
            grads[v - 1].append(grad_y)
        else:
            x, _ = p2p.communicate(send_next=y, recv_prev=recv_prev)
        inputs[next_chunk].append(x)

    for j in range(steady):
        fk, bk = warmup + j, j
        y = run_forward(fk)
        grad_x = run_backward(bk)
        # Which chunk the next input and output gradient are for; the first rank runs pp - 1 forwards
        # ahead of the last, so it asks what the last rank's step sent it, and the last rank likewise.
        if first:
            prev_chunk = chunk_of(fk - (pp - 1), pp, v)
            recv_prev, next_chunk = prev_chunk != v - 1, prev_chunk + 1
        else:
            recv_prev, next_chunk = True, chunk_of(fk + 1, pp, v)
        if last:
            from_chunk = chunk_of(bk - (pp - 1), pp, v, forward=False)
            recv_next, grad_chunk = from_chunk != 0, from_chunk - 1
        else:
            recv_next, grad_chunk = True, chunk_of(bk + 1, pp, v, forward=False)
        recv_prev = recv_prev and j != steady - 1
        x, grad_y = p2p.communicate(send_next=y, recv_prev=recv_prev, send_prev=grad_x, recv_next=recv_next)
        if recv_prev:
            inputs[next_chunk].append(x)
        if recv_next:
            grads[grad_chunk].append(grad_y)

    if forward_only:
        return losses
    if steady == 0:
        grads[v - 1].append(None if last else p2p.communicate(recv_next=True)[1])
    for k in range(steady, total):
        grad_x = run_backward(k)
        next_chunk = chunk_of(k + 1, pp, v, forward=False)
        recv_next = not (last and next_chunk == v - 1) and k != total - 1
        _, grad_y = p2p.communicate(send_prev=grad_x, recv_next=recv_next)
        grads[next_chunk].append(grad_y)
    return losses


def schedule_for(num_chunks: int) -> Callable:
    """forward_backward(forward_step, M, p2p, stage, num_stages, ...) for a stage of `num_chunks` model
    chunks: plain 1F1B (schedule.py) for one, interleaved for more."""
    if num_chunks == 1:
        return forward_backward
    return functools.partial(forward_backward_interleaved, num_chunks=num_chunks)
