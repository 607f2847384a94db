"""What the launch scripts print around pretrain_gpt.py: torchrun's OMP_NUM_THREADS warning never (the scripts
set the thread count), a refusal as our one sentence alone (torchrun's report of the workers' ends left out),
a real failure with torchrun's whole report; and pretrain_slurm.sbatch run outside SLURM says how to submit it."""
import os
import subprocess
import sys

import pytest

from megatron_zero.testing.launch import PRETRAIN, ROOT, byte_data, tiny_flags
from megatron_zero.testing.multirank import free_port

WRAPPER = os.path.join(ROOT, "scripts", "pretrain_torchrun.sh")
SBATCH = os.path.join(ROOT, "scripts", "pretrain_slurm.sbatch")


def _wrapper(argv):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # as a user's shell has it
    env.update(PYTHON=sys.executable, PYTHONPATH=ROOT)
    cmd = ["bash", WRAPPER, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    return subprocess.run(cmd + argv, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.multirank
def test_a_run_prints_no_thread_warning_and_a_refusal_is_one_sentence(tmp_path):
    data = byte_data(tmp_path / "bytes")
    done = _wrapper([PRETRAIN] + tiny_flags(tmp_path, data))
    assert done.returncode == 0, done.stderr
    assert "OMP_NUM_THREADS" not in done.stdout + done.stderr, done.stderr
    refused = _wrapper([PRETRAIN] + tiny_flags(tmp_path, data, **{"num-attention-heads": 3, "save": None}))
    assert refused.returncode == 2
    assert refused.stdout == ""
    assert refused.stderr.strip() == "pretrain_gpt.py: error: --hidden-size 32 is not divisible by " \
                                     "--num-attention-heads 3; give the head dimension with --kv-channels", refused.stderr


@pytest.mark.multirank
def test_a_crash_keeps_torchruns_report(tmp_path):
    crash = tmp_path / "crash.py"
    crash.write_text("raise RuntimeError('the worker broke')\n")
    run = _wrapper([str(crash)])
    assert run.returncode == 1
    assert "RuntimeError: the worker broke" in run.stderr
    assert "failed (exitcode: 1)" in run.stderr and "ChildFailedError" in run.stderr, run.stderr


@pytest.mark.parametrize("argv", [["--help"], ["--num-layers", "2"]])
def test_sbatch_outside_slurm_says_how_to_submit(argv):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    run = subprocess.run(["bash", SBATCH, *argv], capture_output=True, text=True, env=env, timeout=30)
    assert "unbound variable" not in run.stderr
    if argv == ["--help"]:
        assert run.returncode == 0 and run.stderr == ""
        assert run.stdout.startswith("Multi-node pretraining under SLURM.")
        assert "LAUNCHER=torchrun sbatch --nodes 4" in run.stdout and "#SBATCH" not in run.stdout
    else:
        assert run.returncode == 2 and run.stdout == ""
        assert run.stderr.startswith("pretrain_slurm: this is a SLURM batch script and SLURM_JOB_NODELIST is "
                                     "unset (not inside a job): submit it, e.g. sbatch --nodes 2"), run.stderr
        assert len(run.stderr.strip().splitlines()) == 1


def test_every_launcher_sets_the_thread_count_or_runs_through_the_wrapper():
    """pretrain_local.sh and torchrun_node.sh run torchrun through pretrain_torchrun.sh, which sets it;
    demo.sh and examples/pretrain_llama.sh set it themselves (their other commands are threaded too)."""
    wrapper = open(WRAPPER).read()
    assert "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}" in wrapper.splitlines()
    for script in ("scripts/pretrain_local.sh", "scripts/torchrun_node.sh"):
        text = open(os.path.join(ROOT, script)).read()
        assert 'scripts/pretrain_torchrun.sh"' in text and "torch.distributed.run" not in text, script
    for script in ("scripts/demo.sh", "examples/pretrain_llama.sh"):
        assert "export OMP_NUM_THREADS=" in open(os.path.join(ROOT, script)).read(), script
