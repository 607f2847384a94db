"""When a rank dies: NCCL's watchdog settings are in place before the process group is made, the launch
script names the rank that failed first, and gloo is refused for a CUDA device in one sentence."""
import os
import re
import signal
import subprocess
import sys
import time
import types

import pytest
import torch
import torch.distributed as dist
from conftest import ROOT
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from megatron_zero.distributed import initialize as distributed
from megatron_zero.training import trainer as training
from megatron_zero.distributed.device import DeviceError, backend_for
from megatron_zero.testing.launch import PRETRAIN, byte_data, tiny_flags
from megatron_zero.testing.multirank import free_port

WRAPPER = os.path.join(ROOT, "scripts", "pretrain_torchrun.sh")


def _init_seeing(monkeypatch, environ, backend, minutes, launch=None, device=None, gpus=1):
    """init_distributed(backend) with torch's process-group constructor (and the store) replaced:
    -> (environment it saw, its keyword arguments, the device bound before it)."""
    seen, bound = {}, []
    monkeypatch.setattr(os, "environ", environ)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed, "attempt_store", lambda *a, **kw: types.SimpleNamespace(set=lambda k, v: None))
    monkeypatch.setattr(dist, "init_process_group",
                        lambda **kw: seen.update(environ=dict(os.environ), kwargs=kw, bound=list(bound)))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    distributed.init_distributed(backend, timeout_minutes=minutes, environ=launch or {}, device=device)
    return seen["environ"], seen["kwargs"], seen["bound"]


def _init_seeing_environment(monkeypatch, environ, backend, minutes):
    env, kwargs, _ = _init_seeing(monkeypatch, environ, backend, minutes)
    return env, kwargs["timeout"].total_seconds()


def test_nccl_is_given_the_ranks_device_before_any_collective(monkeypatch):
    """device_id names the rank's GPU to the process group (no "Guessing device ID based on global rank", no
    barrier on "the device under current context"), bound with set_device first."""
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3"}
    _, kwargs, bound = _init_seeing(monkeypatch, {}, "nccl", 10, launch=torchrun, gpus=4)
    assert kwargs["device_id"] == torch.device("cuda", 3) and bound == [torch.device("cuda", 3)]
    _, kwargs, bound = _init_seeing(monkeypatch, {}, "nccl", 10, launch=torchrun, device=torch.device("cuda", 1))
    assert kwargs["device_id"] == torch.device("cuda", 1) and bound == [torch.device("cuda", 1)]  # --device's
    _, kwargs, bound = _init_seeing(monkeypatch, {}, "gloo", 10, launch=torchrun)
    assert "device_id" not in kwargs and bound == []


def test_nccl_watchdog_settings_are_set_before_the_process_group_is_made(monkeypatch):
    env, timeout = _init_seeing_environment(monkeypatch, {}, "nccl", 30)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "1800" and timeout == 1800  # one patience for both


def test_nccl_settings_the_user_exported_are_kept_and_gloo_gets_none(monkeypatch):
    env, _ = _init_seeing_environment(monkeypatch, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, "nccl", 10)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "600"
    env, _ = _init_seeing_environment(monkeypatch, {}, "gloo", 10)
    assert not any(name.startswith("TORCH_NCCL") for name in env)


def test_gloo_with_a_cuda_device_is_refused_in_one_sentence(monkeypatch, tmp_path, capsys):
    with pytest.raises(DeviceError, match=r"^--distributed-backend gloo cannot run the collectives of a rank "
                                          r"training on cuda:0 .*--device cpu$"):
        backend_for(torch.device("cuda", 0), "gloo")
    assert backend_for(torch.device("cuda", 0)) == "nccl" and backend_for(torch.device("cpu"), "gloo") == "gloo"
    # as a user meets it: pretrain_gpt.py on a GPU machine with --distributed-backend gloo
    monkeypatch.setattr(training, "select_device", lambda choice, local_rank: torch.device("cuda", 0))
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    data = byte_data(tmp_path / "bytes")
    assert training.pretrain(tiny_flags(tmp_path, data, **{"distributed-backend": "gloo"})) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("pretrain_gpt.py: error: --distributed-backend gloo cannot"), err


