"""A landing folder: files dropped into a directory are the source, in arrival order.

JSON-lines files (a record per line, the payload is the line), CSV files (a record per RFC
4180 record: a quoted field may hold newlines; an empty line is no record; the payload is
the record's text) and Parquet files (a record per row, the payload is the row as JSON) in
a folder: a local path, or any URI pyarrow's file systems read (``s3://``, ``hdfs://``,
``file://``). docs/landing-folder.md is the producer's side of it (how to land a file,
appends, rewrites, repair).

**The manifest.** Each begin looks at the folder first: a new file is indexed in arrival order
(modification time, then name) into ``landing_files`` (path, size, modification time, how far
it is indexed, record count) and ``landing_chunks`` (the file cut at newlines about every
``chunk_bytes``: where each piece starts, in records and in bytes, and the CRC-32 of its
bytes), and its records get the next offsets of its partition (files go to partitions in
turn), in the same PostgreSQL transaction that advances the heads (``source_partitions``, as
for the other logs). So every offset below a head is a record of an indexed chunk, and a batch
is a range over the manifest.

**Rules, loudly kept.**

- A line is indexed once it is complete (its newline written): the bytes after a file's last
  newline wait for the next look (``unterminated_s`` indexes a last line without one, once
  its file has stayed unmodified that long).
- A file that grew, its indexed bytes unchanged (its last indexed chunk's CRC-32 and its
  size say so), is a source of more records: its new complete lines are indexed as new
  chunks, their records at the next offsets of the file's partition. A touched file (another
  modification time only) is the same file.
- Names starting with ``.`` or ``_``, or ending in ``.tmp``, ``.part`` or ``._COPYING_``, are
  skipped, and so is a file modified less than ``settle_s`` seconds ago. Write a file under
  a temporary name and rename it into place.
- Every read checks each chunk's bytes against the CRC-32 indexed (Parquet: the footer's and
  the row group's): a chunk whose bytes changed fails its batch naming the file and the
  chunk. A file found shorter than indexed, or whose last indexed chunk changed, is marked
  changed (``landing_files.changed``, shown by ``onceflow status``) and not indexed further;
  ``onceflow repair`` says what changed and accepts the file as it is now or skips it with
  a recorded gap (onceflow.sources.landing_repair).
- A file removed before every batch that reads it committed fails that batch's read
  (SourceChanged, naming it: retries would not find it either); ``onceflow repair`` skips
  its unread records with a recorded gap.
- JSON lines with a declared ``json_schema``: each line is decoded where it is read
  (onceflow.sources.json_records): the records carry the declared columns and
  ``_corrupt_record`` instead of ``payload``.
- Parquet: a file whose schema is not the declared ``schema`` (a column missing, or of a
  type Spark's Parquet reader cannot read as declared: see _reads_as) is set aside
  (``on_mismatch="skip"``: recorded with its reason, indexed with no records, shown by
  status) or stops the pipeline (``on_mismatch="stop"``: begin fails naming the file).
  With ``typed`` the records carry the declared columns (and ``_corrupt_record``, always
  null) instead of ``payload``: Spark's Parquet reader then decodes only the columns the
  topology uses, and no row is turned into JSON and parsed back. A replayed record comes
  back from its payload (the row as JSON) through the same JsonRecords decoder as JSON
  lines, so it sees the columns its first try saw. A typed row is refused only when a
  float column holds NaN or an infinity (which its JSON payload cannot hold).
"""

from __future__ import annotations

import fnmatch
import functools
import json
import logging
import os
import posixpath
import re
import zlib
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import reduce
from typing import ClassVar, NamedTuple

from onceflow.core import timings
from onceflow.core.db import connection, transaction
from onceflow.core.errors import ConfigError, SourceChanged, SourceShortfall
from onceflow.core.planner import PartitionRange
from onceflow.core.source import MAX_RECORD_BYTES, Position, Source
from onceflow.core.tables import SPARK_JSON
from onceflow.core.topology import column_types
from onceflow.sources import catalog
from onceflow.sources.folders import require_folder
from onceflow.sources.json_records import CORRUPT, PROBLEM, JsonRecords
from onceflow.sources.jvm import READER as JVM_READER
from onceflow.sources.jvm import jvm_reader

log = logging.getLogger(__name__)

FORMATS = ("jsonl", "csv", "parquet")
HIDDEN_SUFFIXES = (".tmp", ".part", "._COPYING_")
# What a refusal of a changed file tells the user to run (status matches it in failures).
REPAIR_HINT = "`onceflow repair` says what changed and how to go on"
# What to do with a file set aside at indexing (status and repair say it).
SET_ASIDE_FIX = ("land a copy that matches source.schema under a new name (this file is "
                 "never read), or declare the schema it has")
# A Parquet row group's bytes are checked in pieces of this size (a row group may be large).
CHECK_BYTES = 8 << 20


def _filesystem(path: str):
    # imported here: pyarrow is heavy: it loads only where files are read or written
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


@dataclass
class _Scan:
    """What one pass over a file's bytes found: its records, its chunks ``(first_record,
    byte_start, byte_end, records, clean_to, crc)`` (first_record counted from the pass's
    start), how far it indexed (the end of its last complete line) and, for a Parquet file,
    its footer's CRC-32."""

    records: int
    chunks: list[tuple[int, int, int, int, int | None, int]] = field(default_factory=list)
    indexed_to: int = 0
    checksum: str | None = None


def _scan_text(filesystem, path: str, start: int, size: int, chunk_bytes: int, *,
               header: bool, limit: int = MAX_RECORD_BYTES, tail: bool = False) -> _Scan:
    """Index bytes ``[start, size)`` of a text file in one pass: chunks cut at newlines about
    every ``chunk_bytes``, each with the CRC-32 of its bytes and its ``clean_to`` (``limit``
    when every line of the chunk is valid UTF-8, holds no NUL byte and is at most ``limit``
    bytes long, so its records cannot be refused; else None). The bytes after the last
    newline are not indexed (a line still being written), unless ``tail``: then they are a
    last record. ``header``: the first line is a CSV header, not a record."""
    chunks: list[tuple[int, int, int, int, int | None, int]] = []
    records = 0
    at = start  # where the chunk being read starts, in bytes
    carry = 0  # bytes after the last newline read so far: the start of the next chunk
    crc = 0  # the CRC-32 of those bytes
    skip_header = header
    clean = _CleanLines(limit)
    left = size - start
    with filesystem.open_input_file(path) as f:
        f.seek(start)
        while True:
            block = f.read(min(chunk_bytes, left)) if left > 0 else b""
            left -= len(block)
            if not block:  # what follows the last newline waits for one, unless ``tail``
                if carry and tail and not skip_header:
                    chunks.append((records, at, at + carry, 1, clean.chunk(b"", 0, 0), crc))
                    records += 1
                    at += carry
                return _Scan(records, chunks, at)
            view = memoryview(block)
            last = block.rfind(b"\n")
            if last < 0:
                carry += len(block)
                clean.carry(block)
                crc = zlib.crc32(view, crc)
                continue
            length, count = carry + last + 1, block.count(b"\n")
            body_start, head = 0, True
            if skip_header:  # the first line; the bytes carried over hold no newline
                body_start, head = block.find(b"\n") + 1, False
                header_end = carry + body_start
                at, length, count, skip_header = at + header_end, length - header_end, \
                    count - 1, False
            if length:
                chunks.append((records, at, at + length, count,
                               clean.chunk(block, body_start, last + 1, head=head),
                               zlib.crc32(view[body_start:last + 1], crc if head else 0)))
                records += count
                at += length
            else:
                clean.chunk(b"", 0, 0, head=False)  # (the header alone: nothing carried)
            carry = len(block) - last - 1
            clean.carry(block[last + 1:])
            crc = zlib.crc32(view[last + 1:])


