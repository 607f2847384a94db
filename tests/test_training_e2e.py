"""pretrain_gpt.py end to end: 4 ranks, TensorBoard tags, falling loss, flags refused without traceback,
and preemption by SIGTERM (save, exit 0, resume at the right iteration)."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from megatron_zero.testing.launch import PRETRAIN, losses_from_log, model_flags, torchrun
from megatron_zero.testing.multirank import free_port
from conftest import ROOT


def test_four_ranks_train_and_log_tensorboard(builtin_corpus, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data, tok = builtin_corpus
    tb = tmp_path / "tb"
    argv = model_flags(data, tok, **{"tensor-model-parallel-size": 2, "pipeline-model-parallel-size": 2,
                                     "tensorboard-dir": tb, "data-cache-path": tmp_path / "cache",
                                     "save": tmp_path / "ckpt"})
    run = torchrun(4, argv)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    losses = losses_from_log(run.stdout)
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.3, losses
    assert "validation loss at iteration 6" in run.stdout
    events = EventAccumulator(str(tb))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("lm loss", "learning-rate", "grad-norm", "loss-scale", "batch-size", "lm loss validation",
                "lm loss validation ppl"):
        assert tag in tags, tags
    tb_losses = [e.value for e in events.Scalars("lm loss")]
    assert [e.step for e in events.Scalars("lm loss")] == list(range(1, 13))
    assert tb_losses == pytest.approx(losses, rel=1e-5)
    # a user sees what the model learned: sample from the TP2 x PP2 checkpoint on one process
    gen = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "generate_text.py"), "--load",
                          str(tmp_path / "ckpt"), "--prompt", "The import statement", "--max-new-tokens", "8",
                          "--greedy"], capture_output=True, text=True, timeout=120)
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("The import statement") and len(gen.stdout.split()) > 3


# the last two are slow: the first shows the script's way out (exit 2, one line), and
# tests/test_arguments.py::test_inconsistencies_are_one_sentence checks every one of these sentences in process
@pytest.mark.parametrize("flags,words", [
    ({"global-batch-size": 7}, ["--global-batch-size 7", "--micro-batch-size 2"]),
    pytest.param({"num-attention-heads": 3}, ["--hidden-size 64", "--num-attention-heads 3"], marks=pytest.mark.slow),
    pytest.param({"fp16": True, "bf16": True}, ["--fp16", "--bf16"], marks=pytest.mark.slow),
])
def test_bad_flags_are_one_sentence_without_traceback(builtin_corpus, flags, words):
    data, tok = builtin_corpus
    run = subprocess.run([sys.executable, PRETRAIN] + model_flags(data, tok, **flags), capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr and run.stderr.strip().count("\n") == 0, run.stderr
    for word in words:
        assert word in run.stderr


def launch_direct(world, argv, log_dir):
    """Ranks started as srun would (RANK/WORLD_SIZE in the environment), so signals reach them directly."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        out = open(os.path.join(log_dir, f"rank{rank}.log"), "w")
        procs.append((subprocess.Popen([sys.executable, PRETRAIN] + argv, env=env, stdout=out,
                                       stderr=subprocess.STDOUT), out))
    return procs


def test_sigterm_saves_and_exits_zero_then_resumes(builtin_corpus, tmp_path):
    data, tok = builtin_corpus
    save = tmp_path / "ckpt"
    argv = model_flags(data, tok, **{"train-iters": 200, "exit-signal-handler": True, "save": save,
                                     "save-interval": 1000, "data-cache-path": tmp_path / "cache",
                                     "eval-iters": 0})
    procs = launch_direct(2, argv, tmp_path)
    log1 = tmp_path / "rank1.log"
    deadline = time.monotonic() + 240
    while " iteration        3/" not in (log1.read_text() if log1.exists() else "") and \
            " iteration        3/" not in (tmp_path / "rank0.log").read_text():
        assert time.monotonic() < deadline, "training did not reach iteration 3"
        assert all(p.poll() is None for p, _ in procs), (tmp_path / "rank0.log").read_text()[-2000:]
        time.sleep(0.2)
    procs[1][0].send_signal(signal.SIGTERM)  # one rank is told; all must agree to stop
    codes = [p.wait(timeout=240) for p, _ in procs]
    for _, out in procs:
        out.close()
    log = (tmp_path / "rank0.log").read_text() + (tmp_path / "rank1.log").read_text()
    assert codes == [0, 0], log[-3000:]
    assert "exit signal received" in log
    stopped = int(re.findall(r"exiting after iteration (\d+)", log)[0])
    assert 3 <= stopped < 200
    assert (save / "latest").read_text().strip() == f"global_step{stopped}"
    resumed = torchrun(2, model_flags(data, tok, **{"train-iters": stopped + 2, "load": save,
                                                    "override-opt_param-scheduler": True,
                                                    "data-cache-path": tmp_path / "cache", "eval-iters": 0}))
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"from iteration {stopped}" in resumed.stdout
    assert re.search(rf" iteration +{stopped + 1}/", resumed.stdout)
