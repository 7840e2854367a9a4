"""`onceflow backfill`: re-run failed, superseded and abandoned transactions, in txid order.

Each is a DAG run with conf ``{"txid": N}`` (the same as the UI's trigger form), so begin
makes a new attempt of N and fences the old one. ``via="airflow"`` triggers runs for the
scheduler (`airflow dags trigger`); ``via="local"`` runs them here, one after the other, with
dag.test() (no scheduler needed).
"""

from __future__ import annotations

import json
import subprocess
import time
from datetime import UTC, datetime, timedelta

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


def trigger_airflow(dag_id: str, txid: int) -> str:
    """Queue a run for the scheduler. Returns its run id."""
    run_id = f"onceflow_backfill__txid_{txid}__{datetime.now(UTC):%Y%m%dT%H%M%S%f}"
    from onceflow.airflow import airflow_cli

    subprocess.run(
        airflow_cli("dags", "trigger", dag_id, "--run-id", run_id,
                    "--conf", json.dumps({"txid": txid})),
        check=True, stdout=subprocess.DEVNULL,
    )
    return run_id


def run_local(dag, txid: int, offset_s: int) -> tuple[str, str]:
    """Run the DAG here with dag.test(). Returns (run id, state)."""
    logical_date = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=offset_s)
    dr = dag.test(logical_date=logical_date, run_conf={"txid": txid})
    return dr.run_id, str(dr.state)


def describe(t: TxRow) -> str:
    state = "abandoned" if t.abandoned else t.state
    return (f"txid={t.txid} state={state} attempt={t.attempt} run={t.run_id or '-'} "
            f"reason={t.reason or '-'}")


def backfill(conn, pipeline: str, dag_id: str, via: str, dry_run: bool,
             load_dag=None) -> list[tuple[int, str, str]]:
    """Returns (txid, run id, state) for every run made; prints as it goes. Damaged
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
    dag = load_dag() if via == "local" else None
    for i, t in enumerate(todo):
        started = time.monotonic()
        if via == "airflow":
            run_id, state = trigger_airflow(dag_id, t.txid), "queued"
        else:
            run_id, state = run_local(dag, t.txid, i)
        print(f"  txid {t.txid}: run {run_id} {state} ({time.monotonic() - started:.1f}s)")
        done.append((t.txid, run_id, state))
    return done