# CSV (RFC 4180): a field that starts with a quote runs to its closing quote, newlines and
# commas included ("" within it is a quote); a quote anywhere else is a character. A record
# ends at a newline outside a quoted field. Possessive quantifiers: no backtracking.
_CSV_FIELD = rb'(?:"(?:[^"]|"")*+"[^,]*+|[^,"][^,]*+)?'
_CSV_CLOSED = re.compile(_CSV_FIELD + rb"(?:," + _CSV_FIELD + rb")*+")
_CSV_QUOTED_REST = re.compile(rb'(?:[^"]|"")*+"[^,]*+')
_EMPTY_LINES = re.compile(rb"(?m)^\r?\n")


def _csv_open_after(line: bytes, inside: bool) -> bool:
    """Whether a quoted field is open at the end of ``line`` (bytes without a newline), which
    starts inside a quoted field (``inside``) or at a record's start."""
    if inside:
        rest = _CSV_QUOTED_REST.match(line)
        if rest is None:
            return True
        if rest.end() == len(line):
            return False
        line = line[rest.end() + 1:]  # past the comma: a field starts
    return b'"' in line and _CSV_CLOSED.fullmatch(line) is None


def _csv_records(data: bytes) -> list[bytes]:
    """A chunk's CSV records (the chunk starts at a record's start): cut at the newlines
    outside quoted fields, each without one trailing CR; an empty one (an empty line) is no
    record; no record after a last newline (a last record without one is one)."""
    out: list[bytes] = []
    parts: list[bytes] = []
    inside = False
    lines = data.split(b"\n")
    last = lines.pop()
    for line in lines:
        parts.append(line)
        inside = _csv_open_after(line, inside) if inside or b'"' in line else False
        if not inside:
            record = parts[0] if len(parts) == 1 else b"\n".join(parts)
            parts = []
            if record.endswith(b"\r"):
                record = record[:-1]
            if record:
                out.append(record)
    if parts or last:
        record = b"\n".join([*parts, last])
        if record.endswith(b"\r"):
            record = record[:-1]
        if record:
            out.append(record)
    return out


def _csv_array(data: bytes):
    """``_csv_records(data)`` as an Arrow string array, bytes that are not UTF-8 replaced
    (U+FFFD); without a quote the records are the non-empty lines, cut in C++."""
    # imported here: pyarrow is heavy: it loads only where files are read or written
    import pyarrow as pa
    import pyarrow.compute as pc

    if b'"' not in data:
        lines = _line_array(data)
        return lines.filter(pc.not_equal(pc.binary_length(lines), 0))
    return pa.array([r.decode("utf-8", errors="replace") for r in _csv_records(data)],
                    pa.string())


def _csv_clean(data, multi: bool, limit: int) -> int | None:
    """A CSV chunk's ``clean_to`` (see _scan_text): None when a record of it spans lines."""
    if multi or b"\0" in data or not _lines_within(data, 0, len(data), limit):
        return None
    if not data.isascii():
        try:
            str(data, "utf-8")
        except UnicodeDecodeError:
            return None
    return limit


def _scan_csv(filesystem, path: str, start: int, size: int, chunk_bytes: int, *,
              header: bool, limit: int = MAX_RECORD_BYTES, tail: bool = False) -> _Scan:
    """``_scan_text`` for CSV (RFC 4180): chunks are cut at record ends (never inside a
    quoted field) and count the records ``_csv_records`` cuts (empty lines are none); a
    chunk that holds empty lines only is not one (its bytes are indexed as nothing).
    ``header``: the first record that is not empty is the header. The bytes after the last
    record's end wait, and so does a quoted field left open for longer than twice
    ``chunk_bytes`` or ``limit`` (the file is indexed to before it; status names it)."""
    chunks: list[tuple[int, int, int, int, int | None, int]] = []
    records = 0
    at = start  # the file's byte at buf[0]: the chunk being cut starts there
    buf = bytearray()
    line = rec = 0  # in buf: the next line to walk; the open record's start
    count, multi, inside, skip = 0, False, False, header
    most = 2 * max(chunk_bytes, limit)
    left = size - start

    def cut() -> None:
        nonlocal records, at, line, rec, count, multi, buf
        if count:
            piece = memoryview(buf)[:rec]
            chunks.append((records, at, at + rec, count,
                           _csv_clean(bytes(piece), multi, limit), zlib.crc32(piece)))
            piece.release()
            records += count
            at += rec
            del buf[:rec]
            line, rec, count, multi = line - rec, 0, 0, False

    with filesystem.open_input_file(path) as f:
        f.seek(start)
        while True:
            block = f.read(min(chunk_bytes, left)) if left > 0 else b""
            left -= len(block)
            if not block:
                if tail and not skip and buf[rec:] not in (b"", b"\r"):
                    multi |= b"\n" in buf[rec:]
                    count, rec = count + 1, len(buf)
                cut()
                # (empty lines before a header not yet whole wait with it: it is found again)
                return _Scan(records, chunks, at if skip else at + rec)
            buf += block
            while True:
                if not inside and not skip:  # whole lines without a quote: each a record
                    quote = buf.find(b'"', line)
                    end = buf.rfind(b"\n", line, quote if quote >= 0 else len(buf))
                    if end >= line:
                        count += buf.count(b"\n", line, end + 1) - \
                            len(_EMPTY_LINES.findall(buf, line, end + 1))
                        line = rec = end + 1
                        continue
                end = buf.find(b"\n", line)
                if end < 0:
                    break
                inside = _csv_open_after(bytes(buf[line:end]), inside)
                multi_line = line != rec
                line = end + 1
                if inside:
                    continue
                if buf[rec:end] not in (b"", b"\r"):
                    if skip:  # the header: not a record
                        at += line
                        del buf[:line]
                        line = rec = 0
                        skip = False
                        continue
                    count += 1
                    multi |= multi_line
                rec = line
            cut()
            if len(buf) - rec > most:  # a record that does not end: the rest waits
                return _Scan(records, chunks, at if skip else at + rec)


