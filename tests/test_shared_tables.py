"""A table belongs to one pipeline (issue 48): two pipelines that declare the same state
(or upsert / append table) would overwrite each other's keys and delete each other's rows.
Refused when they load together (`onceflow pipelines`, `onceflow init`, the registry: exit 2,
naming both, nothing written), and by the coordinator's database when the other pipeline
registered the table earlier and is not loaded here (init, the first begin, the loop); on
real PostgreSQL and Spark, the first pipeline's state checked against a recount of the
records the test produced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter

import pytest

from helpers import produce, run_transaction, table
from onceflow.core.db import transaction, with_database
from onceflow.core.errors import Permanent, SharedTable
from onceflow.core.registration import claim_tables, ensure_ready, register
from onceflow.core.registry import clear_cache, pipelines

# Two teams' pipelines, each as a user writes it from the docs: both count keys into a state
# named by_k and keep every record in an append table named facts.
DECLARED = '''
from onceflow import ANCHORS, SPOUT, Pipeline, PostgresLog, StateSpec, Topology


def build(pipeline=None):
    from pyspark.sql import functions as F

    def parse(records):
        return records.select(*ANCHORS, F.get_json_object("payload", "$.k").alias("key"),
                              F.col("offset").alias("n"))

    return (Topology("keys").bolt("parse", input=SPOUT, fn=parse,
                                  outputs={"keys": "key string, n bigint"})
            .count("keys", "by_k").sink("keys", "facts"))


def declare(name, topic):
    return Pipeline(name=name, source=PostgresLog(topic=topic, partitions=1),
                    topology="shared_decl:build", batch_size=100,
                    states=(StateSpec("by_k"),
                            StateSpec.append("facts", columns={"key": "text", "n": "bigint"})))


FIRST = declare("first", "first_events")
SECOND = declare("second", "second_events")
BOTH = (FIRST, SECOND)
'''


@pytest.fixture
def declared(tmp_path, monkeypatch):
    """The module shared_decl importable here; the folder that holds it."""
    (tmp_path / "shared_decl.py").write_text(textwrap.dedent(DECLARED))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("ONCEFLOW_PIPELINES", raising=False)
    sys.modules.pop("shared_decl", None)
    clear_cache()
    yield tmp_path
    clear_cache()
    sys.modules.pop("shared_decl", None)


def cli(folder, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The onceflow command as a user runs it: their package on the path, the checkout's
    examples not (the registry finds what ONCEFLOW_PIPELINES names)."""
    return subprocess.run([sys.executable, "-m", "onceflow.cli", *args], capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(folder), **(env or {})})


def assert_names_both(text: str) -> None:
    assert "Traceback" not in text
    for part in ("table 'by_k'", "table 'facts'", "'first'", "'second'",
                 "not even on purpose", "Rename the state in one of them",
                 "source='by_k'", "source='facts'"):
        assert part in text, (part, text)


def events(n: int) -> list[str]:
    return [json.dumps({"k": f"k{i % 7}"}) for i in range(n)]


def recount(payloads: list[str]) -> Counter:
    """The test's own count of the keys it produced."""
    return Counter(json.loads(p)["k"] for p in payloads)


def by_k(conn) -> dict[str, int]:
    return dict(table(conn, "SELECT key, value FROM by_k"))


def test_two_pipelines_declaring_one_table_are_refused_at_load_naming_both(
        declared, monkeypatch, dsn, conn, server_dsn):
    """The registry refuses them (every command that loads pipelines, the DAG file too);
    `onceflow pipelines` and `onceflow init` exit 2 naming both, the tables and the fix, and
    init writes nothing: no database is created, no pipeline registered, no table made."""
    import psycopg2

    env = {"ONCEFLOW_PIPELINES": "shared_decl:BOTH"}
    monkeypatch.setenv("ONCEFLOW_PIPELINES", env["ONCEFLOW_PIPELINES"])
    with pytest.raises(SharedTable) as refused:
        pipelines()
    assert isinstance(refused.value, Permanent)
    message = str(refused.value)
    assert_names_both(message)
    assert "from shared_decl:BOTH" in message
    listed = cli(declared, "pipelines", env=env)
    assert listed.returncode == 2, listed.stdout + listed.stderr
    assert_names_both(listed.stderr)
    # init: refused before it touches the database, the test's or one it would create
    nowhere = f"onceflow_shared_{os.getpid()}"
    for target in (dsn, with_database(server_dsn, nowhere)):
        init = cli(declared, "init", env={**env, "ONCEFLOW_PG_DSN": target})
        assert init.returncode == 2, init.stdout + init.stderr
        assert_names_both(init.stderr)
        assert "migrations applied" not in init.stdout and "created" not in init.stdout
    assert table(conn, "SELECT count(*) FROM pipelines") == [(0,)]
    assert table(conn, "SELECT to_regclass('by_k'), to_regclass('facts')") == [(None, None)]
    assert table(conn, "SELECT count(*) FROM source_partitions") == [(0,)]
    admin = psycopg2.connect(with_database(server_dsn, "postgres"))
    try:
        with admin.cursor() as cur:
            cur.execute("SELECT count(*) FROM pg_database WHERE datname = %s", (nowhere,))
            assert cur.fetchone() == (0,)
    finally:
        admin.close()


