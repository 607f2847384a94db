"""The flash path of ring (p2p) and hierarchical (a2a+p2p) context parallelism: which kernel runs for which
inputs, that the flash path never forms a [queries, keys] tensor (forward and backward, every Python-level
torch call watched; the block path, watched the same way, does form them), and that a torch without the
flash op falls back to the block path with the same result. Parity of the flash path with the
whole-sequence attention is in test_context_parallel_attention.py."""
import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from megatron_zero.context_parallel import block_attention, context_parallel_attention, flash_blocks
from megatron_zero.context_parallel.attention import ring_kernel
from megatron_zero.testing import run_ranks
from megatron_zero.testing.tolerances import assert_close_normwise, model_rtol

B, HEADS, SEQ, D, CP = 1, 4, 40, 8, 2  # local queries 20, chunks of 10: neither is D, so a score block shows


def test_backend_and_inputs_pick_the_kernel(monkeypatch):
    q = torch.zeros(1, 2, 4, 8)
    flash, phrase = ring_kernel("auto", None, q)
    assert flash and flash_blocks.CPU_OP in phrase
    assert ring_kernel("flash", None, q)[0] and ring_kernel("flash", None, q.bfloat16())[0]
    for backend in ("unfused", "fused"):
        assert ring_kernel(backend, None, q) == (False, f"block_attention's query pieces (--attention-backend {backend})")
    assert "attention dropout" in ring_kernel("auto", block_attention.Dropout(0.1, 1), q)[1]
    assert "float64" in ring_kernel("auto", None, q.double())[1]
    monkeypatch.setattr(flash_blocks, "CPU_OP", "_no_such_flash_op")
    flash, phrase = ring_kernel("flash", None, q)
    assert not flash and "has no aten._no_such_flash_op" in phrase


class ScoreBlocks(TorchFunctionMode):
    """Records the shape of every result of a torch call whose last two dims are (queries, keys) of a block."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if torch.is_tensor(t) and t.dim() >= 2 and {t.shape[-2], t.shape[-1]} <= {SEQ // CP, SEQ // (2 * CP)}:
                self.seen.append(tuple(t.shape))
        return out


def _attend(comm_type, backend, hierarchy=None):
    g = torch.Generator().manual_seed(11 + dist.get_rank())
    q, k, v = (torch.randn(B, HEADS, SEQ // CP, D, generator=g).requires_grad_() for _ in range(3))
    watch = ScoreBlocks()
    with watch:
        out = context_parallel_attention(q, k, v, dist.group.WORLD, comm_type, hierarchy=hierarchy, backend=backend)
        out.backward(torch.ones_like(out))
    return watch.seen, [t.detach() for t in (out, q.grad, k.grad, v.grad)]


def watched_run():
    ring_of_two = (dist.new_group([dist.get_rank()]), dist.group.WORLD)  # a2a+p2p with all-to-all groups of 1
    block_scores, blocks = _attend("p2p", "unfused")
    real_scores = block_attention._scores

    def refuse(*args):
        raise AssertionError("the flash path formed a score block")
    block_attention._scores = refuse
    flash_scores, flash = _attend("p2p", "flash")
    hier_scores, _ = _attend("a2a+p2p", "auto", ring_of_two)
    block_attention._scores = real_scores
    flash_blocks.CPU_OP = "_no_such_flash_op"  # a torch without the op: auto falls back to the block path
    _, fallback = _attend("p2p", "auto")
    return block_scores, flash_scores, hier_scores, blocks, flash, fallback


@pytest.fixture(scope="module")
def runs():
    return run_ranks(watched_run, CP)


def test_flash_path_forms_no_score_block(runs):
    for block_scores, flash_scores, hier_scores, *_ in runs:
        assert block_scores  # the watch sees the block path's [queries, keys] scores
        assert flash_scores == [] and hier_scores == []


def test_flash_and_block_paths_agree_and_a_missing_op_falls_back(runs):
    """Both are fp32 evaluations of one attention in another order: model_rtol(4 (d + s)), as the parity tests."""
    for *_, blocks, flash, fallback in runs:
        for name, a, b, c in zip(("out", "dq", "dk", "dv"), blocks, flash, fallback):
            assert_close_normwise(b, a, model_rtol(4 * (D + SEQ)), f"flash vs blocks {name}")
            assert torch.equal(c, a), name