def _crc_of(f, start: int, end: int) -> tuple[int, int]:
    """(CRC-32 of bytes ``[start, end)`` of an open file, how many of them it has)."""
    crc, at = 0, start
    while at < end:
        piece = f.read_at(min(CHECK_BYTES, end - at), at)
        if not piece:
            break
        crc = zlib.crc32(piece, crc)
        at += len(piece)
    return crc, at - start


def _parquet_footer(f) -> tuple[int, int]:
    """(CRC-32 of a Parquet file's footer: its metadata, their length and the magic; size)."""
    size = f.size()
    if size < 12:
        return 0, size
    length = int.from_bytes(f.read_at(4, size - 8), "little")
    return _crc_of(f, max(0, size - 8 - length), size)[0], size


def _row_group_bytes(meta, group: int) -> tuple[int, int]:
    """Where a Parquet row group's column chunks lie in its file, ``[start, end)``."""
    rg = meta.row_group(group)
    start, end = None, 0
    for i in range(rg.num_columns):
        column = rg.column(i)
        first = column.dictionary_page_offset if column.has_dictionary_page \
            else column.data_page_offset
        start = first if start is None else min(start, first)
        end = max(end, first + column.total_compressed_size)
    return start or 0, end


def _scan_parquet(filesystem, path: str) -> _Scan:
    """A Parquet file's chunks are its row groups (the byte fields hold the row group's
    number), each with the CRC-32 of its column chunks' bytes; the file's footer's CRC-32
    is its checksum. (One read of the file: Parquet files are written whole, but a rewrite
    in place under the same size and time would otherwise go unseen.)"""
    # imported here: pyarrow is heavy: it loads only where files are read or written
    import pyarrow.parquet as pq

    with filesystem.open_input_file(path) as f:
        footer, size = _parquet_footer(f)
        meta = pq.ParquetFile(f).metadata
        chunks, first = [], 0
        for g in range(meta.num_row_groups):
            rows = meta.row_group(g).num_rows
            chunks.append((first, g, g + 1, rows, None, _crc_of(f, *_row_group_bytes(meta, g))[0]))
            first += rows
    return _Scan(first, chunks, size, f"{footer:08x}")


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
    # imported here: numpy is heavy: it loads only with the Arrow data it serves
    import numpy as np

    # imported here: pyarrow is heavy: it loads only where files are read or written
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


class _Known(NamedTuple):
    """An indexed file as the index holds it (see LandingFolder._known)."""

    file_no: int
    partition: int
    size: int
    mtime: float
    indexed_to: int
    checksum: str | None
    changed: str | None
    skipped: str | None
    last: tuple[int, int, int | None] | None  # its last chunk's byte_start, byte_end, crc
    legacy: bool  # a chunk of it was indexed before chunk checksums
    refused: bool = False  # set aside (a Parquet file of another schema): it holds no record


class _Chunk(NamedTuple):
    """A chunk as the readers get it (LandingFolder._chunks). ``size`` and ``mtime``: its
    file's, compared only when ``crc`` is None (a chunk indexed before chunk checksums);
    ``checksum``: a Parquet file's footer CRC-32."""

    path: str
    size: int | None
    mtime: float | None
    first: int
    start: int
    end: int
    records: int
    partition: int
    crc: int | None
    void: str | None
    checksum: str | None = None


