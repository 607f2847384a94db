"""The output layer + cross-entropy fused by vocabulary chunks (tensor_parallel/output_loss.py) against the
whole logits then the vocab-parallel cross-entropy (the path before it, --no-cross-entropy-loss-fusion):
the same losses and gradients in fp32 at TP 1, TP 2 (with and without sequence parallelism) and across
two pipeline stages with a loss mask; and its peak memory at a vocabulary whose logits dominate.

Tolerances (megatron_zero/testing/tolerances.py): a loss is the logit's h-term dot product, then the
log-sum-exp over the vocabulary (V terms, summed chunk by chunk and rank by rank in the fused path);
model_rtol(h + V + 2 chunks) normwise; the gradients add the weight gradient's sum over the tokens.
"""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_zero.config import from_args
from megatron_zero.arguments import parse_args
from megatron_zero.model import GPTConfig, GPTModel, reference_model
from megatron_zero.model.layer_indices import num_pipeline_layers
from megatron_zero.model.output_loss_converter import OutputLossConverter
from megatron_zero.model_converters import model_converters
from megatron_zero.tensor_parallel import vocab_parallel_cross_entropy
from megatron_zero.tensor_parallel import output_loss
from megatron_zero.tensor_parallel.output_loss import chunk_columns, vocab_parallel_linear_cross_entropy, worth_chunking
from megatron_zero.testing import run_ranks
from megatron_zero.testing.flag_checks import BASE, refused
from megatron_zero.testing.loss_memory import peaks_in_subprocess
from megatron_zero.testing.tiny_gpt import tiny_gpt_config
from megatron_zero.testing.tolerances import assert_close_normwise, gpt_path_length, model_rtol
from megatron_zero.testing.trainer_losses import resume_flags, train_losses
from megatron_zero.distributed.topology import build_parallel_state

VOCAB, PADDED, H, TOKENS = 1000, 1152, 32, (3, 8)


def inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(*TOKENS, H, generator=gen).to(dtype)
    weight = (torch.randn(PADDED, H, generator=gen) * 0.5).to(dtype)
    target = torch.randint(0, VOCAB, TOKENS, generator=gen)
    target.view(-1)[:5] = torch.tensor([0, 255, 256, 511, VOCAB - 1])  # either side of chunk boundaries, the last
    weights = (torch.rand(*TOKENS, generator=gen) > 0.3).float()  # a loss mask
    return hidden, weight, target, weights


def unfused(hidden, weight, target, weights):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(F.linear(hidden, weight), target, None, VOCAB)
    (loss * weights).sum().backward()
    return loss.detach(), hidden.grad, weight.grad


