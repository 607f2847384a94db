"""An elastic job (torchrun --nnodes MIN:MAX, c10d rendezvous) that loses a node goes on at the world size left:
the checkpoint is reshaped to the new DP while loading, the global batch is kept by more micro-batches a step
(one line says so), and a world size the flags cannot use is refused naming those they can.

Tolerance of the resumed losses: relative 1e-5, the reshaped-resume bound of tests/test_cli_resume.py (another
DP reorders the fp32 gradient sums, a few eps per step; a lost Adam moment, lr step or data position moves a
loss by more than 1e-3).

Before attempts formed their process group through their own part of the launcher's store, the survivor's
restarted worker hung or died in init_process_group (tests/test_restarts.py).
"""
import time

import pytest

from megatron_zero.training import trainer as training
from megatron_zero.testing.launch import byte_data, tiny_flags
from megatron_zero.testing.multirank import free_port
from megatron_zero.testing.restarts import RestartJob, resumed_from

RESHAPED_REL = 1e-5


def test_a_world_size_the_flags_cannot_use_is_refused_naming_those_they_can(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(training, "stop_with_launcher", lambda: True)
    for name, value in {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "TORCHELASTIC_RESTART_COUNT": "1"}.items():
        monkeypatch.setenv(name, value)
    data = byte_data(tmp_path / "bytes")
    flags = tiny_flags(tmp_path, data, **{"tensor-model-parallel-size": 2, "global-batch-size": 8})
    with pytest.raises(SystemExit) as stopped:
        training.pretrain(flags)
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert err.startswith("pretrain_gpt.py: error: at world size 3 after a restart: world size 3 is not divisible by "
                          "--tensor-model-parallel-size 2"), err
    assert err.endswith("these flags work at world size 2, 4, 8"), err  # DP 1, 2, 4 divide 8 / 2 micro-batches


def _agent(tmp_path, name, flags, endpoint, host):
    """One node's torchrun (one worker) of a 1:2-node job; `host`: it serves the rendezvous endpoint."""
    return RestartJob(tmp_path, 1, flags, max_restarts=2, log_name=f"{name}.log", torchrun_args=[
        "--nnodes", "1:2", "--nproc_per_node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
        "--rdzv-id", "elastic-test", "--rdzv-conf", f"is_host={str(host).lower()},last_call_timeout=15"])


@pytest.mark.slow  # covered in the default tier by test_restarts.py (the restart) and the refusal above
def test_an_elastic_job_that_loses_a_node_finishes_at_half_the_dp(tmp_path):
    data = byte_data(tmp_path / "bytes")
    flags = tiny_flags(tmp_path, data, **{"train-iters": 24, "save-interval": 10, "load": tmp_path / "ckpt",
                                          "distributed-timeout-minutes": 1, "hidden-dropout": 0.0,
                                          "attention-dropout": 0.0})  # the same at any DP
    endpoint = f"127.0.0.1:{free_port()}"
    first = _agent(tmp_path, "first", flags, endpoint, True)  # the node that stays
    try:
        time.sleep(3)  # its rendezvous store is up before the other node joins (it waits up to 15 s for one)
        second = _agent(tmp_path, "second", flags, endpoint, False)
        try:
            first.wait_for(r"iteration +11/")
            second.kill()  # the whole node: its agent's process group; its worker follows its launcher
            assert first.finish() == 0, first.text()[-4000:]
        finally:
            second.kill()
    finally:
        first.kill()
    text = first.text()
    assert ("resuming at DP=1 after a restart (saved at DP=2): 2 micro-batches a step instead of 1, the global "
            "batch of 4 samples kept") in text, text[-4000:]
    assert "on TP=1 x PP=1 x DP=2" in text and "on TP=1 x PP=1 x DP=1" in text
    before, after = first.attempts()
    resumed = int(resumed_from(text)[-1].rsplit("global_step", 1)[1])
    assert max(after) == 24 and min(after) == resumed + 1, text[-4000:]
    again = sorted(set(before) & set(after))
    assert again, text[-4000:]
    for i in again:
        assert abs(after[i] - before[i]) <= RESHAPED_REL * abs(before[i]), (i, before[i], after[i])
