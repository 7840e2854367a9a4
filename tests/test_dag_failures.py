"""Transactions under failure on real Airflow: whole DAG runs, several at once in separate
processes (dag.test() cannot run from threads), each with its own logical date."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from helpers import table, tweets_pipeline
from onceflow.coordinator import begin
from onceflow.verify import verify

RUNNER = Path(__file__).with_name("dag_runner.py")
_dates = iter(range(1, 10_000))


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setenv("ONCEFLOW_RETRY_DELAY_SECONDS", "1")


def logical_date() -> datetime:
    base = datetime.now(UTC).replace(microsecond=0)
    return base + timedelta(seconds=next(_dates))


def start_run(conf: dict | None = None, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(RUNNER), logical_date().isoformat(), json.dumps(conf or {})],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **(env or {})},
    )


def finish(proc: subprocess.Popen, timeout: float = 300) -> dict:
    out, _ = proc.communicate(timeout=timeout)
    last = out.strip().splitlines()[-1] if out.strip() else ""
    try:
        return json.loads(last) | {"log": out}
    except json.JSONDecodeError:
        raise AssertionError(f"the DAG run printed no result:\n{out[-4000:]}") from None


def wait_for(conn, query: str, expected, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if table(conn, query) == expected:
            return
        time.sleep(0.5)
    raise AssertionError(f"{query} never returned {expected}: {table(conn, query)}")


@pytest.mark.timeout(300)
def test_groups_retry_alone_and_a_crash_after_the_commit_is_a_no_op_on_retry(
        dsn, conn, airflow_db):
    """Two processing groups (mapped tasks); group 1 fails once and is retried alone; the
    commit crashes after PostgreSQL committed, before Airflow records success: its retry is a
    logged no-op."""
    pipeline = tweets_pipeline(conn, events=500, batch_size=500)
    result = finish(start_run(
        {"groups": 2},
        env={"ONCEFLOW_INJECT_FAULTS": "process.before.group1:1:1,commit.after:1:1"}))
    assert result["state"] == "success", result["log"][-3000:]
    assert result["tries"] == {"begin[-1]": 1, "process[0]": 1, "process[1]": 2,
                               "commit[-1]": 2}
    assert "injected fault commit.after for txid 1 (try 1)" in result["log"]
    assert "already committed, nothing to do" in result["log"]
    assert table(conn, "SELECT groups FROM transactions") == [(2,)]
    assert table(conn, "SELECT txid, attempt, outcome FROM transaction_attempts") == [
        (1, 1, "committed")]
    assert verify(conn, pipeline).ok


@pytest.mark.timeout(300)
def test_two_runs_racing_for_one_txid_commit_it_once(dsn, conn, airflow_db):
    pipeline = tweets_pipeline(conn, events=600, batch_size=600)
    begin(conn, pipeline, "setup")  # txid 1 exists; both runs ask for it
    runs = [start_run({"txid": 1}), start_run({"txid": 1})]
    results = [finish(r) for r in runs]
    assert "success" in [r["state"] for r in results]
    attempts = table(conn, """SELECT attempt, outcome FROM transaction_attempts
                              WHERE txid = 1 ORDER BY attempt""")
    assert [a for a, _ in attempts] == [1, 2, 3]
    assert [o for _, o in attempts].count("committed") == 1, attempts
    loser = [r for r in results if r["state"] != "success"]
    for run in loser:  # refused at process or commit: fenced, never counted
        assert "fenced" in run["log"], run["log"][-3000:]
    assert table(conn, "SELECT state FROM transactions") == [("committed",)]
    assert verify(conn, pipeline).ok


@pytest.mark.timeout(420)
def test_commit_of_n_plus_1_waits_while_n_fails_and_is_backfilled(dsn, conn, airflow_db):
    pipeline = tweets_pipeline(conn, events=900, batch_size=400)
    # txid 1's process fails on every try; slow retries keep it in flight meanwhile
    failing = start_run(env={"ONCEFLOW_INJECT_FAULTS": "process.before:1",
                             "ONCEFLOW_RETRY_DELAY_SECONDS": "8"})
    wait_for(conn, "SELECT count(*) FROM transactions", [(1,)])
    waiting = start_run()  # txid 2: processes, then its commit waits for txid 1
    wait_for(conn, "SELECT count(*) FROM transactions", [(2,)])
    failed = finish(failing)
    assert failed["state"] == "failed"
    assert table(conn, "SELECT state FROM transactions WHERE txid = 1") == [("failed",)]
    # txid 2 is processed and its commit is waiting (deferred) for txid 1
    wait_for(conn, """SELECT commit_requested_at IS NOT NULL FROM transactions
                      WHERE txid = 2""", [(True,)])
    assert waiting.poll() is None, "txid 2 must still be waiting for txid 1"
    assert table(conn, "SELECT last_committed_txid FROM pipelines") == [(0,)]

    backfill = finish(start_run())  # adopts txid 1 (attempt 2) and commits it
    assert backfill["state"] == "success", backfill["log"][-3000:]
    done = finish(waiting)
    assert done["state"] == "success", done["log"][-3000:]
    assert "waits for txid 1" in done["log"]
    assert table(conn, """SELECT txid, attempt FROM transactions
                          WHERE state = 'committed' ORDER BY committed_at""") == [(1, 2), (2, 1)]
    assert verify(conn, pipeline).ok


@pytest.mark.timeout(420)
def test_max_pending_is_honoured_with_five_runs_at_once(dsn, conn, airflow_db):
    pipeline = tweets_pipeline(conn, events=5000, batch_size=500)  # max_pending 3
    results = [finish(r) for r in [start_run() for _ in range(5)]]
    skipped = [r for r in results if r["tasks"].get("begin[-1]") == "skipped"]
    assert all(r["state"] == "success" for r in results), [r["tasks"] for r in results]
    planned = table(conn, "SELECT count(*) FROM transactions")[0][0]
    assert planned + len(skipped) == 5 and skipped
    for run in skipped:
        assert "max_pending=3 reached" in run["log"]
    # at no moment were more than 3 transactions planned and uncommitted
    spans = table(conn, "SELECT planned_at, committed_at FROM transactions")
    for start, _ in spans:
        assert sum(1 for s, e in spans if s <= start < e) <= 3
    assert verify(conn, pipeline).ok
