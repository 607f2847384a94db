"""--cpu-optimizer from the command line: the reduced fp32 gradients go to the host as each bucket lands
(zero/host_grads.py, DeepSpeed's ZeRO-Offload), and the run trains as the run without offload does; the
planner's host prediction against the measured peak of an offloaded run.

Parity: the same flags with and without --cpu-optimizer, fp32. The gradients are the same sums in the same
order (host_grads.py adds each landed bucket in launch order), so the first step's loss is equal bit for bit; the
two optimizers are different kernels (the C++ CPU Adam against the device's multi-tensor AdamW: a few ulps of
each update, tests/test_zero_offload.py), so the later losses and the saved weights differ by roundoff only:
normwise within model_rtol of one training step's path (megatron_zero/testing/tolerances.py), far below what a
lost or double-counted bucket does (O(1) on the loss).
"""
import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_zero.model.config import GPTConfig
from megatron_zero.testing.cli import cli_flags, logged_losses, pretrain_cli, text_data
from megatron_zero.testing.host_memory import tool_peak_growth
from megatron_zero.testing.launch import PRETRAIN, ROOT, flags_argv
from megatron_zero.testing.multirank import free_port
from megatron_zero.testing.tolerances import assert_close_normwise, assert_losses_close, gpt_path_length, model_rtol

ITERS = 3


def _saved_weights(checkpoint):
    (path,) = glob.glob(os.path.join(checkpoint, "*", "mp_rank_00_model_states.pt"))
    return torch.load(path, map_location="cpu", weights_only=False)["module"]


def _run(tmp_path, data, nproc, zero, offload):
    save = tmp_path / f"ckpt_{nproc}_{zero}_{offload}"
    flags = cli_flags(data, str(tmp_path / "cache"), "gpt2",
                      {"zero-stage": zero, "cpu-optimizer": offload, "train-iters": ITERS, "save": save,
                       "save-interval": ITERS, "global-batch-size": 8})
    run = pretrain_cli(nproc, flags)
    return logged_losses(run), _saved_weights(str(save))


# slow (two pretrain_gpt.py runs each, about a minute on a loaded 2-core machine): the default tier has
# tests/test_zero_host_grads.py (the same sums bit for bit on 2 ranks, ZeRO 1-3) and
# tests/test_device_placement.py[dp2_zero2_cpu_optimizer] (the trainer's gradient partitions on the host)
@pytest.mark.slow
@pytest.mark.parametrize("nproc,zero", [(2, 2), (2, 1), (1, 1), (1, 2)])
def test_offloaded_run_trains_as_the_run_on_the_device(tmp_path, nproc, zero):
    data = text_data(str(tmp_path / "text"))
    losses, weights = _run(tmp_path, data, nproc, zero, True)
    ref_losses, ref_weights = _run(tmp_path, data, nproc, zero, False)
    assert sorted(losses) == sorted(ref_losses) and len(losses) == ITERS
    assert losses[1] == ref_losses[1]  # the same gradients, the same first step
    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=257,
                       max_position_embeddings=16)
    rtol = model_rtol(gpt_path_length(config, 8 * 16))
    assert_losses_close([losses[i] for i in sorted(losses)], [ref_losses[i] for i in sorted(ref_losses)], rtol,
                        "losses")
    assert weights.keys() == ref_weights.keys()
    for name in weights:
        assert_close_normwise(weights[name].float(), ref_weights[name].float(), rtol, name)


# a GPT of about 11M parameters: its model states (~200 MB under offload) well above what else the run holds
HOST_MODEL = {"num-layers": 4, "hidden-size": 384, "num-attention-heads": 6, "seq-length": 64,
              "max-position-embeddings": 64, "micro-batch-size": 2, "global-batch-size": 2, "train-iters": 2,
              "lr": 1e-4, "tokenizer-type": "ByteTokenizer", "split": "100,0,0", "eval-iters": 0, "log-interval": 1,
              "zero-stage": 2, "cpu-optimizer": True, "device": "cpu"}


@pytest.mark.slow  # a training run and tools/plan.py, a minute on a loaded machine; the default tier:
# tests/test_plan.py::test_planned_step_memory_matches_a_measured_step[zero2_cpu_optimizer's run] (live bytes)
def test_offloaded_run_host_peak_matches_the_plan(tmp_path, monkeypatch):
    """One rank, ZeRO-2 with --cpu-optimizer, fp32, on the CPU (where the device's memory is the host's too): the
    run's peak resident memory beyond its imports (the kernel's high-water mark) against tools/plan.py's
    prediction of the same flags, the rank's peak plus the host's offloaded states and gradient buffers
    (no checkpoint is saved, so none of its staging): within 10 %."""
    data = text_data(str(tmp_path / "text"), docs=200)
    flags = flags_argv({**HOST_MODEL, "data-path": data, "data-cache-path": tmp_path / "cache"})
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    grown = tool_peak_growth(PRETRAIN, *flags, imports=("megatron_zero.training.trainer",))
    plan = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan.py"), *flags, "--vocab-size", "257",
                           "--gpus", "1", "--json"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert plan.returncode == 0, plan.stderr[-2000:]
    got = json.loads(plan.stdout)
    host = got["host_bytes_per_node"]
    predicted = got["peak"] + host["optimizer"] + host["pinned"]
    assert abs(predicted - grown) <= 0.10 * grown, (predicted, grown, got["per_rank_bytes"], host)
