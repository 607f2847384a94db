"""Megatron-LM flags a pretraining script carries that were refused: --ckpt-step resumes an older checkpoint than
`latest` names (a missing one refused in one sentence naming those there), --use-flash-attn is --attention-backend
flash, and --transformer-impl is taken and says in one line which layers run. From pretrain_gpt.py."""
import re

from megatron_zero.arguments import parse_args
from megatron_zero.testing.flag_checks import BASE, with_flags
from megatron_zero.testing.launch import byte_data, pretrain


def test_ckpt_step_resumes_an_older_checkpoint(tmp_path):
    data = byte_data(str(tmp_path / "bytes"))
    run = pretrain(tmp_path, data, **{"train-iters": 4, "save-interval": 2})
    assert run.returncode == 0, run.stderr[-2000:]
    first = {int(i): float(v) for i, v in re.findall(r"iteration\s+(\d+)/.*?lm loss: ([0-9.E+-]+)", run.stdout)}
    again = pretrain(tmp_path, data, **{"train-iters": 4, "load": tmp_path / "ckpt", "ckpt-step": 2,
                                        "overwrite-checkpoints": True, "save": tmp_path / "again"})
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-2000:]
    assert "--ckpt-step 2: resuming global_step2, not the newest (global_step4)" in out
    resumed = {int(i): float(v) for i, v in re.findall(r"iteration\s+(\d+)/.*?lm loss: ([0-9.E+-]+)", again.stdout)}
    assert sorted(resumed) == [3, 4] and all(resumed[i] == first[i] for i in resumed)  # the same steps again
    missing = pretrain(tmp_path, data, **{"train-iters": 4, "load": tmp_path / "ckpt", "ckpt-step": 3})
    err = [line for line in missing.stderr.splitlines() if "--ckpt-step 3" in line]
    assert missing.returncode != 0 and len(err) == 1 and "global_step2, global_step4" in err[0], missing.stderr[-2000:]


def test_flash_attn_and_transformer_impl(tmp_path):
    args = parse_args(with_flags(BASE, use_flash_attn=True, attention_dropout=0.0), world_size=1)
    assert args.attention_backend == "flash"
    run = pretrain(tmp_path, byte_data(str(tmp_path / "bytes")), **{"transformer-impl": "transformer_engine"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "--transformer-impl transformer_engine: megatron_zero's own layers run" in run.stdout + run.stderr
