"""FileSegments: the Source over a partitioned log of Parquet segment files (see
onceflow.sources.segments), the index's segments a batch reads, and the JVM reader of
decoded segments."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from functools import reduce
from pathlib import Path
from typing import ClassVar

from onceflow.core import settings
from onceflow.core.db import connection, transaction
from onceflow.core.errors import ConfigError, SourceShortfall
from onceflow.core.planner import PartitionRange
from onceflow.core.source import Position, require_partitions, require_topic
from onceflow.sources import catalog
from onceflow.sources.folders import require_roots
from onceflow.sources.json_records import JsonRecords, JsonSchemaSource
from onceflow.sources.jvm import SEGMENTS_READER, jvm_reader

SPARK_SCHEMA = "partition int, offset long, payload string"  # the columns a batch reads


def segments_for(cur, topic: str, ranges: Iterable[PartitionRange]) -> dict[str, int]:
    """Paths of the segments holding the ranges' offsets, each once (ranges of several txids,
    as verify reads them, share segments: a path given to Spark twice is read twice), with
    their partitions; SourceShortfall when the index does not cover a range whole."""
    paths: dict[str, int] = {}
    for r in ranges:
        if r.size <= 0:
            continue
        cur.execute(
            """SELECT base_offset, records, path FROM source_segments
               WHERE topic = %s AND partition = %s
                 AND base_offset < %s AND base_offset + records > %s
               ORDER BY base_offset""",
            (topic, r.partition, r.end, r.start),
        )
        covered = r.start
        for base, records, path in cur.fetchall():
            if base > covered:
                break
            covered = max(covered, base + records)
            paths[path] = r.partition
        if covered < r.end:
            raise SourceShortfall(
                f"topic {topic!r} partition {r.partition}: no segment holds offsets "
                f"[{covered}, {r.end}) of the planned range [{r.start}, {r.end})")
    return paths


@dataclass(frozen=True, kw_only=True)
class FileSegments(JsonSchemaSource):
    """Parquet segment files per partition, indexed in PostgreSQL (see onceflow.sources.segments).

    ``topic``: its name; ``path``: the root folder (None: ONCEFLOW_SEGMENTS_DIR, else
    $ONCEFLOW_HOME/.run/segments); ``partitions``: how many ``onceflow init`` creates;
    ``json_schema``: the payloads' fields as Spark DDL of simple types, decoded as the
    segments are read (the records then carry these columns and ``_corrupt_record`` instead
    of ``payload``; see the module docstring).
    """

    kind: ClassVar[str] = "file-segments"
    path: str | None = None
    partitions: int = 4

    def validate(self) -> None:
        super().validate()
        require_topic(self.topic)
        require_partitions(self.partitions)

    def root(self) -> Path:
        if self.path:
            return Path(self.path)
        if settings.get("segments_dir"):
            return Path(settings.get("segments_dir"))
        if settings.get("home"):
            return Path(settings.get("home")) / ".run" / "segments"
        raise ConfigError("source.path=None and neither ONCEFLOW_SEGMENTS_DIR nor "
                          "ONCEFLOW_HOME is set: give the segments folder in the source's path")

    def ensure(self, conn, *, create: bool = False) -> None:
        root = self.root()
        if create:
            root.mkdir(parents=True, exist_ok=True)
        elif not root.is_dir():
            raise ConfigError(
                f"source.path={str(root)!r} does not exist: create it, or point the source's "
                "path (or ONCEFLOW_SEGMENTS_DIR) at the segments folder")
        catalog.ensure_topic(conn, self.topic, self.partitions, create=create)

    arrival_by_sight = False

    def arrivals(self, cur, points: Iterable[tuple[int, int]]) -> dict[tuple[int, int], datetime]:
        """A record arrived when its segment was indexed (written or imported)."""
        return catalog.at_points(cur, """
            SELECT w.p, w.o, (SELECT s.indexed_at FROM source_segments s
                              WHERE s.topic = %(topic)s AND s.partition = w.p
                                AND s.base_offset <= w.o
                              ORDER BY s.base_offset DESC LIMIT 1)
            FROM unnest(%(partitions)s::int[], %(offsets)s::bigint[]) AS w (p, o)""",
                                 self.topic, points)

    def positions(self, cur) -> dict[int, Position]:
        return catalog.positions(cur, self.topic)

    def may_refuse(self, cur, ranges: Iterable[PartitionRange]) -> bool:
        """True when a segment of ``ranges`` was not found clean up to today's
        max_record_bytes when it was written (``largest_bytes``: see largest_payload)."""
        ranges = [r for r in ranges if r.size > 0]
        if not ranges:
            return False
        cur.execute(
            """SELECT coalesce(bool_or(s.largest_bytes IS NULL OR s.largest_bytes > %s), false)
               FROM source_segments s
               JOIN unnest(%s::int[], %s::bigint[], %s::bigint[]) AS r (part, lo, hi)
                 ON s.partition = r.part AND s.base_offset < r.hi
                    AND s.base_offset + s.records > r.lo
               WHERE s.topic = %s""",
            (self.max_record_bytes, [r.partition for r in ranges], [r.start for r in ranges],
             [r.end for r in ranges], self.topic))
        return cur.fetchone()[0]

    def read(self, spark, dsn: str, ranges: Iterable[PartitionRange]):
        # imported here: pyspark loads only where Spark is used
        from pyspark.sql import functions as F

        ranges = [r for r in ranges if r.size > 0]
        with connection(dsn, application_name="onceflow-segments") as conn, \
                transaction(conn) as cur:
            paths = segments_for(cur, self.topic, ranges)
        require_roots(paths, 3)  # ROOT/TOPIC/pPARTITION/BASE.parquet
        if not paths:
            return spark.createDataFrame([], self.read_ddl)
        if self.records is not None:
            return self._read_decoding(spark, list(paths.items()), ranges)
        # pushed down to the Parquet reader: it skips the row groups whose partition and
        # offset statistics miss every range; the schema given spares reading a footer on
        # the driver
        wanted = reduce(lambda a, b: a | b, [
            (F.col("partition") == r.partition) & (F.col("offset") >= r.start)
            & (F.col("offset") < r.end) for r in ranges])
        return (spark.read.schema(SPARK_SCHEMA).parquet(*paths).where(wanted)
                .select("partition", "offset", "payload"))

    def _read_decoding(self, spark, segments: list[tuple[str, int]],
                       ranges: list[PartitionRange]):
        """The records of ``segments`` within ``ranges``, their payloads decoded where they
        are read: one Spark task per segment, in the JVM (local paths) or in Python
        workers (the same rows)."""
        from onceflow.sources.segments.read import decoding_reader  # pyarrow: read, not import

        if jvm_reader(spark) and not any("://" in path for path, _ in segments):
            return jvm_segments(spark, segments, [(r.partition, r.start, r.end) for r in ranges],
                                self.records, self.max_record_bytes)
        tasks = spark.range(0, len(segments), 1, numPartitions=len(segments))
        return tasks.mapInArrow(decoding_reader(segments, ranges, self.records,
                                                 self.max_record_bytes), self.read_ddl)

    def payloads(self, conn, ranges: Iterable[PartitionRange]
                 ) -> Iterator[tuple[int, int, str]]:
        from onceflow.sources.segments.read import read_ranges  # pyarrow: where files are read

        ranges = [r for r in ranges if r.size > 0]
        with conn.cursor() as cur:
            paths = segments_for(cur, self.topic, ranges)
        require_roots(paths, 3)
        for path in paths:
            table = read_ranges(path, ranges, ["partition", "offset", "payload"])
            yield from zip(*(table.column(c).to_pylist() for c in
                             ("partition", "offset", "payload")), strict=True)

    def append(self, conn, payloads: Iterable[str], *, chunk_size: int = 400_000,
               progress=None) -> int:
        from onceflow.sources.segments.write import produce_segments  # pyarrow: to write files

        return produce_segments(conn, self.root(), self.topic, payloads, chunk_size=chunk_size,
                                progress=progress)


def jvm_segments(spark, segments: list[tuple[str, int]], wanted: list[tuple[int, int, int]],
                 records: JsonRecords, max_bytes: int):
    """The JVM reader (onceflow.spark.SegmentsSource) over local ``segments`` ((path,
    partition)): the records in ``wanted`` ((partition, start, end)), decoded by
    ``records``."""
    spec = {"segments": [list(s) for s in segments], "wanted": [list(w) for w in wanted],
            "columns": list(map(list, records.columns)), "max_record_bytes": max_bytes}
    return spark.read.format(SEGMENTS_READER).option("spec", json.dumps(spec)).load()
