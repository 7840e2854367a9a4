"""File segments: a partitioned log of Parquet segment files, for bulk data.

Layout: ``ROOT/TOPIC/pPARTITION/BASEOFFSET.parquet`` (zero-padded names), each file holding
consecutive offsets of one partition (columns partition, offset, payload, produced_at). The
index is the ``source_segments`` table; heads are ``source_partitions`` (onceflow.sources.
catalog) as for the PostgreSQL log. A producer writes and fsyncs a segment first, then records
it and the new head in one PostgreSQL transaction: a crash in between leaves an unindexed
file, never an indexed hole. Spark's own Parquet reader reads exactly the indexed segments
that overlap the planned ranges, filtered to the ranges, in parallel in the JVM.

The root folder: the source's ``path``, else ``ONCEFLOW_SEGMENTS_DIR``, else
``$ONCEFLOW_HOME/.run/segments``. On a cluster it must be a folder every worker sees (a
shared mount, or any Hadoop file system URI Spark can read).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import ClassVar

from onceflow.core.db import connection, transaction
from onceflow.core.errors import ConfigError, SourceShortfall
from onceflow.core.planner import PartitionRange
from onceflow.sources import catalog
from onceflow.sources.base import Position, Source
from onceflow.sources.pglog import check_payload

log = logging.getLogger(__name__)

def _schema():
    import pyarrow as pa

    return pa.schema([("partition", pa.int32()), ("offset", pa.int64()),
                      ("payload", pa.string()), ("produced_at", pa.timestamp("us", tz="UTC"))])


def segment_path(root: Path, topic: str, partition: int, base: int) -> Path:
    return root / topic / f"p{partition:05d}" / f"{base:020d}.parquet"


def _write_segment(path: Path, table) -> None:
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    pq.write_table(table, tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    tmp.replace(path)


def produce_segments(conn, root: Path, topic: str, payloads: Iterable[str], *,
                     chunk_size: int = 400_000, progress=None) -> int:
    """Append ``payloads`` as segment files, one per partition per chunk, indexed in the same
    PostgreSQL transaction that advances the heads. Returns how many were written."""

    import pyarrow as pa

    def write(cur, by_partition: dict[int, list[str]], heads: dict[int, int]) -> None:
        now = datetime.now(UTC)
        for partition, records in by_partition.items():
            if not records:
                continue
            base = heads[partition]
            path = segment_path(root, topic, partition, base)
            _write_segment(path, pa.table({
                "partition": pa.array([partition] * len(records), pa.int32()),
                "offset": pa.array(range(base, base + len(records)), pa.int64()),
                "payload": pa.array(records, pa.string()),
                "produced_at": pa.array([now] * len(records), pa.timestamp("us", tz="UTC")),
            }, schema=_schema()))
            cur.execute(
                """INSERT INTO source_segments (topic, partition, base_offset, records, path)
                   VALUES (%s, %s, %s, %s, %s)""",
                (topic, partition, base, len(records), str(path)),
            )

    counter = iter(range(1, 1 << 62))
    checked = (check_payload(next(counter), p) for p in payloads)
    return catalog.produce_chunks(conn, topic, checked, chunk_size, write, progress)


def segments_for(cur, topic: str, ranges: Iterable[PartitionRange]) -> list[str]:
    """Paths of the segments holding the ranges' offsets; SourceShortfall when the index does
    not cover a range whole."""
    paths: list[str] = []
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
            paths.append(path)
        if covered < r.end:
            raise SourceShortfall(
                f"topic {topic!r} partition {r.partition}: no segment holds offsets "
                f"[{covered}, {r.end}) of the planned range [{r.start}, {r.end})")
    return paths


@dataclass(frozen=True, kw_only=True)
class FileSegments(Source):
    """Parquet segment files per partition, indexed in PostgreSQL (see the module docstring).

    ``topic``: its name; ``path``: the root folder (None: ONCEFLOW_SEGMENTS_DIR, else
    $ONCEFLOW_HOME/.run/segments); ``partitions``: how many ``onceflow init`` creates.
    """

    kind: ClassVar[str] = "file-segments"
    path: str | None = None
    partitions: int = 4

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.topic, str) or not self.topic:
            raise ConfigError(f"source.topic={self.topic!r} is invalid: name the topic")
        if not isinstance(self.partitions, int) or self.partitions <= 0:
            raise ConfigError(f"source.partitions={self.partitions!r} is invalid: give a "
                              "positive number of partitions")

    def root(self) -> Path:
        if self.path:
            return Path(self.path)
        if os.environ.get("ONCEFLOW_SEGMENTS_DIR"):
            return Path(os.environ["ONCEFLOW_SEGMENTS_DIR"])
        if os.environ.get("ONCEFLOW_HOME"):
            return Path(os.environ["ONCEFLOW_HOME"]) / ".run" / "segments"
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

    def positions(self, cur) -> dict[int, Position]:
        return catalog.positions(cur, self.topic)

    def read(self, spark, dsn: str, ranges: Iterable[PartitionRange]):
        from functools import reduce

        from pyspark.sql import functions as F

        ranges = [r for r in ranges if r.size > 0]
        with connection(dsn, application_name="onceflow-segments") as conn, \
                transaction(conn) as cur:
            paths = segments_for(cur, self.topic, ranges)
        if not paths:
            return spark.createDataFrame([], "partition int, offset long, payload string")
        wanted = reduce(lambda a, b: a | b, [
            (F.col("partition") == r.partition) & (F.col("offset") >= r.start)
            & (F.col("offset") < r.end) for r in ranges])
        return (spark.read.parquet(*paths).where(wanted)
                .select("partition", "offset", "payload"))

    def payloads(self, conn, ranges: Iterable[PartitionRange]
                 ) -> Iterator[tuple[int, int, str]]:
        import pyarrow.parquet as pq

        ranges = [r for r in ranges if r.size > 0]
        with conn.cursor() as cur:
            paths = segments_for(cur, self.topic, ranges)
        by_partition: dict[int, list[PartitionRange]] = {}
        for r in ranges:
            by_partition.setdefault(r.partition, []).append(r)
        for path in dict.fromkeys(paths):
            table = pq.read_table(path, columns=["partition", "offset", "payload"])
            for partition, offset, payload in zip(*(table.column(c).to_pylist() for c in
                                                    ("partition", "offset", "payload")),
                                                  strict=True):
                if any(r.start <= offset < r.end for r in by_partition.get(partition, ())):
                    yield partition, offset, payload

    def append(self, conn, payloads: Iterable[str], *, chunk_size: int = 400_000,
               progress=None) -> int:
        return produce_segments(conn, self.root(), self.topic, payloads, chunk_size=chunk_size,
                                progress=progress)
