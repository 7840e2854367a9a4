"""Typed tables: state with composite typed keys and several measures, upsert tables (latest
row per key) and append tables (facts with a txid column). Their columns and types, their
DDL, their staging tables and the set-based SQL that applies a batch in the ordered commit.

A typed state (``StateSpec(key=..., measures=...)``) holds per key one value per measure and,
when opaque, each measure's value before the last txid that wrote it (``prev_<measure>``)
and that txid's predecessor (``prev_txid``): a replay of the txid starts again from the
previous values, so it never counts twice (onceflow.core.opaque is the rule in Python). An
upsert table is a typed state whose measures are all ``Last``. An append table
(``kind="append"``) holds the batch's rows with their txid; applying a txid replaces its own
rows, so a replay leaves exactly one copy.

Staging: one UNLOGGED table per pipeline and typed state, ``onceflow_staging."<pipeline>.<state>"``,
with the processing groups' rows already aggregated by Spark, written by COPY; the commit
aggregates across groups only when the batch has several.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import psycopg2.errors
from psycopg2 import sql

from onceflow.core.errors import ConfigError, StaleBatch, StateOverflow

STAGING_SCHEMA = "onceflow_staging"
AGGREGATES = ("sum", "count", "min", "max", "last")
ORDER = "_order"  # the staging column that orders Last measures

_NUMERIC = re.compile(r"^numeric\((\d{1,2}),\s*(\d{1,2})\)$")
# PostgreSQL type -> Spark type, for keys and for min / max / last values
_TYPES = {
    "text": "string", "bigint": "bigint", "integer": "int", "smallint": "smallint",
    "boolean": "boolean", "date": "date", "timestamp": "timestamp_ntz",
    "timestamptz": "timestamp", "double precision": "double",
}
_SUMMABLE = ("bigint", "integer", "smallint", "double precision")  # and numeric(p,s)


# Spark's JSON of a row (typed tuples through the verdict, Parquet rows as payloads):
# timestamps keep their microseconds.
SPARK_JSON = {"timestampFormat": "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX",
              "timestampNTZFormat": "yyyy-MM-dd'T'HH:mm:ss.SSSSSS"}


def spark_type(pg_type: str) -> str:
    match = _NUMERIC.match(pg_type)
    if match:
        return f"decimal({match.group(1)},{match.group(2)})"
    return _TYPES[pg_type]


def normal_type(pg_type: str) -> str:
    """A type as onceflow spells it ('int8' and 'long' are not accepted: one spelling)."""
    text = " ".join(str(pg_type).lower().split())
    return re.sub(r"numeric\(\s*(\d+)\s*,\s*(\d+)\s*\)", r"numeric(\1,\2)", text)


def known_type(pg_type: str) -> bool:
    match = _NUMERIC.match(pg_type)
    if match:
        precision, scale = int(match.group(1)), int(match.group(2))
        return 1 <= precision <= 38 and scale <= precision
    return pg_type in _TYPES


TYPE_HELP = ("use one of text, bigint, integer, smallint, boolean, date, timestamp, "
             "timestamptz, double precision, numeric(p,s) (p up to 38)")

_INTEGERS = ("smallint", "integer", "bigint")
_SPARK_INTEGRAL = ("tinyint", "smallint", "int", "bigint")
_SPARK_SIMPLE = (*_SPARK_INTEGRAL, "string", "boolean", "float", "double", "decimal", "date",
                 "timestamp", "timestamp_ntz")
_DECIMAL = re.compile(r"^decimal(?:\((\d+)\s*(?:,\s*(\d+))?\))?$")


def conversion_loss(kind: str, pg_type: str) -> str | None:
    """Why a stream column of Spark type ``kind`` (onceflow.core.topology.column_types'
    spelling) cannot be stored as ``pg_type`` without losing what every value holds, or None.

    A string is parsed per record; a value out of the type's range (1780.25 in a
    numeric(5,2)) is that record's failure, not the declaration's. What is refused here
    would change every value silently: a fraction cut off (2.7 into an integer), decimals
    rounded away (numeric(12,4) into numeric(12,2)), a time of day dropped (timestamp into
    date), or types that do not convert at all (boolean into a number)."""
    base = kind.split("(")[0].split("<")[0].strip()
    if base == "string":
        return None
    if base not in _SPARK_SIMPLE:
        return f"a {kind} column cannot be stored in a table column: convert it in a bolt"
    if pg_type == "text":
        return None
    numeric = _NUMERIC.match(pg_type)
    if base in ("float", "double", "decimal") and pg_type in _INTEGERS:
        decimal = _DECIMAL.match(kind)
        if base != "decimal" or (decimal and int(decimal.group(2) or 0) > 0):
            return "the fraction of every value would be cut off"
    if base == "decimal" and numeric:
        decimal = _DECIMAL.match(kind)
        scale, want = int((decimal and decimal.group(2)) or 0), int(numeric.group(2))
        if scale > want:
            return f"its {scale} decimal places would be rounded to {want}"
    if base in ("timestamp", "timestamp_ntz") and pg_type == "date":
        return "the time of day would be cut off"
    numbers = (*_INTEGERS, "double precision")
    fits = {"boolean": ("boolean",), "date": ("date", "timestamp", "timestamptz"),
            "timestamp": ("timestamp", "timestamptz"),
            "timestamp_ntz": ("timestamp", "timestamptz")}
    if base in fits:
        ok = pg_type in fits[base]
    else:  # a number
        ok = pg_type in numbers or bool(numeric)
    return None if ok else f"a {kind} column does not convert to {pg_type}"


@dataclass(frozen=True)
class Measure:
    """One measure of a typed state: ``agg`` over the stream's column ``column``, of
    PostgreSQL type ``type``. Sum, Count, Min, Max and Last build them."""

    agg: str
    column: str | None = None
    type: str = "bigint"

    def describe(self) -> str:
        """The measure as its declaration reads, e.g. ``Max('amount', 'numeric(5,2)')``."""
        args = [repr(a) for a in (self.column, None if self.agg == "count" else self.type)
                if a is not None]
        return f"{self.agg.capitalize()}({', '.join(args)})"

    def stored_type(self) -> str:
        """The state table's column type: the declared one (a Count's is bigint)."""
        return "bigint" if self.agg == "count" else self.type

    def staged_type(self) -> str:
        """The type of a batch's aggregate (Spark's and staging's): a sum is kept wide
        (numeric(38,s), bigint), so a batch's total never fails there; whether the table's
        declared type holds the new running total is the commit's check (apply_batch)."""
        if self.agg == "count":
            return "bigint"
        match = _NUMERIC.match(self.type)
        if self.agg == "sum" and match:
            return f"numeric(38,{match.group(2)})"
        if self.agg == "sum" and self.type in _INTEGERS:
            return "bigint"
        return self.type

    @property
    def bounded_sum(self) -> bool:
        """A sum whose running total may outgrow its declared type (any but a double)."""
        return self.agg == "sum" and self.type != "double precision"


