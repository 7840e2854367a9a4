"""A user's own PostgreSQL table as the source: not a copy, the table itself, read in ranges of
an increasing integer key fed by a sequence (an identity or serial column).

    TableSource(topic="orders", table="public.orders", key="id")        # the coordinator's DB
    TableSource(topic="orders", table="shop.orders", key="id", conn_id="shop_pg")  # another

**Offsets are key values.** One partition (0); a range ``[start, end)`` reads the rows with
``start <= key < end``. Keys need not be dense (rolled-back inserts, INCREMENT > 1 leave
holes), so ``batch_size`` counts key values, not rows, and a batch may hold fewer rows. Each
record's payload is the row as JSON (``row_to_json``: column names as keys, numbers as
numbers, timestamps as ISO text); a topology parses it with ``from_json``, or the source
decodes it as it reads it (``json_schema``, e.g. ``"url string, amount double"``: the records
then carry these columns and ``_corrupt_record``; a value that breaks its declared type, a
text column declared int, makes the record corrupt). With ``json_schema`` a record is the
declared columns of the row: its payload is the JSON object of those the table has (one it
lacks is absent, so null), wherever it is read (a batch, ``payloads``, ``payloads_at`` for
the backflow, verify), and ``max_record_bytes`` and ``_corrupt_record`` apply to it. One
partition is enough: a range is read by several Spark tasks at once (``read_chunk`` key
values each), so splitting keys over partitions by ``key % N`` would add heads to keep and
nothing to speed.

**The direct read.** When every declared column the table has is of a type whose COPY text
Arrow parses to exactly what the decoder makes of its JSON (``DIRECT``: text, varchar or
char declared string; an integer declared an integer at least as wide; boolean; real
declared float or double; double precision or numeric declared double), a batch copies the
values themselves and builds no JSON, except for the rows the decoder must judge: a NaN or
an infinity (JSON strings, so corrupt), a numeric past a double's range or tiny, and a row
whose payload may be over ``max_record_bytes`` by a cheap upper bound. Those carry their
payload and are decoded; the others are yielded as read. Any other declared column (a
timestamp declared string, json, a narrower integer) keeps the whole source on decoding
every payload (``TableSource.direct`` says which).

**The head: a bound no late commit can fall under.** Writers commit out of order: a row with
a smaller key can become visible after one with a larger key, so ``max(key) + 1`` is not a
safe head. onceflow relies on how PostgreSQL hands out sequence values: ``nextval`` takes a
lock on the sequence (RowExclusiveLock) that its transaction holds until it ends, before it
hands out the value, and values come in increasing order (CACHE 1). So to choose a bound:

1. read the sequence's position ``P`` (every key handed out so far is below ``P``);
2. then list the transactions holding the sequence's lock (pg_locks, by virtual transaction
   id, which every transaction has from its start: xid or not);
3. ``P`` becomes the head once every one of them has ended: a key below ``P`` belongs to a
   transaction that had the lock before step 1, so it is in that list or already over, and
   when the list has drained every such row is committed (visible) or rolled back (never).

``positions`` does this without blocking: it waits up to ``wait_s`` for the list to drain;
if it does not, the candidate is kept (``table_source_bounds``) and confirmed by a later call
(the next begin or commit) once its transactions ended, and the head stays where it was.

Worked example. Keys 1-100 are committed and an earlier look confirmed the head 101. Writer
A begins, draws 101 (``SELECT nextval``: no xid yet, nextval assigns one only when it writes
WAL, once every 32 values) and has not inserted yet; writer B inserts 102 and 103 and commits.
A begin now reads ``P = 104`` and finds A holding the sequence: ``[101, 104)`` may not be
planned, the head stays 101 (txid 1 reads ``[1, 101)``), the candidate 104 waits for A. A
inserts 101 and commits; the next begin (or commit) finds A gone and confirms 104: txid 2
reads ``[101, 104)``, 101 included. Had A rolled back, the same range reads 102 and 103. A
bound from ``pg_current_snapshot()`` (its xmin, the in-progress xids) would have counted 104
safe at once: A had no xid, so it was in no snapshot, and 101 would have been skipped.

**Refused, loudly (ConfigError naming the table, the column and the fix):** a table that does
not exist or cannot be read, a view; a key column that is missing, not an integer (a
timestamp or uuid has no order that a commit respects), or not fed by a sequence (a column
DEFAULT nextval(...) or an identity: onceflow cannot bound keys a writer chooses itself); a
sequence with CACHE > 1 (each session takes a block of keys ahead and hands them out later,
in later transactions: keys appear far out of order, no bound is safe: ALTER SEQUENCE ...
CACHE 1), descending, CYCLE, or able to go below 0 (offsets are non-negative), or keys at
2^40 and above (the acker's record ids hold offsets below 2^40); a sequence set back below
the head (setval, RESTART: keys already passed would be handed out again); a topic that was
bound to another table or column.

**The rules a writer keeps (onceflow cannot check them cheaply):** rows are append-only for
onceflow (a row updated after it was read is not read again; one deleted is missing from a
re-read, ``verify`` then reports it); keys come from the sequence, drawn in the transaction
that inserts the row (a column default or identity does that; ``GENERATED ALWAYS`` forbids
anything else); no replication or bulk load writes keys the sequence did not hand out; the
source reads the primary (a standby is refused: writers' locks are not there). A
long transaction that used the sequence holds the head back (``status`` shows the lag, the
log names its pid): set ``idle_in_transaction_session_timeout``.

Reading needs no JDBC driver: as for the PostgreSQL log (sources/pglog.py), the ranges are
cut into chunks of ``read_chunk`` key values spread over the Spark tasks; a task streams each
chunk with ``COPY (SELECT ... row_to_json(t) ...) TO STDOUT`` and parses it with Arrow
(``mapInArrow``). The same code runs in local mode, on a cluster and through Spark Connect,
whose sessions cannot load a JDBC driver that was not on their classpath when they started,
and the payload is PostgreSQL's ``row_to_json`` wherever it is read (a batch, ``payloads_at``
for the backflow, verify; with ``json_schema`` the reader task decodes it, or reads the
columns directly, and the backflow and verify decode the same payloads by the same rules).
Spark's JDBC reader reads more rows per second, but building the JSON in PostgreSQL costs
most of either (the figures: docs/design.md); the direct read builds none.
"""

