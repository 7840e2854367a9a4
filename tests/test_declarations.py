"""Declarations checked before data flows: a pipeline whose topology, sources and state tables
disagree is refused by `onceflow pipelines`, `onceflow init` and the run's begin, naming the
pipeline, the stream, the field and the fix, without Spark and without data; a value that does
not fit its declared type fails its record alone; a sum keeps the type it declares. The
declarations are tests/outside/amounts (a user's package, not installed)."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import OUTSIDE, produce, run_transaction, table
from onceflow import Count, Last, Max, Min, Pipeline, PostgresLog, StateSpec, Sum
from onceflow.core.errors import ConfigError, DeclarationError, Permanent, StateOverflow
from onceflow.core.registration import register
from onceflow.core.topology import SPOUT, Topology

DAGS = Path(__file__).resolve().parents[1] / "dags"


@pytest.fixture
def amounts(monkeypatch):
    """The amounts package importable (this process and those it starts)."""
    monkeypatch.syspath_prepend(str(OUTSIDE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(OUTSIDE), os.environ.get("PYTHONPATH")])))
    from onceflow.core.registry import clear_cache

    clear_cache()
    yield
    clear_cache()


def declared(topology: Topology, *states: StateSpec) -> Pipeline:
    return Pipeline(name="p", source=PostgresLog(topic="t"), topology=lambda _: topology,
                    states=states)


def orders(outputs: str = "merchant string, amount decimal(12,2), at timestamp") -> Topology:
    return (Topology("t").bolt("parse", input=SPOUT, fn=None, outputs={"orders": outputs})
            .sink("orders", "totals"))


def totals(**measures) -> StateSpec:
    return StateSpec("totals", key={"merchant": "text"}, measures=measures)


@pytest.mark.parametrize("pipeline, message", [
    # a measure on a column no stream has
    (declared(orders(), totals(largest=Max("amont", "numeric(12,2)"))),
     r"pipeline 'p': state 'totals' \(fed by sink 'totals'\): measures\['largest'\] = "
     r"Max\('amont', 'numeric\(12,2\)'\) reads column 'amont', which stream 'orders' "
     r"\(emitted by bolt 'parse'\) does not carry \(it has merchant, amount, at\): add it"),
    # a key column no stream has
    (declared(orders(), StateSpec("totals", key={"shop": "text"}, measures={"n": Count()})),
     r"state 'totals' \(fed by sink 'totals'\): key\['shop'\] reads column 'shop'"),
    # one name, two types (the spout's offset is a bigint)
    (declared(orders("merchant string, offset int"), totals(n=Count())),
     r"pipeline 'p': column 'offset' is bigint in stream 'records' \(the spout\) and int in "
     r"stream 'orders' \(bolt 'parse'\): one name has one type in a topology"),
    # decimals rounded away, a fraction or a time of day cut off: every value silently changed
    (declared(orders(), totals(revenue=Sum("amount", "numeric(12,1)"))),
     r"measures\['revenue'\] = Sum\('amount', 'numeric\(12,1\)'\) stores column 'amount' of "
     r"stream 'orders' \(emitted by bolt 'parse'\), a decimal\(12,2\), as numeric\(12,1\): "
     r"its 2 decimal places would be rounded to 1: declare a type that holds every value "
     r"\(e.g. numeric\(12,2\)\)"),
    (declared(orders(), totals(revenue=Sum("amount", "bigint"))),
     r"as bigint: the fraction of every value would be cut off"),
    (declared(orders(), totals(day=Min("at", "date"))),
     r"a timestamp, as date: the time of day would be cut off: declare a type that holds "
     r"every value \(e.g. timestamptz\)"),
    (declared(orders(), totals(flag=Last("amount", "boolean"))),
     r"a decimal\(12,2\) column does not convert to boolean"),
    # a sink into a name no state has: its tuples would be dropped
    (declared(orders().sink("orders", "other"), totals(n=Count())),
     r"sink of stream 'orders' \(emitted by bolt 'parse'\) into 'other': no state is fed by "
     r"'other'"),
    # a state no sink feeds
    (declared(orders(), totals(n=Count()), StateSpec("views")),
     r"state\(s\) fed by \['views'\] would stay empty: no sink of the topology feeds them"),
])
def test_a_declaration_the_topology_cannot_honour_is_refused_before_any_data(pipeline,
                                                                            message):
    with pytest.raises(DeclarationError, match=message) as refused:
        pipeline.build_topology()
    assert isinstance(refused.value, Permanent)  # retrying cannot help: no retries


def test_what_converts_without_loss_is_accepted():
    """A string is parsed per record, a decimal widens, an integer fits a numeric, a date a
    timestamp; a value out of range is its record's failure (test_topology), not the
    declaration's."""
    topology = orders("merchant string, amount decimal(12,2), at date, n int, code string")
    declared(topology, totals(revenue=Sum("amount", "numeric(6,2)"),
                              exact=Sum("amount", "numeric(20,4)"),
                              first=Min("at", "timestamptz"), most=Max("n", "numeric(4,0)"),
                              parsed=Last("code", "bigint"), n=Count("code"))).build_topology()


