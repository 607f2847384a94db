"""Megatron-Core torch_dist checkpoints of mixture-of-experts models, both ways.

Default tier (no megatron-core needed): an MoE Llama (SwiGLU experts, a gated shared expert) and an MoE GPT
(MoE every other layer) written with torch's DCP writer in each of Megatron-Core's key forms (stacked
[L, E, ...], per layer, per expert with SwiGLU halves) read back exactly, weights and moments; our writer's
output reads back exactly, in the form Megatron-Core writes for the model; a router expert bias is refused by
name, and so is a legacy MoE checkpoint.

Slow tier: megatron-core 0.16.1 itself (testing/mcore_peer.py --moe, allgather dispatcher, on gloo) writes
both models at EP1 and EP2 after one FP32Optimizer (AdamW) step; ours loads each at several TP x PP x EP x
ZeRO layouts. Tolerances as tests/test_checkpoint_torch_dist.py's: fp32 logits of two implementations that
sum in other orders agree to ~1e-7 (logits are O(1)), so 1e-5; one Adam step from the loaded moments moves
weights by ~lr = 1e-2 and agrees to 1e-5 (checked from the EP1 checkpoints: Megatron-Core's FP32Optimizer
reduces no gradients over data-parallel ranks, so its EP2 step is no reference). Routing is top-2 of
softmax-ed logits: a near-tie between experts could flip with roundoff and change a logit by far more than
1e-5; with these seeds the gaps are orders above roundoff (a flip would fail the test, not pass it wrongly).
"""
import os
import subprocess
import sys
from argparse import Namespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_zero.checkpoint.errors import CheckpointError
from megatron_zero.checkpoint.interop.mcore_names import LAYERS, mcore_location
from megatron_zero.checkpoint.interop.torch_dist import TorchDistFiles
from megatron_zero.model.gpt import reference_model
from megatron_zero.model.params import param_names, param_spec
from megatron_zero.model.sharding import gather_state_dicts
from megatron_zero.testing import run_ranks
from megatron_zero.testing.tiny_gpt import tiny_gpt_config, tiny_llama_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16)


def _llama():
    return tiny_llama_config(num_layers=2, **MOE, moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True)


def _gpt():
    return tiny_gpt_config(num_layers=3, **MOE, moe_layer_freq=2, add_bias_linear=False)


def _full_model(cfg):
    torch.manual_seed(0)
    model = reference_model(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return gather_state_dicts([{n: p.detach() for n, p in model.named_parameters()}], cfg)


def _mc_form(full, cfg, form):
    """Our full tensors under Megatron-Core's keys in `form` ('stacked', 'per_layer', 'singleton')."""
    placed = {}  # key -> {index: tensor}
    for name, t in full.items():
        key, index = mcore_location(name, cfg)
        if form != "stacked" and index:
            key, index = f"{LAYERS}{index[0]}.{key[len(LAYERS):]}", index[1:]
        if form == "singleton" and index:
            head, _, tail = key.partition("mlp.experts.experts.")
            key, index = f"{head}mlp.experts.experts.{index[0]}.{tail}", ()
        if form == "singleton" and param_spec(name, cfg).sub_params == 2:
            gate, up = t.chunk(2)
            placed.setdefault(key + "_w", {})[index] = gate
            placed.setdefault(key + "_v", {})[index] = up
            continue
        placed.setdefault(key, {})[index] = t
    out = {}
    for key, parts in placed.items():
        if list(parts) == [()]:
            out[key] = parts[()].clone()
            continue
        lead = [1 + max(i[d] for i in parts) for d in range(len(next(iter(parts))))]
        t = torch.zeros(lead + list(next(iter(parts.values())).shape))
        for i, v in parts.items():
            t[i] = v
        out[key] = t
    out.update({f"optimizer.state.exp_avg.{k}": v * 0.5 for k, v in list(out.items())})
    return out


def _write(directory, cfg, tensors):
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True)
    torch.save({"args": Namespace(num_layers=cfg.num_layers), "iteration": 3,
                "optimizer": {"state": {"common_step": torch.tensor(3.0)}, "param_groups": []}},
               os.path.join(str(directory), "common.pt"))


