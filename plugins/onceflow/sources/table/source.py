"""TableSource: a user's own PostgreSQL table as a source (see onceflow.sources.table): its
settings, where the table lives, and the Source's questions, answered by check (the table, its
key and its sequence), head (a bound no late commit can fall under), select (the SELECTs that
make a record) and read (the Spark reader tasks)."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import ClassVar

from psycopg2 import sql

from onceflow.core.connections import resolve_dsn
from onceflow.core.db import connection, transaction
from onceflow.core.errors import ConfigError
from onceflow.core.planner import PartitionRange
from onceflow.core.source import Position, require_topic
from onceflow.sources.json_records import JsonSchemaSource
from onceflow.sources.pglog import chunk_ranges
from onceflow.sources.table import select
from onceflow.sources.table.check import CheckedTable, check_table
from onceflow.sources.table.head import choose_head, look_head

log = logging.getLogger(__name__)

_NAME = r'(?:[A-Za-z_][A-Za-z0-9_$]*|"(?:[^"]|"")+")'
_TABLE = re.compile(rf"^{_NAME}(?:\.{_NAME})?$")


@dataclass(frozen=True, kw_only=True)
class TableSource(JsonSchemaSource):
    """A user's own PostgreSQL table, read by an increasing key (see onceflow.sources.table).

    ``table``: ``schema.table`` (or ``table``, found on the search path); ``key``: the key
    column (integer, fed by a sequence with CACHE 1); ``dsn`` or ``conn_id``: the table's
    database (neither: the coordinator's); ``read_chunk``: key values per Spark reader task;
    ``wait_s``: how long choosing a head waits for writers in flight before it keeps the
    candidate for a later look; ``time_column``: a timestamp column, for the start policy
    ``timestamp:<ISO>``; ``json_schema``: the row's columns to read, as Spark DDL of simple
    types (the records then carry these columns and ``_corrupt_record`` instead of
    ``payload``): a record's payload is then the JSON object of these columns, decoded as a
    batch reads it, or, when their types allow it exactly, read directly (see
    onceflow.sources.table.select).
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
        require_topic(self.topic, "name the topic (how pipelines and the coordinator know "
                      "this table)")
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

    def _check(self, cur) -> CheckedTable:
        """The table, its key and its sequence, checked (ConfigError naming the fix)."""
        return check_table(cur, self.table, self.key, self.time_column, self.records)

    # -- the head: onceflow.sources.table.head -----------------------------------------------
    def positions(self, cur) -> dict[int, Position]:
        with self._table_cursor(cur) as tcur:
            table = self._check(tcur)
            return {0: choose_head(cur, tcur, table, self.topic, self.key, self.wait_s)}

    def heads(self, cur) -> dict[int, Position]:
        """The head as a begin would find it, without waiting and without writing (see
        head.look_head)."""
        with self._table_cursor(cur) as tcur:
            return {0: look_head(cur, tcur, self._check(tcur), self.topic)}

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

    def direct(self, cur) -> bool:
        """Whether a batch reads the declared columns directly (with ``json_schema``, when
        every declared column the table has is of a type read exactly as the decoder would
        read its JSON: see onceflow.sources.table.select); else the reader decodes each payload."""
        return self._check(cur).direct

    def read(self, spark, dsn: str, ranges: Iterable[PartitionRange]):
        from onceflow.sources.table import read as tasks  # pyarrow: loaded to read a batch

        dsn = self.table_dsn(dsn)
        pieces = chunk_ranges([r for r in ranges if r.size > 0], self.read_chunk)
        with connection(dsn, application_name="onceflow-table") as conn:
            with conn.cursor() as cur:
                table = self._check(cur)
                copies = [sql.SQL("COPY ({}) TO STDOUT (FORMAT csv)").format(
                    select.direct_select(table, s, e, self.max_record_bytes) if table.direct
                    else select.payload_select(table, s, e)).as_string(cur)
                    for _, s, e in pieces]
            conn.rollback()
        if table.direct:
            reader = tasks.direct_reader(dsn, self.records, table.fields, self.max_record_bytes)
        else:
            reader = tasks.copy_reader(dsn, self.records, self.max_record_bytes)
        # No repartition: the local rows are already spread over the default parallelism.
        chunks = spark.createDataFrame(list(enumerate(copies)), tasks.CHUNK_SCHEMA)
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
                    cur.execute(select.payload_select(table, r.start, r.end)
                                + sql.SQL(' ORDER BY 2'))
                    yield from cur

    def payloads_at(self, cur, positions: Iterable[tuple[int, int]]
                    ) -> dict[tuple[int, int], str]:
        keys = sorted({o for _, o in positions})
        with self._reading(cur.connection) as tconn, tconn.cursor() as tcur:
            table = self._check(tcur)
            tcur.execute(sql.SQL("SELECT t.{key}::bigint, {payload} {rows}").format(
                key=table.key, payload=select.payload(table), rows=select.rows(
                    table, sql.SQL("t.{} = ANY({}::bigint[])").format(
                        table.key, sql.Literal(keys)))))
            return {(0, key): payload for key, payload in tcur.fetchall()}

    def describe(self) -> str:
        return f"table {self.table} by {self.key} (topic {self.topic!r})"
