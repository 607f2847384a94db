"""Multi-token prediction (--mtp-num-layers, --mtp-loss-scaling-factor; model/multi_token_prediction.py).

Against Megatron-Core 0.16.1's own GPTModel with a MultiTokenPredictionBlock (local spec, on one gloo rank on the
CPU, testing/mtp_reference.py) given our weights: the loss, each depth's logged loss and every parameter's
gradient, two depths. The gradients are fp32 evaluations of one expression in another order: normwise within
model_rtol of the longest path (the model's layers, then each depth's projection and block). Through
pretrain_gpt.py: a toy with one depth at TP2 x PP2 with sequence parallelism and at DP2 ZeRO-3 logs the losses
(the LM loss and mtp_1 loss) of the one-process run within the same rtol; a TP2 x PP2 save resumes at TP1 x PP1,
reshaped while loading and through tools/ds_to_universal.py, with the losses continuing (the reshape tests'
relative 1e-5), and tools/convert_to_hf.py exports it as a Llama without the depths, saying so. The flags reach
the model; what is not implemented is refused in one sentence.
"""
import os
from dataclasses import replace

import pytest

from megatron_zero.arguments import parse_args
from megatron_zero.model import reference_model
from megatron_zero.model.architecture import gpt_config
from megatron_zero.model.layer_indices import layer_kind, mtp_index
from megatron_zero.model.params import param_names, param_spec
from megatron_zero.testing import run_ranks
from megatron_zero.testing.cli import (TINY, CliResume, cli_flags, logged_losses, mtp_losses, pretrain_cli, text_data,
                                       tool)
from megatron_zero.testing.flag_checks import BASE, refused, with_flags
from megatron_zero.testing.tiny_gpt import tiny_gpt_config, tiny_llama_config
from megatron_zero.testing.tolerances import assert_close_normwise, assert_losses_close, model_rtol, mtp_path_length

RESHAPE_BOUND = 1e-5  # the reshape tests' relative bound on a resumed run's losses


def test_catalogue_and_module_agree():
    cfg = tiny_llama_config(num_layers=2, mtp_num_layers=2)
    model = reference_model(cfg)
    got = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert list(got) == param_names(cfg)
    L, h = cfg.num_layers, cfg.hidden_size
    assert layer_kind(mtp_index(L), L) == "mtp"
    assert got[f"{L + 4}.1.eh_proj.weight"] == (h, 2 * h)
    assert param_spec(f"{L + 4}.1.eh_proj.weight", cfg).partition_dim == 0
    assert param_spec(f"{L + 4}.0.enorm.weight", cfg).partition_dim is None
    assert param_spec(f"{L + 4}.0.transformer_layer.self_attention.dense.weight", cfg).partition_dim == 1
    assert param_spec(f"{L + 4}.0.transformer_layer.mlp.dense_h_to_4h.weight", cfg).sub_params == 2
    assert not any(n.startswith(f"{L + 4}.") for n in param_names(replace(cfg, mtp_num_layers=None)))
    # a pipeline's last stage holds the depths with the output head; the first does not
    assert f"{L + 4}.0.eh_proj.weight" in param_names(cfg, [L + 2, L + 3])
    assert not any(n.startswith(f"{L + 4}.") for n in param_names(cfg, [0, 1, 2]))
    # untied at PP2: the last stage holds a copy of the first's embedding under its names, kept equal as a tied one
    from megatron_zero.model import GPTModel
    untied = replace(cfg, untie_embeddings_and_output_weights=True)
    last = GPTModel(untied, layer_indices=[L + 1, L + 2, L + 3])
    assert [n for n, _ in last.named_parameters()] == param_names(untied, [L + 1, L + 2, L + 3])
    assert "1.word_embeddings.weight" in param_names(untied, [L + 1, L + 2, L + 3])
    assert last.pipeline_shared_embedding() is last.embedding is last._modules["1"]
    assert 1 not in last.layer_indices  # its layer_01 file is the first stage's
    first = GPTModel(untied, layer_indices=[0, 1, 2])
    assert first.pipeline_shared_embedding() is first.embedding
    assert GPTModel(replace(untied, mtp_num_layers=None), layer_indices=[0, 1, 2]).pipeline_shared_embedding() is None
    # Muon takes the depths' matrices as Megatron-Core's does: the projection, and the block's as a block's
    from megatron_zero.optimizer.muon import block_matrix_dim, is_qkv, takes_muon
    assert block_matrix_dim(f"{L + 4}.0.eh_proj.weight") == 0
    assert block_matrix_dim(f"{L + 4}.0.transformer_layer.self_attention.dense.weight") == 1
    assert is_qkv(f"{L + 4}.1.transformer_layer.self_attention.query_key_value.weight")
    assert not takes_muon(f"{L + 4}.0.enorm.weight", (h,))
    assert not takes_muon(f"{L + 4}.0.transformer_layer.input_layernorm.weight", (h,))
    # Megatron-Core's torch_dist names (Transformer-Engine spec): each depth's tensors of its own
    from megatron_zero.checkpoint.interop.mcore_names import mcore_key
    assert mcore_key(f"{L + 4}.1.eh_proj.weight", cfg) == ("mtp.layers.1.eh_proj.weight", None)
    assert mcore_key(f"{L + 4}.0.transformer_layer.input_layernorm.weight", cfg) == (
        "mtp.layers.0.transformer_layer.self_attention.linear_qkv.layer_norm_weight", None)


