"""The PostgreSQL log: topics split into partitions, records addressed by offset, in the
``source_log`` table of the coordinator's database (onceflow.sources.catalog keeps the heads).

Reading needs no JDBC driver: the ranges are cut into chunks, each chunk is one Spark task,
and the task streams its rows out of PostgreSQL with ``COPY ... TO STDOUT`` and parses them
with Arrow's CSV reader (``mapInArrow``), so the rows reach the JVM as Arrow batches. The same
code runs in local mode, on a cluster and through Spark Connect. Offsets are dense below the
head, so a chunk that returns fewer rows than its range holds was cut short (records deleted
under the batch): the task fails with SourceShortfall instead of reading a short batch.

With a declared ``json_schema`` the reader task decodes each chunk's payloads as it reads
them (onceflow.sources.json_records): the records carry the declared columns and
``_corrupt_record`` instead of ``payload``, and the topology parses nothing.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import ClassVar

from onceflow.core.errors import Permanent
from onceflow.core.planner import PartitionRange
from onceflow.core.source import Position, require_partitions, require_topic
from onceflow.sources import catalog
from onceflow.sources.json_records import JsonSchemaSource

CHUNK_SCHEMA = "chunk int, partition int, start long, end long"
DEFAULT_CHUNK = 100_000
# A record's arrival, and its payload, at (partition, offset) points (catalog.at_points).
_ARRIVALS = """SELECT l.partition, l."offset", l.produced_at FROM source_log l
    JOIN unnest(%(partitions)s::int[], %(offsets)s::bigint[]) AS w (p, o)
      ON l.partition = w.p AND l."offset" = w.o
    WHERE l.topic = %(topic)s"""
_PAYLOADS = """SELECT l.partition, l."offset", l.payload FROM source_log l
    JOIN unnest(%(partitions)s::int[], %(offsets)s::bigint[]) AS w (p, o)
      ON l.partition = w.p AND l."offset" = w.o
    WHERE l.topic = %(topic)s"""


class BadRecord(Permanent, ValueError):
    """A record no source can hold: the message names it and why."""


def check_payload(index: int, payload: object) -> str:
    """A payload PostgreSQL text can store, or BadRecord naming record ``index`` (from 1)."""
    if not isinstance(payload, str):
        raise BadRecord(f"record {index}: payload is {type(payload).__name__}, not text")
    if payload == "":
        raise BadRecord(f"record {index} is empty: a record needs a payload")
    if "\x00" in payload:
        raise BadRecord(f"record {index} holds a NUL character (at {payload.index(chr(0))}), "
                        "which PostgreSQL text cannot store: remove it or escape it (\\u0000)")
    try:
        payload.encode("utf-8")
    except UnicodeEncodeError as error:
        raise BadRecord(f"record {index} is not valid UTF-8 text ({error.reason} at "
                        f"{error.start}: a lone surrogate?): fix its encoding") from error
    return payload


def chunk_ranges(ranges: Iterable[PartitionRange], chunk: int = DEFAULT_CHUNK
                 ) -> list[tuple[int, int, int]]:
    """Split ranges into (partition, start, end) pieces of at most ``chunk`` offsets."""
    pieces = []
    for r in ranges:
        for start in range(r.start, r.end, chunk):
            pieces.append((r.partition, start, min(r.end, start + chunk)))
    return pieces


@dataclass(frozen=True, kw_only=True)
class PostgresLog(JsonSchemaSource):
    """A partitioned log in the coordinator's PostgreSQL database (``source_log``).

    ``topic``: its name; ``partitions``: how many partitions ``onceflow init`` creates;
    ``max_record_bytes``: a larger payload is rejected (kept with its position and reason);
    ``json_schema``: the payloads' fields as Spark DDL of simple types, decoded as the
    chunks are read (the records then carry these columns and ``_corrupt_record`` instead
    of ``payload``; see the module docstring).
    """

    kind: ClassVar[str] = "postgres-log"
    partitions: int = 4
    read_chunk: int = DEFAULT_CHUNK  # offsets per Spark reader task

    def validate(self) -> None:
        super().validate()
        require_topic(self.topic)
        require_partitions(self.partitions)

    def ensure(self, conn, *, create: bool = False) -> None:
        catalog.ensure_topic(conn, self.topic, self.partitions, create=create)

    def positions(self, cur) -> dict[int, Position]:
        return catalog.positions(cur, self.topic)

    arrival_by_sight = False

    def arrivals(self, cur, points: Iterable[tuple[int, int]]) -> dict[tuple[int, int], datetime]:
        """A record arrived when it was inserted (``produced_at``)."""
        return catalog.at_points(cur, _ARRIVALS, self.topic, points)

    def first_at(self, cur, partition: int, when: datetime, position: Position) -> int:
        cur.execute(
            """SELECT min("offset") FROM source_log
               WHERE topic = %s AND partition = %s AND produced_at >= %s""",
            (self.topic, partition, when),
        )
        first = cur.fetchone()[0]
        return first if first is not None else position.head

    def read(self, spark, dsn: str, ranges: Iterable[PartitionRange]):
        pieces = chunk_ranges([r for r in ranges if r.size > 0], self.read_chunk)
        rows = [(i, p, s, e) for i, (p, s, e) in enumerate(pieces)]
        # No repartition: the local rows are already spread over the default parallelism (the
        # cores), and each reader task takes its chunks one after the other.
        chunks = spark.createDataFrame(rows, CHUNK_SCHEMA)
        from onceflow.sources.copy_read import log_reader  # pyarrow: where a batch is read

        return chunks.mapInArrow(
            log_reader(dsn, self.topic, self.records, self.max_record_bytes), self.read_ddl)

    def payloads(self, conn, ranges: Iterable[PartitionRange]
                 ) -> Iterator[tuple[int, int, str]]:
        ranges = [r for r in ranges if r.size > 0]
        if not ranges:
            return
        with conn.cursor(name="onceflow_scan") as cur:
            cur.itersize = 50_000
            cur.execute(
                """SELECT l.partition, l."offset", l.payload FROM source_log l
                   JOIN unnest(%s::int[], %s::bigint[], %s::bigint[]) AS r(p, s, e)
                     ON l.partition = r.p AND l."offset" >= r.s AND l."offset" < r.e
                   WHERE l.topic = %s ORDER BY l.partition, l."offset" """,
                ([r.partition for r in ranges], [r.start for r in ranges],
                 [r.end for r in ranges], self.topic),
            )
            yield from cur

    def payloads_at(self, cur, positions: Iterable[tuple[int, int]]
                    ) -> dict[tuple[int, int], str]:
        return catalog.at_points(cur, _PAYLOADS, self.topic, positions)

    def retain(self, cur, below: Mapping[int, int]) -> int:
        deleted = 0
        for partition, start in below.items():
            cur.execute(
                """DELETE FROM source_log WHERE topic = %s AND partition = %s
                   AND "offset" < %s""",
                (self.topic, partition, start),
            )
            deleted += cur.rowcount
        catalog.move_log_start(cur, self.topic, below)
        return deleted

    def append(self, conn, payloads: Iterable[str], *, chunk_size: int = 100_000,
               progress=None) -> int:
        """Append ``payloads`` (COPY per chunk). Returns how many."""
        counter = iter(range(1, 1 << 62))

        def write(cur, by_partition: dict[int, list[str]], heads: dict[int, int]) -> None:
            buf = io.StringIO()
            writer = csv.writer(buf)
            for partition, records in by_partition.items():
                base = heads[partition]
                writer.writerows((self.topic, partition, base + i, r)
                                 for i, r in enumerate(records))
            buf.seek(0)
            cur.copy_expert(
                'COPY source_log (topic, partition, "offset", payload) FROM STDIN (FORMAT csv)',
                buf)

        checked = (check_payload(next(counter), p) for p in payloads)
        return catalog.produce_chunks(conn, self.topic, checked, chunk_size, write, progress)