@dataclass(frozen=True, kw_only=True)
class LandingFolder(Source):
    """Files dropped into ``path`` (see the module docstring).

    ``format``: jsonl, csv (``csv_header``: skip each file's first line) or parquet;
    ``pattern``: which names (fnmatch, default every file); ``partitions``: files go to them
    in turn; ``chunk_bytes``: bytes per Spark read task; ``json_schema`` (jsonl): the
    records' fields as Spark DDL of simple types, decoded as the lines are read (the records
    then carry these columns and ``_corrupt_record`` instead of ``payload``); ``schema``
    (Parquet): the declared columns as Spark DDL, ``on_mismatch``: skip or stop;
    ``typed`` (Parquet with a ``schema``): the records carry the schema's columns instead of
    ``payload`` (see the module docstring);
    ``settle_s``: how long a file must stay untouched before it is looked at (0 for files
    appended to all the time, such as logs: their complete lines are indexed as they come);
    ``unterminated_s``: how long a file must stay untouched before a last line without a
    newline is indexed as a record (None, the default: never; it waits for its newline).
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
    typed: bool = False
    settle_s: float = 1.0
    unterminated_s: float | None = None

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
        for name in ("settle_s", "unterminated_s"):
            value = getattr(self, name)
            if value is None and name == "unterminated_s":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ConfigError(f"source.{name}={value!r} is invalid: give a number of "
                                  "seconds >= 0" + (", or None" if name == "unterminated_s"
                                                    else ""))
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
        if self.typed:
            if self.format != "parquet" or not self.schema:
                raise ConfigError(f"source.typed=True needs format='parquet' and a schema "
                                  f"(format={self.format!r}, schema={self.schema!r}): typed "
                                  "records are a Parquet file's declared columns; for JSON "
                                  "lines declare json_schema")
            try:
                self.records  # noqa: B018 (the schema as JSON records: simple types only)
            except ConfigError as error:
                raise ConfigError(f"source.schema={self.schema!r} cannot be typed: "
                                  f"{error}".replace("source.json_schema: ", "")
                                  + "; or leave typed out (the records carry payload)"
                                  ) from None

    @functools.cached_property
    def records(self) -> JsonRecords | None:
        """The decoder of ``json_schema``, or of a typed Parquet ``schema`` (its replays'
        payloads are the rows as JSON); None: the records are payload strings."""
        if self.json_schema is not None:
            return JsonRecords(self.json_schema)
        return JsonRecords(self.schema) if self.typed and self.schema else None

    @property
    def record_ddl(self) -> str:
        return self.records.record_ddl if self.records else super().record_ddl

    # -- the folder ------------------------------------------------------------------------
    def _listing(self):
        """(path, size, mtime) of every landed file, oldest first; settling ones left out."""
        # imported here: pyarrow is heavy: it loads only where files are read or written
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
        # imported here: pyarrow is heavy: it loads only where files are read or written
        import pyarrow.parquet as pq

        with filesystem.open_input_file(path) as f:
            have = {field.name: field.type for field in pq.ParquetFile(f).schema_arrow}
        declared = column_types(self.schema)
        missing = sorted(set(declared) - set(have))
        if missing:
            return f"missing column(s) {missing}"
        wrong = [f"column {name} is {have[name]} in the file, declared {kind}"
                 for name, kind in declared.items() if not _reads_as(have[name], kind)]
        return "; ".join(wrong) + " (Spark's Parquet reader cannot read it as declared)" \
            if wrong else None

    def index(self, cur, enough=None) -> int:
        """Index what landed since the last look (in the caller's transaction, which holds
        the partitions' locks until it ends), in arrival order: new files, and the new
        complete lines of files that grew. A file whose indexed bytes changed is marked
        (``changed``), not indexed further. Returns how many files were looked at.
        ``enough()``: checked before the first step and after each (1, 2, 4, ... files);
        true, the rest waits for a later look (a batch does not wait for a backlog's index:
        see positions_until). Its time counts as a begin's indexing, the wait for the
        partitions' lock as its lock wait (onceflow.core.timings)."""
        with timings.phase("index"):
            return self._index(cur, enough)

    def _index(self, cur, enough) -> int:
        cur.execute("SELECT path, size, mtime, indexed_to, skipped IS NULL FROM landing_files "
                    "WHERE topic = %s", (self.topic,))
        seen = {p: (s, m, to, followed) for p, s, m, to, followed in cur.fetchall()}
        filesystem, listing = self._listing()
        todo = [f for f in listing if f[0] not in seen or self._again(*seen[f[0]], *f[1:])]
        # Files indexed before are looked at again whatever ``enough`` says: a change must be
        # found before a batch plans over it (a grown file's new lines are few).
        again = [f for f in todo if f[0] in seen]
        if not todo or (not again and enough is not None and enough()):
            return 0
        with timings.phase("lock_wait"):
            cur.execute(
                """SELECT partition, next_offset FROM source_partitions WHERE topic = %s
                   ORDER BY partition FOR UPDATE""", (self.topic,))
        heads = dict(cur.fetchall())
        # Under the partitions' locks: what another look indexed meanwhile is seen now.
        known = self._known(cur, [path for path, _, _ in todo])
        work = [(path, size, mtime, known.get(path)) for path, size, mtime in todo
                if path not in known or self._again(
                    known[path].size, known[path].mtime, known[path].indexed_to,
                    known[path].skipped is None, size, mtime)]
        cur.execute("SELECT coalesce(max(file_no), -1) FROM landing_files WHERE topic = %s",
                    (self.topic,))
        file_no = cur.fetchone()[0]
        # In arrival order: at once up to the last file indexed before, then in steps.
        last = max((i for i, w in enumerate(work) if w[3] is not None), default=-1)
        steps, new = [work[:last + 1]], work[last + 1:]
        step = 1 if enough is not None else len(new)
        while new:
            steps.append(new[:step])
            new, step = new[step:], step * 2
        done = 0
        for i, items in enumerate(steps):
            if i and enough is not None and enough():
                break
            if not items:
                continue
            # The files are read side by side: a remote file system's latency overlaps (the
            # newline count holds the GIL, so on a local disk this is about one core's work).
            with ThreadPoolExecutor(min(4, len(items)),
                                    thread_name_prefix="onceflow-index") as pool:
                found = list(pool.map(lambda item: self._look(filesystem, *item), items))
            for item, outcome in zip(items, found, strict=True):
                file_no = self._record(cur, item, outcome, file_no, heads)
            done += len(items)
        log.info("LANDING topic=%s: looked at %d new or changed file(s)%s", self.topic, done,
                 f", {len(work) - done} left for a later look" if done < len(work) else "")
        return done

    def _again(self, size: int, mtime: float, indexed_to: int, followed: bool, now_size: int,
               now_mtime: float) -> bool:
        """Whether a look must read an indexed file again: it changed since the last look,
        or its last line without a newline is now due (``unterminated_s``)."""
        if not followed:
            return False
        if (size, mtime) != (now_size, now_mtime):
            return True
        return (self.unterminated_s is not None and self.format != "parquet"
                and size > indexed_to
                and datetime.now(UTC).timestamp() - mtime >= self.unterminated_s)

    def _known(self, cur, paths: list[str]) -> dict[str, _Known]:
        """The index's state of ``paths`` (those indexed), with each one's last chunk."""
        cur.execute(
            """SELECT f.path, f.file_no, f.partition, f.size, f.mtime, f.indexed_to,
                      f.checksum, f.changed, f.skipped, l.byte_start, l.byte_end, l.crc,
                      EXISTS (SELECT 1 FROM landing_chunks o WHERE o.topic = f.topic
                              AND o.file_no = f.file_no AND o.crc IS NULL AND o.void IS NULL),
                      f.refused IS NOT NULL
               FROM landing_files f
               LEFT JOIN LATERAL (
                   SELECT c.byte_start, c.byte_end, c.crc FROM landing_chunks c
                   WHERE c.topic = f.topic AND c.file_no = f.file_no AND c.void IS NULL
                   ORDER BY c.byte_start DESC LIMIT 1) l ON true
               WHERE f.topic = %s AND f.path = ANY(%s)""", (self.topic, paths))
        return {row[0]: _Known(*row[1:9], None if row[9] is None else tuple(row[9:12]),
                               *row[12:]) for row in cur.fetchall()}

    def _scan(self, filesystem, path: str, start: int, size: int, mtime: float) -> _Scan:
        tail = self.unterminated_s is not None and \
            datetime.now(UTC).timestamp() - mtime >= self.unterminated_s
        scan = _scan_csv if self.format == "csv" else _scan_text
        return scan(filesystem, path, start, size, self.chunk_bytes,
                    header=self.csv_header and start == 0, limit=self.max_record_bytes,
                    tail=tail)

    def _look(self, filesystem, path: str, size: int, mtime: float, known: _Known | None
              ) -> tuple[str, _Scan | str, str | None]:
        """What a look finds of one file (reading it, no database work): ("new", scan,
        why a Parquet file is set aside), ("grown", scan of its new bytes, None) or
        ("changed", what changed, None)."""
        if known is None:
            if self.format != "parquet":
                return "new", self._scan(filesystem, path, 0, size, mtime), None
            refused = self._check_schema(filesystem, path)
            if refused and self.on_mismatch == "stop":
                raise ConfigError(f"landed file {path!r} does not match source.schema "
                                  f"({refused}); fix or remove it, or set on_mismatch='skip'")
            return "new", _Scan(0, indexed_to=size) if refused \
                else _scan_parquet(filesystem, path), refused
        if known.refused:  # nothing of it is read: whatever it holds now
            return "grown", _Scan(0, indexed_to=known.indexed_to), None
        if known.legacy:
            return "changed", (f"its size or modification time changed (size "
                               f"{known.size} -> {size}), and it was indexed before chunk "
                               "checksums, so an append cannot be told from a rewrite"), None
        if self.format == "parquet":  # written whole: only a touch leaves it the same file
            with filesystem.open_input_file(path) as f:
                footer, now = _parquet_footer(f)
            if now == known.indexed_to and f"{footer:08x}" == known.checksum:
                return "grown", _Scan(0, indexed_to=known.indexed_to), None
            return "changed", (f"its size went from {known.indexed_to} to {now} bytes"
                               if now != known.indexed_to else "its footer (metadata) "
                               "is not the one indexed"), None
        if size < known.indexed_to:
            return "changed", (f"it shrank to {size} bytes; {known.indexed_to} bytes of it "
                               "were indexed"), None
        if known.last is not None:
            start, end, crc = known.last
            with filesystem.open_input_file(path) as f:
                data = f.read_at(end - start, start)
            if zlib.crc32(data) != crc or len(data) != end - start:
                return "changed", (f"bytes [{start}, {end}) (its last indexed chunk) are not "
                                   "the bytes indexed"), None
            if size > end and not data.endswith(b"\n"):
                return "changed", (f"its last line (bytes [{start}, {end})) was indexed "
                                   "without a newline (unterminated_s) and then went on"), None
        return "grown", self._scan(filesystem, path, known.indexed_to, size, mtime), None

    def _record(self, cur, item: tuple, outcome: tuple, file_no: int, heads: dict) -> int:
        """Store what a look found of one file (see _look); returns the last file number."""
        path, size, mtime, known = item
        kind, found, refused = outcome
        if kind == "changed":
            if found != known.changed:
                log.warning("LANDING topic=%s: %s changed after it was indexed: %s; its "
                            "unread records are refused until `onceflow repair` accepts or "
                            "skips it", self.topic, path, found)
            # A file indexed before chunk checksums keeps the size and time it was indexed
            # at: its reads compare them.
            cur.execute(
                """UPDATE landing_files SET changed = %s,
                          size = CASE WHEN %s THEN size ELSE %s END,
                          mtime = CASE WHEN %s THEN mtime ELSE %s END
                   WHERE topic = %s AND file_no = %s""",
                (found, known.legacy, size, known.legacy, mtime, self.topic, known.file_no))
            return file_no
        if kind == "new":
            file_no += 1
            partition = file_no % len(heads)
            if refused:
                log.warning("LANDING topic=%s: %s set aside: %s", self.topic, path, refused)
            cur.execute(
                """INSERT INTO landing_files (topic, file_no, partition, path, size, mtime,
                                              checksum, records, base_offset, refused,
                                              indexed_to)
                   VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)""",
                (self.topic, file_no, partition, path, size, mtime, found.checksum,
                 found.records, heads[partition], refused, found.indexed_to))
            number = file_no
        else:
            number, partition = known.file_no, known.partition
            if known.changed:
                log.warning("LANDING topic=%s: %s is as indexed again (%s no more)",
                            self.topic, path, known.changed)
            cur.execute(
                """UPDATE landing_files SET size = %s, mtime = %s, indexed_to = %s,
                          records = records + %s, changed = NULL,
                          checksum = coalesce(%s, checksum)
                   WHERE topic = %s AND file_no = %s""",
                (size, mtime, found.indexed_to, found.records, found.checksum, self.topic,
                 number))
        base = heads[partition]
        for first, start, end, count, clean_to, crc in found.chunks:
            cur.execute(
                """INSERT INTO landing_chunks (topic, file_no, first_offset, byte_start,
                                               byte_end, records, clean_to, crc, landed_at)
                   VALUES (%s, %s, %s, %s, %s, %s, %s, %s, to_timestamp(%s))""",
                (self.topic, number, base + first, start, end, count, clean_to, crc, mtime))
        if found.records:
            heads[partition] = base + found.records
            cur.execute("UPDATE source_partitions SET next_offset = %s "
                        "WHERE topic = %s AND partition = %s",
                        (heads[partition], self.topic, partition))
        return file_no

    # -- the Source interface --------------------------------------------------------------
    def ensure(self, conn, *, create: bool = False) -> None:
        self._listing()  # the folder must exist
        catalog.ensure_topic(conn, self.topic, self.partitions, create=create)

    def positions(self, cur) -> dict[int, Position]:
        self.index(cur)
        return catalog.positions(cur, self.topic)

    arrival_by_sight = False

    def heads(self, cur) -> dict[int, Position]:
        """The heads of what is indexed (no look at the folder: ``unindexed`` does that)."""
        return catalog.positions(cur, self.topic)

    def unindexed(self, cur) -> tuple[int, datetime | None]:
        """What landed since the last look, from a listing of the folder (names, sizes and
        times; no file is read): new files and files that grew, as records at the bytes per
        record indexed so far (a first file: 1), and the oldest one's modification time.
        Changed files wait for `onceflow repair` and count for nothing."""
        _, listing = self._listing()
        if not listing:
            return 0, None
        cur.execute(
            """SELECT coalesce(sum(l.size - coalesce(f.indexed_to, 0)), 0)::bigint, min(l.mtime)
               FROM unnest(%s::text[], %s::bigint[], %s::float8[]) AS l (path, size, mtime)
               LEFT JOIN landing_files f ON f.topic = %s AND f.path = l.path
               WHERE f.path IS NULL OR (f.skipped IS NULL AND f.changed IS NULL
                     AND f.refused IS NULL AND (f.size, f.mtime) <> (l.size, l.mtime)
                     AND l.size > f.indexed_to)""",
            ([p for p, _, _ in listing], [z for _, z, _ in listing],
             [m for _, _, m in listing], self.topic))
        new_bytes, oldest = cur.fetchone()
        if not new_bytes:
            return 0, None
        cur.execute("""SELECT sum(indexed_to)::float8 / nullif(sum(records), 0)
                       FROM landing_files WHERE topic = %s AND refused IS NULL""",
                    (self.topic,))
        per_record = cur.fetchone()[0] or 1.0
        return max(1, int(new_bytes / per_record)), datetime.fromtimestamp(oldest, UTC)

    def arrivals(self, cur, points) -> dict[tuple[int, int], datetime]:
        """A record arrived when its file was last modified before the look that indexed
        it (a chunk indexed before that was recorded: when its file was first indexed)."""
        return catalog.at_points(cur, """
            SELECT w.p, w.o, (SELECT coalesce(c.landed_at, f.indexed_at)
                              FROM landing_chunks c JOIN landing_files f USING (topic, file_no)
                              WHERE c.topic = %(topic)s AND f.partition = w.p
                                AND c.first_offset <= w.o
                              ORDER BY c.first_offset DESC LIMIT 1)
            FROM unnest(%(partitions)s::int[], %(offsets)s::bigint[]) AS w (p, o)""",
                                 self.topic, points)

    def positions_until(self, cur, enough) -> dict[int, Position]:
        """Positions once enough is indexed for ``enough(positions)``: a begin indexes what
        its batch needs and leaves a backlog's other files to later begins, which index them
        while earlier batches process: the first begin of a large backlog has no Spark work
        to overlap. Status, alerts and retention index them all."""
        self.index(cur, enough=lambda: enough(catalog.positions(cur, self.topic)))
        return catalog.positions(cur, self.topic)

    def held_back(self, cur, starts) -> dict[int, int]:
        """Per partition, the first offset at or after its start of a chunk of a changed
        file (not void): a begin plans no batch past it until `onceflow repair` accepts or
        skips the file (see held_back in Source)."""
        if not starts:
            return {}
        cur.execute(
            """SELECT f.partition, min(c.first_offset)
               FROM landing_files f JOIN landing_chunks c USING (topic, file_no)
               JOIN unnest(%s::int[], %s::bigint[]) AS s (part, start)
                 ON f.partition = s.part AND c.first_offset + c.records > s.start
               WHERE f.topic = %s AND f.changed IS NOT NULL AND f.skipped IS NULL
                 AND c.void IS NULL
               GROUP BY f.partition""",
            (list(starts), list(starts.values()), self.topic))
        return dict(cur.fetchall())

    def _chunks(self, cur, ranges: Iterable[PartitionRange]) -> list[_Chunk]:
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
                (self.topic, r.partition, r.end, r.start))
            rows = [_Chunk(*row) for row in cur.fetchall()]
            covered = r.start
            for row in rows:
                if row.first > covered:
                    break
                covered = max(covered, row.first + row.records)
            if covered < r.end:
                raise SourceShortfall(
                    f"landing folder {self.topic!r} partition {r.partition}: no indexed file "
                    f"holds offsets [{covered}, {r.end}) of the planned range")
            out += rows
        return list(dict.fromkeys(out))  # a chunk two ranges share is read once

    def may_refuse(self, cur, ranges: Iterable[PartitionRange]) -> bool:
        """True when a chunk of ``ranges`` was not found clean up to today's
        max_record_bytes when its file was indexed (see _scan_text; Parquet: always,
        a typed one only when it has a float column)."""
        ranges = [r for r in ranges if r.size > 0]
        if self.format == "parquet":  # typed: only a float column's NaN or infinity
            return self.records is None or bool(_float_columns(self.records))
        if not ranges:
            return False
        cur.execute(
            """SELECT coalesce(bool_or(c.clean_to IS NULL OR c.clean_to > %s), false)
               FROM landing_chunks c JOIN landing_files f USING (topic, file_no)
               JOIN unnest(%s::int[], %s::bigint[], %s::bigint[]) AS r (part, lo, hi)
                 ON f.partition = r.part AND c.first_offset < r.hi
                    AND c.first_offset + c.records > r.lo
               WHERE c.topic = %s AND c.void IS NULL""",
            (self.max_record_bytes, [r.partition for r in ranges], [r.start for r in ranges],
             [r.end for r in ranges], self.topic))
        return cur.fetchone()[0]

    def whole_units(self, cur, points: Iterable[tuple[int, int]]
                    ) -> dict[int, tuple[int, int]]:
        """Parquet: the row group around each point (Spark's reader decodes a row group
        whole). Lines are read from any offset: none."""
        points = list(points)
        if self.format != "parquet" or not points:
            return {}
        cur.execute(
            """SELECT pt.p, c.lo, c.hi FROM unnest(%s::int[], %s::bigint[]) AS pt (p, o)
               CROSS JOIN LATERAL (
                   SELECT c.first_offset AS lo, c.first_offset + c.records AS hi
                   FROM landing_chunks c JOIN landing_files f USING (topic, file_no)
                   WHERE c.topic = %s AND f.partition = pt.p AND c.first_offset < pt.o
                     AND c.void IS NULL
                   ORDER BY c.first_offset DESC LIMIT 1) AS c
               WHERE c.hi > pt.o""",
            ([p for p, _ in points], [o for _, o in points], self.topic))
        return {p: (lo, hi) for p, lo, hi in cur.fetchall()}

    def read(self, spark, dsn: str, ranges: Iterable[PartitionRange]):
        ranges = [r for r in ranges if r.size > 0]
        with connection(dsn, application_name="onceflow-landing") as conn, \
                transaction(conn) as cur:
            chunks = [c for c in self._chunks(cur, ranges) if c.void is None]
            if self.format == "parquet":
                cur.execute("SELECT path, base_offset FROM landing_files WHERE topic = %s "
                            "AND path = ANY(%s)", (self.topic, [c.path for c in chunks]))
                bases = dict(cur.fetchall())
        if self.format == "parquet":
            return self._read_parquet(spark, ranges, chunks, bases)
        ddl = self.read_ddl
        if not chunks:
            return spark.createDataFrame([], ddl)
        wanted = [(r.partition, r.start, r.end) for r in ranges]

        if jvm_reader(spark) and "://" not in self.path:
            # the JVM reads the chunks (onceflow.sources.jvm): the same rows, one task per chunk
            return jvm_lines(spark, chunks, wanted, self.records, self.max_record_bytes,
                             csv=self.format == "csv")
        # One Spark task per chunk (task i reads chunks[i], which travel with the reader): a
        # DataFrame of the chunks would be cut by the default parallelism into a few uneven
        # tasks, the last of which holds the batch back while cores idle.
        tasks = spark.range(0, len(chunks), 1, numPartitions=len(chunks))
        return tasks.mapInArrow(
            _chunk_reader(self.format, self.csv_header, self.path, chunks, wanted,
                          self.records, self.max_record_bytes), ddl)

    def _read_parquet(self, spark, ranges: list[PartitionRange], chunks: list[_Chunk],
                      bases: dict[str, int]):
        """Parquet files through Spark's own reader (in the JVM): a row's offset is its
        file's base offset plus its row index in the file, its payload the row as JSON
        (typed: the declared columns, which Spark then reads only as the topology uses them).
        Each file's footer and the row groups the ranges hold are checked against their
        CRC-32s here first (Spark's reader reads them after the check)."""

        # imported here: pyspark loads only where Spark is used
        from pyspark.sql import functions as F

        filesystem, _ = _filesystem(self.path)
        files: dict[str, list[_Chunk]] = {}
        for chunk in chunks:
            files.setdefault(chunk.path, []).append(chunk)
        parts = []
        for path, groups in files.items():
            partition = groups[0].partition
            try:
                _check_parquet(filesystem, groups)
            except RuntimeError as error:
                raise SourceChanged(str(error)) from None
            reader = spark.read.schema(self.schema) if self.schema else spark.read
            df = reader.parquet(_spark_path(self.path, path))
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
            if self.records is not None:  # typed: the columns as they are (pruned by Spark)
                # NaN and the infinities have no JSON form: such a row could not come back
                # from its payload the same, so it is refused as a record over size is
                problem = F.lit(None).cast("string")
                for name in reversed(_float_columns(self.records)):
                    value = F.col(f"`{name}`")
                    problem = F.when(F.isnan(value) | (F.abs(value) == float("inf")), F.lit(
                        f"column {name} holds NaN or an infinity, which the record's payload "
                        "(its row as JSON) cannot hold")).otherwise(problem)
                body = [*(F.col(f"`{name}`").cast(kind).alias(name)
                          for name, kind in self.records.columns),
                        F.lit(None).cast("string").alias(CORRUPT), problem.alias(PROBLEM)]
            else:
                body = [F.to_json(F.struct("*"), SPARK_JSON).alias("payload")]
            parts.append(df.select(
                F.lit(partition).cast("int").alias("partition"), offset.alias("offset"),
                *body).where(keep))
        if not parts:
            return spark.createDataFrame([], self.read_ddl)
        return reduce(lambda a, b: a.unionByName(b), parts)

    def payloads(self, conn, ranges: Iterable[PartitionRange]
                 ) -> Iterator[tuple[int, int, str]]:
        ranges = [r for r in ranges if r.size > 0]
        with conn.cursor() as cur:
            chunks = [c for c in self._chunks(cur, ranges) if c.void is None]
        filesystem, _ = _filesystem(self.path)
        for chunk in chunks:
            for i, payload in enumerate(_read_chunk(filesystem, self.format, chunk)
                                        .to_pylist()):
                offset = chunk.first + i
                if any(r.partition == chunk.partition and r.start <= offset < r.end
                       for r in ranges):
                    yield chunk.partition, offset, payload

    notices_heading: ClassVar[str] = "source files that need something"  # (status)

    def notices(self, cur, pipeline: str) -> list[tuple[str, str]]:
        """(what, the command that fixes it) for each landed file that holds the pipeline up
        or waits: changed ones, skipped ones, and lines waiting a minute or more for their
        newline (onceflow status shows them). The index as the caller's look left it."""
        cur.execute(
            """SELECT path, changed, skipped, size - indexed_to, mtime, refused
               FROM landing_files
               WHERE topic = %s AND (changed IS NOT NULL OR skipped IS NOT NULL
                                     OR refused IS NOT NULL OR (size > indexed_to AND %s))
               ORDER BY file_no""", (self.topic, self.format != "parquet"))
        now = datetime.now(UTC).timestamp()
        out = []
        for path, changed, skipped, waiting, mtime, refused in cur.fetchall():
            if refused is not None:
                out.append((f"landed file {path} is set aside (it holds no record): {refused}",
                            SET_ASIDE_FIX))
            elif changed is not None:
                out.append((f"landed file {path} changed after it was indexed: {changed}; "
                            "its unread records are refused",
                            f"onceflow repair --pipeline {pipeline} (says which records it "
                            f"holds), then --accept-changed or --skip-changed {path}"))
            elif skipped is not None:
                out.append((f"landed file {path} is skipped: {skipped}", "-"))
            elif now - mtime >= max(60.0, self.settle_s):
                what = ("hold no whole record yet (no newline outside a quoted field)"
                        if self.format == "csv" else "have no newline yet")
                out.append((f"landed file {path}: its last {waiting} bytes {what} "
                            f"(unmodified for {now - mtime:.0f}s): they are not read",
                            "if the file is complete, append a newline to it (or set "
                            "source.unterminated_s)"))
        return out

    def describe(self) -> str:
        return f"landing folder {self.path!r} ({self.format}, topic {self.topic!r})"