@pytest.mark.parametrize("form", ["stacked", "per_layer", "singleton"])
@pytest.mark.parametrize("make", [_llama, _gpt], ids=["llama", "gpt"])
def test_moe_key_forms_read_back(tmp_path, make, form):
    """Router, experts (global ids), shared expert and its gate, in each form Megatron-Core writes."""
    cfg = make()
    if form == "stacked" and cfg.moe_layer_freq > 1:
        pytest.skip("Megatron-Core saves dense and MoE blocks mixed one key per layer, never stacked")
    full = _full_model(cfg)
    _write(tmp_path, cfg, _mc_form(full, cfg, form))
    files = TorchDistFiles(str(tmp_path), cfg)
    assert any("deepspeed_experts.3." in n for n in full)
    for name in param_names(cfg):
        assert torch.equal(files.full(name, "fp32")[0], full[name]), name
        assert torch.equal(files.full(name, "exp_avg")[0], full[name] * 0.5), name


@pytest.mark.parametrize("make", [_llama, _gpt], ids=["llama", "gpt"])
def test_moe_writer_reads_back(tmp_path, make):
    """Ours -> torch_dist (write_torch_dist) holds every parameter and moment exactly, stacked when every layer is
    MoE, one key per layer when dense and MoE blocks mix (as Megatron-Core's TransformerBlock saves them)."""
    from megatron_zero.checkpoint.interop.convert import config_args
    from megatron_zero.checkpoint.interop.dcp_reader import DcpReader
    from megatron_zero.checkpoint.interop.to_universal import write_universal
    from megatron_zero.checkpoint.interop.torch_dist_write import write_torch_dist
    cfg = make()
    full = _full_model(cfg)

    class Source:
        has_optimizer = True

        def full(self, name, which):
            return full[name] * {"fp32": 1, "exp_avg": 0.5, "exp_avg_sq": 0.25}[which], None, 1

        def step(self, name):
            return 3
    args = dict(config_args(cfg), **{k: getattr(cfg, k) for k in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size",
                                                                    "moe_layer_freq", "moe_shared_expert_intermediate_size",
                                                                    "moe_shared_expert_gate")})
    write_universal(Source(), cfg, {"iteration": 3, "args": args,
                                    "universal_checkpoint_info": {"original_vocab_size": cfg.vocab_size}},
                    str(tmp_path / "u" / "src"), "test")
    write_torch_dist(str(tmp_path / "u" / "src"), str(tmp_path / "mc"))
    directory = str(tmp_path / "mc" / "iter_0000003")
    keys, h = DcpReader(directory).tensors, cfg.hidden_size
    if cfg.moe_layer_freq == 1:
        assert tuple(keys["decoder.layers.mlp.experts.experts.linear_fc1.weight"].size) == (2, 4, 32, h)
        assert tuple(keys["decoder.layers.mlp.shared_experts.gate_weight"].size) == (2, 1, h)
    else:
        assert tuple(keys["decoder.layers.2.mlp.experts.experts.linear_fc2.weight"].size) == (4, h, 16)
        assert "decoder.layers.1.mlp.linear_fc1.weight" in keys and "decoder.layers.1.mlp.router.weight" not in keys
    files = TorchDistFiles(directory, cfg)
    for name in param_names(cfg):
        assert torch.equal(files.full(name, "fp32")[0], full[name]), name
        assert torch.equal(files.full(name, "exp_avg_sq")[0], full[name] * 0.25), name


