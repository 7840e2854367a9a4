"""Partitioned source and partition offsets (the PartitionManager, without its traps):
restarts, resets, start policies, new partitions, retention under each policy, caps."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from helpers import run_transaction, table, tweets_pipeline
from onceflow.cli import main
from onceflow.coordinator import OffsetOutOfRange, begin, register, reset_offsets
from onceflow.examples.tweets import generate
from onceflow.pipeline import ConfigError, get_pipeline
from onceflow.retention import delete_before
from onceflow.source import ensure_topic, produce
from onceflow.verify import verify


def ranges_of(batch):
    return [(r.partition, r.start, r.end) for r, _ in batch.ranges]


def offsets(conn):
    return table(conn, 'SELECT partition, "offset" FROM partition_offsets ORDER BY 1')


def test_a_restart_resumes_exactly_from_the_committed_offsets(spark, conn, dsn):
    pipeline = tweets_pipeline(conn, events=400, batch_size=120, partitions=2)
    run_transaction(spark, dsn, conn, pipeline, "run-1")
    instance = table(conn, "SELECT instance_id FROM pipelines")
    # a restart (a new deployment): register again, new connections
    from onceflow.db import connect

    conn2 = connect(dsn)
    register(conn2, get_pipeline("tweets", batch_size=120, partitions=2))
    assert table(conn2, "SELECT instance_id FROM pipelines") == instance  # same pipeline
    assert ranges_of(begin(conn2, pipeline, "run-2")) == [(0, 60, 120), (1, 60, 120)]
    conn2.close()


def test_force_from_start_reads_again_from_the_policy_start_and_is_logged(
        spark, conn, dsn, caplog):
    pipeline = tweets_pipeline(conn, events=200, batch_size=100, partitions=2)
    run_transaction(spark, dsn, conn, pipeline, "run-1")
    open_batch = begin(conn, pipeline, "run-2")
    with pytest.raises(ConfigError, match="txids 2 are not committed"):
        reset_offsets(conn, pipeline)
    from onceflow.committer import commit
    from spark_tasks.processing import process_batch

    process_batch(spark, dsn, pipeline, open_batch.attempt)
    commit(conn, pipeline, open_batch.attempt)
    old = table(conn, "SELECT instance_id FROM pipelines")
    new = reset_offsets(conn, pipeline)
    assert table(conn, "SELECT instance_id::text FROM pipelines") == [(str(new),)] != old
    assert "RESET pipeline=tweets" in caplog.text
    assert ranges_of(begin(conn, pipeline, "run-3")) == [(0, 0, 50), (1, 0, 50)]


def test_start_policy_latest_skips_the_past_and_keeps_its_start(spark, conn, dsn):
    pipeline = tweets_pipeline(conn, events=100, partitions=2, start_policy="latest")
    first = begin(conn, pipeline, "run-1")
    # nothing new yet, but the chosen start is stored, so later records are not skipped
    assert ranges_of(first) == [(0, 50, 50), (1, 50, 50)]
    produce(conn, "tweets", generate(10, seed=9))
    from onceflow.committer import commit
    from spark_tasks.processing import process_batch

    process_batch(spark, dsn, pipeline, first.attempt)
    commit(conn, pipeline, first.attempt)
    assert ranges_of(begin(conn, pipeline, "run-2")) == [(0, 50, 55), (1, 50, 55)]


def test_start_policy_timestamp_starts_at_the_first_record_produced_since(conn):
    tweets_pipeline(conn, events=40, partitions=2)
    with conn.cursor() as cur:  # the first 10 offsets of each partition are older
        cur.execute("""UPDATE source_log SET produced_at = now() - interval '2 days'
                       WHERE "offset" < 10""")
    conn.commit()
    since = (datetime.now(UTC) - timedelta(days=1)).isoformat()
    late = get_pipeline("tweets", start_policy=f"timestamp:{since}", partitions=2)
    assert ranges_of(begin(conn, late, "run-1")) == [(0, 10, 20), (1, 10, 20)]


def test_partitions_added_while_running_are_found_at_planning(spark, conn, dsn):
    pipeline = tweets_pipeline(conn, events=40, batch_size=1000, partitions=2)
    run_transaction(spark, dsn, conn, pipeline, "run-1")
    ensure_topic(conn, "tweets", 3)  # a third partition appears
    produce(conn, "tweets", generate(30, seed=2))
    assert ranges_of(begin(conn, pipeline, "run-2")) == [(0, 20, 30), (1, 20, 30), (2, 0, 10)]


def test_per_partition_cap(conn):
    pipeline = tweets_pipeline(conn, events=300, batch_size=1000, max_per_partition=20)
    assert ranges_of(begin(conn, pipeline, "run-1")) == [(p, 0, 20) for p in range(4)]


def retained(conn, spark, dsn, policy):
    """Commit txid 1 ([0, 50) of 2 partitions), then retention deletes below offset 120."""
    pipeline = tweets_pipeline(conn, events=400, batch_size=100, partitions=2,
                               out_of_range=policy)
    run_transaction(spark, dsn, conn, pipeline, "run-1")
    delete_before(conn, "tweets", 120)
    return pipeline


@pytest.mark.parametrize("policy, start, end, committed", [
    # jump to the log start: txid 2 reads [120, 170), txid 3 [170, 200) of each partition
    ("earliest", 120, 170, 100 + 100 + 60),
    # jump to the head: nothing to read until new records come
    ("latest", 200, 200, 100),
])
def test_retention_jumps_by_policy_records_the_gap_once_and_counts_what_remains(
        spark, conn, dsn, caplog, policy, start, end, committed):
    pipeline = retained(conn, spark, dsn, policy)
    batch, result = run_transaction(spark, dsn, conn, pipeline, "run-2")
    assert ranges_of(batch) == [(0, start, end), (1, start, end)]
    assert table(conn, """SELECT partition, from_offset, to_offset, txid, policy
                          FROM offset_gaps ORDER BY 1""") == [
        (0, 50, start, 2, policy), (1, 50, start, 2, policy)]
    assert caplog.text.count("GAP pipeline=tweets") == 2
    assert offsets(conn) == [(0, end), (1, end)]  # the committed offset moved on
    # later plans neither loop nor log again
    run_transaction(spark, dsn, conn, pipeline, "run-3")
    assert caplog.text.count("GAP pipeline=tweets") == 2
    report = verify(conn, pipeline)
    assert report.ok, report.mismatches
    # every committed record is accounted for, those retention deleted included
    assert report.records == committed
    assert main(["status"]) == 0


def test_retention_with_policy_fail_refuses_naming_the_fix(spark, conn, dsn):
    pipeline = retained(conn, spark, dsn, "fail")
    with pytest.raises(OffsetOutOfRange, match=r"partition 0: offset 50 is out of range .* "
                                               r"Set pipeline.out_of_range"):
        begin(conn, pipeline, "run-2")
    assert table(conn, "SELECT count(*) FROM transactions") == [(1,)]
    assert table(conn, "SELECT count(*) FROM offset_gaps") == [(0,)]
    assert verify(conn, pipeline).ok


def test_retention_of_a_planned_transactional_batch_replans_it_by_policy(spark, conn, dsn):
    pipeline = tweets_pipeline(conn, events=400, batch_size=100, partitions=2)
    first = begin(conn, pipeline, "run-1")  # [0, 50) in each partition, not yet processed
    delete_before(conn, "tweets", 30)
    again = begin(conn, pipeline, "run-2", txid=1)
    assert ranges_of(again) == [(0, 30, 80), (1, 30, 80)] != ranges_of(first)
    assert table(conn, "SELECT partition, from_offset, to_offset FROM offset_gaps ORDER BY 1") \
        == [(0, 0, 30), (1, 0, 30)]
    from onceflow.committer import commit
    from spark_tasks.processing import process_batch

    process_batch(spark, dsn, pipeline, again.attempt)
    commit(conn, pipeline, again.attempt)
    assert verify(conn, pipeline).ok