from __future__ import annotations

import io
import logging
import re
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import ClassVar

import psycopg2
from psycopg2 import sql

from onceflow.core import timings
from onceflow.core.connections import resolve_dsn
from onceflow.core.db import connection, transaction
from onceflow.core.errors import ConfigError
from onceflow.core.planner import PartitionRange
from onceflow.core.source import PROBLEM, Position
from onceflow.sources.json_records import CORRUPT, JsonRecords, JsonSchemaSource, arrow_type
from onceflow.sources.pglog import chunk_ranges, copied_batches, copy_records

log = logging.getLogger(__name__)

CHUNK_SCHEMA = "chunk int, copy string"
MAX_OFFSET = 1 << 40  # spark_tasks/ids.py: record ids hold offsets below 2^40
INTEGER_TYPES = ("smallint", "integer", "bigint")
TIME_TYPES = ("timestamp without time zone", "timestamp with time zone", "date")
_NAME = r'(?:[A-Za-z_][A-Za-z0-9_$]*|"(?:[^"]|"")+")'
_TABLE = re.compile(rf"^{_NAME}(?:\.{_NAME})?$")
_STUCK_S = 60.0  # a candidate waiting longer than this is logged with what holds it
_STRINGS = frozenset({"text", "character varying", "character"})
# declared type -> the PostgreSQL types read directly into it (_direct_select): COPY writes
# the value with the same output function as to_json, so Arrow parses the text the decoder
# parses; an integer column only from types no wider than it
DIRECT = {
    "string": _STRINGS,
    "boolean": frozenset({"boolean"}),
    "smallint": frozenset({"smallint"}),
    "int": frozenset({"smallint", "integer"}),
    "bigint": frozenset({"smallint", "integer", "bigint"}),
    "float": frozenset({"real"}),
    "double": frozenset({"real", "double precision", "numeric"}),
}
# the most bytes to_json writes for a value of these types (a bigint's minimum, a double's
# shortest text that reads back the same), "null" included
_WIDTH = {"boolean": 5, "smallint": 6, "integer": 11, "bigint": 20, "real": 26,
          "double precision": 26}


@dataclass(frozen=True)
class _Table:
    """The checked table: what the queries need."""

    oid: int
    name: sql.Composable  # schema.table, quoted
    label: str  # schema.table, for messages and the bounds row
    key: sql.Composable
    sequence: str  # its regclass text
    start: int  # the sequence's START: it hands out no key below it
    time: sql.Composable | None
    # with json_schema: (declared name, declared type, the column's PostgreSQL type or None
    # when the table has no such column), in declaration order; None without json_schema
    fields: tuple[tuple[str, str, str | None], ...] | None = None

    @property
    def present(self) -> list[tuple[str, str, str]]:
        """The declared columns the table has: what a record's payload holds."""
        return [(n, k, t) for n, k, t in self.fields or () if t is not None]

    @property
    def direct(self) -> bool:
        """Whether a batch reads the declared columns' values themselves (see _direct_select):
        every declared column the table has is of a type whose COPY text Arrow parses to
        what the decoder makes of its JSON."""
        return self.fields is not None and all(
            pg_type in DIRECT.get(kind, ()) for _, kind, pg_type in self.present)