def test_moe_refusals(tmp_path):
    """The router's expert bias (not built here) and another expert count are refused naming the key; a legacy
    MoE checkpoint is refused in one sentence."""
    cfg = _llama()
    full = _full_model(cfg)
    tensors = _mc_form(full, cfg, "stacked")
    _write(tmp_path / "bias", cfg, dict(tensors, **{"decoder.layers.mlp.router.expert_bias": torch.zeros(2, 4)}))
    with pytest.raises(CheckpointError, match="mixture-of-experts tensor decoder.layers.mlp.router.expert_bias"):
        TorchDistFiles(str(tmp_path / "bias"), cfg)
    _write(tmp_path / "e4", cfg, tensors)
    more = tiny_llama_config(num_layers=2, **dict(MOE, num_experts=8), moe_shared_expert_intermediate_size=24,
                             moe_shared_expert_gate=True)
    files = TorchDistFiles(str(tmp_path / "e4"), more)
    with pytest.raises(CheckpointError, match="stacks 4 experts but this model has 8 \\(--num-experts differs"):
        files.full("2.mlp.deepspeed_moe.experts.deepspeed_experts.5.dense_4h_to_h.weight", "fp32")
    from megatron_zero.checkpoint.interop.megatron_legacy import LegacyFiles
    with pytest.raises(CheckpointError, match="legacy checkpoint of a mixture-of-experts model"):
        LegacyFiles(str(tmp_path), cfg)


# ---- against megatron-core itself (slow) --------------------------------------------------------------------


@pytest.fixture(scope="module", params=[("llama", 1), ("gpt", 1), ("llama", 2), ("gpt", 2)],
                ids=["llama-ep1", "gpt-ep1", "llama-ep2", "gpt-ep2"])
def mcore_moe(request, tmp_path_factory):
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        pytest.skip(f"megatron-core is not importable ({e}); pip install megatron-core==0.16.1")
    from megatron_zero.testing.multirank import free_port
    arch, ep = request.param
    out = tmp_path_factory.mktemp(f"mcore_moe_{arch}_ep{ep}")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_zero.testing.mcore_peer", "save", str(out),
                          "--arch", arch, "--moe", "--ep", str(ep), "--port", str(free_port())],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return arch, ep, str(out)


def _check(arch, mc_ep, root, ckpt, layout, source="torch_dist"):
    from megatron_zero.testing.mcore_parity import config, gathered, load_and_step, reference_logits
    tp, pp, ep, stage, world = layout
    cfg = config(arch, moe=True)
    results = run_ranks(load_and_step, world, tp, pp, stage, ckpt, arch, 1, source, None, True, ep, timeout=300)
    assert {r[1] for r in results} == {1}
    ref = torch.load(os.path.join(root, "reference.pt"))
    assert (reference_logits(gathered(results, cfg, 2), cfg, 1) - ref["logits"]).abs().max() <= 1e-5
    if mc_ep == 1:
        assert (reference_logits(gathered(results, cfg, 3), cfg, 2) - ref["logits_after_step"]).abs().max() <= 1e-5
        after = TorchDistFiles(os.path.join(root, "after_step"), cfg)
        for name, t in gathered(results, cfg, 3).items():
            assert (after.full(name, "fp32")[0] - t).abs().max() <= 1e-5, name


MOE_LAYOUTS = [(1, 1, 1, 1, 1), (1, 1, 2, 2, 2), (2, 2, 1, 1, 4)]  # (tp, pp, ep, zero stage, world)


@pytest.mark.slow
@pytest.mark.parametrize("layout", MOE_LAYOUTS, ids=lambda x: "tp{}pp{}ep{}z{}".format(*x))
def test_mcore_moe_torch_dist_loads_at_any_layout(mcore_moe, layout):
    """MC MoE at EP1 / EP2 -> ours at TP1, EP2 x DP2 ZeRO-2, TP2 x PP2: logits equal MC's (and, from EP1, one step
    equals MC's FP32Optimizer step)."""
    arch, mc_ep, root = mcore_moe
    _check(arch, mc_ep, root, os.path.join(root, "iter_0000001"), layout)


