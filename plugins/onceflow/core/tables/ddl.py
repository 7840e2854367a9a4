"""A typed table's DDL: its staging table (made again when the declaration changes) and the
state table itself, refused when it exists with other columns or types than declared."""

from __future__ import annotations

from psycopg2 import sql

from onceflow.core.errors import ConfigError
from onceflow.core.tables.shape import STAGING_SCHEMA, Shape, staging_table


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