def test_a_failing_topology_function_is_named_without_a_traceback():
    def build(_):
        return {}["no such key"]

    pipeline = Pipeline(name="p", source=PostgresLog(topic="t"), topology=build,
                        states=(StateSpec("s"),))
    with pytest.raises(ConfigError, match=r"pipeline\[p\].topology=.* raised KeyError: 'no such "
                                          r"key' \(at .*test_declarations.py:\d+\): fix"):
        pipeline.build_topology()


def test_the_type_conflict_of_a_users_package_is_found_before_any_data(amounts):
    from amounts.pipelines import TYPE_CONFLICT

    with pytest.raises(DeclarationError, match=r"pipeline 'type_conflict': column 'amount' is "
                                            r"decimal\(12,2\) in stream 'orders' \(bolt 'parse'\) "
                                            r"and double in stream 'fees' \(bolt 'fees'\)"):
        TYPE_CONFLICT.build_topology()


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onceflow.cli", *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=600)


@pytest.mark.timeout(300)
def test_pipelines_and_init_name_a_bad_declaration_and_exit_2(amounts, dsn, conn):
    env = {"ONCEFLOW_PIPELINES": "amounts.pipelines:ALL"}
    listed = cli("pipelines", env=env)
    assert listed.returncode == 2, listed.stdout + listed.stderr
    assert "Traceback" not in listed.stdout + listed.stderr
    lines = listed.stdout.splitlines()
    assert any(line.startswith("amounts: postgres-log source 'amounts'") for line in lines)
    bad = [line for line in lines if line.startswith("missing_column: ")]
    assert bad and "DECLARATION ERROR" in bad[0], listed.stdout
    assert ("pipeline 'missing_column': state 'missing_column_totals' (fed by sink 'totals'): "
            "measures['largest'] = Max('amont', 'numeric(12,2)') reads column 'amont'"
            ) in listed.stdout
    assert "pipeline 'type_conflict': column 'amount' is decimal(12,2)" in listed.stdout
    # (the installed examples' pipelines are listed too)
    assert re.search(r"2 of \d+ pipelines have declaration errors", listed.stderr)

    one = cli("init", "--pipeline", "missing_column", env=env)
    assert one.returncode == 2 and "Traceback" not in one.stdout + one.stderr
    assert "onceflow init: error: pipeline 'missing_column': state 'missing_column_totals'" \
        in one.stderr
    every = cli("init", env=env)
    assert every.returncode == 2 and "Traceback" not in every.stdout + every.stderr
    assert "pipeline amounts ready" in every.stdout and "pipeline small_sum ready" in every.stdout
    assert "pipeline type_conflict not set up: pipeline 'type_conflict': column 'amount'" \
        in every.stderr
    # nothing of a refused pipeline was made: no coordinator row, no table
    made = {name for name, in table(conn, "SELECT name FROM pipelines")}
    assert {"amounts", "small_sum"} <= made and not {"missing_column", "type_conflict"} & made
    assert table(conn, "SELECT to_regclass('missing_column_totals') IS NULL") == [(True,)]


