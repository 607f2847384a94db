"""The SLURM tier: scripts/pretrain_slurm.sbatch on a one-node cluster (scripts/slurm_local_cluster.sh).

Both launch modes (srun: one task per rank; torchrun: one task per node running
scripts/torchrun_node.sh) train TP2 x PP2 on 4 CPU ranks; the job must end COMPLETED with exit code
0:0 and a checkpoint. SIGUSR1 sent to the job's steps (scancel --signal=USR1, what #SBATCH
--signal=USR1@300 sends before the time limit) must make it save and end COMPLETED, 0:0.
Skipped, with the set-up script's reason, where no cluster can be installed or started (not root,
no apt-get, no network). On a fresh machine the set-up apt-installs SLURM and munge (up to 5 min), so
the tier is `slow`: the default run covers its claims with tests/test_slurm_sbatch_script.py (both
launch modes' command lines), tests/test_two_nodes.py (scripts/torchrun_node.sh's rendezvous training),
tests/test_training_e2e.py::test_sigterm_saves_and_exits_zero_then_resumes (a signal to one rank: all
save, exit 0, resume) and tests/test_exit_and_throughput.py::test_signal_sets_exit_reason (SIGUSR1 too).
"""
import os
import re
import subprocess
import time

import pytest

from megatron_zero.testing.multirank import free_port
from megatron_zero.testing.launch import model_flags
from conftest import ROOT

pytestmark = [pytest.mark.slurm, pytest.mark.slow]  # covered by default-run tests: see above
SBATCH = os.path.join(ROOT, "scripts", "pretrain_slurm.sbatch")


@pytest.fixture(scope="module")
def slurm_env():
    try:
        setup = subprocess.run(["bash", os.path.join(ROOT, "scripts", "slurm_local_cluster.sh"), "start"],
                               capture_output=True, text=True, timeout=420)
    except subprocess.TimeoutExpired:
        pytest.skip("scripts/slurm_local_cluster.sh did not finish in 420 s")
    if setup.returncode != 0:
        reason = (setup.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"no SLURM cluster: {reason}")
    conf = re.search(r"export SLURM_CONF=(\S+)", setup.stderr).group(1)
    yield {**os.environ, "SLURM_CONF": conf, "OMP_NUM_THREADS": "1", "MEGATRON_ZERO_ROOT": ROOT}
    if "already running" not in setup.stderr:  # leave a cluster we found as it was; stop the one we started
        subprocess.run(["bash", os.path.join(ROOT, "scripts", "slurm_local_cluster.sh"), "stop"], timeout=60)


def job_field(env, job, field):
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=env).stdout
    m = re.search(rf"\b{field}=(\S+)", out)
    return m.group(1) if m else None


def wait_job(env, job, timeout=420):
    deadline = time.monotonic() + timeout
    while True:
        state = job_field(env, job, "JobState")
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", None):
            return state, job_field(env, job, "ExitCode")
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], env=env)
            pytest.fail(f"job {job} still {state} after {timeout} s")
        time.sleep(1)


def submit(env, tmp_path, launcher, argv):
    env = {**env, "LAUNCHER": launcher, "GPUS_PER_NODE": "4", "MASTER_PORT": str(free_port())}
    tasks = "4" if launcher == "srun" else "1"
    out = subprocess.run(["sbatch", "--parsable", "--nodes", "1", "--ntasks-per-node", tasks,
                          "--output", str(tmp_path / "job-%j.out"), SBATCH] + argv,
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    job = out.stdout.strip().split(";")[0]
    return job, tmp_path / f"job-{job}.out"


def flags(builtin_corpus, tmp_path, **extra):
    data, tok = builtin_corpus
    return model_flags(data, tok, **{"tensor-model-parallel-size": 2, "pipeline-model-parallel-size": 2,
                                     "data-cache-path": tmp_path / "cache", "save": tmp_path / "ckpt",
                                     "eval-iters": 0, **extra})


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_sbatch_completes_with_a_checkpoint(slurm_env, builtin_corpus, tmp_path, launcher):
    job, log = submit(slurm_env, tmp_path, launcher, flags(builtin_corpus, tmp_path, **{"train-iters": 3}))
    state, code = wait_job(slurm_env, job)
    text = log.read_text() if log.exists() else ""
    assert (state, code) == ("COMPLETED", "0:0"), text[-3000:]
    assert re.search(r" iteration +3/ +3 \|", text), text[-3000:]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step3"


def test_sigusr1_saves_and_ends_cleanly(slurm_env, builtin_corpus, tmp_path):
    job, log = submit(slurm_env, tmp_path, "srun", flags(builtin_corpus, tmp_path, **{"train-iters": 100000,
                                                                                      "save-interval": 100000}))
    deadline = time.monotonic() + 300
    while " iteration        2/" not in (log.read_text() if log.exists() else ""):
        assert job_field(slurm_env, job, "JobState") in ("PENDING", "RUNNING", "CONFIGURING"), \
            log.read_text()[-3000:] if log.exists() else "no log"
        assert time.monotonic() < deadline, "training did not reach iteration 2"
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=USR1", job], env=slurm_env, check=True)
    state, code = wait_job(slurm_env, job)
    text = log.read_text()
    assert (state, code) == ("COMPLETED", "0:0"), text[-3000:]
    stopped = int(re.findall(r"exiting after iteration (\d+): exit signal received", text)[0])
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"global_step{stopped}"
