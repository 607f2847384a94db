"""Messages that say what is true, pinned word for word:

- the loaded line names the layout a checkpoint was saved at with CP and EP where above 1 (an EP2 x CP2
  checkpoint from two ranks is not "DP=1" alone), and the layout it is loaded at likewise;
- a weights-only save says so (its own line, not a full save's);
- the MoE log shows the losses the flags compute and no other (no `load_balancing_loss: 0` under
  --moe-aux-loss-coeff 0, which would read as a balance);
- without a known peak the log lines carry no MFU field (the start of the run says why, once).
The slow test drives them through pretrain_gpt.py: two ranks at EP2 x CP2 with --moe-aux-loss-coeff 0, resumed."""
import argparse
import re
from types import SimpleNamespace

import pytest

from megatron_zero.checkpoint.report import layout_here, loaded_line, saved_layout_text, saved_line
from megatron_zero.metrics.logger import format_train_line
from megatron_zero.moe.metrics import logged_names
from megatron_zero.metrics.run_summary import RunSummary
from megatron_zero.testing.cli import cli_flags, text_data
from megatron_zero.testing.launch import torchrun
from megatron_zero.distributed.topology import Layout


def test_saved_and_loaded_layouts_name_cp_and_ep():
    dense = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "data_parallel_size": 1,
             "zero_stage": 1}
    assert saved_layout_text(dense) == "TP=2 x PP=2 x DP=1, ZeRO-1"  # README's line stays as it is
    moe = dict(dense, tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=2,
               expert_model_parallel_size=2)
    assert saved_layout_text(moe) == "TP=1 x PP=1 x DP=1 x CP=2 x EP=2, ZeRO-1"
    assert saved_layout_text(dict(dense, context_parallel_size=1, expert_model_parallel_size=1.0)) == \
        "TP=2 x PP=2 x DP=1, ZeRO-1"
    line = loaded_line("ckpt/global_step4", "plain", {"iteration": 4, "args": moe}, "TP=1 x PP=1 x DP=2, ZeRO-1")
    assert line == ("loaded checkpoint global_step4 (plain, iteration 4, saved at TP=1 x PP=1 x DP=1 x CP=2 x EP=2, "
                    "ZeRO-1) from ckpt/global_step4, reshaped to TP=1 x PP=1 x DP=2, ZeRO-1")
    layout = Layout(tp=1, pp=1, dp=2)
    assert layout_here(SimpleNamespace(layout=layout, ep_size=2), 3) == "TP=1 x PP=1 x DP=2 x EP=2, ZeRO-3"
    assert layout_here(SimpleNamespace(layout=layout, ep_size=1), 1) == "TP=1 x PP=1 x DP=2, ZeRO-1"


def test_weights_only_saves_have_their_own_line():
    assert saved_line("ckpt/global_step6", 0.5, 2_000_000) == "saved checkpoint ckpt/global_step6 in 0.50 s (2.0 MB, " \
                                                              "4.0 MB/s)"
    assert saved_line("ckpt/weights_only/global_step5", 0.5, 2_000_000, weights_only=True) == (
        "saved weights-only checkpoint ckpt/weights_only/global_step5 in 0.50 s (2.0 MB, 4.0 MB/s; no optimizer "
        "state: a --load of it starts a fresh optimizer at iteration 0)")


@pytest.mark.parametrize("flags,names", [
    (dict(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3), ("load_balancing_loss", "z_loss")),
    (dict(moe_aux_loss_coeff=0.0, moe_z_loss_coeff=1e-3), ("z_loss",)),
    (dict(moe_aux_loss_coeff=0.0), ()),
    (dict(moe_aux_loss_coeff=1e-2, moe_router_load_balancing_type="seq_aux_loss"), ("seq_load_balancing_loss",)),
    (dict(moe_aux_loss_coeff=1e-2, moe_router_load_balancing_type="none"), ()),
    (dict(moe_router_load_balancing_type="sinkhorn", moe_z_loss_coeff=1e-3), ("z_loss",)),
    (dict(moe_aux_loss_coeff=0.1, moe_capacity_factor=1.0), ("load_balancing_loss",)),  # DeepSpeed-MoE's gating
])
def test_the_moe_log_shows_the_losses_the_flags_compute(flags, names):
    config = argparse.Namespace(**{"moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": None, "moe_capacity_factor": None,
                                   "moe_router_load_balancing_type": "aux_loss", **flags})
    assert logged_names(config) == names