def test_one_process_formula():
    """The objective written out from the model's pieces (DeepSeek-V3's MTP: shifted tokens, positions, labels
    and mask; the two norms, the projection of their concatenation, the block, the depth's own norm, the shared
    output layer) against the model's loss and gradients; learned positions and a padded loss mask included."""
    import torch
    import torch.nn.functional as F

    cfg = replace(tiny_gpt_config(num_layers=2, hidden_dropout=0.0, attention_dropout=0.0), mtp_num_layers=2,
                  mtp_loss_scaling_factor=0.3)
    model = reference_model(cfg).train()
    g = torch.Generator().manual_seed(3)
    text = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=g)
    tokens, labels = text[:, :-1], text[:, 1:]
    mask = torch.ones(labels.shape)
    mask[0, 3] = 0
    loss = model(tokens, labels=labels, loss_mask=mask)
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    def shifted(t, k):  # left by k, zeros after
        return torch.cat([t[:, k:], torch.zeros_like(t[:, :k])], dim=1)

    emb, s = model.embedding, cfg.seq_length
    wte, wpe = emb.word_embeddings.weight[:cfg.vocab_size], emb.position_embeddings.weight

    def xent(h, y, m):
        per = F.cross_entropy((h @ wte.T).flatten(0, 1), y.flatten(), reduction="none").view_as(m)
        return (per * m).sum() / m.sum()

    h = model._modules[str(cfg.num_layers + 2)](model.blocks[1](model.blocks[0](wte[tokens] + wpe[:s])))
    main = xent(h, labels, mask)
    depths = []
    positions = torch.arange(s)
    for k, depth in enumerate(model.mtp, start=1):
        pos = torch.cat([positions[k:], torch.zeros(k, dtype=torch.long)])
        e = wte[shifted(tokens, k)] + wpe[pos]
        x = F.linear(torch.cat([depth.enorm(e), depth.hnorm(h)], -1), depth.eh_proj.weight)
        h = depth.final_layernorm(depth.transformer_layer(x))
        depths.append(xent(h, shifted(labels, k), shifted(mask, k)))
    (main + 0.3 / 2 * sum(depths)).backward()
    rtol = model_rtol(mtp_path_length(cfg, labels.numel()))
    assert_close_normwise(float(loss), float(main), rtol, "the loss is the LM loss alone")
    assert_close_normwise(model.mtp.take_loss_sums(), torch.stack(depths).detach(), rtol, "each depth's loss")
    for name, p in model.named_parameters():
        assert_close_normwise(got[name], p.grad, rtol, name)
    assert got[f"{cfg.num_layers + 4}.1.eh_proj.weight"].abs().sum() > 0


def _check_against_mcore(arch):
    (ours, theirs, grads, our_depths, their_depths), = run_ranks(_mcore_case, 1, arch, timeout=600)
    from megatron_zero.testing.mcore_parity import config
    cfg = replace(config(arch), mtp_num_layers=2)
    from megatron_zero.testing.mcore_peer import SIZES
    rtol = model_rtol(mtp_path_length(cfg, SIZES["batch"] * SIZES["seq_length"]))
    assert_close_normwise(ours, theirs, rtol, "loss")
    assert_close_normwise(our_depths, their_depths, rtol, "each depth's loss")
    assert len(grads) == len(param_names(cfg))
    for name, (got, want) in grads.items():
        assert_close_normwise(got, want, rtol, name)
    assert any(n.startswith(f"{cfg.num_layers + 4}.1.") and g.abs().sum() > 0 for n, (g, _) in grads.items())


def _mcore_case(arch):
    from megatron_zero.testing.mtp_reference import mtp_against_mcore
    return mtp_against_mcore(arch, 2)


@pytest.mark.slow  # default tier: test_one_process_formula (the same expression, independently written)
def test_loss_and_gradients_equal_megatron_core_llama():
    """RMSNorm, RoPE, SwiGLU, GQA, untied output layer: DeepSeek-V3's kind of block."""
    _check_against_mcore("llama")


