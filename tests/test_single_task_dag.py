"""The one-task transaction DAG (``dag_shape="single"``): the same transaction, its phases in
one task; on real Airflow (dag.test()), the warm Spark and PostgreSQL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from helpers import produce, table, tweets_pipeline
from onceflow.airflow.dags import STANDBY_RUNS
from onceflow.core.begin import begin
from onceflow.core.registration import register
from onceflow.core.registry import clear_cache, get_pipeline
from onceflow.dev.demo import load_dag
from onceflow.ops.verify import recount
from onceflow_testing.holds import hold_staging
from tweets_example.data import generate

DAGS = Path(__file__).resolve().parents[1] / "dags"


@pytest.fixture
def quick_retries(monkeypatch):
    monkeypatch.setenv("ONCEFLOW_RETRY_DELAY_SECONDS", "1")


@pytest.fixture
def single(monkeypatch, conn, airflow_db):
    """The tweets pipeline declared with dag_shape="single", registered the way a user's is
    (ONCEFLOW_PIPELINES), so the project's DAG file builds its DAG: (pipeline, dag)."""
    monkeypatch.setenv("ONCEFLOW_PIPELINES", "helpers:TWEETS_SINGLE")
    clear_cache()
    try:
        pipeline = get_pipeline("tweets_single")
        register(conn, pipeline, create_source=True)
        yield pipeline, load_dag(DAGS, "onceflow_tweets_single")
    finally:
        clear_cache()


@pytest.mark.timeout(420)
def test_each_run_is_one_task_that_commits_its_transaction_in_order(
        single, conn, dsn, warm_spark, quick_retries, caplog):
    """Two runs, each one task: BEGIN, PROCESSED and COMMIT in its log, committed in txid
    order, the state exact; the second transaction's processing fails on its first try (its
    staging waits on a row the test holds, and the test cancels the statement): the retry
    begins again with a new attempt of the same txid, which commits once."""
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session

    pipeline, dag = single
    produce(conn, pipeline.topic, generate(1000, seed=7, malformed_share=0.05))
    assert [t.task_id for t in dag.tasks] == ["transaction"]
    assert dag.max_active_runs == pipeline.max_pending + STANDBY_RUNS["single"]
    assert "in one task, **transaction**" in dag.doc_md
    base = datetime.now(UTC).replace(microsecond=0)
    runs = []
    with hold_staging(dsn, "tweets_single", txid=2, attempt=1) as hold:
        canceller = hold.cancel_in_background()
        for i in range(2):
            dr = dag.test(logical_date=base + timedelta(seconds=i),
                          run_conf={"batch_size": 600})
            assert str(dr.state) == "success"
            runs.append(dr)
        (cancelled,) = canceller.finish()
    assert cancelled.application == "onceflow-process-tweets_single", cancelled
    (ti,) = runs[1].get_task_instances()
    assert ti.try_number == 2  # the cancelled staging, then the retry
    assert table(conn, """SELECT attempt, outcome FROM transaction_attempts
                          WHERE txid = 2 ORDER BY attempt""") == [(1, "fenced"), (2, "committed")]
    for txid, attempt in ((1, 1), (2, 2)):
        assert f"COMMIT pipeline=tweets_single txid={txid} attempt={attempt} " \
               f"prev_txid={txid - 1}" in caplog.text
    assert "BEGIN pipeline=tweets_single txid=2 attempt=2" in caplog.text
    assert "PROCESSED pipeline=tweets_single txid 2 attempt 2 group=0" in caplog.text
    assert table(conn, "SELECT txid, attempt, state FROM transactions ORDER BY txid") == [
        (1, 1, "committed"), (2, 2, "committed")]
    report = recount(conn, pipeline)
    assert report.ok, report.mismatches
    assert report.records + report.queued + report.dead == 1000
    with create_session() as session:  # the task's outlets: an event per table per commit
        events = session.query(AssetModel.name, AssetEvent.extra).join(
            AssetModel, AssetEvent.asset_id == AssetModel.id).filter(
            AssetEvent.source_run_id.in_([dr.run_id for dr in runs])).all()
    assert sorted((name, extra["txid"]) for name, extra in events) == sorted(
        (f"onceflow/tweets_single/tweets_single_{t}", txid)
        for t in ("url_counts", "domain_counts")
        for txid in (1, 2))


def test_a_waiting_commit_defers_with_its_batch_and_resumes_with_it(spark, conn, dsn):
    """Past its wait in the task the commit defers, the batch in the deferral (a resumed task
    is a new operator: nothing else remembers it); resumed, it commits that batch."""
    from airflow.sdk.exceptions import TaskDeferred

    from onceflow.airflow.operators import TransactionOperator
    from onceflow.core.commit import commit
    from onceflow.spark.processing import process_batch

    pipeline = tweets_pipeline(conn, events=600, batch_size=300)
    first, second = begin(conn, pipeline, "run-1"), begin(conn, pipeline, "run-2")
    for batch in (first, second):
        process_batch(spark, dsn, pipeline, batch.attempt)
    entries = [{"pipeline": "tweets", "txid": 2, "attempt": 1, "group": 0, "groups": 1,
                "records": 300, "committed": False}]
    waiting = TransactionOperator(task_id="transaction", pipeline="tweets", wait_in_task=0)
    waiting.batch = entries
    with pytest.raises(TaskDeferred) as deferred:
        waiting._try_commit(time.time() + 60)
    assert deferred.value.method_name == "execute_complete"
    assert deferred.value.kwargs == {"batch": entries}
    commit(conn, pipeline, first.attempt)
    resumed = TransactionOperator(task_id="transaction", pipeline="tweets")
    out = resumed.execute_complete(None, {"deadline": time.time() + 60},
                                   **deferred.value.kwargs)
    assert (out["txid"], out["attempt"], out["status"]) == (2, 1, "committed")