def Sum(column: str, type: str = "bigint") -> Measure:  # noqa: N802 (reads like a type)
    """The sum of ``column`` (bigint, integer, smallint, double precision or numeric(p,s))."""
    return Measure("sum", column, normal_type(type))


def Count(column: str | None = None) -> Measure:  # noqa: N802
    """How many rows (with ``column`` not null, when given)."""
    return Measure("count", column, "bigint")


def Min(column: str, type: str) -> Measure:  # noqa: N802
    return Measure("min", column, normal_type(type))


def Max(column: str, type: str) -> Measure:  # noqa: N802
    return Measure("max", column, normal_type(type))


def Last(column: str, type: str) -> Measure:  # noqa: N802
    """The value of the batch's last row for the key (by the state's ``order_by``, else by
    the record's position); a later txid replaces it."""
    return Measure("last", column, normal_type(type))


def validate_shape(name: str, kind: str, key: Mapping[str, str], measures: Mapping[str, Measure],
                   columns: Mapping[str, str], order_by: str | None, ident: re.Pattern) -> None:
    where = f"state[{name}]"

    def refuse(field_name: str, value, fix: str) -> None:
        raise ConfigError(f"{where}.{field_name}={value!r} is invalid: {fix}")

    if kind == "append":
        if not columns:
            refuse("columns", columns, "an append table needs its columns, e.g. "
                   "columns={'order_id': 'bigint', 'amount': 'numeric(12,2)'}")
        if key or measures:
            refuse("key", key, "an append table has columns only (no key, no measures)")
        named = dict(columns)
    else:
        if columns:
            refuse("columns", columns, "only an append table (kind='append') has columns; "
                   "a typed state has key and measures")
        if not key:
            refuse("key", key, "give the key columns and their types, e.g. "
                   "key={'merchant': 'text', 'day': 'date'}")
        if not measures:
            refuse("measures", measures, "give at least one measure, e.g. "
                   "measures={'revenue': Sum('amount', 'numeric(12,2)')}")
        named = dict(key)
        for measure_name, measure in measures.items():
            if not isinstance(measure, Measure):
                refuse(f"measures[{measure_name}]", measure,
                       "use Sum(...), Count(...), Min(...), Max(...) or Last(...)")
            if measure.agg not in AGGREGATES:
                refuse(f"measures[{measure_name}].agg", measure.agg,
                       f"choose one of {', '.join(AGGREGATES)}")
            if measure.agg != "count" and not measure.column:
                refuse(f"measures[{measure_name}].column", measure.column,
                       f"name the stream column the {measure.agg} reads")
            if measure.agg == "sum" and not (measure.type in _SUMMABLE
                                             or _NUMERIC.match(measure.type)):
                refuse(f"measures[{measure_name}].type", measure.type,
                       "a sum is bigint, integer, smallint, double precision or numeric(p,s)")
            if not known_type(measure.type):
                refuse(f"measures[{measure_name}].type", measure.type, TYPE_HELP)
            named[measure_name] = measure.type
        lasts = [m for m in measures.values() if m.agg == "last"]
        if order_by is not None and not lasts:
            refuse("order_by", order_by, "order_by orders Last measures; this state has none")
    for column, pg_type in named.items():
        if not ident.match(column) or column in ("txid", "prev_txid") or \
                column.startswith(("prev_", "_")):
            refuse("columns", column, "name columns with lower-case letters, digits and _, "
                   "not txid, prev_txid, prev_* or _*")
        if not known_type(pg_type):
            refuse(f"type of {column}", pg_type, TYPE_HELP)
    if kind != "append":
        for column, pg_type in key.items():
            if pg_type == "double precision":
                refuse(f"key[{column}]", pg_type, "a double is no key (equality of floating "
                       "point values); use numeric(p,s) or bigint")


