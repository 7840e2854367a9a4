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
import json
from collections.abc import Mapping
from typing import IO

from psycopg2 import sql

from onceflow.core.errors import StaleBatch
from onceflow.core.pipeline import StateSpec
from onceflow.core.txlog import TransactionAttempt

# A key's weight in a contribution's digest: PostgreSQL's 64-bit hash of its bytes (the one
# hash partitioning uses, stable across versions, and cheaper than md5). A change moved
# from one key to another changes the digest unless both keys weigh the same (one chance in
# 2**64). Verify asks PostgreSQL for the weights of the keys it re-ran (key_weights).
KEY_WEIGHT = 'hashtextextended({} COLLATE "C", 0)'


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


# MERGE (PostgreSQL 15+): a join, then plain inserts and updates, where INSERT ... ON
# CONFLICT probes the key index per row and inserts speculatively: less work for new
# keys. The commit holds the pipeline's lock, so no one else inserts these keys meanwhile
# (if someone did, the commit fails on the key and is retried: nothing is applied twice).
# An opaque key whose stored txid is newer is not written, so the rows written then differ
# from the batch's keys (StaleBatch). The staging's statistics cannot tell how many rows an
# attempt staged: read straight from it, a batch of any size looks like one row and is
# joined one index probe per key. So the join is planned from a count: the keys the batch's
# one group recorded when it staged (the MERGE then reads the staging itself), or else a
# copy of the batch into a temp table, which counts it and which the planner sizes.
_MERGE = {
    "opaque": """
        MERGE INTO {table} AS s USING {source} AS d ON s.key = d.key
        WHEN MATCHED AND s.txid <= %(txid)s THEN UPDATE SET
            value = CASE WHEN s.txid = %(txid)s THEN s.prev_value ELSE s.value END + d.delta,
            prev_value = CASE WHEN s.txid = %(txid)s THEN s.prev_value ELSE s.value END,
            txid = %(txid)s
        WHEN NOT MATCHED THEN INSERT (key, txid, value, prev_value)
            VALUES (d.key, %(txid)s, d.delta, 0)""",
    "transactional": """
        MERGE INTO {table} AS s USING {source} AS d ON s.key = d.key
        WHEN MATCHED AND s.txid < %(txid)s THEN UPDATE SET
            value = s.value + d.delta, txid = %(txid)s
        WHEN NOT MATCHED THEN INSERT (key, txid, value) VALUES (d.key, %(txid)s, d.delta)""",
}
_MERGE_SINCE = 150000  # server_version_num of PostgreSQL 15

# Before PostgreSQL 15 (a state in an older database of its own): one upsert per key.
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


# A batch of at least this share of the state's rows is hash-joined (one scan of the state
# table); a smaller one probes the key index once per key, cheaper than reading every row.
# A batch of more keys than the state holds is mostly new keys: it takes the copy, whose
# plan hashes the state and inserts the new keys in the order they were staged (a hash
# join of the batch would insert them in its hash table's order, spread over the index).
HASH_JOIN_SHARE = 0.1


def apply_source(cur, spec: StateSpec, txid: int, source: sql.Composable,
                 params: Mapping | None = None, *, revert_absent: bool = False,
                 keys: int | None = None) -> int:
    """Apply the deltas ``source`` yields (columns key, delta; one row per key) at ``txid``.

    Returns the rows written. An opaque table raises StaleBatch when a key's stored txid is
    newer than ``txid`` (the caller's transaction must then roll back); a transactional one
    skips keys already at ``txid`` (applied before). ``revert_absent``: first put keys left at
    ``txid`` by an earlier try, and absent from this batch, back to prev_value (opaque only).
    ``keys``: how many rows ``source`` yields, when the caller knows (then, up to the
    state's rows, it is read once, by the MERGE itself).
    """
    table = sql.Identifier(spec.table)
    params = {**(params or {}), "txid": txid}
    if revert_absent and spec.kind == "opaque":
        cur.execute(sql.SQL(_REVERT_ABSENT).format(table=table, source=source), params)
    rows = _planned_rows(cur, table) if keys is not None else 0.0
    if cur.connection.server_version >= _MERGE_SINCE and keys is not None and keys <= rows:
        expected, written = keys, _merge_counted(cur, spec, table, source, params,
                                                 hash_join=keys >= HASH_JOIN_SHARE * rows)
    elif cur.connection.server_version >= _MERGE_SINCE:
        expected, written = _merge(cur, spec, table, source, params)
    else:
        cur.execute(sql.SQL(_UPSERT[spec.kind]).format(table=table, source=source), params)
        expected, written = cur.fetchone()
    if spec.kind == "opaque" and written != expected:
        raise StaleBatch(
            f"{spec.table}: {expected - written} key(s) hold a txid newer than {txid}; "
            "a batch older than the state is never applied"
        )
    return written