@pytest.mark.slow  # default tier: test_one_process_formula
def test_loss_and_gradients_equal_megatron_core_gpt():
    """LayerNorm with biases, learned positions (shifted with the tokens), the tied embedding as output layer."""
    _check_against_mcore("gpt")


def test_flags_reach_the_model_and_refusals(capsys):
    args = parse_args(with_flags(BASE, mtp_num_layers=2, mtp_loss_scaling_factor=0.3), world_size=1)
    cfg = gpt_config(args, 100)
    assert (cfg.mtp_num_layers, cfg.mtp_loss_scaling_factor) == (2, 0.3)
    assert gpt_config(parse_args(BASE, world_size=1), 100).mtp_num_layers is None
    assert parse_args(with_flags(BASE, mtp_num_layers=1), world_size=1).mtp_loss_scaling_factor == 0.1
    line = refused(with_flags(BASE, mtp_num_layers=1, context_parallel_size=2), 2, capsys)
    assert "--mtp-num-layers" in line and "--context-parallel-size 2" in line
    parse_args(with_flags(BASE, mtp_num_layers=1, untie_embeddings_and_output_weights=True,
                          pipeline_model_parallel_size=2), world_size=2)  # the last stage holds a copy
    # the depth's block is built as the last one, dense or MoE (tests/test_deepseek_toy.py)
    for freq in ("[1,1,1,0]", "1"):
        parse_args(with_flags(BASE, mtp_num_layers=1, num_experts=4, moe_layer_freq=freq), world_size=1)
    line = refused(with_flags(BASE, mtp_num_layers=-1), 1, capsys)
    assert "--mtp-num-layers -1" in line
    # a resume with other depths than the checkpoint's is refused by the model check, naming them
    from megatron_zero.checkpoint.compat import disagreements
    saved = {"args": vars(parse_args(with_flags(BASE, mtp_num_layers=1), world_size=1))}
    assert disagreements(saved, parse_args(BASE, world_size=1), 100, lambda tp: 128) == [
        "mtp_num_layers 1 in the checkpoint vs None here"]
    assert disagreements(saved, parse_args(with_flags(BASE, mtp_num_layers=1), world_size=1), 100, lambda tp: 128) == []


def _tiny_config():
    from megatron_zero.data.tokenizers import ByteTokenizer
    return tiny_gpt_config(num_layers=TINY["num-layers"], hidden_size=TINY["hidden-size"],
                           seq_length=TINY["seq-length"], max_position_embeddings=TINY["seq-length"],
                           vocab_size=ByteTokenizer.vocab_size, mtp_num_layers=1)


def _mtp_llama():
    """The model MTP_FLAGS make of cli_flags' tiny Llama (a tied embedding), for its parameter names."""
    from megatron_zero.data.tokenizers import ByteTokenizer
    return tiny_llama_config(num_layers=TINY["num-layers"], hidden_size=TINY["hidden-size"],
                             seq_length=TINY["seq-length"], max_position_embeddings=TINY["seq-length"],
                             vocab_size=ByteTokenizer.vocab_size, untie_embeddings_and_output_weights=False,
                             mtp_num_layers=1)


# a Llama-shaped toy with a tied embedding (the last stage's copy embeds MTP's tokens), one depth, 4 steps
MTP_FLAGS = {"mtp-num-layers": 1, "untie-embeddings-and-output-weights": None, "train-iters": 4}


def _cli_parity(tmp_path, nproc, layout):
    data = text_data(str(tmp_path / "text"))
    tie = {k: v for k, v in layout.items() if k == "untie-embeddings-and-output-weights"}
    want = pretrain_cli(1, cli_flags(data, tmp_path / "cache", "llama", MTP_FLAGS, tie), timeout=600)
    got = pretrain_cli(nproc, cli_flags(data, tmp_path / "cache", "llama", MTP_FLAGS, layout), timeout=900)
    rtol = model_rtol(mtp_path_length(_tiny_config(), TINY["global-batch-size"] * TINY["seq-length"]))
    for read in (logged_losses, mtp_losses):
        w, g = read(want), read(got)
        assert sorted(w) == sorted(g) == [1, 2, 3, 4], (w, g)
        assert_losses_close([g[i] for i in sorted(g)], [w[i] for i in sorted(w)], rtol, read.__name__)


@pytest.mark.slow  # default tier: test_tp2_sequence_parallel_step (TP2 + SP in one step), test_catalogue_and_module_agree
@pytest.mark.parametrize("embedding", ["tied", "untied"])  # untied: the last stage's copy of the embedding
def test_pretrain_gpt_tp2_pp2_sequence_parallel_matches_one_process(tmp_path, embedding):
    _cli_parity(tmp_path, 4, {"tensor-model-parallel-size": 2, "pipeline-model-parallel-size": 2,
                              "sequence-parallel": True,
                              **({"untie-embeddings-and-output-weights": True} if embedding == "untied" else {})})


