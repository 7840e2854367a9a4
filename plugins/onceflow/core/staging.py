"""Staging: the processing phase's results, keyed by (txid, attempt, group).

A group's staging is replaced as a whole in one PostgreSQL transaction (delete, COPY, marker),
under a share lock on the transaction's row and only while the attempt is current and
uncommitted, so a re-run never adds to it and a zombie attempt can never stage.

The staged rows live in UNLOGGED tables (no WAL: staging is rewritten often and is cheap to
redo), which PostgreSQL empties when it recovers from a crash. The marker row in
``staged_groups`` and the group's contribution to each sink (``staged_contributions``: keys,
total, digest) are logged. The marker records how many rows of each kind the group staged; the
commit checks them inside its own transaction (``proof``: rejects and failures counted again,
delta rows by a probe per group and sink) and refuses an attempt whose staging is not whole,
which is then processed again. So a crash loses work, never data.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO

from psycopg2 import sql

from onceflow.core.db import transaction
from onceflow.core.errors import Fenced
from onceflow.core.state_tables import KEY_WEIGHT
from onceflow.core.tables import STAGING_SCHEMA
from onceflow.core.txlog import TransactionAttempt, TxState, fence

STAGING_TABLES = ("staged_deltas", "staged_rejects", "staged_failures", "staged_contributions",
                  "staged_groups")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Staged:
    attempt: TransactionAttempt
    group: int
    records: int
    rejected: int
    delta_rows: int
    replayed: int = 0
    failed: int = 0


def stage_group(conn, pipeline: str, ta: TransactionAttempt, group: int, *,
                deltas_csv: IO, rejects_csv: IO, records: int, failures_csv: IO | None = None,
                replayed: int = 0, stateful: tuple[str, ...] = (),
                tables: Mapping[str, tuple[list[str], IO]] | None = None,
                before_commit: Callable[[], None] | None = None) -> Staged:
    """Replace the staging of (``ta``, ``group``) with the given CSV data.

    ``deltas_csv``: rows ``state_name,key,delta``; ``rejects_csv``: rows
    ``topic,partition,offset,error``; ``failures_csv``: rows
    ``partition,offset,replayed,payload,error`` (roots whose tree failed). ``records``: source
    records read, ``replayed``: backflow items read; ``stateful``: the stateful bolts whose
    changes this group prepared; ``tables``: per typed state, its staging columns and CSV
    rows (``txid,attempt,grp`` first, then those columns; onceflow.core.tables), copied
    straight into its staging table. Raises Fenced when ``ta`` is not the current,
    uncommitted attempt. ``before_commit`` runs last inside the transaction (fault injection
    in tests).
    """
    keys = {"pipeline": pipeline, "txid": ta.txid, "attempt": ta.attempt, "grp": group}
    with transaction(conn) as cur:
        txn_state = fence(cur, pipeline, ta, lock="share")
        if txn_state is not TxState.PLANNED:
            raise Fenced(f"{ta} of {pipeline} is {txn_state}: its staging is closed")
        delete_staging(cur, pipeline, ta.txid, attempt=ta.attempt, group=group)
        # COPY into temporary tables then one INSERT ... SELECT adds the key columns without
        # repeating them on every CSV line.
        cur.execute(
            """CREATE TEMP TABLE IF NOT EXISTS onceflow_in_deltas
                   (state_name text, key text, delta bigint) ON COMMIT DELETE ROWS;
               CREATE TEMP TABLE IF NOT EXISTS onceflow_in_rejects
                   (topic text, partition integer, "offset" bigint, error text)
                   ON COMMIT DELETE ROWS"""
        )
        cur.copy_expert("COPY onceflow_in_deltas FROM STDIN (FORMAT csv)", deltas_csv)
        failed = 0
        if failures_csv is not None:
            cur.execute(
                """CREATE TEMP TABLE IF NOT EXISTS onceflow_in_failures
                       (partition integer, "offset" bigint, replayed boolean, payload text,
                        error text) ON COMMIT DELETE ROWS"""
            )
            cur.copy_expert("COPY onceflow_in_failures FROM STDIN (FORMAT csv)", failures_csv)
            cur.execute(
                """INSERT INTO staged_failures (pipeline, txid, attempt, grp, partition,
                                                "offset", replayed, payload, error)
                   SELECT %(pipeline)s, %(txid)s, %(attempt)s, %(grp)s, partition, "offset",
                          replayed, payload, error
                   FROM onceflow_in_failures""",
                keys,
            )
            failed = cur.rowcount
        cur.copy_expert("COPY onceflow_in_rejects FROM STDIN (FORMAT csv)", rejects_csv)
        # one row per (state, key) and group already: Spark summed them
        cur.execute(
            """INSERT INTO staged_deltas (pipeline, txid, attempt, grp, state_name, key, delta)
               SELECT %(pipeline)s, %(txid)s, %(attempt)s, %(grp)s, state_name, key, delta
               FROM onceflow_in_deltas""",
            keys,
        )
        delta_rows = cur.rowcount
        # What the group adds to each sink, summed here, off the serial commit, which only
        # adds its groups' figures up (onceflow.core.state_tables.record_contributions).
        cur.execute(
            sql.SQL("""INSERT INTO staged_contributions
                           (pipeline, txid, attempt, grp, state_name, keys, total, digest)
                       SELECT %(pipeline)s, %(txid)s, %(attempt)s, %(grp)s, state_name,
                              count(*), sum(delta), sum({weight}::numeric * delta)
                       FROM onceflow_in_deltas GROUP BY state_name""").format(
                weight=sql.SQL(KEY_WEIGHT.format("key"))),
            keys,
        )
        for state, (names, rows_csv) in (tables or {}).items():
            cur.copy_expert(cur.mogrify(
                sql.SQL("COPY {} ({}) FROM STDIN (FORMAT csv)").format(
                    sql.Identifier(STAGING_SCHEMA, f"{pipeline}.{state}"),
                    sql.SQL(", ").join(map(sql.Identifier, ["txid", "attempt", "grp", *names]))),
            ).decode(), rows_csv)
            delta_rows += cur.rowcount
        cur.execute(
            """INSERT INTO staged_rejects
                   (pipeline, txid, attempt, grp, topic, partition, "offset", error)
               SELECT %(pipeline)s, %(txid)s, %(attempt)s, %(grp)s, topic, partition, "offset",
                      error
               FROM onceflow_in_rejects""",
            keys,
        )
        rejected = cur.rowcount
        cur.execute(
            """INSERT INTO staged_groups (pipeline, txid, attempt, grp, records, rejected,
                                          delta_rows, replayed, failed, stateful)
               VALUES (%(pipeline)s, %(txid)s, %(attempt)s, %(grp)s, %(records)s, %(rejected)s,
                       %(delta_rows)s, %(replayed)s, %(failed)s, %(stateful)s)""",
            {**keys, "records": records, "rejected": rejected, "delta_rows": delta_rows,
             "replayed": replayed, "failed": failed, "stateful": list(stateful)},
        )
        if before_commit is not None:
            before_commit()
    staged = Staged(ta, group, records, rejected, delta_rows, replayed, failed)
    log.info("STAGED pipeline=%s %s group=%d records=%d replayed=%d rejected=%d failed=%d "
             "delta_rows=%d", pipeline, ta, group, records, replayed, rejected, failed,
             delta_rows)
    return staged


def delete_staging(cur, pipeline: str, txid: int, *, attempt: int | None = None,
                   group: int | None = None) -> None:
    """Drop the staging of a txid (or of one attempt, or of one group of one attempt)."""
    where = [sql.SQL("pipeline = %(pipeline)s AND txid = %(txid)s")]
    if attempt is not None:
        where.append(sql.SQL("attempt = %(attempt)s"))
    if group is not None:
        where.append(sql.SQL("grp = %(grp)s"))
    params = {"pipeline": pipeline, "txid": txid, "attempt": attempt, "grp": group}
    for table in STAGING_TABLES:
        cur.execute(
            sql.SQL("DELETE FROM {} WHERE {}").format(sql.Identifier(table),
                                                      sql.SQL(" AND ").join(where)),
            params,
        )
    for table in typed_staging(cur, pipeline):  # one table per pipeline: no pipeline column
        cur.execute(sql.SQL("DELETE FROM {} WHERE {}").format(
            table, sql.SQL(" AND ").join([sql.SQL("txid = %(txid)s"), *where[1:]])), params)


def delete_committed(cur, pipeline: str, txid: int) -> None:
    """Drop the staging of committed ``txid`` and of any txid before it (none can commit
    again) that a crash after its commit left behind: the markers tell which txids have some."""
    cur.execute("SELECT DISTINCT txid FROM staged_groups WHERE pipeline = %s AND txid <= %s "
                "ORDER BY 1", (pipeline, txid))
    for (done,) in cur.fetchall():
        delete_staging(cur, pipeline, done)


def typed_staging(cur, pipeline: str) -> list[sql.Composable]:
    """The staging tables of the pipeline's typed states (onceflow.core.tables)."""
    cur.execute("""SELECT c.relname FROM pg_class c
                   JOIN pg_namespace n ON n.oid = c.relnamespace
                   WHERE n.nspname = %s AND c.relkind = 'r'
                     AND split_part(c.relname, '.', 1) = %s ORDER BY 1""",
                (STAGING_SCHEMA, pipeline))
    return [sql.Identifier(STAGING_SCHEMA, name) for (name,) in cur.fetchall()]


