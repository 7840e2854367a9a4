"""Exactly once under real faults (onceflow_testing.faults): processes killed with SIGKILL while
staging, inside the commit transaction and right after its COMMIT; PostgreSQL crashed
(immediate-mode restart of a private cluster) between staging and commit and under a commit;
duplicate triggers; zombie attempts reaching the staging fence; runs that die silently.

A fault counts only once it happened (onceflow_testing.faults confirms each), and an agent that
hangs fails within its own deadline, showing its stderr. The oracle is the test's own
(helpers.assert_exact): it reads what the generator wrote (the payload list), with none of
onceflow's bookkeeping as the expectation, and every count must match: zero duplicates, zero
losses, dead letters exactly the poison records. Kills inside commits that write outside the
coordinator's database: tests/test_faults_outside.py.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from psycopg2.extensions import parse_dsn

from helpers import assert_exact, table, tweets_pipeline
from onceflow.core import db
from onceflow.core.begin import begin
from onceflow.core.commit import commit
from onceflow.core.errors import StagingIncomplete
from onceflow.core.registration import register
from onceflow.core.registry import get_pipeline
from onceflow.dev.localpg import crash_restart, start_private, stop_private
from onceflow_testing.faults import KINDS, Agent, AgentError, FaultRun, run_and_kill
from tweets_example.data import generate

SEED = int(os.environ.get("ONCEFLOW_FAULT_SEED", "20261123"))


@pytest.fixture(scope="module")
def private_pg():
    """A PostgreSQL cluster of this module's own, which the tests crash."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data_dir = Path("/var/tmp") / f"onceflow-faults-{os.getpid()}"
    dsn = start_private(data_dir, port)
    yield dsn, data_dir
    stop_private(data_dir)
    subprocess.run(["rm", "-rf", str(data_dir)], check=False)


@pytest.fixture
def crashable(private_pg, request):
    """A fresh migrated database on the private cluster, and how to crash the cluster."""
    server, data_dir = private_pg
    name = f"faults_{abs(hash(request.node.name)) % 10**8}"
    dsn = db.recreate_database(server, name)
    return dsn, lambda: crash_restart(data_dir)


def setup(dsn, events: int, **settings):
    pipeline = get_pipeline("tweets", **settings)
    payloads = list(generate(events, seed=SEED % 1000, malformed_share=0.04,
                             poison_share=0.01, flaky_share=0.02))
    conn = db.connect(dsn)
    register(conn, pipeline, create_source=True)
    pipeline.source.append(conn, payloads)
    return pipeline, payloads, conn


def exact(conn, pipeline, payloads) -> None:
    """Drained: every record read, every poison one dead, nothing queued; and there were
    poison records, or "every poison one dead" would hold of none."""
    result = assert_exact(conn, pipeline, payloads, read_all=True, drained=True)
    assert result.dead, "the run read no poison record: its dead letters proved nothing"


def test_a_postgres_crash_between_staging_and_commit_loses_nothing(spark, crashable,
                                                                   monkeypatch):
    """The outside fault run's finding: PostgreSQL crashed after staging (its unlogged
    tables emptied) and the retry committed an empty batch. Now the commit finds its staging
    is not whole, fails the attempt, and the batch is processed again."""
    from onceflow.spark.processing import process_batch

    dsn, crash = crashable
    monkeypatch.setenv("ONCEFLOW_PG_DSN", dsn)
    pipeline, payloads, conn = setup(dsn, 400, batch_size=400)
    batch = begin(conn, pipeline, "run-1")
    process_batch(spark, dsn, pipeline, batch.attempt)
    crash()
    conn = db.connect(dsn)
    with pytest.raises(StagingIncomplete, match="staging is not whole"):
        commit(conn, pipeline, batch.attempt)
    with conn.cursor() as cur:
        cur.execute("SELECT state, last_committed_txid FROM transactions JOIN pipelines "
                    "ON name = pipeline")
        assert cur.fetchone() == ("failed", 0)
    conn.commit()
    again = begin(conn, pipeline, "run-2")  # adopts txid 1
    assert again.attempt.txid == 1 and again.attempt.attempt == 2
    process_batch(spark, dsn, pipeline, again.attempt)
    assert commit(conn, pipeline, again.attempt).status == "committed"
    FaultRun(pipeline, dsn, spark, SEED).drain()
    exact(conn, pipeline, payloads)


def test_a_postgres_crash_under_a_commit_transaction_loses_nothing(spark, crashable,
                                                                  monkeypatch):
    from onceflow.spark.processing import process_batch

    dsn, crash = crashable
    monkeypatch.setenv("ONCEFLOW_PG_DSN", dsn)
    pipeline, payloads, conn = setup(dsn, 400, batch_size=400)
    batch = begin(conn, pipeline, "run-1")
    process_batch(spark, dsn, pipeline, batch.attempt)
    env = {**os.environ, "ONCEFLOW_PG_DSN": dsn}
    agent = Agent(["commit", "--pipeline", "tweets", "--settings",
                   json.dumps({"batch_size": 400}), "--txid", "1", "--attempt", "1",
                   "--pause-at", "offsets"], env)
    try:
        assert agent.wait_paused().where == "commit:offsets"
        before = server_started(dsn)
        crash()  # the commit's transaction is cut off by the crash, then the agent goes
        assert server_started(dsn) != before  # the server did restart
        assert agent.kill().killed
    finally:
        agent.stop()
    conn = db.connect(dsn)
    with pytest.raises(StagingIncomplete):
        commit(conn, pipeline, batch.attempt)
    FaultRun(pipeline, dsn, spark, SEED).drain()
    exact(conn, pipeline, payloads)