def _reads_as(arrow_type, declared: str) -> bool:
    """Whether Spark's Parquet reader reads a column of ``arrow_type`` as the declared Spark
    type, each value as it is (a narrower integer or float widened, a decimal of the same
    scale and no more digits); a type Spark would refuse, or convert to other values (an
    integer read as a date, a wider integer cut), is not. Nested types are left to Spark."""
    # imported here: pyarrow is heavy: it loads only where files are read or written
    import pyarrow as pa
    import pyarrow.types as t

    if declared.startswith(("array", "map", "struct")):
        return True
    if t.is_dictionary(arrow_type):  # (pandas' categoricals): read as their values
        arrow_type = arrow_type.value_type
    ints = {"tinyint": 8, "smallint": 16, "int": 32, "bigint": 64}
    if declared in ints:
        width = ints[declared]
        return (t.is_signed_integer(arrow_type) and arrow_type.bit_width <= width) or \
            (t.is_unsigned_integer(arrow_type) and arrow_type.bit_width < min(width, 64)
             and width > 8)
    if declared == "double":
        return t.is_floating(arrow_type) and arrow_type.bit_width >= 32 or \
            (t.is_integer(arrow_type) and arrow_type.bit_width <= 32)
    if declared == "float":
        return arrow_type == pa.float32()
    if declared == "string" or declared == "binary":
        return t.is_string(arrow_type) or t.is_large_string(arrow_type) or \
            t.is_binary(arrow_type) or t.is_large_binary(arrow_type)
    if declared == "boolean":
        return t.is_boolean(arrow_type)
    if declared == "date":
        return t.is_date32(arrow_type)
    if declared in ("timestamp", "timestamp_ntz"):
        return t.is_timestamp(arrow_type) or (declared == "timestamp_ntz"
                                              and t.is_date32(arrow_type))
    if declared.startswith("decimal"):
        digits = [int(x) for x in declared[len("decimal"):].strip("()").split(",") if x]
        precision, scale = (digits + [10, 0][len(digits):])[:2]
        return t.is_decimal(arrow_type) and arrow_type.scale == scale and \
            arrow_type.precision <= precision
    return True  # a type this does not know: Spark's reader decides


