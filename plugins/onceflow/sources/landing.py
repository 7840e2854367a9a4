"""A landing folder: files dropped into a directory are the source, in arrival order.

JSON-lines or CSV files (a record per line, the payload is the line) and Parquet files (a
record per row, the payload is the row as JSON) in a folder: a local path, or any URI
pyarrow's file systems read (``s3://``, ``hdfs://``, ``file://``).

**The manifest.** Each begin looks at the folder first: a new file is indexed in arrival order
(modification time, then name) into ``landing_files`` (path, size, modification time, a
fingerprint, record count) and ``landing_chunks`` (the file cut at newlines about every
``chunk_bytes``: where each piece starts, in records and in bytes), and its records get the
next offsets of its partition (files go to partitions in turn), in the same PostgreSQL
transaction that advances the heads (``source_partitions``, as for the other logs). So every
offset below a head is a record of an indexed file, and a batch is a range over the manifest.

**Rules, loudly kept.**

- Half-written files are never read: names starting with ``.`` or ``_``, or ending in
  ``.tmp``, ``.part`` or ``._COPYING_``, are skipped, and so is a file modified less than
  ``settle_s`` seconds ago. Write a file under a temporary name and rename it into place.
- A file changed after it was indexed (another size or modification time) is refused: the
  next begin fails naming it, and so does a read. Landed files never change; a new version
  lands under a new name.
- A file removed before every batch that reads it committed fails that batch's read
  (SourceShortfall, naming it).
- JSON lines with a declared ``json_schema``: each line is decoded where it is read
  (onceflow.sources.json_records): the records carry the declared columns and
  ``_corrupt_record`` instead of ``payload``.
- Parquet: a file whose schema is not the declared ``schema`` is set aside
  (``on_mismatch="skip"``: recorded with its reason, indexed with no records, shown by
  status) or stops the pipeline (``on_mismatch="stop"``: begin fails naming the file).
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import json
import logging
import posixpath
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import ClassVar

from onceflow.core.errors import ConfigError, SourceShortfall
from onceflow.core.planner import PartitionRange
from onceflow.sources import catalog
from onceflow.sources.base import MAX_RECORD_BYTES, Position, Source
from onceflow.sources.folders import require_folder
from onceflow.sources.json_records import PROBLEM, JsonRecords

log = logging.getLogger(__name__)

FORMATS = ("jsonl", "csv", "parquet")
HIDDEN_SUFFIXES = (".tmp", ".part", "._COPYING_")
# The fingerprint of a landed file: SHA-256 of its size and of its first and last SAMPLE bytes.
SAMPLE = 64 << 10


def _filesystem(path: str):
    from pyarrow import fs

    if "://" in path:
        return fs.FileSystem.from_uri(path)
    return fs.LocalFileSystem(), path


def _lines_within(block: bytes, start: int, end: int, limit: int) -> bool:
    """Whether every line of ``block[start:end]`` (which ends with a newline) is at most
    ``limit`` bytes long, not counting its newline. It jumps from line start to line start:
    the last newline within ``limit`` + 1 bytes of one ends every line before it, and a
    stretch that long without one is a longer line. About one search per ``limit`` bytes."""
    while start < end:
        last = block.rfind(b"\n", start, min(end, start + limit + 1))
        if last < 0:
            return False
        start = last + 1
    return True


class _CleanLines:
    """What ``_fingerprint`` learns of each chunk's lines on its way: every line valid UTF-8,
    without a NUL byte, at most ``limit`` bytes long (the chunk's ``clean_to``; None when
    not so). The bytes of a line that runs on past a block are carried into the next one
    (at most ``limit`` of them: a longer line settles it)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.head = b""  # the carried start of the line the next chunk begins with
        self.head_over = False  # that line is over the limit already

    def carry(self, tail: bytes) -> None:
        """A block without a newline (or the bytes after its last one) continues the line."""
        if not self.head_over:
            if len(self.head) + len(tail) > self.limit:
                self.head, self.head_over = b"", True
            else:
                self.head += tail

    def chunk(self, block: bytes, start: int, end: int, *, head: bool = True) -> int | None:
        """``clean_to`` of the chunk made of the carried bytes (``head``) and
        ``block[start:end]``, which ends with a newline or the file; the carry is spent."""
        first = block.find(b"\n", start, end)
        first = end if first < 0 else first
        carried, over = (self.head, self.head_over) if head else (b"", False)
        self.head, self.head_over = b"", False
        if over or len(carried) + first - start > self.limit:
            return None
        if b"\0" in carried or block.find(b"\0", start, end) >= 0:
            return None
        if not _lines_within(block, first + 1, end, self.limit):
            return None
        body = memoryview(block)[start:end]
        if not (carried.isascii() and block.isascii()):
            try:
                str(carried + bytes(body) if carried else body, "utf-8")
            except UnicodeDecodeError:
                return None
        return self.limit


