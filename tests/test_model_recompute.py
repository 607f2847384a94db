"""Activation recomputation with dropout on: the same loss and bit-identical gradients as without it.

Dropout masks come from the default generator (hidden dropout) and the TP RNG tracker (attention
dropout, sequence-parallel dropout); both must replay on recompute. Checked at TP1 in one process
and at TP2 x PP2 (with and without sequence parallelism) through the 1F1B schedule.
"""
import pytest
import torch
import torch.distributed as dist

from megatron_zero.model import GPTModel
from megatron_zero.model.recompute import layer_segments
from megatron_zero.pipeline.gpt_stage import activation_shape, build_gpt_stage, make_forward_step
from megatron_zero.pipeline.p2p import P2P
from megatron_zero.pipeline.schedule import forward_backward
from megatron_zero.tensor_parallel import model_parallel_seed
from megatron_zero.testing import run_ranks
from megatron_zero.testing.tiny_gpt import tiny_gpt_config
from megatron_zero.distributed.topology import build_parallel_state

VARIANTS = {
    "selective": dict(recompute_granularity="selective"),
    "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-uniform-3": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3),
    "full-block-1": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
}
DROPOUT = dict(hidden_dropout=0.2, attention_dropout=0.2, attention_backend="unfused", hidden_size=64)  # head_dim 16


def test_layer_segments():
    assert layer_segments(4, "uniform", 1) == [(0, 1, True), (1, 2, True), (2, 3, True), (3, 4, True)]
    assert layer_segments(5, "uniform", 2) == [(0, 2, True), (2, 4, True), (4, 5, True)]
    assert layer_segments(4, "block", 2) == [(0, 1, True), (1, 2, True), (2, 4, False)]
    assert layer_segments(2, "block", 3) == [(0, 1, True), (1, 2, True)]


def batch(b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 100, (b, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:].contiguous()


def loss_grads_and_calls(**overrides):
    """Loss, gradients and how often each block's forward ran, with dropout on, on fixed RNG states."""
    model_parallel_seed(11)
    model = GPTModel(tiny_gpt_config(**{**DROPOUT, **overrides}))
    calls = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda *_: calls.append(1))
    big = []  # saved tensors shaped like attention probabilities [.., s, s] (s = 8, head_dim = 16)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: big.append(t.shape[-2:] == (8, 8)) or t, lambda t: t):
        tokens, labels = batch()
        loss = model(tokens, labels=labels)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, len(calls), any(big)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_recompute_matches_no_recompute_with_dropout(variant):
    ref_loss, ref_grads, ref_calls, ref_big = loss_grads_and_calls()
    loss, grads, calls, big = loss_grads_and_calls(**VARIANTS[variant])
    assert torch.equal(loss, ref_loss)
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name  # bit-exact: the same masks, the same arithmetic
    assert ref_calls == 4 and ref_big
    recomputed = {"selective": 0, "full-uniform-1": 4, "full-uniform-3": 4, "full-block-1": 1}[variant]
    assert calls == 4 + recomputed
    if variant == "selective":
        assert not big  # the s x s probabilities are never kept


def test_dropout_is_on_in_these_tests():
    model = GPTModel(tiny_gpt_config(**DROPOUT))
    tokens, labels = batch()
    losses = []
    for seed in (11, 12):
        model_parallel_seed(seed)
        losses.append(model(tokens, labels=labels).item())
    assert losses[0] != losses[1]


def pipelined_grads(overrides, steps=2):
    """Gradients of two global batches on TP2 x PP2, each from fresh RNG states (dropout on)."""
    state = build_parallel_state(tp=2, pp=2)
    cfg = tiny_gpt_config(**DROPOUT, **overrides)
    model = build_gpt_stage(cfg, state)
    p2p = P2P(state.prev_rank, state.next_rank, activation_shape(2, cfg, state.tp_size), torch.float32)
    model_parallel_seed(3, state.tp_rank, state.pp_rank)
    out = []
    for step in range(steps):
        tokens, labels = batch(b=6, seed=step)
        micro = [{"tokens": tokens[i:i + 2], "labels": labels[i:i + 2]} for i in range(0, 6, 2)]
        model.zero_grad()
        losses = forward_backward(make_forward_step(model, micro, state), 3, p2p, state.pp_rank, 2)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out.append(([x.clone() for x in losses], grads))
    return out


def tp2pp2_fn():
    results = {}
    for sp, names in ((False, ("selective", "full-uniform-1", "full-block-1")), (True, ("full-uniform-1",))):
        base = dict(sequence_parallel=sp)
        results[(sp, "none")] = pipelined_grads(base)
        for name in names:
            results[(sp, name)] = pipelined_grads({**base, **VARIANTS[name]})
    dist.barrier()
    return results


def test_recompute_matches_no_recompute_at_tp2_pp2_with_dropout():
    for results in run_ranks(tp2pp2_fn, 4, timeout=300):
        for (sp, name), steps in results.items():
            ref = results[(sp, "none")]
            for (losses, grads), (ref_losses, ref_grads) in zip(steps, ref):
                assert grads.keys() == ref_grads.keys() and len(losses) == len(ref_losses)
                assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), (sp, name)
                for n, g in ref_grads.items():
                    assert torch.equal(grads[n], g), (sp, name, n)


def test_selective_recompute_of_sdpa_matches():
    base = dict(attention_dropout=0.0, attention_backend="flash")  # hidden dropout stays on
    ref_loss, ref_grads, _, _ = loss_grads_and_calls(**base)
    loss, grads, _, _ = loss_grads_and_calls(**base, recompute_granularity="selective")
    assert torch.equal(loss, ref_loss)
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name


def saved_between_forward_and_backward(sp):
    """Bytes of the distinct storages a 4-layer TP2 stage (hidden dropout on, SDPA) keeps for backward under full
    recomputation, one layer a segment; and one layer input's bytes on this rank."""
    from megatron_zero.model import GPTConfig
    from megatron_zero.model.layer_indices import block_layer_index

    state = build_parallel_state(tp=2)
    model_parallel_seed(1, state.tp_rank)
    seq, hidden, layers = 256, 64, 4
    config = GPTConfig(vocab_size=1024, hidden_size=hidden, num_layers=layers, num_attention_heads=4, seq_length=seq,
                       max_position_embeddings=seq, hidden_dropout=0.1, attention_dropout=0.0, attention_backend="flash",
                       sequence_parallel=sp, **VARIANTS["full-uniform-1"])
    model = GPTModel(config, state.tp_group, layer_indices=range(block_layer_index(0), block_layer_index(layers)))
    x = torch.randn(1, seq // 2 if sp else seq, hidden, requires_grad=True)
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(storages.values()), x.numel() * 4


@pytest.mark.slow  # default tier: test_recompute_matches_no_recompute_at_tp2_pp2_with_dropout (SP + full recompute)
def test_sequence_parallel_full_recompute_keeps_only_the_layer_input_shards():
    """What full recomputation keeps is each layer's input, and with sequence parallelism that is this rank's
    shard of the tokens, never a view holding the whole [b, s, h] (bench/bench_activation_memory.py's 9.9 MiB
    against 5.1 was shm_comm's shared buffers growing inside its measurement, not activations)."""
    for sp in (False, True):
        for saved, layer_input in run_ranks(saved_between_forward_and_backward, 2, sp, timeout=120):
            assert saved == 4 * layer_input, (sp, saved, layer_input)