def _float_columns(records: JsonRecords) -> list[str]:
    return [name for name, kind in records.columns if kind in ("float", "double")]


def _spark_path(root: str, path: str) -> str:
    """A manifest path as Spark reads it: local paths as they are, URIs with their scheme."""
    scheme = root.split("://", 1)[0] + "://" if "://" in root else ""
    return path if not scheme or path.startswith(scheme) else scheme + path


def jvm_lines(spark, chunks: list[_Chunk], wanted: list[tuple[int, int, int]],
              records: JsonRecords | None, max_bytes: int, *, csv: bool = False):
    """The JVM reader (onceflow.spark.JsonLinesSource) over local ``chunks``: the records in
    ``wanted`` ((partition, start, end)), decoded by ``records`` (None: payloads); ``csv``:
    cut as CSV records (_csv_records), not lines."""
    spec = {"chunks": [_jvm_chunk(c) for c in chunks], "wanted": [list(w) for w in wanted],
            "columns": list(map(list, records.columns)) if records else None,
            "max_record_bytes": max_bytes, "csv": csv}
    return spark.read.format(JVM_READER).option("spec", json.dumps(spec)).load()


def file_chunk(path: str, records: int, partition: int = 0) -> _Chunk:
    """A whole local file of ``records`` lines as one chunk of ``partition`` from offset 0,
    checked by its size and mtime (no CRC-32): what the server's warm-up reads."""
    stat = os.stat(path)
    return _Chunk(path=path, size=stat.st_size, mtime=stat.st_mtime, first=0, start=0,
                  end=stat.st_size, records=records, partition=partition, crc=None, void=None)


