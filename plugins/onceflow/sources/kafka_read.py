"""The Kafka source's read path (onceflow.sources.kafka declares the source): a partition
range read whole by position (``read_range``), the Spark task that reads a batch's chunks
into Arrow record batches (``reader``), and the record's own columns as Arrow arrays.

pyarrow is imported here at the top: the declaration loads this module only where records
are read, so a DAG file's parse (and `import onceflow`) loads no pyarrow.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from onceflow.core.errors import SourceShortfall
from onceflow.core.planner import PartitionRange
from onceflow.core.source import PROBLEM
from onceflow.sources.json_records import JsonRecords
from onceflow.sources.kafka_client import KafkaDataLost, consumer, text, unreachable


def meta_arrays(meta: Sequence[tuple]) -> dict[str, Any]:
    """The kafka_key, kafka_timestamp and kafka_headers columns of ``meta`` rows."""
    return {
        "kafka_key": pa.array([m[0] for m in meta], pa.string()),
        "kafka_timestamp": pa.array([m[1] for m in meta], pa.timestamp("ms", tz="UTC")).cast(
            pa.timestamp("us", tz="UTC")),
        "kafka_headers": pa.array([None if not m[2] else json.dumps(m[2]) for m in meta],
                                  pa.string()),
    }


def read_range(reader, config: Mapping[str, Any], conn_id: str, topic: str, partition: int,
               start: int, end: int, timeout_s: float, *, missing_ok: bool = False
               ) -> Iterator[tuple]:
    """The records of ``[start, end)`` of one partition as (partition, offset, value, key,
    timestamp ms, headers or None), read by ``reader`` assigned and positioned at ``start``
    until its position reaches ``end``. Offsets without a record are skipped; a range that cannot
    be read whole fails, naming why (``missing_ok``: gives what the broker still holds of
    it instead)."""
    # The broker's log start and high watermark first: a range it no longer holds whole is
    # named now (some brokers answer a fetch past their end with silence, not an error).
    try:
        low, high = reader.get_watermark_offsets(TopicPartition(topic, partition),
                                                 timeout=timeout_s, cached=False)
    except KafkaException as error:
        code = error.args[0].code()
        if code not in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION,
                        KafkaError._UNKNOWN_TOPIC):
            raise unreachable(config, conn_id, f"a list-offsets request for partition "
                               f"{partition}", error.args[0], timeout_s) from None
        if missing_ok:
            return
        raise KafkaDataLost(
            f"Kafka topic {topic!r} partition {partition} is gone from the broker "
            f"({error.args[0].str()}) with the planned range [{start}, {end}): the broker lost "
            "the topic (a restart without its storage?). Nothing of this batch is "
            "committed") from None
    if missing_ok:  # what the broker still holds of the range
        start, end = max(start, low), min(end, high)
        if start >= end:
            return
    if end > high:
        raise KafkaDataLost(
            f"Kafka topic {topic!r} partition {partition} ends at offset {high}, below the "
            f"planned end {end} of [{start}, {end}): the broker lost records of a planned "
            "batch (a restart without its storage?). Nothing of this batch is committed")
    if start < low:
        raise SourceShortfall(
            f"SourceShortfall: Kafka topic {topic!r} partition {partition} offsets [{start}, "
            f"{end}): the log starts at {low}: retention deleted records of a planned batch; "
            "the next attempt re-plans from the log start and records the gap")
    reader.assign([TopicPartition(topic, partition, start)])
    position, quiet_since = start, time.monotonic()
    try:
        while position < end:
            messages = reader.consume(num_messages=min(10_000, end - position), timeout=1.0)
            if messages:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > timeout_s:
                raise unreachable(config, conn_id, f"a fetch of partition {partition} at "
                                   f"offset {position}", "no records and no end of partition",
                                   timeout_s)
            for m in messages:
                error = m.error()
                if error is None:
                    offset = m.offset()
                    if offset >= end:
                        position = end
                        break
                    if offset >= position:
                        key, (kind, ms), raw = m.key(), m.timestamp(), m.headers()
                        yield (partition, offset, m.value(),
                               None if key is None else key.decode("utf-8", "replace"),
                               ms if kind else None,
                               [(k, None if v is None else v.decode("utf-8", "replace"))
                                for k, v in raw] if raw else None)
                        position = offset + 1
                    continue
                code = error.code()
                if code == KafkaError._PARTITION_EOF:
                    if m.offset() < end:
                        raise KafkaDataLost(
                            f"Kafka topic {topic!r} partition {partition} ends at offset "
                            f"{m.offset()}, below the planned end {end} of [{start}, {end}): "
                            "the broker lost records of a planned batch (a restart without "
                            "its storage?). Nothing of this batch is committed")
                    position = end  # every record below the end was delivered before it
                elif code in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC,
                              KafkaError._UNKNOWN_PARTITION):
                    raise KafkaDataLost(
                        f"Kafka topic {topic!r} partition {partition} is gone from the broker "
                        f"({error.str()}) with the planned range [{start}, {end}): the broker "
                        "lost the topic (a restart without its storage?). Nothing of this "
                        "batch is committed")
                elif code in (KafkaError.OFFSET_OUT_OF_RANGE, KafkaError._AUTO_OFFSET_RESET):
                    low, high = reader.get_watermark_offsets(
                        TopicPartition(topic, partition), timeout=timeout_s, cached=False)
                    if position >= high:
                        raise KafkaDataLost(
                            f"Kafka topic {topic!r} partition {partition} ends at offset "
                            f"{high}, below the planned end {end} of [{start}, {end}): the "
                            "broker lost records of a planned batch (a restart without its "
                            "storage?). Nothing of this batch is committed")
                    raise SourceShortfall(
                        f"SourceShortfall: Kafka topic {topic!r} partition {partition} "
                        f"offsets [{start}, {end}): offset {position} is out of range (the "
                        f"log starts at {low}): retention deleted records of a planned batch; "
                        "the next attempt re-plans from the log start and records the gap")
                elif error.fatal() or not (error.retriable() or code in (
                        KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN,
                        KafkaError._TIMED_OUT, KafkaError._RESOLVE)):
                    raise unreachable(config, conn_id, f"a fetch of partition {partition}",
                                       error.str(), timeout_s)
    finally:
        reader.unassign()


# Positions closer than this share one read: a fetch of the records between two failed ones
# costs less than a seek, a watermark request and a fetch of its own.
NEAR = 256


def covering(positions: Iterable[tuple[int, int]]) -> list[PartitionRange]:
    """Ranges covering the (partition, offset) ``positions``, neighbours at most NEAR apart
    in one range."""
    spans: list[list[int]] = []
    for p, o in sorted(set(positions)):
        if spans and spans[-1][0] == p and o - (spans[-1][2] - 1) <= NEAR:
            spans[-1][2] = o + 1
        else:
            spans.append([p, o, o + 1])
    return [PartitionRange(p, s, e) for p, s, e in spans]


def records_at(config: Mapping[str, Any], conn_id: str, topic: str, timeout_s: float,
               positions: Iterable[tuple[int, int]], *, missing_ok: bool = False
               ) -> Iterator[tuple]:
    """read_range's records at ``positions`` only, read by the ranges that cover them."""
    wanted = set(positions)
    for record in records(config, conn_id, topic, timeout_s, covering(wanted),
                          missing_ok=missing_ok):
        if (record[0], record[1]) in wanted:
            yield record


