"""TP=1,2,4 GPT on gloo ranks vs the single-process reference: same init, same loss, same gradients.

fp32 tolerances from megatron_zero/testing/tolerances.py: the loss to model_rtol of the forward's
path (~1.7e-5), each gathered gradient normwise to model_rtol of the forward and backward's (~2.4e-5)."""
import pytest
import torch

from megatron_zero.model import GPTConfig, GPTModel, gather_state_dicts, reference_model, unpad_vocab
from megatron_zero.model.params import param_spec
from megatron_zero.model.sharding import gather_tensor
from megatron_zero.testing import run_ranks
from megatron_zero.testing.tolerances import assert_close_normwise, assert_losses_close, gpt_path_length, model_rtol
from megatron_zero.distributed.topology import build_parallel_state

# vocab 1000 / divisible_by 96 pads to 1056 at TP1 and 1152 at TP2 and TP4;
# vocab 960 is unpadded at TP1 and TP2 and padded to 1152 at TP4.
CONFIGS = {
    "padded": dict(vocab_size=1000, make_vocab_size_divisible_by=96),
    "exact": dict(vocab_size=960, make_vocab_size_divisible_by=96),
}


def small_config(**overrides):
    base = dict(hidden_size=64, num_layers=2, num_attention_heads=4, seq_length=16, max_position_embeddings=32,
                hidden_dropout=0.0, attention_dropout=0.0, seed=1234)
    base.update(overrides)
    return GPTConfig(**base)


def batch(config, b=2):
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, config.vocab_size, (b, config.seq_length + 1), generator=gen)
    loss_mask = (torch.rand(b, config.seq_length, generator=gen) > 0.2).float()
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), loss_mask


def rtols(config, b=2):
    """(loss, gradient) tolerances for one forward and backward on `b` sequences."""
    tokens = b * config.seq_length
    return (model_rtol(gpt_path_length(config, tokens, backward=False)),
            model_rtol(gpt_path_length(config, tokens)))


def loss_and_grads(model, config):
    tokens, labels, loss_mask = batch(config)
    loss = model(tokens, labels, loss_mask)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return loss.detach(), grads


def tp_rank_fn(config, tp):
    state = build_parallel_state(tp=tp)
    model = GPTModel(config, state.tp_group)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss, grads = loss_and_grads(model, config)
    attrs = {n: (p.tensor_model_parallel, getattr(p, "partition_dim", None)) for n, p in model.named_parameters()}
    return loss, grads, weights, attrs


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.isa
@pytest.mark.parametrize("case", sorted(CONFIGS))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_matches_reference(tp, case):
    config = small_config(**CONFIGS[case])
    ref = reference_model(config)
    ref_loss, ref_grads = loss_and_grads(ref, config)
    ref_weights = {n: p.detach() for n, p in ref.named_parameters()}
    word = "tied_modules.embed.word_embeddings.weight"
    for d in (ref_grads, ref_weights):
        d[word] = unpad_vocab(d[word], config.vocab_size)

    results = run_ranks(tp_rank_fn, tp, config, tp, timeout=120)

    # the same seed gives the same full weights at any TP
    full_weights = gather_state_dicts([r[2] for r in results], config)
    assert full_weights.keys() == ref_weights.keys()
    for name, w in full_weights.items():
        assert torch.equal(w, ref_weights[name]), name

    loss_rtol, grad_rtol = rtols(config)
    for loss, *_ in results:
        assert_losses_close([loss.item()], [ref_loss.item()], loss_rtol, "loss")
    for name in ref_grads:
        spec = param_spec(name, config)
        shards = [r[1][name] for r in results]
        full = gather_tensor(shards, spec, config)
        assert_close_normwise(full, ref_grads[name], grad_rtol, name)
        if spec.partition_dim is None:  # replicated parameters get the same gradient on every TP rank
            for s in shards[1:]:
                assert rel(s, shards[0]) < 1e-6, name
        assert results[0][3][name] == (spec.partition_dim is not None, spec.partition_dim), name


def test_padded_vocab_rows_get_zero_gradient():
    config = small_config(**CONFIGS["padded"])
    _, grads = loss_and_grads(reference_model(config), config)
    word = grads["tied_modules.embed.word_embeddings.weight"]
    assert word.shape[0] == config.padded_vocab_size(1) > config.vocab_size
    assert torch.count_nonzero(word[config.vocab_size:]) == 0
    assert word[: config.vocab_size].abs().sum() > 0


def test_pipeline_stages_compose_to_the_whole_model():
    """Two stages built from layer ranges chain to the same loss and gradients as the whole model."""
    config = small_config(**CONFIGS["padded"])
    whole = reference_model(config)
    ref_loss, ref_grads = loss_and_grads(whole, config)
    first, last = GPTModel(config, layer_indices=range(0, 3)), GPTModel(config, layer_indices=range(3, 6))
    assert [n for n, _ in last.named_parameters()][:2] == ["tied_modules.embed.word_embeddings.weight",
                                                           "tied_modules.embed.position_embeddings.weight"]
    tokens, labels, loss_mask = batch(config)
    hidden = first(tokens)
    assert hidden.shape == (2, config.seq_length, config.hidden_size)
    loss = last(hidden, labels, loss_mask)
    loss.backward()
    loss_rtol, grad_rtol = rtols(config)
    assert_losses_close([loss.item()], [ref_loss.item()], loss_rtol, "loss")
    grads = {}
    for stage in (first, last):
        for name, p in stage.named_parameters():
            if p.grad is not None:
                grads[name] = grads.get(name, 0) + p.grad  # the tied word embedding sums both stages
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert_close_normwise(g, ref_grads[name], grad_rtol, name)