# -- the shape of a typed state, as the Spark side and the SQL need it -------------------------
@dataclass(frozen=True)
class Shape:
    """Columns of a typed state's staging: the key, one per measure, and _order when a Last
    measure needs it; ``inputs``: the stream columns the sink reads."""

    name: str
    append: bool
    key: tuple[tuple[str, str], ...]  # (column, PostgreSQL type)
    measures: tuple[tuple[str, Measure], ...]
    columns: tuple[tuple[str, str], ...]  # append tables
    order_by: str | None

    conversion_loss = staticmethod(conversion_loss)  # for the topology's check

    @property
    def ordered(self) -> bool:
        return any(m.agg == "last" for _, m in self.measures)

    def inputs(self) -> list[str]:
        """Stream columns the sink needs."""
        if self.append:
            return [c for c, _ in self.columns]
        out = [c for c, _ in self.key]
        for column in [m.column for _, m in self.measures] + [self.order_by]:
            if column and column not in out:
                out.append(column)
        return out

    def targets(self) -> list[tuple[str, str, str]]:
        """(stream column, the PostgreSQL type its value is stored as, the declaration that
        stores it) of every key, measure and append column; a Count reads no value."""
        if self.append:
            return [(c, t, f"columns[{c!r}]") for c, t in self.columns]
        out = [(c, t, f"key[{c!r}]") for c, t in self.key]
        out += [(m.column, m.type, f"measures[{name!r}] = {m.describe()}")
                for name, m in self.measures if m.column and m.agg != "count"]
        return out

    def typed_inputs(self) -> list[tuple[str, str, list[str]]]:
        """(stream column, PostgreSQL type, the declarations that store it) of each distinct
        pair of column and type (one column may feed measures of several types): what each
        record's values must fit."""
        out: dict[tuple[str, str], list[str]] = {}
        for column, pg_type, what in self.targets():
            out.setdefault((column, pg_type), []).append(what)
        return [(c, t, whats) for (c, t), whats in out.items()]

    def staged(self) -> list[tuple[str, str]]:
        """(column, PostgreSQL type) of the staging rows, after the key columns' order."""
        if self.append:
            return list(self.columns)
        out = list(self.key) + [(name, m.staged_type()) for name, m in self.measures]
        if self.ordered:  # the last row's rank: order_by as a number, else the record's
            out.append((ORDER, "bigint"))
        return out


def staging_table(pipeline: str, shape: Shape) -> sql.Composable:
    return sql.Identifier(STAGING_SCHEMA, f"{pipeline}.{shape.name}")


def staging_name_ok(pipeline: str, state: str) -> bool:
    return len(f"{pipeline}.{state}".encode()) <= 63