def _sampled(size: int, head: bytes, tail: bytes) -> str:
    """A landed file's fingerprint (``landing_files.checksum``): SHA-256 of its size and its
    first and last SAMPLE bytes. It names the version of the file that was indexed (a file
    replaced later shows another one, in all but contrived cases); the whole file is not
    hashed, because nothing reads it back to compare (a changed file is told by its size and
    modification time, at every begin and read), and hashing every byte was a third of
    indexing's CPU: 0.085 of 0.23 CPU s per 120 MB file."""
    digest = hashlib.sha256(b"%d\n" % size)
    digest.update(head[:SAMPLE])
    digest.update(tail[-SAMPLE:] if size > SAMPLE else b"")
    return digest.hexdigest()


def _fingerprint(filesystem, path: str, chunk_bytes: int, fmt: str, header: bool,
                 limit: int = MAX_RECORD_BYTES):
    """(fingerprint, records, chunks [(first_record, byte_start, byte_end, records,
    clean_to)]) of a file, in one pass (see _sampled for the fingerprint). Text files are cut
    at newlines about every ``chunk_bytes``; a Parquet file by row group (the byte fields then
    hold the row group's number). ``clean_to``: ``limit`` when every line of the chunk is
    valid UTF-8, holds no NUL byte and is at most ``limit`` bytes long (its records cannot be
    refused), else None."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        with filesystem.open_input_file(path) as f:
            size = f.size()
            fingerprint = _sampled(size, f.read_at(min(SAMPLE, size), 0),
                                   f.read_at(min(SAMPLE, size), max(0, size - SAMPLE)))
            f.seek(0)
            meta = pq.ParquetFile(f).metadata
        chunks, first = [], 0
        for g in range(meta.num_row_groups):
            rows = meta.row_group(g).num_rows
            chunks.append((first, g, g + 1, rows, None))
            first += rows
        return fingerprint, first, chunks
    chunks: list[tuple[int, int, int, int, int | None]] = []
    records = 0
    start = 0  # where the chunk being read starts, in bytes
    carry = 0  # bytes after the last newline read so far: the start of the next chunk
    skip_header = header
    clean = _CleanLines(limit)
    opening, ending, length = b"", b"", 0  # the fingerprint's (no block is copied whole)
    with filesystem.open_input_stream(path) as f:
        while True:
            block = f.read(chunk_bytes)
            if not block:  # what follows the last newline is a last record
                if carry and not skip_header:
                    chunks.append((records, start, start + carry, 1,
                                   clean.chunk(b"", 0, 0)))
                    records += 1
                return _sampled(length, opening, ending), records, chunks
            length += len(block)
            if len(opening) < SAMPLE:
                opening += block[:SAMPLE - len(opening)]
            ending = (ending + block[-SAMPLE:])[-SAMPLE:]
            last = block.rfind(b"\n")
            if last < 0:
                carry += len(block)
                clean.carry(block)
                continue
            size, count = carry + last + 1, block.count(b"\n")
            body_start, head = 0, True
            if skip_header:  # the first line; the bytes carried over hold no newline
                body_start, head = block.find(b"\n") + 1, False
                header_end = carry + body_start
                start, size, count, skip_header = start + header_end, size - header_end, \
                    count - 1, False
            if size:
                chunks.append((records, start, start + size, count,
                               clean.chunk(block, body_start, last + 1, head=head)))
                records += count
                start += size
            else:
                clean.chunk(b"", 0, 0, head=False)  # (the header alone: nothing carried)
            carry = len(block) - last - 1
            clean.carry(block[last + 1:])


def _lines(data: bytes) -> list[str]:
    """A chunk's records: its lines, cut at LF, each without one trailing CR, bytes that are
    not UTF-8 replaced (U+FFFD); no record after a last LF."""
    text = data.decode("utf-8", errors="replace")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def _line_bytes(data: bytes) -> list[bytes]:
    """``_lines(data)`` as bytes, undecoded (what a JSON decoder reads): the same cut."""
    unterminated = not data.endswith(b"\n")  # a last line without LF (may end with a CR)
    if b"\r" in data:
        data = data.replace(b"\r\n", b"\n")
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    if unterminated and lines and lines[-1].endswith(b"\r"):
        lines[-1] = lines[-1][:-1]
    return lines


def _line_array(data: bytes):
    """``_lines(data)`` as an Arrow string array, cut in C++ (pyarrow's split) without a
    Python string per line; a chunk that is not valid UTF-8 goes through ``_lines``.

    Equal to ``_lines``: LF occurs in UTF-8 only as itself, so cutting bytes is cutting text;
    a CR before an LF can only end a line, so replacing CRLF by LF strips exactly one CR per
    line; a CR at the very end ends a last line that has no LF."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if not data:
        return pa.array([], pa.string())
    whole = data
    if b"\r" in whole:
        whole = whole.replace(b"\r\n", b"\n")
    drop_last = whole.endswith(b"\n")  # nothing after the last LF: no record there
    if whole.endswith(b"\r"):
        whole = whole[:-1]
    kind = pa.large_binary() if len(whole) >= 1 << 31 else pa.binary()
    width = np.int64 if kind == pa.large_binary() else np.int32
    blob = pa.Array.from_buffers(kind, 1, [None, pa.py_buffer(np.array([0, len(whole)], width)),
                                           pa.py_buffer(whole)])
    lines = pc.split_pattern(blob, "\n").flatten()
    if drop_last:
        lines = lines.slice(0, len(lines) - 1)
    try:
        return lines.cast(pa.large_string() if kind == pa.large_binary() else pa.string())
    except pa.ArrowInvalid:  # bytes that are not UTF-8: replaced, as Python decodes them
        return pa.array(_lines(data), pa.string())


@dataclass(frozen=True, kw_only=True)
class LandingFolder(Source):
    """Files dropped into ``path`` (see the module docstring).

    ``format``: jsonl, csv (``csv_header``: skip each file's first line) or parquet;
    ``pattern``: which names (fnmatch, default every file); ``partitions``: files go to them
    in turn; ``chunk_bytes``: bytes per Spark read task; ``json_schema`` (jsonl): the
    records' fields as Spark DDL of simple types, decoded as the lines are read (the records
    then carry these columns and ``_corrupt_record`` instead of ``payload``); ``schema``
    (Parquet): the declared columns as Spark DDL, ``on_mismatch``: skip or stop;
    ``settle_s``: how long a file must stay untouched before it is indexed.
    """

    kind: ClassVar[str] = "landing-folder"
    path: str
    format: str = "jsonl"
    pattern: str = "*"
    partitions: int = 1
    chunk_bytes: int = 32 << 20
    csv_header: bool = False
    schema: str | None = None
    json_schema: str | None = None
    on_mismatch: str = "skip"
    settle_s: float = 1.0

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.topic, str) or not self.topic:
            raise ConfigError(f"source.topic={self.topic!r} is invalid: name the landing "
                              "folder's topic (how pipelines and the manifest know it)")
        if self.format not in FORMATS:
            raise ConfigError(f"source.format={self.format!r} is invalid: choose one of "
                              f"{', '.join(FORMATS)}")
        if self.on_mismatch not in ("skip", "stop"):
            raise ConfigError(f"source.on_mismatch={self.on_mismatch!r} is invalid: choose "
                              "skip or stop")
        for name in ("partitions", "chunk_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"source.{name}={value!r} is invalid: give a positive number")
        if self.json_schema is not None:
            if self.format != "jsonl":
                raise ConfigError(f"source.json_schema is set but source.format="
                                  f"{self.format!r}: a JSON schema decodes JSON lines; use "
                                  "format='jsonl', or leave json_schema out")
            self.records  # noqa: B018 (compiles the schema: a bad one fails here, by name)

    @functools.cached_property
    def records(self) -> JsonRecords | None:
        """The decoder of ``json_schema`` (None: the records are payload strings)."""
        return JsonRecords(self.json_schema) if self.json_schema is not None else None

    @property
    def record_ddl(self) -> str:
        return self.records.record_ddl if self.records else super().record_ddl

    # -- the folder ------------------------------------------------------------------------
    def _listing(self):
        """(path, size, mtime) of every landed file, oldest first; settling ones left out."""
        from pyarrow import fs

        filesystem, root = _filesystem(self.path)
        require_folder(root, filesystem, field="source.path")
        now = datetime.now(UTC).timestamp()
        found = []
        for entry in filesystem.get_file_info(fs.FileSelector(root, recursive=False)):
            name = entry.base_name
            if entry.type != fs.FileType.File or name.startswith((".", "_")) \
                    or name.endswith(HIDDEN_SUFFIXES) or not fnmatch.fnmatch(name, self.pattern):
                continue
            mtime = entry.mtime.timestamp() if entry.mtime else 0.0
            if now - mtime < self.settle_s:
                continue  # still being written, perhaps: the next begin takes it
            found.append((entry.path, entry.size, mtime))
        return filesystem, sorted(found, key=lambda f: (f[2], f[0]))

    def _check_schema(self, filesystem, path: str) -> str | None:
        """Why a Parquet file does not match the declared schema (None: it does)."""
        if self.format != "parquet" or not self.schema:
            return None
        import pyarrow.parquet as pq

        from spark_tasks.topology import column_types

        with filesystem.open_input_file(path) as f:
            have = {field.name for field in pq.ParquetFile(f).schema_arrow}
        missing = sorted(set(column_types(self.schema)) - have)
        return f"missing column(s) {missing}" if missing else None

    def index(self, cur, enough=None) -> int:
        """Index the files landed since the last look (in the caller's transaction, which
        holds the partitions' locks until it ends), in arrival order. Returns how many.
        ``enough()``: checked before the first step and after each (1, 2, 4, ... files);
        true, the rest waits for a later look (a batch does not wait for a backlog's index:
        see positions_until)."""
        cur.execute(
            """SELECT path, size, mtime FROM landing_files WHERE topic = %s""", (self.topic,))
        known = {p: (s, m) for p, s, m in cur.fetchall()}
        filesystem, listing = self._listing()
        for path, size, mtime in listing:
            if path in known and known[path] != (size, mtime):
                raise ConfigError(
                    f"landed file {path!r} changed after it was indexed (size {known[path][0]}"
                    f" -> {size}, modified {datetime.fromtimestamp(mtime, UTC):%F %T}): landed "
                    "files must never change. Restore it, or land the new version under a new "
                    "name")
        new = [f for f in listing if f[0] not in known]
        if not new or (enough is not None and enough()):
            return 0
        cur.execute(
            """SELECT partition, next_offset FROM source_partitions WHERE topic = %s
               ORDER BY partition FOR UPDATE""", (self.topic,))
        heads = dict(cur.fetchall())
        cur.execute("SELECT coalesce(max(file_no), -1) FROM landing_files WHERE topic = %s",
                    (self.topic,))
        file_no = cur.fetchone()[0]
        done, step = 0, 1 if enough is not None else len(new)
        while done < len(new):
            files = new[done:done + step]
            file_no = self._index_files(cur, filesystem, files, file_no, heads)
            done += len(files)
            step *= 2
            if enough is not None and done < len(new) and enough():
                break
        log.info("LANDING topic=%s: indexed %d new file(s)%s", self.topic, done,
                 f", {len(new) - done} left for a later look" if done < len(new) else "")
        return done

    def _index_files(self, cur, filesystem, new: list, file_no: int, heads: dict) -> int:
        """Index ``new`` files (path, size, mtime) after ``file_no``, their records after
        ``heads`` (updated); returns the last file number."""
        refusals = []
        for path, _, _ in new:
            refused = self._check_schema(filesystem, path)
            if refused and self.on_mismatch == "stop":
                raise ConfigError(f"landed file {path!r} does not match source.schema "
                                  f"({refused}); fix or remove it, or set on_mismatch='skip'")
            refusals.append(refused)
        # The files are read side by side: a remote file system's latency overlaps (the
        # newline count holds the GIL, so on a local disk this is about one core's work).
        with ThreadPoolExecutor(min(4, len(new)), thread_name_prefix="onceflow-index") as pool:
            prints = list(pool.map(lambda f: _fingerprint(
                filesystem, f[0], self.chunk_bytes, self.format, self.csv_header,
                self.max_record_bytes), new))
        for (path, size, mtime), refused, (checksum, records, chunks) in zip(
                new, refusals, prints, strict=True):
            file_no += 1
            partition = file_no % len(heads)
            if refused:
                records, chunks = 0, []
                log.warning("LANDING topic=%s: %s set aside: %s", self.topic, path, refused)
            base = heads[partition]
            cur.execute(
                """INSERT INTO landing_files (topic, file_no, partition, path, size, mtime,
                                              checksum, records, base_offset, refused)
                   VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)""",
                (self.topic, file_no, partition, path, size, mtime, checksum, records, base,
                 refused))
            for first, start, end, count, clean_to in chunks:
                cur.execute(
                    """INSERT INTO landing_chunks (topic, file_no, first_offset, byte_start,
                                                   byte_end, records, clean_to)
                       VALUES (%s, %s, %s, %s, %s, %s, %s)""",
                    (self.topic, file_no, base + first, start, end, count, clean_to))
            heads[partition] = base + records
            cur.execute("UPDATE source_partitions SET next_offset = %s "
                        "WHERE topic = %s AND partition = %s", (heads[partition], self.topic,
                                                                partition))
        return file_no

    # -- the Source interface --------------------------------------------------------------
    def ensure(self, conn, *, create: bool = False) -> None:
        self._listing()  # the folder must exist
        catalog.ensure_topic(conn, self.topic, self.partitions, create=create)

    def positions(self, cur) -> dict[int, Position]:
        self.index(cur)
        return catalog.positions(cur, self.topic)

    def positions_until(self, cur, enough) -> dict[int, Position]:
        """Positions once enough is indexed for ``enough(positions)``: a begin indexes what
        its batch needs and leaves a backlog's other files to later begins, which index them
        while earlier batches process (ten 1M-line files took the first begin 3 s on two
        cores, with no Spark work to overlap). Status, alerts and retention index them all."""
        self.index(cur, enough=lambda: enough(catalog.positions(cur, self.topic)))
        return catalog.positions(cur, self.topic)

    def _chunks(self, cur, ranges: Iterable[PartitionRange]) -> list[tuple]:
        """(path, size, mtime, first_offset, byte_start, byte_end, records, partition) of
        every chunk overlapping ``ranges``; SourceShortfall when the manifest does not cover
        a range whole."""
        out = []
        for r in ranges:
            if r.size <= 0:
                continue
            cur.execute(
                """SELECT f.path, f.size, f.mtime, c.first_offset, c.byte_start, c.byte_end,
                          c.records, f.partition
                   FROM landing_chunks c JOIN landing_files f USING (topic, file_no)
                   WHERE c.topic = %s AND f.partition = %s
                     AND c.first_offset < %s AND c.first_offset + c.records > %s
                   ORDER BY c.first_offset""",
                (self.topic, r.partition, r.end, r.start))
            rows = cur.fetchall()
            covered = r.start
            for row in rows:
                if row[3] > covered:
                    break
                covered = max(covered, row[3] + row[6])
            if covered < r.end:
                raise SourceShortfall(
                    f"landing folder {self.topic!r} partition {r.partition}: no indexed file "
                    f"holds offsets [{covered}, {r.end}) of the planned range")
            out += rows
        return list(dict.fromkeys(out))  # a chunk two ranges share is read once

    def may_refuse(self, cur, ranges: Iterable[PartitionRange]) -> bool:
        """True when a chunk of ``ranges`` was not found clean up to today's
        max_record_bytes when its file was indexed (see _fingerprint; Parquet: always)."""
        ranges = [r for r in ranges if r.size > 0]
        if self.format == "parquet":
            return True
        if not ranges:
            return False
        cur.execute(
            """SELECT coalesce(bool_or(c.clean_to IS NULL OR c.clean_to > %s), false)
               FROM landing_chunks c JOIN landing_files f USING (topic, file_no)
               JOIN unnest(%s::int[], %s::bigint[], %s::bigint[]) AS r (part, lo, hi)
                 ON f.partition = r.part AND c.first_offset < r.hi
                    AND c.first_offset + c.records > r.lo
               WHERE c.topic = %s""",
            (self.max_record_bytes, [r.partition for r in ranges], [r.start for r in ranges],
             [r.end for r in ranges], self.topic))
        return cur.fetchone()[0]

    def read(self, spark, dsn: str, ranges: Iterable[PartitionRange]):
        from onceflow.core.db import connection, transaction

        ranges = [r for r in ranges if r.size > 0]
        with connection(dsn, application_name="onceflow-landing") as conn, \
                transaction(conn) as cur:
            chunks = self._chunks(cur, ranges)
            if self.format == "parquet":
                cur.execute("SELECT path, base_offset FROM landing_files WHERE topic = %s "
                            "AND path = ANY(%s)", (self.topic, [c[0] for c in chunks]))
                bases = dict(cur.fetchall())
        if self.format == "parquet":
            return self._read_parquet(spark, ranges, chunks, bases)
        ddl = self.read_ddl
        if not chunks:
            return spark.createDataFrame([], ddl)
        wanted = [(r.partition, r.start, r.end) for r in ranges]
        from spark_tasks.jvm import READER as JVM_READER
        from spark_tasks.jvm import jvm_reader

        if jvm_reader(spark) and "://" not in self.path:
            # the JVM reads the chunks (spark_tasks/jvm): the same rows, one task per chunk
            spec = {"chunks": [[path, size, mtime, first, start, end, partition] for path, size,
                               mtime, first, start, end, _, partition in chunks],
                    "wanted": wanted,
                    "columns": list(map(list, self.records.columns)) if self.records else None,
                    "max_record_bytes": self.max_record_bytes}
            return spark.read.format(JVM_READER).option("spec", json.dumps(spec)).load()
        # One Spark task per chunk: task i reads chunks[i], which travel with the reader.
        # (A DataFrame of the chunks would be cut into as many tasks as the session's default
        # parallelism, 2 here: a batch's last task then held its next batch's final stage
        # back, and a core idled while one task read the rest.)
        tasks = spark.range(0, len(chunks), 1, numPartitions=len(chunks))
        return tasks.mapInArrow(
            _chunk_reader(self.format, self.csv_header, self.path, chunks, wanted,
                          self.records, self.max_record_bytes), ddl)

    def _read_parquet(self, spark, ranges: list[PartitionRange], chunks: list[tuple],
                      bases: dict[str, int]):
        """Parquet files through Spark's own reader (in the JVM): a row's offset is its
        file's base offset plus its row index in the file, its payload the row as JSON.
        Each file is checked unchanged first (size, modification time)."""
        from functools import reduce

        from pyarrow import fs
        from pyspark.sql import functions as F

        from onceflow.core.tables import SPARK_JSON

        filesystem, _ = _filesystem(self.path)
        files = {}
        for path, size, mtime, _, _, _, _, partition in chunks:
            files[path] = (size, mtime, partition)
        parts = []
        for path, (size, mtime, partition) in files.items():
            info = filesystem.get_file_info(path)
            if info.type != fs.FileType.File:
                require_folder(posixpath.dirname(path), filesystem)
                raise SourceShortfall(f"landed file {path!r} was removed before every batch "
                                      "reading it committed")
            if info.size != size or (info.mtime and abs(info.mtime.timestamp() - mtime) > 1e-3):
                raise ConfigError(f"landed file {path!r} changed after it was indexed: "
                                  "refused (a landed file never changes; land a new one)")
            reader = spark.read.schema(self.schema) if self.schema else spark.read
            df = reader.parquet(_spark_path(self.path, path))
            offset = F.lit(bases[path]) + F.col("_metadata.row_index")
            keep = reduce(lambda a, b: a | b, [
                (offset >= r.start) & (offset < r.end) for r in ranges
                if r.partition == partition])
            parts.append(df.select(
                F.lit(partition).cast("int").alias("partition"), offset.alias("offset"),
                F.to_json(F.struct("*"), SPARK_JSON).alias("payload")).where(keep))
        if not parts:
            return spark.createDataFrame([], "partition int, offset long, payload string")
        return reduce(lambda a, b: a.unionByName(b), parts)

    def payloads(self, conn, ranges: Iterable[PartitionRange]
                 ) -> Iterator[tuple[int, int, str]]:
        ranges = [r for r in ranges if r.size > 0]
        with conn.cursor() as cur:
            chunks = self._chunks(cur, ranges)
        filesystem, _ = _filesystem(self.path)
        for path, size, mtime, first, start, end, _, partition in chunks:
            for i, payload in enumerate(_read_chunk(filesystem, self.format, path, size, mtime,
                                                    start, end).to_pylist()):
                offset = first + i
                if any(r.partition == partition and r.start <= offset < r.end
                       for r in ranges):
                    yield partition, offset, payload

    def describe(self) -> str:
        return f"landing folder {self.path!r} ({self.format}, topic {self.topic!r})"


def _spark_path(root: str, path: str) -> str:
    """A manifest path as Spark reads it: local paths as they are, URIs with their scheme."""
    scheme = root.split("://", 1)[0] + "://" if "://" in root else ""
    return path if not scheme or path.startswith(scheme) else scheme + path


def _read_chunk(filesystem, fmt: str, path: str, size: int, mtime: float, start: int,
                end: int):
    """The payloads of one chunk (an Arrow string array), after checking the file is the
    one indexed."""
    import pyarrow as pa

    if fmt == "parquet":
        import pyarrow.parquet as pq

        _check_unchanged(filesystem, path, size, mtime)
        with filesystem.open_input_file(path) as f:
            table = pq.ParquetFile(f).read_row_group(start)  # start: the row group
        return pa.array([json.dumps(row, default=str, ensure_ascii=False)
                         for row in table.to_pylist()], pa.string())
    return _line_array(_chunk_bytes(filesystem, path, size, mtime, start, end))


def _chunk_bytes(filesystem, path: str, size: int, mtime: float, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of a landed text file, after checking it is the one indexed."""
    _check_unchanged(filesystem, path, size, mtime)
    with filesystem.open_input_file(path) as f:
        f.seek(start)
        return f.read(end - start)


def _check_unchanged(filesystem, path: str, size: int, mtime: float) -> None:
    from pyarrow import fs

    info = filesystem.get_file_info(path)
    if info.type != fs.FileType.File:
        require_folder(posixpath.dirname(path), filesystem)
        raise RuntimeError(f"SourceShortfall: landed file {path!r} was removed before every "
                           "batch reading it committed")
    if info.size != size or (info.mtime and abs(info.mtime.timestamp() - mtime) > 1e-3):
        raise RuntimeError(f"landed file {path!r} changed after it was indexed: refused")


def _chunk_reader(fmt: str, header: bool, root: str, chunks: list[tuple],
                  wanted: list[tuple[int, int, int]], records: JsonRecords | None = None,
                  max_bytes: int | None = None):
    """The mapInArrow function reading ``chunks`` (rows of LandingFolder._chunks) by index
    (the ids of spark.range), keeping the records in ``wanted`` ((partition, start, end)).
    With ``records`` each line is decoded (its columns, ``_corrupt_record`` and the spout's
    ``_problem``, see JsonRecords.decode) instead of being a payload."""
    def read(batches):
        import numpy as np
        import pyarrow as pa

        filesystem, _ = _filesystem(root)
        for batch in batches:
            for index in batch.column("id").to_pylist():
                path, size, mtime, first, byte_start, byte_end, _, partition = chunks[index]
                if records is None:
                    columns = {"payload": _read_chunk(filesystem, fmt, path, size, mtime,
                                                      byte_start, byte_end)}
                else:
                    lines = _line_bytes(_chunk_bytes(filesystem, path, size, mtime,
                                                     byte_start, byte_end))
                    columns, problems = records.decode(lines, max_bytes)
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
