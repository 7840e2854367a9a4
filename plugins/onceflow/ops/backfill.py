"""`onceflow backfill`: re-run failed, superseded and abandoned transactions, in txid order.

Each is a DAG run with conf ``{"txid": N}`` (the same as the UI's trigger form), so begin
makes a new attempt of N and fences the old one. ``via="airflow"`` triggers runs for the
scheduler (`airflow dags trigger`); ``via="local"`` runs them here, one after the other, with
dag.test() (no scheduler needed).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from onceflow.core import txlog
from onceflow.core.errors import BookkeepingDamaged
from onceflow.core.txlog import TxRow
from onceflow.ops import bookkeeping


def open_transactions(conn, pipeline: str) -> list[TxRow]:
    """Failed, superseded and abandoned (run died) transactions, lowest txid first, with the
    last attempt's reason. A transaction whose commit left its marks is never one of them,
    whatever its state says (its commit record was changed by hand: running it again would
    count its batch twice; `onceflow repair` restores it)."""
    with conn.cursor() as cur:
        committed = {r.txid for r in bookkeeping.commit_marks(cur, pipeline)[0]}
        rows = [r for r in txlog.history(cur, pipeline, 10_000, open_only=True)
                if (r.state in txlog.ADOPTABLE or r.abandoned) and r.txid not in committed]
    conn.commit()
    return rows


def damaged(conn, pipeline: str) -> list[str]:
    """What is wrong with the pipeline's bookkeeping (onceflow.ops.bookkeeping), one line
    each; backfill re-runs nothing while there is something."""
    with conn.cursor() as cur:
        book = bookkeeping.check(cur, pipeline, ranges=False)
    conn.commit()
    return [p.line() for p in book.problems]


def describe(t: TxRow) -> str:
    state = "abandoned" if t.abandoned else t.state
    return (f"txid={t.txid} state={state} attempt={t.attempt} run={t.run_id or '-'} "
            f"reason={t.reason or '-'}")


# Starts the run of one txid (txid, its place in the backfill): returns (run id, state).
StartRun = Callable[[int, int], tuple[str, str]]


def backfill(conn, pipeline: str, start_run: StartRun, dry_run: bool
             ) -> list[tuple[int, str, str]]:
    """Returns (txid, run id, state) for every run made; prints as it goes. The runs are
    started by ``start_run`` (onceflow.airflow.backfill: queued for the scheduler, or run
    here with dag.test()). Damaged
    bookkeeping (a commit record changed by hand, offsets that disagree with the commit log)
    is printed and raises BookkeepingDamaged before anything is triggered, dry run or not."""
    todo = open_transactions(conn, pipeline)
    problems = damaged(conn, pipeline)
    if not todo:
        print(f"backfill {pipeline}: no failed, superseded or abandoned transactions")
    else:
        print(f"backfill {pipeline}: {len(todo)} transaction(s) to re-run, in txid order:")
    for t in todo:
        print("  " + describe(t))
    for problem in problems:
        print(f"  PROBLEM: {problem}")
    if problems:
        raise BookkeepingDamaged(
            f"pipeline {pipeline!r}: the bookkeeping is damaged ({len(problems)} problem(s) "
            f"above): nothing triggered; `onceflow repair --pipeline {pipeline}` says what it "
            "fixes, then backfill again")
    if not todo:
        return []
    if dry_run:
        print("dry run: nothing triggered")
        return []
    done = []
    for i, t in enumerate(todo):
        started = time.monotonic()
        run_id, state = start_run(t.txid, i)
        print(f"  txid {t.txid}: run {run_id} {state} ({time.monotonic() - started:.1f}s)")
        done.append((t.txid, run_id, state))
    return done
