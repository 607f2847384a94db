"""TP state-dict sharding and gathering, vocab padding, the parameter catalogue and layer indices."""
import pytest
import torch

from megatron_zero.model import (GPTConfig, GPTModel, block_layer_index, final_norm_index, gather_state_dicts,
                                 lm_head_index, num_pipeline_layers, pad_vocab, param_names, param_spec,
                                 reference_model, shard_state_dict, unpad_vocab)
from megatron_zero.model.layer_indices import layer_kind

WORD = "tied_modules.embed.word_embeddings.weight"


def config(**kw):
    base = dict(vocab_size=1000, hidden_size=64, num_layers=2, num_attention_heads=4, seq_length=16,
                max_position_embeddings=16, make_vocab_size_divisible_by=96)
    base.update(kw)
    return GPTConfig(**base)


def random_full_state(c):
    gen = torch.Generator().manual_seed(5)
    return {n: torch.randn(param_spec(n, c).full_shape, generator=gen) for n in param_names(c)}


def test_round_trip_tp1_tp2_tp4_tp1_is_exact():
    c = config()
    full = random_full_state(c)
    sd = full
    for tp in (1, 2, 4, 1):
        shards = [shard_state_dict(sd, c, tp, r) for r in range(tp)]
        assert shards[0][WORD].shape == (c.padded_vocab_size(tp) // tp, 64)
        sd = gather_state_dicts(shards, c)
    assert sd.keys() == full.keys()
    for name in full:
        assert torch.equal(sd[name], full[name]), name


def test_shards_load_into_a_tp_model_with_matching_shapes():
    """A TP-form state dict has exactly the keys and local shapes of the model (built per rank, no groups needed)."""
    c = config()
    ref = reference_model(c)
    full = {n: p.detach() for n, p in ref.named_parameters()}
    full[WORD] = unpad_vocab(full[WORD], c.vocab_size)
    back = shard_state_dict(full, c, 1, 0)
    ref_sd = ref.state_dict()
    assert back.keys() == ref_sd.keys()
    for name in back:
        assert torch.equal(back[name], ref_sd[name]), name
    two = shard_state_dict(full, c, 2, 1)
    assert two["2.self_attention.query_key_value.weight"].shape == (96, 64)
    assert two["2.mlp.dense_4h_to_h.weight"].shape == (64, 128)
    assert two["2.mlp.dense_4h_to_h.bias"].shape == (64,)


def test_qkv_column_split_keeps_whole_heads():
    c = config()
    full = random_full_state(c)
    qkv = full["2.self_attention.query_key_value.weight"]  # rows: heads x [q, k, v] x head_dim
    heads = qkv.view(4, 3, 16, 64)
    shards = [shard_state_dict(full, c, 2, r)["2.self_attention.query_key_value.weight"] for r in range(2)]
    assert torch.equal(shards[1].view(2, 3, 16, 64), heads[2:])


def test_vocab_padding_helpers_and_sizes():
    c = config()
    assert [c.padded_vocab_size(tp) for tp in (1, 2, 4)] == [1056, 1152, 1152]
    t = torch.randn(1000, 3)
    padded = pad_vocab(t, 1056)
    assert padded.shape == (1056, 3) and torch.count_nonzero(padded[1000:]) == 0
    assert torch.equal(unpad_vocab(padded, 1000), t)
    with pytest.raises(ValueError, match="unpadded"):
        shard_state_dict({WORD: padded}, c, 1, 0)


def test_layer_indices_and_names():
    c = config()
    L = c.num_layers
    assert num_pipeline_layers(L) == 6 and block_layer_index(0) == 2 and final_norm_index(L) == 4
    assert lm_head_index(L) == 5
    assert [layer_kind(i, L) for i in range(6)] == ["input", "embedding", "block", "block", "final_norm", "lm_head"]
    assert param_names(c)[-2:] == ["4.weight", "4.bias"]
    with pytest.raises(ValueError, match="not a parameter"):
        param_spec("7.input_layernorm.weight", c)
    middle = GPTModel(c, layer_indices=range(3, 4))
    assert [n for n, _ in middle.named_parameters()] == param_names(c, range(3, 4))
    assert all(n.startswith("3.") for n in param_names(c, range(3, 4)))
    assert GPTModel(c, layer_indices=[1, 3]).chunks == [[1], [3]]  # runs apart: interleaved model chunks
    for bad in ([3, 1], [2, 2], [], [9]):
        with pytest.raises(ValueError, match="increasing and within"):
            GPTModel(c, layer_indices=bad)


def test_same_seed_same_weights_other_seed_other_weights():
    a, b = reference_model(config()).state_dict(), reference_model(config()).state_dict()
    c = reference_model(config(seed=1)).state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a[WORD], c[WORD])
    assert torch.equal(a["2.mlp.dense_h_to_4h.bias"], torch.zeros(256))
    scaled, plain = a["2.mlp.dense_4h_to_h.weight"].std(), a["2.mlp.dense_h_to_4h.weight"].std()
    assert abs(scaled / plain - 0.5) < 0.05  # output projections: std / sqrt(2L) with L = 2


def test_parameter_attributes_and_tp_duplicates():
    from megatron_zero.tensor_parallel import param_is_tp_duplicate
    c = config()
    model = reference_model(c)
    for name, p in model.named_parameters():
        spec = param_spec(name, c)
        assert p.tensor_model_parallel == (spec.partition_dim is not None), name
        if p.tensor_model_parallel:
            assert (p.partition_dim, p.partition_stride) == (spec.partition_dim, 1), name
        assert not param_is_tp_duplicate(p, 0)
        assert param_is_tp_duplicate(p, 1) == (spec.partition_dim is None), name
    assert model.get_parameter("2.self_attention.dense.weight").partition_dim == 1
    assert model.get_parameter("2.self_attention.dense.bias").tensor_model_parallel is False
