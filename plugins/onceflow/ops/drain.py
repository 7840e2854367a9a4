"""A kept-up pipeline draining a backlog, measured from its transactions' own timestamps
(planned_at to committed_at): how many were in flight on average, and whether each commit
was followed by a plan while records over ``min_records`` waited: how well keep-up kept a
pipeline busy (bench/bench_keepup_drain.py, tests/test_keepup_airflow.py).

A transaction's planned_at is written once its begin has indexed and planned the batch; the
begin records those seconds (transaction_attempts.begin_index_s, begin_plan_s), so when the
records were taken up is planned_at less them (its wait for the coordinator's lock counts as
waiting). Both waits are given: to the plan taken up, and to the plan written."""

from __future__ import annotations

from typing import Any

# (txid, records, planned_at, committed_at, taken_up): seconds since the epoch; taken_up is
# planned_at less the begin's indexing and planning
Span = tuple[int, int, float, float, float]

QUERY = """SELECT t.txid, t.records, extract(epoch FROM t.planned_at),
                  extract(epoch FROM t.committed_at),
                  coalesce(a.begin_index_s, 0) + coalesce(a.begin_plan_s, 0)
           FROM transactions t
           LEFT JOIN transaction_attempts a
             ON a.pipeline = t.pipeline AND a.txid = t.txid AND a.attempt = 1
           WHERE t.pipeline = %s AND t.txid > %s ORDER BY t.txid"""


def spans(cur, pipeline: str, after: int = 0) -> list[Span]:
    """The transactions of ``pipeline`` past txid ``after``, every one committed."""
    cur.execute(QUERY, (pipeline, after))
    rows = cur.fetchall()
    open_ = [t for t, _, _, committed, _ in rows if committed is None]
    if open_:
        raise ValueError(f"txids {open_} are not committed: the drain is not over")
    return [(int(t), int(n), float(p), float(c), float(p) - float(work))
            for t, n, p, c, work in rows]


def in_flight(done: list[Span], start: float, end: float) -> float:
    """The transactions open on average between ``start`` and ``end``; when they are one
    instant (a drain planned at once), the transactions open at it."""
    if end <= start:
        return float(sum(1 for _, _, planned, committed, _ in done
                         if planned <= start < committed))
    open_s = sum(max(0.0, min(end, committed) - max(start, planned))
                 for _, _, planned, committed, _ in done)
    return open_s / (end - start)


def after_commits(done: list[Span], min_records: int) -> list[tuple[int, int, float, float]]:
    """Per commit after which ``min_records`` or more records of the drain waited unplanned:
    (txid, the records waiting, seconds to the next plan taken up, to it written)."""
    records = sum(n for _, n, _, _, _ in done)
    out = []
    for txid, _, _, committed, _ in done:
        waiting = records - sum(n for _, n, planned, _, _ in done if planned <= committed)
        later = sorted((planned, taken) for _, _, planned, _, taken in done
                       if planned > committed)
        if waiting >= min_records and later:
            planned, taken = later[0]
            out.append((txid, waiting, round(max(0.0, taken - committed), 2),
                        round(planned - committed, 2)))
    return out


def figures(done: list[Span], min_records: int, watch_interval: float) -> dict[str, Any]:
    """A drain's figures: transactions in flight on average while records waited (from the
    first plan to the last) and over the whole drain (to the last commit); the longest wait
    from a commit to the next plan (taken up; written) while records over ``min_records``
    waited, and the commits after which it was taken up later than ``watch_interval``."""
    first = min(planned for _, _, planned, _, _ in done)
    last_plan = max(planned for _, _, planned, _, _ in done)
    last_commit = max(committed for _, _, _, committed, _ in done)
    waits = after_commits(done, min_records)
    return {"transactions": len(done), "records": sum(n for _, n, _, _, _ in done),
            "seconds": round(last_commit - first, 1),
            "in_flight_waiting": round(in_flight(done, first, last_plan), 2),
            "in_flight_drain": round(in_flight(done, first, last_commit), 2),
            "commit_to_plan_max_s": max((w[2] for w in waits), default=None),
            "commit_to_plan_written_max_s": max((w[3] for w in waits), default=None),
            "after_commits": waits,
            "slow_after_commit": [w for w in waits if w[2] > watch_interval]}
