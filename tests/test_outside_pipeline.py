"""A pipeline of a user's own, from outside this repository (tests/outside/pageviews, not
installed): found by reference, run through its Airflow DAG on the warm Spark (spark-submit:
tests/test_cluster.py) and through the CLI, then `onceflow verify` with no recount of the
user's: OK. An oracle of the test's own counts what the payloads hold, from the list the test
wrote."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest

from helpers import (
    outside_pipeline,
    table,
)

REF = "pageviews.pipelines:PAGE_VIEWS"
COUNTRIES = ["de", "fr", "DE", " nl ", "us", "zz"]  # "zz": unknown, fails every try
PAGES = ["/", "/home", "/pricing", "/docs/a,b", '/q?"x"']


def payloads(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        roll = rng.random()
        if roll < 0.05:
            out.append('{"country": "de", "page": ')  # malformed
        elif roll < 0.08:
            out.append(json.dumps({"page": "/no-country"}))
        else:
            out.append(json.dumps({"country": rng.choice(COUNTRIES), "page": rng.choice(PAGES),
                                   "n": i}))
    return out


def oracle(records: list[str]) -> tuple[Counter, Counter, int, int]:
    """Counts per country and page, rejected and failing, from the payloads alone."""
    countries, pages, rejected, failing = Counter(), Counter(), 0, 0
    for payload in records:
        try:
            doc = json.loads(payload)
        except ValueError:
            rejected += 1
            continue
        if doc.get("country") is None or doc.get("page") is None:
            rejected += 1
        elif doc["country"].strip().upper() == "ZZ":
            failing += 1
        else:
            countries[doc["country"].strip().upper()] += 1
            pages[doc["page"]] += 1
    return countries, pages, rejected, failing


@pytest.fixture
def outside(monkeypatch):
    """The user's package reachable the way a user makes it so: its folder on PYTHONPATH and
    its reference in ONCEFLOW_PIPELINES (this process and every one it starts)."""
    with outside_pipeline(monkeypatch, REF):
        yield


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onceflow.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=600)


def test_a_pipeline_of_ones_own_runs_through_its_dag_and_the_cli(outside, dsn, conn,
                                                                 airflow_db, warm_spark):
    """Through the warm Spark Connect server: the user's code is shipped by value with the
    functions Spark sends, nothing installed on the server. (The same pipeline through
    spark-submit, where the driver finds it by the reference and folder the task passes, is
    tests/test_cluster.py's first test; local spark-submit is test_dag_failures' killed
    driver.)"""
    from pageviews.pipelines import PAGE_VIEWS

    from onceflow.airflow import transaction_dag

    listed = cli("pipelines")
    assert listed.returncode == 0 and "page_views: postgres-log source 'page_views'" in \
        listed.stdout and f"from {REF}" in listed.stdout
    done = cli("init", "--pipeline", "page_views")
    assert done.returncode == 0, done.stderr
    records = payloads(600, seed=5)
    produced = cli("produce", "--pipeline", "page_views", stdin="\n".join(records) + "\n")
    assert produced.returncode == 0 and "produced 600 records" in produced.stdout

    # the DAG from the Pipeline object: its reference is found, and travels to spark-submit
    dag = transaction_dag(PAGE_VIEWS)
    assert dag.dag_id == "onceflow_page_views" and dag.params["batch_size"] == 400
    assert dag.max_active_runs == 3 and dag.default_args["retries"] == 1
    base = datetime.now(UTC).replace(microsecond=0)
    for i in range(2):  # 600 records (and the replays of failures) in batches of 400
        dr = dag.test(logical_date=base + timedelta(seconds=i))
        assert str(dr.state) == "success"
    assert table(conn, "SELECT count(*) FROM transactions WHERE state = 'committed'") == [(2,)]

    countries, pages, rejected, failing = oracle(records)
    assert dict(table(conn, "SELECT key, value FROM views_per_country")) == dict(countries)
    assert dict(table(conn, "SELECT key, value FROM views_per_page")) == dict(pages)
    assert table(conn, "SELECT count(*) FROM rejected_records") == [(rejected,)]
    parked = table(conn, "SELECT count(*) FROM backflow_items")[0][0] + \
        table(conn, "SELECT count(*) FROM dead_letters")[0][0]
    assert parked == failing > 0

    verified = cli("verify", "--pipeline", "page_views")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "verify page_views (re-run): OK: 2 committed txids re-run" in verified.stdout
    status = cli("status", "--pipeline", "page_views", "--json")
    assert status.returncode == 0
    assert json.loads(status.stdout)["last_committed"] == 2
    text = cli("status", "--pipeline", "page_views")
    assert text.returncode == 0 and max(map(len, text.stdout.splitlines())) <= 100


def test_verify_without_user_code_finds_a_wrong_value(outside, dsn, conn, spark):
    """The default verify re-runs the topology: a count changed by hand is found, with the
    key, what is committed and what the re-run says."""
    from helpers import run_transaction
    from onceflow.core.registration import register
    from onceflow.core.registry import get_pipeline
    from onceflow.ops.verify import rerun

    pipeline = get_pipeline("page_views")
    register(conn, pipeline, create_source=True)
    pipeline.source.append(conn, payloads(300, seed=8))
    run_transaction(spark, dsn, conn, pipeline, "run-1")
    assert rerun(conn, dsn, pipeline, spark).ok
    with conn.cursor() as cur:
        cur.execute("UPDATE views_per_country SET value = value + 1 WHERE key = 'DE'")
    conn.commit()
    report = rerun(conn, dsn, pipeline, spark)
    assert not report.ok
    assert any(m.startswith("views_per_country['DE']: (value, prev, txid) committed")
               for m in report.mismatches)
