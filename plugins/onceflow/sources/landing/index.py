"""Indexing a landing folder: each look lists the folder, reads what is new (new files, the new
complete lines of files that grew), and records it in the manifest (landing_files,
landing_chunks) under the partitions' locks; a file whose indexed bytes changed is marked,
not indexed further (see onceflow.sources.landing). pyarrow at the top: see
onceflow.sources.landing.scan."""

from __future__ import annotations

import fnmatch
import logging
import zlib
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq
import pyarrow.types as t
from pyarrow import fs

from onceflow.core import timings
from onceflow.core.errors import ConfigError
from onceflow.core.topology import column_types
from onceflow.sources.landing.scan import (
    Scan,
    parquet_footer,
    scan_csv,
    scan_parquet,
    scan_text,
)
from onceflow.sources.landing.storage import open_filesystem, require_folder

log = logging.getLogger("onceflow.sources.landing")


HIDDEN_SUFFIXES = (".tmp", ".part", "._COPYING_")


class Known(NamedTuple):
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


class Listed(NamedTuple):
    """A landed file as the folder's listing shows it (list_files)."""

    path: str
    size: int
    mtime: float


class Seen(NamedTuple):
    """An indexed file as a look reads the index first: as it was, how far it is indexed."""

    size: int
    mtime: float
    indexed_to: int
    followed: bool  # not skipped: its new lines are indexed


class Work(NamedTuple):
    """A file a look reads: as listed now, and as indexed (None: a new file)."""

    path: str
    size: int
    mtime: float
    known: Known | None


class Look(NamedTuple):
    """What a look finds of one file (look): ``kind`` "new", "grown" or "changed"; ``found``
    the scan of its (new) bytes, or what changed; ``refused``: why a new Parquet file is
    set aside."""

    kind: str
    found: Scan | str
    refused: str | None = None


def list_files(folder):
    """(Listed) every landed file, oldest first; settling ones left out."""
    filesystem, root = open_filesystem(folder.path)
    require_folder(root, filesystem, field="source.path")
    now = datetime.now(UTC).timestamp()
    found = []
    for entry in filesystem.get_file_info(fs.FileSelector(root, recursive=False)):
        name = entry.base_name
        if entry.type != fs.FileType.File or name.startswith((".", "_")) \
                or name.endswith(HIDDEN_SUFFIXES) or not fnmatch.fnmatch(name, folder.pattern):
            continue
        mtime = entry.mtime.timestamp() if entry.mtime else 0.0
        if now - mtime < folder.settle_s:
            continue  # still being written, perhaps: the next begin takes it
        found.append(Listed(entry.path, entry.size, mtime))
    return filesystem, sorted(found, key=lambda f: (f[2], f[0]))


def _check_schema(folder, filesystem, path: str) -> str | None:
    """Why a Parquet file does not match the declared schema (None: it does)."""
    if folder.format != "parquet" or not folder.schema:
        return None

    with filesystem.open_input_file(path) as f:
        have = {field.name: field.type for field in pq.ParquetFile(f).schema_arrow}
    declared = column_types(folder.schema)
    missing = sorted(set(declared) - set(have))
    if missing:
        return f"missing column(s) {missing}"
    wrong = [f"column {name} is {have[name]} in the file, declared {kind}"
             for name, kind in declared.items() if not _reads_as(have[name], kind)]
    return "; ".join(wrong) + " (Spark's Parquet reader cannot read it as declared)" \
        if wrong else None


def index(folder, cur, enough=None) -> int:
    """Index what landed since the last look (in the caller's transaction, which holds
    the partitions' locks until it ends), in arrival order: new files, and the new
    complete lines of files that grew. A file whose indexed bytes changed is marked
    (``changed``), not indexed further. Returns how many files were looked at.
    ``enough()``: checked before the first step and after each (1, 2, 4, ... files);
    true, the rest waits for a later look (a batch does not wait for a backlog's index:
    see positions_until). Its time counts as a begin's indexing, the wait for the
    partitions' lock as its lock wait (onceflow.core.timings)."""
    with timings.phase("index"):
        return _index(folder, cur, enough)


