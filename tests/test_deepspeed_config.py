"""The DeepSpeed JSON: every documented key with a meaning here honoured as DeepSpeed reads it, the rest refused."""
import json

import pytest
import torch
from deepspeed.runtime import lr_schedules
from deepspeed.runtime.config import DeepSpeedConfig

from megatron_zero.config import from_args
from megatron_zero.arguments import parse_args
from megatron_zero.optimizer.lr_schedule import build_lr_schedule

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--train-iters", "40"]


def args_with(tmp_path, config, world_size=1, extra=()):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return parse_args(MODEL + ["--deepspeed-config", str(path)] + list(extra), world_size=world_size)


def refusal(tmp_path, config, capsys, world_size=1, extra=()):
    with pytest.raises(SystemExit) as exit_info:
        args_with(tmp_path, config, world_size, extra)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


def deepspeed_batches(config: dict, dp: int):
    """DeepSpeed's own batch arithmetic (runtime/config.py), run on a bare DeepSpeedConfig."""
    ds = DeepSpeedConfig.__new__(DeepSpeedConfig)
    ds.world_size = dp
    ds.train_batch_size = config.get("train_batch_size")
    ds.train_micro_batch_size_per_gpu = config.get("train_micro_batch_size_per_gpu")
    ds.gradient_accumulation_steps = config.get("gradient_accumulation_steps")
    ds._set_batch_related_parameters()
    ds._batch_assertion()
    return ds.train_micro_batch_size_per_gpu, ds.train_batch_size, ds.gradient_accumulation_steps


@pytest.mark.parametrize("config,dp", [
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 4),  # global batch mb x GA x DP = 32, not mb x GA = 8
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3}, 2),
    ({"train_batch_size": 16}, 4),
    ({"train_micro_batch_size_per_gpu": 5}, 2),
    ({"train_batch_size": 48, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 6}, 4),
])
def test_batch_sizes_as_deepspeed_computes_them(tmp_path, config, dp):
    args = args_with(tmp_path, config, world_size=dp, extra=["--lr", "1"])
    micro, train, accum = deepspeed_batches(config, dp)
    assert (args.micro_batch_size, args.global_batch_size, args.num_micro_batches) == (micro, train, accum)


def test_batch_conflicts_and_auto(tmp_path, capsys):
    err = refusal(tmp_path, {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 2,
                             "gradient_accumulation_steps": 4}, capsys, world_size=4, extra=["--lr", "1"])
    assert "train_batch_size 30 != train_micro_batch_size_per_gpu 2 x gradient_accumulation_steps 4" in err
    err = refusal(tmp_path, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, capsys,
                  world_size=4, extra=["--lr", "1", "--global-batch-size", "8"])
    assert "--global-batch-size 8 disagrees with train_batch_size=32" in err
    auto = {k: "auto" for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                "gradient_clipping")}
    args = args_with(tmp_path, auto, 2, ["--lr", "1", "--micro-batch-size", "3", "--global-batch-size", "12"])
    assert (args.micro_batch_size, args.global_batch_size, args.num_micro_batches, args.clip_grad) == (3, 12, 2, 1.0)


def test_precision_and_loss_scaler_keys(tmp_path, capsys):
    base = {"train_micro_batch_size_per_gpu": 1}
    assert args_with(tmp_path, dict(base, bfloat16={"enabled": True}), extra=["--lr", "1"]).bf16
    assert not args_with(tmp_path, dict(base, bf16={"enabled": "auto"}), extra=["--lr", "1"]).bf16
    fp16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
            "hysteresis": 3, "min_loss_scale": 0.5, "consecutive_hysteresis": False, "auto_cast": False}
    a = args_with(tmp_path, dict(base, fp16=fp16), extra=["--lr", "1"])
    assert (a.fp16, a.loss_scale, a.initial_loss_scale, a.loss_scale_window, a.hysteresis, a.min_loss_scale) == \
        (True, None, 4096.0, 500, 3, 0.5)
    assert args_with(tmp_path, dict(base, fp16={"enabled": True, "loss_scale": 128}), extra=["--lr", "1"]).loss_scale == 128
    err = refusal(tmp_path, dict(base, bf16={"enabled": True}, bfloat16={"enabled": True}), capsys, extra=["--lr", "1"])
    assert "bf16" in err and "bfloat16" in err


