"""The multi-rank harness: results come back, errors carry their traceback, nothing hangs."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from megatron_zero.testing import RankFailure, run_ranks


def rank_and_sum(offset):
    t = torch.tensor([dist.get_rank() + offset], dtype=torch.float64)
    dist.all_reduce(t)
    return dist.get_rank(), int(os.environ["WORLD_SIZE"]), t.item()


def fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken on purpose")
    dist.barrier()


def die_on_rank_two():
    if dist.get_rank() == 2:
        os._exit(3)
    time.sleep(60)


def stuck_on_rank_zero():
    if dist.get_rank() == 0:
        time.sleep(600)


def test_results_per_rank():
    assert run_ranks(rank_and_sum, 4, 10) == [(r, 4, 46.0) for r in range(4)]


def test_exception_carries_rank_and_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailure) as err:
        run_ranks(fail_on_rank_one, 3, timeout=60)
    msg = str(err.value)
    assert "rank 1 of 3" in msg and "ValueError: rank one is broken on purpose" in msg
    assert "fail_on_rank_one" in msg and "Traceback" in msg
    assert time.monotonic() - start < 30  # the other ranks were killed, not waited for


def test_silent_death_is_reported():
    with pytest.raises(RankFailure, match=r"rank 2 died with exit code 3"):
        run_ranks(die_on_rank_two, 4, timeout=60)


def test_timeout_names_the_stuck_rank_and_its_stack():
    start = time.monotonic()
    with pytest.raises(RankFailure) as err:
        run_ranks(stuck_on_rank_zero, 2, timeout=3)
    msg = str(err.value)
    assert "rank(s) [0] did not finish" in msg and "stuck_on_rank_zero" in msg
    assert time.monotonic() - start < 20


def die_on_rank_two_while_others_connect():
    if dist.get_rank() == 2:
        os._exit(3)
    raise RuntimeError("Connection closed by peer [127.0.0.1]:1 (what gloo says when a peer is gone)")


def test_lost_connection_gives_way_to_the_rank_that_died():
    with pytest.raises(RankFailure, match=r"rank 2 died with exit code 3"):
        run_ranks(die_on_rank_two_while_others_connect, 4, timeout=60)


def test_free_port_is_held_until_the_store_binds_it():
    """A port found free and then released can be taken by any other bind or outgoing connection before torchrun's
    or gloo's TCPStore binds it; free_port() holds it, and only a SO_REUSEADDR listener (the TCPStore) gets it."""
    import datetime
    import errno
    import socket

    from megatron_zero.testing.multirank import free_port

    port = free_port()
    other = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with pytest.raises(OSError) as taken:
        other.bind(("127.0.0.1", port))
    other.close()
    assert taken.value.errno == errno.EADDRINUSE
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=10))
    store.set("key", "value")
    assert store.get("key") == b"value"
