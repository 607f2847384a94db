"""bench/bench_moe.py's argument handling, and its equal-active-parameter baseline."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

from bench_moe import active_params, config, parse, weight_copies  # noqa: E402

from megatron_zero.model.gpt import reference_model  # noqa: E402


def test_parse_defaults_and_table_choice():
    a = parse([])
    assert a.tables == {"a", "b", "c", "d"} and a.experts % 4 == 0
    assert parse(["--tables", "b"]).tables == {"b"}


@pytest.mark.parametrize("argv", [["--tables", "a,e"], ["--experts", "6"], ["--topk", "9"], ["--reps", "0"]])
def test_parse_refuses(argv, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("llama", [False, True])
def test_dense_baseline_has_the_moe_models_active_parameters(llama):
    """k experts of width F against one MLP of width k F: the same parameters a token goes through, except
    the router (h E) and, with biases, the k - 1 extra second-layer biases (h each)."""
    a = parse(["--layers", "1", "--hidden", "32", "--ffn", "16", "--vocab", "64", "--seq", "8"])
    moe, dense = config(a, True, llama), config(a, False, llama)
    assert dense.ffn_hidden_size == a.topk * moe.moe_ffn_hidden_size
    extra = a.layers * a.hidden * (a.experts + (0 if llama else a.topk - 1))
    assert active_params(reference_model(moe), moe) - active_params(reference_model(dense), dense) == extra


def test_weight_copies_table_counts_the_stack_and_none_under_zero():
    """(d): separate tensors copy every expert byte a forward, ZeRO-1's flat buffer and ZeRO-3's gathered storage
    none."""
    a = parse(["--layers", "1", "--hidden", "32", "--ffn", "16", "--vocab", "64", "--seq", "8", "--tokens", "16"])
    for name, held, separate, zero1, zero3 in weight_copies(a):
        assert (separate, zero1, zero3) == (held, 0, 0), name