def _failure(tmp_path, local_rank, pid, exitcode, lost_contact_at=None):
    """torchrun's record of a failed worker; lost_contact_at: the time its error file says it lost contact."""
    error_file = str(tmp_path / f"error{local_rank}.json")
    if lost_contact_at is not None:
        os.environ["TORCHELASTIC_ERROR_FILE"] = error_file
        try:
            distributed.record_peer_loss("rank 0 lost contact with another rank (Connection closed by peer)")
        finally:
            del os.environ["TORCHELASTIC_ERROR_FILE"]
        text = open(error_file).read()
        open(error_file, "w").write(re.sub(r'"timestamp": "\d+"', f'"timestamp": "{lost_contact_at}"', text))
    return ProcessFailure(local_rank=local_rank, pid=pid, exitcode=exitcode, error_file=error_file)


def test_first_failure_is_the_cause_not_the_rank_that_lost_contact(tmp_path):
    """torchrun's own 'first observed failure' is the earliest timestamp: a rank that lost contact and said so
    at once is stamped before the killed rank (stamped when torchrun noticed it), and would be named."""
    lost = _failure(tmp_path, 0, 100, 1, lost_contact_at=int(time.time()) - 5)
    killed = _failure(tmp_path, 1, 101, -signal.SIGKILL)
    assert lost.timestamp < killed.timestamp
    line = distributed.first_failure({0: lost, 1: killed})
    assert line == "rank 1 (local rank 1, pid 101) failed first: killed by signal SIGKILL; 1 other rank failed after it"
    # in the same second, the one torchrun observed first (listed first; it stopped the others after it)
    stopped = ProcessFailure(local_rank=0, pid=100, exitcode=-signal.SIGTERM, error_file=str(tmp_path / "none"))
    stopped.timestamp = killed.timestamp
    assert distributed.first_failure({1: killed, 0: stopped}).startswith("rank 1 (local rank 1, pid 101) failed first")
    # with no cause among them (every rank only lost contact), the earliest is named
    assert distributed.first_failure({0: lost}).startswith("rank 0 (local rank 0, pid 100) failed first: exit code 1")


def _descendants(pid):
    table = [line.split() for line in subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True,
                                                     text=True).stdout.splitlines()]
    found, todo = [], [str(pid)]
    while todo:
        parent = todo.pop()
        children = [c for c, p in table if p == parent]
        found += children
        todo += children
    return found


def test_the_launch_script_names_the_rank_that_was_killed(tmp_path):
    data, log = byte_data(tmp_path / "bytes"), tmp_path / "job.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(["bash", WRAPPER, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
                            str(free_port()), PRETRAIN] + tiny_flags(tmp_path, data, **{"train-iters": 100000}),
                           stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not re.search(r" iteration +3/", log.read_text()):
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        ranks = {}
        for pid in _descendants(job.pid):  # torchrun starts each worker in a session of its own
            try:
                environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            rank = [e for e in environ if e.startswith(b"RANK=")]
            if rank and any(e.startswith(b"TORCHELASTIC_ERROR_FILE=") for e in environ):
                ranks[int(rank[0][5:])] = int(pid)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGKILL)
        assert job.wait(timeout=240) != 0
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    out = log.read_text()
    assert f"pretrain_torchrun: rank 1 (local rank 1, pid {ranks[1]}) failed first: killed by signal SIGKILL" in out, \
        out[-3000:]


NCCL_START = """
import torch, torch.distributed as dist
from megatron_zero.distributed.initialize import init_distributed, shutdown_distributed
init_distributed("nccl", 1.0)
x = torch.ones(4, device="cuda")
dist.all_reduce(x)
dist.barrier()
torch.cuda.synchronize()
print("summed", x.sum().item())
shutdown_distributed()
"""


@pytest.mark.gpu
def test_a_one_rank_nccl_start_prints_no_device_warning():
    """NCCL's two warnings about the rank's device (a barrier on "the device under current context", "Guessing
    device ID based on global rank") do not appear: init_distributed names the device. This needs NCCL, so a
    CUDA device, also under MEGATRON_ZERO_TEST_DEVICE=cpu."""
    if not torch.cuda.is_available():
        pytest.skip("NCCL needs a CUDA device")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "PYTHONPATH": ROOT}
    run = subprocess.run([sys.executable, "-c", NCCL_START], capture_output=True, text=True, env=env, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "summed 4.0" in out, out[-3000:]
    for warning in ("using the device under current context", "Guessing device ID"):
        assert warning not in out, out[-3000:]
