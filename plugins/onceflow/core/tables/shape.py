"""What a typed state, upsert or append table is declared as: its measures (Sum, Count, Min,
Max, Last), the declaration's checks, and its Shape (the columns the Spark side and the SQL
need)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from psycopg2 import sql

from onceflow.core.errors import ConfigError
from onceflow.core.tables.types import (
    INTEGERS,
    NUMERIC,
    SUMMABLE,
    TYPE_HELP,
    conversion_loss,
    known_type,
    normal_type,
)

STAGING_SCHEMA = "onceflow_staging"
AGGREGATES = ("sum", "count", "min", "max", "last")
ORDER = "_order"  # the staging column that orders Last measures


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
        match = NUMERIC.match(self.type)
        if self.agg == "sum" and match:
            return f"numeric(38,{match.group(2)})"
        if self.agg == "sum" and self.type in INTEGERS:
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
            if measure.agg == "sum" and not (measure.type in SUMMABLE
                                             or NUMERIC.match(measure.type)):
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
