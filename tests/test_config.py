"""The configuration layer: each check in one place (the command line refuses with the very sentence of the
code that owns the rule), a feature's flags module plugs in with one entry, and the files stay small."""
import os

import pytest

import megatron_zero
from megatron_zero import arguments
from megatron_zero.config.errors import require
from megatron_zero.moe.expert_counts import check_expert_counts
from megatron_zero.testing.flag_checks import BASE, refused, with_flags
from megatron_zero.topology import Layout, TopologyError


def _sentence(error_type, call):
    with pytest.raises(error_type) as err:
        call()
    return str(err.value)


@pytest.mark.parametrize("changes,world,owner", [
    (dict(tensor_model_parallel_size=4), 6, lambda: Layout.from_world(6, 4, 1, 1)),
    (dict(context_parallel_size=3), 4, lambda: Layout.from_world(4, 1, 1, 3)),
    (dict(num_experts=4, context_parallel_size=2, expert_model_parallel_size=4), 2,
     lambda: Layout(dp=1, cp=2).check_expert_parallel(4)),
    (dict(num_experts=4, expert_model_parallel_size=4), 2, lambda: Layout(dp=2).check_expert_parallel(4)),
    (dict(num_experts=4, tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2,
          expert_tensor_parallel_size=1), 4, lambda: Layout(tp=2, dp=1, cp=2).check_expert_parallel(1, 1)),
    (dict(num_experts=4, tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=1,
          expert_model_parallel_size=4), 2, lambda: Layout(tp=2, dp=1).check_expert_parallel(4, 1)),
])
def test_layout_rules_refused_in_the_topologys_words(changes, world, owner, capsys):
    """The world's divisibility and the expert groups' rules live in topology.Layout; the flags say the same."""
    sentence = _sentence(TopologyError, owner)
    assert refused(with_flags(BASE, **changes), world, capsys).strip() == f"pretrain_gpt.py: error: {sentence}"


@pytest.mark.parametrize("changes,counts", [
    (dict(num_experts=3, expert_model_parallel_size=2), (3, 2, 2)),
    (dict(num_experts=4, moe_router_topk=5), (4, 5, 1)),
])
def test_expert_count_refused_in_one_sentence_everywhere(changes, counts, capsys):
    """The flags, GPTConfig and the MoE layer ask moe/expert_counts.py."""
    from megatron_zero.model.config import GPTConfig

    experts, topk, ep = counts
    sentence = _sentence(ValueError, lambda: check_expert_counts(experts, topk, ep))
    assert refused(with_flags(BASE, **changes), 2, capsys).strip() == f"pretrain_gpt.py: error: {sentence}"
    if ep == 1:
        config = dict(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, seq_length=16,
                      max_position_embeddings=16, num_experts=experts, moe_router_topk=topk)
        assert _sentence(ValueError, lambda: GPTConfig(**config)) == sentence


def _feature_flags(parser):
    parser.add_argument_group("a feature").add_argument("--feature-width", type=int, default=3,
                                                        help="the feature's width")


def _check_feature(args):
    require(args.feature_width <= args.hidden_size,
            f"--feature-width {args.feature_width} exceeds --hidden-size {args.hidden_size}")
    args.feature_share = args.feature_width / args.hidden_size


def test_a_features_flags_module_plugs_in(monkeypatch, capsys):
    """One FEATURES entry: its flags join the parser and --help, its check runs on the checked values."""
    monkeypatch.setattr(arguments, "FEATURES", arguments.FEATURES + ((_feature_flags, _check_feature),))
    assert "the feature's width (default: 3)" in " ".join(arguments.build_parser().format_help().split())
    assert arguments.parse_args(with_flags(BASE, feature_width=16)).feature_share == 0.25
    assert "--feature-width 65 exceeds --hidden-size 64" in refused(with_flags(BASE, feature_width=65), 1, capsys)


def test_no_file_of_the_package_over_500_lines():
    root = os.path.dirname(megatron_zero.__file__)
    sizes = {}
    for directory, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(directory, name)) as f:
                    sizes[os.path.relpath(os.path.join(directory, name), root)] = sum(1 for _ in f)
    assert sizes["arguments.py"] < 300
    assert not {name: n for name, n in sizes.items() if n > 500}