@dataclass(frozen=True, kw_only=True)
class TableSource(JsonSchemaSource):
    """A user's own PostgreSQL table, read by an increasing key (see the module docstring).

    ``table``: ``schema.table`` (or ``table``, found on the search path); ``key``: the key
    column (integer, fed by a sequence with CACHE 1); ``dsn`` or ``conn_id``: the table's
    database (neither: the coordinator's); ``read_chunk``: key values per Spark reader task;
    ``wait_s``: how long choosing a head waits for writers in flight before it keeps the
    candidate for a later look; ``time_column``: a timestamp column, for the start policy
    ``timestamp:<ISO>``; ``json_schema``: the row's columns to read, as Spark DDL of simple
    types (the records then carry these columns and ``_corrupt_record`` instead of
    ``payload``): a record's payload is then the JSON object of these columns, decoded as a
    batch reads it, or, when their types allow it exactly, read directly (see the module
    docstring).
    """

    kind: ClassVar[str] = "table"
    table: str
    key: str
    dsn: str | None = None
    conn_id: str | None = None
    read_chunk: int = 200_000
    wait_s: float = 1.0
    time_column: str | None = None

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.topic, str) or not self.topic:
            raise ConfigError(f"source.topic={self.topic!r} is invalid: name the topic (how "
                              "pipelines and the coordinator know this table)")
        if not isinstance(self.table, str) or not _TABLE.match(self.table):
            raise ConfigError(f"source.table={self.table!r} is invalid: give schema.table, "
                              "e.g. 'public.orders' (quote names with capitals: "
                              "'public.\"Orders\"')")
        for name, value in (("key", self.key), ("time_column", self.time_column or "-")):
            if not isinstance(value, str) or not value:
                raise ConfigError(f"source.{name}={value!r} is invalid: give a column name "
                                  f"of {self.table}")
        if self.dsn is not None and self.conn_id is not None:
            raise ConfigError(f"source dsn and conn_id are both set for {self.table}: give "
                              "one (or neither: the coordinator's database)")
        if not isinstance(self.read_chunk, int) or self.read_chunk <= 0:
            raise ConfigError(f"source.read_chunk={self.read_chunk!r} is invalid: give a "
                              "positive number of key values")
        if not isinstance(self.wait_s, int | float) or self.wait_s < 0:
            raise ConfigError(f"source.wait_s={self.wait_s!r} is invalid: give seconds >= 0")

    # -- where the table lives -------------------------------------------------------------
    def table_dsn(self, coordinator_dsn: str | None) -> str | None:
        if self.dsn:
            return self.dsn
        if self.conn_id:

            return resolve_dsn(self.conn_id, setting="source.conn_id")
        return coordinator_dsn

    @contextmanager
    def _table_cursor(self, cur):
        """A cursor on the table's database: ``cur`` itself (the coordinator's database), or
        a connection of its own, in autocommit (each statement sees what is committed)."""
        own = self.table_dsn(None)
        if own is None:
            yield cur
            return
        with connection(own, application_name="onceflow-table") as conn:
            conn.autocommit = True
            with conn.cursor() as tcur:
                yield tcur

    def _check(self, cur) -> _Table:
        """The table, its key and its sequence, checked (ConfigError naming the fix)."""
        where = f"source.table={self.table!r}"
        cur.execute(
            """SELECT c.oid, n.nspname, c.relname, c.relkind,
                      has_table_privilege(c.oid, 'SELECT')
               FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
               WHERE c.oid = to_regclass(%s)""", (self.table,))
        row = cur.fetchone()
        if row is None:
            raise ConfigError(f"{where}: no such table in database {cur.connection.info.dbname!r}"
                              ": check the name and the database (dsn / conn_id); onceflow "
                              "reads a user's table, it never creates one")
        oid, schema, name, relkind, readable = row
        cur.execute("SELECT pg_is_in_recovery()")
        if cur.fetchone()[0]:
            raise ConfigError(f"{where}: database {cur.connection.info.dbname!r} is a standby: "
                              "point dsn / conn_id at the primary, where writers draw keys "
                              "(their locks, which the head waits for, are not on a standby)")
        label = f"{schema}.{name}"
        if relkind not in ("r", "p"):
            raise ConfigError(f"{where} is a {'view' if relkind in 'vm' else 'relation'} "
                              f"({relkind}), not a table: point the source at the table whose "
                              "rows carry the key")
        if not readable:
            raise ConfigError(f"{where}: user {cur.connection.info.user!r} may not read "
                              f"{label}: GRANT SELECT ON {label} TO it")
        column = f"column {self.key!r} of {label}"
        cur.execute(
            """SELECT a.attnum, format_type(a.atttypid, NULL),
                      pg_get_serial_sequence(%s, a.attname)
               FROM pg_attribute a
               WHERE a.attrelid = %s AND a.attname = %s AND a.attnum > 0
                 AND NOT a.attisdropped""",
            (sql.Identifier(schema, name).as_string(cur), oid, self.key))
        row = cur.fetchone()
        if row is None:
            cur.execute("""SELECT string_agg(attname, ', ' ORDER BY attnum) FROM pg_attribute
                           WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped""", (oid,))
            raise ConfigError(f"source.key={self.key!r}: {label} has no such column (it has "
                              f"{cur.fetchone()[0]}): name its increasing key column")
        attnum, type_name, sequence = row
        if type_name not in INTEGER_TYPES:
            raise ConfigError(
                f"source.key={self.key!r}: {column} is {type_name}, not an integer: a table "
                "source reads by an integer key fed by a sequence, whose order commits can be "
                f"bounded. Add one: ALTER TABLE {label} ADD COLUMN onceflow_id bigint "
                "GENERATED ALWAYS AS IDENTITY, and set key='onceflow_id'")
        if sequence is None:  # a DEFAULT nextval('...') of a sequence the column does not own
            cur.execute(
                """SELECT d.refobjid::regclass::text FROM pg_attrdef ad
                   JOIN pg_depend d ON d.classid = 'pg_attrdef'::regclass AND d.objid = ad.oid
                    AND d.refclassid = 'pg_class'::regclass
                   JOIN pg_class s ON s.oid = d.refobjid AND s.relkind = 'S'
                   WHERE ad.adrelid = %s AND ad.adnum = %s""", (oid, attnum))
            found = [s for (s,) in cur.fetchall()]
            sequence = found[0] if len(found) == 1 else None
        if sequence is None:
            raise ConfigError(
                f"source.key={self.key!r}: {column} is not fed by a sequence, so its keys "
                "may not increase in the order they are handed out and no safe bound exists: "
                f"make it an identity (ALTER TABLE {label} ALTER COLUMN {self.key} ADD "
                "GENERATED ALWAYS AS IDENTITY) or give it DEFAULT nextval(a sequence with "
                "CACHE 1)")
        cur.execute(
            """SELECT seqincrement, seqcache, seqcycle, seqmin, seqstart,
                      has_sequence_privilege(seqrelid, 'SELECT')
               FROM pg_sequence WHERE seqrelid = %s::regclass""", (sequence,))
        increment, cache, cycle, minimum, start, seq_readable = cur.fetchone()
        fix = f"of sequence {sequence} feeding {column}"
        if cache > 1:
            raise ConfigError(
                f"source.key={self.key!r}: CACHE {cache} {fix}: each session takes {cache} "
                "keys ahead and hands them out later, in later transactions, so keys become "
                "visible far out of order and no bound is safe. Fix: ALTER SEQUENCE "
                f"{sequence} CACHE 1")
        if increment < 0 or cycle:
            raise ConfigError(
                f"source.key={self.key!r}: {column} does not increase (INCREMENT {increment}"
                f"{', CYCLE' if cycle else ''} {fix}): keys must only grow. Fix: ALTER "
                f"SEQUENCE {sequence} INCREMENT BY 1 NO CYCLE")
        if minimum < 0:
            raise ConfigError(
                f"source.key={self.key!r}: MINVALUE {minimum} {fix}: offsets are keys and "
                f"may not be negative. Fix: ALTER SEQUENCE {sequence} MINVALUE 0 (or more)")
        if not seq_readable:
            raise ConfigError(f"source.key={self.key!r}: user {cur.connection.info.user!r} "
                              f"may not read sequence {sequence}: GRANT SELECT ON SEQUENCE "
                              f"{sequence} TO it")
        time_column = None
        if self.time_column is not None:
            cur.execute("""SELECT format_type(atttypid, NULL) FROM pg_attribute
                           WHERE attrelid = %s AND attname = %s AND attnum > 0
                             AND NOT attisdropped""", (oid, self.time_column))
            row = cur.fetchone()
            if row is None or row[0] not in TIME_TYPES:
                raise ConfigError(
                    f"source.time_column={self.time_column!r}: {label} has no such "
                    f"{'column' if row is None else 'timestamp column (it is ' + row[0] + ')'}"
                    ": name a timestamp column, or leave it out")
            time_column = sql.Identifier(self.time_column)
        fields = None
        if self.records is not None:
            cur.execute("""SELECT attname, format_type(atttypid, NULL) FROM pg_attribute
                           WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped
                             AND attname = ANY(%s)""", (oid, self.records.names))
            types = dict(cur.fetchall())
            fields = tuple((n, k, types.get(n)) for n, k in self.records.columns)
        return _Table(oid, sql.Identifier(schema, name), label, sql.Identifier(self.key),
                      sequence, start, time_column, fields)

    # -- the head ----------------------------------------------------------------------------
    @staticmethod
    def _candidate(cur, table: _Table) -> tuple[int, list[str]]:
        """(P, holders): the sequence's position (every key handed out is below it), then the
        transactions holding the sequence's lock, listed after it (the order matters)."""
        cur.execute(sql.SQL("SELECT last_value, is_called FROM {}").format(
            sql.SQL(table.sequence)))
        last, called = cur.fetchone()
        position = last + 1 if called else last
        return position, _holders(cur, table.sequence, None)

    def _wait(self, cur, table: _Table, holders: list[str]) -> list[str]:
        """Wait up to wait_s for the writers in ``holders`` to end (a begin's lock wait)."""
        with timings.phase("lock_wait"):
            return self._wait_for(cur, table, holders)

    def _wait_for(self, cur, table: _Table, holders: list[str]) -> list[str]:
        deadline = time.monotonic() + self.wait_s
        while holders and time.monotonic() < deadline:
            time.sleep(0.02)
            holders = _holders(cur, table.sequence, holders)
        return holders

    def positions(self, cur) -> dict[int, Position]:
        with self._table_cursor(cur) as tcur:
            table = self._check(tcur)
            candidate, holders = self._candidate(tcur, table)
            holders = self._wait(tcur, table, holders)
            # A first head no key can still fall under: the sequence's START (it hands out
            # nothing below), or a lower key already there (rows loaded before the sequence).
            tcur.execute(sql.SQL("SELECT least({start}, min({key})) FROM {table}").format(
                start=sql.Literal(table.start), key=table.key, table=table.name))
            lowest = max(0, tcur.fetchone()[0])
            cur.execute(
                """INSERT INTO table_source_bounds (topic, relation, key_column, head)
                   VALUES (%s, %s, %s, %s) ON CONFLICT (topic) DO NOTHING""",
                (self.topic, table.label, self.key, lowest))
            cur.execute(
                """SELECT relation, key_column, head, pending_head, pending_on,
                          now() - pending_since
                   FROM table_source_bounds WHERE topic = %s FOR UPDATE""", (self.topic,))
            relation, key, head, pending, pending_on, age = cur.fetchone()
            if (relation, key) != (table.label, self.key):
                raise ConfigError(
                    f"source topic={self.topic!r} reads {table.label}.{self.key} but the topic "
                    f"is bound to {relation}.{key}: offsets of one table mean nothing in "
                    "another. Give the source a new topic (and the pipeline a new name)")
            if pending is not None and not _holders(tcur, table.sequence, pending_on):
                head, pending, pending_on = max(head, pending), None, None
            if candidate < head:
                raise ConfigError(
                    f"sequence {table.sequence} feeding {table.label}.{self.key} is at "
                    f"{candidate}, below {head}, where onceflow has read up to: it was set "
                    "back (setval, RESTART) and would hand out keys already passed. Set it "
                    f"forward: SELECT setval('{table.sequence}', {head})")
            if candidate > MAX_OFFSET:
                raise ConfigError(
                    f"{table.label}.{self.key} reached {candidate}: offsets (keys) must stay "
                    f"below 2^40 = {MAX_OFFSET} (the acker's record ids hold 40 bits of offset)")
            fresh = False
            if not holders:
                head, pending, pending_on = candidate, None, None
            elif pending is None:
                pending, pending_on, fresh = candidate, holders, True
            elif age is not None and age.total_seconds() > _STUCK_S:
                log.warning("TABLE topic=%s: the head is held at %d for %.0fs by %s",
                            self.topic, head, age.total_seconds(),
                            _describe_holders(tcur, table.sequence, pending_on))
            cur.execute(
                """UPDATE table_source_bounds
                   SET head = %(head)s, pending_head = %(pending)s, pending_on = %(on)s,
                       updated_at = now(),
                       pending_since = CASE WHEN %(pending)s::bigint IS NULL THEN NULL
                                            WHEN %(fresh)s THEN now() ELSE pending_since END
                   WHERE topic = %(topic)s""",
                {"head": head, "pending": pending, "on": pending_on, "fresh": fresh,
                 "topic": self.topic})
        # The log start: no key lies below it (keys below the head are final). Not the lowest
        # key: keys of rolled-back inserts leave holes, which are no gap.
        return {0: Position(min(lowest, head), head)}

    def heads(self, cur) -> dict[int, Position]:
        """The head as a begin would find it, without waiting and without writing: the
        sequence's position, unless a begin keeps a candidate for writers still running
        (then the head confirmed last)."""
        with self._table_cursor(cur) as tcur:
            table = self._check(tcur)
            candidate, holders = self._candidate(tcur, table)
            tcur.execute(sql.SQL("SELECT least({start}, min({key})) FROM {table}").format(
                start=sql.Literal(table.start), key=table.key, table=table.name))
            lowest = max(0, tcur.fetchone()[0])
            cur.execute("SELECT head, pending_head, pending_on FROM table_source_bounds "
                        "WHERE topic = %s", (self.topic,))
            row = cur.fetchone()
            head = row[0] if row else lowest
            if holders and row and row[1] is not None:
                # a begin keeps a candidate until the writers it waits for have ended
                if not _holders(tcur, table.sequence, row[2]):
                    head = max(head, row[1])
            else:
                # no writer, or none a begin knows of yet: a begin plans what is final of
                # this and keeps the rest as its candidate (a begin with writers that do not
                # end plans nothing once, then waits for them here)
                head = max(head, candidate)
        return {0: Position(min(lowest, head), head)}

    @property
    def arrival_by_sight(self) -> bool:
        return self.time_column is None

    def arrivals(self, cur, points) -> dict[tuple[int, int], datetime]:
        """With ``time_column``: the row's time at or after each key; else when a head past
        the key was first seen (the watcher's or a begin's look)."""
        if self.time_column is None:
            return super().arrivals(cur, points)
        keys = sorted({o for _, o in points})
        if not keys:
            return {}
        with self._table_cursor(cur) as tcur:
            table = self._check(tcur)
            tcur.execute(sql.SQL(
                """SELECT w.o, (SELECT t.{time}::timestamptz FROM {table} AS t
                                WHERE t.{key} >= w.o ORDER BY t.{key} LIMIT 1)
                   FROM unnest({keys}::bigint[]) AS w (o)""").format(
                time=table.time, table=table.name, key=table.key, keys=sql.Literal(keys)))
            found = {o: at for o, at in tcur.fetchall() if at is not None}
        return {(p, o): found[o] for p, o in points if o in found}

    def ensure(self, conn, *, create: bool = False) -> None:
        """Check the table, its key and its sequence; bind the topic to it and choose a first
        head. ``create`` creates nothing: the table is the user's."""

        with transaction(conn) as cur:
            self.positions(cur)
            with self._table_cursor(cur) as tcur:
                table = self._check(tcur)
                tcur.execute("""SELECT 1 FROM pg_index WHERE indrelid = %s AND indkey[0] =
                                (SELECT attnum FROM pg_attribute WHERE attrelid = %s
                                   AND attname = %s)""", (table.oid, table.oid, self.key))
                if tcur.fetchone() is None:
                    log.warning("TABLE topic=%s: no index on %s.%s leads with the key: every "
                                "batch and every head scans the whole table. CREATE INDEX ON "
                                "%s (%s)", self.topic, table.label, self.key, table.label,
                                self.key)

    def first_at(self, cur, partition: int, when: datetime, position: Position) -> int:
        if self.time_column is None:
            return super().first_at(cur, partition, when, position)
        with self._table_cursor(cur) as tcur:
            table = self._check(tcur)
            tcur.execute(sql.SQL(
                "SELECT min({key}) FROM {table} WHERE {time} >= {when} AND {key} < {head}").format(
                key=table.key, table=table.name, time=table.time, when=sql.Literal(when),
                head=sql.Literal(position.head)))
            first = tcur.fetchone()[0]
        return position.head if first is None else first

    # -- reading -----------------------------------------------------------------------------
    # A record's payload: the row as JSON (row_to_json(t)), or with json_schema the JSON object
    # of the declared columns the table has (row_to_json of a sub-select of them). Batches,
    # payloads, payloads_at (the backflow) and verify all build it here, so the decoder,
    # _corrupt_record and max_record_bytes see one payload wherever a record is read.
    @staticmethod
    def _rows(table: _Table, where: sql.Composable) -> sql.Composed:
        """``FROM`` the table as ``t`` (and its declared columns as ``r``) ``WHERE where``."""
        if table.fields is None:
            return sql.SQL("FROM {} AS t WHERE {}").format(table.name, where)
        picked = sql.SQL(", ").join(sql.SQL("t.{}").format(sql.Identifier(n))
                                    for n, _, _ in table.present)
        return sql.SQL("FROM {} AS t CROSS JOIN LATERAL (SELECT {}) AS r WHERE {}").format(
            table.name, picked, where)

    @staticmethod
    def _payload(table: _Table) -> sql.SQL:
        # t.* and r.*: a bare t or r would name a column of the table called so
        return sql.SQL("row_to_json(t.*)::text" if table.fields is None
                       else "row_to_json(r.*)::text")

    def _select(self, table: _Table, start: int, end: int) -> sql.Composed:
        """The records of keys ``[start, end)``: partition, offset, payload. Values go in as
        literals: an identifier may hold a ``%``, which parameters would take for a
        placeholder."""
        return sql.SQL("""SELECT 0 AS partition, t.{key}::bigint AS "offset", {payload}
                          AS payload {rows}""").format(
            key=table.key, payload=self._payload(table), rows=self._rows(table, self._keys(
                table, start, end)))

    @staticmethod
    def _keys(table: _Table, start: int, end: int) -> sql.Composed:
        return sql.SQL("t.{key} >= {start} AND t.{key} < {end}").format(
            key=table.key, start=sql.Literal(start), end=sql.Literal(end))

    def _direct_select(self, table: _Table, start: int, end: int) -> sql.Composed:
        """The records of keys ``[start, end)`` read directly (``table.direct``): partition,
        offset, the declared columns the table has, as stored (no cast: a real read as a
        double must keep its own shortest text, a bpchar its padding), then ``payload``:
        NULL for a clean row, the payload for a row the decoder must judge: a NaN or an
        infinity (to_json writes them as strings, which a number column refuses), a numeric
        past a double's range or a tiny one (whose sign a zero may keep), or one whose
        payload may exceed max_record_bytes by a cheap upper bound (6 bytes a text byte,
        the widest text of a fixed-width type)."""
        values, suspect = [], []
        size = 2 + len(table.present)  # braces and commas (one more than needed)
        variable = []
        for name, _, pg_type in table.present:
            column = sql.SQL("t.{}").format(sql.Identifier(name))
            size += 6 * len(name.encode()) + 3  # the key, escaped, quoted, and its colon
            if pg_type in ("real", "double precision", "numeric"):
                fine = (sql.SQL("abs({c}) < 'Infinity'") if pg_type != "numeric" else sql.SQL(
                    "abs({c}) < 1e308 AND ({c} = 0 OR abs({c}) > 1e-300)")).format(c=column)
                values.append(sql.SQL("CASE WHEN {} THEN {} END").format(fine, column))
                suspect.append(sql.SQL("coalesce(NOT ({}), false)").format(fine))
            else:
                values.append(column)
            if pg_type in _STRINGS:
                size += 4
                variable.append(sql.SQL("6 * coalesce(octet_length({}), 0)").format(column))
            elif pg_type == "numeric":  # below 1e308: 309 digits, a sign and a point at most
                size += 311
                variable.append(sql.SQL("coalesce(scale({}), 0)").format(column))
            else:
                size += _WIDTH[pg_type]
        if variable:
            suspect.append(sql.SQL("{} > {}").format(
                sql.SQL(" + ").join([sql.Literal(size), *variable]),
                sql.Literal(self.max_record_bytes)))
        elif size > self.max_record_bytes:
            suspect.append(sql.SQL("true"))
        payload = sql.SQL("CASE WHEN {} THEN {} END").format(
            sql.SQL(" OR ").join(suspect), self._payload(table)) if suspect else \
            sql.SQL("NULL::text")
        return sql.SQL("""SELECT 0 AS partition, t.{key}::bigint AS "offset", {values}
                          {payload} AS payload {rows}""").format(
            key=table.key, values=sql.SQL("").join(sql.SQL("{}, ").format(v) for v in values),
            payload=payload, rows=self._rows(table, self._keys(table, start, end)))

    def direct(self, cur) -> bool:
        """Whether a batch reads the declared columns directly (with ``json_schema``, when
        every declared column the table has is of a type read exactly as the decoder would
        read its JSON: see the module docstring); else the reader decodes each payload."""
        return self._check(cur).direct

    def read(self, spark, dsn: str, ranges: Iterable[PartitionRange]):
        dsn = self.table_dsn(dsn)
        pieces = chunk_ranges([r for r in ranges if r.size > 0], self.read_chunk)
        with connection(dsn, application_name="onceflow-table") as conn:
            with conn.cursor() as cur:
                table = self._check(cur)
                select = self._direct_select if table.direct else self._select
                copies = [sql.SQL("COPY ({}) TO STDOUT (FORMAT csv)").format(
                    select(table, s, e)).as_string(cur) for _, s, e in pieces]
            conn.rollback()
        if table.direct:
            reader = _direct_reader(dsn, self.records, table.fields, self.max_record_bytes)
        else:
            reader = _copy_reader(dsn, self.records, self.max_record_bytes)
        # No repartition: the local rows are already spread over the default parallelism.
        chunks = spark.createDataFrame(list(enumerate(copies)), CHUNK_SCHEMA)
        return chunks.mapInArrow(reader, self.read_ddl)

    @contextmanager
    def _reading(self, conn):
        """A connection on the table's database: ``conn``, or one of its own."""
        own = self.table_dsn(None)
        if own is None:
            yield conn
            return
        with connection(own, application_name="onceflow-table") as other:
            try:
                yield other
            finally:
                other.rollback()

    def payloads(self, conn, ranges: Iterable[PartitionRange]
                 ) -> Iterator[tuple[int, int, str]]:
        ranges = [r for r in ranges if r.size > 0]
        if not ranges:
            return
        with self._reading(conn) as tconn:
            with tconn.cursor() as cur:
                table = self._check(cur)
            for r in ranges:
                with tconn.cursor(name="onceflow_table_scan") as cur:
                    cur.itersize = 50_000
                    cur.execute(self._select(table, r.start, r.end)
                                + sql.SQL(' ORDER BY 2'))
                    yield from cur

    def payloads_at(self, cur, positions: Iterable[tuple[int, int]]
                    ) -> dict[tuple[int, int], str]:
        keys = sorted({o for _, o in positions})
        with self._reading(cur.connection) as tconn, tconn.cursor() as tcur:
            table = self._check(tcur)
            tcur.execute(sql.SQL("SELECT t.{key}::bigint, {payload} {rows}").format(
                key=table.key, payload=self._payload(table), rows=self._rows(
                    table, sql.SQL("t.{} = ANY({}::bigint[])").format(
                        table.key, sql.Literal(keys)))))
            return {(0, key): payload for key, payload in tcur.fetchall()}

    def describe(self) -> str:
        return f"table {self.table} by {self.key} (topic {self.topic!r})"


