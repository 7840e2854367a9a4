"""Commit lag alerts (onceflow.airflow.alerts): a pipeline declares the lag it tolerates and
its notifiers; the DAG onceflow_<name>_commit_lag (from the DAG file, like every pipeline's
DAGs) measures how long the oldest uncommitted work has waited. On a stalled pipeline (a failed
txid blocks the commits) the check fails with what waits and how to free it, and calls the
notifiers, once per stall; on a healthy one (everything committed, or fresh work within the
lag) it succeeds and calls nobody. Real PostgreSQL, real Airflow (dag.test()), and a real
local Spark for the transaction that heals the pipeline.

Time is the records' and the transaction's own timestamps in onceflow's database, moved back
ten minutes for the stall: no test waits for a lag to grow."""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from airflow.sdk import BaseNotifier

from helpers import (
    outside_pipeline,
    run_transaction,
    table,
)

ALERT = timedelta(seconds=60)
NOTIFY_FILE = "ONCEFLOW_TEST_NOTIFY_FILE"


# -- the user's side: a pipeline with an alert, and its notifiers ---------------------------------
def _said(text: str) -> None:
    with open(os.environ[NOTIFY_FILE], "a") as out:
        out.write(json.dumps(text) + "\n")


def record(context) -> None:
    """A notifier as a plain function of the context."""
    _said(context["commit_lag"]["message"])


class LineNotifier(BaseNotifier):
    """An Airflow notifier whose text is a template of the context."""

    template_fields = ("text",)

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def notify(self, context) -> None:
        _said(self.text)


TEMPLATED = LineNotifier("{{ commit_lag.message }}")


def watched():
    """The outside pipeline with a commit lag alert (a reference names it: test_alerts:watched)."""
    from pageviews.pipelines import PAGE_VIEWS

    return dataclasses.replace(PAGE_VIEWS, commit_lag_alert=ALERT,
                               commit_lag_notifier=("test_alerts:record", "test_alerts:TEMPLATED"))


@pytest.fixture
def pipeline(monkeypatch, dsn, conn, tmp_path):
    monkeypatch.setenv(NOTIFY_FILE, str(tmp_path / "notified.jsonl"))
    with outside_pipeline(monkeypatch, "test_alerts:watched", conn) as found:
        yield found


def notified() -> list[str]:
    path = Path(os.environ[NOTIFY_FILE])
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def views(n: int) -> list[str]:
    return [json.dumps({"country": c, "page": "/"}) for c in (["de", "fr"] * n)[:n]]


def measure(conn, pipeline):
    from onceflow.airflow.alerts import measure as commit_lag
    from onceflow.core.db import transaction

    with transaction(conn) as cur:
        return commit_lag(cur, pipeline)


def stall(conn, pipeline) -> int:
    """A transaction that failed, ten minutes ago, over records that arrived then."""
    from onceflow.core.begin import begin, mark_failed

    batch = begin(conn, pipeline, "run-stalled")
    mark_failed(conn, pipeline.name, batch.attempt, "process failed in run run-stalled: boom")
    with conn.cursor() as cur:
        cur.execute("UPDATE source_log SET produced_at = produced_at - interval '10 minutes' "
                    "WHERE topic = %s", (pipeline.topic,))
        cur.execute("UPDATE transactions SET planned_at = planned_at - interval '10 minutes' "
                    "WHERE pipeline = %s", (pipeline.name,))
    conn.commit()
    return batch.attempt.txid


# -- the declaration ------------------------------------------------------------------------------
def test_the_alert_settings_are_checked(pipeline):
    from onceflow.core.errors import ConfigError

    for bad, says in [({"commit_lag_alert": timedelta(0)}, "positive timedelta"),
                      ({"commit_lag_alert": 60}, "positive timedelta"),
                      ({"commit_lag_alert": None}, "set commit_lag_alert too"),
                      ({"commit_lag_notifier": ["test_alerts:record"]}, "tuple of those"),
                      ({"commit_lag_notifier": "not a reference"}, "'module:attribute'"),
                      ({"dead_letter_approval": "yes"}, "True or False")]:
        with pytest.raises(ConfigError, match=says):
            pipeline.with_settings(**bad)


# -- what is measured -----------------------------------------------------------------------------
def test_commit_lag_is_how_long_the_oldest_uncommitted_work_waits(pipeline, conn):
    lag = measure(conn, pipeline)
    assert (lag.seconds, lag.what) == (0.0, "nothing waits")

    pipeline.source.append(conn, views(10))
    fresh = measure(conn, pipeline)
    assert fresh.records_waiting == 10 and 0 <= fresh.seconds < 30
    assert "10 record(s) of the source are not committed and no transaction plans them" in \
        fresh.what and "Trigger onceflow_page_views" in fresh.fix

    txid = stall(conn, pipeline)
    stalled = measure(conn, pipeline)
    assert 600 <= stalled.seconds < 660 and stalled.over(ALERT)
    assert stalled.open_txids == (txid,)
    assert stalled.what.startswith(f"txid {txid} is failed: process failed in run run-stalled")
    assert f'{{"txid": {txid}}}' in stalled.fix and "onceflow backfill" in stalled.fix
    assert "nothing committed yet" in stalled.message(ALERT)
    assert stalled.message(ALERT).startswith("commit lag of page_views is 10m")


# -- the monitoring DAG ---------------------------------------------------------------------------
@pytest.mark.timeout(400)
def test_the_check_fires_on_a_stalled_pipeline_and_not_on_a_healthy_one(pipeline, conn, dsn,
                                                                        airflow_db, spark):
    from onceflow.airflow.alerts import commit_lag_dag

    dag = commit_lag_dag("page_views")
    assert dag.dag_id == "onceflow_page_views_commit_lag"
    assert dag.schedule == timedelta(minutes=1)  # a quarter of the alert, 1 minute at least
    base = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=10)

    def check(i: int):
        run = dag.test(logical_date=base + timedelta(minutes=i))
        (ti,) = run.get_task_instances()
        return str(run.state), str(ti.state), run

    pipeline.source.append(conn, views(40))
    txid = stall(conn, pipeline)

    # stalled: the check fails with what waits; both notifiers said it, once
    state, task, run = check(0)
    assert (state, task) == ("failed", "failed")
    said = notified()
    assert len(said) == 2 and said[0] == said[1], said  # the function and the template
    assert said[0].startswith("commit lag of page_views is 10m") and "(alert at 60s)" in said[0]
    assert f"txid {txid} is failed: process failed in run run-stalled: boom" in said[0]
    assert "onceflow backfill --pipeline page_views" in said[0]
    # the same stall checked again: still failed, nobody told twice
    assert check(1)[:2] == ("failed", "failed")
    assert len(notified()) == 2
    # the run's note says it (not "failed before a txid was given")
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session

    with create_session() as session:
        live = session.get(DagRun, run.id)
        note = live.dag_run_note.content if live.dag_run_note else ""
    assert note.startswith("commit lag of page_views is 10m"), note

    # healed: the failed txid committed (adopted by the next transaction): nothing waits
    batch, result = run_transaction(spark, dsn, conn, pipeline, "run-heal")
    assert (batch.attempt.txid, result.status) == (txid, "committed")
    assert check(2)[:2] == ("success", "success")
    # healthy with fresh work, well within the lag: no alert either
    pipeline.source.append(conn, views(5))
    assert check(3)[:2] == ("success", "success")
    assert len(notified()) == 2
    assert table(conn, "SELECT count(*) FROM transactions WHERE state = 'committed'") == [(1,)]