@pytest.mark.slow
def test_mcore_moe_singleton_local_shards(mcore_moe):
    """The same state saved with singleton_local_shards (per-layer, per-expert keys, SwiGLU halves) loads at
    TP2 x EP2 with the same logits."""
    arch, mc_ep, root = mcore_moe
    _check(arch, mc_ep, root, os.path.join(root, "singleton", "iter_0000001"), (2, 1, 2, 1, 4))


@pytest.mark.slow
def test_ours_moe_to_torch_dist_loads_in_mcore(mcore_moe, tmp_path):
    """Ours (loaded at EP2, one step, saved in our layout) -> tools/convert_checkpoint.py --to torch_dist ->
    megatron-core's dist_checkpointing.load at EP1 and EP2: its logits equal ours within 1e-5."""
    from megatron_zero.testing.mcore_parity import config, gathered, load_and_step, reference_logits
    from megatron_zero.testing.multirank import free_port
    arch, mc_ep, root = mcore_moe
    if mc_ep != 2:
        pytest.skip("one source suffices per model: the EP2 checkpoint")
    cfg = config(arch, moe=True)
    save = tmp_path / "ours"
    results = run_ranks(load_and_step, 2, 1, 1, 1, os.path.join(root, "iter_0000001"), arch, 1, "torch_dist",
                        str(save), True, 2, timeout=300)
    ours = reference_logits(gathered(results, cfg, 3), cfg, 1)
    out = tmp_path / "megatron"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), "--from", "deepspeed",
                          "--to", "torch_dist", "--input", str(save / "global_step2"), "--output", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    for ep in (1, 2):
        logits = tmp_path / f"logits_ep{ep}.pt"
        run = subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_zero.testing.mcore_peer", "load",
                              str(out / "iter_0000002"), str(logits), "--arch", arch, "--moe", "--ep", str(ep),
                              "--port", str(free_port())], env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert (torch.load(logits)["logits"][..., :cfg.vocab_size] - ours).abs().max() <= 1e-5


@pytest.mark.slow
def test_mcore_moe_command_line(mcore_moe, tmp_path):
    """As a user drives it: tools/convert_checkpoint.py --from torch_dist --to universal, loaded at EP2 (same
    logits), and pretrain_gpt.py --load <Megatron-LM save dir> with the MoE flags at EP2 trains on."""
    import numpy as np

    from megatron_zero.data.indexed_dataset import IndexedDatasetBuilder
    from megatron_zero.testing.launch import torchrun
    from megatron_zero.testing.mcore_peer import MOE_ARCH, SIZES
    arch, mc_ep, root = mcore_moe
    if mc_ep != 2:
        pytest.skip("one source suffices per model: the EP2 checkpoint")
    out = tmp_path / "iter1_universal"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), "--from", "torch_dist",
                          "--to", "universal", "--input", root, "--output", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    _check(arch, mc_ep, root, str(out), (1, 1, 2, 1, 2), "universal")
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(str(tmp_path / "data"), dtype=np.uint16)
    for _ in range(40):
        builder.add_document(list(rng.integers(0, SIZES["vocab_size"] - 1, size=60)) + [SIZES["vocab_size"] - 1])
    builder.finalize()
    moe = MOE_ARCH[arch]
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
            "--seq-length", "16", "--max-position-embeddings", "16", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(SIZES["vocab_size"] - 1), "--make-vocab-size-divisible-by", "1",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-2", "--lr-decay-style", "constant",
            "--train-iters", "3", "--data-path", str(tmp_path / "data"), "--split", "100,0,0", "--eval-iters", "0",
            "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0", "--disable-bias-linear",
            "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
            "--moe-layer-freq", str(moe["moe_layer_freq"]), "--expert-model-parallel-size", "2",
            "--load", root, "--ckpt-format", "torch_dist"]
    if arch == "llama":
        argv += ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
                 "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
                 "--moe-shared-expert-intermediate-size", "48", "--moe-shared-expert-gate"]
    run = torchrun(2, argv)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "loaded checkpoint iter_0000001 (Megatron-LM torch_dist, iteration 1" in run.stdout
    assert "iteration        3/       3" in run.stdout
