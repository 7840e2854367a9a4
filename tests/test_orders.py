"""The orders example end to end on real PostgreSQL and Spark: typed state (composite key,
numeric sum, count, max), an append table and an upsert table, from the user's own table
written by concurrent writers that commit out of order while batches run, and from Parquet
files landing during a run. The oracle is the example's own (plain SQL / Python over the
orders, none of onceflow's bookkeeping)."""

from __future__ import annotations

import dataclasses
import time

import pytest

from onceflow.core import db
from onceflow.core.begin import mark_failed
from onceflow.core.registration import register
from onceflow.core.registry import get_pipeline
from onceflow.ops.verify import recount, rerun
from orders_example import data
from tests.helpers import run_transaction, table


def drain(spark, dsn, conn, pipeline, *, while_running=lambda: False, max_runs: int = 60):
    """Transactions until the writers are done and a batch reads nothing new."""
    runs = 0
    while True:
        busy = while_running()
        batch, result = run_transaction(spark, dsn, conn, pipeline, f"r{runs}")
        assert result.status in ("committed", "already_committed"), result
        runs += 1
        if not busy and batch.records == 0 and batch.replayed == 0:
            return runs
        assert runs < max_runs, "the pipeline did not catch up"


@pytest.fixture
def orders(conn, dsn):
    data.create_table(conn)
    pipeline = get_pipeline("orders", batch_size=400)
    register(conn, pipeline)
    return pipeline


@pytest.mark.timeout(600)
def test_concurrent_writers_out_of_order_every_row_exactly_once(spark, dsn, conn, orders):
    generated = list(data.generate(2500, seed=5))
    writers = data.Writers(dsn, generated, writers=4, max_hold_s=0.05).start()
    runs = drain(spark, dsn, conn, orders, while_running=lambda: writers.running)
    writers.join()
    assert writers.written == 2500
    want = data.expected_from_table(conn)
    got = data.committed(conn)
    assert data.differences(want, got) == []
    assert want.orders == 2500 and sum(n for _, n, _ in got.revenue.values()) \
        == 2500 - want.refunds
    assert runs >= 3
    # large orders carry the txid that committed them, once each
    assert table(conn, "SELECT count(*), count(DISTINCT order_id) FROM large_orders") == [
        (sum(want.large.values()), sum(want.large.values()))]
    report = rerun(conn, dsn, orders, spark)
    assert report.ok, report.mismatches
    assert report.keys["merchant_day_revenue"] == len(want.revenue)
    report = recount(conn, orders)
    assert report.ok, report.mismatches
    # typed states in a range check: an append table's rows of the range, the measures of
    # the keys the range wrote last (previous values combined with the batch). The range is
    # two txids where the first committed a large order and the second last wrote a revenue
    # row (which txids those are depends on how the writers' rows fell into batches).
    first = table(conn, """SELECT min(l.txid) FROM large_orders l WHERE EXISTS (
                               SELECT 1 FROM merchant_day_revenue r WHERE r.txid = l.txid + 1)""")
    first = first[0][0]
    assert first is not None, "no large order in a txid followed by a revenue row"
    assert rerun(conn, dsn, orders, spark, txids=(first, first + 1)).ok
    with conn.cursor() as cur:
        cur.execute("""UPDATE merchant_day_revenue SET revenue = revenue + 1
                       WHERE (merchant, day) = (SELECT merchant, day FROM merchant_day_revenue
                                                WHERE txid = %s ORDER BY 1, 2 LIMIT 1)""",
                    (first + 1,))
        assert cur.rowcount == 1
        cur.execute("""UPDATE large_orders SET amount = amount + 1
                       WHERE order_id = (SELECT min(order_id) FROM large_orders
                                         WHERE txid = %s)""", (first,))
        assert cur.rowcount == 1
    conn.commit()
    report = rerun(conn, dsn, orders, spark, txids=(first, first + 1))
    assert report.found == 3 and report.outside == 0, report.mismatches  # a row: 2 mismatches
    assert sum(m.startswith("merchant_day_revenue[") and f"txid {first + 1}: " in m
               and "'revenue'" in m for m in report.mismatches) == 1, report.mismatches


