"""Megatron-Core torch_dist checkpoints into ours, read with plain torch.distributed.checkpoint.

Default tier (no megatron-core needed): a torch_dist directory written here with torch's own DCP writer under
Megatron-Core's names maps onto our parameters exactly (whole tensors and one-layer slices of the stacked
ones, the padded vocabulary rows dropped, the step from common.pt), a mixture-of-experts key is refused by
name, and a Megatron-LM save directory is told from ours.

Slow tier: megatron-core 0.16.1 itself (megatron_zero/testing/mcore_peer.py, a subprocess on gloo) writes a
GPT and a Llama checkpoint at TP2 after one FP32Optimizer (AdamW) step; ours loads each at TP1, TP2, PP2 and
DP2 ZeRO-3. Tolerances: fp32 logits of two implementations that sum in other orders agree to ~1e-7
relative (logits are O(1)), so 1e-5 absolute; after one Adam step from the loaded moments the weights move
by about lr = 1e-2 and agree to 1e-5 (the QKV key bias aside: its gradient is exactly zero in exact
arithmetic, so Adam turns roundoff into lr-sized updates, tiny_gpt.without_key_bias).
"""
import os
import subprocess
import sys
from argparse import Namespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_zero.checkpoint.errors import CheckpointError
from megatron_zero.checkpoint.interop.mcore_names import mcore_key
from megatron_zero.checkpoint.interop.megatron_layout import find_megatron_checkpoint
from megatron_zero.checkpoint.interop.torch_dist import TorchDistFiles
from megatron_zero.model.gpt import reference_model
from megatron_zero.model.params import param_names
from megatron_zero.model.sharding import gather_state_dicts
from megatron_zero.testing import run_ranks
from megatron_zero.testing.layout_train import full_weights
from megatron_zero.testing.tiny_gpt import tiny_llama_config, without_key_bias

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _full_model(cfg):
    torch.manual_seed(0)
    model = reference_model(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return gather_state_dicts([{n: p.detach() for n, p in model.named_parameters()}], cfg)


def _write_torch_dist(directory, cfg, full, pad_rows=3, extra=None):
    """A torch_dist checkpoint of `full` under Megatron-Core's names: layers stacked, vocabulary padded."""
    tensors = {}
    for name, t in full.items():
        key, layer = mcore_key(name, cfg)
        if key.startswith("embedding.word") or key == "output_layer.weight":
            t = torch.cat([t, torch.full((pad_rows, t.shape[1]), 7.0)])
        if layer is None:
            tensors[key] = t.clone()
        else:
            tensors.setdefault(key, [None] * cfg.num_layers)[layer] = t
    tensors = {k: torch.stack(v) if isinstance(v, list) else v for k, v in tensors.items()}
    tensors.update({f"optimizer.state.exp_avg.{k}": v * 0.5 for k, v in list(tensors.items())})
    tensors.update({f"optimizer.state.exp_avg_sq.{k[len('optimizer.state.exp_avg.'):]}": v.abs()
                    for k, v in list(tensors.items()) if k.startswith("optimizer.state.exp_avg.")})
    tensors.update(extra or {})
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(directory), no_dist=True)
    torch.save({"args": Namespace(num_layers=cfg.num_layers, tensor_model_parallel_size=2), "iteration": 5,
                "optimizer": {"state": {"common_step": torch.tensor(5.0)}, "param_groups": []}},
               os.path.join(directory, "common.pt"))


def test_torch_dist_names_and_slices(tmp_path):
    """Every parameter of a Llama (GQA, SwiGLU, untied) reads back exactly from the stacked MC tensors."""
    cfg = tiny_llama_config(num_layers=3)
    full = _full_model(cfg)
    ckpt = tmp_path / "iter_0000005"
    _write_torch_dist(str(ckpt), cfg, full)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    assert find_megatron_checkpoint(str(tmp_path)) == (str(ckpt), "torch_dist")
    files = TorchDistFiles(str(ckpt), cfg)
    assert files.step(param_names(cfg)[0]) == 5 and files.model_states(0)["iteration"] == 5
    for name in param_names(cfg):
        t, _, sub = files.full(name, "fp32")
        assert torch.equal(t, full[name]), name
        assert torch.equal(files.full(name, "exp_avg")[0], full[name] * 0.5), name
        assert sub == (2 if name.endswith("dense_h_to_4h.weight") else 1)


