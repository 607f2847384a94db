"""Observability: params-norm against the reference model, the timers' breakdown, Megatron's log line and
TensorBoard tags, wandb in offline mode (no network), and the flags' one-sentence errors."""
import os
import re
import sys

import pytest
import torch

from megatron_zero.arguments import parse_args
from megatron_zero.checkpoint.export.consolidate import get_fp32_state_dict, load_consolidated
from megatron_zero.model.gpt import reference_model
from megatron_zero.pipeline.gpt_stage import build_gpt_stage
from megatron_zero.testing import run_ranks
from megatron_zero.testing.tiny_gpt import tiny_gpt_config
from megatron_zero.metrics.timers import Timers
from megatron_zero.distributed.topology import build_parallel_state
from megatron_zero.zero import ZeroOptimizer
from megatron_zero.testing.launch import model_flags, torchrun


def _params_norm(tp, pp, stage):
    state = build_parallel_state(tp=tp, pp=pp)
    model = build_gpt_stage(tiny_gpt_config(), state)
    opt = ZeroOptimizer(list(model.named_parameters()), dp_group=state.dp_group, stage=stage, mp_group=state.mp_group,
                        tp_rank=state.tp_rank, module=model, lr=1e-3)
    return opt.params_norm()


@pytest.mark.parametrize("world,tp,pp,stage", [(4, 2, 2, 1), (2, 1, 1, 3)])
def test_params_norm_matches_reference(world, tp, pp, stage):
    want = torch.cat([p.detach().reshape(-1) for p in reference_model(tiny_gpt_config()).parameters()]).norm().item()
    got = run_ranks(_params_norm, world, tp, pp, stage, timeout=180)
    assert all(abs(g - want) <= 1e-6 * want for g in got), (got, want)  # fp32 masters, summed in fp64


def test_timers_levels_and_report():
    timers = Timers(1, "minmax", torch.device("cpu"))
    with timers("optimizer", 1):
        sum(range(10000))
    assert timers("forward-compute", 2).elapsed_s == 0.0  # above the level: a no-op
    text, max_ms = timers.report(normalizer=2)
    assert text.splitlines()[0] == "(min, max) time across ranks (ms):"
    assert list(max_ms) == ["optimizer"] and max_ms["optimizer"] > 0
    assert re.match(r"    optimizer \.+: \([0-9.]+, [0-9.]+\)$", text.splitlines()[1])
    assert timers.elapsed_ms() == {"optimizer": 0.0}  # report() reset it


def test_log_line_tags_timers_and_wandb_offline(builtin_corpus, tmp_path):
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    data, tok = builtin_corpus
    tb, wb = tmp_path / "tb", tmp_path / "wandb"
    argv = model_flags(data, tok, **{"pipeline-model-parallel-size": 2, "train-iters": 4, "log-interval": 2,
                                     "eval-interval": 4, "tensorboard-dir": tb, "data-cache-path": tmp_path / "c",
                                     "log-params-norm": True, "log-memory-to-tensorboard": True,
                                     "log-world-size-to-tensorboard": True, "log-timers-to-tensorboard": True,
                                     "timing-log-level": 2, "peak-tflops": 0.05, "wandb-project": "mz-test",
                                     "wandb-exp-name": "offline-run", "wandb-save-dir": wb,
                                     "save": tmp_path / "ckpt", "save-16bit-model": True, "log-straggler": True})
    os.environ["WANDB_MODE"] = "offline"
    try:
        run = torchrun(2, argv)
    finally:
        del os.environ["WANDB_MODE"]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = [ln for ln in run.stdout.splitlines() if " iteration " in ln and "lm loss:" in ln]
    assert len(lines) == 2, run.stdout
    assert re.match(r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration +2/ +4 \|", lines[0])
    for field in ("throughput per GPU (TFLOP/s/GPU):", "params norm:", "tokens per second:", "MFU: "):
        assert field in lines[0]
    # Megatron's breakdown, level 2, every log interval
    for name in ("forward-backward", "forward-compute", "backward-compute", "pipeline-p2p", "optimizer",
                 "embedding-grads-all-reduce", "loss-broadcast"):
        assert re.search(rf"    {name} \.+: \(", run.stdout), name
    # --log-straggler: each rank's forward time (the first iteration left out), against its pipeline stage's
    reports = re.findall(r"straggler report \| .*", run.stdout)  # (tests/test_straggler.py: a rank made slow)
    assert len(reports) == 2 and all(re.search(r"slowest rank \d \(\S+\) [0-9.]+, fastest rank \d \(\S+\) "
                                               r"[0-9.]+, median per pipeline stage [0-9.]+, [0-9.]+ \| ", r)
                                     for r in reports), reports
    events = EventAccumulator(str(tb))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("lm loss", "lm loss vs samples", "iteration-time", "iteration-time vs samples", "throughput",
                "throughput vs samples", "params-norm", "params-norm vs samples", "world-size", "world-size vs samples",
                "mem-rss-bytes", "learning-rate vs samples", "forward-compute-time", "lm loss validation vs samples"):
        assert tag in tags, (tag, sorted(tags))
    assert [e.value for e in events.Scalars("world-size")] == [2.0, 2.0]
    assert [e.step for e in events.Scalars("lm loss vs samples")] == [8, 16, 24, 32]
    # MFU = TFLOP/s per rank / --peak-tflops
    tflops = float(re.search(r"TFLOP/s/GPU\): ([0-9.]+)", lines[1]).group(1))
    mfu = float(re.search(r"MFU: ([0-9.]+)%", lines[1]).group(1))
    assert abs(mfu - 100 * tflops / 0.05) <= 0.01 + 100 * 0.0005 / 0.05
    # wandb wrote an offline run with the run's name and the iteration-indexed scalars
    runs = list((wb / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list(wb.rglob("*"))[:20]
    assert list(runs[0].glob("run-*.wandb"))
    # --save-16bit-model: both pipeline stages' ranks wrote a shard of the bf16 model next to the checkpoint
    bf16 = load_consolidated(str(tmp_path / "ckpt" / "global_step4" / "model_16bit"))
    fp32 = get_fp32_state_dict(str(tmp_path / "ckpt"))
    assert sorted(bf16) == sorted(fp32) and all(torch.equal(bf16[n], t.to(torch.bfloat16)) for n, t in fp32.items())


@pytest.mark.parametrize("flags,words", [
    ({"wandb-project": "p"}, ["--wandb-project", "--wandb-exp-name"]),
    ({"wandb-exp-name": "x"}, ["--wandb-exp-name", "--wandb-project"]),
    ({"wandb-project": "p", "wandb-exp-name": "x"}, ["--wandb-project", "--wandb-save-dir", "--save"]),
    ({"peak-tflops": -1}, ["--peak-tflops -1"]),
])
def test_logging_flags_refused_in_one_sentence(flags, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(model_flags("data", "tok.model", **flags))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.strip().count("\n") == 0, err
    for word in words:
        assert word in err


def test_wandb_missing_is_one_sentence(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now fails, as where it is not installed
    with pytest.raises(SystemExit):
        parse_args(model_flags("data", "tok.model", **{"wandb-project": "p", "wandb-exp-name": "x",
                                                       "wandb-save-dir": tmp_path}))
    assert "--wandb-project p needs the wandb package, which is not installed (pip install wandb)" in capsys.readouterr().err
