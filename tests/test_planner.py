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


# align_to_units: (plan [(partition, start, end)], units {p: (lo, hi)}, heads, batch_size,
#                  max_per_partition, keep, protected, expected [(partition, start, end)])
ALIGN = [
    # two partitions cut inside one-unit files: the one with most left takes its unit whole
    ([(0, 0, 500), (1, 0, 500)], {0: (0, 1000), 1: (0, 1000)}, {0: 3000, 1: 2000}, 1000,
     None, frozenset(), frozenset(), [(0, 0, 1000)]),
    # ... unless the other waited in the previous batch: then it goes first
    ([(0, 0, 500), (1, 0, 500)], {0: (0, 1000), 1: (0, 1000)}, {0: 3000, 1: 2000}, 1000,
     None, frozenset(), frozenset({1}), [(1, 0, 1000)]),
    # the rest of a unit an earlier batch cut is taken whole
    ([(0, 500, 1200), (1, 500, 800)], {0: (1000, 2000), 1: (0, 1000)},
     {0: 3000, 1: 2000}, 1000, None, frozenset(), frozenset(),
     [(0, 500, 1000), (1, 500, 1000)]),
    # a range holding whole units ends before the cut one; the freed records extend another
    ([(0, 0, 150), (1, 0, 50)], {0: (100, 200), 1: (0, 100)}, {0: 1000, 1: 100}, 200,
     None, frozenset(), frozenset(), [(0, 0, 100), (1, 0, 100)]),
    # units larger than a batch: nothing whole fits, the plan stays
    ([(0, 0, 500), (1, 0, 500)], {0: (0, 5000), 1: (0, 5000)}, {0: 5000, 1: 5000}, 1000,
     None, frozenset(), frozenset(), [(0, 0, 500), (1, 0, 500)]),
    # a protected partition that cannot take its unit whole stays as planned
    ([(0, 0, 500), (1, 0, 500)], {0: (0, 1000), 1: (0, 1000)}, {0: 3000, 1: 2000}, 1000,
     None, frozenset(), frozenset({0, 1}), [(0, 0, 500), (1, 0, 500)]),
    # max_per_partition bounds a unit taken whole
    ([(0, 0, 300), (1, 0, 300)], {0: (0, 500), 1: (0, 500)}, {0: 3000, 1: 3000}, 1000,
     400, frozenset(), frozenset(), [(0, 0, 300), (1, 0, 300)]),
    # a unit ends at the partition's head at most; a partition left empty stays when kept
    ([(0, 0, 500), (1, 0, 500)], {0: (0, 1000), 1: (0, 1000)}, {0: 800, 1: 900}, 1000,
     None, frozenset({0}), frozenset(), [(0, 0, 0), (1, 0, 900)]),
]


@pytest.mark.parametrize("plan, units, heads, batch_size, cap, keep, protected, expected",
                         ALIGN)
def test_align_to_units(plan, units, heads, batch_size, cap, keep, protected, expected):
    """Table above."""
    from onceflow.core.planner import align_to_units

    aligned = align_to_units([(PartitionRange(p, s, e), p % 2) for p, s, e in plan], units,
                             heads, batch_size, max_per_partition=cap, keep=keep,
                             protected=protected)
    assert [(r.partition, r.start, r.end) for r, _ in aligned] == expected
    assert all(g == r.partition % 2 for r, g in aligned)
    assert sum(r.size for r, _ in aligned) <= batch_size


def test_aligned_batches_read_each_unit_once_and_no_partition_waits_twice():
    """Batch after batch over two partitions of one-unit files, as begin plans them: every
    unit is read by one batch, and a partition never sits out two batches in a row."""
    from onceflow.core.planner import align_to_units

    unit = 1000
    heads = {0: 3 * unit, 1: 2 * unit}
    starts, previous, batches = {0: 0, 1: 0}, None, []
    while any(starts[p] < heads[p] for p in heads):
        plan = plan_ranges(starts, heads, unit)
        units = {r.partition: (r.end // unit * unit, r.end // unit * unit + unit)
                 for r, _ in plan if r.end % unit and r.end < heads[r.partition]}
        protected = frozenset() if previous is None else frozenset(
            p for p in units if p not in previous)
        plan = align_to_units(plan, units, heads, unit, protected=protected)
        batches.append({r.partition: (r.start, r.end) for r, _ in plan if r.size})
        previous = set(batches[-1])
        for r, _ in plan:
            starts[r.partition] = r.end
    assert batches == [{0: (0, 1000)}, {1: (0, 1000)}, {0: (1000, 2000)}, {1: (1000, 2000)},
                       {0: (2000, 3000)}]