def test_torch_dist_refusals(tmp_path):
    """An expert tensor, or a checkpoint of another depth, is refused in one sentence naming it."""
    cfg = tiny_llama_config(num_layers=2)
    full = _full_model(cfg)
    key = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    _write_torch_dist(str(tmp_path / "moe"), cfg, full, extra={key: torch.zeros(2, 4, 8, 8)})
    with pytest.raises(CheckpointError, match=f"mixture-of-experts tensor {key}"):
        TorchDistFiles(str(tmp_path / "moe"), cfg)
    _write_torch_dist(str(tmp_path / "dense"), cfg, full)
    deeper = tiny_llama_config(num_layers=3)
    files = TorchDistFiles(str(tmp_path / "dense"), deeper)
    with pytest.raises(CheckpointError, match="stacks 2 layers but this model has 3"):
        files.full("2.input_layernorm.weight", "fp32")


# ---- against megatron-core itself (slow) --------------------------------------------------------------------

LAYOUTS = [(1, 1, 1, 1), (2, 1, 1, 2), (1, 2, 1, 2), (1, 1, 3, 2)]  # (tp, pp, zero stage, world): DP = world / tp pp


def _mcore_available():
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


@pytest.fixture(scope="module", params=["gpt", "llama"])
def mcore_checkpoint(request, tmp_path_factory):
    missing = _mcore_available()
    if missing:
        pytest.skip(f"megatron-core is not importable ({missing}); pip install megatron-core==0.16.1")
    out = tmp_path_factory.mktemp(f"mcore_{request.param}")
    from megatron_zero.testing.multirank import free_port
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_zero.testing.mcore_peer", "save", str(out),
                          "--arch", request.param, "--tp", "2", "--port", str(free_port())],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return request.param, str(out)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"tp{x[0]}pp{x[1]}z{x[2]}w{x[3]}")
def test_mcore_torch_dist_loads_at_any_layout(mcore_checkpoint, layout):
    """MC TP2 -> ours at the layout: logits equal MC's, and one step equals MC's FP32Optimizer step."""
    arch, root = mcore_checkpoint
    _check_load_and_step(arch, root, os.path.join(root, "iter_0000001"), layout, "torch_dist")


@pytest.mark.slow
def test_mcore_torch_dist_through_universal(mcore_checkpoint, tmp_path):
    """tools/convert_checkpoint.py --from torch_dist --to universal, then the universal load at TP2 x PP2 (world 4):
    the same logits and step as the direct load."""
    arch, root = mcore_checkpoint
    out = tmp_path / "iter1_universal"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), "--from", "torch_dist",
                          "--to", "universal", "--input", root, "--output", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "converted" in run.stdout and (tmp_path / "latest_universal").read_text() == out.name
    _check_load_and_step(arch, root, str(out), (2, 2, 1, 4), "universal")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(1, 1, 1, 1), (1, 2, 1, 4), (1, 1, 3, 2)], ids=["tp1", "pp2dp2", "dp2z3"])
def test_mcore_legacy_loads_at_any_layout(mcore_checkpoint, layout):
    """The same state as a legacy checkpoint (mp_rank_0T/model_optim_rng.pt, Megatron's optimizer groups) loads at
    TP1, PP2 x DP2 and DP2 ZeRO-3 (ZeRO-3 does not pipeline) with the same logits and step."""
    arch, root = mcore_checkpoint
    _check_load_and_step(arch, root, os.path.join(root, "legacy", "iter_0000001"), layout, "legacy")


def _check_load_and_step(arch, root, ckpt, layout, source):
    from megatron_zero.testing.mcore_parity import config, load_and_step, reference_logits
    tp, pp, stage, world = layout
    cfg = config(arch)
    results = run_ranks(load_and_step, world, tp, pp, stage, ckpt, arch, 1, source, timeout=300)
    assert {r[1] for r in results} == {1}
    loaded = full_weights([(c, None, w) for c, _, w, _ in results], cfg)
    stepped = full_weights([(c, None, w) for c, _, _, w in results], cfg)
    ref = torch.load(os.path.join(root, "reference.pt"))
    assert (reference_logits(loaded, cfg, 1) - ref["logits"]).abs().max() <= 1e-5
    assert (reference_logits(stepped, cfg, 2) - ref["logits_after_step"]).abs().max() <= 1e-5
    after = TorchDistFiles(os.path.join(root, "after_step"), cfg)
    for name, t in stepped.items():
        mc = after.full(name, "fp32")[0]
        diff = (without_key_bias(name, mc, cfg) - without_key_bias(name, t, cfg)).abs().max()
        assert diff <= 1e-5, (name, float(diff))


