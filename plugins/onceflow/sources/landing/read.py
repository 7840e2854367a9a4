"""Reading a landing folder's planned ranges: the manifest's chunks that hold them, read by one
Spark task per chunk (or the JVM reader, or Spark's Parquet reader), each chunk's bytes checked
against its CRC-32 as it is read: a changed or removed file is refused by name. pyarrow at the
top: see onceflow.sources.landing.scan."""

from __future__ import annotations

import json
import os
import posixpath
import zlib
from collections.abc import Iterable, Iterator
from functools import reduce

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow import fs

from onceflow.core.db import connection, transaction
from onceflow.core.errors import SourceChanged, SourceShortfall
from onceflow.core.planner import PartitionRange
from onceflow.core.source import CORRUPT, PROBLEM
from onceflow.core.tables import SPARK_JSON
from onceflow.sources import json_arrow
from onceflow.sources.json_records import JsonRecords
from onceflow.sources.jvm import READER as JVM_READER
from onceflow.sources.jvm import jvm_reader
from onceflow.sources.landing.files import REPAIR_HINT, Chunk
from onceflow.sources.landing.scan import (
    crc_of,
    csv_array,
    line_array,
    line_bytes,
    parquet_footer,
    row_group_bytes,
)
from onceflow.sources.landing.storage import open_filesystem, require_folder


def chunks_of(folder, cur, ranges: Iterable[PartitionRange]) -> list[Chunk]:
    """Every chunk overlapping ``ranges`` (void ones too: they hold their offsets, with no
    record); SourceShortfall when the manifest does not cover a range whole."""
    out = []
    for r in ranges:
        if r.size <= 0:
            continue
        cur.execute(
            """SELECT f.path, f.size, f.mtime, c.first_offset, c.byte_start, c.byte_end,
                      c.records, f.partition, c.crc, c.void, f.checksum
               FROM landing_chunks c JOIN landing_files f USING (topic, file_no)
               WHERE c.topic = %s AND f.partition = %s
                 AND c.first_offset < %s AND c.first_offset + c.records > %s
               ORDER BY c.first_offset""",
            (folder.topic, r.partition, r.end, r.start))
        rows = [Chunk(*row) for row in cur.fetchall()]
        covered = r.start
        for row in rows:
            if row.first > covered:
                break
            covered = max(covered, row.first + row.records)
        if covered < r.end:
            raise SourceShortfall(
                f"landing folder {folder.topic!r} partition {r.partition}: no indexed file "
                f"holds offsets [{covered}, {r.end}) of the planned range")
        out += rows
    return list(dict.fromkeys(out))  # a chunk two ranges share is read once


def read(folder, spark, dsn: str, ranges: Iterable[PartitionRange]):
    ranges = [r for r in ranges if r.size > 0]
    with connection(dsn, application_name="onceflow-landing") as conn, \
            transaction(conn) as cur:
        chunks = [c for c in chunks_of(folder, cur, ranges) if c.void is None]
        if folder.format == "parquet":
            cur.execute("SELECT path, base_offset FROM landing_files WHERE topic = %s "
                        "AND path = ANY(%s)", (folder.topic, [c.path for c in chunks]))
            bases = dict(cur.fetchall())
    if folder.format == "parquet":
        return _read_parquet(folder, spark, ranges, chunks, bases)
    ddl = folder.read_ddl
    if not chunks:
        return spark.createDataFrame([], ddl)
    wanted = [(r.partition, r.start, r.end) for r in ranges]

    if jvm_reader(spark) and "://" not in folder.path:
        # the JVM reads the chunks (onceflow.sources.jvm): the same rows, one task per chunk
        return jvm_lines(spark, chunks, wanted, folder.records, folder.max_record_bytes,
                         csv=folder.format == "csv")
    # One Spark task per chunk (task i reads chunks[i], which travel with the reader): a
    # DataFrame of the chunks would be cut by the default parallelism into a few uneven
    # tasks, the last of which holds the batch back while cores idle.
    tasks = spark.range(0, len(chunks), 1, numPartitions=len(chunks))
    return tasks.mapInArrow(
        chunk_reader(folder.format, folder.csv_header, folder.path, chunks, wanted,
                      folder.records, folder.max_record_bytes), ddl)


