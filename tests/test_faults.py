"""Exactly once under real faults (onceflow_testing.faults): processes killed with SIGKILL while
staging, inside the commit transaction and right after its COMMIT; PostgreSQL crashed
(immediate-mode restart of a private cluster) between staging and commit and under a commit;
duplicate triggers; zombie attempts reaching the staging fence; runs that die silently.

The oracle is the test's own: it counts what the generator wrote (the payload list), with
none of onceflow's bookkeeping (no offsets, gaps, queues or dead letters), and every count
must match: zero duplicates, zero losses.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from onceflow.core import db
from onceflow.core.begin import begin
from onceflow.core.commit import commit
from onceflow.core.errors import StagingIncomplete
from onceflow.core.registration import register
from onceflow.core.registry import get_pipeline
from onceflow.dev.localpg import crash_restart, recreate_database, start_private, stop_private
from onceflow_testing.faults import FaultRun, run_and_kill
from tweets_example.data import generate

SEED = int(os.environ.get("ONCEFLOW_FAULT_SEED", "20261123"))
HOST = re.compile(r"^https?://([^/:?#\s]+)")


def oracle(payloads: list[str]) -> dict:
    """What the committed state must be, from the payloads alone. The generator writes
    well-formed tweets, four kinds of unusable ones, poison hosts ("a..b": an empty label)
    and ASCII hosts only, so this is all it takes."""
    urls, domains = Counter(), Counter()
    rejected = poison = 0
    for payload in payloads:
        try:
            doc = json.loads(payload)
        except ValueError:
            rejected += 1
            continue
        url = doc.get("url") if isinstance(doc, dict) else None
        match = HOST.match(url) if isinstance(url, str) else None
        if match is None:
            rejected += 1
        elif ".." in match.group(1):
            poison += 1
        else:
            urls[url] += 1
            domains[match.group(1).lower()] += 1
    return {"url_counts": urls, "domain_counts": domains, "rejected": rejected,
            "poison": poison}


def assert_exact(conn, payloads: list[str]) -> None:
    want = oracle(payloads)

    def rows(query):
        with conn.cursor() as cur:
            cur.execute(query)
            out = cur.fetchall()
        conn.commit()
        return out

    for state in ("url_counts", "domain_counts"):
        got = dict(rows(f"SELECT key, value FROM {state} WHERE value <> 0"))  # noqa: S608
        assert got == dict(want[state]), state
    assert rows("SELECT count(*) FROM rejected_records") == [(want["rejected"],)]
    assert rows("SELECT count(*) FROM dead_letters") == [(want["poison"],)]
    assert rows("SELECT count(*) FROM backflow_items") == [(0,)]
    # committed ranges tile every partition from 0 to its head: nothing read twice or skipped
    ends: dict[int, int] = {}
    for partition, start, end in rows(
            """SELECT b.partition, b.start_offset, b.end_offset FROM batch_ranges b
               JOIN transactions t USING (pipeline, txid)
               WHERE t.state = 'committed' ORDER BY 1, 2"""):
        assert start == ends.get(partition, 0)
        ends[partition] = end
    heads = dict(rows("SELECT partition, next_offset FROM source_partitions"))
    assert ends == heads


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
    dsn = recreate_database(server, name)
    return dsn, lambda: crash_restart(data_dir)


def setup(dsn, events: int, **settings):
    pipeline = get_pipeline("tweets", **settings)
    payloads = list(generate(events, seed=SEED % 1000, malformed_share=0.04,
                             poison_share=0.01, flaky_share=0.02))
    conn = db.connect(dsn)
    register(conn, pipeline, create_source=True)
    pipeline.source.append(conn, payloads)
    return pipeline, payloads, conn


def test_a_postgres_crash_between_staging_and_commit_loses_nothing(spark, crashable,
                                                                   monkeypatch):
    """The outside fault run's finding: PostgreSQL crashed after staging (its unlogged
    tables emptied) and the retry committed an empty batch. Now the commit finds its staging
    is not whole, fails the attempt, and the batch is processed again."""
    from spark_tasks.processing import process_batch

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
    assert_exact(conn, payloads)


def test_a_postgres_crash_under_a_commit_transaction_loses_nothing(spark, crashable,
                                                                  monkeypatch):
    from spark_tasks.processing import process_batch

    dsn, crash = crashable
    monkeypatch.setenv("ONCEFLOW_PG_DSN", dsn)
    pipeline, payloads, conn = setup(dsn, 400, batch_size=400)
    batch = begin(conn, pipeline, "run-1")
    process_batch(spark, dsn, pipeline, batch.attempt)
    env = {**os.environ, "ONCEFLOW_PG_DSN": dsn}
    agent = subprocess.Popen(
        [sys.executable, "-m", "onceflow_testing.faults", "commit", "--pipeline", "tweets",
         "--settings", json.dumps({"batch_size": 400}), "--txid", "1", "--attempt", "1",
         "--pause-at", "offsets"], env=env, stdout=subprocess.PIPE, text=True)
    assert agent.stdout.readline().startswith("PAUSED commit:offsets")
    crash()  # the commit's transaction is cut off by the crash, then the agent goes
    agent.kill()
    agent.wait()
    conn = db.connect(dsn)
    with pytest.raises(StagingIncomplete):
        commit(conn, pipeline, batch.attempt)
    FaultRun(pipeline, dsn, spark, SEED).drain()
    assert_exact(conn, payloads)


def test_kills_inside_and_after_the_commit_apply_once(spark, dsn, conn):
    """SIGKILL of the committing process inside its transaction leaves nothing; after its
    COMMIT, the retry is a logged no-op."""
    from spark_tasks.processing import process_batch

    pipeline, payloads, conn = setup(dsn, 300, batch_size=300)
    batch = begin(conn, pipeline, "run-1")
    process_batch(spark, dsn, pipeline, batch.attempt)
    env = {**os.environ, "ONCEFLOW_PG_DSN": dsn}
    agent = ["commit", "--pipeline", "tweets", "--settings", json.dumps({"batch_size": 300}),
             "--txid", "1", "--attempt", "1"]
    assert run_and_kill([*agent, "--pause-at", "commit_record"], env) == "commit:commit_record"
    assert run_and_kill([*agent, "--pause-at", "after"], env) == "after commit"
    assert commit(conn, pipeline, batch.attempt).status == "already_committed"
    FaultRun(pipeline, dsn, spark, SEED).drain()
    assert_exact(conn, payloads)


@pytest.mark.parametrize("mode", ["transactional", "opaque"])
def test_randomized_faults_end_exact(spark, crashable, monkeypatch, capsys, mode):
    """Seeded (ONCEFLOW_FAULT_SEED, fixed by default), bounded: every kind of fault, drawn at
    every point, until 6 transactions committed; then a drain; then the oracle."""
    dsn, crash = crashable
    monkeypatch.setenv("ONCEFLOW_PG_DSN", dsn)
    settings = {"batch_size": 150, "mode": mode, "max_pending": 3}
    pipeline, payloads, conn = setup(dsn, 1500, **settings)
    run = FaultRun(pipeline, dsn, spark, SEED + (mode == "opaque"), settings=settings,
                   restart_postgres=crash, rate=0.2)
    run.run(transactions=6)
    run.drain()
    with capsys.disabled():
        print(f"\nfault run {mode} seed {run.seed}: {run.steps} steps, "
              f"faults {dict(run.faults)}")
    assert sum(run.faults.values()) >= 5
    conn = db.connect(dsn)
    assert_exact(conn, payloads)
    run.close()
