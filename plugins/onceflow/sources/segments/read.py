"""Reading segments: the row groups of one that meet a batch's ranges (by their statistics),
the rows within them, and the Spark reader of decoded segments in Python workers.

pyarrow is imported here at the top: the package loads this module only where segments are
read (FileSegments.read and payloads, the import), so `import onceflow` loads no pyarrow.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import reduce
from typing import Any

import pyarrow.compute as pc
import pyarrow.parquet as pq

from onceflow.core.planner import PartitionRange
from onceflow.sources import json_arrow
from onceflow.sources.json_records import JsonRecords
from onceflow.sources.segments import write


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
                yield from json_arrow.decode_batches(records.columns, table, max_bytes,
                                                      write.ROW_GROUP_ROWS)

    return read