@dataclass(frozen=True)
class Proof:
    """What the commit found staged for an attempt, against what processing recorded."""

    groups: int  # groups the batch has
    staged_groups: tuple[int, ...]  # groups with a marker row
    expected: tuple[int, int, int]  # delta rows, rejects, failures the markers recorded
    found: tuple[int, int, int]  # the rows actually there
    stateful: tuple[str, ...]  # stateful bolts whose changes the groups prepared

    @property
    def missing_groups(self) -> list[int]:
        return sorted(set(range(self.groups)) - set(self.staged_groups))

    @property
    def whole(self) -> bool:
        return self.expected == self.found


def proof(cur, pipeline: str, ta: TransactionAttempt, groups: int) -> Proof:
    """Count the attempt's staging (inside the commit's transaction)."""
    keys = {"pipeline": pipeline, "txid": ta.txid, "attempt": ta.attempt}
    cur.execute(
        """SELECT coalesce(array_agg(grp ORDER BY grp), '{}'),
                  coalesce(sum(delta_rows), 0), coalesce(sum(rejected), 0),
                  coalesce(sum(failed), 0),
                  coalesce((SELECT array_agg(DISTINCT s) FROM staged_groups g2,
                            unnest(g2.stateful) s
                            WHERE g2.pipeline = %(pipeline)s AND g2.txid = %(txid)s
                              AND g2.attempt = %(attempt)s), '{}')
           FROM staged_groups
           WHERE pipeline = %(pipeline)s AND txid = %(txid)s AND attempt = %(attempt)s""",
        keys,
    )
    staged, deltas, rejects, failures, stateful = cur.fetchone()
    # A crash empties the unlogged tables whole and nothing deletes part of a group's rows,
    # so each logged figure whose rows are still there (one index probe, with its values: a
    # join may be planned as a read of every row) counts its keys, without a pass over them.
    cur.execute("""SELECT grp, state_name, keys FROM staged_contributions
                   WHERE pipeline = %(pipeline)s AND txid = %(txid)s
                     AND attempt = %(attempt)s""", keys)
    found = [0]
    for group, state, rows in cur.fetchall():
        cur.execute("""SELECT EXISTS (SELECT 1 FROM staged_deltas
                                      WHERE pipeline = %(pipeline)s AND txid = %(txid)s
                                        AND attempt = %(attempt)s AND state_name = %(state)s
                                        AND grp = %(grp)s)""",
                    {**keys, "state": state, "grp": group})
        found[0] += rows if cur.fetchone()[0] else 0
    for table in ("staged_rejects", "staged_failures"):
        cur.execute(sql.SQL("SELECT count(*) FROM {} WHERE pipeline = %(pipeline)s "
                            "AND txid = %(txid)s AND attempt = %(attempt)s")
                    .format(sql.Identifier(table)), keys)
        found.append(cur.fetchone()[0])
    for table in typed_staging(cur, pipeline):  # typed states' rows count as delta rows
        cur.execute(sql.SQL("SELECT count(*) FROM {} WHERE txid = %(txid)s "
                            "AND attempt = %(attempt)s").format(table), keys)
        found[0] += cur.fetchone()[0]
    return Proof(groups, tuple(staged), (int(deltas), int(rejects), int(failures)),
                 tuple(found), tuple(sorted(stateful)))