def _read_parquet(folder, spark, ranges: list[PartitionRange], chunks: list[Chunk],
                  bases: dict[str, int]):
    """Parquet files through Spark's own reader (in the JVM): a row's offset is its
    file's base offset plus its row index in the file, its payload the row as JSON
    (typed: the declared columns, which Spark then reads only as the topology uses them).
    Each file's footer and the row groups the ranges hold are checked against their
    CRC-32s here first (Spark's reader reads them after the check)."""

    # imported here: pyspark loads only where Spark is used
    from pyspark.sql import functions as F

    filesystem, _ = open_filesystem(folder.path)
    files: dict[str, list[Chunk]] = {}
    for chunk in chunks:
        files.setdefault(chunk.path, []).append(chunk)
    parts = []
    for path, groups in files.items():
        partition = groups[0].partition
        try:
            _check_parquet(filesystem, groups)
        except RuntimeError as error:
            raise SourceChanged(str(error)) from None
        reader = spark.read.schema(folder.schema) if folder.schema else spark.read
        df = reader.parquet(_spark_path(folder.path, path))
        offset = F.lit(bases[path]) + F.col("_metadata.row_index")
        # the planned ranges, within the row groups that hold records (not void ones)
        held = []
        for c in sorted(groups, key=lambda c: c.first):
            if held and held[-1][1] == c.first:
                held[-1][1] = c.first + c.records
            else:
                held.append([c.first, c.first + c.records])
        keep = reduce(lambda a, b: a | b, [
            (offset >= max(r.start, lo)) & (offset < min(r.end, hi)) for r in ranges
            for lo, hi in held if r.partition == partition and r.start < hi and lo < r.end])
        if folder.records is not None:  # typed: the columns as they are (pruned by Spark)
            # NaN and the infinities have no JSON form: such a row could not come back
            # from its payload the same, so it is refused as a record over size is
            problem = F.lit(None).cast("string")
            for name in reversed(folder.records.float_columns):
                value = F.col(f"`{name}`")
                problem = F.when(F.isnan(value) | (F.abs(value) == float("inf")), F.lit(
                    f"column {name} holds NaN or an infinity, which the record's payload "
                    "(its row as JSON) cannot hold")).otherwise(problem)
            body = [*(F.col(f"`{name}`").cast(kind).alias(name)
                      for name, kind in folder.records.columns),
                    F.lit(None).cast("string").alias(CORRUPT), problem.alias(PROBLEM)]
        else:
            body = [F.to_json(F.struct("*"), SPARK_JSON).alias("payload")]
        parts.append(df.select(
            F.lit(partition).cast("int").alias("partition"), offset.alias("offset"),
            *body).where(keep))
    if not parts:
        return spark.createDataFrame([], folder.read_ddl)
    return reduce(lambda a, b: a.unionByName(b), parts)


def payloads(folder, conn, ranges: Iterable[PartitionRange]
             ) -> Iterator[tuple[int, int, str]]:
    ranges = [r for r in ranges if r.size > 0]
    with conn.cursor() as cur:
        chunks = [c for c in chunks_of(folder, cur, ranges) if c.void is None]
    filesystem, _ = open_filesystem(folder.path)
    for chunk in chunks:
        for i, payload in enumerate(_read_chunk(filesystem, folder.format, chunk)
                                    .to_pylist()):
            offset = chunk.first + i
            if any(r.partition == chunk.partition and r.start <= offset < r.end
                   for r in ranges):
                yield chunk.partition, offset, payload


def _spark_path(root: str, path: str) -> str:
    """A manifest path as Spark reads it: local paths as they are, URIs with their scheme."""
    scheme = root.split("://", 1)[0] + "://" if "://" in root else ""
    return path if not scheme or path.startswith(scheme) else scheme + path


def jvm_lines(spark, chunks: list[Chunk], wanted: list[tuple[int, int, int]],
              records: JsonRecords | None, max_bytes: int, *, csv: bool = False):
    """The JVM reader (onceflow.spark.JsonLinesSource) over local ``chunks``: the records in
    ``wanted`` ((partition, start, end)), decoded by ``records`` (None: payloads); ``csv``:
    cut as CSV records (_csv_records), not lines."""
    spec = {"chunks": [jvm_chunk(c) for c in chunks], "wanted": [list(w) for w in wanted],
            "columns": list(map(list, records.columns)) if records else None,
            "max_record_bytes": max_bytes, "csv": csv}
    return spark.read.format(JVM_READER).option("spec", json.dumps(spec)).load()


def file_chunk(path: str, records: int, partition: int = 0) -> Chunk:
    """A whole local file of ``records`` lines as one chunk of ``partition`` from offset 0,
    checked by its size and mtime (no CRC-32): what the server's warm-up reads."""
    stat = os.stat(path)
    return Chunk(path=path, size=stat.st_size, mtime=stat.st_mtime, first=0, start=0,
                  end=stat.st_size, records=records, partition=partition, crc=None, void=None)


def jvm_chunk(chunk: Chunk) -> list:
    """A chunk as the JVM reader's spec holds it (onceflow.spark.ReadSpec)."""
    return [chunk.path, chunk.crc, chunk.size, chunk.mtime, chunk.first, chunk.start,
            chunk.end, chunk.partition, chunk.records]


def _where(chunk: Chunk) -> str:
    return (f"bytes [{chunk.start}, {chunk.end}) (the chunk of offsets [{chunk.first}, "
            f"{chunk.first + chunk.records}) of partition {chunk.partition})")


def _changed(chunk: Chunk, what: str) -> RuntimeError:
    return RuntimeError(f"landed file {chunk.path!r} changed after it was indexed: {what}: "
                        f"refused. {REPAIR_HINT}")


def _removed(path: str, filesystem) -> RuntimeError:
    require_folder(posixpath.dirname(path), filesystem)  # a folder not mounted here says so
    # Refused as a changed file is (retries read the same missing file): repair skips it.
    return RuntimeError(f"landed file {path!r} was removed before every batch reading it "
                        f"committed: refused. {REPAIR_HINT}")