def _columns(cur, schema: str, table: str) -> list[tuple[str, str]]:
    cur.execute("""SELECT a.attname, format_type(a.atttypid, a.atttypmod)
                   FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
                   JOIN pg_namespace n ON n.oid = c.relnamespace
                   WHERE n.nspname = %s AND c.relname = %s AND a.attnum > 0
                     AND NOT a.attisdropped ORDER BY a.attnum""", (schema, table))
    return cur.fetchall()


_SPELLING = {"timestamp": "timestamp without time zone",
             "timestamptz": "timestamp with time zone", "text": "text"}


def _spelled(pg_type: str) -> str:
    return _SPELLING.get(pg_type, pg_type)


def expected_columns(shape: Shape, opaque: bool) -> list[tuple[str, str]]:
    if shape.append:
        return [(c, _spelled(t)) for c, t in shape.columns] + [("txid", "bigint")]
    out = [(c, _spelled(t)) for c, t in shape.key] + [("txid", "bigint")]
    if opaque:
        out.append(("prev_txid", "bigint"))
    for name, measure in shape.measures:
        out.append((name, _spelled(measure.stored_type())))
        if opaque:
            out.append((f"prev_{name}", _spelled(measure.stored_type())))
    return out


def _staging_columns(shape: Shape) -> list[tuple[str, str]]:
    return [("txid", "bigint"), ("attempt", "integer"), ("grp", "integer")] + [
        (c, _spelled(t)) for c, t in shape.staged()]


def ensure_staging(cur, pipeline: str, shape: Shape) -> None:
    """The state's staging table (UNLOGGED: emptied by a crash, which the commit's proof
    notices), indexed by attempt. Made again when the declaration changed (an attempt staged
    with the old shape then fails the commit's proof and is processed again)."""
    cur.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(STAGING_SCHEMA)))
    table = staging_table(pipeline, shape)
    want = _staging_columns(shape)
    have = _columns(cur, STAGING_SCHEMA, f"{pipeline}.{shape.name}")
    if have and have != want:
        cur.execute(sql.SQL("DROP TABLE {}").format(table))
    cols = [sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(t)) for c, t in shape.staged()]
    cur.execute(sql.SQL(
        "CREATE UNLOGGED TABLE IF NOT EXISTS {} (txid bigint NOT NULL, attempt integer NOT NULL, "
        "grp integer NOT NULL, {})").format(table, sql.SQL(", ").join(cols)))
    cur.execute(sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} (txid, attempt, grp)").format(
        sql.Identifier(f"{pipeline}.{shape.name}.attempt"[:63]), table))


def follow_declaration(cur, pipeline: str, shapes: list[Shape]) -> list[str]:
    """Make again each staging table whose columns are not the declaration's (a measure's
    type widened since `onceflow init` made it: COPY into the old type would fail); one
    catalog query when none differs. Called by begin under the pipeline's lock, so no commit
    reads the staging meanwhile. Returns what changed, one text per state."""
    if not shapes:
        return []
    names = [f"{pipeline}.{shape.name}" for shape in shapes]
    cur.execute("""SELECT c.relname, array_agg(a.attname::text ORDER BY a.attnum),
                          array_agg(format_type(a.atttypid, a.atttypmod) ORDER BY a.attnum)
                   FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                   JOIN pg_attribute a ON a.attrelid = c.oid
                   WHERE n.nspname = %s AND c.relname = ANY(%s) AND a.attnum > 0
                     AND NOT a.attisdropped
                   GROUP BY c.relname""", (STAGING_SCHEMA, names))
    have = {name: list(zip(cols, types, strict=True)) for name, cols, types in cur.fetchall()}
    changed = []
    for name, shape in zip(names, shapes, strict=True):
        want, old = _staging_columns(shape), have.get(name)
        if old == want:
            continue
        ensure_staging(cur, pipeline, shape)
        if old is None:
            changed.append(f"{shape.name}: made")
            continue
        was = dict(old)
        diff = [f"{c} {was.get(c, 'absent')} -> {t}" for c, t in want if was.get(c) != t]
        diff += [f"{c} {t} -> absent" for c, t in old if c not in dict(want)]
        changed.append(f"{shape.name}: {', '.join(diff)}")
    return changed