def test_optimizer_keys(tmp_path, capsys):
    opt = {"type": "Adam", "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1,
                                      "torch_adam": True, "adam_w_mode": True}}
    a = args_with(tmp_path, {"train_micro_batch_size_per_gpu": 1, "optimizer": opt})
    assert (a.lr, a.adam_beta1, a.adam_beta2, a.adam_eps, a.weight_decay) == (3e-4, 0.8, 0.95, 1e-6, 0.1)
    auto = {"type": "AdamW", "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}}
    a = args_with(tmp_path, {"train_micro_batch_size_per_gpu": 1, "optimizer": auto}, extra=["--lr", "2e-3"])
    assert (a.lr, a.adam_beta1, a.weight_decay) == (2e-3, 0.9, 0.01)


def test_unknown_keys_listed_in_one_sentence(tmp_path, capsys):
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimisation": {"stage": 2},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
              "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "overlap_comm": True,
                                    "allgather_bucket_size": 5e8},
              "wall_clock_breakdown": True, "scheduler": {"type": "OneCycle", "params": {}}}
    err = refusal(tmp_path, config, capsys, extra=["--lr", "1"])
    for word in ("zero_optimisation.stage", "optimizer.type SGD", "optimizer.params.momentum",
                 "zero_optimization.offload_param.device", "zero_optimization.overlap_comm",
                 "zero_optimization.allgather_bucket_size", "wall_clock_breakdown true", "scheduler.type OneCycle"):
        assert word in err, (word, err)
    err = refusal(tmp_path, {"train_micro_batch_size_per_gpu": 1,
                             "optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}, capsys, extra=["--lr", "1"])
    assert "optimizer.params.adam_w_mode false (only true)" in err


def deepspeed_lrs(kind, params, lr, steps):
    """The lr of each optimizer step under DeepSpeed: built at iteration -1, stepped after each step."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = getattr(lr_schedules, kind)(opt, **params)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        sched.step()
    return out


@pytest.mark.parametrize("kind,params", [
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 10}),
    ("WarmupLR", {"warmup_min_lr": 0, "warmup_num_steps": 7, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 30, "warmup_min_lr": 1e-5, "warmup_max_lr": 2e-3, "warmup_num_steps": 8}),
    ("WarmupDecayLR", {"total_num_steps": 25, "warmup_num_steps": 5, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 30, "warmup_min_ratio": 0.1, "warmup_num_steps": 6,
                        "cos_min_ratio": 0.01}),
    ("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 1, "warmup_type": "linear"}),
])
def test_scheduler_matches_deepspeeds_classes(tmp_path, kind, params):
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 5e-4}},
              "scheduler": {"type": kind, "params": params}}
    schedule = build_lr_schedule(from_args(args_with(tmp_path, config)))
    steps = params.get("total_num_steps", 20) + 6
    ours = [schedule.lr(n) for n in range(steps)]
    theirs = deepspeed_lrs(kind, params, 5e-4, steps)
    assert ours == pytest.approx(theirs, rel=1e-12, abs=0), (ours, theirs)  # same formula, same operation order
    for n in range(3):  # stepping and resuming from a state dict follow the same values
        schedule.step()
    assert schedule.lr() == pytest.approx(theirs[3], rel=1e-12)


def test_scheduler_auto_and_conflicts(tmp_path, capsys):
    config = {"train_micro_batch_size_per_gpu": 1,
              "scheduler": {"type": "WarmupDecayLR", "params": {k: "auto" for k in (
                  "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")}}}
    schedule = build_lr_schedule(from_args(args_with(tmp_path, config, extra=["--lr", "1e-3", "--lr-warmup-iters", "4"])))
    theirs = deepspeed_lrs("WarmupDecayLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 4,
                                             "total_num_steps": 40}, 1e-3, 45)
    assert [schedule.lr(n) for n in range(45)] == pytest.approx(theirs, rel=1e-12)
    config["scheduler"]["params"] = {"warmup_num_steps": 5, "total_num_steps": 40}
    err = refusal(tmp_path, config, capsys, extra=["--lr", "1e-3", "--lr-decay-style", "cosine"])
    assert "--lr-decay-style and scheduler WarmupDecayLR" in err
    err = refusal(tmp_path, config, capsys, extra=["--lr", "1e-3", "--lr-warmup-iters", "3"])
    assert "--lr-warmup-iters" in err
    err = refusal(tmp_path, {"train_micro_batch_size_per_gpu": 1, "scheduler": {
        "type": "WarmupCosineLR", "params": {"warmup_num_steps": 5}}}, capsys, extra=["--lr", "1e-3"])
    assert "needs params.total_num_steps" in err