LLAMA_FLAGS = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu", "--group-query-attention",
               "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--disable-bias-linear"]


@pytest.mark.slow
def test_pretrain_gpt_loads_mcore_torch_dist(mcore_checkpoint, tmp_path):
    """pretrain_gpt.py --load <Megatron-LM save dir> --ckpt-format torch_dist resumes at DP2 ZeRO-3 and trains on."""
    import numpy as np

    from megatron_zero.data.indexed_dataset import IndexedDatasetBuilder
    from megatron_zero.testing.launch import torchrun
    from megatron_zero.testing.mcore_peer import SIZES
    arch, root = mcore_checkpoint
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(str(tmp_path / "data"), dtype=np.uint16)
    for _ in range(40):
        builder.add_document(list(rng.integers(0, SIZES["vocab_size"] - 1, size=60)) + [SIZES["vocab_size"] - 1])
    builder.finalize()
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
            "--seq-length", "16", "--max-position-embeddings", "16", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(SIZES["vocab_size"] - 1), "--make-vocab-size-divisible-by", "1",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-2", "--lr-decay-style", "constant",
            "--train-iters", "3", "--data-path", str(tmp_path / "data"), "--split", "100,0,0", "--eval-iters", "0",
            "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0", "--zero-stage", "3",
            "--load", root, "--ckpt-format", "torch_dist"] + (LLAMA_FLAGS if arch == "llama" else [])
    run = torchrun(2, argv)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (f"loaded checkpoint iter_0000001 (Megatron-LM torch_dist, iteration 1, saved at TP=2 x PP=1 x DP=1) "
            f"from {os.path.join(root, 'iter_0000001')}, reshaped to TP=1 x PP=1 x DP=2, ZeRO-3") in run.stdout
    assert "iteration        3/       3" in run.stdout
    at = argv.index("--ckpt-format") + 1
    wrong = torchrun(2, argv[:at] + ["torch"] + argv[at + 1:])
    assert wrong.returncode != 0
    assert "--ckpt-format torch but --load" in wrong.stdout + wrong.stderr  # one sentence, from the rank


@pytest.mark.slow
def test_ours_to_torch_dist_loads_in_mcore(mcore_checkpoint, tmp_path):
    """Ours (trained one step further at TP2, saved in our layout) -> tools/convert_checkpoint.py --to torch_dist
    -> megatron-core's dist_checkpointing.load at TP1 and TP2: its logits equal ours within 1e-5."""
    from megatron_zero.testing.mcore_parity import config, load_and_step, reference_logits
    from megatron_zero.testing.multirank import free_port
    arch, root = mcore_checkpoint
    cfg = config(arch)
    save = tmp_path / "ours"
    results = run_ranks(load_and_step, 2, 2, 1, 1, os.path.join(root, "iter_0000001"), arch, 1, "torch_dist", str(save),
                        timeout=300)
    ours = reference_logits(full_weights([(c, None, w) for c, _, _, w in results], cfg), cfg, 1)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    for tp in (1, 2):
        out = tmp_path / f"megatron_tp{tp}"
        run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), "--from",
                              "deepspeed", "--to", "torch_dist", "--input", str(save / "global_step2"), "--output",
                              str(out), "--target-tp", str(tp)], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        assert (out / "latest_checkpointed_iteration.txt").read_text() == "2"
        logits = tmp_path / f"logits_tp{tp}.pt"
        run = subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_zero.testing.mcore_peer", "load",
                              str(out / "iter_0000002"), str(logits), "--arch", arch, "--tp", str(tp), "--port",
                              str(free_port())], env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert (torch.load(logits)["logits"][..., :cfg.vocab_size] - ours).abs().max() <= 1e-5