def rtols(tokens):
    n = H + VOCAB + 2 * -(-PADDED // chunk_columns(PADDED))
    return model_rtol(n), model_rtol(n + tokens)


def test_chunks_cover_the_vocabulary_in_sixteenths():
    assert chunk_columns(PADDED) == 256  # the minimum: this test's vocabulary is 5 chunks, the last partly padding
    assert chunk_columns(128256) == 8064 and -(-128256 // 8064) == 16  # Llama-3's: 16 chunks


def test_fused_matches_unfused_fp32():
    hidden, weight, target, weights = inputs()
    want = unfused(hidden, weight, target, weights)
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = vocab_parallel_linear_cross_entropy(x, w, target, None, VOCAB, chunked=True)
    (loss * weights).sum().backward()
    loss_rtol, grad_rtol = rtols(target.numel())
    assert_close_normwise(loss.detach(), want[0], loss_rtol, "per-token losses")
    assert_close_normwise(x.grad, want[1], grad_rtol, "hidden gradient")
    assert_close_normwise(w.grad, want[2], grad_rtol, "weight gradient")
    assert torch.count_nonzero(w.grad[VOCAB:]) == 0  # padded rows never learn


def test_small_logits_take_the_unchunked_path(monkeypatch):
    """Below UNCHUNKED_BELOW_BYTES of fp32 logits the default computes them whole: the losses and gradients of
    the unfused path bit for bit, and no chunk's forward runs; above it (the threshold lowered) the chunks run."""
    hidden, weight, target, weights = inputs()
    assert not worth_chunking(target.numel(), PADDED) and worth_chunking(8192, 128256 // 8)  # Llama-3-8B at TP8
    chunk_forwards = []
    real = output_loss._LinearCrossEntropy.forward
    monkeypatch.setattr(output_loss._LinearCrossEntropy, "forward",
                        staticmethod(lambda *a: chunk_forwards.append(1) or real(*a)))
    want = unfused(hidden, weight, target, weights)
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = vocab_parallel_linear_cross_entropy(x, w, target, None, VOCAB)
    (loss * weights).sum().backward()
    assert not chunk_forwards
    assert torch.equal(loss.detach(), want[0]) and torch.equal(x.grad, want[1]) and torch.equal(w.grad, want[2])
    monkeypatch.setattr(output_loss, "UNCHUNKED_BELOW_BYTES", 4 * target.numel() * PADDED)
    vocab_parallel_linear_cross_entropy(hidden, weight, target, None, VOCAB)
    assert chunk_forwards == [1]


def test_fused_bf16_within_one_rounding_of_the_logits():
    """bf16: each logit is one bf16 rounding of the same dot product on both paths, and a loss moves by
    at most twice the largest logit change (log-sum-exp and the target logit are 1-Lipschitz in max-norm);
    the gradients are the unfused ones to a bf16 rounding per chunk's share plus the final one."""
    hidden, weight, target, weights = inputs(torch.bfloat16)
    want = unfused(hidden, weight, target, weights)
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = vocab_parallel_linear_cross_entropy(x, w, target, None, VOCAB, chunked=True)
    (loss * weights).sum().backward()
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16
    u = 2.0 ** -8
    max_logit = F.linear(hidden.float(), weight.float()).abs().max()
    assert (loss.detach() - want[0]).abs().max() <= 2 * u * max_logit
    chunks = -(-VOCAB // chunk_columns(PADDED))
    assert_close_normwise(x.grad.float(), want[1].float(), (chunks + 1) * u, "bf16 hidden gradient")
    assert_close_normwise(w.grad.float(), want[2].float(), 2 * u, "bf16 weight gradient")


def tp_rank():
    """Per sequence-parallel setting (off, on): this rank's losses, hidden gradient, weight-slice gradient."""
    tp = dist.get_world_size()
    group = build_parallel_state(tp=tp).tp_group
    rank = dist.get_rank()
    hidden, weight, target, weights = inputs()
    out = []
    for sequence_parallel in (False, True):
        w = weight.chunk(tp)[rank].clone().requires_grad_()
        # sequence parallelism: this rank's tokens are its block of the [b s] rows
        x = hidden.view(-1, H).chunk(tp)[rank].view(1, -1, H) if sequence_parallel else hidden
        x = x.clone().requires_grad_()
        loss = vocab_parallel_linear_cross_entropy(x, w, target.view(1, -1) if sequence_parallel else target, group,
                                                   VOCAB, sequence_parallel, chunked=True)
        (loss.view(TOKENS) * weights).sum().backward()
        out.append((loss.detach().view(TOKENS), x.grad.reshape(-1, H), w.grad))
    return out


def test_fused_tp2_matches_unfused_tp1():
    hidden, weight, target, weights = inputs()
    want = unfused(hidden, weight, target, weights)
    per_rank = run_ranks(tp_rank, 2, timeout=120)
    loss_rtol, grad_rtol = rtols(target.numel())
    for sequence_parallel in (False, True):
        results = [r[sequence_parallel] for r in per_rank]
        what = "TP2" + (" sequence-parallel" if sequence_parallel else "")
        for loss, _, _ in results:
            assert_close_normwise(loss, want[0], loss_rtol, f"{what} losses")
        x_grads = [g for _, g, _ in results]
        x_grad = torch.cat(x_grads) if sequence_parallel else x_grads[0]
        assert sequence_parallel or torch.equal(x_grads[0], x_grads[1])  # summed over TP: the same on both ranks
        assert_close_normwise(x_grad, want[1].view(-1, H), grad_rtol, f"{what} hidden gradient")
        assert_close_normwise(torch.cat([w for _, _, w in results]), want[2], grad_rtol, f"{what} weight gradient")


def model_loss_and_grads(stages, tokens, labels, mask, fused):
    """Run `stages` (GPTModels, the first taking tokens) one after another; -> loss, {name: grad}."""
    OutputLossConverter(fused).convert(stages[-1])  # as --[no-]cross-entropy-loss-fusion
    x = tokens
    for stage in stages[:-1]:
        x = stage(x)
    loss = stages[-1](x, labels, mask)
    loss.backward()
    grads = {}
    for stage in stages:
        for n, p in stage.named_parameters():
            if p.grad is not None:  # the last stage's copy of the positions is unused
                grads[n] = grads[n] + p.grad if n in grads else p.grad.clone()  # the tied embedding: summed
    return loss.detach(), grads


@pytest.mark.parametrize("untied", [False, True])
def test_model_two_stages_fused_matches_reference_unfused(untied, monkeypatch):
    """Two pipeline stages (the second holding the output layer, the tied embedding's copy or the untied head)
    with the loss mask, fused (by chunks, however small the logits), against the whole single-process reference
    with the loss unfused."""
    monkeypatch.setattr(output_loss, "UNCHUNKED_BELOW_BYTES", 0)
    config = GPTConfig(vocab_size=1000, make_vocab_size_divisible_by=96, hidden_size=32, num_layers=2,
                       num_attention_heads=4, seq_length=16, max_position_embeddings=16, hidden_dropout=0.0,
                       attention_dropout=0.0, untie_embeddings_and_output_weights=untied, seed=3)
    gen = torch.Generator().manual_seed(9)
    data = torch.randint(0, config.vocab_size, (2, 17), generator=gen)
    tokens, labels = data[:, :-1], data[:, 1:]
    mask = (torch.rand(2, 16, generator=gen) > 0.25).float()
    want_loss, want = model_loss_and_grads([reference_model(config)], tokens, labels, mask, fused=False)
    last = num_pipeline_layers(config.num_layers)
    stages = [GPTModel(config, layer_indices=range(0, 3)), GPTModel(config, layer_indices=range(3, last))]
    loss, got = model_loss_and_grads(stages, tokens, labels, mask, fused=True)
    h, n = config.hidden_size, 5 * config.hidden_size + config.ffn_hidden_size + 2 * config.seq_length
    path = 2 * (config.num_layers * n + 2 * h + 1056) + 32
    assert_close_normwise(loss, want_loss, model_rtol(path), "two-stage loss")
    assert set(got) == set(want)
    for name in want:
        assert_close_normwise(got[name], want[name], model_rtol(path), name)


def test_peak_memory_under_a_quarter_of_the_logits():
    """Forward and backward peak, the weight's gradient left out (testing/loss_memory.py): the whole logits
    and their exponentials (over 2x the fp32 logits' bytes) against one vocabulary chunk at a time."""
    tokens, vocab, hidden = 256, 8192, 32
    peaks = peaks_in_subprocess(tokens, vocab, hidden, timeout=300)
    before, after = peaks["unfused"], peaks["fused"]
    assert before["peak"] >= 1.5 * before["logits"]  # the measurement sees the unfused path's logits
    assert after["peak"] < 0.25 * after["logits"], after
    assert after["loss"] == pytest.approx(before["loss"], rel=model_rtol(hidden + vocab))


def test_flags_set_the_switch():
    assert parse_args(BASE, world_size=1).cross_entropy_loss_fusion is True  # the default
    assert parse_args(BASE + ["--cross-entropy-loss-fusion"], world_size=1).cross_entropy_loss_fusion is True
    for flags, fused in ((BASE, True), (BASE + ["--no-cross-entropy-loss-fusion"], False)):
        model = reference_model(tiny_gpt_config(num_layers=1))
        model.fused_output_loss = not fused
        model_converters(from_args(parse_args(flags, world_size=1)), None, torch.device("cpu")).convert(model)
        assert model.fused_output_loss is fused  # as the Trainer converts its stage
    assert parse_args(BASE + ["--cross-entropy-fusion-impl", "native"], world_size=1).cross_entropy_loss_fusion


def test_transformer_engine_cross_entropy_refused_in_one_line(capsys):
    line = refused(BASE + ["--cross-entropy-fusion-impl", "te"], 1, capsys)
    assert "--cross-entropy-fusion-impl" in line and "native" in line


@pytest.mark.slow  # default tier: test_fused_tp2_matches_unfused_tp1, test_model_two_stages_fused_matches_reference_unfused
@pytest.mark.multirank
def test_trainer_tp2_pp2_sequence_parallel_fused_matches_unfused(builtin_corpus, tmp_path):
    """The real Trainer at TP2 x PP2 with sequence parallelism, the loss fused (default) and not: the first
    iteration's loss (the same weights) to the forward's tolerance, every later one finite."""
    base = resume_flags(builtin_corpus, tmp_path, 2, 2, 1, **{"train-iters": 3, "hidden-dropout": 0.0,
                                                              "attention-dropout": 0.0, "sequence-parallel": True})
    fused = run_ranks(train_losses, 4, base, 2, 2, timeout=600)[0]
    unfused = run_ranks(train_losses, 4, base + ["--no-cross-entropy-loss-fusion"], 2, 2, timeout=600)[0]
    assert len(fused) == len(unfused) == 3 and all(map(math.isfinite, fused))
    # the built-in corpus's tokenizer has 2048 pieces
    config = GPTConfig(vocab_size=2048, hidden_size=32, num_layers=2, num_attention_heads=4, seq_length=32,
                       max_position_embeddings=32)
    assert fused[0] == pytest.approx(unfused[0], rel=model_rtol(gpt_path_length(config, 8 * 32, backward=False)))
