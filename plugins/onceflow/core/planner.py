"""Batch planning: which [start, end) offsets of each partition one transaction reads."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PartitionRange:
    partition: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def plan_ranges(starts: dict[int, int], heads: dict[int, int], batch_size: int,
                groups: int = 1, *, max_per_partition: int | None = None,
                keep: frozenset[int] = frozenset()) -> list[tuple[PartitionRange, int]]:
    """Plan one batch: per partition ``[start, min(head, start + share))`` and its group.

    The batch takes at most ``batch_size`` records in all, shared fairly: a water level ``L``
    such that every partition contributes ``min(available, L)`` (the largest level that fits),
    and what is left of the cap goes one record each to the lowest-numbered partitions that
    still have more. So a busy partition cannot starve a quiet one, and the result depends only
    on the inputs. Partitions with nothing new are left out: they cost nothing.

    ``max_per_partition`` caps each partition first. Partitions in ``keep`` stay in the plan
    even when empty (a start chosen by policy must be stored, or the next plan would choose
    again and skip what arrived meanwhile). Groups: partition p goes to group ``p % groups``.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size={batch_size!r}: must be positive")
    cap = max_per_partition if max_per_partition is not None else batch_size
    available = {p: min(cap, max(0, heads.get(p, starts[p]) - starts[p])) for p in sorted(starts)}
    take = dict(available)
    if sum(available.values()) > batch_size:
        lo, hi = 0, max(available.values())
        while lo < hi:  # largest level whose total fits in the cap
            mid = (lo + hi + 1) // 2
            if sum(min(a, mid) for a in available.values()) <= batch_size:
                lo = mid
            else:
                hi = mid - 1
        take = {p: min(a, lo) for p, a in available.items()}
        left = batch_size - sum(take.values())
        for p, a in available.items():
            if left == 0:
                break
            if a > take[p]:
                take[p] += 1
                left -= 1
    return [
        (PartitionRange(p, starts[p], starts[p] + n), p % groups)
        for p, n in take.items()
        if n > 0 or p in keep
    ]


def align_to_units(plan: list[tuple[PartitionRange, int]], units: dict[int, tuple[int, int]],
                   heads: dict[int, int], batch_size: int, *,
                   max_per_partition: int | None = None, keep: frozenset[int] = frozenset(),
                   protected: frozenset[int] = frozenset()
                   ) -> list[tuple[PartitionRange, int]]:
    """``plan`` (plan_ranges') with its ranges' ends moved to the edges of the read units
    they cut: ``units`` maps a partition to the unit ``[lo, hi)`` that holds its range's end,
    for a source whose units are read whole (a Parquet row group), which a cut unit makes
    two batches read.

    A range that holds whole units before the cut one ends before it. A range that lies
    inside its first unit takes the unit whole when the batch has room, the partitions with
    most left to read first; else it waits for a later batch, unless its unit is larger than
    a batch or the partition is ``protected`` (it had no records in the previous batch:
    so no partition waits twice in a row), then it stays as planned. The records a cut frees
    extend the other cut ranges to their units' ends, while the batch stays within
    ``batch_size`` and ``max_per_partition``. A partition left with nothing stays in the
    plan only when ``keep`` holds it.
    """
    cap = max_per_partition if max_per_partition is not None else batch_size
    ends = {r.partition: r.end for r, _ in plan}
    starts = {r.partition: r.start for r, _ in plan}
    first, later = [], []  # cut inside its first unit / after whole units
    for p, (lo, hi) in sorted(units.items()):
        if p not in ends or not lo < ends[p] < hi:
            continue
        hi = min(hi, heads.get(p, hi))
        if lo > starts[p]:
            ends[p] = lo
            later.append((p, hi))
        elif hi - starts[p] <= min(cap, batch_size):
            first.append((p, hi))
    if not first and not later:
        return plan

    def most_left(item):
        p, _ = item
        return (p not in protected, ends[p] - heads.get(p, ends[p]), p)

    first.sort(key=most_left)
    planned = {p: ends[p] for p, _ in first}
    for p, _ in first:
        ends[p] = starts[p]
    for p, hi in first:  # room: the batch less what is kept and what protected ones hold
        held = sum(ends[q] - starts[q] for q in ends) + sum(
            planned[q] - starts[q] for q, _ in first if q in protected and ends[q] == starts[q]
            and q != p)
        if hi - starts[p] <= batch_size - held:
            ends[p] = hi
        elif p in protected:
            ends[p] = planned[p]
    for p, hi in sorted(later, key=most_left):
        if hi - ends[p] <= batch_size - sum(ends[q] - starts[q] for q in ends) and \
                hi - starts[p] <= cap:
            ends[p] = hi
    if all(ends[p] == starts[p] for p in ends):
        return plan
    return [(PartitionRange(r.partition, r.start, ends[r.partition]), g) for r, g in plan
            if ends[r.partition] > r.start or r.partition in keep]
