"""Our universal conversion against DeepSpeed 0.19's ds_to_universal, both ways round.

1. DeepSpeed's tool on our TP2xPP2xDP2 ZeRO-1 checkpoint writes the same tensors as ours.
2. On a checkpoint DeepSpeed's engine wrote (ZeRO-1 and ZeRO-2, DP2), our tool writes what DeepSpeed's writes.
3. The pattern lists our checkpoints record (universal_checkpoint_info) make DeepSpeed's merge of TP slices
   give every parameter of an MoE model whole: the DeepSeek-V3 toy's (MLA, routers with expert bias, shared
   expert, a dense first layer, an MTP depth) and an all-MoE Llama's, with no pattern left unused.
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


def _all_moe_llama():
    from megatron_zero.testing.tiny_gpt import tiny_llama_config
    return tiny_llama_config(2, num_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2, qk_layernorm=True)


@pytest.mark.parametrize("model", ["deepseek_v3_toy", "all_moe_llama"])
def test_deepspeed_merges_our_moe_parameters_at_tp2(tmp_path, model):
    """DeepSpeed's own merge of a parameter's TP slices (ds_to_universal's merge_tp_slices, reading our
    checkpoint's universal_checkpoint_info) on every parameter of the model, each slice as our TP rank 0 / 1
    holds it (model/sharding.py), gives the whole tensor: the experts' and the shared expert's down-projections
    on dim 1 and their SwiGLU [gate; up] block by block, the routers, MLA's down-projections and latent norms
    replicated, an MTP depth's as a block's; and every pattern is used (DeepSpeed refuses an unused one)."""
    from deepspeed.checkpoint.ds_to_universal import merge_tp_slices

    from megatron_zero.checkpoint.deepspeed_layout import universal_checkpoint_info
    from megatron_zero.model.params import param_names, param_spec
    from megatron_zero.model.sharding import shard_tensor
    from megatron_zero.testing.deepseek_toy import deepseek_toy_config

    cfg = deepseek_toy_config() if model == "deepseek_v3_toy" else _all_moe_llama()
    info = universal_checkpoint_info(cfg, cfg.padded_vocab_size(2))
    g = torch.Generator().manual_seed(0)
    unused = None
    for name in param_names(cfg):
        spec = param_spec(name, cfg)
        full = torch.randn(spec.full_shape, generator=g)
        shards = [shard_tensor(full, spec, cfg, 2, rank) for rank in range(2)]
        for rank, shard in enumerate(shards):  # as ds_to_universal's extraction writes a DP rank's fragment
            folder = tmp_path / "slices" / name / str(rank)
            folder.mkdir(parents=True)
            for state in ("fp32", "exp_avg", "exp_avg_sq"):
                torch.save(shard.reshape(-1).clone(), folder / f"{state}.00")
        left = merge_tp_slices(info, str(tmp_path / "zero"), str(tmp_path / "slices"), 2,
                               (name, [s.shape for s in shards]))
        unused = set(left) if unused is None else unused & set(left)
        merged = torch.load(tmp_path / "zero" / name / "fp32.pt", weights_only=False)["param"]
        assert torch.equal(merged, full), (name, tuple(merged.shape), spec.full_shape)
    assert not unused, f"patterns no parameter matches: {sorted(unused)}"


@pytest.mark.slow  # the default tier: test_deepspeed_merges_our_moe_parameters_at_tp2 (DeepSpeed's merge, per parameter)
def test_deepspeed_converts_our_deepseek_toy_checkpoint_like_us(tmp_path):
    """The DeepSeek-V3 toy saved by pretrain_gpt.py at TP2: DeepSpeed's ds_to_universal (strict) writes our
    tools/ds_to_universal.py's tensors, and its routers' expert biases (buffers, which it copies from the
    model-states file) as saved; the checkpoint's own zero_to_fp32.py (merging TP slices by the checkpoint's
    patterns) writes what the package's tools/zero_to_fp32.py does."""
    from megatron_zero.testing.cli import pretrain_cli, text_data, tool
    from megatron_zero.testing.deepseek_toy import deepseek_toy_flags

    data, save = text_data(tmp_path / "data"), tmp_path / "ckpt"
    pretrain_cli(2, deepseek_toy_flags(data, str(tmp_path / "cache"), {"tensor-model-parallel-size": 2,
                                                                       "train-iters": 2, "save": str(save),
                                                                       "save-interval": 2}), timeout=600)
    src = str(save / "global_step2")
    tool("ds_to_universal.py", "--input_folder", src, "--output_folder", str(tmp_path / "ours"))
    deepspeed_convert(src, str(tmp_path / "theirs"))
    ours, theirs = ({d.name for d in (tmp_path / side / "zero").iterdir() if d.is_dir()} for side in ("ours", "theirs"))
    biases = {n for n in theirs - ours if n.endswith(".mlp.deepspeed_moe.gate.expert_bias")}
    assert theirs - ours == biases and len(biases) == 2  # the MoE block's and the MTP depth's
    for name in sorted(ours):
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            a = load_any(os.path.join(tmp_path, "ours", "zero", name, f"{key}.pt"))
            b = load_any(os.path.join(tmp_path, "theirs", "zero", name, f"{key}.pt"))
            assert torch.equal(a["param"], b["param"]), (name, key)
    model_states = torch.load(os.path.join(src, "mp_rank_00_model_states.pt"), weights_only=False)["module"]
    for name in biases:
        assert torch.equal(load_any(os.path.join(tmp_path, "theirs", "zero", name, "fp32.pt"))["param"],
                           model_states[name].float()), name
    tool("zero_to_fp32.py", src, str(tmp_path / "package"), "--quiet")
    copied = subprocess.run([sys.executable, os.path.join(src, "zero_to_fp32.py"), src, str(tmp_path / "copied"),
                             "--quiet"], capture_output=True, text=True, timeout=300)
    assert copied.returncode == 0, copied.stderr[-3000:]
    want = torch.load(tmp_path / "package" / "pytorch_model.bin", weights_only=True)
    got = torch.load(tmp_path / "copied" / "pytorch_model.bin", weights_only=True)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), (name, tuple(got[name].shape), tuple(tensor.shape))
