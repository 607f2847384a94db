import pytest

from megatron_zero.pipeline.partition import (PartitionError, block_counts, parse_partition_flag,
                                              stage_layer_ranges)


def test_uniform_covers_all_layers_contiguously():
    for blocks in range(4, 12):
        for pp in (1, 2, 3, 4):
            ranges = stage_layer_ranges(blocks, pp)
            assert ranges[0][0] == 0 and ranges[-1][1] == blocks + 4
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            counts = block_counts(blocks, pp)
            assert max(counts) - min(counts) <= 1 and sum(counts) == blocks


def test_uneven_extra_layers_go_first():
    assert block_counts(7, 3) == [3, 2, 2]
    # stage 0: cast, embed, blocks 0-2 (layers 2..4); stage 2 ends with final norm and head.
    assert stage_layer_ranges(7, 3) == [(0, 5), (5, 7), (7, 11)]


def test_parameter_balance_moves_blocks_off_the_embedding_stage():
    counts = block_counts(8, 2, method="parameters", block_params=100, embedding_params=400, final_params=0)
    assert counts == [2, 6]  # 500+100 | 6x100


def test_explicit_partition_and_refusals():
    assert block_counts(6, 2, explicit=[1, 5]) == [1, 5]
    with pytest.raises(PartitionError, match=r"\[2, 2\] must list 2 positive layer counts summing to 6"):
        block_counts(6, 2, explicit=[2, 2])
    with pytest.raises(PartitionError, match="3 transformer layers cannot fill 4 pipeline stages"):
        stage_layer_ranges(3, 4)
    with pytest.raises(PartitionError, match="--pipeline-partition"):
        parse_partition_flag("3;5")
    assert parse_partition_flag("3,5") == [3, 5]
