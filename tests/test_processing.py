"""The processing phase on real local Spark: what it stages, and that a re-run replaces it."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from helpers import table, tweets_pipeline
from onceflow.coordinator import begin
from onceflow.examples.tweets import (
    ERR_BAD_URL,
    ERR_MALFORMED,
    ERR_NO_URL,
    ERR_OVERSIZED,
    classify,
    generate,
    normalize_host,
)
from onceflow.txn import Fenced, TransactionAttempt
from spark_tasks.processing import process_batch
from spark_tasks.source_reader import chunk_ranges, read_ranges

EDGE_PAYLOADS = [
    # (payload, what the pure-Python twin says)
    ('{"url": "https://News.Example.com/a?b=1#c", "text": "x"}',
     ("https://News.Example.com/a?b=1#c", "news.example.com")),
    ('{"url": "http://h.example:8080/p"}', ("http://h.example:8080/p", "h.example")),
    ('{"url": ', ERR_MALFORMED),
    ("[1, 2]", ERR_MALFORMED),
    ('"just a string"', ERR_MALFORMED),
    ('{"text": "no url"}', ERR_NO_URL),
    ('{"url": null}', ERR_NO_URL),
    ('{"url": 42}', ERR_BAD_URL),
    ('{"url": {"nested": 1}}', ERR_BAD_URL),
    ('{"url": "ftp://x.example/f"}', ERR_BAD_URL),
    ('{"url": "https://"}', ERR_BAD_URL),
    ('{"url": "https://q.example/with,comma \\"quote\\"\\nnewline"}',
     ('https://q.example/with,comma "quote"\nnewline', "q.example")),
]


@pytest.mark.parametrize("payload, expected", EDGE_PAYLOADS)
def test_python_twin_classifies(payload, expected):
    assert classify(payload) == expected


def test_spark_transform_agrees_with_the_python_twin(spark):
    """Record by record, the JVM transform and the independent recomputation agree."""
    from spark_tasks.tweets import parse

    long_one = json.dumps({"url": "https://big.example/x", "text": "é" * 300})  # 600+ bytes
    payloads = ([p for p, _ in EDGE_PAYLOADS] + [long_one]
                + list(generate(500, seed=3, malformed_share=0.2)))
    df = spark.createDataFrame([(0, i, p) for i, p in enumerate(payloads)],
                               "partition int, offset long, payload string")
    got = {r["offset"]: (r["error"] or (r["url"], r["domain"]))
           for r in parse(df, max_bytes=400).collect()}
    expected = {i: classify(p, 400) for i, p in enumerate(payloads)}
    assert got == expected
    assert expected[len(EDGE_PAYLOADS)] == ERR_OVERSIZED


def test_chunks_cover_ranges_exactly():
    from onceflow.planner import PartitionRange

    pieces = chunk_ranges([PartitionRange(0, 5, 25), PartitionRange(3, 0, 3)], chunk=8)
    assert pieces == [(0, 5, 13), (0, 13, 21), (0, 21, 25), (3, 0, 3)]


def test_read_ranges_reads_exactly_the_planned_records(spark, conn, dsn):
    from onceflow.planner import PartitionRange

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
    doc = json.loads(payload)
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
    from onceflow.source import produce

    pipeline = tweets_pipeline(conn)
    odd = json.dumps({"url": 'https://x.example/a,b"c\nd', "text": "é ✓ \t tab"})
    produce(conn, pipeline.topic, [odd])
    batch = begin(conn, pipeline, "run-1")
    process_batch(spark, dsn, pipeline, batch.attempt)
    deltas, _ = staged(conn, batch.attempt.txid)
    assert ("url_counts", 'https://x.example/a,b"c\nd', 1) in deltas
