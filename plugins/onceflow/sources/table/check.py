"""A table source's table, its key and its sequence, checked against PostgreSQL's catalog.

**Refused, loudly (ConfigError naming the table, the column and the fix):** a table that does
not exist or cannot be read, a view; a key column that is missing, not an integer (a
timestamp or uuid has no order that a commit respects), or not fed by a sequence (a column
DEFAULT nextval(...) or an identity: onceflow cannot bound keys a writer chooses itself); a
sequence with CACHE > 1 (each session takes a block of keys ahead and hands them out later,
in later transactions: keys appear far out of order, no bound is safe: ALTER SEQUENCE ...
CACHE 1), descending, CYCLE, or able to go below 0 (offsets are non-negative). Keys at 2^40
and above, a sequence set back below the head and a topic bound to another table or column
are refused where the head is chosen (onceflow.sources.table.head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from psycopg2 import sql

from onceflow.core.errors import ConfigError
from onceflow.sources.json_records import JsonRecords

INTEGER_TYPES = ("smallint", "integer", "bigint")
TIME_TYPES = ("timestamp without time zone", "timestamp with time zone", "date")
STRINGS = frozenset({"text", "character varying", "character"})
# declared type -> the PostgreSQL types read directly into it (select.direct_select): COPY
# writes the value with the same output function as to_json, so Arrow parses the text the
# decoder parses; an integer column only from types no wider than it
DIRECT = {
    "string": STRINGS,
    "boolean": frozenset({"boolean"}),
    "smallint": frozenset({"smallint"}),
    "int": frozenset({"smallint", "integer"}),
    "bigint": frozenset({"smallint", "integer", "bigint"}),
    "float": frozenset({"real"}),
    "double": frozenset({"real", "double precision", "numeric"}),
}


class Declared(NamedTuple):
    """A column of the json_schema, and what the table holds under its name."""

    name: str
    kind: str  # the declared (Spark) type
    pg_type: str | None  # the table column's PostgreSQL type; None: the table has none


@dataclass(frozen=True)
class CheckedTable:
    """The checked table: what the queries need."""

    oid: int
    name: sql.Composable  # schema.table, quoted
    label: str  # schema.table, for messages and the bounds row
    key: sql.Composable
    sequence: str  # its regclass text
    start: int  # the sequence's START: it hands out no key below it
    time: sql.Composable | None
    # with json_schema: the declared columns in declaration order; None without json_schema
    fields: tuple[Declared, ...] | None = None

    @property
    def present(self) -> list[Declared]:
        """The declared columns the table has: what a record's payload holds."""
        return [f for f in self.fields or () if f.pg_type is not None]

    @property
    def direct(self) -> bool:
        """Whether a batch reads the declared columns' values themselves (see
        select.direct_select): every declared column the table has is of a type whose COPY
        text Arrow parses to what the decoder makes of its JSON."""
        return self.fields is not None and all(
            f.pg_type in DIRECT.get(f.kind, ()) for f in self.present)


def check_table(cur, table: str, key: str, time_column: str | None,
                records: JsonRecords | None) -> CheckedTable:
    """The table, its key and its sequence, checked (ConfigError naming the fix); with
    ``records`` (a json_schema) the PostgreSQL type of each declared column."""
    where = f"source.table={table!r}"
    cur.execute(
        """SELECT c.oid, n.nspname, c.relname, c.relkind,
                  has_table_privilege(c.oid, 'SELECT')
           FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
           WHERE c.oid = to_regclass(%s)""", (table,))
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
    column = f"column {key!r} of {label}"
    cur.execute(
        """SELECT a.attnum, format_type(a.atttypid, NULL),
                  pg_get_serial_sequence(%s, a.attname)
           FROM pg_attribute a
           WHERE a.attrelid = %s AND a.attname = %s AND a.attnum > 0
             AND NOT a.attisdropped""",
        (sql.Identifier(schema, name).as_string(cur), oid, key))
    row = cur.fetchone()
    if row is None:
        cur.execute("""SELECT string_agg(attname, ', ' ORDER BY attnum) FROM pg_attribute
                       WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped""", (oid,))
        raise ConfigError(f"source.key={key!r}: {label} has no such column (it has "
                          f"{cur.fetchone()[0]}): name its increasing key column")
    attnum, type_name, sequence = row
    if type_name not in INTEGER_TYPES:
        raise ConfigError(
            f"source.key={key!r}: {column} is {type_name}, not an integer: a table "
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
            f"source.key={key!r}: {column} is not fed by a sequence, so its keys "
            "may not increase in the order they are handed out and no safe bound exists: "
            f"make it an identity (ALTER TABLE {label} ALTER COLUMN {key} ADD "
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
            f"source.key={key!r}: CACHE {cache} {fix}: each session takes {cache} "
            "keys ahead and hands them out later, in later transactions, so keys become "
            "visible far out of order and no bound is safe. Fix: ALTER SEQUENCE "
            f"{sequence} CACHE 1")
    if increment < 0 or cycle:
        raise ConfigError(
            f"source.key={key!r}: {column} does not increase (INCREMENT {increment}"
            f"{', CYCLE' if cycle else ''} {fix}): keys must only grow. Fix: ALTER "
            f"SEQUENCE {sequence} INCREMENT BY 1 NO CYCLE")
    if minimum < 0:
        raise ConfigError(
            f"source.key={key!r}: MINVALUE {minimum} {fix}: offsets are keys and "
            f"may not be negative. Fix: ALTER SEQUENCE {sequence} MINVALUE 0 (or more)")
    if not seq_readable:
        raise ConfigError(f"source.key={key!r}: user {cur.connection.info.user!r} "
                          f"may not read sequence {sequence}: GRANT SELECT ON SEQUENCE "
                          f"{sequence} TO it")
    time = None
    if time_column is not None:
        cur.execute("""SELECT format_type(atttypid, NULL) FROM pg_attribute
                       WHERE attrelid = %s AND attname = %s AND attnum > 0
                         AND NOT attisdropped""", (oid, time_column))
        row = cur.fetchone()
        if row is None or row[0] not in TIME_TYPES:
            raise ConfigError(
                f"source.time_column={time_column!r}: {label} has no such "
                f"{'column' if row is None else 'timestamp column (it is ' + row[0] + ')'}"
                ": name a timestamp column, or leave it out")
        time = sql.Identifier(time_column)
    fields = None
    if records is not None:
        cur.execute("""SELECT attname, format_type(atttypid, NULL) FROM pg_attribute
                       WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped
                         AND attname = ANY(%s)""", (oid, records.names))
        types = dict(cur.fetchall())
        fields = tuple(Declared(n, k, types.get(n)) for n, k in records.columns)
    return CheckedTable(oid=oid, name=sql.Identifier(schema, name), label=label,
                        key=sql.Identifier(key), sequence=sequence, start=start, time=time,
                        fields=fields)

