"""Records retention deleted from a Kafka partition (the PartitionManager's "offset out of
range"): gone before they were read, they are a gap with its count in `onceflow status`,
never a silent skip and never a stall; the result is exact against an oracle over the
records the test produced less the ones deleted.

Tansu's memory engine honours neither retention.ms / retention.bytes nor DeleteRecords (it
panics "not yet implemented"), so these tests run Tansu on its S3 storage engine over a small
object store in the test process (tests/s3_store.py) and delete a partition's oldest record
batches there, as Kafka's retention deletes a partition's oldest segments. Tansu then answers
the new log start itself; its fetch below it answers the first batch kept, without an error:
the source's own check of the log start is what names the gap."""

from __future__ import annotations

import pytest
from kafka_broker import Tansu
from s3_store import S3Store
from test_kafka_source import REF, TOPIC, assert_exact, cli, committed_offsets, register_views
from test_outside_pipeline import payloads

from helpers import outside_pipeline, run_transaction, table
from onceflow.core.begin import begin, mark_failed


@pytest.fixture
def broker(tmp_path, monkeypatch):
    store = S3Store().start()
    b = Tansu(tmp_path, storage="s3://tansu/", env=store.env()).start()
    b.store = store
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA_DEFAULT", b.conn_json())
    try:
        yield b
    finally:
        b.stop()
        store.stop()


@pytest.fixture
def views(broker, monkeypatch):
    broker.create_topic(TOPIC, 3)
    with outside_pipeline(monkeypatch, REF):
        from onceflow.core.registry import get_pipeline

        yield get_pipeline("kafka_views")


def delete_below(broker, partition: int, offset: int) -> int:
    """Delete the partition's record batches below ``offset`` from the broker's storage (one
    record per batch, tests/kafka_broker.py): what retention does. Returns how many."""
    prefix = f"clusters/tansu_cluster/topics/{TOPIC}/partitions/{partition:010d}/records/"
    gone = [k for k in broker.store.keys(prefix) if int(k[len(prefix):][:20]) < offset]
    broker.store.delete(gone)
    return len(gone)


def log_start(views, partition: int) -> int:
    return views.source.positions(None)[partition].log_start


def run_until_done(spark, dsn, conn, views, prefix: str) -> None:
    for i in range(8):  # the batches left and the failures' replays
        batch, _ = run_transaction(spark, dsn, conn, views, f"{prefix}{i}")
        if batch.records == 0 and batch.replayed == 0:
            return
    raise AssertionError("the pipeline did not catch up in 8 batches")


def test_records_deleted_before_they_were_planned_are_a_gap(views, broker, dsn, conn, spark):
    """Committed up to 50 in each partition; retention then deletes partition 0 below 70
    (20 records nobody read) and partition 1 below 40 (read already). The next begin jumps
    partition 0 to its log start and records [50, 70) as a gap of 20; status names it."""
    register_views(conn, views)
    produced = broker.produce(TOPIC, payloads(300, seed=21), partitions=3)
    run_transaction(spark, dsn, conn, views, "r1")
    assert committed_offsets(conn) == {0: 50, 1: 50, 2: 50}
    assert delete_below(broker, 0, 70) == 70 and delete_below(broker, 1, 40) == 40
    assert log_start(views, 0) == 70 and log_start(views, 1) == 40  # the broker's own answer
    batch = begin(conn, views, "r2")
    assert {r.partition: r.start for r, _ in batch.ranges if r.size} == {0: 70, 1: 50, 2: 50}
    assert table(conn, "SELECT partition, from_offset, to_offset, policy FROM offset_gaps "
                       "WHERE pipeline = 'kafka_views'") == [(0, 50, 70, "out_of_range=earliest")]
    from onceflow.core.commit import commit
    from onceflow.kvstate import open_state_provider
    from onceflow.spark.processing import process_batch

    process_batch(spark, dsn, views, batch.attempt, 0)
    commit(conn, views, batch.attempt, open_state=open_state_provider)
    run_until_done(spark, dsn, conn, views, "r3-")
    # the oracle: every produced record but the 20 retention took before they were read
    assert_exact(conn, [r for r in produced if not (r[0] == 0 and 50 <= r[1] < 70)])
    assert committed_offsets(conn) == {0: 100, 1: 100, 2: 100}
    status = cli("status", "--pipeline", "kafka_views")
    assert status.returncode == 0, status.stdout + status.stderr  # a gap is said, no stall
    assert "p0: [50,70) 20 records, txid 2, out_of_range=earliest" in status.stdout
    assert "p0: log_start=70 head=100 committed=100 lag=0" in status.stdout
    assert "p1: [" not in status.stdout.split("gaps (records gone")[1].split("backflow")[0]


def test_records_deleted_under_a_planned_batch_fail_it_then_are_a_gap(views, broker, dsn,
                                                                     conn, spark):
    """txid 2 planned from 50 in each partition; retention then deletes partition 2 below
    65. Processing fails naming the range (Tansu would hand out the batch from 65 without a
    word); the next attempt re-plans partition 2 from 65, records [50, 65) as a gap of 15,
    and the result is exact over what is left."""
    from onceflow.spark.processing import process_batch

    register_views(conn, views)
    produced = broker.produce(TOPIC, payloads(300, seed=22), partitions=3)
    run_transaction(spark, dsn, conn, views, "r1")
    batch = begin(conn, views, "r2")
    assert {r.partition: r.start for r, _ in batch.ranges if r.size} == {0: 50, 1: 50, 2: 50}
    assert delete_below(broker, 2, 65) == 65
    with pytest.raises(Exception, match=r"SourceShortfall: Kafka topic 'page_views' partition "
                                        r"2 offsets \[50, \d+\): the log starts at 65: "
                                        r"retention deleted records of a planned batch"):
        process_batch(spark, dsn, views, batch.attempt, 0)
    assert committed_offsets(conn) == {0: 50, 1: 50, 2: 50}
    assert table(conn, "SELECT count(*) FROM offset_gaps")[0][0] == 0  # not yet: not read
    # what the failed task's handler does; the next run adopts the txid
    assert mark_failed(conn, "kafka_views", batch.attempt, "SourceShortfall")
    again = begin(conn, views, "r3")
    assert again.attempt.txid == batch.attempt.txid and again.attempt.attempt == 2
    assert {r.partition: r.start for r, _ in again.ranges if r.size} == {0: 50, 1: 50, 2: 65}
    assert table(conn, "SELECT partition, from_offset, to_offset FROM offset_gaps "
                       "WHERE pipeline = 'kafka_views'") == [(2, 50, 65)]
    from onceflow.core.commit import commit
    from onceflow.kvstate import open_state_provider

    process_batch(spark, dsn, views, again.attempt, 0)
    commit(conn, views, again.attempt, open_state=open_state_provider)
    run_until_done(spark, dsn, conn, views, "r4-")
    assert_exact(conn, [r for r in produced if not (r[0] == 2 and 50 <= r[1] < 65)])
    assert committed_offsets(conn) == {0: 100, 1: 100, 2: 100}
    status = cli("status", "--pipeline", "kafka_views")
    assert status.returncode == 0, status.stdout + status.stderr
    assert "p2: [50,65) 15 records, txid 2, out_of_range=earliest" in status.stdout