@pytest.mark.slow  # default tier: test_one_process_formula (ZeRO-3's units: each depth its own)
def test_pretrain_gpt_dp2_zero3_matches_one_process(tmp_path):
    _cli_parity(tmp_path, 2, {"zero-stage": 3})


@pytest.mark.slow  # default tier: test_catalogue_and_module_agree (the names and splits the reshape reads)
def test_tp2_pp2_save_resumes_at_tp1_pp1(tmp_path):
    data = text_data(str(tmp_path / "text"))

    def flags(*changes):
        return cli_flags(data, os.path.join(tmp_path, "cache"), "llama", MTP_FLAGS, *changes)

    run = CliResume(str(tmp_path), flags, {"tensor-model-parallel-size": 2, "pipeline-model-parallel-size": 2},
                    nproc=4, iters=5, save_at=3)
    flat = {"tensor-model-parallel-size": 1, "pipeline-model-parallel-size": 1}
    run.assert_matches(run.resume("reshaped", flat), RESHAPE_BOUND)
    run.assert_matches(run.resume("universal", flat), RESHAPE_BOUND)
    # to Megatron-Core's torch_dist and back: the depths' weights and Adam moments unchanged
    import torch
    for source, out in (("deepspeed", run.checkpoint), ("torch_dist", None)):
        if source == "torch_dist":
            tool("convert_checkpoint.py", "--from", "deepspeed", "--to", "torch_dist", "--input", run.checkpoint,
                 "--output", os.path.join(tmp_path, "td"), "--quiet")
            out = os.path.join(tmp_path, "td", "iter_0000003")
        tool("convert_checkpoint.py", "--from", source, "--to", "universal", "--input", out, "--output",
             os.path.join(tmp_path, f"u_{source}"), "--quiet")
    for name in (n for n in param_names(_mtp_llama()) if n.startswith("6.")):
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            a, b = (torch.load(os.path.join(tmp_path, f"u_{s}", "zero", name, f"{key}.pt"))["param"]
                    for s in ("deepspeed", "torch_dist"))
            assert torch.equal(a, b), (name, key)
    # Hugging Face's Llama has no MTP layers: the export leaves the depths out and says so
    out = tool("convert_to_hf.py", run.checkpoint, os.path.join(tmp_path, "hf"))
    assert "left out 10 parameters of the multi-token prediction depths" in out.stdout, out.stdout


def _tp2_step(cfg):
    import torch
    import torch.distributed as dist

    from megatron_zero.model import GPTModel
    from megatron_zero.model.sharding import gather_state_dicts, shard_state_dict
    from megatron_zero.tensor_parallel import model_parallel_seed
    from megatron_zero.distributed.topology import build_parallel_state

    state = build_parallel_state(tp=2)
    model_parallel_seed(1, state.tp_rank, 0)
    full = gather_state_dicts([reference_model(cfg).state_dict()], cfg)
    model = GPTModel(replace(cfg, sequence_parallel=True), state.tp_group).train()
    model.load_state_dict(shard_state_dict(full, cfg, 2, state.tp_rank))
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=g)
    loss = model(tokens[:, :-1], labels=tokens[:, 1:])
    loss.backward()
    grads = [None, None]
    dist.all_gather_object(grads, {n: p.grad for n, p in model.named_parameters()})
    return float(loss), gather_state_dicts(grads, cfg), model.mtp.take_loss_sums()


def test_tp2_sequence_parallel_step():
    """Two depths at TP2 with sequence parallelism (eh_proj column-parallel, its output gathered and scattered back
    to the rank's tokens): the loss, each depth's and every gradient equal the one-process model's."""
    import torch

    cfg = tiny_llama_config(num_layers=2, mtp_num_layers=2, seq_length=16, max_position_embeddings=16)
    loss, grads, depths = run_ranks(_tp2_step, 2, cfg, timeout=300)[0]
    ref = reference_model(cfg).train()
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=g)
    want = ref(tokens[:, :-1], labels=tokens[:, 1:])
    want.backward()
    rtol = model_rtol(mtp_path_length(cfg, tokens[:, 1:].numel()))
    assert_close_normwise(loss, float(want), rtol, "loss")
    assert_close_normwise(depths, ref.mtp.take_loss_sums(), rtol, "each depth's loss")
    from megatron_zero.model.sharding import gather_state_dicts
    want_grads = gather_state_dicts([{n: p.grad for n, p in ref.named_parameters()}], cfg)  # unpadded
    assert set(grads) == set(want_grads)
    for name, want_grad in want_grads.items():
        assert_close_normwise(grads[name], want_grad, rtol, name)