def _refuse_other_types(shape: Shape, have: list[tuple[str, str]],
                        want: list[tuple[str, str]]) -> None:
    if have and [c for c, _ in have] == [c for c, _ in want] and have != want:
        # the same columns of other types (a sum made numeric(38,s) before sums kept their
        # declared type, a measure's type changed): the statement that migrates it
        changed = [(c, old, new) for (c, old), (_, new) in zip(have, want, strict=True)
                   if old != new]
        raise ConfigError(
            f"state[{shape.name}]: table {shape.name} exists with column types other than the "
            f"declaration's ({', '.join(f'{c} {old}, declared {new}' for c, old, new in changed)}"
            f"): alter it to the declared types (ALTER TABLE {shape.name} "
            f"{', '.join(f'ALTER COLUMN {c} TYPE {new}' for c, _, new in changed)}; a value "
            "that does not fit a new type makes it fail), or declare the types it has")


def check_types(cur, states: list[tuple[Shape, bool]]) -> None:
    """Refuse (ConfigError, with the ALTER TABLE) a state table of the coordinator's
    database whose columns have other types than the declaration gives ((shape, opaque)
    pairs): a type widened in the declaration only would fail the commit. One catalog
    query."""
    if not states:
        return
    cur.execute("""SELECT c.relname, array_agg(a.attname::text ORDER BY a.attnum),
                          array_agg(format_type(a.atttypid, a.atttypmod) ORDER BY a.attnum)
                   FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid
                   WHERE c.relnamespace = current_schema()::regnamespace
                     AND c.relname = ANY(%s) AND a.attnum > 0 AND NOT a.attisdropped
                   GROUP BY c.relname""", ([shape.name for shape, _ in states],))
    have = {name: list(zip(cols, types, strict=True)) for name, cols, types in cur.fetchall()}
    for shape, opaque in states:
        _refuse_other_types(shape, have.get(shape.name, []), expected_columns(shape, opaque))


def ensure_table(cur, shape: Shape, opaque: bool, with_txid_index: bool) -> None:
    """The state table itself (in the coordinator's database or the state's own). A table
    that exists with other columns than the declaration's is refused, not altered."""
    ident = sql.Identifier(shape.name)
    cur.execute("SELECT current_schema()")
    have = _columns(cur, cur.fetchone()[0], shape.name)
    want = expected_columns(shape, opaque)
    _refuse_other_types(shape, have, want)
    if have and have != want:
        raise ConfigError(
            f"state[{shape.name}]: table {shape.name} exists with columns "
            f"{', '.join(f'{c} {t}' for c, t in have)}, but the declaration needs "
            f"{', '.join(f'{c} {t}' for c, t in want)}: migrate the table (or drop it, if its "
            "data may go), or give the state a new name")
    if shape.append:
        cols = [sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(t)) for c, t in shape.columns]
        cur.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} ({}, txid bigint NOT NULL)").format(
            ident, sql.SQL(", ").join(cols)))
        cur.execute(sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} (txid)").format(
            sql.Identifier(f"{shape.name}_txid"[:63]), ident))
        return
    cols = [sql.SQL("{} {} NOT NULL").format(sql.Identifier(c), sql.SQL(t)) for c, t in shape.key]
    cols.append(sql.SQL("txid bigint NOT NULL"))
    if opaque:
        cols.append(sql.SQL("prev_txid bigint"))
    for name, measure in shape.measures:
        cols.append(sql.SQL("{} {}").format(sql.Identifier(name), sql.SQL(measure.stored_type())))
        if opaque:
            cols.append(sql.SQL("{} {}").format(sql.Identifier(f"prev_{name}"),
                                                sql.SQL(measure.stored_type())))
    keys = sql.SQL(", ").join(sql.Identifier(c) for c, _ in shape.key)
    cur.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} ({}, PRIMARY KEY ({})) "
                        "WITH (fillfactor = 70)").format(ident, sql.SQL(", ").join(cols), keys))
    if with_txid_index:
        cur.execute(sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} (txid)").format(
            sql.Identifier(f"{shape.name}_txid"[:63]), ident))


# -- the batch, from staging ------------------------------------------------------------------
def _across_groups(name: str, measure: Measure) -> sql.Composable:
    col = sql.Identifier(name)
    if measure.agg in ("sum", "count"):
        return sql.SQL("sum({c})::{t} AS {c}").format(c=col, t=sql.SQL(measure.staged_type()))
    if measure.agg in ("min", "max"):
        return sql.SQL("{f}({c}) AS {c}").format(f=sql.SQL(measure.agg), c=col)
    return sql.SQL("(array_agg({c} ORDER BY {o} DESC))[1] AS {c}").format(
        c=col, o=sql.Identifier(ORDER))


