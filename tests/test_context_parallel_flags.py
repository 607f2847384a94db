"""--context-parallel-size and --cp-comm-type: the derived sizes, and each layout or composition context
parallelism does not have refused in one sentence naming the flag."""
import pytest

from megatron_zero.arguments import cp_a2a_size, parse_args
from megatron_zero.testing.flag_checks import BASE, refused, with_flags
from megatron_zero.distributed.topology import Layout, hierarchical_cp_ranks


def test_cp_divides_the_world_and_dp_counts_data_replicas():
    args = parse_args(with_flags(BASE, context_parallel_size=2, tensor_model_parallel_size=2, attention_dropout=0,
                                 cp_comm_type="all_gather"), world_size=8)
    assert (args.data_parallel_size, args.num_micro_batches, args.cp_comm_type) == (2, 4, "all_gather")
    assert parse_args(BASE, world_size=1).cp_comm_type == "p2p"
    composed = parse_args(with_flags(BASE, context_parallel_size=2, pipeline_model_parallel_size=2,
                                     num_layers_per_virtual_pipeline_stage=1, recompute_granularity="selective",
                                     bf16=True, attention_dropout=0, global_batch_size=4), world_size=4)
    assert (composed.virtual_pipeline_model_parallel_size, composed.params_dtype) == (2, "bf16")
    ulysses = parse_args(with_flags(BASE, context_parallel_size=2, cp_comm_type="a2a", attention_backend="flash",
                                    attention_dropout=0), world_size=2)
    assert (ulysses.cp_comm_type, ulysses.attention_backend) == ("a2a", "flash")
    for comm_type in ("p2p", "all_gather"):  # attention dropout in the blocks they compute
        dropped = parse_args(with_flags(BASE, context_parallel_size=2, cp_comm_type=comm_type, attention_dropout=0.1),
                             world_size=2)
        assert (dropped.cp_comm_type, dropped.attention_dropout) == (comm_type, 0.1)
    for comm_type, backend in (("p2p", "flash"), ("p2p", "unfused"), ("a2a+p2p", "unfused")):  # the ring's kernel
        sizes = dict(hierarchical_context_parallel_sizes=[1, 2]) if comm_type == "a2a+p2p" else {}
        ring = parse_args(with_flags(BASE, context_parallel_size=2, cp_comm_type=comm_type, attention_dropout=0,
                                     attention_backend=backend, **sizes), world_size=2)
        assert (ring.cp_comm_type, ring.attention_backend) == (comm_type, backend)
    hierarchical = parse_args(with_flags(BASE, context_parallel_size=4, cp_comm_type="a2a+p2p", attention_dropout=0.1,
                                         hierarchical_context_parallel_sizes=[2, 2]), world_size=4)
    assert (hierarchical.cp_comm_type, cp_a2a_size(hierarchical), cp_a2a_size(ulysses)) == ("a2a+p2p", 2, 0)


def test_hierarchical_groups_are_megatron_cores():
    """create_hierarchical_groups' levels for sizes [2, 4] of 8 ranks: pairs, then strided fours."""
    a2a, p2p = hierarchical_cp_ranks([10, 11, 12, 13, 14, 15, 16, 17], 2)
    assert a2a == [[10, 11], [12, 13], [14, 15], [16, 17]]
    assert p2p == [[10, 12, 14, 16], [11, 13, 15, 17]]


def test_layout_order_is_tp_cp_dp_pp():
    layout = Layout.from_world(16, tp=2, pp=2, cp=2)
    assert (layout.dp, layout.dp_cp, str(layout)) == (2, 4, "TP=2 x PP=2 x DP=2 x CP=2")
    for rank in range(16):
        pp, d, tp = layout.coords(rank)
        cp, dp = layout.cp_rank(rank), layout.data_parallel_rank(rank)
        assert rank == pp * 8 + dp * 4 + cp * 2 + tp  # Megatron-Core's tp-cp-dp-pp
        assert [layout.cp_rank(r) for r in layout.cp_group(rank)] == [0, 1]
        assert {layout.data_parallel_rank(r) for r in layout.cp_group(rank)} == {dp}
        assert sorted(layout.dp_group(rank)) == sorted(r for r in range(16) if layout.coords(r)[::2] == (pp, tp))
    assert Layout.from_world(4, tp=2) == Layout(tp=2, dp=2)  # CP 1: the layout it always was


@pytest.mark.parametrize("changes,world,words", [
    (dict(context_parallel_size=3), 4, ["world size 4", "--context-parallel-size 3"]),
    (dict(context_parallel_size=4, seq_length=36, max_position_embeddings=36), 4,
     ["--seq-length 36", "2 x --context-parallel-size 4"]),
    (dict(context_parallel_size=2, tensor_model_parallel_size=4, sequence_parallel=True, seq_length=20,
          max_position_embeddings=20, global_batch_size=2), 8,
     ["--sequence-parallel", "10 tokens", "--tensor-model-parallel-size 4"]),
    (dict(cp_comm_type="a2a+p4p"), 1, ["--cp-comm-type a2a+p4p", "p2p", "all_gather"]),
    (dict(context_parallel_size=4, cp_comm_type="a2a+p2p"), 4,
     ["--hierarchical-context-parallel-sizes A P", "--context-parallel-size 4"]),
    (dict(context_parallel_size=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 3]), 4,
     ["A x P = --context-parallel-size 4", "[2, 3]"]),
    (dict(context_parallel_size=4, tensor_model_parallel_size=2, cp_comm_type="a2a+p2p",
          hierarchical_context_parallel_sizes=[4, 1]), 8, ["2 attention heads", "all-to-all size 4"]),
    (dict(context_parallel_size=2, hierarchical_context_parallel_sizes=[2, 1]), 2,
     ["--hierarchical-context-parallel-sizes applies to --cp-comm-type a2a+p2p, not p2p"]),
    (dict(context_parallel_size=4, tensor_model_parallel_size=2, cp_comm_type="a2a"), 8,
     ["--cp-comm-type a2a", "2 attention heads", "--context-parallel-size 4"]),
    (dict(context_parallel_size=2, cp_comm_type="all_gather", attention_backend="flash"), 2,
     ["--attention-backend flash", "all_gather"]),
    (dict(context_parallel_size=2, attention_backend="fused"), 2, ["--attention-backend fused", "p2p"]),
    (dict(context_parallel_size=2, attention_backend="flash", attention_dropout=0.1), 2,
     ["--attention-backend flash with --attention-dropout", "auto"]),
    (dict(context_parallel_size=2, zero_hpz_partition_size=2), 4, ["--zero-hpz-partition-size"]),
])
def test_refusals_are_one_sentence(changes, world, words, capsys):
    changes = {"attention_dropout": 0, **changes}
    err = refused(with_flags(BASE, **changes), world, capsys)
    for word in words:
        assert word in err, (word, err)
