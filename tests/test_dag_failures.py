"""Transactions under failure on real Airflow: whole DAG runs, several at once in separate
processes (dag.test() cannot run from threads), each with its own logical date."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psutil
import pytest

from helpers import assert_exact, table, tweets_events, tweets_pipeline
from onceflow.core.begin import begin
from onceflow.ops.verify import recount as verify
from onceflow_testing.holds import Hold, airflow_writes_held, hold_staging, kill_child

RUNNER = Path(__file__).with_name("dag_runner.py")
_dates = iter(range(1, 10_000))


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setenv("ONCEFLOW_RETRY_DELAY_SECONDS", "1")


def logical_date() -> datetime:
    base = datetime.now(UTC).replace(microsecond=0)
    return base + timedelta(seconds=next(_dates))


def start_run(conf: dict | None = None, env: dict | None = None,
              date: datetime | None = None) -> subprocess.Popen:
    """A DAG run in a process of its own; its output goes to a file (``proc.log``), which a
    test can watch while the run goes on. ``date``: the logical date of an earlier run, to
    run it again (dag.test() replaces it: a Clear of the whole run)."""
    log = Path(tempfile.mkstemp(prefix="onceflow-dag-run-", suffix=".log")[1])
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(RUNNER), (date or logical_date()).isoformat(),
             json.dumps(conf or {})],
            stdout=out, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
    proc.log = log
    return proc


def finish(proc: subprocess.Popen, timeout: float = 300) -> dict:
    proc.wait(timeout=timeout)
    out = proc.log.read_text()
    proc.log.unlink()
    last = out.strip().splitlines()[-1] if out.strip() else ""
    try:
        return json.loads(last) | {"log": out}
    except json.JSONDecodeError:
        raise AssertionError(f"the DAG run printed no result:\n{out[-4000:]}") from None


def exact(conn, pipeline, payloads, **kw) -> None:
    """The independent oracle (helpers.assert_exact) and onceflow's own verify."""
    assert_exact(conn, pipeline, payloads, **kw)
    assert verify(conn, pipeline).ok


