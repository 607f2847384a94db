"""Reading torchrun's and SLURM's launch environment."""
import pytest

from megatron_zero.distributed.initialize import LaunchError, first_host, read_launch_env


def test_torchrun_env():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "1234"}
    launch = read_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank) == (3, 8, 1)
    assert (launch.master_addr, launch.master_port, launch.source) == ("n1", 1234, "torchrun")


def test_slurm_env_takes_master_from_nodelist():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "gpu[007-009,12]"}
    launch = read_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank) == (5, 16, 1)
    assert launch.master_addr == "gpu007" and launch.source == "slurm"


@pytest.mark.parametrize("nodelist,host", [("node1", "node1"), ("a[1-3]", "a1"), ("a[03,5]", "a03"),
                                           ("x-y[10-11],z1", "x-y10"), ("c1,c2", "c1")])
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_single_process_default():
    assert read_launch_env({}).world_size == 1


def test_bad_integer_is_named():
    with pytest.raises(LaunchError, match="RANK"):
        read_launch_env({"RANK": "x", "WORLD_SIZE": "2"})


def test_slurm_without_nodelist_explains():
    with pytest.raises(LaunchError, match="SLURM_JOB_NODELIST"):
        read_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})


def _threads() -> int:
    import os
    return len(os.listdir("/proc/self/task"))


def _groups_torn_down_with_their_threads():
    import torch
    import torch.distributed as dist

    from megatron_zero.distributed import shm_comm
    from megatron_zero.distributed.initialize import shutdown_distributed
    from megatron_zero.distributed.topology import build_parallel_state

    with_default_group = _threads()
    state = build_parallel_state(tp=2)
    holder = {"state": state}
    holder["self"] = holder  # a reference cycle keeps the subgroups alive, as the model's modules do
    for name in ("tp", "dp", "pp", "mp", "embedding"):
        dist.all_reduce(torch.ones(4), group=state.groups[name])
        shm_comm.all_reduce(torch.ones(4), state.groups[name])  # its table of groups holds them too
    assert _threads() > with_default_group
    del state, holder
    shutdown_distributed()
    return dist.is_initialized(), with_default_group, _threads()


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="counts threads in /proc")
def test_shutdown_joins_every_gloo_thread_before_exit():
    """A gloo thread still alive at interpreter exit can abort the process (SIGABRT) while it frees a tensor."""
    from megatron_zero.testing.multirank import run_ranks

    for initialised, before, after in run_ranks(_groups_torn_down_with_their_threads, 2):
        assert not initialised
        assert after < before, (before, after)  # the default group's threads are gone too
