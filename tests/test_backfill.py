"""`onceflow backfill`: failed and superseded transactions re-run in txid order."""

from __future__ import annotations

import pytest

from helpers import assert_exact, table, tweets_events, tweets_pipeline
from onceflow.cli import main
from onceflow.core.begin import begin, mark_failed
from onceflow.ops.verify import recount as verify

PAYLOADS = tweets_events(700)


@pytest.fixture
def two_failed(conn):
    pipeline = tweets_pipeline(conn, payloads=PAYLOADS, batch_size=300)
    batches = {run: begin(conn, pipeline, run) for run in ("run-1", "run-2")}
    for run, batch in batches.items():
        mark_failed(conn, "tweets", batch.attempt, f"{run} died")
    return pipeline


def test_dry_run_lists_in_txid_order_and_triggers_nothing(two_failed, conn, capsys):
    assert main(["backfill", "--pipeline", "tweets", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.index("txid=1 state=failed") < out.index("txid=2 state=failed")
    assert "reason=run-1 died" in out and "dry run: nothing triggered" in out
    assert table(conn, "SELECT max(attempt) FROM transactions") == [(1,)]


@pytest.mark.timeout(300)
def test_local_backfill_commits_them_in_order(two_failed, conn, airflow_db, capsys,
                                               warm_spark):
    assert main(["backfill", "--pipeline", "tweets", "--via", "local"]) == 0
    assert table(conn, """SELECT txid, attempt, state FROM transactions
                          ORDER BY committed_at""") == [(1, 2, "committed"), (2, 2, "committed")]
    assert main(["backfill", "--pipeline", "tweets", "--dry-run"]) == 0
    assert "no failed, superseded or abandoned transactions" in capsys.readouterr().out
    assert table(conn, 'SELECT sum("offset") FROM partition_offsets') == [(600,)]
    assert_exact(conn, two_failed, PAYLOADS, read_all=False)
    assert verify(conn, two_failed).ok


@pytest.mark.timeout(300)
def test_airflow_backfill_queues_runs_with_the_txid_in_conf(two_failed, conn, airflow_db):
    assert main(["backfill", "--pipeline", "tweets", "--via", "airflow"]) == 0
    from airflow.models import DagRun
    from airflow.utils.session import create_session

    with create_session() as session:
        runs = session.query(DagRun).filter(DagRun.dag_id == "onceflow_tweets",
                                            DagRun.run_id.like("onceflow_backfill__%")).all()
        confs = sorted(r.conf["txid"] for r in runs)
    assert confs == [1, 2]