def kill_descendants(proc: subprocess.Popen, marker: str, timeout: float = 180) -> list[int]:
    """SIGKILL, by PID, the processes among ``proc``'s descendants (processes this test
    started, and only those) whose command line holds ``marker``, once they appear; waits
    until they are gone. Returns their PIDs."""
    root = psutil.Process(proc.pid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        found = []
        for child in root.children(recursive=True):
            try:
                if marker in " ".join(child.cmdline()):
                    found.append(child)
            except psutil.NoSuchProcess:  # ended meanwhile
                pass
        if found:
            for child in found:
                child.send_signal(signal.SIGKILL)
            _, alive = psutil.wait_procs(found, timeout=30)
            assert not alive, f"still running after SIGKILL: {alive}"
            return [child.pid for child in found]
        time.sleep(0.1)
    return []


def wait_for(conn, query: str, expected, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if table(conn, query) == expected:
            return
        time.sleep(0.5)
    raise AssertionError(f"{query} never returned {expected}: {table(conn, query)}")


CANCELLED = "canceling statement due to user request"


@pytest.fixture
def long_lease(monkeypatch):
    """A lease longer than a test holds a staging: a staging waiting on the test's row holds
    its transaction's row (FOR SHARE), so its task's lease reports wait too, and with the
    default lease the next run would adopt the held txid."""
    monkeypatch.setenv("ONCEFLOW_ATTEMPT_LEASE_S", "600")


@pytest.mark.timeout(480)
def test_a_group_retries_alone_and_a_commit_killed_after_postgresql_committed_is_a_no_op(
        dsn, conn, airflow_db, warm_spark):
    """Two processing groups (mapped tasks). Group 1's staging waits on a row the test holds,
    and the test cancels that statement: the group's first try fails (a database error, as
    any) and Airflow retries that group alone. Then the commit's transaction commits in
    PostgreSQL and its process dies before Airflow records the task's success: the test
    holds the commit's write to a state table, takes Airflow's metadata database for
    writing, lets the commit go on, and once PostgreSQL has it committed (Airflow still sees
    the task running) kills the run's process. The run run again (a Clear) finds the txid
    committed: its commit is a logged no-op, and the batch is counted once."""
    payloads = tweets_events(500)
    pipeline = tweets_pipeline(conn, payloads=payloads, batch_size=500)
    date = logical_date()
    with Hold(dsn, "LOCK TABLE url_counts IN EXCLUSIVE MODE",
              what="the commit's write to url_counts") as state_write, \
            hold_staging(dsn, "tweets", txid=1, attempt=1, group=1) as staging:
        run = start_run({"groups": 2}, date=date)
        waiter = staging.wait_for_waiter(alive=run)
        assert waiter.application == "onceflow-process-tweets", waiter
        assert "INSERT INTO staged_groups" in waiter.query
        staging.cancel(waiter)
        staging.release()
        waiter = state_write.wait_for_waiter(alive=run)
        assert "url_counts" in waiter.query, waiter
        with airflow_writes_held() as airflow:
            state_write.release()
            wait_for(conn, "SELECT state FROM transactions", [("committed",)], timeout=30)
            (run_id,) = table(conn, "SELECT run_id FROM transactions")[0]
            tries = airflow.execute(
                """SELECT task_id, map_index, try_number, state FROM task_instance
                   WHERE dag_id = 'onceflow_tweets' AND run_id = ?
                   ORDER BY task_id, map_index""", (run_id,)).fetchall()
            assert kill_child(run, run.pid, str(RUNNER)) == -signal.SIGKILL
    # group 1 was tried twice; Airflow never heard of the commit's end
    assert tries == [("begin", -1, 1, "success"), ("commit", -1, 1, "running"),
                     ("process", 0, 1, "success"), ("process", 1, 2, "success")]
    killed_log = run.log.read_text()
    run.log.unlink()
    assert CANCELLED in killed_log
    assert "COMMIT pipeline=tweets txid=1 attempt=1" in killed_log
    again = finish(start_run({"groups": 2}, date=date))
    assert again["state"] == "success", again["log"][-3000:]
    # the runner built Airflow's in-process API ahead, as the demo does, and dag.test()
    # ran on it (onceflow.dev.demo.prepare_dag_test)
    assert again["api_prebuilt"] is True
    assert again["run_id"] == run_id
    assert "already committed, nothing to do" in again["log"]
    assert table(conn, "SELECT groups FROM transactions") == [(2,)]
    assert table(conn, "SELECT txid, attempt, outcome FROM transaction_attempts") == [
        (1, 1, "committed")]
    exact(conn, pipeline, payloads, read_all=True)


@pytest.mark.timeout(300)
def test_two_runs_racing_for_one_txid_commit_it_once(dsn, conn, airflow_db, warm_spark):
    """Duplicate triggers of one txid: one attempt commits; the fenced one ends skipped (not
    failed: nothing is wrong), saying it was superseded."""
    payloads = tweets_events(600)
    pipeline = tweets_pipeline(conn, payloads=payloads, batch_size=600)
    begin(conn, pipeline, "setup")  # txid 1 exists; both runs ask for it
    runs = [start_run({"txid": 1}), start_run({"txid": 1})]
    results = [finish(r) for r in runs]
    assert [r["state"] for r in results] == ["success", "success"], results
    attempts = table(conn, """SELECT attempt, outcome FROM transaction_attempts
                              WHERE txid = 1 ORDER BY attempt""")
    assert [a for a, _ in attempts] == [1, 2, 3]
    assert [o for _, o in attempts].count("committed") == 1, attempts
    fenced = [r for r in results if "skipped" in r["tasks"].values()]
    if fenced:  # one run was overtaken while processing: it says so and writes nothing
        assert "superseded, nothing to do" in fenced[0]["log"]
    assert table(conn, "SELECT state FROM transactions") == [("committed",)]
    exact(conn, pipeline, payloads, read_all=True)


@pytest.mark.timeout(420)
def test_a_failed_txid_fails_the_waiting_commit_fast_and_a_backfill_commits_both(
        dsn, conn, airflow_db, warm_spark, long_lease):
    """txid 1's process fails on every try: its staging waits on a row the test holds, and
    the test cancels it, three times. txid 2 begins while txid 1 is surely in flight (its
    first try waits until the test cancels it: no timing window), processes, and its commit
    waits. Once txid 1 failed, the waiting commit fails at once, naming txid 1 and the
    backfill; `onceflow backfill` then re-runs 1 and 2, committed in order."""
    payloads = tweets_events(900)
    pipeline = tweets_pipeline(conn, payloads=payloads, batch_size=400)
    with hold_staging(dsn, "tweets", txid=1, attempt=1) as hold:
        failing = start_run()
        first_try = hold.wait_for_waiter(alive=failing)
        waiting = start_run()  # txid 2: processes, then its commit waits for txid 1
        wait_for(conn, """SELECT commit_requested_at IS NOT NULL FROM transactions
                          WHERE txid = 2""", [(True,)])
        assert waiting.poll() is None, "txid 2 must be waiting for txid 1"
        hold.cancel(first_try)
        for _ in range(2):  # the retries wait there too, and are cancelled
            hold.cancel(hold.wait_for_waiter(alive=failing))
        failed = finish(failing)
    assert failed["state"] == "failed" and failed["tries"]["process[0]"] == 3
    assert len(hold.cancelled) == 3 and CANCELLED in failed["log"]
    blocked = finish(waiting, timeout=120)
    assert blocked["state"] == "failed"
    assert "cannot commit: txid 1 is failed" in blocked["log"]
    assert 'trigger this DAG with {"txid": 1}' in blocked["log"]
    assert blocked["tries"]["commit[-1]"] == 1  # not retried: retrying cannot help
    assert table(conn, "SELECT txid, state FROM transactions ORDER BY 1") == [
        (1, "failed"), (2, "failed")]
    from onceflow.cli import main

    assert main(["backfill", "--pipeline", "tweets", "--via", "local"]) == 0
    assert table(conn, """SELECT txid, attempt FROM transactions
                          WHERE state = 'committed' ORDER BY committed_at""") == [(1, 2), (2, 2)]
    exact(conn, pipeline, payloads, read_all=True)  # (txid 2 read the rest: 500)


@pytest.mark.timeout(300)
def test_a_txid_whose_run_died_is_adopted_by_the_next_run(dsn, conn, airflow_db, warm_spark,
                                                          monkeypatch):
    """A run's process task is killed (SIGKILL of its process) while it holds txid 1 (its
    staging waits on a row the test holds): no failure callback runs. Until then its task
    reports the lease (the attempt shortened the hand-over lease begin gave it) and its
    process; after the kill the reports stop, and once the lease is over (seconds here,
    about a minute by default, not ten) the next run adopts txid 1 and commits it, counted
    once."""
    monkeypatch.setenv("ONCEFLOW_ATTEMPT_LEASE_S", "5")
    payloads = tweets_events(600)
    pipeline = tweets_pipeline(conn, payloads=payloads, batch_size=300)
    with hold_staging(dsn, "tweets", txid=1, attempt=1) as hold:
        doomed = start_run()
        try:
            hold.wait_for_waiter(alive=doomed)
            # the process task holds txid 1 and reports from its own process (dag.test
            # runs tasks in the runner): the short lease, its pid, the one killed
            wait_for(conn, "SELECT lease_s, holder ~ ' pid [0-9]+$' FROM transactions",
                     [(5, True)])
            (holder,) = table(conn, "SELECT holder FROM transactions")[0]
            pid = int(holder.rpartition(" pid ")[2])
            assert pid == doomed.pid, holder
            assert kill_child(doomed, pid, str(RUNNER)) == -signal.SIGKILL
        finally:
            if doomed.poll() is None:
                doomed.kill()
                doomed.wait()
    killed = time.monotonic()
    doomed.log.unlink()
    wait_for(conn, """SELECT heartbeat_at < now() - make_interval(secs => lease_s)
                      FROM transactions""", [(True,)], timeout=60)
    assert time.monotonic() - killed < 60
    result = finish(start_run())
    assert result["state"] == "success", result["log"][-3000:]
    assert "adopting an abandoned txid: its run manual__" in result["log"]
    assert table(conn, "SELECT txid, attempt, state FROM transactions") == [
        (1, 2, "committed")]
    assert table(conn, """SELECT attempt, outcome FROM transaction_attempts
                          ORDER BY attempt""") == [(1, "abandoned"), (2, "committed")]
    assert verify(conn, pipeline).ok
    exact(conn, pipeline, payloads, read_all=False)


@pytest.mark.timeout(300)
def test_errors_retrying_cannot_fix_fail_the_task_at_once(dsn, conn, airflow_db, warm_spark):
    tweets_pipeline(conn, events=100)
    result = finish(start_run({"txid": 99}))
    assert result["state"] == "failed"
    assert result["tries"]["begin[-1]"] == 1
    assert "txid=99 does not exist in pipeline 'tweets'" in result["log"]
    assert "DeprecatedImportWarning" not in result["log"]


@pytest.mark.timeout(300)
def test_a_killed_spark_driver_is_retried_and_counts_once(dsn, conn, airflow_db, spark_submit):
    """SIGKILL of the real spark-submit process of a run: the process task fails, Airflow
    retries it, and the transaction commits exactly once."""
    payloads = tweets_events(400)
    pipeline = tweets_pipeline(conn, payloads=payloads, batch_size=400)
    run = start_run()
    killed = kill_descendants(run, "process_batch.py --pipeline tweets --txid 1 --attempt 1")
    assert killed, "the Spark driver was never seen"
    result = finish(run)
    assert result["state"] == "success", result["log"][-3000:]
    assert result["tries"]["process[0]"] == 2
    assert table(conn, "SELECT state, attempt FROM transactions") == [("committed", 1)]
    exact(conn, pipeline, payloads, read_all=True)


@pytest.mark.timeout(300)
def test_a_run_that_may_not_wait_is_skipped_past_max_pending(dsn, conn, airflow_db, warm_spark):
    """With ONCEFLOW_BEGIN_WAIT_S=0 a run finding max_pending transactions open is skipped at
    once, planning nothing (the waiting runs are the test below)."""
    pipeline = tweets_pipeline(conn, events=2000, batch_size=500)  # max_pending 3
    for n in range(3):  # three planned by someone else, none committed
        begin(conn, pipeline, f"held-{n}")
    result = finish(start_run(env={"ONCEFLOW_BEGIN_WAIT_S": "0"}))
    assert result["state"] == "success", result["log"][-3000:]
    assert result["tasks"].get("begin[-1]") == "skipped", result["tasks"]
    assert "max_pending=3 reached" in result["log"]
    assert table(conn, "SELECT txid, state FROM transactions ORDER BY txid") == [
        (1, "planned"), (2, "planned"), (3, "planned")]


@pytest.mark.timeout(420)
def test_runs_past_max_pending_wait_in_begin_and_plan_when_one_commits(
        dsn, conn, airflow_db, warm_spark, long_lease):
    """Txid 1's run holds in its process task (its staging waits on a row the test holds,
    until the test lets it go) while four more start: two plan txids 2 and 3, and the other
    two, finding max_pending=3 open, wait in begin; once txid 1 commits they plan in turn.
    Exactly two wait, by construction."""
    payloads = tweets_events(2500)
    pipeline = tweets_pipeline(conn, payloads=payloads, batch_size=500)  # max_pending 3
    with hold_staging(dsn, "tweets", txid=1, attempt=1) as hold:
        first = start_run()
        hold.wait_for_waiter(alive=first)
        others = [start_run() for _ in range(4)]

        def waiting() -> list:
            return [r for r in others if WAITING in r.log.read_text()]

        deadline = time.monotonic() + 240
        while len(waiting()) < 2:
            assert time.monotonic() < deadline, "two runs never waited in begin"
            assert all(r.poll() is None for r in others), "a run ended while txid 1 was held"
            time.sleep(0.5)
        assert table(conn, "SELECT txid, state FROM transactions ORDER BY 1") == [
            (1, "planned"), (2, "planned"), (3, "planned")]
        assert [w.application for w in hold.waiters()] == ["onceflow-process-tweets"]
    # released: txid 1 stages and commits, a place frees, and then another
    results = [finish(r) for r in [first, *others]]
    assert all(r["state"] == "success" for r in results), [r["tasks"] for r in results]
    assert all(r["tasks"].get("begin[-1]") == "success" for r in results), [
        r["tasks"] for r in results]
    # all five planned and committed, never more than three open at once; two waited
    assert table(conn, "SELECT count(*) FROM transactions WHERE state = 'committed'") == [(5,)]
    waited = [r for r in results if WAITING in r["log"]]
    assert len(waited) == 2, [r["log"][-2000:] for r in results]
    assert all("a place freed after" in r["log"] for r in waited)
    _at_most_three_open(conn)
    exact(conn, pipeline, payloads, read_all=True)


WAITING = "waiting up to 300s for one to commit"


def _at_most_three_open(conn) -> None:
    """At no moment were more than 3 transactions planned and uncommitted."""
    spans = table(conn, "SELECT planned_at, committed_at FROM transactions")
    for start, _ in spans:
        assert sum(1 for s, e in spans if s <= start < e) <= 3