def test_a_postgres_restarting_at_begin_is_waited_for_and_the_run_commits_once(
        spark, private_pg, crashable, monkeypatch, caplog, capsys):
    """A PostgreSQL that stops as in a crash (SIGQUIT to its postmaster, by PID: immediate
    shutdown, recovery at the next start) and comes back 2 s later: the run's connection is
    tried again, each try logged, and the run then commits its batch once."""
    from onceflow.spark.loop import run_batches

    dsn, _ = crashable
    _, data_dir = private_pg
    monkeypatch.setenv("ONCEFLOW_PG_DSN", dsn)
    monkeypatch.setenv("ONCEFLOW_PG_CONNECT_RETRY_S", "60")
    pipeline, payloads, conn = setup(dsn, 400, batch_size=400)
    conn.close()
    before = server_started(dsn)
    postmaster = int((data_dir / "postmaster.pid").read_text().split()[0])
    os.kill(postmaster, signal.SIGQUIT)
    wait_until(lambda: not _alive(postmaster), "the postmaster to stop")
    port = int(parse_dsn(dsn)["port"])
    restarted = threading.Timer(2.0, start_private, (data_dir, port))
    restarted.start()
    try:
        with caplog.at_level(logging.WARNING, logger="onceflow.core.db"):
            done = run_batches(spark, dsn, pipeline)
    finally:
        restarted.join()
    assert server_started(dsn) > before  # the server did go down and start again
    # (where Airflow was imported, its logging may print the lines rather than pass them on)
    logged = caplog.text + capsys.readouterr().out
    assert "does not answer yet" in logged and "try 1 failed" in logged  # the run met it
    assert "answered at try" in logged
    assert done.committed[0] == 1
    conn = db.connect(dsn)
    assert table(conn, "SELECT txid, attempt, outcome FROM transaction_attempts "
                       "WHERE txid = 1") == [(1, 1, "committed")]
    FaultRun(pipeline, dsn, spark, SEED).drain()
    exact(conn, pipeline, payloads)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_postgres_that_stays_away_fails_retryable_and_a_wrong_one_at_once(dsn, monkeypatch,
                                                                           caplog, capsys):
    """Past pg_connect_retry_s a refused connection is Unavailable, which Airflow retries
    (airflow_outcomes lets it through); a server that answers with an error waiting cannot
    fix (a database that does not exist) is Unreachable at once, failing the task."""
    from onceflow.airflow.compat import AirflowFailException
    from onceflow.airflow.operators import airflow_outcomes
    from onceflow.core.errors import Unavailable, Unreachable, is_permanent

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nowhere = f"postgresql://postgres@127.0.0.1:{s.getsockname()[1]}/onceflow"
    monkeypatch.setenv("ONCEFLOW_PG_CONNECT_RETRY_S", "1.6")
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="onceflow.core.db"), \
            pytest.raises(Unavailable) as gone, airflow_outcomes():
        db.connect(nowhere)
    assert 1.4 < time.monotonic() - started < 10
    assert not is_permanent(gone.value) and "3 tries in" in str(gone.value)
    assert "onceflow_pg" in str(gone.value) and "run.sh" not in str(gone.value)
    # (once Airflow is imported, its logging may print the lines rather than pass them on)
    logged = caplog.text + capsys.readouterr().out
    assert logged.count("does not answer yet") == 2
    assert "try 1 failed, trying again in 0.5s" in logged
    assert "try 2 failed, trying again in 1.0s" in logged
    caplog.clear()
    wrong = db.with_database(dsn, "onceflow_no_such_database")
    with pytest.raises(AirflowFailException) as failed, airflow_outcomes():
        db.connect(wrong)
    assert isinstance(failed.value.__cause__, Unreachable)
    assert "does not exist" in str(failed.value)
    assert "does not answer yet" not in caplog.text + capsys.readouterr().out  # no retry


