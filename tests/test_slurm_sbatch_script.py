"""scripts/pretrain_slurm.sbatch without a cluster: `srun` and `scontrol` are stubs on PATH that record what
the batch script runs, so the default run checks the command lines of both launch modes (srun: the ranks
run pretrain_gpt.py with --exit-signal-handler, master on the first node; torchrun: one
scripts/torchrun_node.sh per node with a c10d rendezvous on the first node) and the refusal of an unknown
LAUNCHER. tests/test_slurm.py (marked `slow` and `slurm`) submits the same script to a real one-node cluster.
"""
import os
import subprocess

from conftest import ROOT

SBATCH = os.path.join(ROOT, "scripts", "pretrain_slurm.sbatch")
RECORDED = ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NPROC_PER_NODE", "RDZV_ID", "RDZV_ENDPOINT")


def run_sbatch(tmp_path, launcher, **env):
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "scontrol").write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "gpu007\\ngpu008\\n"\n')
    record = "".join(f'echo "{k}=${{{k}:-}}" >> "$RECORD"\n' for k in RECORDED)
    (stubs / "srun").write_text(f'#!/bin/sh\nfor a in "$@"; do echo "arg=$a" >> "$RECORD"; done\n{record}')
    for stub in ("scontrol", "srun"):
        os.chmod(stubs / stub, 0o755)
    env = {"PATH": f"{stubs}:{os.environ['PATH']}", "RECORD": str(tmp_path / "srun.txt"), "LAUNCHER": launcher,
           "MEGATRON_ZERO_ROOT": ROOT, "SLURM_JOB_NODELIST": "gpu[007-008]", "SLURM_JOB_ID": "42", **env}
    run = subprocess.run(["bash", SBATCH, "--num-layers", "2"], capture_output=True, text=True, env=env, timeout=30)
    lines = (tmp_path / "srun.txt").read_text().splitlines() if (tmp_path / "srun.txt").exists() else []
    args = [ln[4:] for ln in lines if ln.startswith("arg=")]
    recorded = dict(ln.split("=", 1) for ln in lines if not ln.startswith("arg="))
    return run, args, recorded


def test_srun_mode_runs_every_rank_with_the_signal_handler(tmp_path):
    run, args, env = run_sbatch(tmp_path, "srun", SLURM_NTASKS="16")
    assert run.returncode == 0, run.stderr
    assert args == ["--kill-on-bad-exit=1", os.path.join(ROOT, ".venv", "bin", "python"),
                    os.path.join(ROOT, "pretrain_gpt.py"), "--exit-signal-handler", "--num-layers", "2"]
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("gpu007", "29500")
    assert run.stdout.strip() == "megatron_zero: 16 ranks on 2 nodes, master gpu007:29500"


def test_torchrun_mode_runs_one_node_script_per_node(tmp_path):
    run, args, env = run_sbatch(tmp_path, "torchrun", GPUS_PER_NODE="4", MASTER_PORT="1234")
    assert run.returncode == 0, run.stderr
    assert args == ["--kill-on-bad-exit=1", "--ntasks-per-node=1", "bash",
                    os.path.join(ROOT, "scripts", "torchrun_node.sh"), "--num-layers", "2"]
    assert env == {"MASTER_ADDR": "gpu007", "MASTER_PORT": "1234", "NNODES": "2", "NPROC_PER_NODE": "4",
                   "RDZV_ID": "42", "RDZV_ENDPOINT": "gpu007:1234"}


def test_sigusr1_is_asked_for_before_the_time_limit():
    """What SLURM sends (tests/test_exit_and_throughput.py: SIGUSR1 sets the exit reason, as SIGTERM does)."""
    assert "#SBATCH --signal=USR1@300" in open(SBATCH).read().splitlines()


def test_unknown_launcher_is_one_sentence(tmp_path):
    run, args, _ = run_sbatch(tmp_path, "mpirun")
    assert run.returncode == 2 and args == []
    assert run.stderr.strip() == "pretrain_slurm: LAUNCHER=mpirun must be srun or torchrun"