def staged_batch(pipeline: str, shape: Shape, groups: int) -> sql.Composable:
    """The attempt's rows for the state (params txid, attempt): one per key (typed state,
    aggregated across the groups when there are several), every row (append table)."""
    table = staging_table(pipeline, shape)
    where = sql.SQL("txid = %(txid)s AND attempt = %(attempt)s")
    if shape.append:
        cols = sql.SQL(", ").join(sql.Identifier(c) for c, _ in shape.columns)
        return sql.SQL("SELECT {} FROM {} WHERE {}").format(cols, table, where)
    keys = sql.SQL(", ").join(sql.Identifier(c) for c, _ in shape.key)
    if groups == 1:  # Spark aggregated the only group: one row per key already
        values = sql.SQL(", ").join(sql.Identifier(n) for n, _ in shape.measures)
        return sql.SQL("SELECT {}, {} FROM {} WHERE {}").format(keys, values, table, where)
    values = sql.SQL(", ").join(_across_groups(n, m) for n, m in shape.measures)
    return sql.SQL("SELECT {}, {} FROM {} WHERE {} GROUP BY {}").format(
        keys, values, table, where, keys)


# -- applying a batch in the ordered commit ---------------------------------------------------
def _combine(measure: Measure, base: sql.Composable, new: sql.Composable) -> sql.Composable:
    if measure.agg in ("sum", "count"):
        return sql.SQL("coalesce({b}, 0) + {n}").format(b=base, n=new)
    if measure.agg == "min":
        return sql.SQL("least({b}, {n})").format(b=base, n=new)
    if measure.agg == "max":
        return sql.SQL("greatest({b}, {n})").format(b=base, n=new)
    return new


def apply_batch(cur, shape: Shape, opaque: bool, txid: int, source: sql.Composable,
                params: Mapping | None = None, *, revert_absent: bool = False) -> int:
    """Apply the batch ``source`` yields (staged_batch's columns) at ``txid``; returns the rows
    written. Opaque: a key's stored txid newer than ``txid`` raises StaleBatch (roll back);
    a key already at ``txid`` starts again from its previous values. Transactional: a key
    at ``txid`` already is skipped. Append: the txid's rows are replaced. ``revert_absent``
    (opaque, outside the coordinator's database): first undo this txid's earlier writes to
    keys the batch no longer has."""
    params = {**(params or {}), "txid": txid}
    table = sql.Identifier(shape.name)
    if shape.append:
        cols = sql.SQL(", ").join(sql.Identifier(c) for c, _ in shape.columns)
        cur.execute(sql.SQL("DELETE FROM {} WHERE txid = %(txid)s").format(table), params)
        cur.execute(sql.SQL("INSERT INTO {} ({}, txid) SELECT {}, %(txid)s FROM ({}) AS d").format(
            table, cols, cols, source), params)
        return cur.rowcount
    keys = [sql.Identifier(c) for c, _ in shape.key]
    key_list = sql.SQL(", ").join(keys)
    names = [n for n, _ in shape.measures]
    if revert_absent and opaque:
        same = sql.SQL(" AND ").join(sql.SQL("d.{k} = s.{k}").format(k=k) for k in keys)
        absent = sql.SQL("s.txid = %(txid)s AND NOT EXISTS (SELECT 1 FROM ({}) AS d WHERE {})"
                         ).format(source, same)
        cur.execute(sql.SQL("DELETE FROM {} AS s WHERE {} AND s.prev_txid IS NULL").format(
            table, absent), params)
        back = sql.SQL(", ").join(sql.SQL("{m} = s.{p}").format(
            m=sql.Identifier(n), p=sql.Identifier(f"prev_{n}")) for n in names)
        cur.execute(sql.SQL("UPDATE {} AS s SET {}, txid = s.prev_txid, prev_txid = NULL "
                            "WHERE {}").format(table, back, absent), params)
    measure_list = sql.SQL(", ").join(sql.Identifier(n) for n in names)
    if opaque:
        def base(name: str) -> sql.Composable:
            return sql.SQL("CASE WHEN s.txid = EXCLUDED.txid THEN s.{p} ELSE s.{m} END").format(
                p=sql.Identifier(f"prev_{name}"), m=sql.Identifier(name))
        sets = [sql.SQL("{m} = {v}").format(
            m=sql.Identifier(n), v=_combine(m, base(n), sql.SQL("EXCLUDED.{}").format(
                sql.Identifier(n)))) for n, m in shape.measures]
        sets += [sql.SQL("{p} = {b}").format(p=sql.Identifier(f"prev_{n}"), b=base(n))
                 for n in names]
        sets.append(sql.SQL("prev_txid = CASE WHEN s.txid = EXCLUDED.txid THEN s.prev_txid "
                            "ELSE s.txid END"))
        guard = sql.SQL("s.txid <= EXCLUDED.txid")
    else:
        sets = [sql.SQL("{m} = {v}").format(
            m=sql.Identifier(n), v=_combine(m, sql.SQL("s.{}").format(sql.Identifier(n)),
                                            sql.SQL("EXCLUDED.{}").format(sql.Identifier(n))))
                for n, m in shape.measures]
        guard = sql.SQL("s.txid < EXCLUDED.txid")
    sets.append(sql.SQL("txid = EXCLUDED.txid"))
    query = sql.SQL(
        """WITH d AS MATERIALIZED ({source}),
           up AS (
               INSERT INTO {table} AS s ({keys}, txid, {measures})
               SELECT {keys}, %(txid)s, {measures} FROM d
               ON CONFLICT ({keys}) DO UPDATE SET {sets} WHERE {guard}
               RETURNING 1)
           SELECT (SELECT count(*) FROM d), (SELECT count(*) FROM up)""").format(
        source=source, table=table, keys=key_list, measures=measure_list,
        sets=sql.SQL(", ").join(sets), guard=guard)
    # A sum kept in the type its declaration gives may outgrow it: the statement then fails
    # (numeric_value_out_of_range); under a savepoint the batch is still there to name the
    # key, read only then (the usual commit makes no extra pass).
    bounded = [(n, m) for n, m in shape.measures if m.bounded_sum]
    if bounded:
        cur.execute("SAVEPOINT onceflow_apply")
    try:
        cur.execute(query, params)
    except psycopg2.errors.NumericValueOutOfRange as error:
        if not bounded:
            raise
        cur.execute("ROLLBACK TO SAVEPOINT onceflow_apply")
        raise _overflow(cur, shape, opaque, source, params, bounded) from error
    expected, written = cur.fetchone()
    if bounded:
        cur.execute("RELEASE SAVEPOINT onceflow_apply")
    if opaque and written != expected:
        raise StaleBatch(f"{shape.name}: {expected - written} key(s) hold a txid newer than "
                         f"{txid}; a batch older than the state is never applied")
    return written