def _index(folder, cur, enough) -> int:
    cur.execute("SELECT path, size, mtime, indexed_to, skipped IS NULL FROM landing_files "
                "WHERE topic = %s", (folder.topic,))
    seen = {p: Seen(s, m, to, followed) for p, s, m, to, followed in cur.fetchall()}
    filesystem, listing = list_files(folder)
    todo = [f for f in listing
            if f.path not in seen or _again(folder, seen[f.path], f.size, f.mtime)]
    # Files indexed before are looked at again whatever ``enough`` says: a change must be
    # found before a batch plans over it (a grown file's new lines are few).
    again = [f for f in todo if f.path in seen]
    if not todo or (not again and enough is not None and enough()):
        return 0
    with timings.phase("lock_wait"):
        cur.execute(
            """SELECT partition, next_offset FROM source_partitions WHERE topic = %s
               ORDER BY partition FOR UPDATE""", (folder.topic,))
    heads = dict(cur.fetchall())
    # Under the partitions' locks: what another look indexed meanwhile is seen now.
    known = known_files(folder, cur, [f.path for f in todo])
    work = [Work(path, size, mtime, known.get(path)) for path, size, mtime in todo
            if path not in known or _again(folder, Seen(
                known[path].size, known[path].mtime, known[path].indexed_to,
                known[path].skipped is None), size, mtime)]
    cur.execute("SELECT coalesce(max(file_no), -1) FROM landing_files WHERE topic = %s",
                (folder.topic,))
    file_no = cur.fetchone()[0]
    # In arrival order: at once up to the last file indexed before, then in steps.
    last = max((i for i, w in enumerate(work) if w.known is not None), default=-1)
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
            found = list(pool.map(lambda item: look(folder, filesystem, item), items))
        for item, outcome in zip(items, found, strict=True):
            file_no = record(folder, cur, item, outcome, file_no, heads)
        done += len(items)
    log.info("LANDING topic=%s: looked at %d new or changed file(s)%s", folder.topic, done,
             f", {len(work) - done} left for a later look" if done < len(work) else "")
    return done


def _again(folder, seen: Seen, now_size: int, now_mtime: float) -> bool:
    """Whether a look must read an indexed file again: it changed since the last look,
    or its last line without a newline is now due (``unterminated_s``)."""
    if not seen.followed:
        return False
    if (seen.size, seen.mtime) != (now_size, now_mtime):
        return True
    return (folder.unterminated_s is not None and folder.format != "parquet"
            and seen.size > seen.indexed_to
            and datetime.now(UTC).timestamp() - seen.mtime >= folder.unterminated_s)


