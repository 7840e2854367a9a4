"""Batch planning, table-driven."""

from __future__ import annotations

import pytest

from onceflow.core.planner import PartitionRange, plan_ranges

CASES = [
    # (starts, heads, batch_size, groups, expected [(partition, start, end, group)])
    # everything fits: take all that is new
    ({0: 0, 1: 0}, {0: 5, 1: 3}, 100, 1, [(0, 0, 5, 0), (1, 0, 3, 0)]),
    # an empty partition costs nothing and is left out
    ({0: 10, 1: 0}, {0: 10, 1: 4}, 100, 1, [(1, 0, 4, 0)]),
    # nothing new anywhere: an empty plan
    ({0: 7}, {0: 7}, 100, 1, []),
    # the cap is shared fairly: the quiet partition keeps all of its 2
    ({0: 0, 1: 0, 2: 0}, {0: 100, 1: 2, 2: 100}, 10, 1, [(0, 0, 4, 0), (1, 0, 2, 0),
                                                         (2, 0, 4, 0)]),
    # the remainder goes one each to the lowest partitions
    ({0: 0, 1: 0, 2: 0}, {0: 10, 1: 10, 2: 10}, 7, 1, [(0, 0, 3, 0), (1, 0, 2, 0),
                                                        (2, 0, 2, 0)]),
    # ranges start where the previous batch ended
    ({0: 40, 1: 17}, {0: 50, 1: 20}, 100, 1, [(0, 40, 50, 0), (1, 17, 20, 0)]),
    # groups: partition p goes to group p % groups
    ({0: 0, 1: 0, 2: 0}, {0: 1, 1: 1, 2: 1}, 10, 2, [(0, 0, 1, 0), (1, 0, 1, 1), (2, 0, 1, 0)]),
    # a partition missing from heads (just created) has nothing to read
    ({0: 0, 1: 0}, {0: 3}, 10, 1, [(0, 0, 3, 0)]),
]


@pytest.mark.parametrize("starts, heads, batch_size, groups, expected", CASES)
def test_plan_ranges(starts, heads, batch_size, groups, expected):
    """Table above."""
    plan = plan_ranges(starts, heads, batch_size, groups)
    assert [(r.partition, r.start, r.end, g) for r, g in plan] == expected
    assert sum(r.size for r, _ in plan) <= batch_size


# (starts, heads, batch_size, max_per_partition, keep, expected [(partition, start, end)])
CAP_CASES = [
    # the per-partition cap applies before the batch cap
    ({0: 0, 1: 0}, {0: 100, 1: 100}, 1000, 30, set(), [(0, 0, 30), (1, 0, 30)]),
    # both caps: 25 each would fit the per-partition cap of 30, the batch cap decides
    ({0: 0, 1: 0}, {0: 100, 1: 100}, 50, 30, set(), [(0, 0, 25), (1, 0, 25)]),
    # a kept partition stays in the plan although empty (its start was just decided)
    ({0: 5, 1: 9}, {0: 5, 1: 12}, 100, None, {0}, [(0, 5, 5), (1, 9, 12)]),
]


@pytest.mark.parametrize("starts, heads, batch_size, per_partition, keep, expected", CAP_CASES)
def test_plan_caps_and_kept_partitions(starts, heads, batch_size, per_partition, keep,
                                       expected):
    plan = plan_ranges(starts, heads, batch_size, max_per_partition=per_partition,
                       keep=frozenset(keep))
    assert [(r.partition, r.start, r.end) for r, _ in plan] == expected


def test_plan_never_exceeds_the_cap_and_never_leaves_records_behind_needlessly():
    import random

    rng = random.Random(3)
    for _ in range(500):
        n = rng.randrange(1, 8)
        starts = {p: rng.randrange(0, 50) for p in range(n)}
        heads = {p: starts[p] + rng.randrange(0, 60) for p in range(n)}
        cap = rng.randrange(1, 200)
        plan = plan_ranges(starts, heads, cap)
        total = sum(r.size for r, _ in plan)
        available = sum(heads[p] - starts[p] for p in range(n))
        assert total == min(cap, available)
        assert all(isinstance(r, PartitionRange) and r.start == starts[r.partition]
                   and r.end <= heads[r.partition] for r, _ in plan)


def test_plan_rejects_a_non_positive_cap():
    with pytest.raises(ValueError, match="batch_size=0"):
        plan_ranges({0: 0}, {0: 1}, 0)
