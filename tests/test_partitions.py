"""Partitioned source and partition offsets (the PartitionManager, without its traps):
restarts, resets, start policies, new partitions, retention under each policy, caps."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from helpers import ensure_topic, produce, run_transaction, table, tweets_pipeline
from onceflow.cli import main
from onceflow.core.begin import begin
from onceflow.core.errors import ConfigError, OffsetOutOfRange
from onceflow.core.registration import register, reset_offsets
from onceflow.ops.repair import repair
from onceflow.ops.retention import apply
from onceflow.ops.verify import recount as verify
from tweets_example.data import generate


def ranges_of(batch):
    return [(r.partition, r.start, r.end) for r, _ in batch.ranges]


def offsets(conn):
    return table(conn, 'SELECT partition, "offset" FROM partition_offsets ORDER BY 1')


def test_a_restart_resumes_exactly_from_the_committed_offsets(spark, conn, dsn):
    pipeline = tweets_pipeline(conn, events=400, batch_size=120, partitions=2)
    run_transaction(spark, dsn, conn, pipeline, "run-1")
    instance = table(conn, "SELECT instance_id FROM pipelines")
    # a restart (a new deployment): register again, new connections
    from onceflow.core.db import connect

    conn2 = connect(dsn)
    register(conn2, pipeline)
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
    from onceflow.core.commit import commit
    from onceflow.spark.processing import process_batch

    process_batch(spark, dsn, pipeline, open_batch.attempt)
    commit(conn, pipeline, open_batch.attempt)
    old = table(conn, "SELECT instance_id FROM pipelines")
    new = reset_offsets(conn, pipeline)
    assert table(conn, "SELECT instance_id::text FROM pipelines") == [(str(new),)] != old
    assert "RESET pipeline=tweets" in caplog.text
    assert repair(conn, pipeline).findings == []  # the forgotten offsets are no damage
    assert ranges_of(begin(conn, pipeline, "run-3")) == [(0, 0, 50), (1, 0, 50)]


def test_start_policy_latest_skips_the_past_and_keeps_its_start(spark, conn, dsn):
    pipeline = tweets_pipeline(conn, events=100, partitions=2, start_policy="latest")
    first = begin(conn, pipeline, "run-1")
    # nothing new yet, but the chosen start is stored, so later records are not skipped
    assert ranges_of(first) == [(0, 50, 50), (1, 50, 50)]
    produce(conn, "tweets", generate(10, seed=9))
    from onceflow.core.commit import commit
    from onceflow.spark.processing import process_batch

    process_batch(spark, dsn, pipeline, first.attempt)
    commit(conn, pipeline, first.attempt)
    assert repair(conn, pipeline).findings == []  # an empty committed range is an offset
    assert ranges_of(begin(conn, pipeline, "run-2")) == [(0, 50, 55), (1, 50, 55)]


def test_start_policy_timestamp_starts_at_the_first_record_produced_since(conn):
    tweets_pipeline(conn, events=40, partitions=2)
    with conn.cursor() as cur:  # the first 10 offsets of each partition are older
        cur.execute("""UPDATE source_log SET produced_at = now() - interval '2 days'
                       WHERE "offset" < 10""")
    conn.commit()
    since = (datetime.now(UTC) - timedelta(days=1)).isoformat()
    late = tweets_pipeline(conn, start_policy=f"timestamp:{since}", partitions=2)
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


def retained(conn, spark, dsn, policy, **retention):
    """Commit txid 1 ([0, 50) of 2 partitions of 200), then retention below offset 120."""
    pipeline = tweets_pipeline(conn, events=400, batch_size=100, partitions=2,
                               out_of_range=policy)
    run_transaction(spark, dsn, conn, pipeline, "run-1")
    plan = apply(conn, pipeline.source, 120, pipelines={"tweets": pipeline}, **retention)
    return pipeline, plan


def gap_rows(conn):
    return table(conn, """SELECT partition, from_offset, to_offset, policy FROM offset_gaps
                          ORDER BY 1""")


def test_retention_deletes_only_what_every_pipeline_committed(spark, conn, dsn):
    pipeline, plan = retained(conn, spark, dsn, "earliest")
    assert [(p.partition, p.log_start, p.allowed) for p in plan.partitions] == [
        (0, 0, 50), (1, 0, 50)]
    assert "pipeline tweets has committed up to 50; --force deletes unread" in plan.lines()[1]
    assert table(conn, "SELECT partition, min(\"offset\") FROM source_log GROUP BY 1 "
                       "ORDER BY 1") == [(0, 50), (1, 50)]
    batch, _ = run_transaction(spark, dsn, conn, pipeline, "run-2")
    assert ranges_of(batch) == [(0, 50, 100), (1, 50, 100)]  # nothing skipped
    assert gap_rows(conn) == []
    report = verify(conn, pipeline)
    assert report.ok, report.mismatches
    assert report.records == 200  # the retired 100 included


def test_retention_dry_run_says_what_would_go_and_deletes_nothing(spark, conn, dsn):
    _, plan = retained(conn, spark, dsn, "earliest", force=True, dry_run=True)
    assert plan.deletes == 240
    assert "pipeline tweets had not read [50,120): recorded as a gap" in "\n".join(plan.lines())
    assert table(conn, "SELECT count(*) FROM source_log") == [(400,)] and gap_rows(conn) == []


@pytest.mark.parametrize("policy, start, end, gap_end, committed", [
    # jump to the log start: txid 2 reads [120, 170), txid 3 [170, 200) of each partition
    ("earliest", 120, 170, 120, 100 + 100 + 60),
    # jump to the head: nothing to read until new records come; the gap grows to the head
    ("latest", 200, 200, 200, 100),
])
def test_forced_retention_records_the_gap_at_once_and_the_policy_jumps(
        spark, conn, dsn, caplog, policy, start, end, gap_end, committed):
    pipeline, plan = retained(conn, spark, dsn, policy, force=True)
    assert plan.deletes == 240
    # the gap is there before any new batch: status shows it at once
    assert gap_rows(conn) == [(0, 50, 120, "retention --force"),
                              (1, 50, 120, "retention --force")]
    batch, result = run_transaction(spark, dsn, conn, pipeline, "run-2")
    assert ranges_of(batch) == [(0, start, end), (1, start, end)]
    assert [r[:3] for r in gap_rows(conn)] == [(0, 50, gap_end), (1, 50, gap_end)]
    assert offsets(conn) == [(0, end), (1, end)]  # the committed offset moved on
    logged = caplog.text.count("GAP pipeline=tweets")
    run_transaction(spark, dsn, conn, pipeline, "run-3")  # later plans neither loop nor log
    assert caplog.text.count("GAP pipeline=tweets") == logged
    report = verify(conn, pipeline)
    assert report.ok, report.mismatches
    assert report.records == committed  # the records retention deleted after commit included
    assert main(["status", "--pipeline", "tweets"]) == 0
    assert repair(conn, pipeline).findings == []  # a jump over a recorded gap tiles


def test_forced_retention_with_policy_fail_refuses_naming_the_fix(spark, conn, dsn):
    pipeline, _ = retained(conn, spark, dsn, "fail", force=True)
    with pytest.raises(OffsetOutOfRange, match=r"partition 0: offset 50 is out of range .* "
                                               r"Set pipeline.out_of_range"):
        begin(conn, pipeline, "run-2")
    assert table(conn, "SELECT count(*) FROM transactions") == [(1,)]
    assert verify(conn, pipeline).ok


def test_retention_never_deletes_what_an_open_transaction_planned(spark, conn, dsn):
    """Even forced: txid 1 planned [0, 50) of each partition; retention below 30 deletes
    nothing of it, and the batch reads every planned record."""
    pipeline = tweets_pipeline(conn, events=400, batch_size=100, partitions=2)
    first = begin(conn, pipeline, "run-1")
    plan = apply(conn, pipeline.source, 30, force=True, pipelines={"tweets": pipeline})
    assert plan.deletes == 0
    assert "an open transaction planned offset 0 on" in plan.lines()[1]
    from onceflow.core.commit import commit
    from onceflow.spark.processing import process_batch

    staged = process_batch(spark, dsn, pipeline, first.attempt)
    assert staged.records == 100
    commit(conn, pipeline, first.attempt)
    assert verify(conn, pipeline).ok


def test_records_deleted_under_a_batch_fail_its_processing(spark, conn, dsn):
    """Records gone from a planned range by any other way than retention (a hand in the
    database): processing fails naming the range, instead of committing a short batch."""
    pipeline = tweets_pipeline(conn, events=400, batch_size=100, partitions=2)
    first = begin(conn, pipeline, "run-1")
    with conn.cursor() as cur:
        cur.execute('DELETE FROM source_log WHERE partition = 1 AND "offset" BETWEEN 10 AND 19')
    conn.commit()
    from onceflow.spark.processing import process_batch

    with pytest.raises(Exception, match=r"SourceShortfall: topic 'tweets' partition 1 "
                                        r"offsets \[0, 50\) returned 40 of 50 records"):
        process_batch(spark, dsn, pipeline, first.attempt)
    assert table(conn, "SELECT count(*) FROM staged_groups") == [(0,)]


@pytest.mark.parametrize("argv, message", [
    (["retention", "--topic", "nope", "--before", "5"], "--topic='nope' is unknown"),
    (["retention", "--topic", "tweets", "--before", "5", "--partition", "9"],
     "--partition=9 is invalid: topic 'tweets' has partitions 0, 1"),
])
def test_retention_refuses_bad_arguments(conn, capsys, argv, message):
    tweets_pipeline(conn, events=10, partitions=2)
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_retention_refuses_a_negative_offset(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["retention", "--topic", "tweets", "--before", "-3"])
    assert exit_.value.code == 2
    assert "-3 is negative" in capsys.readouterr().err
