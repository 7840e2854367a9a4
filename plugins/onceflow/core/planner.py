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
