"""The landing folder as a Source (LandingFolder): its declaration, checked, and what the
transactions ask of it; its indexing is onceflow.sources.landing.index, its reads
onceflow.sources.landing.read (see onceflow.sources.landing).

Those modules import pyarrow at their top; this one does not import them at its own: a DAG
parse (in every task process, issue 52) declares the folder and needs neither, so the methods
that list, index or read the folder import them where they run."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import ClassVar

from onceflow.core.errors import ConfigError
from onceflow.core.planner import PartitionRange
from onceflow.core.source import Position, Source, require_topic
from onceflow.sources import catalog
from onceflow.sources.json_records import JsonRecords
from onceflow.sources.landing.files import SET_ASIDE_FIX

FORMATS = ("jsonl", "csv", "parquet")


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
        require_topic(self.topic, "name the landing folder's topic (how pipelines and the "
                      "manifest know it)")
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

    def index(self, cur, enough=None) -> int:
        """Index what landed since the last look; returns how many files were looked at
        (see onceflow.sources.landing.index.index)."""
        from onceflow.sources.landing import index  # pyarrow at its top: not for a DAG parse

        return index.index(self, cur, enough)

    def ensure(self, conn, *, create: bool = False) -> None:
        from onceflow.sources.landing import index  # pyarrow at its top: not for a DAG parse

        index.list_files(self)  # the folder must exist
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
        from onceflow.sources.landing import index  # pyarrow at its top: not for a DAG parse

        _, listing = index.list_files(self)
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

    def may_refuse(self, cur, ranges: Iterable[PartitionRange]) -> bool:
        """True when a chunk of ``ranges`` was not found clean up to today's
        max_record_bytes when its file was indexed (see scan_text; Parquet: always,
        a typed one only when it has a float column)."""
        ranges = [r for r in ranges if r.size > 0]
        if self.format == "parquet":  # typed: only a float column's NaN or infinity
            return self.records is None or bool(self.records.float_columns)
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
        from onceflow.sources.landing import read  # pyarrow at its top: not for a DAG parse

        return read.read(self, spark, dsn, ranges)

    def payloads(self, conn, ranges: Iterable[PartitionRange]
                 ) -> Iterator[tuple[int, int, str]]:
        from onceflow.sources.landing import read  # pyarrow at its top: not for a DAG parse

        return read.payloads(self, conn, ranges)

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
