"""State tables: the opaque rule (onceflow.core.opaque) as set-based SQL, one statement per
state and batch.

Opaque table: ``key, txid, value, prev_value`` (absent counts as 0). Transactional table:
``key, txid, value`` (a stored txid equal to the batch's means "already applied").

A replay whose batch no longer has a key that the first try wrote (stored txid == txid, the
key absent now) puts that key back to prev_value. Without this a crash between a state's write
and the coordinator's commit, followed by a different batch, would count the first try's
records twice. Keys are found by txid, so a table that needs it (a state outside the
coordinator's database) has an index on txid. Inside the coordinator's database the state
write and the commit record are one PostgreSQL transaction, so no key can be left at an
uncommitted txid and the scan is skipped.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping
from typing import IO

from psycopg2 import sql

from onceflow.core.errors import StaleBatch
from onceflow.core.pipeline import StateSpec


def needs_revert(spec: StateSpec) -> bool:
    """Whether replays must put absent keys back (an opaque state outside the coordinator)."""
    return spec.kind == "opaque" and spec.conn_id is not None


def ensure_table(cur, spec: StateSpec) -> None:
    prev = sql.SQL(", prev_value bigint NOT NULL DEFAULT 0" if spec.kind == "opaque" else "")
    # fillfactor 50 leaves room for HOT updates: upserts of hot keys rewrite no index.
    cur.execute(
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} (key text PRIMARY KEY, txid bigint NOT NULL, "
            "value bigint NOT NULL{}) WITH (fillfactor = 50)"
        ).format(sql.Identifier(spec.table), prev)
    )
    if needs_revert(spec):
        cur.execute(sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} (txid)").format(
            sql.Identifier(f"{spec.table}_txid"), sql.Identifier(spec.table)))


_UPSERT = {
    "opaque": """
        WITH d AS MATERIALIZED ({source}),
        up AS (
            INSERT INTO {table} AS s (key, txid, value, prev_value)
            SELECT key, %(txid)s, delta, 0 FROM d
            ON CONFLICT (key) DO UPDATE SET
                value = CASE WHEN s.txid = EXCLUDED.txid THEN s.prev_value ELSE s.value END
                        + EXCLUDED.value,
                prev_value = CASE WHEN s.txid = EXCLUDED.txid THEN s.prev_value ELSE s.value END,
                txid = EXCLUDED.txid
            WHERE s.txid <= EXCLUDED.txid
            RETURNING 1)
        SELECT (SELECT count(*) FROM d), (SELECT count(*) FROM up)""",
    "transactional": """
        WITH d AS MATERIALIZED ({source}),
        up AS (
            INSERT INTO {table} AS s (key, txid, value)
            SELECT key, %(txid)s, delta FROM d
            ON CONFLICT (key) DO UPDATE SET value = s.value + EXCLUDED.value, txid = EXCLUDED.txid
            WHERE s.txid < EXCLUDED.txid
            RETURNING 1)
        SELECT (SELECT count(*) FROM d), (SELECT count(*) FROM up)""",
}


_REVERT_ABSENT = """
    UPDATE {table} AS s SET value = s.prev_value
    WHERE s.txid = %(txid)s AND s.value <> s.prev_value
      AND NOT EXISTS (SELECT 1 FROM ({source}) AS d WHERE d.key = s.key)"""


def apply_source(cur, spec: StateSpec, txid: int, source: sql.Composable,
                 params: Mapping | None = None, *, revert_absent: bool = False) -> int:
    """Apply the deltas ``source`` yields (columns key, delta; one row per key) at ``txid``.

    Returns the rows written. An opaque table raises StaleBatch when a key's stored txid is
    newer than ``txid`` (the caller's transaction must then roll back); a transactional one
    skips keys already at ``txid`` (applied before). ``revert_absent``: first put keys left at
    ``txid`` by an earlier try, and absent from this batch, back to prev_value (opaque only).
    """
    table = sql.Identifier(spec.table)
    if revert_absent and spec.kind == "opaque":
        cur.execute(sql.SQL(_REVERT_ABSENT).format(table=table, source=source),
                    {**(params or {}), "txid": txid})
    query = sql.SQL(_UPSERT[spec.kind]).format(table=table, source=source)
    cur.execute(query, {**(params or {}), "txid": txid})
    expected, written = cur.fetchone()
    if spec.kind == "opaque" and written != expected:
        raise StaleBatch(
            f"{spec.table}: {expected - written} key(s) hold a txid newer than {txid}; "
            "a batch older than the state is never applied"
        )
    return written


def staged_source(groups: int = 2) -> sql.Composable:
    """The current attempt's deltas for one state, summed over the batch's groups (a batch
    of one group has one row per key already: Spark summed them)."""
    if groups == 1:
        return sql.SQL(
            """SELECT key, delta FROM staged_deltas
               WHERE pipeline = %(pipeline)s AND txid = %(txid)s AND attempt = %(attempt)s
                 AND state_name = %(state)s""")
    return sql.SQL(
        """SELECT key, sum(delta)::bigint AS delta FROM staged_deltas
           WHERE pipeline = %(pipeline)s AND txid = %(txid)s AND attempt = %(attempt)s
             AND state_name = %(state)s
           GROUP BY key"""
    )


def apply_csv(cur, spec: StateSpec, txid: int, rows_csv: IO, *, revert_absent: bool = True
              ) -> int:
    """Apply a whole batch given as CSV rows ``key,delta`` (COPY into a temp table, then
    upsert), putting keys an earlier try left at ``txid`` back when this batch lacks them."""
    cur.execute("CREATE TEMP TABLE IF NOT EXISTS onceflow_batch (key text, delta bigint) "
                "ON COMMIT DELETE ROWS")
    cur.execute("TRUNCATE onceflow_batch")
    cur.copy_expert("COPY onceflow_batch (key, delta) FROM STDIN (FORMAT csv)", rows_csv)
    source = sql.SQL("SELECT key, sum(delta)::bigint AS delta FROM onceflow_batch GROUP BY key")
    return apply_source(cur, spec, txid, source, revert_absent=revert_absent)


def apply_deltas(cur, spec: StateSpec, txid: int, deltas: Mapping[str, int]) -> int:
    """Apply a whole in-memory batch ``{key: delta}`` (absent keys reverted as in apply_csv)."""
    buf = io.StringIO()
    csv.writer(buf).writerows(deltas.items())
    buf.seek(0)
    return apply_csv(cur, spec, txid, buf)


def read_rows(cur, spec: StateSpec) -> dict[str, tuple[int, int, int]]:
    """key -> (value, prev_value, txid); a transactional table has no prev_value (0)."""
    prev = sql.SQL("prev_value" if spec.kind == "opaque" else "0")
    cur.execute(sql.SQL("SELECT key, value, {}, txid FROM {}").format(
        prev, sql.Identifier(spec.table)))
    return {key: (value, prev_value, txid) for key, value, prev_value, txid in cur.fetchall()}


def read_state(cur, spec: StateSpec) -> dict[str, int]:
    cur.execute(sql.SQL("SELECT key, value FROM {}").format(sql.Identifier(spec.table)))
    return dict(cur.fetchall())
