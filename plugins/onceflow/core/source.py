"""The Source interface: all the engine asks of a source.

A source is a partitioned, offset-addressed, replayable log (Storm's opaque partitioned
spout, Spark's ``Source``). The planner, the partition offsets, the commit and verify work on
``(partition, [start, end))`` ranges only; what a source is made of stays behind this class:

- ``positions(cur)``: per partition ``(log_start, head)``. Offsets below ``head`` are final:
  nothing can appear below it later (a PostgreSQL log hands out offsets under a lock; a table
  source chooses a bound no open writer can fall under). Below ``log_start`` retention deleted.
- ``read(spark, dsn, ranges)``: the records of the ranges as a DataFrame with columns
  ``partition``, ``offset`` and the source's record columns (``record_ddl``: ``payload``, or
  a decoded source's columns and ``_corrupt_record``, with ``_problem``, see ``read_ddl``).
  Repeatable: the same ranges give the same records, so a replay of a txid reads exactly its
  batch. A range that cannot be read whole raises SourceShortfall; nothing is silently short.
- ``payloads(conn, ranges)``: the same records in Python, ``(partition, offset, payload)``
  (the verify oracle and retention use it).
- ``positions_until(cur, enough)``: positions, looking only as far as a begin needs
  (optional: by default, positions);
- ``planning()``: a context a begin's looks at the source share (one client), optional;
- ``held_back(cur, starts)``: per partition, an offset from which a batch planned from
  ``starts`` may not read for now (records the source knows it would refuse: a landed file
  that changed), optional;
- ``first_at(cur, partition, when)``: where a ``timestamp:`` start policy starts.
- ``ensure(conn, create=)``: the source exists (``create``: make it, e.g. a topic's partitions).
- ``may_refuse(cur, ranges)``: whether the spout may refuse a record of the ranges (True
  unless the source knows better), optional;
- ``retain(cur, below)``: delete what lies below per-partition offsets (retention), optional;
  ``append(conn, payloads)``: add records, for logs onceflow itself keeps, optional.
- ``after_commit(conn, pipeline)``: told after each commit (e.g. to write the committed
  offsets to a Kafka consumer group), optional.

For keeping up (onceflow.core.keepup, docs/keep-up.md), all with defaults:

- ``heads(cur)``: the positions as known now, cheaply: no indexing of files, no waiting for
  writers (the source watcher looks every few seconds);
- ``unindexed(cur)``: records the source holds that its heads do not count yet (a landing
  folder's new files), estimated, and when the oldest of them arrived;
- ``arrivals(cur, points)``: when the records at some ``(partition, offset)`` arrived. By
  default, when a head past the offset was first seen (``source_sightings``, written by the
  watcher and by begin for sources with ``arrival_by_sight``).

Adding a source is one new module implementing this class; no engine module changes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, ClassVar

from onceflow.core.errors import ConfigError
from onceflow.core.planner import PartitionRange

# The column in which a reader says why the spout refuses a record (too large, NUL).
PROBLEM = "_problem"
# A decoding source's column for a line that does not decode (Spark's PERMISSIVE name).
CORRUPT = "_corrupt_record"

if TYPE_CHECKING:  # pyspark is imported only where a batch is read
    from pyspark.sql import DataFrame, SparkSession

RECORD_KEYS = "partition int, offset long"
MAX_RECORD_BYTES = 64 * 1024


@dataclass(frozen=True)
class Position:
    log_start: int  # the first offset still held (retention deleted below it)
    head: int  # one past the last final offset

    @property
    def available(self) -> int:
        return self.head - self.log_start


def require_topic(topic, fix: str = "name the topic") -> None:
    """A source's ``topic``: a non-empty name, or ConfigError ending in ``fix``."""
    if not isinstance(topic, str) or not topic:
        raise ConfigError(f"source.topic={topic!r} is invalid: {fix}")


def require_partitions(partitions) -> None:
    """A source's ``partitions``: a positive whole number, or ConfigError."""
    if not isinstance(partitions, int) or partitions <= 0:
        raise ConfigError(f"source.partitions={partitions!r} is invalid: give a positive "
                          "number of partitions")