def test_a_spark_submit_connection_fails_the_run_at_once_naming_the_fix(
        single, conn, dsn, spark_submit):
    """The one-task DAG processes on a Spark Connect server; a spark connection (spark-submit)
    is refused before any Spark work, without retries, and the txid is marked failed for the
    next run to adopt."""
    pipeline, dag = single
    produce(conn, pipeline.topic, generate(100, seed=3))
    dr = dag.test(logical_date=datetime.now(UTC).replace(microsecond=0))
    (ti,) = dr.get_task_instances()
    assert str(dr.state) == "failed" and ti.try_number == 1  # no retry
    assert table(conn, "SELECT state FROM transactions WHERE txid = 1") == [("failed",)]
    (reason,) = table(conn, "SELECT reason FROM transaction_attempts WHERE txid = 1")[0]
    assert "is not of type spark_connect" in reason and "dag_shape='phases'" in reason


# In a fresh interpreter: a one-task transaction whose begin plans at once, refused after
# its plan (a spark-submit connection), then one whose begin waits for a place until it gives
# up; which of onceflow's Spark modules each left imported.
BEGIN_FIRST = """
import json, sys
from onceflow.airflow.operators import TransactionOperator
from onceflow.core.begin import begin
from onceflow.core.db import connection
from onceflow.core.registry import get_pipeline

SPARK = ("onceflow.spark.session", "onceflow.spark.processing")
out = {}
op = TransactionOperator(task_id="transaction", pipeline="tweets_single")
try:
    op.execute({"params": {}, "run_id": "planned-at-once"})
except Exception as error:
    out["refused"] = str(error)
out["at_once"] = [m for m in SPARK if m in sys.modules]
pipeline = get_pipeline("tweets_single", batch_size=10)
with connection() as conn:
    for n in range(pipeline.max_pending - 1):
        begin(conn, pipeline, f"open-{n}")
op = TransactionOperator(task_id="transaction", pipeline="tweets_single", wait_for_slot=0.5,
                         poll_interval=0.1)
try:
    op.execute({"params": {"batch_size": 10}, "run_id": "waits"})
except Exception as error:
    out["skipped"] = type(error).__name__
out["waited"] = [m for m in SPARK if m in sys.modules]
print(json.dumps(out))
"""


@pytest.mark.timeout(300)
def test_a_begin_that_plans_at_once_imports_no_spark_client_first(single, conn, dsn,
                                                                   spark_submit):
    """The txid is planned before the Spark client is imported (it would hold the GIL and the
    declaration check's lock); a begin that waits for a place imports it meanwhile."""
    pipeline, _ = single
    produce(conn, pipeline.topic, generate(100, seed=3))
    tests = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", BEGIN_FIRST], env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert "is not of type spark_connect" in out["refused"]
    assert table(conn, "SELECT txid, run_id FROM transactions ORDER BY txid")[0] == \
        (1, "planned-at-once")
    assert out["at_once"] == []
    assert out["skipped"] == "AirflowSkipException"  # max_pending, no place within 0.5 s
    assert out["waited"] == ["onceflow.spark.session", "onceflow.spark.processing"]


def test_the_shape_is_checked_by_name():
    from onceflow.airflow.dags import transaction_dag
    from onceflow.core.errors import ConfigError
    from onceflow.core.registry import get_pipeline

    with pytest.raises(ConfigError, match="pipeline.dag_shape='one' is invalid: choose one of "
                                          "phases, single"):
        get_pipeline("tweets", dag_shape="one").validate()
    with pytest.raises(ConfigError, match="shape='tasks' is invalid: choose one of"):
        transaction_dag("tweets", shape="tasks")


@pytest.mark.timeout(420)
def test_the_demos_runs_keep_their_true_durations_in_airflows_pages(single, conn, warm_spark,
                                                                   tmp_path):
    """The demo's runner (onceflow.dev.demo.run_transactions): each run's start and end in
    Airflow's metadata, which its pages show, span the run's own time, not the runs before
    it (dag.test() starts a run at its logical date)."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session

    from onceflow.dev.demo import run_transactions

    pipeline, dag = single
    produce(conn, pipeline.topic, generate(400, seed=7))
    results = run_transactions(dag, 2, {"batch_size": 200}, tmp_path / "demo.log")
    with create_session() as session:
        runs = {r.run_id: (r.start_date, r.end_date) for r in session.query(DagRun).filter(
            DagRun.dag_id == dag.dag_id)}
    previous_end = None
    for run_id, state, seconds in results:
        start, end = runs[run_id]
        assert state == "success"
        shown = (end - start).total_seconds()
        assert 0 < shown <= seconds + 0.5, (run_id, shown, seconds)
        if previous_end is not None:
            assert start >= previous_end
        previous_end = end
    assert table(conn, "SELECT txid, state FROM transactions ORDER BY txid") == [
        (1, "committed"), (2, "committed")]
