"""Staging: the processing phase's results, keyed by (txid, attempt, group).

A group's staging is replaced as a whole in one PostgreSQL transaction (delete, COPY, marker),
under a share lock on the transaction's row and only while the attempt is current and
uncommitted, so a re-run never adds to it and a zombie attempt can never stage.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import IO

from onceflow.db import transaction
from onceflow.txn import Fenced, TransactionAttempt, current_attempt, delete_staging

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
                replayed: int = 0) -> Staged:
    """Replace the staging of (``ta``, ``group``) with the given CSV data.

    ``deltas_csv``: rows ``state_name,key,delta``; ``rejects_csv``: rows
    ``topic,partition,offset,error``; ``failures_csv``: rows
    ``partition,offset,replayed,payload,error`` (roots whose tree failed). ``records``: source
    records read, ``replayed``: backflow items read. Raises Fenced when ``ta`` is not the
    current, uncommitted attempt.
    """
    keys = {"pipeline": pipeline, "txid": ta.txid, "attempt": ta.attempt, "grp": group}
    with transaction(conn) as cur:
        txn_state = current_attempt(cur, pipeline, ta, lock="share")
        if txn_state != "planned":
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
        cur.execute(
            """INSERT INTO staged_deltas (pipeline, txid, attempt, grp, state_name, key, delta)
               SELECT %(pipeline)s, %(txid)s, %(attempt)s, %(grp)s, state_name, key, sum(delta)
               FROM onceflow_in_deltas GROUP BY state_name, key""",
            keys,
        )
        delta_rows = cur.rowcount
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
                                          delta_rows, replayed, failed)
               VALUES (%(pipeline)s, %(txid)s, %(attempt)s, %(grp)s, %(records)s, %(rejected)s,
                       %(delta_rows)s, %(replayed)s, %(failed)s)""",
            {**keys, "records": records, "rejected": rejected, "delta_rows": delta_rows,
             "replayed": replayed, "failed": failed},
        )
    staged = Staged(ta, group, records, rejected, delta_rows, replayed, failed)
    log.info("STAGED pipeline=%s %s group=%d records=%d replayed=%d rejected=%d failed=%d "
             "delta_rows=%d", pipeline, ta, group, records, replayed, rejected, failed,
             delta_rows)
    return staged