def _merge(cur, spec: StateSpec, table: sql.Identifier, source: sql.Composable,
           params: Mapping) -> tuple[int, int]:
    """(keys in the batch, rows written) of the MERGE of ``source`` into ``table``."""
    cur.execute("CREATE TEMP TABLE IF NOT EXISTS onceflow_apply (key text, delta bigint) "
                "ON COMMIT DELETE ROWS")
    cur.execute("TRUNCATE onceflow_apply")
    cur.execute(sql.SQL("INSERT INTO onceflow_apply (key, delta) SELECT key, delta FROM ({}) d")
                .format(source), params)
    expected = cur.rowcount
    cur.execute(sql.SQL(_MERGE[spec.kind]).format(table=table,
                                                  source=sql.Identifier("onceflow_apply")),
                params)
    return expected, cur.rowcount


def _planned_rows(cur, table: sql.Identifier) -> float:
    """The rows the planner expects ``table`` to hold (its statistics, scaled to its size)."""
    cur.execute(sql.SQL("EXPLAIN (FORMAT JSON) SELECT 1 FROM {}").format(table))
    plan = cur.fetchone()[0]
    plan = json.loads(plan) if isinstance(plan, str) else plan
    return float(plan[0]["Plan"]["Plan Rows"])


def _merge_counted(cur, spec: StateSpec, table: sql.Identifier, source: sql.Composable,
                   params: Mapping, *, hash_join: bool) -> int:
    """Rows written by the MERGE of ``source`` into ``table``: a hash join of the batch
    with one scan of the state, or one key-index probe per key, whatever the planner
    believes of ``source``."""
    if hash_join:  # this transaction only, and put back before its next statement
        cur.execute("SELECT current_setting('enable_nestloop'), "
                    "set_config('enable_nestloop', 'off', true)")
        was = cur.fetchone()[0]
    cur.execute(sql.SQL(_MERGE[spec.kind]).format(table=table,
                                                  source=sql.SQL("({})").format(source)),
                params)
    written = cur.rowcount
    if hash_join:
        cur.execute("SELECT set_config('enable_nestloop', %s, true)", (was,))
    return written


def staged_keys(cur, params: Mapping) -> int | None:
    """The keys a batch of one processing group staged for a state (``params``: pipeline,
    txid, attempt, state), as the group recorded them when it staged (staged_contributions:
    one row per key); None when it recorded none."""
    cur.execute("""SELECT count(*), sum(keys) FROM staged_contributions
                   WHERE pipeline = %(pipeline)s AND txid = %(txid)s
                     AND attempt = %(attempt)s AND state_name = %(state)s""", params)
    groups, keys = cur.fetchone()
    return int(keys) if groups == 1 else None


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


def key_weights(cur, keys: list[str]) -> dict[str, int]:
    """KEY_WEIGHT of each of ``keys``."""
    cur.execute(sql.SQL("SELECT k, {} FROM unnest(%s::text[]) AS k").format(
        sql.SQL(KEY_WEIGHT.format("k"))), (keys,))
    return dict(cur.fetchall())


