"""The identity of a transaction attempt and the fence every write checks."""

from __future__ import annotations

from dataclasses import dataclass

from psycopg2 import sql

STAGING_TABLES = ("staged_deltas", "staged_rejects", "staged_failures", "staged_groups")


@dataclass(frozen=True, order=True)
class TransactionAttempt:
    txid: int
    attempt: int

    def __str__(self) -> str:
        return f"txid {self.txid} attempt {self.attempt}"


class Fenced(RuntimeError):
    """This attempt is no longer the transaction's current one (a zombie): it may not write."""


_ROW_LOCKS = {"": sql.SQL(""), "share": sql.SQL("FOR SHARE"), "update": sql.SQL("FOR UPDATE")}


def current_attempt(cur, pipeline: str, ta: TransactionAttempt, *, lock: str = "") -> str:
    """The state of ``ta``'s transaction; raises Fenced unless ``ta`` is its current attempt.

    ``lock``: "" (none), "share" (staging: excludes a concurrent commit) or "update" (commit).
    """
    cur.execute(
        sql.SQL("SELECT attempt, state FROM transactions WHERE pipeline = %s AND txid = %s {}")
        .format(_ROW_LOCKS[lock]),
        (pipeline, ta.txid),
    )
    row = cur.fetchone()
    if row is None:
        raise LookupError(f"pipeline {pipeline!r} has no txid {ta.txid}")
    attempt, txn_state = row
    if attempt != ta.attempt:
        raise Fenced(f"{ta} of {pipeline} is fenced: attempt {attempt} is current")
    return txn_state


def delete_staging(cur, pipeline: str, txid: int, *, attempt: int | None = None,
                   group: int | None = None) -> None:
    """Drop the staging of a txid (or of one attempt, or of one group of one attempt)."""
    where = [sql.SQL("pipeline = %(pipeline)s AND txid = %(txid)s")]
    if attempt is not None:
        where.append(sql.SQL("attempt = %(attempt)s"))
    if group is not None:
        where.append(sql.SQL("grp = %(grp)s"))
    for table in STAGING_TABLES:
        cur.execute(
            sql.SQL("DELETE FROM {} WHERE {}").format(sql.Identifier(table),
                                                      sql.SQL(" AND ").join(where)),
            {"pipeline": pipeline, "txid": txid, "attempt": attempt, "grp": group},
        )