@dataclass(frozen=True, kw_only=True)
class Source(ABC):
    """A partitioned, offset-addressed, replayable source (see the module docstring).

    Every source has a ``topic`` (a field or a property): the name the coordinator stores for
    it, so that a pipeline never silently switches to another source.
    """

    kind: ClassVar[str]
    # What a txid's planned count (transactions.records, batch_size) counts: its records,
    # or "offsets" for a log whose offsets may hold no record (Kafka's transaction markers
    # and compacted records), where the records read are fewer.
    planned_counts: ClassVar[str] = "records"
    # A decoded source's JsonRecords (None: its records are payload strings)
    records: ClassVar = None
    topic: str

    max_record_bytes: int = MAX_RECORD_BYTES

    def validate(self) -> None:
        if not isinstance(self.max_record_bytes, int) or self.max_record_bytes <= 0:
            raise ConfigError(f"source.max_record_bytes={self.max_record_bytes!r} is invalid: "
                              "give a positive number of bytes")

    @property
    def record_ddl(self) -> str:
        """The record's columns besides partition and offset, as Spark DDL."""
        return "payload string"

    @property
    def read_ddl(self) -> str:
        """What ``read`` returns, as Spark DDL: partition, offset, the record's columns and,
        for a decoded source, ``_problem`` (why the spout refuses a record, else null; a
        payload source's problems are found from its payload)."""
        problem = f", {PROBLEM} string" if self.records is not None else ""
        return f"{RECORD_KEYS}, {self.record_ddl}{problem}"

    @abstractmethod
    def ensure(self, conn, *, create: bool = False) -> None:
        """Check the source exists; ``create``: make it if it does not."""

    @abstractmethod
    def positions(self, cur) -> dict[int, Position]:
        """``partition -> Position`` for every partition, in one query where possible."""

    def positions_until(self, cur, enough: Callable[[dict[int, Position]], bool]
                        ) -> dict[int, Position]:
        """``positions(cur)``, where a source whose look for new records is costly may stop
        looking once ``enough(positions)`` holds (what a begin needs to plan its batch);
        the rest is found by a later look. This default looks at everything."""
        return self.positions(cur)

    def planning(self) -> AbstractContextManager:
        """Open while a begin looks at the source (positions, start policies): a source whose
        looks each cost a connection (a Kafka broker's) keeps one for the whole begin. This
        default: nothing."""
        return nullcontext()

    def watching(self) -> AbstractContextManager:
        """Open for a source watcher's life, its looks inside it: a source whose looks each
        cost a connection (a Kafka broker's) keeps one from look to look. This default:
        nothing."""
        return nullcontext()

    def held_back(self, cur, starts: Mapping[int, int]) -> dict[int, int]:
        """Per partition, an offset at or after its start in ``starts`` from which a batch
        may not read for now: records the source knows it would refuse (a landed file that
        changed, until `onceflow repair` accepts or skips it). A batch is planned up to
        there, so the pipeline waits instead of failing batch after batch. Partitions left
        out are read up to their heads (this default: all)."""
        return {}

    def first_at(self, cur, partition: int, when: datetime, position: Position) -> int:
        raise ConfigError(f"start_policy='timestamp:...' is not supported by a {self.kind} "
                          "source: use earliest or latest")

    @abstractmethod
    def read(self, spark: SparkSession, dsn: str, ranges: Iterable[PartitionRange]
             ) -> DataFrame:
        """The records of ``ranges`` (partition, offset, record columns)."""

    @abstractmethod
    def payloads(self, conn, ranges: Iterable[PartitionRange]
                 ) -> Iterator[tuple[int, int, str]]:
        """``(partition, offset, payload)`` of every record in ``ranges``, in Python, inside
        the caller's transaction on ``conn`` (never committed here)."""

    def payloads_at(self, cur, positions: Iterable[tuple[int, int]]
                    ) -> dict[tuple[int, int], str]:
        """The payloads at some (partition, offset) positions: the batch's failed records,
        for the backflow. Few: this default reads them one offset at a time."""
        ranges = [PartitionRange(p, o, o + 1) for p, o in sorted(set(positions))]
        return {(p, o): payload for p, o, payload in self.payloads(cur.connection, ranges)}

    def replay_columns(self, rows: Sequence[tuple[int, int, str, int]]) -> dict:
        """The record columns (Arrow arrays by name, as ``read`` gives them besides
        partition and offset) of replayed backflow items ``(partition, offset, payload,
        replays)``: the payload, or its decoded columns and ``_problem``. A source whose
        records carry more than their payload adds those columns."""
        import pyarrow as pa  # the Spark side calls this; a DAG parse imports this module

        payloads = [r[2] for r in rows]
        if self.records is None:
            return {"payload": pa.array(payloads, pa.string())}
        body, problems = self.records.decode([p.encode("utf-8") for p in payloads],
                                             self.max_record_bytes)
        body[PROBLEM] = problems
        return body

    def whole_units(self, cur, points: Iterable[tuple[int, int]]
                    ) -> dict[int, tuple[int, int]]:
        """For a source that reads its records in units it cannot cut (a Parquet row group
        is decoded whole), the unit ``[lo, hi)`` around each ``(partition, offset)`` point
        that falls inside one (lo < offset < hi): the planner then ends a batch at a unit's
        edge (onceflow.core.planner.align_to_units). This default: none (a record costs the
        same wherever a batch ends)."""
        return {}

    def may_refuse(self, cur, ranges: Iterable[PartitionRange]) -> bool:
        """Whether a record of ``ranges`` may be one the spout refuses (over
        ``max_record_bytes``, or holding a NUL byte). True unless the source knows better:
        then the batch is not searched for them (a landing folder learns it as it indexes a
        file). A wrong False is caught, not lost: the batch fails naming the record."""
        return True

    # -- keeping up --------------------------------------------------------------------------
    # Whether a record's arrival is when a head past it was first seen (the source keeps no
    # time per record): then the watcher and begin record the heads they see.
    arrival_by_sight: ClassVar[bool] = True

    def heads(self, cur) -> dict[int, Position]:
        """``positions(cur)`` as known now, without work a begin does (indexing, waiting for
        writers). This default is positions."""
        return self.positions(cur)

    def unindexed(self, cur) -> tuple[int, datetime | None]:
        """(about how many records, when the oldest arrived) the source holds that its heads
        do not count yet; (0, None) for a source whose heads count everything (this
        default)."""
        return 0, None

    def arrivals(self, cur, points: Iterable[tuple[int, int]]
                 ) -> dict[tuple[int, int], datetime]:
        """When the records at ``points`` ``(partition, offset)`` arrived, where known. This
        default: when a head past the offset was first seen (see ``record_sightings``)."""
        return sighted_arrivals(cur, self.topic, points)

    def retain(self, cur, below: Mapping[int, int]) -> int:
        raise ConfigError(f"retention is not supported by a {self.kind} source "
                          f"(topic {self.topic!r})")

    def append(self, conn, payloads: Iterable[str]) -> int:
        raise ConfigError(f"a {self.kind} source (topic {self.topic!r}) is not written by "
                          "onceflow: add records where the source lives")

    def after_commit(self, conn, pipeline: str) -> None:
        """Called after each commit of ``pipeline`` (a commit found already done included),
        outside its transaction, on ``conn``: a source that mirrors what is committed into a
        system of its own (a Kafka consumer group's offsets) does it here, from what
        PostgreSQL holds then, so a crash before it is made good by the next one. This
        default: nothing."""
        return

    def describe(self) -> str:
        return f"{self.kind} source {self.topic!r}"

    @property
    def identity(self) -> str:
        """Where the topic lives, stored with the pipeline (pipelines.source): the source's
        kind, and whatever else tells two topics of one name apart (a Kafka cluster)."""
        return self.kind


