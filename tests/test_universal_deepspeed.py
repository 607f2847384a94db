"""Our universal conversion against DeepSpeed 0.19's ds_to_universal, both ways round.

1. DeepSpeed's tool on our TP2xPP2xDP2 ZeRO-1 checkpoint writes the same tensors as ours.
2. On a checkpoint DeepSpeed's engine wrote (ZeRO-1 and ZeRO-2, DP2), our tool writes what DeepSpeed's writes.
"""
import os
import subprocess
import sys

import pytest
import torch

from megatron_zero.checkpoint.reshape.universal_convert import convert_to_universal
from megatron_zero.checkpoint.storage.tensor_io import load_file as load_any
from megatron_zero.testing import run_ranks
from megatron_zero.testing.layout_train import train

try:
    import deepspeed  # noqa: F401
    HAVE_DS = True
except Exception as e:  # pragma: no cover - depends on the environment
    HAVE_DS, WHY = False, f"deepspeed is not importable ({e}); pip install deepspeed==0.19.8 to run this test"

pytestmark = pytest.mark.skipif(not HAVE_DS, reason="deepspeed missing" if HAVE_DS else WHY)
os.environ.setdefault("DS_ACCELERATOR", "cpu")
ENV = dict(os.environ)


def deepspeed_convert(src, out, *extra):
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", src,
           "--output_folder", out, "--num_extract_workers", "1", "--num_merge_workers", "1", *extra]
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def assert_same_universal(ours, theirs):
    names = sorted(d for d in os.listdir(os.path.join(theirs, "zero")) if os.path.isdir(os.path.join(theirs, "zero", d)))
    assert names == sorted(d for d in os.listdir(os.path.join(ours, "zero")) if os.path.isdir(os.path.join(ours, "zero", d)))
    assert names
    for name in names:
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            a = load_any(os.path.join(ours, "zero", name, f"{key}.pt"))
            b = load_any(os.path.join(theirs, "zero", name, f"{key}.pt"))
            assert torch.equal(a["param"], b["param"]), (name, key)
            assert a.get("vocab_tensor", False) == b.get("vocab_tensor", False), name
            assert a.get("cat_dim") == b.get("cat_dim"), (name, key, a.get("cat_dim"), b.get("cat_dim"))
        sa = load_any(os.path.join(ours, "zero", name, "step.pt"))
        sb = load_any(os.path.join(theirs, "zero", name, "step.pt"))
        assert int(sa) == int(sb), name
    return names


def test_deepspeed_converts_our_checkpoint_like_us(tmp_path):
    run_ranks(train, 8, 2, 2, 1, 2, str(tmp_path), None, "universal", 3, 3, timeout=300)
    src = os.path.join(tmp_path, "global_step3")
    convert_to_universal(src, os.path.join(tmp_path, "ours"), progress=False)
    deepspeed_convert(src, os.path.join(tmp_path, "theirs"))
    names = assert_same_universal(os.path.join(tmp_path, "ours"), os.path.join(tmp_path, "theirs"))
    assert "2.self_attention.dense.weight" in names and "tied_modules.embed.word_embeddings.weight" in names


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 16)
        self.fc1 = torch.nn.Linear(16, 37)
        self.fc2 = torch.nn.Linear(37, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(self.fc2(torch.relu(self.fc1(self.embed(x))))).pow(2).mean()


def deepspeed_save(stage, save_dir):
    import importlib
    import deepspeed
    # DeepSpeed's CPU backend JIT-builds a shared-memory all-reduce (an optional speed-up over gloo) into the
    # user-wide torch_extensions cache at init: minutes on a fresh 2-core machine, and forever behind a lock
    # file that an interrupted build left there. The checkpoint files it writes are the same without it.
    # (importlib: the attribute deepspeed.comm.torch is torch itself, star-imported over the submodule)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
           "zero_optimization": {"stage": stage}, "steps_per_print": 1000}
    model = Net()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    g = torch.Generator().manual_seed(engine.global_rank)
    for _ in range(3):
        loss = engine(torch.randint(0, 50, (2, 5), generator=g))
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(save_dir, client_state={"universal_checkpoint_info": {"universal_checkpoint_version": 0.2},
                                                   "iteration": 3})
    return True


# ZeRO-2 is slow: DeepSpeed writes ZeRO-1 and ZeRO-2 optimizer states alike (its stage-1/2 optimizer, the same
# zero_pp_rank files), which stage 1 here converts and compares
@pytest.mark.parametrize("stage", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_we_convert_deepspeed_checkpoint_like_deepspeed(tmp_path, stage):
    run_ranks(deepspeed_save, 2, stage, str(tmp_path), timeout=300)
    src = os.path.join(tmp_path, open(os.path.join(tmp_path, "latest")).read().strip())
    convert_to_universal(src, os.path.join(tmp_path, "ours"), progress=False)
    deepspeed_convert(src, os.path.join(tmp_path, "theirs"))
    names = assert_same_universal(os.path.join(tmp_path, "ours"), os.path.join(tmp_path, "theirs"))
    assert "fc1.weight" in names
