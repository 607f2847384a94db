"""DeepSpeed-MoE checkpoints written by Megatron-DeepSpeed's own MoE GPT, loaded by ours, driven as users run them.

Megatron-DeepSpeed's pretrain_gpt.py runs as bench/bench_vs_megatron_deepspeed.py runs its `dp2moe` layout (DP 2,
ZeRO-1, --no-pipeline-parallel as its MoE examples require, every second MLP a DeepSpeed-MoE layer of 4 experts
over EP 2, top-2, capacity factor 1, min capacity 4, aux loss 0.01, --create-moe-param-group), with the schedule
of tests/test_megatron_deepspeed_interop.py (--weight-decay 0, no clipping: the reasons are there) and
--disable-moe-top2-2nd-expert-sampling (the second expert's Gumbel draws come from each framework's default
generator, whose stream differs between them; without sampling the gating is a function of the weights; tokens
are dropped by capacity as the flags say). MDS trains 7 iterations and saves at 6 and 7 (per-expert
`layer_{M}_expert_{E}_mp_rank_00_model_states.pt` under global ids, the ZeRO files' expert groups under each EP
rank's local ids). MDS's own resume of that checkpoint
fails on this CPU (DeepSpeed 0.19.8: its MoE branch of language_model.load_state_dict raises IndexError on the
`encoderlayers.*` keys its state_dict_for_save_checkpoint writes), so its uninterrupted iteration 7 is the
reference, which a resume from the same state reproduces (dropout 0, no random gating). Ours resumes global_step6:
  --load at EP 2 (the layout saved)      the iteration-7 loss equals MDS's, and the weights after the step too
  --load at EP 1 (reshaped while loading), and through tools/ds_to_universal.py + --universal-checkpoint at EP 1:
                                         the same iteration-7 loss.
Tolerances: losses 1e-5 (both print 7 significant digits; the forward passes agree to fp32 roundoff), weights
1e-5 absolute (one Adam step of lr 8e-4 from equal states). Needs Megatron-DeepSpeed set up by
bench/peers/setup_megatron_deepspeed.sh (its MoE save needs the wrapper that script installs for DeepSpeed >= 0.19);
skipped, saying so, without it.
"""
import os
import subprocess
import sys

import pytest

from tests.test_megatron_deepspeed_interop import (EXT_DIR, MDS_DIR, MDS_PYTHON, ROOT, SCHEDULE, _bench,
                                                   _loss_at_7, _max_weight_difference)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not (os.path.isfile(os.path.join(MDS_DIR, "pretrain_gpt.py")) and os.access(MDS_PYTHON, os.X_OK) and EXT_DIR),
    reason="Megatron-DeepSpeed is not set up: run bench/peers/setup_megatron_deepspeed.sh and set MDS_DIR, "
           "MDS_PYTHON and TORCH_EXTENSIONS_DIR")]

LAYOUT = "dp2moe"


def _moe_flags(b, ep):
    flags = list(b.LAYOUT_FLAGS[LAYOUT])
    flags[flags.index("--moe-expert-parallel-size") + 1] = str(ep)
    return flags + ["--disable-moe-top2-2nd-expert-sampling"]


def _run(b, data, side, work, extra, ep=2):
    if side == "mds":
        cmd, cwd = b.mds_cmd(LAYOUT, data, 7, MDS_DIR, MDS_PYTHON, work, extra=[*_moe_flags(b, ep), *extra])
        config = os.path.join(work, f"ds_{LAYOUT}.json")  # DeepSpeed clips by its JSON, not --clip-grad
        with open(config) as f:
            ds = f.read()
        with open(config, "w") as f:
            f.write(ds.replace('"gradient_clipping": 1.0', '"gradient_clipping": 0.0'))
    else:
        cmd, cwd = b.ours_cmd(LAYOUT, data, 7, extra=[*_moe_flags(b, ep), *extra])
    tp, pp, dp = b.LAYOUTS[LAYOUT]
    try:
        p = subprocess.run(cmd, cwd=cwd, env=b.launch_env(cwd, tp * pp * dp, EXT_DIR), capture_output=True,
                           text=True, timeout=900)
    finally:
        b.remove_shm_buffers(cmd)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"{side} failed:\n{out[-4000:]}"
    return out


def test_megatron_deepspeed_moe_to_ours(tmp_path):
    b = _bench()
    data = b.build_data(str(tmp_path))
    work = str(tmp_path)
    a, ours = str(tmp_path / "mds_save"), str(tmp_path / "ours")
    mds = _loss_at_7(_run(b, data, "mds", work, ["--save", a, "--save-interval", "6", *SCHEDULE]))
    step6 = os.path.join(a, "global_step6")
    files = sorted(os.listdir(step6))
    assert [f for f in files if f.startswith("layer_")] == [  # 4 layers, every second an MoE layer
        f"layer_{m}_expert_{e}_mp_rank_00_model_states.pt" for m in range(2) for e in range(4)], files
    loss = _loss_at_7(_run(b, data, "ours", work, ["--load", step6, "--save", ours, "--save-interval", "100",
                                                   *SCHEDULE]))
    assert abs(loss - mds) <= 1e-5, (loss, mds)
    assert _max_weight_difference(os.path.join(a, "global_step7"), os.path.join(ours, "global_step7")) <= 1e-5
    reshaped = _loss_at_7(_run(b, data, "ours", work, ["--load", step6, *SCHEDULE], ep=1))
    assert abs(reshaped - mds) <= 1e-5, ("EP1", reshaped, mds)
    universal = str(tmp_path / "universal")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "ds_to_universal.py"), "--input_folder", step6,
                    "--output_folder", universal], check=True, capture_output=True)
    loss = _loss_at_7(_run(b, data, "ours", work, ["--load", universal, "--universal-checkpoint", *SCHEDULE], ep=1))
    assert abs(loss - mds) <= 1e-5, ("universal EP1", loss, mds)
