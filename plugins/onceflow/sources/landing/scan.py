"""Reading a landed file's bytes at indexing: cut into chunks at record boundaries (lines, CSV
records, Parquet row groups), each with its CRC-32 and how far its records are clean; and
the same cutting for the read path (split_lines, line_array, csv_array).

pyarrow is imported here at the top, as in the other modules that list, index and read the
folder: the declaration (LandingFolder) reaches them only when a transaction asks, so a DAG
parse loads no pyarrow (onceflow.sources.landing.folder)."""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from onceflow.core.source import MAX_RECORD_BYTES

# A Parquet row group's bytes are checked in pieces of this size (a row group may be large).
CHECK_BYTES = 8 << 20


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
class Scan:
    """What one pass over a file's bytes found: its records, its chunks ``(first_record,
    byte_start, byte_end, records, clean_to, crc)`` (first_record counted from the pass's
    start), how far it indexed (the end of its last complete line) and, for a Parquet file,
    its footer's CRC-32."""

    records: int
    chunks: list[tuple[int, int, int, int, int | None, int]] = field(default_factory=list)
    indexed_to: int = 0
    checksum: str | None = None


def scan_text(filesystem, path: str, start: int, size: int, chunk_bytes: int, *,
               header: bool, limit: int = MAX_RECORD_BYTES, tail: bool = False) -> Scan:
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
                return Scan(records, chunks, at)
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
# Whole lines that are each a record whose quoted fields close on the line (as writers that
# quote every string make them): _CSV_CLOSED with no newline inside, walked in one C call.
_CSV_LINE_FIELD = rb'(?:"(?:[^"\n]|"")*+"[^,\n]*+|[^,"\n][^,\n]*+)?'
_CSV_CLOSED_LINES = re.compile(
    rb"(?:" + _CSV_LINE_FIELD + rb"(?:," + _CSV_LINE_FIELD + rb")*+\n)++")


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


def csv_array(data: bytes):
    """``_csv_records(data)`` as an Arrow string array, bytes that are not UTF-8 replaced
    (U+FFFD); without a quote the records are the non-empty lines, cut in C++."""
    if b'"' not in data:
        lines = line_array(data)
        return lines.filter(pc.not_equal(pc.binary_length(lines), 0))
    return pa.array([r.decode("utf-8", errors="replace") for r in _csv_records(data)],
                    pa.string())


def _csv_clean(data, multi: bool, limit: int) -> int | None:
    """A CSV chunk's ``clean_to`` (see scan_text): None when a record of it spans lines."""
    if multi or b"\0" in data or not _lines_within(data, 0, len(data), limit):
        return None
    if not data.isascii():
        try:
            str(data, "utf-8")
        except UnicodeDecodeError:
            return None
    return limit


def scan_csv(filesystem, path: str, start: int, size: int, chunk_bytes: int, *,
              header: bool, limit: int = MAX_RECORD_BYTES, tail: bool = False) -> Scan:
    """``scan_text`` for CSV (RFC 4180): chunks are cut at record ends (never inside a
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
                return Scan(records, chunks, at if skip else at + rec)
            buf += block
            while True:
                if not inside and not skip:  # whole lines without a quote: each a record
                    quote = buf.find(b'"', line)
                    end = buf.rfind(b"\n", line, quote if quote >= 0 else len(buf))
                    if end < line:  # a quote on the next line: lines whose quotes close
                        closed = _CSV_CLOSED_LINES.match(buf, line)
                        end = closed.end() - 1 if closed else -1
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
                return Scan(records, chunks, at if skip else at + rec)


def crc_of(f, start: int, end: int) -> tuple[int, int]:
    """(CRC-32 of bytes ``[start, end)`` of an open file, how many of them it has)."""
    crc, at = 0, start
    while at < end:
        piece = f.read_at(min(CHECK_BYTES, end - at), at)
        if not piece:
            break
        crc = zlib.crc32(piece, crc)
        at += len(piece)
    return crc, at - start


def parquet_footer(f) -> tuple[int, int]:
    """(CRC-32 of a Parquet file's footer: its metadata, their length and the magic; size)."""
    size = f.size()
    if size < 12:
        return 0, size
    length = int.from_bytes(f.read_at(4, size - 8), "little")
    return crc_of(f, max(0, size - 8 - length), size)[0], size


def row_group_bytes(meta, group: int) -> tuple[int, int]:
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


def scan_parquet(filesystem, path: str) -> Scan:
    """A Parquet file's chunks are its row groups (the byte fields hold the row group's
    number), each with the CRC-32 of its column chunks' bytes; the file's footer's CRC-32
    is its checksum. (One read of the file: Parquet files are written whole, but a rewrite
    in place under the same size and time would otherwise go unseen.)"""
    with filesystem.open_input_file(path) as f:
        footer, size = parquet_footer(f)
        meta = pq.ParquetFile(f).metadata
        chunks, first = [], 0
        for g in range(meta.num_row_groups):
            rows = meta.row_group(g).num_rows
            chunks.append((first, g, g + 1, rows, None, crc_of(f, *row_group_bytes(meta, g))[0]))
            first += rows
    return Scan(first, chunks, size, f"{footer:08x}")


def split_lines(data: bytes) -> list[str]:
    """A chunk's records: its lines, cut at LF, each without one trailing CR, bytes that are
    not UTF-8 replaced (U+FFFD); no record after a last LF."""
    text = data.decode("utf-8", errors="replace")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def line_bytes(data: bytes) -> list[bytes]:
    """``split_lines(data)`` as bytes, undecoded (what a JSON decoder reads): the same cut."""
    unterminated = not data.endswith(b"\n")  # a last line without LF (may end with a CR)
    if b"\r" in data:
        data = data.replace(b"\r\n", b"\n")
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    if unterminated and lines and lines[-1].endswith(b"\r"):
        lines[-1] = lines[-1][:-1]
    return lines


def line_array(data: bytes):
    """``split_lines(data)`` as an Arrow string array, cut in C++ (pyarrow's split) without a
    Python string per line; a chunk that is not valid UTF-8 goes through ``split_lines``.

    Equal to ``split_lines``: LF occurs in UTF-8 only as itself, so cutting bytes is cutting text;
    a CR before an LF can only end a line, so replacing CRLF by LF strips exactly one CR per
    line; a CR at the very end ends a last line that has no LF."""
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
        return pa.array(split_lines(data), pa.string())
