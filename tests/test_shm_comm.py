"""The shared-memory all-reduce / all-gather (megatron_zero/distributed/shm_comm.py) against the exact results, chunked
rounds included, with nothing left in /dev/shm; the gloo fallback when it is switched off; a missing rank
reported after the timeout, a killed one at once."""
import os
import re
import signal

import pytest
import torch
import torch.distributed as dist

from megatron_zero.distributed import shm_comm
from megatron_zero.arguments import parse_args
from megatron_zero.testing import multirank, run_ranks
from test_arguments import BASE


def rank_tensor(rank, n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(n, generator=g).to(dtype)


def collectives_fn(world, slot_bytes, enabled):
    shm_comm.SLOT_BYTES = slot_bytes  # before the group's first all-reduce sets it up
    shm_comm.set_shared_memory_comm(enabled)
    group = dist.new_group(list(range(world)))
    r = dist.get_rank()
    out = {}
    # files another run left (a killed process cannot unlink its own) are not this group's
    before = {f for f in os.listdir(shm_comm.SHM_DIR) if f.startswith("megatron_zero_allreduce_")}
    dist.barrier()
    for seed, (n, dtype) in enumerate([(1000, torch.float32), (5000, torch.float32), (300, torch.bfloat16)]):
        x = rank_tensor(r, n, dtype, seed)
        shm_comm.all_reduce(x, group)
        out[f"sum{seed}"] = x
    for seed, n in ((5, 200), (6, 3000)):  # split-phase; 3000 floats exceed a 1 KiB slot: the chunked path
        x = rank_tensor(r, n, seed=seed)
        handle = shm_comm.all_reduce_async(x, group)
        handle.wait()
        out[f"async{seed}"] = x
    x = rank_tensor(r, 777, seed=7)
    shm_comm.all_reduce(x, group, dist.ReduceOp.MAX)
    out["max"] = x
    parts = [torch.empty(1500) for _ in range(world)]
    shm_comm.all_gather(parts, rank_tensor(r, 1500, seed=8), group)
    out["gather"] = parts
    out["shm"] = shm_comm._by_group[group] is not None
    dist.barrier()
    out["left"] = [f for f in os.listdir(shm_comm.SHM_DIR) if f.startswith("megatron_zero_allreduce_") and f not in before]
    return out


@pytest.mark.parametrize("world,slot_bytes,enabled", [(2, 1024, True), (3, 4 << 20, True), (2, 1024, False)])
def test_collectives_exact(world, slot_bytes, enabled):
    """Sums in rank order (bit-identical on every rank), maxima and gathers; 1 KiB slots make a
    5000-float all-reduce take 20 rounds, alternating the two slot sets."""
    results = run_ranks(collectives_fn, world, world, slot_bytes, enabled, timeout=120)
    for seed, (n, dtype) in enumerate([(1000, torch.float32), (5000, torch.float32), (300, torch.bfloat16)]):
        expected = rank_tensor(0, n, dtype, seed)
        for q in range(1, world):
            expected = expected + rank_tensor(q, n, dtype, seed)
        for res in results:
            if enabled:
                assert torch.equal(res[f"sum{seed}"], expected)
            else:  # gloo's own reduction order
                torch.testing.assert_close(res[f"sum{seed}"], expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6,
                                           atol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    for seed, n in ((5, 200), (6, 3000)):
        expected = sum(rank_tensor(q, n, seed=seed) for q in range(world))
        for res in results:
            torch.testing.assert_close(res[f"async{seed}"], expected, rtol=0 if enabled else 1e-6,
                                       atol=0 if enabled else 1e-6)
    expected_max = torch.stack([rank_tensor(q, 777, seed=7) for q in range(world)]).max(0).values
    for res in results:
        assert torch.equal(res["max"], expected_max)
        for q, part in enumerate(res["gather"]):
            assert torch.equal(part, rank_tensor(q, 1500, seed=8))
        assert res["shm"] is enabled
        assert res["left"] == []


def test_flag_switches_it_off():
    assert parse_args(BASE, world_size=1).shared_memory_all_reduce is True
    assert parse_args(BASE + ["--no-shared-memory-all-reduce"], world_size=1).shared_memory_all_reduce is False


def silent_rank_fn():
    shm_comm.set_timeout(1.0)
    group = dist.new_group([0, 1])
    shm_comm.all_reduce(torch.ones(4), group)  # sets the group up
    error = None
    if dist.get_rank() == 0:  # rank 1 skips the second all-reduce
        try:
            shm_comm.all_reduce(torch.ones(4), group)
        except dist.DistBackendError as e:
            error = str(e)
    dist.barrier()
    return error


def test_missing_rank_is_reported_after_the_timeout():
    """As torch.distributed's own collectives do: a DistBackendError after the group's timeout, naming it."""
    error = run_ranks(silent_rank_fn, 2, timeout=60)[0]
    assert error is not None
    assert "a rank of the process group of global ranks [0, 1] did not arrive within 1 s" in error


def _killed_peer_rank(rank, port, messages):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    shm_comm.set_timeout(3600.0)
    group = dist.new_group([0, 1])
    shm_comm.all_reduce(torch.ones(4), group)  # sets the group's shared memory up
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        shm_comm.all_reduce(torch.ones(4), group)
        messages.put("no error")
    except dist.DistBackendError as e:
        messages.put(str(e))
    messages.close()
    messages.join_thread()  # the message written before the exit
    os._exit(0)  # no teardown of a group whose peer is dead


def test_killed_peer_ends_the_wait_at_once():
    """A rank SIGKILLed on the same host: the survivor's shared-memory wait ends with one sentence naming it,
    long before the group's timeout (an hour here; the queue's 120 s guard would fail the test first)."""
    ctx = multirank._context()
    port, messages = multirank.free_port(), ctx.Queue()
    procs = [ctx.Process(target=_killed_peer_rank, args=(r, port, messages), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        message = messages.get(timeout=120)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert procs[1].exitcode == -signal.SIGKILL
    assert re.fullmatch(r"shared-memory collective round 2: a rank of the process group of global ranks \[0, 1\] "
                        r"will not arrive: global rank 1 \(process \d+\) has exited", message), message


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs os.pidfd_open (Linux 5.3, Python 3.9)")
def test_a_wake_up_written_just_before_a_peer_exited_is_still_read():
    """A peer that exits once the round is complete (its last collective, then the end of the run) while
    another rank's wake-up to this one is still on its way: the wait returns the wake-up, it is no failure."""
    import subprocess
    import threading

    child = subprocess.Popen(["true"])
    peers = {os.pidfd_open(child.pid): (2, child.pid)}
    child.wait()  # exited: its pidfd is readable
    read_fd, write_fd = os.pipe()
    late = threading.Timer(0.2, os.write, (write_fd, b"x"))
    late.start()
    try:
        assert shm_comm.wait_readable([read_fd], "a test round", peers) == [read_fd]
    finally:
        late.join()
        shm_comm.close_watch(peers)
        os.close(read_fd)
        os.close(write_fd)