def test_kills_inside_and_after_the_commit_apply_once(spark, dsn, conn):
    """SIGKILL of the committing process inside its transaction leaves nothing; after its
    COMMIT, the retry is a logged no-op (deleting the staging if the kill came first)."""
    from onceflow.spark.processing import process_batch

    pipeline, payloads, conn = setup(dsn, 600, batch_size=300)
    batch = begin(conn, pipeline, "run-1")
    process_batch(spark, dsn, pipeline, batch.attempt)
    env = {**os.environ, "ONCEFLOW_PG_DSN": dsn}
    agent = ["commit", "--pipeline", "tweets", "--settings", json.dumps({"batch_size": 300}),
             "--txid", "1", "--attempt", "1"]
    inside = run_and_kill([*agent, "--pause-at", "commit_record"], env)
    assert inside.killed and inside.where == "commit:commit_record", inside.describe()
    assert table(conn, "SELECT last_committed_txid FROM pipelines") == [(0,)]
    after = run_and_kill([*agent, "--pause-at", "after"], env)
    assert after.killed and after.where == "after commit", after.describe()
    assert "COMMIT committed" in after.stdout
    assert commit(conn, pipeline, batch.attempt).status == "already_committed"
    # killed after the COMMIT, before its staging is deleted: the retry deletes it
    second = begin(conn, pipeline, "run-2")
    process_batch(spark, dsn, pipeline, second.attempt)
    agent[agent.index("--txid") + 1] = "2"
    killed = run_and_kill([*agent, "--pause-at", "committed"], env)
    assert killed.killed and killed.where == "commit:committed", killed.describe()
    assert table(conn, "SELECT last_committed_txid FROM pipelines") == [(2,)]
    assert table(conn, "SELECT txid FROM staged_groups") == [(2,)]
    assert commit(conn, pipeline, second.attempt).status == "already_committed"
    assert table(conn, "SELECT count(*) FROM staged_groups") == [(0,)]
    FaultRun(pipeline, dsn, spark, SEED).drain()
    exact(conn, pipeline, payloads)


@pytest.mark.parametrize("mode", ["transactional", "opaque"])
def test_randomized_faults_end_exact(spark, crashable, monkeypatch, capsys, mode):
    """Seeded (ONCEFLOW_FAULT_SEED, fixed by default), bounded: faults drawn at every point
    until 6 transactions committed and every kind of fault happened (a kill counts once the
    agent died of it at the step drawn, a PostgreSQL crash once the server came back with a
    new start time); then a drain; then the oracle."""
    dsn, crash = crashable
    monkeypatch.setenv("ONCEFLOW_PG_DSN", dsn)
    settings = {"batch_size": 150, "mode": mode, "max_pending": 3}
    pipeline, payloads, conn = setup(dsn, 1500, **settings)
    run = FaultRun(pipeline, dsn, spark, SEED + (mode == "opaque"), settings=settings,
                   restart_postgres=crash, rate=0.2)
    run.run(transactions=6, cover=KINDS)
    run.drain()
    with capsys.disabled():
        print(f"\nfault run {mode} seed {run.seed}: {run.steps} steps\n{run.table()}\n"
              f"outcomes {dict(sorted(run.outcomes.items()))}")
    assert not run.missed, run.missed  # every fault drawn happened
    assert run.happened == run.attempted
    assert all(run.happened[kind] >= 1 for kind in KINDS), run.table()
    conn = db.connect(dsn)
    exact(conn, pipeline, payloads)
    run.close()


def server_started(dsn: str):
    with db.connection(dsn) as c, c.cursor() as cur:
        cur.execute("SELECT pg_postmaster_start_time()")
        return cur.fetchone()[0]


def wait_until(check, what: str, timeout: float = 120) -> None:
    """Poll an observable state; the deadline only catches a real hang."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f}s"
        time.sleep(0.1)


def test_a_hung_agent_fails_within_its_deadline_showing_its_stderr(dsn, conn):
    """An agent that never reaches its step (here: blocked on the coordinator row another
    session holds) is killed when its deadline passes, and the error shows its stderr."""
    tweets_pipeline(conn, events=20)
    batch = begin(conn, get_pipeline("tweets"), "run-1")
    holder = db.connect(dsn)
    with holder.cursor() as cur:
        cur.execute("SELECT 1 FROM pipelines WHERE name = 'tweets' FOR UPDATE")
    env = {**os.environ, "ONCEFLOW_PG_DSN": dsn}
    agent = Agent(["commit", "--pipeline", "tweets", "--txid", str(batch.attempt.txid),
                   "--attempt", str(batch.attempt.attempt), "--pause-at", "locked"], env)
    try:
        wait_until(lambda: table(conn, """SELECT count(*) FROM pg_stat_activity
                                          WHERE datname = current_database()
                                            AND application_name = 'onceflow-fault-agent'
                                            AND wait_event_type = 'Lock'""") == [(1,)],
                   "the agent waiting for the coordinator row")
        started = time.monotonic()
        with pytest.raises(AgentError, match="neither paused nor ended within 1s") as failed:
            agent.wait_paused(timeout=1)
        assert time.monotonic() - started < 60  # its own deadline, not the test's timeout
    finally:
        agent.stop()
        holder.close()
    assert agent.proc.returncode == -signal.SIGKILL
    assert f"fault agent pid {agent.proc.pid}: commit tweets txid 1" in str(failed.value)


def test_an_agent_that_fails_is_reported_with_its_stderr(dsn):
    env = {**os.environ, "ONCEFLOW_PG_DSN": dsn}
    with pytest.raises(AgentError, match="the agent failed") as failed:
        run_and_kill(["commit", "--pipeline", "no_such_pipeline", "--txid", "1",
                      "--attempt", "1", "--pause-at", "locked"], env)
    assert "no_such_pipeline" in str(failed.value).split("--- its stderr ---")[1]
