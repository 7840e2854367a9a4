"""File segments: a partitioned log of Parquet segment files, for bulk data.

Layout: ``ROOT/TOPIC/pPARTITION/BASEOFFSET.parquet`` (zero-padded names), each file holding
consecutive offsets of one partition (columns partition, offset, payload, produced_at). The
index is the ``source_segments`` table; heads are ``source_partitions`` (onceflow.sources.
catalog) as for the PostgreSQL log. A producer writes and fsyncs a segment first, then
records it and the new head in one PostgreSQL transaction: a crash in between leaves an
unindexed file, never an indexed hole. Spark's own Parquet reader reads exactly the indexed
segments that overlap the planned ranges, filtered to the ranges, in parallel in the JVM.
The index also keeps what the writer saw of each segment's payloads (``largest_bytes``: the
longest, when none holds a NUL), so a batch is searched for records the spout refuses only
when one of its segments may hold one.

A segment is written in row groups of ROW_GROUP_ROWS consecutive offsets, with min/max
statistics on partition and offset: the range filter is pushed down to
the Parquet reader, which decodes only the row groups that meet a range, so a batch smaller
than a segment does not decode the whole segment; ``payloads`` (Python) picks the row groups
by the same statistics. A segment of one row group (as written before) reads the same way.

With a declared ``json_schema`` each payload is decoded where it is read, by the rules of
onceflow.sources.json_records, as a landing folder's JSON lines are: the records carry the
declared columns and ``_corrupt_record`` instead of ``payload``, and the topology parses
nothing. In the JVM when the session has onceflow's jar (``onceflow.spark.SegmentsSource``:
the payload bytes of the row groups that meet the ranges go straight to the decoder), else
in Python workers (pyarrow and msgspec); the two give the same rows.

The root folder: the source's ``path``, else ``ONCEFLOW_SEGMENTS_DIR``, else
``$ONCEFLOW_HOME/.run/segments``. On a cluster it must be a folder every worker sees (a
shared mount, or any Hadoop file system URI Spark can read).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import reduce
from pathlib import Path
from typing import Any, ClassVar

from onceflow.core import settings
from onceflow.core.db import connection, transaction
from onceflow.core.errors import ConfigError, ImportConflict, SourceShortfall
from onceflow.core.planner import PartitionRange
from onceflow.core.source import Position, require_partitions, require_topic
from onceflow.sources import catalog
from onceflow.sources.folders import require_roots
from onceflow.sources.json_records import JsonRecords, JsonSchemaSource
from onceflow.sources.jvm import SEGMENTS_READER, jvm_reader
from onceflow.sources.pglog import check_payload

log = logging.getLogger(__name__)

def _schema():
    import pyarrow as pa  # lazy: `import onceflow` loads no pyarrow

    return pa.schema([("partition", pa.int32()), ("offset", pa.int64()),
                      ("payload", pa.string()), ("produced_at", pa.timestamp("us", tz="UTC"))])


SPARK_SCHEMA = "partition int, offset long, payload string"  # the columns a batch reads


def segment_path(root: Path, topic: str, partition: int, base: int) -> Path:
    return root / topic / f"p{partition:05d}" / f"{base:020d}.parquet"


# Rows per Parquet row group of a segment. A read of a sub-range decodes only the row groups
# whose offset statistics meet it (Spark's Parquet filter pushdown, payloads() in Python), so
# a batch smaller than a segment reads at most about its own size plus two row groups.
ROW_GROUP_ROWS = 32_768


def _write_segment(path: Path, table) -> None:
    import pyarrow.parquet as pq  # lazy: `import onceflow` loads no pyarrow

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
    import pyarrow as pa  # lazy: `import onceflow` loads no pyarrow

    payload = pa.array(records, pa.string())
    _write_segment(path, pa.table({
        "partition": pa.array([partition] * len(records), pa.int32()),
        "offset": pa.array(range(base, base + len(records)), pa.int64()),
        "payload": payload,
        "produced_at": pa.array([now] * len(records), pa.timestamp("us", tz="UTC")),
    }, schema=_schema()))
    return payload


def _largest(payloads) -> int | None:
    """The byte length of the longest of ``payloads`` (an Arrow string array) when none holds
    a NUL character, else None: what a batch's may_refuse compares with max_record_bytes
    (the spout refuses a record over it, or one with a NUL)."""
    import pyarrow.compute as pc  # lazy: `import onceflow` loads no pyarrow

    if not len(payloads) or pc.any(pc.match_substring(payloads, "\x00")).as_py():
        return None
    return pc.max(pc.binary_length(payloads)).as_py()


def produce_segments(conn, root: Path, topic: str, payloads: Iterable[str], *,
                     chunk_size: int = 400_000, progress=None) -> int:
    """Append ``payloads`` as segment files, one per partition per chunk, indexed in the same
    PostgreSQL transaction that advances the heads. Returns how many were written."""

    # imported here: pyarrow is heavy: it loads only where files are read or written

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
                (topic, partition, base, len(records), str(path), _largest(payload)),
            )

    counter = iter(range(1, 1 << 62))
    checked = (check_payload(next(counter), p) for p in payloads)
    return catalog.produce_chunks(conn, topic, checked, chunk_size, write, progress)


ON_CONFLICT = ("refuse", "keep-existing")


@dataclass
class Imported:
    records: int = 0  # written as segments
    skipped: int = 0  # at offsets the log holds already, with the same payload
    kept: int = 0  # at offsets the log holds with another payload, left as the log has them
    before_start: int = 0  # below their partition's log start: not imported (keep-existing)
    segments: int = 0
    heads: dict[int, int] | None = None


@dataclass
class _Clash:
    """What of one partition's records the log has otherwise (found before anything is
    written)."""

    partition: int
    differ: Any  # offsets below the head whose payload is not the log's (numpy, ascending)
    before: tuple[int, int, int] | None = None  # (first offset, log start, records) below it


def _first_run(offsets) -> tuple[int, int]:
    """The first run of consecutive offsets (ascending, numpy): (first, last)."""
    breaks = (offsets[1:] - offsets[:-1]) != 1
    last = int(breaks.argmax()) if breaks.any() else len(offsets) - 1
    return int(offsets[0]), int(offsets[last])


def _span(first: int, last: int) -> str:
    return f"offset {first}" if first == last else f"offsets {first}..{last}"


def _refusal(topic: str, clashes: list[_Clash]) -> str:
    parts = []
    differ = [c for c in clashes if len(c.differ)]
    if differ:
        n = sum(len(c.differ) for c in differ)
        first = differ[0]
        a, b = _first_run(first.differ)
        where = f"; {len(differ)} partitions in all" if len(differ) > 1 else ""
        parts.append(f"{n} record(s) are at offsets the log already holds with another "
                     f"payload (first: partition {first.partition}, {_span(a, b)}{where})")
    before = [c for c in clashes if c.before]
    if before:
        n = sum(c.before[2] for c in before)
        first = before[0]
        low, log_start, _ = first.before
        parts.append(f"{n} record(s) lie below their partition's log start, where the log "
                     f"has no records (first: partition {first.partition}, "
                     f"{_span(low, log_start - 1)}; the log starts at {log_start})")
    return (f"import into topic {topic!r} refused, nothing imported: {'; '.join(parts)}. "
            "The log keeps the records it has: a batch may have read them, and reading other "
            "payloads at the same offsets would break exactly-once. Pass --on-conflict "
            "keep-existing to keep the log's records and import only the new ones past each "
            "head, or import different data into a new topic")


def _aligned(segment, base: int, offsets):
    """The payloads ``segment`` (a segment's offset and payload columns) holds at
    ``offsets``, in their order (null where it holds none). A segment holds consecutive
    offsets from its base in order, so offset o is row o - base; a file that does not
    (not written by onceflow) is joined on offset instead."""
    import pyarrow.compute as pc  # lazy: `import onceflow` loads no pyarrow

    low, high = pc.min(offsets).as_py() - base, pc.max(offsets).as_py() - base
    if segment.num_rows and low >= 0 and high < segment.num_rows:
        # consecutive offsets (what an import brings again) are a slice, which copies nothing
        taken = (segment.slice(low, high - low + 1) if high - low + 1 == len(offsets)
                 else segment.take(pc.subtract(offsets, base)))
        if pc.all(pc.equal(taken.column("offset"), offsets)).as_py():
            return taken.column("payload")
    import pyarrow as pa  # lazy: `import onceflow` loads no pyarrow

    mine = pa.table({"offset": offsets, "at": pa.array(range(len(offsets)), pa.int64())})
    joined = mine.join(segment, keys="offset", join_type="left outer").sort_by("at")
    return joined.column("payload")


def _differing(cur, topic: str, partition: int, rows):
    """Offsets of ``rows`` (below the head, at or above the log start) whose payload is not
    the one the log holds, ascending (a numpy array): each overlapping segment is read once
    (offset and payload only, the row groups that meet the rows' offsets) and compared with
    the rows it holds, column against column."""
    import numpy as np  # lazy: `import onceflow` loads no numpy
    import pyarrow.compute as pc  # lazy: `import onceflow` loads no pyarrow
    import pyarrow.parquet as pq  # lazy: `import onceflow` loads no pyarrow

    offsets = rows.column("offset")
    low, high = pc.min(offsets).as_py(), pc.max(offsets).as_py() + 1
    cur.execute("""SELECT base_offset, records, path FROM source_segments
                   WHERE topic = %s AND partition = %s
                     AND base_offset < %s AND base_offset + records > %s
                   ORDER BY base_offset""", (topic, partition, high, low))
    found = []
    for base, records, path in cur.fetchall():
        inside = pc.and_(pc.greater_equal(offsets, base), pc.less(offsets, base + records))
        mine = rows.filter(inside)
        if not mine.num_rows:
            continue
        mine_offsets = mine.column("offset")
        span = PartitionRange(partition, pc.min(mine_offsets).as_py(),
                              pc.max(mine_offsets).as_py() + 1)
        with pq.ParquetFile(path) as f:
            groups = row_groups(f.metadata, [span])
            # the rows before the first row group read: where its offsets start
            before = sum(f.metadata.row_group(g).num_rows for g in range(groups[0])) \
                if groups else 0
            segment = f.read_row_groups(groups, columns=["offset", "payload"])
        held = _aligned(segment, base + before, mine_offsets)
        same = pc.fill_null(pc.equal(mine.column("payload"), held), False)
        found.append(mine.column("offset").filter(pc.invert(same)).to_numpy())
        outside = pc.invert(inside)
        rows, offsets = rows.filter(outside), offsets.filter(outside)
    # what no indexed segment holds (an index hole, which onceflow never makes) is not the log's
    found.append(offsets.to_numpy())
    return np.sort(np.concatenate(found))


def _unique_offsets(topic: str, partition: int, rows):
    """``rows`` (sorted by offset) with repeated records dropped; ImportConflict when the
    import holds two payloads for one offset (no flag can choose between them)."""
    import numpy as np  # lazy: `import onceflow` loads no numpy
    import pyarrow as pa  # lazy: `import onceflow` loads no pyarrow
    import pyarrow.compute as pc  # lazy: `import onceflow` loads no pyarrow

    numbers = rows.column("offset").to_numpy()
    repeated = numbers[1:] == numbers[:-1]
    if not repeated.any():
        return rows
    at = np.flatnonzero(repeated)
    payloads = rows.column("payload")
    same = pc.fill_null(pc.equal(payloads.take(pa.array(at)), payloads.take(pa.array(at + 1))),
                        False).to_numpy(zero_copy_only=False)
    if not same.all():
        bad = int(numbers[at[int(same.argmin())]])
        raise ImportConflict(
            f"import into topic {topic!r} partition {partition}: offset {bad} appears twice "
            "in the files with different payloads; nothing imported (give each offset once)")
    return rows.filter(pa.array(np.concatenate([[True], ~repeated])))


def import_segments(conn, root: Path, topic: str, table, *, chunk_size: int = 400_000,
                    on_conflict: str = "refuse") -> Imported:
    """Import records that already have their partition and offset (an export of a Kafka
    topic, another log) as segment files, keeping both: ``table`` is an Arrow table with
    columns partition, offset, payload. Per partition the new offsets must be consecutive and
    go on from the head (an empty partition starts at the first offset given: its log starts
    there). A record at an offset the log holds already with the same payload was imported
    before and is skipped, so importing the same files twice changes nothing; one offset given
    twice with the same payload counts once.

    ``on_conflict``: what to do with records the log already has otherwise (at an offset
    below the head with another payload, or below the partition's log start): "refuse" (the
    default) refuses the whole import (ImportConflict naming the first conflicting range and
    how many records); "keep-existing" keeps the log's records and imports the rest. There is
    no "replace": a batch may have read those offsets, and a record read differently on a
    re-run would break exactly-once. Anything else wrong is refused (ConfigError naming the
    partition and the offsets). Every refusal comes before a file is written."""
    import numpy as np  # lazy: `import onceflow` loads no numpy
    import pyarrow as pa  # lazy: `import onceflow` loads no pyarrow
    import pyarrow.compute as pc  # lazy: `import onceflow` loads no pyarrow

    if on_conflict not in ON_CONFLICT:
        raise ConfigError(f"on_conflict={on_conflict!r} is invalid: give one of "
                          f"{', '.join(ON_CONFLICT)}")
    missing = {"partition", "offset", "payload"} - set(table.column_names)
    if missing:
        raise ConfigError(f"import into topic {topic!r}: column(s) {sorted(missing)} missing "
                          f"(the records have {table.column_names}); give partition, offset "
                          "and payload")
    table = table.select(["partition", "offset", "payload"]).cast(pa.schema([
        ("partition", pa.int32()), ("offset", pa.int64()), ("payload", pa.string())]))
    table = table.sort_by([("partition", "ascending"), ("offset", "ascending")])
    out = Imported()
    with transaction(conn) as cur:
        cur.execute("""SELECT partition, log_start_offset, next_offset FROM source_partitions
                       WHERE topic = %s ORDER BY partition FOR UPDATE""", (topic,))
        known = {p: (start, head) for p, start, head in cur.fetchall()}
        if not known:
            raise ConfigError(f"topic {topic!r} has no partitions: register the pipeline "
                              "first (`onceflow init`)")
        plan, clashes = [], []
        for partition in pc.unique(table.column("partition")).to_pylist():
            if partition not in known:
                raise ConfigError(
                    f"import into topic {topic!r}: partition {partition} is not one of its "
                    f"{len(known)} partitions (0..{len(known) - 1}); declare the source with "
                    "as many partitions as the data has")
            rows = _unique_offsets(topic, partition, table.filter(
                pc.equal(table.column("partition"), partition)))
            offsets = rows.column("offset")
            start, head = known[partition]
            empty = head == start and not _has_segments(cur, topic, partition)
            fresh = rows if empty else rows.filter(pc.greater_equal(offsets, head))
            clash = _Clash(partition, np.empty(0, np.int64))
            if not empty:
                below = rows.filter(pc.less(offsets, start))
                if below.num_rows:
                    clash.before = (below.column("offset")[0].as_py(), start, below.num_rows)
                old = rows.filter(pc.and_(pc.greater_equal(offsets, start),
                                          pc.less(offsets, head)))
                if old.num_rows:
                    clash.differ = _differing(cur, topic, partition, old)
                out.skipped += old.num_rows - len(clash.differ)
                if len(clash.differ) or clash.before:
                    clashes.append(clash)
            if not fresh.num_rows:
                continue
            first = fresh.column("offset")[0].as_py()
            if first != head and not empty:
                raise ConfigError(
                    f"import into topic {topic!r} partition {partition}: the records start at "
                    f"offset {first}, the partition's head is {head}: offsets must go on from "
                    "the head (import the missing records first)")
            numbers = fresh.column("offset").to_numpy()
            jumps = (numbers[1:] - numbers[:-1]) != 1
            if jumps.any():
                at = int(jumps.argmax())
                raise ConfigError(
                    f"import into topic {topic!r} partition {partition}: offset "
                    f"{int(numbers[at + 1])} follows {int(numbers[at])}; a partition's offsets "
                    "must be consecutive (a compacted export cannot be imported as a log)")
            if pc.any(pc.is_null(fresh.column("payload"))).as_py():
                raise ConfigError(f"import into topic {topic!r} partition {partition}: a "
                                  "record has no payload")
            plan.append((partition, first, fresh))
        if clashes and on_conflict == "refuse":
            raise ImportConflict(_refusal(topic, clashes))
        for clash in clashes:
            out.kept += len(clash.differ)
            out.before_start += clash.before[2] if clash.before else 0
        if clashes:
            log.warning("IMPORT topic=%s: kept the log's records (on_conflict=keep-existing): "
                        "%d at offsets it holds with another payload, %d below a log start",
                        topic, out.kept, out.before_start)
        now = datetime.now(UTC)
        for partition, first, rows in plan:
            for base in range(0, rows.num_rows, chunk_size):
                part = rows.slice(base, chunk_size)
                offset = first + base
                path = segment_path(root, topic, partition, offset)
                _write_segment(path, part.append_column("produced_at", pa.array(
                    [now] * part.num_rows, pa.timestamp("us", tz="UTC"))).cast(_schema()))
                cur.execute(
                    """INSERT INTO source_segments (topic, partition, base_offset, records,
                                                    path, largest_bytes)
                       VALUES (%s, %s, %s, %s, %s, %s)""",
                    (topic, partition, offset, part.num_rows, str(path),
                     _largest(part.column("payload").combine_chunks())))
                out.segments += 1
            end = first + rows.num_rows
            cur.execute("""UPDATE source_partitions SET next_offset = %s,
                                  log_start_offset = CASE WHEN next_offset = log_start_offset
                                                          THEN %s ELSE log_start_offset END
                           WHERE topic = %s AND partition = %s""",
                        (end, first, topic, partition))
            out.records += rows.num_rows
        cur.execute("SELECT partition, next_offset FROM source_partitions WHERE topic = %s",
                    (topic,))
        out.heads = dict(cur.fetchall())
    log.info("imported %d records into %s as %d segments (%d already there)", out.records,
             topic, out.segments, out.skipped)
    return out


def _has_segments(cur, topic: str, partition: int) -> bool:
    cur.execute("SELECT 1 FROM source_segments WHERE topic = %s AND partition = %s LIMIT 1",
                (topic, partition))
    return cur.fetchone() is not None


def read_export(paths: Iterable[str]):
    """Records with their partition and offset from Parquet or JSON-lines files (fields
    partition, offset, payload), as one Arrow table."""
    import pyarrow as pa  # lazy: `import onceflow` loads no pyarrow
    import pyarrow.json as pajson  # lazy: `import onceflow` loads no pyarrow
    import pyarrow.parquet as pq  # lazy: `import onceflow` loads no pyarrow

    tables = []
    for path in paths:
        if not Path(path).is_file():
            raise ConfigError(f"{path!r} is not a file: give Parquet (.parquet) or JSON-lines "
                              "files with partition, offset and payload")
        if str(path).endswith(".parquet"):
            tables.append(pq.read_table(path))
        else:
            tables.append(pajson.read_json(path, parse_options=pajson.ParseOptions(
                explicit_schema=pa.schema([("partition", pa.int32()), ("offset", pa.int64()),
                                           ("payload", pa.string())]))))
    if not tables:
        raise ConfigError("nothing to import: give one or more files")
    return pa.concat_tables([t.select(["partition", "offset", "payload"]) for t in tables],
                            promote_options="permissive")


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


def _decoding_reader(segments: list[tuple[str, int]], ranges: list[PartitionRange],
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
                yield from records.decode_batches(table, max_bytes, ROW_GROUP_ROWS)

    return read


@dataclass(frozen=True, kw_only=True)
class FileSegments(JsonSchemaSource):
    """Parquet segment files per partition, indexed in PostgreSQL (see the module docstring).

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
        max_record_bytes when it was written (``largest_bytes``: see _largest)."""
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
        if jvm_reader(spark) and not any("://" in path for path, _ in segments):
            return jvm_segments(spark, segments, [(r.partition, r.start, r.end) for r in ranges],
                                self.records, self.max_record_bytes)
        tasks = spark.range(0, len(segments), 1, numPartitions=len(segments))
        return tasks.mapInArrow(_decoding_reader(segments, ranges, self.records,
                                                 self.max_record_bytes), self.read_ddl)

    def payloads(self, conn, ranges: Iterable[PartitionRange]
                 ) -> Iterator[tuple[int, int, str]]:
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
