"""Writing segments: a segment file (Parquet, in row groups of ROW_GROUP_ROWS offsets with
partition and offset statistics, fsynced, then renamed into place) and a producer's append,
indexed in the PostgreSQL transaction that advances the heads.

pyarrow is imported here at the top: the package loads this module only where segments are
written (onceflow.sources.segments names it lazily), so `import onceflow` loads no pyarrow.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from onceflow.sources import catalog
from onceflow.sources.pglog import check_payload


def segment_schema():
    return pa.schema([("partition", pa.int32()), ("offset", pa.int64()),
                      ("payload", pa.string()), ("produced_at", pa.timestamp("us", tz="UTC"))])


def segment_path(root: Path, topic: str, partition: int, base: int) -> Path:
    return root / topic / f"p{partition:05d}" / f"{base:020d}.parquet"


# Rows per Parquet row group of a segment. A read of a sub-range decodes only the row groups
# whose offset statistics meet it (Spark's Parquet filter pushdown, payloads() in Python), so
# a batch smaller than a segment reads at most about its own size plus two row groups.
ROW_GROUP_ROWS = 32_768


def write_segment_file(path: Path, table) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    # min/max statistics per row group on partition and offset: what readers skip row groups
    # by; no reader filters on the payload
    pq.write_table(table, tmp, row_group_size=ROW_GROUP_ROWS,
                   write_statistics=["partition", "offset"])
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    tmp.replace(path)


def write_segment(path: Path, partition: int, base: int, records: list[str], now: datetime):
    """One segment file of ``records`` at offsets ``base``... of ``partition``, not indexed
    (produce_segments indexes it); returns its payloads as an Arrow array."""
    payload = pa.array(records, pa.string())
    write_segment_file(path, pa.table({
        "partition": pa.array([partition] * len(records), pa.int32()),
        "offset": pa.array(range(base, base + len(records)), pa.int64()),
        "payload": payload,
        "produced_at": pa.array([now] * len(records), pa.timestamp("us", tz="UTC")),
    }, schema=segment_schema()))
    return payload


def largest_payload(payloads) -> int | None:
    """The byte length of the longest of ``payloads`` (an Arrow string array) when none holds
    a NUL character, else None: what a batch's may_refuse compares with max_record_bytes
    (the spout refuses a record over it, or one with a NUL)."""
    if not len(payloads) or pc.any(pc.match_substring(payloads, "\x00")).as_py():
        return None
    return pc.max(pc.binary_length(payloads)).as_py()


def produce_segments(conn, root: Path, topic: str, payloads: Iterable[str], *,
                     chunk_size: int = 400_000, progress=None) -> int:
    """Append ``payloads`` as segment files, one per partition per chunk, indexed in the same
    PostgreSQL transaction that advances the heads. Returns how many were written."""

    def write(cur, by_partition: dict[int, list[str]], heads: dict[int, int]) -> None:
        now = datetime.now(UTC)
        for partition, records in by_partition.items():
            if not records:
                continue
            base = heads[partition]
            path = segment_path(root, topic, partition, base)
            payload = write_segment(path, partition, base, records, now)
            cur.execute(
                """INSERT INTO source_segments (topic, partition, base_offset, records, path,
                                                largest_bytes)
                   VALUES (%s, %s, %s, %s, %s, %s)""",
                (topic, partition, base, len(records), str(path), largest_payload(payload)),
            )

    counter = iter(range(1, 1 << 62))
    checked = (check_payload(next(counter), p) for p in payloads)
    return catalog.produce_chunks(conn, topic, checked, chunk_size, write, progress)
