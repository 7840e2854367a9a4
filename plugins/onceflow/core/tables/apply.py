"""A batch applied to a typed table in the ordered commit: the attempt's rows from staging
(aggregated across groups), the set-based upsert (opaque or transactional) or the append, the
refusal that names a running total outgrowing its type, and the table read back."""

from __future__ import annotations

from collections.abc import Mapping

import psycopg2.errors
from psycopg2 import sql

from onceflow.core.errors import StaleBatch, StateOverflow
from onceflow.core.tables.shape import ORDER, Measure, Shape, staging_table
from onceflow.core.tables.types import NUMERIC


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
    match = NUMERIC.match(pg_type)
    if match:
        precision, scale = int(match.group(1)), int(match.group(2))
        return sql.SQL("abs(round({v}, {s})) < {limit}").format(
            v=value, s=sql.Literal(scale), limit=sql.Literal(10 ** (precision - scale)))
    low, high = _INTEGER_RANGES[pg_type]
    return sql.SQL("{v} BETWEEN {lo} AND {hi}").format(v=value, lo=sql.Literal(low),
                                                       hi=sql.Literal(high))


def _wider(pg_type: str, total) -> str:
    """A type that holds ``total`` with room to grow (an example for the fix)."""
    match = NUMERIC.match(pg_type)
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