def record_sightings(cur, topic: str, heads: Mapping[int, int]) -> None:
    """Record that ``heads`` (partition -> head) were seen now, where a head is new: the
    arrival of a source that keeps no time per record. One statement."""
    if not heads:
        return
    cur.execute(
        """INSERT INTO source_sightings (topic, partition, head, seen_at)
           SELECT %(topic)s, n.p, n.h, clock_timestamp()
           FROM unnest(%(parts)s::int[], %(heads)s::bigint[]) AS n (p, h)
           WHERE n.h > 0 AND NOT EXISTS (
               SELECT 1 FROM source_sightings s WHERE s.topic = %(topic)s
                 AND s.partition = n.p AND s.head >= n.h)
           ON CONFLICT DO NOTHING""",
        {"topic": topic, "parts": list(heads), "heads": list(heads.values())})


def sighted_arrivals(cur, topic: str, points: Iterable[tuple[int, int]]
                     ) -> dict[tuple[int, int], datetime]:
    """Per ``(partition, offset)``, when a head past the offset was first seen."""
    points = sorted(set(points))
    if not points:
        return {}
    cur.execute(
        """SELECT w.p, w.o, (SELECT s.seen_at FROM source_sightings s
                             WHERE s.topic = %s AND s.partition = w.p AND s.head > w.o
                             ORDER BY s.head LIMIT 1)
           FROM unnest(%s::int[], %s::bigint[]) AS w (p, o)""",
        (topic, [p for p, _ in points], [o for _, o in points]))
    return {(p, o): at for p, o, at in cur.fetchall() if at is not None}


def forget_sightings(cur, topic: str, below: Mapping[int, int]) -> None:
    """Sightings of heads at or below ``below`` (partition -> offset; every pipeline on the
    topic committed past it) tell the arrival of no record still to commit."""
    if below:
        cur.execute(
            """DELETE FROM source_sightings s USING unnest(%s::int[], %s::bigint[]) AS b (p, o)
               WHERE s.topic = %s AND s.partition = b.p AND s.head <= b.o""",
            (list(below), list(below.values()), topic))
