"""Transactions without Airflow (onceflow.spark.loop.run_batches): batches processed side by side
on one session, committed in txid order, and a failure that stops the loop without losing or
doubling a record (real PostgreSQL, real local Spark)."""

from __future__ import annotations

import pytest
from pyspark.sql import functions as F

from helpers import assert_exact, table, tweets_events, tweets_pipeline
from onceflow import SPOUT, Topology
from onceflow.core.begin import begin
from onceflow.core.errors import ConfigError
from onceflow.ops.verify import recount as verify
from onceflow.spark.loop import CommitWaiting, run_batches
from tweets_example import topology as tweets

BROKEN_AT = 150  # the offset the broken topology cannot parse


def broken_topology(pipeline=None) -> Topology:
    """The tweets topology with a bug: its parse bolt fails the Spark job on one offset."""
    parse = tweets._parse_bolt()

    def bolt(records):
        return parse(records.withColumn("payload", F.when(
            F.col("offset") == BROKEN_AT, F.raise_error(F.lit("a bug in parse")))
            .otherwise(F.col("payload"))))

    good = tweets.topology(pipeline)
    return (Topology("tweets").bolt("parse", input=SPOUT, fn=bolt,
                                    outputs=good.bolts[0].outputs)
            .record_bolt("normalize_domain", input="domains", fn=tweets.normalize_domain,
                         outputs={"domain_keys": "key string"})
            .count("urls", "url_counts").count("domain_keys", "domain_counts")
            .reject("rejects"))


def test_batches_process_side_by_side_and_commit_in_txid_order(spark, conn, dsn):
    payloads = tweets_events(1000)
    pipeline = tweets_pipeline(conn, payloads=payloads, batch_size=200, max_pending=3)
    done = run_batches(spark, dsn, pipeline, in_flight=3)
    # five batches of 200, the backflow's replays of failed records, and the empty batch
    # that finds the source read to its end: every txid committed, in order
    last = done.committed[-1]
    assert done.committed == list(range(1, last + 1)) and last >= 6, done.committed
    assert done.records >= 1000 and len(done.process_s) == last - 1
    assert table(conn, "SELECT txid, state FROM transactions ORDER BY txid") == [
        (t, "committed") for t in range(1, last + 1)]
    assert table(conn, "SELECT sum(\"offset\") FROM partition_offsets") == [(1000,)]
    # side by side: txid 2 and 3 were planned before txid 1 committed
    overlap = table(conn, """SELECT count(*) FROM transactions t
                             WHERE t.txid IN (2, 3) AND t.planned_at < (
                                 SELECT committed_at FROM transactions WHERE txid = 1)""")
    assert overlap == [(2,)]
    # every record read once: counted, rejected, dead, or (failed, not due yet) queued
    assert_exact(conn, pipeline, payloads, read_all=True)
    assert verify(conn, pipeline).ok


def test_a_failed_batch_stops_the_loop_and_the_next_run_adopts_it(spark, conn, dsn):
    payloads = tweets_events(500)
    good = tweets_pipeline(conn, payloads=payloads, batch_size=100, partitions=1,
                           max_pending=3)
    broken = good.with_settings(topology=broken_topology)
    with pytest.raises(Exception, match="a bug in parse"):
        run_batches(spark, dsn, broken, in_flight=3)
    # txid 1 (offsets 0-99) committed; txid 2 holds offset 150: it and every later txid
    # the loop had begun failed. Which ones, by the loop's order (no timing): txids 1-3
    # begin; txid 1 is awaited and commits, and the loop begins txid 4 before it awaits
    # txid 2 and finds it failed.
    assert table(conn, "SELECT txid, state FROM transactions ORDER BY txid") == [
        (1, "committed"), (2, "failed"), (3, "failed"), (4, "failed")]
    assert table(conn, 'SELECT "offset" FROM partition_offsets') == [(100,)]
    assert_exact(conn, good, payloads, read_all=False)  # txid 1's records, counted once
    # the fixed pipeline's next loop adopts them in txid order, then reads on
    done = run_batches(spark, dsn, good, in_flight=2)
    last = done.committed[-1]
    assert done.committed == list(range(2, last + 1)) and last >= 6, done.committed
    assert table(conn, 'SELECT "offset" FROM partition_offsets') == [(500,)]
    assert_exact(conn, good, payloads, read_all=True)
    assert verify(conn, good).ok


def test_a_txid_another_run_holds_stops_the_loop_with_a_clear_error(spark, conn, dsn):
    pipeline = tweets_pipeline(conn, events=300, batch_size=100, max_pending=3)
    other = begin(conn, pipeline, "someone-elses-run")  # txid 1, planned, still reporting
    with pytest.raises(CommitWaiting, match="cannot commit before txid 1"):
        run_batches(spark, dsn, pipeline, in_flight=1)
    assert table(conn, "SELECT txid, state FROM transactions ORDER BY txid") == [
        (1, "planned"), (2, "failed")]
    assert other.attempt.txid == 1
    with pytest.raises(ConfigError, match="in_flight=4 is invalid: give 1..max_pending=3"):
        run_batches(spark, dsn, pipeline, in_flight=4)