@pytest.mark.timeout(600)
def test_a_failed_attempt_and_an_error_between_two_databases_leave_exact_state(
        spark, dsn, conn, second_dsn, monkeypatch):
    """States in a second database (conn_id): the commit applies them there first, then
    commits the coordinator. An error in between (raised in this process; a SIGKILL there is
    tests/test_faults_outside.py's), then a new attempt: the opaque previous values undo the
    first write, the append table replaces its txid's rows."""
    from onceflow.core import commit as commit_module
    from onceflow.core.begin import begin
    from onceflow.spark.processing import process_batch

    data.create_table(conn)
    base = get_pipeline("orders", batch_size=300)
    states = tuple(dataclasses.replace(s, conn_id="orders_state") for s in base.states)
    pipeline = base.with_settings(states=states)
    monkeypatch.setenv("AIRFLOW_CONN_ORDERS_STATE", _conn_json(second_dsn))
    register(conn, pipeline)
    generated = list(data.generate(900, seed=9))
    data.Writers(dsn, generated, writers=1, max_hold_s=0).start().join()

    run_transaction(spark, dsn, conn, pipeline, "first")
    batch = begin(conn, pipeline, "second")
    process_batch(spark, dsn, pipeline, batch.attempt, 0)

    def crash(step: str) -> None:
        if step.startswith("external:") and step.endswith("large_orders"):
            raise RuntimeError("the commit task died after writing the second database")

    with pytest.raises(RuntimeError, match="died"):
        commit_module.commit(conn, pipeline, batch.attempt, on_step=crash)
    # the task's last retry failed too: the next run adopts the txid with a new attempt
    mark_failed(conn, pipeline.name, batch.attempt, "crashed (test)")
    drain(spark, dsn, conn, pipeline)
    with db.connection(second_dsn) as other:
        got = data.committed(other, coordinator=conn)
    assert data.differences(data.expected_from_table(conn), got) == []
    report = rerun(conn, dsn, pipeline, spark)
    assert report.ok, report.mismatches


def _conn_json(dsn: str) -> str:
    from onceflow.dev.localenv import airflow_connection_json

    return airflow_connection_json(dsn)


@pytest.mark.timeout(600)
def test_parquet_files_landing_during_a_run(spark, dsn, conn, tmp_path, monkeypatch):
    landing = tmp_path / "landing"
    landing.mkdir()
    base = get_pipeline("orders_files", batch_size=700)
    pipeline = base.with_settings(source=dataclasses.replace(base.source, path=str(landing),
                                                             settle_s=0.0))
    register(conn, pipeline, create_source=True)
    generated = list(data.generate(3000, seed=21, start_id=1))
    chunks = [generated[i:i + 500] for i in range(0, 3000, 500)]
    (landing / "half-written.parquet.tmp").write_bytes(b"PAR1 not yet")  # never read
    landed = []
    for i, chunk in enumerate(chunks):
        landed.append(data.land_parquet(landing, chunk, f"orders-{i:03d}.parquet"))
        time.sleep(0.01)  # arrival order by modification time
        run_transaction(spark, dsn, conn, pipeline, f"during-{i}")
    drain(spark, dsn, conn, pipeline)
    want = data.expected_from_rows(generated)
    got = data.committed(conn, prefix="files_")
    assert data.differences(want, got) == []
    assert table(conn, "SELECT count(*) FROM landing_files WHERE topic = 'orders_files'") \
        == [(6,)]
    report = rerun(conn, dsn, pipeline, spark)
    assert report.ok, report.mismatches
    # a file rewritten after every record of it was read: the next begin marks it changed
    # (status names it) and goes on; a re-run of its batches (verify) is refused, named
    # with the reason, and the other txids are still checked
    data.land_parquet(landing, chunks[0][:10], landed[0].name)
    from onceflow.core.begin import begin

    assert begin(conn, pipeline, "after-change").records == 0
    [(changed,)] = table(conn, "SELECT changed FROM landing_files WHERE path = %s",
                         (str(landed[0]),))
    assert changed.startswith("its size went from ")
    report = rerun(conn, dsn, pipeline, spark)
    assert report.unreadable and not report.found, report.mismatches
    assert all(why.startswith("SourceChanged: ") and "orders-000.parquet' changed after it was "
               "indexed: its footer (metadata" in why for why in report.unreadable.values())
    assert 0 < report.txids_checked == report.txids - len(report.unreadable)
