"""Transactional producers' commit markers inside the planned ranges of a Kafka source: a
marker takes an offset and holds no record, so a range (and each reader chunk) is done by
its position, never by a count of records. Exact against an oracle built from what the test
produced.

What Tansu (the tests' broker, tests/kafka_broker.py) does not do, and so what is not
tested here: it hands a read_committed consumer the records of aborted transactions (its
fetch answers no aborted transactions), and while a transaction is open it answers a
read_committed "latest offset" request with 0 instead of the transaction's first offset."""

from __future__ import annotations

import json

from test_kafka_source import broker, committed_offsets_of  # noqa: F401 (the fixture)

from helpers import outside_pipeline, table


def test_commit_markers_at_chunk_and_batch_edges_are_passed_by_position(
        broker, dsn, conn, spark, monkeypatch):  # noqa: F811
    """One partition: a plain record, then 8 times two plain records and a committed
    transaction of two (its marker after them): markers at 5, 10, ..., 40. Read in chunks of
    10 offsets and batches of 30, chunks and batches start and end on markers."""
    from onceflow.spark.loop import run_batches

    broker.create_topic("events", 1)
    expected: dict[str, int] = {}
    produced: list[tuple[int, int, str]] = []
    n = 0

    def send(count: int, transactional_id: str | None = None) -> None:
        nonlocal n
        values = [json.dumps({"n": n + i}) for i in range(count)]
        produced.extend(broker.produce("events", values, partitions=1,
                                       transactional_id=transactional_id))
        for i in range(count):  # the helper keys each record k<its index in the call>
            expected[f"k{i}:n={n + i}"] = 1
        n += count

    send(1)
    for block in range(8):
        send(2)
        send(2, transactional_id=f"tx-{block}")
    offsets = [o for _, o, _ in produced]
    markers = sorted(set(range(41)) - set(offsets))
    assert markers == list(range(5, 41, 5)) and len(offsets) == 33  # as planned
    with outside_pipeline(monkeypatch, "pageviews.kafka:EVENTS", conn, "events") as pipeline:
        done = run_batches(spark, dsn, pipeline, in_flight=1)
    assert done.records == 41  # a batch's size is its planned offsets, markers included
    assert dict(table(conn, "SELECT key, value FROM by_key")) == expected
    assert committed_offsets_of(conn, "events") == {0: 41}  # past the last marker
    ranges = table(conn, "SELECT start_offset, end_offset FROM batch_ranges "
                         "WHERE pipeline = 'events' ORDER BY txid")
    assert ranges == [(0, 30), (30, 41)]  # each batch ends on a marker