DAG_FILE = '''"""{name}: an Airflow DAG file of a user's own."""
from onceflow.airflow import transaction_dag
from amounts.pipelines import {name}

dag = transaction_dag({name})
'''


@pytest.mark.timeout(300)
def test_a_bad_declaration_parses_and_its_run_fails_in_begin_naming_it(
        amounts, airflow_db, conn, tmp_path, monkeypatch):
    """The scheduler's parse imports no topology (no Spark there): a DAG file of a bad
    declaration gives its DAG like a good one. Its run fails in begin, on its first try
    (retrying cannot help), before any txid is planned, with the error naming the pipeline,
    the state, the measure and the column."""
    from airflow.dag_processing.dagbag import DagBag

    from onceflow.airflow.operators import BeginBatchOperator
    from onceflow.core.registry import clear_cache
    from onceflow.dev.demo import load_dag

    (tmp_path / "good_amounts.py").write_text(DAG_FILE.format(name="AMOUNTS"))
    (tmp_path / "bad_amounts.py").write_text(DAG_FILE.format(name="MISSING_COLUMN"))
    bag = DagBag(dag_folder=str(tmp_path))
    assert not bag.import_errors, bag.import_errors
    assert sorted(bag.dags) == ["onceflow_amounts", "onceflow_missing_column"]

    # its run, from the DAGs folder's file (dag.test() runs what that folder holds)
    monkeypatch.setenv("ONCEFLOW_PIPELINES", "amounts.pipelines:MISSING_COLUMN")
    clear_cache()
    dr = load_dag(DAGS, "onceflow_missing_column").test()
    tis = {ti.task_id: ti for ti in dr.get_task_instances()}
    assert str(dr.state) == "failed"
    assert str(tis["begin"].state) == "failed" and tis["begin"].try_number == 1
    assert table(conn, "SELECT count(*) FROM transactions") == [(0,)]
    # what the failed begin said (the same call, outside Airflow's task runner)
    begin_task = BeginBatchOperator(task_id="begin", pipeline="missing_column",
                                    pipeline_refs=["amounts.pipelines:MISSING_COLUMN"])
    with pytest.raises(Exception, match=re.escape(
            "pipeline 'missing_column': state 'missing_column_totals' (fed by sink 'totals'): "
            "measures['largest'] = Max('amont', 'numeric(12,2)') reads column 'amont', which "
            "stream 'orders' (emitted by bolt 'parse') does not carry")) as refused:
        begin_task._begin({"params": {}, "run_id": "manual"})
    assert type(refused.value).__name__ == "AirflowFailException"  # no retry


PARSE = """
import json, os, sys
from airflow.dag_processing.dagbag import DagBag

bag = DagBag(dag_folder=sys.argv[1])
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("pyspark", "pyarrow", "numpy"))
postgres = sorted(m for m in sys.modules
                  if m.startswith("airflow.providers.postgres.hooks") or m == "psycopg")
from onceflow.core.registry import get_pipeline

get_pipeline("page_views").build_topology()  # what begin and `onceflow pipelines` do
print(json.dumps({"dags": sorted(bag.dags), "errors": {k: str(v) for k, v in
                  bag.import_errors.items()}, "parse": loaded, "postgres": postgres, "check": len(
                  [m for m in sys.modules if m.startswith("pyspark.")])}))
"""