@pytest.mark.timeout(300)
def test_a_table_another_pipeline_registered_is_refused_and_its_rows_stay_exact(
        declared, spark, dsn, conn):
    """The issue's case: pipeline first commits a txid; pipeline second, from a package not
    loaded with it, declares the same tables. Its `onceflow init`, its first begin and the
    loop are refused naming both, and nothing of it is written: first's keys and append rows
    stay what the test's own recount says. Dropping the tables releases them to second."""
    from shared_decl import FIRST, SECOND

    from onceflow.spark.loop import run_batches

    register(conn, FIRST, create_source=True)
    payloads = events(60)
    produce(conn, FIRST.topic, payloads)
    run_transaction(spark, dsn, conn, FIRST, "first-1")
    expected = recount(payloads)
    assert by_k(conn) == expected
    assert table(conn, "SELECT count(*), count(DISTINCT n) FROM facts") == [(60, 60)]

    init = cli(declared, "init", env={"ONCEFLOW_PIPELINES": "shared_decl:SECOND"})
    assert init.returncode == 2, init.stdout + init.stderr
    assert "Traceback" not in init.stderr
    for part in ("pipeline 'second' declares table 'by_k'", "pipeline 'first' registered",
                 "whether 'first' is loaded here or not", "table 'facts'",
                 "not even on purpose", "name='second_by_k', source='by_k'",
                 "drop the table instead"):
        assert part in init.stderr, (part, init.stderr)
    # the first begin of an Airflow run (BeginBatchOperator calls ensure_ready), the loop
    for attempt in (lambda: ensure_ready(conn, SECOND),
                    lambda: run_batches(spark, dsn, SECOND)):
        with pytest.raises(SharedTable, match="pipeline 'second' declares table 'by_k'"):
            attempt()
    # two registrations at once: the one that claims second is refused in its transaction
    with pytest.raises(SharedTable, match="which pipeline 'first' registered"), \
            transaction(conn) as cur:
        cur.execute("INSERT INTO pipelines (name, instance_id, topic) "
                    "VALUES ('second', gen_random_uuid(), 'second_events')")
        claim_tables(cur, SECOND)
    # nothing of second was written, and first's rows are whole
    assert table(conn, "SELECT name FROM pipelines") == [("first",)]  # no example: not loaded
    assert table(conn, "SELECT topic FROM source_partitions") == [("first_events",)]
    assert table(conn, "SELECT database, table_name, pipeline FROM state_table_owners "
                       "ORDER BY table_name") == [("", "by_k", "first"), ("", "facts", "first")]
    assert by_k(conn) == expected
    assert table(conn, "SELECT count(*), min(txid), max(txid) FROM facts") == [(60, 1, 1)]
    # first runs on, exactly
    more = events(30)
    produce(conn, FIRST.topic, more)
    ensure_ready(conn, FIRST)
    run_transaction(spark, dsn, conn, FIRST, "first-2")
    assert by_k(conn) == expected + recount(more)
    # once first's tables are dropped, second may make them anew; first is then refused
    with transaction(conn) as cur:
        cur.execute("DROP TABLE by_k, facts")
    init = cli(declared, "init", env={"ONCEFLOW_PIPELINES": "shared_decl:SECOND"})
    assert init.returncode == 0, init.stdout + init.stderr
    assert "pipeline second ready" in init.stdout
    assert table(conn, "SELECT table_name, pipeline FROM state_table_owners "
                       "ORDER BY table_name") == [("by_k", "second"), ("facts", "second")]
    with pytest.raises(SharedTable, match="pipeline 'first' declares table 'by_k'.*"
                                          "which pipeline 'second' registered"):
        ensure_ready(conn, FIRST)
