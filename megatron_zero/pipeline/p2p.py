"""Point-to-point transfer of activations and their gradients between neighbouring stages.

Shapes are fixed for a run ([micro_batch, seq, hidden]), so the receiver
allocates from a known shape and dtype; pairs of transfers are batched with
`batch_isend_irecv` so a send and a receive in opposite directions never
deadlock (gloo and NCCL alike). `communicate` is the interleaved schedule's one
exchange with both neighbours; its fixed order (activations before gradients) keeps a
ring of two stages, where prev and next are the same rank, matched.
Given the pipeline `group`, stages on one host (gloo, host tensors) exchange through shared memory
(shm_p2p.py), bit-identical and in the same order; elsewhere, or with --no-shared-memory-all-reduce,
through torch.distributed.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from ..distributed.device import HOST
from . import shm_p2p


class P2P:
    def __init__(self, prev_rank: Optional[int], next_rank: Optional[int], shape, dtype, device: torch.device = HOST,
                 group=None):
        """`group`: the pipeline group, to set up shared memory over (collective); None: torch.distributed."""
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self._shm = None
        if group is not None:
            nbytes = math.prod(self.shape) * dtype.itemsize
            self._shm = shm_p2p.connect(group, (prev_rank, next_rank), nbytes,
                                        host_tensors=torch.device(device) == HOST)

    def _empty(self):
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def _run(self, ops):
        """Run (isend or irecv, tensor, peer) ops, those with a tensor, as one batch."""
        ops = [(op, t if op is dist.irecv else t.detach().contiguous(), peer) for op, t, peer in ops if t is not None]
        if self._shm is not None:
            self._shm.exchange([(t, peer) for op, t, peer in ops if op is dist.isend],
                               [(t, peer) for op, t, peer in ops if op is dist.irecv])
        elif ops:
            for req in dist.batch_isend_irecv([dist.P2POp(op, t, peer) for op, t, peer in ops]):
                req.wait()

    def _exchange(self, send: Optional[torch.Tensor], send_to: Optional[int], recv_from: Optional[int]):
        received = self._empty() if recv_from is not None else None
        self._run([(dist.isend, send if send_to is not None else None, send_to), (dist.irecv, received, recv_from)])
        return received

    def recv_forward(self) -> Optional[torch.Tensor]:
        x = self._exchange(None, None, self.prev_rank)
        return x.requires_grad_() if x is not None else None

    def send_forward(self, y: torch.Tensor):
        self._exchange(y, self.next_rank, None)

    def recv_backward(self) -> Optional[torch.Tensor]:
        return self._exchange(None, None, self.next_rank)

    def send_backward(self, grad: Optional[torch.Tensor]):
        self._exchange(grad, self.prev_rank, None)

    def send_forward_recv_backward(self, y: torch.Tensor) -> Optional[torch.Tensor]:
        return self._exchange(y, self.next_rank, self.next_rank)

    def send_backward_recv_forward(self, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        x = self._exchange(grad, self.prev_rank, self.prev_rank)
        return x.requires_grad_() if x is not None else None

    def communicate(self, send_next: Optional[torch.Tensor] = None, recv_prev: bool = False,
                    send_prev: Optional[torch.Tensor] = None, recv_next: bool = False):
        """Send to / receive from both neighbours in one batch. -> (from prev, from next), None where not asked."""
        from_prev = self._empty() if recv_prev else None
        from_next = self._empty() if recv_next else None
        self._run([(dist.isend, send_next, self.next_rank), (dist.irecv, from_prev, self.prev_rank),
                   (dist.isend, send_prev, self.prev_rank), (dist.irecv, from_next, self.next_rank)])
        return (from_prev.requires_grad_() if from_prev is not None else None), from_next
