"""The file-segment source: a partitioned log of Parquet segment files, for bulk data.

Layout: ``ROOT/TOPIC/pPARTITION/BASEOFFSET.parquet`` (zero-padded names), each file holding
consecutive offsets of one partition (columns partition, offset, payload, produced_at). The
index is the ``source_segments`` table; heads are ``source_partitions`` as for the PostgreSQL
log, so the planner, the offsets and the commit are the same for both kinds. A producer
writes and fsyncs a segment first, then records it and the new head in one PostgreSQL
transaction: a crash in between leaves an unindexed file, never an indexed hole.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from onceflow.source import produce_chunks

log = logging.getLogger(__name__)

SCHEMA = pa.schema([("partition", pa.int32()), ("offset", pa.int64()),
                    ("payload", pa.string()), ("produced_at", pa.timestamp("us", tz="UTC"))])


def segment_path(root: Path, topic: str, partition: int, base: int) -> Path:
    return root / topic / f"p{partition:05d}" / f"{base:020d}.parquet"


def _write_segment(path: Path, table: pa.Table) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    pq.write_table(table, tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    tmp.replace(path)


def produce_segments(conn, root: Path, topic: str, payloads: Iterable[str], *,
                     chunk_size: int = 400_000) -> int:
    """Append ``payloads`` as segment files, one per partition per chunk, indexed in the same
    PostgreSQL transaction that advances the heads. Returns how many were written."""

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
            }, schema=SCHEMA))
            cur.execute(
                """INSERT INTO source_segments (topic, partition, base_offset, records, path)
                   VALUES (%s, %s, %s, %s, %s)""",
                (topic, partition, base, len(records), str(path)),
            )

    return produce_chunks(conn, topic, payloads, chunk_size, write)


def segments_for(cur, topic: str, ranges: Iterable[tuple[int, int, int]]) -> list[str]:
    """Paths of the segments holding any offset of the (partition, start, end) ranges."""
    paths: list[str] = []
    for partition, start, end in ranges:
        if end <= start:
            continue
        cur.execute(
            """SELECT path FROM source_segments
               WHERE topic = %s AND partition = %s
                 AND base_offset < %s AND base_offset + records > %s
               ORDER BY base_offset""",
            (topic, partition, end, start),
        )
        paths += [p for (p,) in cur.fetchall()]
    return paths


def iter_segment_payloads(conn, topic: str, ends: dict[int, int],
                          skipped: list[tuple[int, int, int]] = (),
                          parked: frozenset[tuple[int, int]] = frozenset()) -> Iterator[str]:
    """Payloads below ``ends[partition]``, leaving out the ``skipped`` (partition, from, to)
    ranges and the ``parked`` (partition, offset) records (verify's reading of a file topic)."""
    with conn.cursor() as cur:
        paths = segments_for(cur, topic, [(p, 0, end) for p, end in ends.items()])
    conn.commit()
    for path in paths:
        table = pq.read_table(path, columns=["partition", "offset", "payload"])
        for partition, offset, payload in zip(*(table.column(c).to_pylist()
                                                for c in ("partition", "offset", "payload")),
                                              strict=True):
            if offset >= ends[partition]:
                continue
            if any(p == partition and lo <= offset < hi for p, lo, hi in skipped):
                continue
            if (partition, offset) in parked:
                continue
            yield payload