def test_no_mfu_field_without_a_peak():
    args = (12, 100, 96, 40.0, 1e-3, 8, 5.5, 1.0, 1.5, 0, 0, 3200.0, 0.002)
    assert format_train_line(*args).endswith("| tokens per second: 3200 |")
    assert format_train_line(*args, mfu=0.3125).endswith("| tokens per second: 3200 | MFU: 31.25% |")


def test_the_summary_names_mfu_and_validation_where_known():
    """A resumed run of 10 iterations of 8 x 64 tokens (one skipped), a peak of 1 TFLOP/s, evaluated: every field;
    the CPU run of tests/test_ctrl_c.py has no peak, no evaluation and drives the line from the command line."""
    start = SimpleNamespace(iteration=20, consumed_train_samples=160, skipped_iterations=1)
    summary = RunSummary(start, 64, 1e9, 2, 1.0)
    summary.start -= 4.0  # four seconds ago
    summary.validated(30, 4.25)
    end = SimpleNamespace(iteration=30, consumed_train_samples=240, skipped_iterations=2)
    line = summary.line(end, (30, 4.5), "ckpt/global_step30")
    found = re.fullmatch(r"training done: iterations 20 to 30 \(10 run, 1 skipped\), 5120 tokens in 4\.0 s \((\d+) "
                         r"tokens/s, MFU ([0-9.]+)%\); final lm loss 4\.500000E\+00 \(iteration 30 alone; a log line "
                         r"averages its interval\); last validation "
                         r"lm loss 4\.250000E\+00 \(iteration 30\); last checkpoint ckpt/global_step30", line)
    assert found, line
    seconds = 5120 / int(found.group(1))  # the elapsed time the line measured (4 s and the microseconds since)
    assert float(found.group(2)) == pytest.approx(100 * 1e9 * 80 / seconds / 2 / 1e12, abs=0.006)
    bare = summary.line(end, None, None)  # no loss read, nothing saved or loaded
    assert "final lm loss" not in bare and bare.endswith("); last validation lm loss 4.250000E+00 (iteration 30); "
                                                         "no checkpoint saved"), bare


@pytest.mark.slow  # the tests above pin each line's wording
@pytest.mark.multirank
def test_an_ep2_cp2_checkpoint_without_aux_loss_through_pretrain(tmp_path):
    data = text_data(str(tmp_path / "text"))
    flags = {"num-experts": 4, "moe-router-topk": 2, "moe-aux-loss-coeff": 0, "expert-model-parallel-size": 2,
             "context-parallel-size": 2, "save": tmp_path / "ckpt", "train-iters": 2, "save-interval": 2}
    first = torchrun(2, cli_flags(data, str(tmp_path / "cache"), "gpt2", flags))
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert "balancing_loss" not in first.stdout and "z_loss" not in first.stdout
    assert "MFU:" not in first.stdout and first.stdout.count("MFU is not reported: no peak TFLOP/s is known") == 1
    again = torchrun(2, cli_flags(data, str(tmp_path / "cache"), "gpt2", flags,
                                  {"load": tmp_path / "ckpt", "train-iters": 3,
                                   "override-opt_param-scheduler": True}))
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert re.search(r"^loaded checkpoint global_step2 \(plain, iteration 2, saved at TP=1 x PP=1 x DP=1 x CP=2 x "
                     r"EP=2, ZeRO-1\) from ", again.stdout, re.M), again.stdout[-3000:]
