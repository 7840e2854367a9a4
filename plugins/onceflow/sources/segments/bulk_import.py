"""Importing records at their own offsets (an export of another log, a backfill): what the log
holds already is skipped, kept or refused (``on_conflict``), and the rest written as segments
and indexed in one PostgreSQL transaction.

pyarrow and numpy are imported here at the top: the package loads this module only for an
import, so `import onceflow` loads neither.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson
import pyarrow.parquet as pq

from onceflow.core.db import transaction
from onceflow.core.errors import ConfigError, ImportConflict
from onceflow.core.planner import PartitionRange
from onceflow.sources.segments.read import row_groups
from onceflow.sources.segments.write import (
    largest_payload,
    segment_path,
    segment_schema,
    write_segment_file,
)

log = logging.getLogger(__name__)


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
    low, high = pc.min(offsets).as_py() - base, pc.max(offsets).as_py() - base
    if segment.num_rows and low >= 0 and high < segment.num_rows:
        # consecutive offsets (what an import brings again) are a slice, which copies nothing
        taken = (segment.slice(low, high - low + 1) if high - low + 1 == len(offsets)
                 else segment.take(pc.subtract(offsets, base)))
        if pc.all(pc.equal(taken.column("offset"), offsets)).as_py():
            return taken.column("payload")
    mine = pa.table({"offset": offsets, "at": pa.array(range(len(offsets)), pa.int64())})
    joined = mine.join(segment, keys="offset", join_type="left outer").sort_by("at")
    return joined.column("payload")


def _differing(cur, topic: str, partition: int, rows):
    """Offsets of ``rows`` (below the head, at or above the log start) whose payload is not
    the one the log holds, ascending (a numpy array): each overlapping segment is read once
    (offset and payload only, the row groups that meet the rows' offsets) and compared with
    the rows it holds, column against column."""
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
                write_segment_file(path, part.append_column("produced_at", pa.array(
                    [now] * part.num_rows, pa.timestamp("us", tz="UTC"))).cast(segment_schema()))
                cur.execute(
                    """INSERT INTO source_segments (topic, partition, base_offset, records,
                                                    path, largest_bytes)
                       VALUES (%s, %s, %s, %s, %s, %s)""",
                    (topic, partition, offset, part.num_rows, str(path),
                     largest_payload(part.column("payload").combine_chunks())))
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
