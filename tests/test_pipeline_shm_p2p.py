"""Pipeline p2p through shared memory (megatron_zero/pipeline/shm_p2p.py): what arrives is bit-identical to
what gloo delivers, both directions, chunked messages, sends queued ahead of their receives, the ring of
two stages of the interleaved schedule, the 1F1B schedule on top; the gloo fallback when switched off;
a stage that never sends reported after the timeout; nothing left in /dev/shm."""
import os

import pytest
import torch
import torch.distributed as dist

from megatron_zero.distributed import shm_comm
from megatron_zero.pipeline.p2p import P2P
from megatron_zero.pipeline.schedule import forward_backward
from megatron_zero.testing import run_ranks
from megatron_zero.testing.toy_pipeline import H, MB, toy_batches, toy_layers
from megatron_zero.distributed.topology import build_parallel_state

SHAPE = (3, 5, 70)  # 4200 bytes of fp32: five chunks of a 1 KiB slot


def message(rank, k, dtype=torch.float32):
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(100 * rank + k)).to(dtype)


def leftovers():
    return [f for f in os.listdir(shm_comm.SHM_DIR) if f.startswith("megatron_zero_p2p_")]


def exchanges_fn(slot_bytes, enabled, dtype):
    shm_comm.SLOT_BYTES = slot_bytes
    shm_comm.set_shared_memory_comm(enabled)
    r, group = dist.get_rank(), dist.new_group([0, 1])
    chain = P2P(None if r == 0 else 0, 1 if r == 0 else None, SHAPE, dtype, group=group)
    ring = P2P(1 - r, 1 - r, SHAPE, dtype, group=group)  # prev and next: the same rank
    got = {"shm": chain._shm is not None and ring._shm is not None}
    if r == 0:
        for k in range(3):  # three sends in a row (15 chunks through 4 slots) before the first receive
            chain.send_forward(message(r, k, dtype))
        got["grad"] = chain.send_forward_recv_backward(message(r, 3, dtype))
        got["grad2"] = chain.recv_backward()
    else:
        got["acts"] = [chain.recv_forward() for _ in range(3)]
        got["act3"] = chain.send_backward_recv_forward(message(r, 10, dtype))
        chain.send_backward(message(r, 11, dtype))
    got["ring"] = ring.communicate(send_next=message(r, 20, dtype), recv_prev=True,
                                   send_prev=message(r, 21, dtype), recv_next=True)
    dist.barrier()
    got["left"] = leftovers()
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shm_p2p_delivers_what_gloo_delivers(dtype):
    runs = {enabled: run_ranks(exchanges_fn, 2, 1024, enabled, dtype, timeout=120) for enabled in (True, False)}
    for enabled, (rank0, rank1) in runs.items():
        assert rank0["shm"] is enabled and rank1["shm"] is enabled
        assert rank0["left"] == [] and rank1["left"] == []
        for k in range(3):
            assert torch.equal(rank1["acts"][k], message(0, k, dtype))
        assert torch.equal(rank1["act3"], message(0, 3, dtype)) and rank1["act3"].requires_grad
        assert torch.equal(rank0["grad"], message(1, 10, dtype))
        assert torch.equal(rank0["grad2"], message(1, 11, dtype))
        for me, res in enumerate((rank0, rank1)):  # from prev: the peer's send_next; from next: its send_prev
            from_prev, from_next = res["ring"]
            assert torch.equal(from_prev, message(1 - me, 20, dtype)) and from_prev.requires_grad
            assert torch.equal(from_next, message(1 - me, 21, dtype))


def schedule_fn(m, enabled):
    shm_comm.set_shared_memory_comm(enabled)
    state = build_parallel_state(tp=1, pp=dist.get_world_size())
    stage, layer, batches = state.pp_rank, toy_layers(state.pp_size)[state.pp_rank], toy_batches(m)

    def forward_step(i, x):
        y = torch.tanh(layer(batches[i][0] if stage == 0 else x))
        return torch.nn.functional.mse_loss(y, batches[i][1]) / m if state.is_last_stage else y

    p2p = P2P(state.prev_rank, state.next_rank, (MB, H), torch.float32, group=state.pp_group)
    losses = forward_backward(forward_step, m, p2p, stage, state.pp_size)
    return p2p._shm is not None, losses, layer.weight.grad


@pytest.mark.parametrize("pp,m", [(2, 4), (3, 5)])
def test_1f1b_through_shm_is_bit_identical_to_gloo(pp, m):
    shm, gloo = (run_ranks(schedule_fn, pp, m, enabled, timeout=120) for enabled in (True, False))
    for (used_shm, shm_losses, shm_grad), (used_gloo, gloo_losses, gloo_grad) in zip(shm, gloo):
        assert used_shm and not used_gloo
        assert len(shm_losses) == len(gloo_losses) and all(map(torch.equal, shm_losses, gloo_losses))
        assert torch.equal(shm_grad, gloo_grad)


def silent_peer_fn():
    shm_comm.set_timeout(1.0)
    r, group = dist.get_rank(), dist.new_group([0, 1])
    p2p = P2P(None if r == 0 else 0, 1 if r == 0 else None, SHAPE, torch.float32, group=group)
    error = None
    if r == 1:  # rank 0 never sends
        try:
            p2p.recv_forward()
        except dist.DistBackendError as e:
            error = str(e)
    dist.barrier()
    return error


def test_missing_stage_is_reported_after_the_timeout():
    error = run_ranks(silent_peer_fn, 2, timeout=60)[1]
    assert error is not None
    assert "global ranks [0, 1]" in error and "did not arrive within 1 s" in error