def record_contributions(cur, pipeline: str, ta: TransactionAttempt) -> None:
    """The commit's record of what ``ta`` adds to each count state (batch_contributions):
    per sink, the keys it writes, the sum of its deltas and their digest (the sum of
    key_weight(key) * delta), added up from the figures its groups staged
    (staged_contributions). Sums add up over groups; a key can come from several groups, so
    a sink fed by more than one group has its distinct keys counted in the staging."""
    cur.execute(
        """INSERT INTO batch_contributions (pipeline, txid, state_name, keys, total, digest)
           SELECT c.pipeline, c.txid, c.state_name,
                  CASE WHEN count(*) = 1 THEN sum(c.keys)
                       ELSE (SELECT count(*) FROM (
                                SELECT DISTINCT d.key FROM staged_deltas d
                                WHERE d.pipeline = c.pipeline AND d.txid = c.txid
                                  AND d.attempt = c.attempt
                                  AND d.state_name = c.state_name) AS k) END,
                  sum(c.total), sum(c.digest)
           FROM staged_contributions c
           WHERE c.pipeline = %(pipeline)s AND c.txid = %(txid)s AND c.attempt = %(attempt)s
           GROUP BY c.pipeline, c.txid, c.attempt, c.state_name
           ON CONFLICT (pipeline, txid, state_name) DO UPDATE
           SET keys = EXCLUDED.keys, total = EXCLUDED.total, digest = EXCLUDED.digest""",
        {"pipeline": pipeline, "txid": ta.txid, "attempt": ta.attempt})


def totals(cur, spec: StateSpec) -> tuple[int, int, int]:
    """(keys, sum of values, sum of key_weight(key) * value) of a count state's table: one
    pass in SQL, what the contributions of every txid must add up to."""
    cur.execute(sql.SQL("SELECT count(*), coalesce(sum(value), 0), "
                        "coalesce(sum({}::numeric * value), 0) FROM {}").format(
        sql.SQL(KEY_WEIGHT.format("key")), sql.Identifier(spec.table)))
    keys, total, digest = cur.fetchone()
    return keys, int(total), int(digest)


def read_rows_where(cur, spec: StateSpec, first: int, last: int, keys: list[str]
                    ) -> dict[str, tuple[int, int, int]]:
    """read_rows for the keys last written by a txid in ``first..last`` and the keys
    ``keys`` (what a range check needs: not the whole table)."""
    prev = sql.SQL("prev_value" if spec.kind == "opaque" else "0")
    cur.execute(sql.SQL("SELECT key, value, {}, txid FROM {} "
                        "WHERE txid BETWEEN %s AND %s OR key = ANY(%s)").format(
        prev, sql.Identifier(spec.table)), (first, last, keys))
    return {key: (value, prev_value, txid) for key, value, prev_value, txid in cur.fetchall()}


def contributions(cur, pipeline: str, first: int, last: int
                  ) -> dict[tuple[int, str], tuple[int, int, int]]:
    """(txid, sink) -> (keys, total, digest) as the commits of ``first..last`` recorded."""
    cur.execute("""SELECT txid, state_name, keys, total, digest FROM batch_contributions
                   WHERE pipeline = %s AND txid BETWEEN %s AND %s""", (pipeline, first, last))
    return {(txid, state): (keys, int(total), int(digest))
            for txid, state, keys, total, digest in cur.fetchall()}


def contribution_sums(cur, pipeline: str) -> tuple[int, dict[str, tuple[int, int]]]:
    """The first txid whose commit recorded its contributions, and per sink the sums of
    total and digest over every committed txid's record."""
    cur.execute("SELECT contributions_since FROM pipelines WHERE name = %s", (pipeline,))
    since = cur.fetchone()[0]
    cur.execute("""SELECT state_name, sum(total), sum(digest) FROM batch_contributions
                   WHERE pipeline = %s GROUP BY state_name""", (pipeline,))
    return since, {state: (int(total), int(digest)) for state, total, digest in cur.fetchall()}