_INTEGER_RANGES = {"smallint": (-2**15, 2**15 - 1), "integer": (-2**31, 2**31 - 1),
                   "bigint": (-2**63, 2**63 - 1)}
_WIDER = {"smallint": "integer", "integer": "bigint", "bigint": "numeric(38,0)"}


def _fits(pg_type: str, value: sql.Composable) -> sql.Composable:
    """Whether ``value`` (a numeric) fits ``pg_type``, as SQL that cannot fail."""
    match = _NUMERIC.match(pg_type)
    if match:
        precision, scale = int(match.group(1)), int(match.group(2))
        return sql.SQL("abs(round({v}, {s})) < {limit}").format(
            v=value, s=sql.Literal(scale), limit=sql.Literal(10 ** (precision - scale)))
    low, high = _INTEGER_RANGES[pg_type]
    return sql.SQL("{v} BETWEEN {lo} AND {hi}").format(v=value, lo=sql.Literal(low),
                                                       hi=sql.Literal(high))


def _wider(pg_type: str, total) -> str:
    """A type that holds ``total`` with room to grow (an example for the fix)."""
    match = _NUMERIC.match(pg_type)
    if not match:
        return _WIDER[pg_type]
    precision, scale = int(match.group(1)), int(match.group(2))
    digits = len(str(int(abs(total)))) + scale
    return f"numeric({min(38, max(precision + 1, digits + 2))},{scale})"