def _read_chunk(filesystem, fmt: str, chunk: Chunk):
    """The payloads of one chunk (an Arrow string array), its bytes checked."""
    if fmt == "parquet":
        _check_parquet(filesystem, [chunk])
        with filesystem.open_input_file(chunk.path) as f:
            table = pq.ParquetFile(f).read_row_group(chunk.start)  # start: the row group
        return pa.array([json.dumps(row, default=str, ensure_ascii=False)
                         for row in table.to_pylist()], pa.string())
    if fmt == "csv":
        return csv_array(_chunk_bytes(filesystem, chunk))
    return line_array(_chunk_bytes(filesystem, chunk))


def _chunk_bytes(filesystem, chunk: Chunk) -> bytes:
    """Bytes ``[start, end)`` of a landed text file, checked against the chunk's CRC-32 (on
    the bytes returned: no window between the check and the use)."""
    if chunk.crc is None:
        _check_unchanged(filesystem, chunk)
    try:
        with filesystem.open_input_file(chunk.path) as f:
            data = f.read_at(chunk.end - chunk.start, chunk.start)
    except FileNotFoundError:
        raise _removed(chunk.path, filesystem) from None
    if len(data) != chunk.end - chunk.start:
        raise _changed(chunk, f"it ends at byte {chunk.start + len(data)}, before "
                              f"{_where(chunk)}")
    if chunk.crc is not None:
        crc = zlib.crc32(data)
        if crc != chunk.crc:
            raise _changed(chunk, f"{_where(chunk)} are not the bytes indexed (CRC-32 "
                                  f"{crc:08x}, indexed {chunk.crc:08x})")
    return data


def _check_parquet(filesystem, chunks: list[Chunk]) -> None:
    """A Parquet file's footer and the row groups of ``chunks`` (all of one file) are the
    bytes indexed."""
    first = chunks[0]
    if first.crc is None:
        _check_unchanged(filesystem, first)
        return
    try:
        with filesystem.open_input_file(first.path) as f:
            footer, size = parquet_footer(f)
            if f"{footer:08x}" != first.checksum:
                raise _changed(first, f"its footer (metadata, at the end of its {size} "
                                      f"bytes) is not the one indexed")
            meta = pq.ParquetFile(f).metadata
            for chunk in chunks:
                crc, _ = crc_of(f, *row_group_bytes(meta, chunk.start))
                if crc != chunk.crc:
                    raise _changed(chunk, f"row group {chunk.start} (offsets [{chunk.first}, "
                                          f"{chunk.first + chunk.records}) of partition "
                                          f"{chunk.partition}) is not the one indexed (CRC-32 "
                                          f"{crc:08x}, indexed {chunk.crc:08x})")
    except FileNotFoundError:
        raise _removed(first.path, filesystem) from None


def _check_unchanged(filesystem, chunk: Chunk) -> None:
    """A chunk indexed before chunk checksums: its file's size and modification time."""
    info = filesystem.get_file_info(chunk.path)
    if info.type != fs.FileType.File:
        raise _removed(chunk.path, filesystem)
    if info.size != chunk.size or (info.mtime and
                                   abs(info.mtime.timestamp() - chunk.mtime) > 1e-3):
        raise _changed(chunk, f"its size or modification time is not the one indexed (size "
                              f"{chunk.size} -> {info.size}; indexed before chunk checksums)")


def chunk_reader(fmt: str, header: bool, root: str, chunks: list[Chunk],
                  wanted: list[tuple[int, int, int]], records: JsonRecords | None = None,
                  max_bytes: int | None = None):
    """The mapInArrow function reading ``chunks`` (rows of LandingFolder._chunks) by index
    (the ids of spark.range), keeping the records in ``wanted`` ((partition, start, end)).
    With ``records`` each line is decoded (its columns, ``_corrupt_record`` and the spout's
    ``_problem``, see JsonRecords.decode) instead of being a payload."""
    def read(batches):
        filesystem, _ = open_filesystem(root)
        for batch in batches:
            for index in batch.column("id").to_pylist():
                chunk = chunks[index]
                first, partition = chunk.first, chunk.partition
                if records is None:
                    columns = {"payload": _read_chunk(filesystem, fmt, chunk)}
                else:
                    lines = line_bytes(_chunk_bytes(filesystem, chunk))
                    columns, problems = json_arrow.decode(records.columns, lines, max_bytes)
                    columns[PROBLEM] = problems
                count = len(next(iter(columns.values())))
                offsets = np.arange(first, first + count, dtype=np.int64)
                keep = np.zeros(count, dtype=bool)
                for p, s, e in wanted:
                    if p == partition:
                        keep |= (offsets >= s) & (offsets < e)
                if not keep.all():  # the chunk's ends outside the planned ranges
                    mask = pa.array(keep)
                    offsets = offsets[keep]
                    columns = {name: column.filter(mask) for name, column in columns.items()}
                yield pa.RecordBatch.from_arrays(
                    [pa.array(np.full(len(offsets), partition, dtype=np.int32)),
                     pa.array(offsets), *columns.values()],
                    names=["partition", "offset", *columns])

    return read
