"""Vocab-parallel cross-entropy vs torch.nn.functional.cross_entropy on the unpadded logits."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_zero.tensor_parallel import vocab_parallel_cross_entropy
from megatron_zero.testing import run_ranks
from megatron_zero.distributed.topology import build_parallel_state

VOCAB, PADDED = 1000, 1152  # 152 padded columns: the last TP=4 rank holds 288 columns, 136 of them real


def inputs(scale):
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 5, PADDED, generator=gen) * scale
    target = torch.randint(0, VOCAB, (3, 5), generator=gen)
    target[0, 0], target[0, 1] = 0, VOCAB - 1  # the first and the last real column
    weights = torch.rand(3, 5, generator=gen)
    return logits, target, weights


def reference(scale):
    logits, target, weights = inputs(scale)
    logits.requires_grad_()
    loss = F.cross_entropy(logits[..., :VOCAB].reshape(-1, VOCAB), target.view(-1), reduction="none").view(3, 5)
    (loss * weights).sum().backward()
    return loss.detach(), logits.grad


def rank_fn(tp, scale):
    group = build_parallel_state(tp=tp).tp_group
    logits, target, weights = inputs(scale)
    local = logits.chunk(tp, dim=-1)[dist.get_rank()].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, group, vocab_size=VOCAB)
    (loss * weights).sum().backward()
    return loss.detach(), local.grad


@pytest.mark.parametrize("scale", [1.0, 1000.0])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_matches_torch_cross_entropy(tp, scale):
    ref_loss, ref_grad = reference(scale)
    assert torch.isfinite(ref_loss).all()
    results = run_ranks(rank_fn, tp, tp, scale, timeout=60)
    for loss, _ in results:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    grad = torch.cat([g for _, g in results], dim=-1)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
    assert torch.count_nonzero(grad[..., VOCAB:]) == 0  # padded columns never learn


def test_single_process_path_and_unpadded_vocab():
    logits, target, _ = inputs(1.0)
    ref = F.cross_entropy(logits.view(-1, PADDED), target.view(-1), reduction="none").view(3, 5)
    torch.testing.assert_close(vocab_parallel_cross_entropy(logits, target), ref, rtol=1e-6, atol=1e-6)
    masked = vocab_parallel_cross_entropy(logits, target, None, vocab_size=VOCAB)
    assert (masked < ref).all()  # removing padded columns removes probability mass from the denominator


def test_input_untouched_and_second_backward_refused():
    """The forward works on its own copy (the logits are unchanged); the backward reuses the saved
    softmax in place, so a second backward through the same graph is an error, not a wrong gradient."""
    logits, target, _ = inputs(1.0)
    logits.requires_grad_()
    before = logits.detach().clone()
    loss = vocab_parallel_cross_entropy(logits, target).sum()
    assert torch.equal(logits.detach(), before)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once"):
        loss.backward()