def _holders(cur, sequence: str, among: list[str] | None) -> list[str]:
    """Virtual transaction ids of the transactions holding ``sequence``'s lock (a prepared
    transaction too: its locks stay with it), other than this one; ``among``: only those of
    this list (still running). Readers of the sequence (AccessShareLock: another look at the
    head) draw no keys and are left out; nextval and setval take RowExclusiveLock."""
    if among is not None and not among:
        return []
    cur.execute(
        """SELECT DISTINCT virtualtransaction FROM pg_locks
           WHERE locktype = 'relation' AND relation = %s::regclass AND granted
             AND mode <> 'AccessShareLock'
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
             AND pid IS DISTINCT FROM pg_backend_pid()
             AND (%s::text[] IS NULL OR virtualtransaction = ANY(%s::text[]))
           ORDER BY 1""", (sequence, among, among))
    return [v for (v,) in cur.fetchall()]


def _describe_holders(cur, sequence: str, among: list[str]) -> str:
    cur.execute(
        """SELECT string_agg(format('pid %%s (%%s, %%s since %%s)', coalesce(a.pid::text,
                  'prepared'), coalesce(a.application_name, ''), coalesce(a.state, ''),
                  a.xact_start), '; ')
           FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
           WHERE l.locktype = 'relation' AND l.relation = %s::regclass AND l.granted
             AND l.virtualtransaction = ANY(%s::text[])""", (sequence, among))
    return cur.fetchone()[0] or "transactions that have ended since"


