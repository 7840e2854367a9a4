"""Landed files that changed after they were indexed: what `onceflow repair` finds, and its two
ways on (onceflow.ops.repair calls this for a landing-folder pipeline).

**Found.** A look at the folder marks a file that shrank below what was indexed, or whose last
indexed chunk changed (``landing_files.changed``); a read that finds a chunk's bytes changed
fails its batch. Repair re-reads, against their CRC-32s, every chunk of the files so marked and
of the files that stuck transactions (failed, superseded, abandoned) of the topic's pipelines
planned to read, and reports each changed file: what changed, its first changed chunk (bytes,
offsets) and who has read or planned it.

**Accept** (``--accept-changed FILE``): the file as it is now is the truth from its first
changed chunk on. Allowed only when no pipeline has planned that chunk (so nothing read or
about to be read changes): its chunks from there are left void (their offsets hold no record)
and the file is indexed again from that chunk's first byte, its records at the next offsets
of its partition, as a grown file's are.

**Skip** (``--skip-changed FILE``): the file's records from its first changed chunk on that
some pipeline has not committed are skipped: those chunks are left void, each pipeline that had
not committed them gets the skipped offsets recorded as a gap (``offset_gaps``, as retention
--force records), and the file is not followed any more (``landing_files.skipped``). A stuck
transaction that planned them then reads none of them and commits.

Either runs in one PostgreSQL transaction holding the rows of every pipeline of the topic and
the topic's partitions (as retention does), so no batch is planned or committed meanwhile; a
crash anywhere leaves nothing done, and a second repair finds the file repaired (or skipped)
and does nothing.

pyarrow is imported here at the top (the files are read again): onceflow.ops.repair imports
this module only when a repair runs, so the CLI and a DAG parse load no pyarrow.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pyarrow.parquet as pq
from pyarrow import fs

from onceflow.core import offsets, txlog
from onceflow.core.errors import ConfigError
from onceflow.sources.landing import LandingFolder
from onceflow.sources.landing import index as indexing
from onceflow.sources.landing.files import Chunk
from onceflow.sources.landing.index import Look, Work
from onceflow.sources.landing.scan import crc_of, parquet_footer, row_group_bytes, scan_parquet
from onceflow.sources.landing.storage import open_filesystem

log = logging.getLogger(__name__)


@dataclass
class Reader:
    """A pipeline reading the topic, in one partition: where it has committed and planned to
    (None: nothing yet)."""

    name: str
    committed: int | None
    planned: int | None

    @property
    def resume(self) -> int | None:
        known = [x for x in (self.committed, self.planned) if x is not None]
        return max(known) if known else None


@dataclass
class ChangedFile:
    path: str
    file_no: int
    partition: int
    what: str  # what changed (the look's words, or the first changed chunk's)
    chunks: list[Chunk]  # its chunks holding records, in byte order
    first: int  # index in ``chunks`` of the first changed chunk (len(chunks): none changed)
    readers: list[Reader] = field(default_factory=list)
    parquet: bool = False

    @property
    def changed_chunks(self) -> list[Chunk]:
        return self.chunks[self.first:]

    def planned_by(self, chunk: Chunk) -> list[str]:
        return [r.name for r in self.readers
                if r.resume is not None and r.resume > chunk.first]

    def committed_by_all(self, chunk: Chunk) -> bool:
        return all(r.committed is not None and r.committed >= chunk.first + chunk.records
                   for r in self.readers)

    @property
    def to_accept(self) -> list[Chunk]:
        """The chunks --accept-changed leaves void: from the first changed one on (a Parquet
        file's: all, it is indexed again whole)."""
        return self.chunks if self.parquet else self.changed_chunks

    def accept_refusal(self) -> str | None:
        """Why --accept-changed cannot be done (None: it can)."""
        if not self.to_accept:
            return None
        chunk = self.to_accept[0]
        planned = self.planned_by(chunk)
        if planned:
            return (f"pipeline(s) {', '.join(planned)} planned or read its offsets "
                    f"[{chunk.first}, {chunk.first + chunk.records}) already: records a batch "
                    "holds never change")
        return None

    def to_skip(self) -> list[Chunk]:
        """The chunks --skip-changed leaves void: from the first changed one on, but those
        every pipeline has committed."""
        return [c for c in self.changed_chunks if not self.committed_by_all(c)]

    def gaps(self) -> dict[str, list[tuple[int, int]]]:
        """Per pipeline, the offsets --skip-changed records as its gaps: those of the skipped
        chunks it has not committed (a chunk is skipped whole, but what a pipeline
        committed of it stays committed)."""
        out = {}
        for reader in self.readers:
            spans = [(max(lo, reader.committed or 0), hi) for lo, hi in _spans(self.to_skip())]
            out[reader.name] = [(lo, hi) for lo, hi in spans if lo < hi]
        return out

    def skipped_records(self) -> int:
        """How many of the skipped chunks' records some pipeline has not committed: what
        --skip-changed announces and skips (each pipeline's gaps hold its part of them)."""
        lows = [reader.committed or 0 for reader in self.readers] or [0]
        return sum(max(0, hi - max(lo, min(lows))) for lo, hi in _spans(self.to_skip()))

    def describe(self) -> str:
        return f"landed file {self.path} (partition {self.partition}) changed: {self.what}"

    @property
    def restart(self) -> int:
        """The byte --accept-changed indexes the file again from (0: its start, header
        included)."""
        if self.first == 0 or self.parquet:
            return 0
        if self.first < len(self.chunks):
            return self.chunks[self.first].start
        return self.chunks[-1].end

    def choices(self) -> list[str]:
        out = []
        refusal = self.accept_refusal()
        gone = self.to_accept
        void = (f"its {sum(c.records for c in gone)} record(s) from offset {gone[0].first} on "
                "are left void; " if gone else "")
        out.append(f"--accept-changed {self.path}: " + (
            f"not possible: {refusal}" if refusal else
            f"index it again as it is now from byte {self.restart} ({void}its lines from "
            "there get new offsets)"))
        gaps = "; ".join(f"{name} {', '.join(f'[{lo}, {hi})' for lo, hi in spans)}"
                         for name, spans in self.gaps().items() if spans)
        out.append(f"--skip-changed {self.path}: skip {self.skipped_records()} record(s) of it "
                   "no pipeline committed (recorded as gaps" + (f": {gaps}" if gaps else "")
                   + ") and stop following it")
        return out


def _readers(cur, topic: str, partitions: set[int]) -> dict[int, list[Reader]]:
    cur.execute("SELECT name, reset_after_txid FROM pipelines WHERE topic = %s ORDER BY name",
                (topic,))
    out: dict[int, list[Reader]] = {p: [] for p in partitions}
    for name, reset in cur.fetchall():
        done = offsets.committed(cur, name)
        planned = txlog.planned_ends(cur, name, reset, None)
        for p in partitions:
            out[p].append(Reader(name, done.get(p), planned.get(p)))
    return out


def _check(source: LandingFolder, chunks: list[Chunk], known_legacy: bool) -> tuple[int, str]:
    """(index of the first chunk whose bytes are not those indexed, what is wrong with it);
    ``len(chunks)`` when all are as indexed. A chunk indexed before chunk checksums counts as
    changed when its file is marked changed (``known_legacy``)."""
    if not chunks:
        return 0, ""
    filesystem, _ = open_filesystem(source.path)
    try:
        f = filesystem.open_input_file(chunks[0].path)
    except FileNotFoundError:
        return 0, "it was removed"
    with f:
        size = f.size()
        meta = None
        if source.format == "parquet" and chunks[0].crc is not None:
            footer, _ = parquet_footer(f)
            if f"{footer:08x}" != chunks[0].checksum:
                return 0, "its footer (metadata) is not the one indexed"
            meta = pq.ParquetFile(f).metadata
        for i, chunk in enumerate(chunks):
            if chunk.crc is None:
                if known_legacy:
                    return i, ("it changed, and was indexed before chunk checksums: "
                               "every chunk counts as changed")
                continue
            if meta is not None:
                if chunk.start >= meta.num_row_groups:
                    return i, f"its row group {chunk.start} is gone"
                crc, _ = crc_of(f, *row_group_bytes(meta, chunk.start))
            else:
                if size < chunk.end:
                    return i, (f"it is {size} bytes long, and chunk {i + 1} of {len(chunks)} "
                               f"(bytes [{chunk.start}, {chunk.end}), offsets "
                               f"[{chunk.first}, {chunk.first + chunk.records})) ended at "
                               f"byte {chunk.end}")
                crc, _ = crc_of(f, chunk.start, chunk.end)
            if crc != chunk.crc:
                return i, (f"the bytes of chunk {i + 1} of {len(chunks)} differ (bytes "
                           f"[{chunk.start}, {chunk.end}), offsets [{chunk.first}, "
                           f"{chunk.first + chunk.records}))")
    return len(chunks), ""


def inspect(cur, source: LandingFolder) -> list[ChangedFile]:
    """The topic's changed files (see the module docstring); looks at the folder first."""
    source.positions(cur)  # a look: marks the files found changed since the last one
    cur.execute(
        """SELECT f.file_no FROM landing_files f
           WHERE f.topic = %(topic)s AND f.skipped IS NULL AND f.changed IS NOT NULL
           UNION
           SELECT c.file_no FROM landing_chunks c
           JOIN landing_files f USING (topic, file_no)
           JOIN batch_ranges br ON br.topic = c.topic AND br.partition = f.partition
                AND c.first_offset < br.end_offset
                AND c.first_offset + c.records > br.start_offset
           JOIN transactions t ON t.pipeline = br.pipeline AND t.txid = br.txid
           WHERE c.topic = %(topic)s AND c.void IS NULL AND f.skipped IS NULL
             AND (t.state IN ('failed', 'superseded')
                  OR (t.state = 'planned'
                      AND t.heartbeat_at < now() - make_interval(secs => t.lease_s)))""",
        {"topic": source.topic})
    numbers = sorted(n for (n,) in cur.fetchall())
    if not numbers:
        return []
    cur.execute(
        """SELECT f.file_no, f.partition, f.changed, f.path, f.size, f.mtime,
                  c.first_offset, c.byte_start, c.byte_end, c.records, f.partition, c.crc,
                  c.void, f.checksum
           FROM landing_files f LEFT JOIN landing_chunks c
                ON c.topic = f.topic AND c.file_no = f.file_no AND c.void IS NULL
           WHERE f.topic = %s AND f.file_no = ANY(%s)
           ORDER BY f.file_no, c.byte_start""", (source.topic, numbers))
    files: dict[int, tuple[int, str | None, str, list[Chunk]]] = {}
    for file_no, partition, changed, path, *chunk in cur.fetchall():
        held = files.setdefault(file_no, (partition, changed, path, []))[3]
        if chunk[2] is not None:  # (a file that holds no record has no chunk)
            held.append(Chunk(path, *chunk))
    readers = _readers(cur, source.topic, {f[0] for f in files.values()})
    found = []
    for file_no, (partition, changed, path, chunks) in files.items():
        first, what = _check(source, chunks, changed is not None)
        if first == len(chunks) and changed is None:
            continue  # as indexed (a stuck transaction failed for another reason)
        if first == len(chunks):
            what = f"{changed} (its indexed chunks are as indexed)"
        elif changed and changed not in what:
            what = f"{changed}; {what}"
        found.append(ChangedFile(path, file_no, partition, what, chunks, first,
                                 readers[partition], source.format == "parquet"))
    return found


def set_aside(cur, source: LandingFolder) -> list[str]:
    """The topic's files set aside at indexing (a Parquet file of another schema), each as
    ``path: why``: they hold no record, so there is nothing to repair."""
    cur.execute("SELECT path, refused FROM landing_files WHERE topic = %s "
                "AND refused IS NOT NULL ORDER BY file_no", (source.topic,))
    return [f"{path}: {why}" for path, why in cur.fetchall()]


def _pick(found: list[ChangedFile], wanted: str) -> ChangedFile:
    """The changed file named ``wanted`` (its path, or a name only one of them has)."""
    matches = [f for f in found if f.path == wanted] or \
        [f for f in found if f.path.rsplit("/", 1)[-1] == wanted]
    if len(matches) != 1:
        listed = ", ".join(f.path for f in found) or "none"
        raise ConfigError(f"{wanted!r} is not {'one' if not matches else 'exactly one'} of "
                          f"the changed landed files ({listed}): give a path that `onceflow "
                          "repair` lists")
    return matches[0]


def _void(cur, source: LandingFolder, change: ChangedFile, chunks: list[Chunk],
          why: str) -> None:
    cur.execute(
        """UPDATE landing_chunks SET void = %s
           WHERE topic = %s AND file_no = %s AND first_offset = ANY(%s) AND void IS NULL""",
        (why, source.topic, change.file_no, [c.first for c in chunks]))


def accept(cur, source: LandingFolder, change: ChangedFile) -> int:
    """--accept-changed (see the module docstring); returns how many records the file's new
    bytes hold. The caller holds the pipelines' and partitions' locks."""
    refusal = change.accept_refusal()
    if refusal:
        raise ConfigError(f"--accept-changed {change.path}: not possible: {refusal}. Restore "
                          f"the file's bytes, or --skip-changed {change.path}")
    gone = change.to_accept
    start = change.restart
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    _void(cur, source, change, gone, f"the file changed before these were read; indexed "
                                     f"again from byte {start} by onceflow repair at {when}")
    cur.execute(
        """UPDATE landing_files SET indexed_to = %s, records = records - %s,
                  base_offset = CASE WHEN %s THEN (SELECT next_offset FROM
                      source_partitions WHERE topic = %s AND partition = %s)
                      ELSE base_offset END
           WHERE topic = %s AND file_no = %s""",
        (start, sum(c.records for c in gone), source.format == "parquet", source.topic,
         change.partition, source.topic, change.file_no))
    # Index it again from there as a look would a grown file (the partitions' locks held).
    cur.execute(
        """SELECT partition, next_offset FROM source_partitions WHERE topic = %s
           ORDER BY partition FOR UPDATE""", (source.topic,))
    heads = dict(cur.fetchall())
    known = indexing.known_files(source, cur, [change.path])[change.path]
    filesystem, _ = open_filesystem(source.path)
    info = filesystem.get_file_info(change.path)
    if info.type != fs.FileType.File:
        raise ConfigError(f"--accept-changed {change.path}: the file is gone; --skip-changed "
                          "it instead")
    size, mtime = info.size, info.mtime.timestamp() if info.mtime else 0.0
    # (its chunks before ``start`` were just checked: the look reads on from there)
    known = known._replace(size=-1, changed=None, last=None, legacy=False)
    if source.format == "parquet":
        kind, scan = "grown", scan_parquet(filesystem, change.path)
    else:
        kind, scan, _ = indexing.look(source, filesystem, Work(change.path, size, mtime, known))
    if kind != "grown":  # (it changed again meanwhile)
        raise ConfigError(f"--accept-changed {change.path}: it changed again while being "
                          f"indexed ({scan}); run repair again")
    indexing.record(source, cur, Work(change.path, size, mtime, known), Look("grown", scan), 0,
                    heads)
    log.warning("REPAIR topic=%s: %s accepted as it is now: %d record(s) of it were left "
                "void and %d indexed again", source.topic, change.path,
                sum(c.records for c in gone), scan.records)
    return scan.records


def skip(cur, source: LandingFolder, change: ChangedFile) -> int:
    """--skip-changed (see the module docstring); returns how many records are skipped.
    The caller holds the pipelines' and partitions' locks."""
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    gone = change.to_skip()
    _void(cur, source, change, gone, f"skipped by onceflow repair at {when}: the file changed "
                                     "before these were read")
    cur.execute(
        """UPDATE landing_files SET skipped = %s, changed = NULL, records = records - %s
           WHERE topic = %s AND file_no = %s""",
        (f"{change.what}; skipped by onceflow repair at {when}", sum(c.records for c in gone),
         source.topic, change.file_no))
    policy = f"repair --skip-changed {change.path}"
    for name, spans in change.gaps().items():
        last = txlog.last_committed(cur, name)
        for lo, hi in spans:
            offsets.record_gap(cur, name, source.topic, change.partition, lo, hi, last, policy)
    skipped = change.skipped_records()
    log.warning("REPAIR topic=%s: %s skipped: %d record(s) of it no pipeline committed",
                source.topic, change.path, skipped)
    return skipped


def _spans(chunks: list[Chunk]) -> list[tuple[int, int]]:
    """The chunks' offsets as [from, to) ranges, those that touch merged."""
    out: list[tuple[int, int]] = []
    for c in sorted(chunks, key=lambda c: c.first):
        if out and out[-1][1] == c.first:
            out[-1] = (out[-1][0], c.first + c.records)
        else:
            out.append((c.first, c.first + c.records))
    return out

