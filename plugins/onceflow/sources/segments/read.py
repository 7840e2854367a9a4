"""Reading segments: the indexed segments that hold a batch's ranges, the row groups of one
that meet them (by their statistics), and the rows within them; the Spark readers of decoded
segments (Python workers, or the JVM reader of onceflow's jar)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import reduce
from typing import Any

from onceflow.core.errors import SourceShortfall
from onceflow.core.planner import PartitionRange
from onceflow.sources.json_records import JsonRecords
from onceflow.sources.jvm import SEGMENTS_READER
from onceflow.sources.segments import write


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


def _stats(meta, group: int, column: int) -> tuple[Any, Any] | None:
    stats = meta.row_group(group).column(column).statistics
    return (stats.min, stats.max) if stats is not None and stats.has_min_max else None


def row_groups(meta, ranges: Iterable[PartitionRange]) -> list[int]:
    """The row groups of a segment (its Parquet metadata) that may hold an offset of
    ``ranges``, by their partition and offset statistics; a row group without statistics
    (a file not written by onceflow) is kept, so a read of it filters every row."""
    names = meta.schema.names
    partition, offset = names.index("partition"), names.index("offset")
    kept = []
    for group in range(meta.num_row_groups):
        p, o = _stats(meta, group, partition), _stats(meta, group, offset)
        if any((p is None or p[0] <= r.partition <= p[1])
               and (o is None or (r.start <= o[1] and o[0] < r.end)) for r in ranges):
            kept.append(group)
    return kept


def read_ranges(path: str, ranges: Iterable[PartitionRange], columns: list[str]):
    """The rows of the segment at ``path`` within ``ranges`` (``columns`` of them, as an Arrow
    table in file order), decoding only the row groups whose statistics meet the ranges."""
    import pyarrow.compute as pc  # lazy: `import onceflow` loads no pyarrow
    import pyarrow.parquet as pq  # lazy: `import onceflow` loads no pyarrow

    ranges = list(ranges)
    with pq.ParquetFile(path) as f:
        wanted = sorted(set(columns) | {"partition", "offset"})
        table = f.read_row_groups(row_groups(f.metadata, ranges), columns=wanted)
    inside = [pc.and_(pc.equal(table.column("partition"), r.partition),
                      pc.and_(pc.greater_equal(table.column("offset"), r.start),
                              pc.less(table.column("offset"), r.end))) for r in ranges]
    if not inside:
        return table.slice(0, 0).select(columns)
    return table.filter(reduce(pc.or_, inside)).select(columns)


def decoding_reader(segments: list[tuple[str, int]], ranges: list[PartitionRange],
                     records: JsonRecords, max_bytes: int):
    """The mapInArrow function reading ``segments`` ((path, partition)) by index (the ids of
    spark.range): each one's records within ``ranges``, their payloads decoded by
    ``records`` (the declared columns, ``_corrupt_record`` and the spout's ``_problem``),
    a row group's worth at a time."""
    def read(batches):
        for batch in batches:
            for index in batch.column("id").to_pylist():
                path, partition = segments[index]
                mine = [r for r in ranges if r.partition == partition]
                table = read_ranges(path, mine, ["partition", "offset", "payload"])
                yield from records.decode_batches(table, max_bytes, write.ROW_GROUP_ROWS)

    return read


def jvm_segments(spark, segments: list[tuple[str, int]], wanted: list[tuple[int, int, int]],
                 records: JsonRecords, max_bytes: int):
    """The JVM reader (onceflow.spark.SegmentsSource) over local ``segments`` ((path,
    partition)): the records in ``wanted`` ((partition, start, end)), decoded by
    ``records``."""
    spec = {"segments": [list(s) for s in segments], "wanted": [list(w) for w in wanted],
            "columns": list(map(list, records.columns)), "max_record_bytes": max_bytes}
    return spark.read.format(SEGMENTS_READER).option("spec", json.dumps(spec)).load()