@pytest.mark.timeout(300)
def test_parsing_the_dag_file_loads_no_pyspark_module(airflow_db, tmp_path):
    """dags/onceflow_pipelines.py parsed as Airflow's DAG processor does, in a fresh
    interpreter, with a user's pipeline whose topology module imports pyspark.sql.functions
    at its top (tests/outside/pageviews) and the examples' registered: every DAG is there
    and not one pyspark, pyarrow or numpy module was imported, nor the postgres provider's
    hook (issue 52: every task process parses the DAG file). The
    declaration check, run after the parse in the same process, does import pyspark (the
    count means something)."""
    env = {**os.environ, "ONCEFLOW_PIPELINES": "pageviews.pipelines:PAGE_VIEWS",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(OUTSIDE),
                                                       os.environ.get("PYTHONPATH")]))}
    assert "from pyspark.sql import functions as F" in \
        (OUTSIDE / "pageviews" / "topology.py").read_text()
    done = subprocess.run([sys.executable, "-c", PARSE, str(DAGS)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert not out["errors"], out["errors"]
    assert {"onceflow_page_views", "onceflow_tweets", "onceflow_orders"} <= set(out["dags"])
    assert out["parse"] == []
    # nor the postgres provider's hook (and its psycopg 3): tasks look connections up
    # through the Task SDK
    assert out["postgres"] == []
    assert out["check"] > 50


def order(merchant: str, amount: str) -> str:
    return f'{{"merchant": "{merchant}", "amount": {amount}}}'


def recount(orders: list[tuple[str, str]], fits) -> dict[str, tuple]:
    """Per merchant (revenue, largest, orders) of the orders ``fits`` keeps: plain Python
    over the list the test wrote."""
    out: dict[str, list] = {}
    for merchant, amount in orders:
        value = Decimal(amount)
        if fits(value):
            t = out.setdefault(merchant, [Decimal(0), value, 0])
            t[0] += value
            t[1] = max(t[1], value)
            t[2] += 1
    return {m: tuple(t) for m, t in out.items()}


@pytest.mark.timeout(600)
def test_a_value_its_measure_cannot_hold_fails_its_record_and_the_rest_commits(
        amounts, spark, dsn, conn):
    """`largest` is a Max in numeric(5,2) over amounts that reach thousands, next to a Sum
    in numeric(12,2) of the same column: a record over 999.99 is a dead letter (max_replays
    0) naming the table, the measure, the value and the type; every other record counts,
    exactly as a recount says. (It failed the whole txid in Spark's cast before.)"""
    from amounts.pipelines import AMOUNTS

    register(conn, AMOUNTS, create_source=True)
    rng = random.Random(37)
    orders = [(rng.choice("abc"), f"{rng.randrange(1, 99999) / 100:.2f}") for _ in range(40)]
    orders[7], orders[23] = ("b", "1780.25"), ("c", "5000.00")
    produce(conn, AMOUNTS.topic, [order(m, a) for m, a in orders])
    batch, result = run_transaction(spark, dsn, conn, AMOUNTS, "run-1")
    assert result.status == "committed" and result.dead == 2 and batch.records == 40
    want = recount(orders, lambda v: v <= Decimal("999.99"))
    got = {m: (revenue, largest, n) for m, revenue, largest, n in table(
        conn, "SELECT merchant, revenue, largest, orders FROM amounts_totals")}
    assert got == want and sum(n for _, _, n in got.values()) == 38
    dead = {error for errors, in table(conn, "SELECT errors FROM dead_letters") for error in errors}
    assert dead == {f"table amounts_totals: measures['largest'] = Max('amount', 'numeric(5,2)'):"
                    f" value {value} does not fit numeric(5,2)" for value in ("1780.25", "5000.00")}


@pytest.mark.timeout(600)
def test_a_sum_keeps_its_declared_numeric_6_2_end_to_end(amounts, spark, dsn, conn):
    """The table's revenue is the numeric(6,2) declared. An amount over 9999.99 fails its
    record alone; a running total past it refuses the commit whole, naming the state, the
    key, the column, the type and the fix, and nothing of the txid is written; with the fix
    done (a wider type declared, the table altered) the txid's next attempt commits, and
    the table equals a recount."""
    from airflow.sdk.exceptions import AirflowFailException
    from amounts.pipelines import SMALL_SUM

    from onceflow.airflow.operators import airflow_outcomes, mark_transaction_failed
    from onceflow.core.begin import begin
    from onceflow.core.commit import commit
    from onceflow.core.connections import DEFAULT_CONN_ID
    from onceflow.ops.status import pipeline_status, render
    from onceflow.spark.processing import process_batch

    register(conn, SMALL_SUM, create_source=True)
    assert table(conn, """SELECT format_type(atttypid, atttypmod) FROM pg_attribute
                          WHERE attrelid = 'small_sum_totals'::regclass
                            AND attname = 'revenue'""") == [("numeric(6,2)",)]
    first = [("a", "4000.00"), ("a", "3000.00"), ("b", "10.00"), ("c", "12345.67")]
    produce(conn, SMALL_SUM.topic, [order(m, a) for m, a in first])
    _, result = run_transaction(spark, dsn, conn, SMALL_SUM, "run-1")
    assert result.status == "committed" and result.dead == 1
    assert table(conn, "SELECT errors FROM dead_letters") == [(
        ["table small_sum_totals: measures['revenue'] = Sum('amount', 'numeric(6,2)'): value "
         "12345.67 does not fit numeric(6,2)"],)]

    second = [("a", "3500.00"), ("b", "5.00")]
    produce(conn, SMALL_SUM.topic, [order(m, a) for m, a in second])
    batch = begin(conn, SMALL_SUM, "run-2")
    process_batch(spark, dsn, SMALL_SUM, batch.attempt, 0)
    with pytest.raises(AirflowFailException) as failed:  # no retries: it cannot help
        with airflow_outcomes():
            commit(conn, SMALL_SUM, batch.attempt)
    refused = failed.value.__cause__
    assert isinstance(refused, StateOverflow) and isinstance(refused, Permanent)
    assert str(refused).startswith(
        "pipeline 'small_sum', txid 2 attempt 1: state small_sum_totals: measures['revenue'] = "
        "Sum('amount', 'numeric(6,2)') for key (merchant='a') would be 10500.00 (the table "
        "holds 7000.00, txid 2 adds 3500.00): over numeric(6,2), the type its declaration "
        "gives column revenue. No record is at fault")
    assert "(ALTER TABLE small_sum_totals ALTER COLUMN revenue TYPE numeric(9,2), ALTER " \
           "COLUMN prev_revenue TYPE numeric(9,2))" in str(refused)
    assert table(conn, "SELECT merchant, revenue, txid FROM small_sum_totals ORDER BY 1") == [
        ("a", Decimal("7000.00"), 1), ("b", Decimal("10.00"), 1)]
    assert table(conn, "SELECT last_committed_txid FROM pipelines") == [(1,)]

    # the commit task's last failure marks the txid failed, as permanent: status says to
    # fix it first (the reason, whole, is the fix), never only to run it again
    mark_transaction_failed({"task": SimpleNamespace(
        task_id="commit", postgres_conn_id=DEFAULT_CONN_ID,
        batch={"pipeline": "small_sum", "txid": 2, "attempt": 1}),
        "exception": failed.value, "run_id": "run-2"})
    with conn.cursor() as cur:
        status = pipeline_status(cur, SMALL_SUM.source, "small_sum")
    conn.commit()
    [stuck] = status.stuck
    assert (stuck.txid, stuck.state, stuck.permanent) == (2, "failed", True)
    assert stuck.holds.startswith("attempt 1 failed: commit failed in run run-2: StateOverflow: "
                                  "pipeline 'small_sum', txid 2 attempt 1: state small_sum_totals")
    assert stuck.fix.startswith("retrying cannot help until its cause is fixed") and \
        stuck.fix.endswith("then: onceflow backfill --pipeline small_sum")
    lines = render(status)
    assert max(map(len, lines)) <= 100
    text = " ".join(line.strip() for line in lines)
    assert "ALTER TABLE small_sum_totals ALTER COLUMN revenue TYPE numeric(9,2)" in text
    assert "-> once their cause is fixed (a bolt, a declared type): onceflow " \
           "replay-dead-letters --pipeline small_sum --error-contains TEXT" in text

    # the fix the message gives; the next run adopts the txid
    with conn.cursor() as cur:
        cur.execute("ALTER TABLE small_sum_totals ALTER COLUMN revenue TYPE numeric(9,2), "
                    "ALTER COLUMN prev_revenue TYPE numeric(9,2)")
    conn.commit()
    spec = SMALL_SUM.states[0]
    wider = SMALL_SUM.with_settings(states=(dataclasses.replace(spec, measures={
        **dict(spec.measures), "revenue": Sum("amount", "numeric(9,2)")}),))
    register(conn, wider)  # the altered table is what the new declaration needs
    again, result = run_transaction(spark, dsn, conn, wider, "run-3")
    assert again.attempt.txid == 2 and again.attempt.attempt == 2
    assert result.status == "committed"
    want = recount(first + second, lambda v: v <= Decimal("9999.99"))
    assert {m: (revenue, n) for m, revenue, n in table(
        conn, "SELECT merchant, revenue, orders FROM small_sum_totals")} == {
        m: (revenue, n) for m, (revenue, _, n) in want.items()}


def test_status_suggests_a_rerun_only_where_it_can_help():
    """A permanently failed txid: fix first; a txid after it: after that fix; a transient
    failure and a dead run: a re-run; a planned txid waiting its turn: nothing."""
    from onceflow.core.txlog import TxRow, TxState
    from onceflow.ops.status import _stuck

    def row(txid, state, permanent=False, silent_s=None):
        return TxRow(txid, 1, state, f"run-{txid}", 10, 0, None, None, None, None,
                     f"why {txid}", None, silent_s, 60, permanent=permanent)

    rows = [row(2, TxState.FAILED), row(3, TxState.FAILED, permanent=True),
            row(4, TxState.FAILED), row(5, TxState.PLANNED, silent_s=600),
            row(6, TxState.PLANNED, silent_s=1)]
    fixes = {s.txid: (s.permanent, s.fix) for s in _stuck("p", rows, last_committed=1)}
    backfill = "onceflow backfill --pipeline p"
    assert fixes == {
        2: (False, f"the next run adopts it; now: {backfill}"),
        3: (True, "retrying cannot help until its cause is fixed: do what the reason says (a "
                  f"declaration, a state table, a setting), then: {backfill}"),
        4: (False, f"once txid 3 is fixed, {backfill} re-runs both in txid order"),
        5: (False, f"once txid 3 is fixed, {backfill} re-runs both in txid order"),
        6: (False, "if its run is dead, free it now: onceflow release --pipeline p --txid 6")}


def test_a_module_that_fails_to_declare_is_named_without_a_traceback(tmp_path, monkeypatch):
    """The guide's old TableSource example had no topic: importing the declaration raised a
    TypeError, which every command showed as a traceback."""
    from onceflow.core.registry import load_ref

    (tmp_path / "no_topic.py").write_text(
        "from onceflow import Pipeline, StateSpec, TableSource\n"
        "ORDERS = Pipeline(name='orders', topology='x:y', states=(StateSpec('n'),),\n"
        "                  source=TableSource(table='public.orders', key='order_id'))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"pipeline reference='no_topic:ORDERS': importing "
                                          r"module 'no_topic' raised TypeError: .*missing 1 "
                                          r"required keyword-only argument: 'topic' \(at "
                                          r".*no_topic.py:3\): fix the module"):
        load_ref("no_topic:ORDERS")


def test_a_spark_submit_process_task_fails_a_bad_declaration_once_before_the_driver(
        amounts, dsn, conn, spark_submit):
    """A DAG parsed before the declaration went bad: its process task (spark-submit) checks
    the declaration itself and fails without retries, before starting a driver that would
    fail on every retry."""
    from airflow.sdk.exceptions import AirflowFailException
    from amounts.pipelines import MISSING_COLUMN

    from onceflow.airflow.operators import ProcessBatchOperator
    from onceflow.core.begin import begin

    register(conn, MISSING_COLUMN, create_source=True)
    produce(conn, MISSING_COLUMN.topic, [order("a", "1.00")])
    batch = begin(conn, MISSING_COLUMN, "run-1")
    task = ProcessBatchOperator(task_id="process", pipeline="missing_column",
                                pipeline_refs=["amounts.pipelines:ALL"],
                                batch={"txid": 1, "attempt": 1, "group": 0})
    with pytest.raises(AirflowFailException, match=r"DeclarationError: pipeline "
                                                   r"'missing_column': state "):
        task._process({"ti": SimpleNamespace(try_number=1)}, batch.attempt, 0)