def _overflow(cur, shape: Shape, opaque: bool, source: sql.Composable, params: Mapping,
              bounded: list[tuple[str, Measure]]) -> StateOverflow:
    """Which key's running total outgrew its declared type (the batch's rows joined with
    what the table holds, as apply_batch would have combined them), as a refusal naming the
    table, the key, the column, the type and the fix."""
    keys = [c for c, _ in shape.key]
    same = sql.SQL(" AND ").join(sql.SQL("s.{k} = d.{k}").format(k=sql.Identifier(k))
                                 for k in keys)
    for name, measure in bounded:
        column = sql.Identifier(name)
        if opaque:  # a replay of the txid starts again from the previous value
            base = sql.SQL("CASE WHEN s.txid = %(txid)s THEN s.{} ELSE s.{} END").format(
                sql.Identifier(f"prev_{name}"), column)
            applied = sql.SQL("s.txid IS NULL OR s.txid <= %(txid)s")
        else:
            base = sql.SQL("s.{}").format(column)
            applied = sql.SQL("s.txid IS NULL OR s.txid < %(txid)s")
        total = sql.SQL("(coalesce({b}, 0)::numeric + d.{m}::numeric)").format(b=base, m=column)
        cur.execute(sql.SQL(
            """SELECT {keys}, coalesce({base}, 0), d.{m}, {total}, count(*) OVER ()
               FROM ({source}) AS d LEFT JOIN {table} AS s ON {same}
               WHERE ({applied}) AND NOT ({fits})
               ORDER BY abs({total}) DESC LIMIT 1""").format(
            keys=sql.SQL(", ").join(sql.SQL("d.{}").format(sql.Identifier(k)) for k in keys),
            base=base, m=column, total=total, source=source, table=sql.Identifier(shape.name),
            same=same, applied=applied, fits=_fits(measure.type, total)), params)
        row = cur.fetchone()
        if row is None:
            continue
        held, added, value, count = row[len(keys):]
        key = ", ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}"
                        for k, v in zip(keys, row[:len(keys)], strict=True))
        wider = _wider(measure.type, value)
        alter = f"ALTER COLUMN {name} TYPE {wider}" + (
            f", ALTER COLUMN prev_{name} TYPE {wider}" if opaque else "")
        more = f" (and {count - 1} more key(s))" if count > 1 else ""
        return StateOverflow(
            f"state {shape.name}: measures[{name!r}] = {measure.describe()} for key ({key}) "
            f"would be {value} (the table holds {held}, txid {params['txid']} adds {added})"
            f"{more}: over {measure.type}, the type its declaration gives column {name}. No "
            "record is at fault and none is dropped: the txid cannot commit while the column "
            f"is this narrow. Declare a wider type (e.g. {wider}), alter the table to it "
            f"(ALTER TABLE {shape.name} {alter}), then run the txid again")
    return StateOverflow(f"state {shape.name}: a running total outgrew the type its "
                         "declaration gives it (the key was not found again): declare a wider "
                         "type for its sums, alter the table to it, then run the txid again")


def copy_out(cur, pipeline: str, shape: Shape, groups: int, keys: Mapping, out) -> None:
    """Write the attempt's batch for ``shape`` (staged_batch) as CSV into ``out``."""
    cur.copy_expert(cur.mogrify(sql.SQL("COPY ({}) TO STDOUT (FORMAT csv)").format(
        staged_batch(pipeline, shape, groups)), keys).decode(), out)


def apply_csv(cur, shape: Shape, opaque: bool, txid: int, rows_csv) -> int:
    """Apply a whole batch given as CSV (copy_out's) in the state's own database: COPY into
    a temporary table, then apply_batch, undoing this txid's earlier writes to keys the batch
    no longer has."""
    temp = sql.Identifier(f"onceflow_batch_{shape.name}"[:63])
    if shape.append:
        names = list(shape.columns)
    else:
        names = list(shape.key) + [(n, m.staged_type()) for n, m in shape.measures]
    cols = sql.SQL(", ").join(sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(t))
                              for c, t in names)
    cur.execute(sql.SQL("CREATE TEMP TABLE IF NOT EXISTS {} ({}) ON COMMIT DELETE ROWS").format(
        temp, cols))
    cur.execute(sql.SQL("TRUNCATE {}").format(temp))
    cur.copy_expert(cur.mogrify(sql.SQL("COPY {} FROM STDIN (FORMAT csv)").format(temp)).decode(),
                    rows_csv)
    return apply_batch(cur, shape, opaque, txid, sql.SQL("SELECT * FROM {}").format(temp),
                       revert_absent=True)


def read_table(cur, shape: Shape, opaque: bool = False, *, since: int = 0,
               until: int | None = None) -> list[dict]:
    """Every row of the state table (whose txid is in ``since..until``): key columns,
    measures and txid (with ``opaque``, the previous values too); an append table's columns
    and txid."""
    if shape.append:
        names = [c for c, _ in shape.columns] + ["txid"]
    else:
        names = [c for c, _ in shape.key] + [n for n, _ in shape.measures] + ["txid"]
        if opaque:
            names += ["prev_txid"] + [f"prev_{n}" for n, _ in shape.measures]
    cur.execute(sql.SQL("SELECT {} FROM {} WHERE txid >= %s AND (%s::bigint IS NULL "
                        "OR txid <= %s)").format(
        sql.SQL(", ").join(sql.Identifier(n) for n in names), sql.Identifier(shape.name)),
        (since, until, until))
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