def _copies_reader(dsn: str, each):
    """The Spark task: each chunk row's COPY statement, run on a connection of the task's
    own; the record batches ``each(cur, copy)`` makes of it."""

    def read(batches: Iterator) -> Iterator:
        conn = psycopg2.connect(dsn, application_name="onceflow-table-reader")
        try:
            with conn.cursor() as cur:
                for batch in batches:
                    for copy in batch.column("copy").to_pylist():
                        yield from each(cur, copy)
            conn.rollback()
        finally:
            conn.close()

    return read


def _copy_reader(dsn: str, records: JsonRecords | None, max_bytes: int):
    """The Spark task: each chunk's CSV parsed by Arrow, decoded with ``records``
    (pglog.copied_batches)."""
    return _copies_reader(dsn, lambda cur, copy: copied_batches(
        copy_records(cur, copy), records, max_bytes))


def _direct_reader(dsn: str, records: JsonRecords,
                   fields: tuple[tuple[str, str, str | None], ...], max_bytes: int):
    """The Spark task of a direct read (TableSource._direct_select): each chunk's CSV parsed
    by Arrow into the declared types; the clean rows yielded as read, the rows that carry a
    payload decoded by ``records`` (corrupt or oversized exactly as the decoder says)."""
    import pyarrow as pa  # lazy: `import onceflow` loads no pyarrow
    import pyarrow.compute as pc  # lazy: `import onceflow` loads no pyarrow
    from pyarrow import csv as pacsv  # lazy: `import onceflow` loads no pyarrow

    present = [(f"c{n}", kind) for n, (_, kind, pg_type) in enumerate(fields)
               if pg_type is not None]
    types = {"partition": pa.int32(), "offset": pa.int64(),
             # a float column is parsed as a double, then rounded, as the decoder does
             **{c: arrow_type("double" if kind == "float" else kind) for c, kind in present},
             "payload": pa.string()}
    # COPY CSV writes NULL as an empty field, '' as "", a boolean as t or f
    convert = pacsv.ConvertOptions(column_types=types, null_values=[""],
                                   strings_can_be_null=True, quoted_strings_can_be_null=False,
                                   true_values=["t"], false_values=["f"])

    def clean(table) -> pa.Table:
        n = table.num_rows
        out = {"partition": table.column("partition"), "offset": table.column("offset")}
        for i, (name, kind, pg_type) in enumerate(fields):
            if pg_type is None:
                out[name] = pa.nulls(n, arrow_type(kind))
                continue
            column = table.column(f"c{i}")
            if kind in ("float", "double"):
                # to_json writes -0.0 as -0, an integer the decoder reads as 0.0
                column = pc.add(column, 0.0)
                if kind == "float":
                    column = column.cast(pa.float32())
            out[name] = column
        out[CORRUPT] = pa.nulls(n, pa.string())
        out[PROBLEM] = pa.nulls(n, pa.string())
        return pa.table(out)

    def read(cur, copy: str) -> Iterator:
        buf = io.BytesIO()
        cur.copy_expert(copy, buf)
        if not buf.tell():
            return
        buf.seek(0)
        table = pacsv.read_csv(
            buf, read_options=pacsv.ReadOptions(column_names=list(types)),
            parse_options=pacsv.ParseOptions(newlines_in_values=True),
            convert_options=convert)
        judged = table.column("payload").is_valid()
        yield from clean(table.filter(pc.invert(judged))).to_batches()
        flagged = table.filter(judged)
        if flagged.num_rows:
            yield from records.decode_batches(
                flagged.select(["partition", "offset", "payload"]), max_bytes)

    return _copies_reader(dsn, read)