def _jvm_chunk(chunk: _Chunk) -> list:
    """A chunk as the JVM reader's spec holds it (onceflow.spark.ReadSpec)."""
    return [chunk.path, chunk.crc, chunk.size, chunk.mtime, chunk.first, chunk.start,
            chunk.end, chunk.partition, chunk.records]


def _where(chunk: _Chunk) -> str:
    return (f"bytes [{chunk.start}, {chunk.end}) (the chunk of offsets [{chunk.first}, "
            f"{chunk.first + chunk.records}) of partition {chunk.partition})")


def _changed(chunk: _Chunk, what: str) -> RuntimeError:
    return RuntimeError(f"landed file {chunk.path!r} changed after it was indexed: {what}: "
                        f"refused. {REPAIR_HINT}")


def _removed(path: str, filesystem) -> RuntimeError:
    require_folder(posixpath.dirname(path), filesystem)  # a folder not mounted here says so
    # Refused as a changed file is (retries read the same missing file): repair skips it.
    return RuntimeError(f"landed file {path!r} was removed before every batch reading it "
                        f"committed: refused. {REPAIR_HINT}")


def _read_chunk(filesystem, fmt: str, chunk: _Chunk):
    """The payloads of one chunk (an Arrow string array), its bytes checked."""
    # imported here: pyarrow is heavy: it loads only where files are read or written
    import pyarrow as pa

    if fmt == "parquet":
        # imported here: pyarrow is heavy: it loads only where files are read or written
        import pyarrow.parquet as pq

        _check_parquet(filesystem, [chunk])
        with filesystem.open_input_file(chunk.path) as f:
            table = pq.ParquetFile(f).read_row_group(chunk.start)  # start: the row group
        return pa.array([json.dumps(row, default=str, ensure_ascii=False)
                         for row in table.to_pylist()], pa.string())
    if fmt == "csv":
        return _csv_array(_chunk_bytes(filesystem, chunk))
    return _line_array(_chunk_bytes(filesystem, chunk))


