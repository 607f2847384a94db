"""Point-to-point transfer of activations and their gradients between neighbouring stages.

Shapes are fixed for a run ([micro_batch, seq, hidden]), so the receiver
allocates from a known shape and dtype; pairs of transfers are batched with
`batch_isend_irecv` so a send and a receive in opposite directions never
deadlock (gloo and NCCL alike). `communicate` is the interleaved schedule's one
exchange with both neighbours; its fixed order (activations before gradients) keeps a
ring of two stages, where prev and next are the same rank, matched.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..device import HOST


class P2P:
    def __init__(self, prev_rank: Optional[int], next_rank: Optional[int], shape, dtype, device: torch.device = HOST):
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self.shape, self.dtype, self.device = tuple(shape), dtype, device

    def _empty(self):
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def _exchange(self, send: Optional[torch.Tensor], send_to: Optional[int], recv_from: Optional[int]):
        ops, received = [], None
        if send is not None and send_to is not None:
            ops.append(dist.P2POp(dist.isend, send.detach().contiguous(), send_to))
        if recv_from is not None:
            received = self._empty()
            ops.append(dist.P2POp(dist.irecv, received, recv_from))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
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
        ops = [dist.P2POp(op, t, peer) for op, t, peer in (
            (dist.isend, None if send_next is None else send_next.detach().contiguous(), self.next_rank),
            (dist.irecv, from_prev, self.prev_rank),
            (dist.isend, None if send_prev is None else send_prev.detach().contiguous(), self.prev_rank),
            (dist.irecv, from_next, self.next_rank)) if t is not None]
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return (from_prev.requires_grad_() if from_prev is not None else None), from_next
