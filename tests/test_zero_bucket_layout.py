"""ZeRO 0-2 gradient bucket layouts (zero/partition.py, pure functions): every gradient element of a group
lands in exactly one place of exactly one bucket's rows, the row of the rank that owns it, at its offset
in that rank's partition; stage 0/1's buckets have rows of equal width (the reduce-scatter input as it
lies, its rows covering the partition once); stage 2's are consecutive parameters, last first, with the
`alone` ones in buckets of their own."""
import pytest

from megatron_zero.zero.partition import contiguous_buckets, partition_group, strided_buckets

NUMELS = [7, 130, 1, 64, 300, 5, 33]


def placed(part, buckets):
    """flat index -> (bucket, row, offset in row) for every element the buckets place."""
    where = {}
    for k, b in enumerate(buckets):
        for i, a, o, n in b.pieces:
            for e in range(n):
                flat = part.offsets[i] + a + e
                assert flat not in where, flat
                where[flat] = (k, (o + e) // b.width, (o + e) % b.width)
    return where


def check_rows(part, buckets, where):
    for flat, (k, r, col) in where.items():
        b = buckets[k]
        assert r == flat // part.partition_size  # the owner's row
        assert b.lo[r] + col == flat % part.partition_size < b.hi[r]  # at its offset in the partition
    assert sorted(where) == list(range(part.numel))  # every element once


@pytest.mark.parametrize("dp,bucket", [(1, 100), (2, 100), (3, 64), (4, 1000), (2, 1)])
def test_strided_buckets(dp, bucket):
    part = partition_group([(f"p{i}", n) for i, n in enumerate(NUMELS)], dp)
    buckets = strided_buckets(part, bucket)
    check_rows(part, buckets, placed(part, buckets))
    starts = 0
    for b in buckets:  # bucket after bucket, the rows of equal width tile every partition once
        assert len(set(b.lo)) == 1 and all(h - lo == b.width for lo, h in zip(b.lo, b.hi))
        assert b.lo[0] == starts
        starts += b.width
    assert starts == part.partition_size


@pytest.mark.parametrize("dp,bucket,alone", [(1, 100, ()), (2, 100, (0,)), (3, 64, (3,)), (2, 1, ()),
                                             (4, 10_000, (0, 6))])
def test_contiguous_buckets(dp, bucket, alone):
    part = partition_group([(f"p{i}", n) for i, n in enumerate(NUMELS)], dp)
    buckets = contiguous_buckets(part, bucket, alone)
    check_rows(part, buckets, placed(part, buckets))
    order = [b.params for b in buckets]
    assert [i for ps in order for i in reversed(ps)] == list(reversed(range(len(NUMELS))))  # last first
    for ps in order:
        assert not set(ps) & set(alone) or len(ps) == 1
        assert sum(NUMELS[i] for i in ps) < bucket + max(NUMELS[i] for i in ps)  # closed once full