def _chunk_bytes(filesystem, chunk: _Chunk) -> bytes:
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


def _check_parquet(filesystem, chunks: list[_Chunk]) -> None:
    """A Parquet file's footer and the row groups of ``chunks`` (all of one file) are the
    bytes indexed."""
    # imported here: pyarrow is heavy: it loads only where files are read or written
    import pyarrow.parquet as pq

    first = chunks[0]
    if first.crc is None:
        _check_unchanged(filesystem, first)
        return
    try:
        with filesystem.open_input_file(first.path) as f:
            footer, size = _parquet_footer(f)
            if f"{footer:08x}" != first.checksum:
                raise _changed(first, f"its footer (metadata, at the end of its {size} "
                                      f"bytes) is not the one indexed")
            meta = pq.ParquetFile(f).metadata
            for chunk in chunks:
                crc, _ = _crc_of(f, *_row_group_bytes(meta, chunk.start))
                if crc != chunk.crc:
                    raise _changed(chunk, f"row group {chunk.start} (offsets [{chunk.first}, "
                                          f"{chunk.first + chunk.records}) of partition "
                                          f"{chunk.partition}) is not the one indexed (CRC-32 "
                                          f"{crc:08x}, indexed {chunk.crc:08x})")
    except FileNotFoundError:
        raise _removed(first.path, filesystem) from None


def _check_unchanged(filesystem, chunk: _Chunk) -> None:
    """A chunk indexed before chunk checksums: its file's size and modification time."""
    # imported here: pyarrow is heavy: it loads only where files are read or written
    from pyarrow import fs

    info = filesystem.get_file_info(chunk.path)
    if info.type != fs.FileType.File:
        raise _removed(chunk.path, filesystem)
    if info.size != chunk.size or (info.mtime and
                                   abs(info.mtime.timestamp() - chunk.mtime) > 1e-3):
        raise _changed(chunk, f"its size or modification time is not the one indexed (size "
                              f"{chunk.size} -> {info.size}; indexed before chunk checksums)")


def _chunk_reader(fmt: str, header: bool, root: str, chunks: list[_Chunk],
                  wanted: list[tuple[int, int, int]], records: JsonRecords | None = None,
                  max_bytes: int | None = None):
    """The mapInArrow function reading ``chunks`` (rows of LandingFolder._chunks) by index
    (the ids of spark.range), keeping the records in ``wanted`` ((partition, start, end)).
    With ``records`` each line is decoded (its columns, ``_corrupt_record`` and the spout's
    ``_problem``, see JsonRecords.decode) instead of being a payload."""
    def read(batches):
        # imported here: numpy is heavy: it loads only with the Arrow data it serves
        import numpy as np

        # imported here: pyarrow is heavy: it loads only where files are read or written
        import pyarrow as pa

        filesystem, _ = _filesystem(root)
        for batch in batches:
            for index in batch.column("id").to_pylist():
                chunk = chunks[index]
                first, partition = chunk.first, chunk.partition
                if records is None:
                    columns = {"payload": _read_chunk(filesystem, fmt, chunk)}
                else:
                    lines = _line_bytes(_chunk_bytes(filesystem, chunk))
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
