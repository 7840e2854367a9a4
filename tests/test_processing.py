"""The processing phase on real local Spark: what it stages, and that a re-run replaces it."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from helpers import read_ranges, table, tweets_pipeline
from onceflow.core.begin import begin
from onceflow.core.errors import Fenced
from onceflow.core.txlog import TransactionAttempt
from onceflow.sources.pglog import chunk_ranges
from onceflow.spark.processing import process_batch
from tweets_example.data import classify, normalize_host, parse_event


def test_chunks_cover_ranges_exactly():
    from onceflow.core.planner import PartitionRange

    pieces = chunk_ranges([PartitionRange(0, 5, 25), PartitionRange(3, 0, 3)], chunk=8)
    assert pieces == [(0, 5, 13), (0, 13, 21), (0, 21, 25), (3, 0, 3)]


def test_read_ranges_reads_exactly_the_planned_records(spark, conn, dsn):
    from onceflow.core.planner import PartitionRange

    pipeline = tweets_pipeline(conn, events=400)
    # 400 events round-robin over 4 partitions: offsets 0..99 in each
    ranges = [PartitionRange(0, 10, 35), PartitionRange(2, 90, 100)]
    rows = read_ranges(spark, dsn, pipeline.topic, ranges, chunk=7).collect()
    assert sorted((r.partition, r.offset) for r in rows) == (
        [(0, o) for o in range(10, 35)] + [(2, o) for o in range(90, 100)]
    )
    expected = dict(table(conn, """SELECT partition * 1000 + "offset", payload FROM source_log
                                   WHERE topic = 'tweets'"""))
    assert all(expected[r.partition * 1000 + r.offset] == r.payload for r in rows)


def staged(conn, txid):
    deltas = table(conn, """SELECT state_name, key, delta FROM staged_deltas
                            WHERE txid = %s ORDER BY 1, 2""", (txid,))
    rejects = table(conn, """SELECT partition, "offset", error FROM staged_rejects
                             WHERE txid = %s ORDER BY 1, 2""", (txid,))
    return deltas, rejects


def expected_outcome(payload: str):
    """What the example topology must do with a record tried for the first time: its counts,
    a rejection error, or "failed" (poison, or a flaky lookup's first try)."""
    c = classify(payload)
    if isinstance(c, str):
        return c
    doc = parse_event(payload)
    try:
        domain = normalize_host(c[1])
    except UnicodeError:
        return "failed"
    if doc.get("flaky"):
        return "failed"
    return c[0], domain


def test_staging_matches_recomputation_and_a_rerun_replaces_it(spark, conn, dsn):
    pipeline = tweets_pipeline(conn, events=3000, batch_size=2000, poison_share=0.01,
                               flaky_share=0.01)
    batch = begin(conn, pipeline, "run-1")
    result = process_batch(spark, dsn, pipeline, batch.attempt)
    assert result.records == 2000
    deltas, rejects = staged(conn, batch.attempt.txid)

    payloads = table(conn, """SELECT l.partition, l."offset", l.payload
                              FROM source_log l JOIN batch_ranges b
                              ON b.partition = l.partition AND l."offset" >= b.start_offset
                                 AND l."offset" < b.end_offset
                              WHERE b.txid = %s""", (batch.attempt.txid,))
    want, want_rejected, want_failed = Counter(), 0, set()
    for partition, offset, payload in payloads:
        outcome = expected_outcome(payload)
        if outcome == "failed":
            want_failed.add((partition, offset))
        elif isinstance(outcome, str):
            want_rejected += 1
        else:
            want["url_counts", outcome[0]] += 1
            want["domain_counts", outcome[1]] += 1
    assert {(s, k): d for s, k, d in deltas} == dict(want)
    assert len(rejects) == want_rejected == result.rejected > 0
    failures = table(conn, """SELECT partition, "offset", replayed, error FROM staged_failures
                              WHERE txid = %s""", (batch.attempt.txid,))
    assert {(p, o) for p, o, _, _ in failures} == want_failed and result.failed > 5
    assert {e.split(":")[0] for *_, e in failures} == {"bolt normalize_domain"}
    assert not any(replayed for _, _, replayed, _ in failures)

    # the same (txid, attempt) processed again: the staging is replaced, never added to
    process_batch(spark, dsn, pipeline, batch.attempt)
    assert staged(conn, batch.attempt.txid) == (deltas, rejects)
    assert table(conn, "SELECT count(*) FROM staged_groups WHERE txid = %s",
                 (batch.attempt.txid,)) == [(1,)]
    assert len(table(conn, "SELECT 1 FROM staged_failures WHERE txid = %s",
                     (batch.attempt.txid,))) == len(failures)


def test_an_unknown_attempt_cannot_stage(spark, conn, dsn):
    pipeline = tweets_pipeline(conn, events=100)
    batch = begin(conn, pipeline, "run-1")
    with pytest.raises(Fenced, match="attempt 1 is current"):
        process_batch(spark, dsn, pipeline, TransactionAttempt(batch.attempt.txid, 2))
    assert staged(conn, batch.attempt.txid) == ([], [])


def test_an_empty_batch_stages_nothing_without_spark_work(spark, conn, dsn):
    pipeline = tweets_pipeline(conn, events=0)
    batch = begin(conn, pipeline, "run-1")
    assert batch.records == 0
    result = process_batch(spark, dsn, pipeline, batch.attempt)
    assert (result.records, result.rejected, result.delta_rows) == (0, 0, 0)


def test_payload_with_csv_specials_round_trips(spark, conn, dsn):
    from helpers import produce

    pipeline = tweets_pipeline(conn)
    odd = json.dumps({"url": 'https://x.example/a,b"c\nd', "text": "é ✓ \t tab"})
    produce(conn, pipeline.topic, [odd])
    batch = begin(conn, pipeline, "run-1")
    process_batch(spark, dsn, pipeline, batch.attempt)
    deltas, _ = staged(conn, batch.attempt.txid)
    assert ("url_counts", 'https://x.example/a,b"c\nd', 1) in deltas


def test_planning_a_batch_is_few_round_trips_to_the_jvm(spark, conn, dsn):
    """A local session onceflow starts plans a batch without PySpark's DataFrame debugging
    (onceflow.spark.conf): with it, every function would add about six py4j round trips (its
    Python call site recorded in the JVM), several times the planning's own."""
    import threading

    from py4j.clientserver import ClientServerConnection

    from onceflow.core.planner import PartitionRange
    from onceflow.spark.records import batch_records
    from onceflow.spark.runner import run_topology

    assert spark.conf.get("spark.python.sql.dataFrameDebugging.enabled") == "false"
    pipeline = tweets_pipeline(conn, events=40)
    topology = pipeline.build_topology()
    sent, me = [], threading.get_ident()
    send = ClientServerConnection.send_command

    def counted(self, command):
        if threading.get_ident() == me:  # not py4j's own thread releasing JVM objects
            sent.append(command[:2])
        return send(self, command)

    ClientServerConnection.send_command = counted
    try:
        source = batch_records(spark, dsn, pipeline.source, [PartitionRange(0, 0, 10)])
        run = run_topology(topology, source, attempt=1)
        plans = [run.lean if run.lean is not None else run.output]
    finally:
        ClientServerConnection.send_command = send
    assert plans[0] is not None
    # measured on the tweets topology: about 1,200 without debugging, over 3,000 with it
    assert 100 < len(sent) < 2500, len(sent)
