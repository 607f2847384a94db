"""Reading torchrun's and SLURM's launch environment."""
import pytest

from megatron_zero.distributed import LaunchError, first_host, read_launch_env


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
