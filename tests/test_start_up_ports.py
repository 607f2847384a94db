"""Start-up without port races: a port is never found free and then released for the launcher to bind later
(another job can take it in between). A one-process run needs no port at all; scripts/pretrain_local.sh leaves
the port to torchrun's own rendezvous unless MASTER_PORT names one; the tests hold theirs (free_port)."""
import os
import shutil
import socket
import subprocess
import sys

import pytest

from megatron_zero.testing.launch import PRETRAIN, ROOT, byte_data, losses_from_log, tiny_flags


def _listening() -> socket.socket:
    """A port another job's store listens on."""
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    return taken


def test_a_one_process_store_binds_no_port():
    """The store of a run of one process (no torchrun, no SLURM) is in memory: another job's store on MASTER_PORT, or
    on the default 29500 where it is unset, is no conflict."""
    import datetime

    from megatron_zero.distributed.initialize import attempt_store, read_launch_env

    taken = _listening()
    try:
        store = attempt_store(read_launch_env({"MASTER_PORT": str(taken.getsockname()[1])}),
                              datetime.timedelta(seconds=5))
        store.set("key", "value")
        assert store.get("key") == b"value"
    finally:
        taken.close()


@pytest.mark.slow  # one pretrain_gpt.py start-up (~20 s loaded); the default tier's test above covers its store
def test_a_one_process_run_binds_no_port(tmp_path):
    """pretrain_gpt.py on one process trains with another job's store listening on its MASTER_PORT."""
    taken = _listening()
    try:
        env = {**os.environ, "MASTER_PORT": str(taken.getsockname()[1]), "OMP_NUM_THREADS": "1"}
        run = subprocess.run([sys.executable, PRETRAIN] + tiny_flags(tmp_path, byte_data(tmp_path / "bytes"),
                                                                    **{"train-iters": 1, "save": None}),
                             capture_output=True, text=True, timeout=180, env=env)
    finally:
        taken.close()
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(losses_from_log(run.stdout)) == 1, run.stdout[-2000:]


def _launch_line(tmp_path, env: dict) -> list:
    """The torchrun arguments scripts/pretrain_local.sh passes on (its set-up and the launch recorded, not run)."""
    scripts = tmp_path / "scripts"
    scripts.mkdir(exist_ok=True)
    shutil.copy(os.path.join(ROOT, "scripts", "pretrain_local.sh"), scripts / "pretrain_local.sh")
    (scripts / "setup_env.sh").write_text("exit 0\n")
    record = tmp_path / "launch.txt"
    (scripts / "pretrain_torchrun.sh").write_text(f"printf '%s\\n' \"$@\" > {record}\n")
    clean = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    run = subprocess.run(["bash", str(scripts / "pretrain_local.sh"), "--train-iters", "1"], capture_output=True,
                         text=True, timeout=60, env={**clean, **env})
    assert run.returncode == 0, run.stderr
    return record.read_text().split("\n")[:-1]


def test_pretrain_local_leaves_the_port_to_torchrun(tmp_path):
    """No port is picked before torchrun starts: its standalone rendezvous binds port 0 and tells the ranks."""
    line = _launch_line(tmp_path, {"NPROC": "2"})
    assert line == ["--nproc_per_node", "2", "--standalone", str(tmp_path / "pretrain_gpt.py"), "--exit-signal-handler",
                    "--train-iters", "1"], line
    named = _launch_line(tmp_path, {"NPROC": "2", "MASTER_PORT": "29611"})
    assert named[:6] == ["--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", "29611"], named
