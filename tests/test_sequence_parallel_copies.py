"""The sequence-parallel mappings move activations without copying them: each rank's tokens are one
contiguous block of the whole, so the all-gather writes straight into the whole, the reduce-scatter reads
straight from it, and the split is a view (tensor_parallel/mappings.py). Counted by CopyCounter (the
aten ops that write on the calling thread), through gloo's collectives at TP2, forward and backward; and
the values are the mappings' (the gathered whole is every rank's tokens in order)."""
import torch
import torch.distributed as dist

from megatron_zero.distributed import shm_comm
from megatron_zero.tensor_parallel import (gather_from_sequence_parallel_region,
                                           reduce_scatter_to_sequence_parallel_region,
                                           scatter_to_sequence_parallel_region)
from megatron_zero.testing import run_ranks
from megatron_zero.testing.copy_counter import CopyCounter
from megatron_zero.distributed.topology import build_parallel_state

B, S, H, TP = 3, 8, 16, 2


def whole(rank):
    return torch.arange(B * S * H, dtype=torch.float32).view(B, S, H) + 1000 * rank


def copies_fn():
    shm_comm.set_shared_memory_comm(False)  # gloo's collectives: their transport is not on this thread
    group = build_parallel_state(tp=TP).tp_group
    r, out = dist.get_rank(), {}
    for name, fn, shape in [("scatter", scatter_to_sequence_parallel_region, (B, S, H)),
                            ("gather", gather_from_sequence_parallel_region, (B, S // TP, H)),
                            ("reduce_scatter", reduce_scatter_to_sequence_parallel_region, (B, S, H))]:
        x = whole(r)[:, :shape[1]].contiguous().requires_grad_()
        grad_out = None
        with CopyCounter() as copies:
            y = fn(x, group)
            grad_out = torch.full(y.shape, float(r + 1))
            y.backward(grad_out)
        out[name] = (dict(copies.bytes), y.detach(), x.grad)
    return out


def test_sequence_parallel_mappings_copy_nothing():
    results = run_ranks(copies_fn, TP, timeout=120)
    tokens = B * S // TP
    for r, res in enumerate(results):
        for name, (copied, _, _) in res.items():
            assert copied == {}, (name, copied)  # no cat, no .contiguous() chunk, no copy_
        # scatter: my block of the tokens in memory order; its backward gathers every rank's gradient
        _, y, grad = res["scatter"]
        assert torch.equal(y.reshape(-1, H), whole(r).reshape(-1, H)[r * tokens:(r + 1) * tokens])
        assert torch.equal(grad.reshape(TP, -1), torch.stack([torch.full((tokens * H,), q + 1.0) for q in range(TP)]))
        # gather: every rank's block in rank order; backward reduce-scatters the (partial) gradient
        _, y, grad = res["gather"]
        assert torch.equal(y.reshape(TP, -1), torch.stack([whole(q)[:, :S // TP].reshape(-1) for q in range(TP)]))
        assert torch.equal(grad, torch.full((B, S // TP, H), float(sum(range(1, TP + 1)))))
        # reduce-scatter: my block of the sum; backward gathers
        _, y, grad = res["reduce_scatter"]
        total = sum(whole(q) for q in range(TP)).reshape(TP, -1)[r]
        assert torch.equal(y.reshape(-1), total)
        assert torch.equal(grad.reshape(TP, -1), torch.stack([torch.full((tokens * H,), q + 1.0) for q in range(TP)]))
