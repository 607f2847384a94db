"""Forward and backward over the micro-batches of one global batch.

`forward_backward` is the single entry point: with one stage it runs each
micro-batch's forward and backward in turn; with several it runs the 1F1B
schedule (warm-up of pp - stage - 1 forwards, then one forward one backward,
then the cool-down backwards), so stage s holds at most pp - s micro-batches
of activations, and frees each as soon as its backward is done.

`forward_step(i, x)` runs this stage on micro-batch i (x: the received
activation, None on the first stage) and returns the activation to send, or on
the last stage the loss of that micro-batch (already divided by the number of
micro-batches). `backward_loss(loss)` starts the backward on the last stage
(the optimizer's, which applies the fp16 loss scale). `before_last_backward()`, if given,
runs just before the last micro-batch's backward (Megatron's grad-sync switch: with
--overlap-grad-reduce, ZeRO 0/1 reduce each gradient as that backward produces it).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from ..distributed import shm_comm
from ..distributed.device import HOST

from .p2p import P2P


@dataclass
class ScheduleStats:
    max_in_flight: int = 0  # most micro-batches whose activations were held at once


def _backward(x, y, grad_y, is_last, backward_loss, count_backward):
    count_backward()
    if is_last:
        backward_loss(y)
    else:
        torch.autograd.backward(y, grad_tensors=grad_y)
    return x.grad if x is not None else None


def forward_backward(forward_step: Callable, num_micro_batches: int, p2p: Optional[P2P],
                     stage: int, num_stages: int, backward_loss: Callable = None,
                     forward_only: bool = False, stats: Optional[ScheduleStats] = None,
                     before_last_backward: Optional[Callable] = None) -> List[torch.Tensor]:
    """Run the schedule; returns the (detached) micro-batch losses on the last stage, [] elsewhere."""
    backward_loss = backward_loss or (lambda loss: loss.backward())
    backwards_done = [0]

    def count_backward():
        if backwards_done[0] == num_micro_batches - 1 and before_last_backward is not None:
            before_last_backward()
        backwards_done[0] += 1

    stats = stats or ScheduleStats()
    is_first, is_last = stage == 0, stage == num_stages - 1
    losses: List[torch.Tensor] = []
    m = num_micro_batches

    if num_stages == 1:
        for i in range(m):
            loss = forward_step(i, None)
            losses.append(loss.detach())
            stats.max_in_flight = max(stats.max_in_flight, 1)
            if not forward_only:
                count_backward()
                backward_loss(loss)
        return losses

    if forward_only:
        for i in range(m):
            y = forward_step(i, None if is_first else p2p.recv_forward())
            if is_last:
                losses.append(y.detach())
            else:
                p2p.send_forward(y)
        return losses

    warmup = min(num_stages - stage - 1, m)
    inputs, outputs = deque(), deque()

    def run_forward(i, x):
        y = forward_step(i, x)
        inputs.append(x)
        outputs.append(y)
        stats.max_in_flight = max(stats.max_in_flight, len(inputs))
        if is_last:
            losses.append(y.detach())
        return y

    for i in range(warmup):
        y = run_forward(i, None if is_first else p2p.recv_forward())
        if not is_last:
            p2p.send_forward(y)

    steady = m - warmup
    x = None if (is_first or steady == 0) else p2p.recv_forward()
    for j in range(steady):
        y = run_forward(warmup + j, x)
        grad_y = None if is_last else p2p.send_forward_recv_backward(y)
        grad_x = _backward(inputs.popleft(), outputs.popleft(), grad_y, is_last, backward_loss,
                           count_backward)
        if j == steady - 1:
            if not is_first:
                p2p.send_backward(grad_x)
        elif is_first:
            x = None
        else:
            x = p2p.send_backward_recv_forward(grad_x)

    for _ in range(warmup):
        grad_y = p2p.recv_backward()
        grad_x = _backward(inputs.popleft(), outputs.popleft(), grad_y, is_last, backward_loss,
                           count_backward)
        if not is_first:
            p2p.send_backward(grad_x)
    return losses


def reduce_loss(losses: List[torch.Tensor], is_last: bool, last_stage_rank: int, pp_group,
                dp_group=None, device: torch.device = HOST) -> torch.Tensor:
    """The global batch's mean loss on every rank, as a one-element fp32 tensor on `device` (no host read:
    the training loop reads it at --log-interval). Summed on the last stage, sent along the pipeline
    (a sum in which the other stages add exact zeros: a broadcast, through shared memory where shm_comm
    applies), and averaged over the data-parallel replicas."""
    value = torch.stack(losses).sum().reshape(1).float() if (is_last and losses) else torch.zeros(1, device=device)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        if dist.get_rank() != last_stage_rank:
            value.zero_()
        shm_comm.all_reduce(value, pp_group)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        shm_comm.all_reduce(value, dp_group)
        value /= dist.get_world_size(dp_group)
    return value


def broadcast_loss(losses: List[torch.Tensor], is_last: bool, last_stage_rank: int, pp_group,
                   dp_group=None, device: torch.device = HOST) -> float:
    """reduce_loss read back to the host (a sync: for evaluation and tests, not the training step)."""
    return reduce_loss(losses, is_last, last_stage_rank, pp_group, dp_group, device).item()