def records(config: Mapping[str, Any], conn_id: str, topic: str, timeout_s: float,
            ranges: Iterable[PartitionRange], *, missing_ok: bool = False) -> Iterator[tuple]:
    """read_range's records of every range, in Python, by one consumer."""
    kafka = consumer(config, timeout_s)
    try:
        for r in ranges:
            if r.size > 0:
                yield from read_range(kafka, config, conn_id, topic, r.partition, r.start,
                                      r.end, timeout_s, missing_ok=missing_ok)
    finally:
        kafka.close()


def reader(config: dict[str, Any], conn_id: str, topic: str, records: JsonRecords | None,
           max_bytes: int, timeout_s: float):
    """The Spark task: each chunk row's records, read whole (see read_range), decoded with
    ``records`` when the source declares a schema."""

    def read(batches: Iterator) -> Iterator:
        kafka = consumer(config, timeout_s)
        try:
            for batch in batches:
                cols = batch.to_pydict()
                for partition, start, end in zip(cols["partition"], cols["start"], cols["end"],
                                                 strict=True):
                    rows = list(read_range(kafka, config, conn_id, topic, partition, start,
                                           end, timeout_s))
                    for piece in range(0, len(rows), 32_768):
                        yield _batch(rows[piece:piece + 32_768], records, max_bytes)
        finally:
            kafka.close()

    return read


def _batch(rows: list[tuple], records: JsonRecords | None, max_bytes: int):
    """Arrow record batch of read_range rows, in the source's read_ddl order."""
    keys = {"partition": pa.array([r[0] for r in rows], pa.int32()),
            "offset": pa.array([r[1] for r in rows], pa.int64())}
    values = [r[2] for r in rows]
    if records is None:
        body: dict[str, Any] = {"payload": pa.array([text(v) for v in values], pa.string())}
        problem: dict[str, Any] = {}
    else:
        body, problems = records.decode([v or b"" for v in values], max_bytes)
        problem = {PROBLEM: problems}
    meta = meta_arrays([(r[3], r[4], r[5]) for r in rows])
    columns = {**keys, **body, **meta, **problem}
    return pa.RecordBatch.from_arrays(list(columns.values()), names=list(columns))

