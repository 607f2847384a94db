"""Sequence parallelism at TP2: the reference's loss and gradients (fp32, dropout 0), and training with dropout.

fp32 tolerances from megatron_zero/testing/tolerances.py: the loss to model_rtol of the forward's path
(1.3e-5 GPT, 1.5e-5 Llama), each gradient element within model_rtol of the forward and backward's
(1.8e-5, 2.1e-5) times (|its value| + its tensor's largest), the size of the terms its roundoff comes from.

The pipelined cases (TP2, TP2 x PP2 through the 1F1B schedule, several steps) are in
test_pipeline_gpt.py; recomputation with sequence parallelism and dropout in test_model_recompute.py.
"""
import torch
import torch.distributed as dist

import pytest

from megatron_zero.model import GPTModel, gather_state_dicts, reference_model, unpad_vocab
from megatron_zero.model.params import param_spec
from megatron_zero.tensor_parallel import model_parallel_seed
from megatron_zero.testing import run_ranks
from megatron_zero.testing.tiny_gpt import tiny_gpt_config, tiny_llama_config
from megatron_zero.testing.tolerances import assert_close_scaled, assert_losses_close, gpt_path_length, model_rtol
from megatron_zero.distributed.topology import build_parallel_state

WORD = "tied_modules.embed.word_embeddings.weight"


def rtols(config, b=4):
    """(loss, gradient) tolerances for one forward and backward on `b` sequences."""
    tokens = b * config.seq_length
    return (model_rtol(gpt_path_length(config, tokens, backward=False)),
            model_rtol(gpt_path_length(config, tokens)))


def batch(b=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 100, (b, 9), generator=g)
    mask = (torch.rand(b, 8, generator=g) > 0.2).float()
    return tokens[:, :-1], tokens[:, 1:].contiguous(), mask


def sp_fn():
    state = build_parallel_state(tp=2)
    model = GPTModel(tiny_gpt_config(sequence_parallel=True), state.tp_group)
    tokens, labels, mask = batch()
    hidden = model.embedding(tokens)
    loss = model(tokens, labels, mask)
    loss.backward()
    marked = sorted(n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False))
    return tuple(hidden.shape), loss.detach(), {n: p.grad for n, p in model.named_parameters()}, marked


def test_sequence_parallel_matches_reference_at_tp2():
    config = tiny_gpt_config()
    ref = reference_model(config)
    tokens, labels, mask = batch()
    ref_loss = ref(tokens, labels, mask)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    ref_grads[WORD] = unpad_vocab(ref_grads[WORD], config.vocab_size)
    results = run_ranks(sp_fn, 2, timeout=120)
    loss_rtol, grad_rtol = rtols(config)
    for shape, loss, grads, marked in results:
        assert shape == (4, 4, 32)  # each rank holds half of the sequence
        assert_losses_close([loss.item()], [ref_loss.item()], loss_rtol, "loss")
        # LayerNorms (4 blocks' two, the final one) and the row-parallel biases are sequence-parallel
        assert len(marked) == 4 * 6 + 2 and "5.self_attention.dense.bias" in marked and "6.weight" in marked
        for name in marked:  # their partial gradients were summed over TP: equal on both ranks
            assert torch.equal(grads[name], results[0][2][name]), name
    full = gather_state_dicts([r[2] for r in results], config)
    assert full.keys() == ref_grads.keys()
    for name, g in full.items():
        assert_close_scaled(g, ref_grads[name], grad_rtol, name)


def llama_sp_fn(groups):
    state = build_parallel_state(tp=2)
    model = GPTModel(tiny_llama_config(num_query_groups=groups, sequence_parallel=True), state.tp_group)
    tokens, labels, mask = batch()
    loss = model(tokens, labels, mask)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.isa
@pytest.mark.parametrize("groups", [2, 1])  # 1: fewer KV groups than TP ranks (gathered and replicated)
def test_sequence_parallel_llama_matches_reference_at_tp2(groups):
    """RMSNorm, RoPE on the gathered sequence, SwiGLU, grouped-query attention and the untied head under
    sequence parallelism, fp32 and dropout 0, to the tolerances above."""
    config = tiny_llama_config(num_query_groups=groups)
    ref = reference_model(config)
    tokens, labels, mask = batch()
    ref_loss = ref(tokens, labels, mask)
    ref_loss.backward()
    results = run_ranks(llama_sp_fn, 2, groups, timeout=120)
    loss_rtol, grad_rtol = rtols(config)
    for loss, _ in results:
        assert_losses_close([loss.item()], [ref_loss.item()], loss_rtol, "loss")
    full = gather_state_dicts([r[1] for r in results], config)
    for name, p in ref.named_parameters():
        want = unpad_vocab(p.grad, config.vocab_size) if param_spec(name, config).is_vocab else p.grad
        assert_close_scaled(full[name], want, grad_rtol, name)


def train_with_dropout_fn(steps):
    state = build_parallel_state(tp=2)
    model_parallel_seed(5, state.tp_rank)
    model = GPTModel(tiny_gpt_config(sequence_parallel=True, hidden_dropout=0.1, attention_dropout=0.1),
                     state.tp_group)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    tokens, labels, mask = batch(b=8)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(tokens, labels, mask)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        eval_loss = model(tokens, labels, mask).item()
    replicated = {n: p.detach() for n, p in model.named_parameters() if not p.tensor_model_parallel}
    dist.barrier()
    return losses, eval_loss, replicated


def test_sequence_parallel_with_dropout_trains():
    (losses, eval_loss, rep0), (losses1, eval_loss1, rep1) = run_ranks(train_with_dropout_fn, 2, 40, timeout=120)
    assert losses == losses1  # the loss is all-reduced over TP: both ranks see the same value
    assert len(set(losses)) == len(losses)  # dropout on: every step draws new masks
    assert losses[-1] < 0.6 * losses[0] and eval_loss < 0.6 * losses[0], (losses[0], losses[-1], eval_loss)
    for name, w in rep0.items():  # replicated weights never drift apart across TP ranks
        assert torch.equal(w, rep1[name]), name
