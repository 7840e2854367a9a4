"""Freshness: how long a record waits from its arrival in the source to its commit, and how far
the pipeline trails its source now (lag, in records and in seconds).

Each transaction records when the oldest and the newest record of its batch arrived
(``transactions.first_arrival`` / ``last_arrival``, written by begin from the source's
``arrivals``: the PostgreSQL log's ``produced_at``, a segment's index time, a landed file's
modification time, a table's ``time_column`` or when its head was first seen). A record of it
waited from its arrival to the transaction's ``committed_at``: the newest record the least,
the oldest the most. ``measure`` gives the median and 95th percentile over the records of the
last ``last`` committed transactions, taking each batch's records as arriving evenly between
its oldest and its newest (exact at both ends), and the longest wait. Replayed records count
with their batch's first arrival or not at all: a batch of replays only has no arrival.

Lag: the records of the source past the committed offsets (``lag_records``), and how long
the oldest of them has waited (``lag_s``, 0 when none waits; None when its arrival is not
known).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from onceflow.core import offsets
from onceflow.core.source import Position

LAST = 100  # transactions looked at by default


@dataclass(frozen=True)
class Freshness:
    transactions: int  # committed transactions looked at (those with known arrivals)
    records: int  # their records
    p50_s: float | None  # median delay from arrival to commit, over those records
    p95_s: float | None
    max_s: float | None  # the longest any of them waited (the oldest record of a batch)
    lag_records: int  # records of the source past the committed offsets
    lag_s: float | None  # how long the oldest of them has waited (0: none waits)
    last: int = LAST  # how many transactions at most were looked at

    def as_dict(self) -> dict[str, Any]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}

    def line(self) -> str:
        """One line for `onceflow status`."""
        if self.transactions:
            fresh = (f"freshness p50 {self.p50_s:.1f}s, p95 {self.p95_s:.1f}s, max "
                     f"{self.max_s:.1f}s (arrival to commit, {self.records:,} records of the "
                     f"last {self.transactions} transaction(s))")
        else:
            fresh = "freshness: no committed transaction with known arrivals yet"
        lag = "-" if self.lag_s is None else f"{self.lag_s:.1f}s"
        return f"{fresh}; lag {self.lag_records:,} records, {lag}"


def weighted_quantile(spans: list[tuple[float, float, int]], q: float) -> float | None:
    """The ``q`` quantile of records spread evenly over spans ``(low, high, records)``."""
    spans = [(lo, max(lo, hi), n) for lo, hi, n in spans if n > 0]
    total = sum(n for _, _, n in spans)
    if not total:
        return None

    def share_below(x: float) -> float:
        below = 0.0
        for lo, hi, n in spans:
            if x >= hi:
                below += n
            elif x > lo:
                below += n * (x - lo) / (hi - lo)
        return below / total

    low, high = min(lo for lo, _, _ in spans), max(hi for _, hi, _ in spans)
    for _ in range(60):
        mid = (low + high) / 2
        if share_below(mid) >= q:
            high = mid
        else:
            low = mid
    return high


def of_transactions(cur, pipeline: str, last: int = LAST) -> list[tuple[float, float, int]]:
    """(newest record's wait, oldest record's wait, records) of the last ``last`` committed
    transactions with known arrivals, in seconds."""
    cur.execute(
        """SELECT EXTRACT(EPOCH FROM committed_at - last_arrival),
                  EXTRACT(EPOCH FROM committed_at - first_arrival), records
           FROM transactions
           WHERE pipeline = %s AND state = 'committed' AND records > 0
             AND first_arrival IS NOT NULL AND committed_at IS NOT NULL
           ORDER BY txid DESC LIMIT %s""", (pipeline, last))
    # a commit record without its time (changed by hand) has no wait to measure
    return [(float(lo), float(hi), int(n)) for lo, hi, n in cur.fetchall()
            if lo is not None and hi is not None]


def of_txid(cur, pipeline: str, txid: int) -> tuple[float, float] | None:
    """(newest record's wait, oldest record's wait) of a committed ``txid``, in seconds."""
    cur.execute(
        """SELECT EXTRACT(EPOCH FROM committed_at - last_arrival),
                  EXTRACT(EPOCH FROM committed_at - first_arrival)
           FROM transactions WHERE pipeline = %s AND txid = %s AND committed_at IS NOT NULL
             AND first_arrival IS NOT NULL""", (pipeline, txid))
    row = cur.fetchone()
    return (float(row[0]), float(row[1])) if row else None


def by_txid(cur, pipeline: str, txids: list[int]) -> dict[int, tuple[float, float]]:
    """``of_txid`` of several committed txids at once (those with known arrivals)."""
    cur.execute(
        """SELECT txid, EXTRACT(EPOCH FROM committed_at - last_arrival),
                  EXTRACT(EPOCH FROM committed_at - first_arrival)
           FROM transactions WHERE pipeline = %s AND txid = ANY(%s)
             AND committed_at IS NOT NULL AND first_arrival IS NOT NULL""",
        (pipeline, list(txids)))
    return {txid: (float(lo), float(hi)) for txid, lo, hi in cur.fetchall()}


def lag(cur, pipeline: str, source, positions: Mapping[int, Position] | None = None,
        committed: Mapping[int, int] | None = None) -> tuple[int, float | None]:
    """(records past the committed offsets, seconds the oldest of them has waited).
    ``positions``: the source's, if the caller has them (else its cheap ``heads``, with what
    a landing folder has not indexed yet). ``committed``: the committed offsets to count
    from, if the caller has them (status: the commit log's where partition_offsets lost
    them), else partition_offsets."""
    unindexed, oldest_unindexed = (0, None) if positions is not None else source.unindexed(cur)
    positions = source.heads(cur) if positions is None else positions
    committed = offsets.committed(cur, pipeline) if committed is None else committed
    records, points = unindexed, []
    for partition, position in positions.items():
        done = max(committed.get(partition, position.log_start), position.log_start)
        if position.head > done:
            records += position.head - done
            points.append((partition, done))
    arrived = list(source.arrivals(cur, points).values()) if points else []
    if oldest_unindexed is not None:
        arrived.append(oldest_unindexed)
    if not records:
        return 0, 0.0
    if not arrived:
        return records, None
    cur.execute("SELECT EXTRACT(EPOCH FROM now() - %s::timestamptz)", (min(arrived),))
    return records, max(0.0, float(cur.fetchone()[0]))


def measure(cur, pipeline: str, source, positions: Mapping[int, Position] | None = None,
            last: int = LAST, committed: Mapping[int, int] | None = None) -> Freshness:
    """The pipeline's freshness over its last ``last`` committed transactions, and its lag
    now (see the module docstring; ``positions``, ``committed``: as ``lag`` takes them)."""
    spans = of_transactions(cur, pipeline, last)
    lag_records, lag_s = lag(cur, pipeline, source, positions, committed)
    return Freshness(len(spans), sum(n for _, _, n in spans),
                     weighted_quantile(spans, 0.5), weighted_quantile(spans, 0.95),
                     max((hi for _, hi, _ in spans), default=None), lag_records, lag_s, last)
