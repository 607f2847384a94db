"""Jobs of several processes: SIGTERM through the launch script saves and exits 0; workers stop when
their launcher is SIGKILLed; a fault found by one rank is one sentence, the other ranks exit quietly;
a second job on the same --save is refused while the first runs."""
import json
import os
import re
import signal
import subprocess
import sys
import time

from conftest import ROOT

from megatron_zero.checkpoint.storage.lock import LOCK_NAME
from megatron_zero.testing.launch import PRETRAIN, byte_data, pretrain, tiny_flags
from megatron_zero.testing.multirank import free_port

WRAPPER = os.path.join(ROOT, "scripts", "pretrain_torchrun.sh")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def launch(cmd, log):
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=ENV, start_new_session=True)


def torchrun_args(nproc):
    return ["--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1", "--master_port", str(free_port())]


def wait_for(log, pattern, proc, timeout=240):
    deadline = time.monotonic() + timeout
    while not re.search(pattern, log.read_text() if log.exists() else ""):
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{pattern!r} not seen: {log.read_text()[-3000:]}"
        time.sleep(0.2)


def gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_sigterm_to_the_launch_script_saves_and_exits_zero(tmp_path):
    data, log = byte_data(tmp_path / "bytes"), tmp_path / "job.log"
    job = launch(["bash", WRAPPER] + torchrun_args(2) + [PRETRAIN, "--exit-signal-handler"] +
                 tiny_flags(tmp_path, data, **{"train-iters": 100000, "save-interval": 100000}), log)
    try:
        wait_for(log, r" iteration +3/", job)
        second = pretrain(tmp_path, data)  # another job on the same --save, while the first one runs
        holder = json.loads((tmp_path / "ckpt" / LOCK_NAME).read_text())
        assert second.returncode == 2 and "Traceback" not in second.stderr
        assert f"names pid {holder['pid']}" in second.stderr and "is being written by another job" in second.stderr
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=240) == 0, log.read_text()[-3000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    out = log.read_text()
    assert "Traceback" not in out and "exit signal received" in out
    stopped = int(re.findall(r"exiting after iteration (\d+)", out)[0])
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"global_step{stopped}"
    assert not (tmp_path / "ckpt" / LOCK_NAME).exists()


def test_workers_stop_when_their_launcher_is_killed(tmp_path):
    data, log = byte_data(tmp_path / "bytes"), tmp_path / "job.log"
    torchrun = launch([sys.executable, "-m", "torch.distributed.run"] + torchrun_args(2) + [PRETRAIN] +
                      tiny_flags(tmp_path, data, **{"train-iters": 100000}), log)
    try:
        wait_for(log, r" iteration +3/", torchrun)
        workers = [int(p) for p in subprocess.run(["ps", "-o", "pid=", "--ppid", str(torchrun.pid)],
                                                  capture_output=True, text=True).stdout.split()]
        assert len(workers) == 2
        torchrun.kill()  # SIGKILL: torchrun cannot pass anything on
        torchrun.wait()
        deadline = time.monotonic() + 120
        while not all(gone(p) for p in workers):
            assert time.monotonic() < deadline, f"workers {workers} still running after their launcher died"
            time.sleep(0.2)
    finally:
        for pid in [torchrun.pid] + locals().get("workers", []):
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
    # without --exit-signal-handler the parent-death SIGTERM ends them at once: their lock is stale,
    # and the next job takes it over
    holder = json.loads((tmp_path / "ckpt" / LOCK_NAME).read_text())
    assert holder["pid"] in workers
    after = pretrain(tmp_path, data)
    assert after.returncode == 0, after.stderr[-2000:]
    assert f"taking over {tmp_path / 'ckpt' / LOCK_NAME}: the lock of pid {holder['pid']}" in after.stdout


def test_a_fault_one_rank_finds_is_one_sentence(tmp_path):
    data = byte_data(tmp_path / "bytes")
    saved = subprocess.run(["bash", WRAPPER] + torchrun_args(2) + [PRETRAIN] + tiny_flags(tmp_path, data),
                           capture_output=True, text=True, env=ENV, timeout=240)
    assert saved.returncode == 0, saved.stderr[-3000:]
    shard = tmp_path / "ckpt" / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # only DP rank 1 reads this file
    shard.write_bytes(bytes(raw))
    run = subprocess.run(["bash", WRAPPER] + torchrun_args(2) + [PRETRAIN] +
                         tiny_flags(tmp_path, data, load=tmp_path / "ckpt", **{"train-iters": 4, "override-opt_param-scheduler": True}),
                         capture_output=True, text=True, env=ENV, timeout=240)
    out = run.stdout + run.stderr
    assert run.returncode == 2, out[-3000:]
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1 and str(shard) in errors[0], out[-3000:]
    for noise in ("Traceback", "Connection", "gloo", "ChildFailedError"):
        assert noise not in out, (noise, out[-3000:])