def known_files(folder, cur, paths: list[str]) -> dict[str, Known]:
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
           WHERE f.topic = %s AND f.path = ANY(%s)""", (folder.topic, paths))
    return {path: Known(file_no, partition, size, mtime, indexed_to, checksum, changed,
                        skipped, None if start is None else (start, end, crc), legacy, refused)
            for (path, file_no, partition, size, mtime, indexed_to, checksum, changed, skipped,
                 start, end, crc, legacy, refused) in cur.fetchall()}


def _scan(folder, filesystem, path: str, start: int, size: int, mtime: float) -> Scan:
    tail = folder.unterminated_s is not None and \
        datetime.now(UTC).timestamp() - mtime >= folder.unterminated_s
    scan = scan_csv if folder.format == "csv" else scan_text
    return scan(filesystem, path, start, size, folder.chunk_bytes,
                header=folder.csv_header and start == 0, limit=folder.max_record_bytes,
                tail=tail)


def look(folder, filesystem, item: Work) -> Look:
    """What a look finds of one file (reading it, no database work): "new" (its scan, and
    why a Parquet file is set aside), "grown" (the scan of its new bytes) or "changed" (what
    changed)."""
    path, size, mtime, known = item
    if known is None:
        if folder.format != "parquet":
            return Look("new", _scan(folder, filesystem, path, 0, size, mtime))
        refused = _check_schema(folder, filesystem, path)
        if refused and folder.on_mismatch == "stop":
            raise ConfigError(f"landed file {path!r} does not match source.schema "
                              f"({refused}); fix or remove it, or set on_mismatch='skip'")
        return Look("new", Scan(0, indexed_to=size) if refused
                    else scan_parquet(filesystem, path), refused)
    if known.refused:  # nothing of it is read: whatever it holds now
        return Look("grown", Scan(0, indexed_to=known.indexed_to))
    if known.legacy:
        return Look("changed", (f"its size or modification time changed (size "
                                f"{known.size} -> {size}), and it was indexed before chunk "
                                "checksums, so an append cannot be told from a rewrite"))
    if folder.format == "parquet":  # written whole: only a touch leaves it the same file
        with filesystem.open_input_file(path) as f:
            footer, now = parquet_footer(f)
        if now == known.indexed_to and f"{footer:08x}" == known.checksum:
            return Look("grown", Scan(0, indexed_to=known.indexed_to))
        return Look("changed", (f"its size went from {known.indexed_to} to {now} bytes"
                                if now != known.indexed_to else "its footer (metadata) "
                                "is not the one indexed"))
    if size < known.indexed_to:
        return Look("changed", (f"it shrank to {size} bytes; {known.indexed_to} bytes of it "
                                "were indexed"))
    if known.last is not None:
        start, end, crc = known.last
        with filesystem.open_input_file(path) as f:
            data = f.read_at(end - start, start)
        if zlib.crc32(data) != crc or len(data) != end - start:
            return Look("changed", (f"bytes [{start}, {end}) (its last indexed chunk) are not "
                                    "the bytes indexed"))
        if size > end and not data.endswith(b"\n"):
            return Look("changed", (f"its last line (bytes [{start}, {end})) was indexed "
                                    "without a newline (unterminated_s) and then went on"))
    return Look("grown", _scan(folder, filesystem, path, known.indexed_to, size, mtime))


def record(folder, cur, item: Work, outcome: Look, file_no: int, heads: dict) -> int:
    """Store what a look found of one file (see look); returns the last file number."""
    path, size, mtime, known = item
    kind, found, refused = outcome
    if kind == "changed":
        if found != known.changed:
            log.warning("LANDING topic=%s: %s changed after it was indexed: %s; its "
                        "unread records are refused until `onceflow repair` accepts or "
                        "skips it", folder.topic, path, found)
        # A file indexed before chunk checksums keeps the size and time it was indexed
        # at: its reads compare them.
        cur.execute(
            """UPDATE landing_files SET changed = %s,
                      size = CASE WHEN %s THEN size ELSE %s END,
                      mtime = CASE WHEN %s THEN mtime ELSE %s END
               WHERE topic = %s AND file_no = %s""",
            (found, known.legacy, size, known.legacy, mtime, folder.topic, known.file_no))
        return file_no
    if kind == "new":
        file_no += 1
        partition = file_no % len(heads)
        if refused:
            log.warning("LANDING topic=%s: %s set aside: %s", folder.topic, path, refused)
        cur.execute(
            """INSERT INTO landing_files (topic, file_no, partition, path, size, mtime,
                                          checksum, records, base_offset, refused,
                                          indexed_to)
               VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)""",
            (folder.topic, file_no, partition, path, size, mtime, found.checksum,
             found.records, heads[partition], refused, found.indexed_to))
        number = file_no
    else:
        number, partition = known.file_no, known.partition
        if known.changed:
            log.warning("LANDING topic=%s: %s is as indexed again (%s no more)",
                        folder.topic, path, known.changed)
        cur.execute(
            """UPDATE landing_files SET size = %s, mtime = %s, indexed_to = %s,
                      records = records + %s, changed = NULL,
                      checksum = coalesce(%s, checksum)
               WHERE topic = %s AND file_no = %s""",
            (size, mtime, found.indexed_to, found.records, found.checksum, folder.topic,
             number))
    base = heads[partition]
    for first, start, end, count, clean_to, crc in found.chunks:
        cur.execute(
            """INSERT INTO landing_chunks (topic, file_no, first_offset, byte_start,
                                           byte_end, records, clean_to, crc, landed_at)
               VALUES (%s, %s, %s, %s, %s, %s, %s, %s, to_timestamp(%s))""",
            (folder.topic, number, base + first, start, end, count, clean_to, crc, mtime))
    if found.records:
        heads[partition] = base + found.records
        cur.execute("UPDATE source_partitions SET next_offset = %s "
                    "WHERE topic = %s AND partition = %s",
                    (heads[partition], folder.topic, partition))
    return file_no


def _reads_as(arrow_type, declared: str) -> bool:
    """Whether Spark's Parquet reader reads a column of ``arrow_type`` as the declared Spark
    type, each value as it is (a narrower integer or float widened, a decimal of the same
    scale and no more digits); a type Spark would refuse, or convert to other values (an
    integer read as a date, a wider integer cut), is not. Nested types are left to Spark."""
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
