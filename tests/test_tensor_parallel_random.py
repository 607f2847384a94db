"""The TP-aware RNG tracker: per-rank masks inside TP regions, identical ones outside, restorable states."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_zero.model import GPTConfig, GPTModel
from megatron_zero.tensor_parallel import get_rng_tracker, model_parallel_seed
from megatron_zero.testing import run_ranks
from megatron_zero.distributed.topology import build_parallel_state


def masks():
    outside = F.dropout(torch.ones(4096), 0.5, True) > 0
    with get_rng_tracker().fork():
        inside = F.dropout(torch.ones(4096), 0.5, True) > 0
    return outside, inside


def tracker_fn():
    tp_rank = build_parallel_state(tp=dist.get_world_size()).tp_rank
    model_parallel_seed(1234, tp_rank, pp_rank=0)
    first = masks()
    saved_tracker, saved_default = get_rng_tracker().get_states(), torch.get_rng_state()
    second = masks()
    get_rng_tracker().set_states(saved_tracker)
    torch.set_rng_state(saved_default)
    replay = masks()
    return first, second, replay


def test_masks_differ_inside_tp_regions_and_replay_after_restore():
    results = run_ranks(tracker_fn, 2, timeout=60)
    (out0, in0), _, _ = results[0]
    (out1, in1), _, _ = results[1]
    assert torch.equal(out0, out1)          # replicated region: every TP rank draws the same mask
    assert not torch.equal(in0, in1)        # TP region: each rank its own mask
    for first, second, replay in results:
        assert not torch.equal(first[0], second[0]) and not torch.equal(first[1], second[1])  # streams advance
        assert torch.equal(second[0], replay[0]) and torch.equal(second[1], replay[1])


def test_fork_without_seeding_names_the_fix():
    tracker = get_rng_tracker()
    saved = tracker.get_states()
    tracker.reset()
    try:
        with tracker.fork():
            raise AssertionError("fork() ran on an untracked state")
    except RuntimeError as err:
        assert "model_parallel_seed" in str(err)
    finally:
        tracker.set_states(saved)


CONFIG = dict(vocab_size=500, hidden_size=64, num_layers=2, num_attention_heads=4, seq_length=16,
              max_position_embeddings=16, make_vocab_size_divisible_by=64, seed=99)


def model_dropout_fn(same_attention_seed):
    state = build_parallel_state(tp=dist.get_world_size())
    config = GPTConfig(hidden_dropout=0.2, attention_dropout=0.2, **CONFIG)
    tokens = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    trunk = GPTModel(config, state.tp_group, layer_indices=range(0, 4))  # embedding and both blocks
    model_parallel_seed(5, 0 if same_attention_seed else state.tp_rank, 0)
    saved = get_rng_tracker().get_states(), torch.get_rng_state()
    hidden = trunk(tokens)
    get_rng_tracker().set_states(saved[0])
    torch.set_rng_state(saved[1])
    replay = trunk(tokens)
    again = trunk(tokens)
    return hidden.detach(), replay.detach(), again.detach()


def test_model_dropout_is_replicated_outside_and_restorable():
    (h0, r0, a0), (h1, r1, a1) = run_ranks(model_dropout_fn, 2, False, timeout=60)
    assert torch.equal(h0, h1)                # residual stream (hidden dropout) identical on both TP ranks
    assert torch.equal(h0, r0) and torch.equal(h1, r1)  # restored states replay the same masks
    assert not torch.equal(h0, a0)            # and without restoring, new masks are drawn
    (s0, _, _), _ = run_ranks(model_dropout_fn, 2, True, timeout=60)
    assert not torch.equal(h0, s0)            # attention dropout draws from the per-TP-rank tracker state
