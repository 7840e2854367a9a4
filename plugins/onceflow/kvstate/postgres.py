"""The PostgreSQL provider: tables kv_state, kv_state_prepared, kv_state_attempts and
kv_state_bolts (sql/006_kv_state.sql), in the coordinator's database (commit can then join the
coordinator's commit transaction: ``commit(..., cur=cur)``) or in another one (its own
transaction; the txid rule makes the replay exact). Prepare is one COPY; commit is a handful
of set-based statements in one transaction, whatever the number of keys."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterable, Iterator
from typing import Any

import psycopg2.errors
from psycopg2 import sql

from onceflow.core import db
from onceflow.core.txlog import TransactionAttempt
from onceflow.kvstate.base import (
    DELETED,
    Change,
    NotPrepared,
    Provider,
    RecoveryNeeded,
    StaleBatch,
    as_of,
    check_name,
    dedupe,
    log,
)

_SCHEMA_LOCK = 0x6B767374  # pg_advisory_xact_lock key: one creator of the tables at a time
_SCAN_PAGE = 10_000
_ATTEMPT = sql.SQL("pipeline = %(p)s AND bolt = %(b)s AND txid = %(t)s AND attempt = %(a)s")
# A replay of txid T (an earlier attempt of T committed here) first puts every key of T back to
# its value before T (a key that had none goes), then applies its own changes as usual: keys
# the replay does not change end as before T. Both use the txid index, no join: the plans do
# not depend on table statistics (a freshly filled table has none).
_RESET_NEW = ("DELETE FROM kv_state WHERE pipeline = %(p)s AND bolt = %(b)s AND txid = %(t)s "
              "AND prev_value IS NULL")
_RESET_OLD = ("UPDATE kv_state SET value = prev_value WHERE pipeline = %(p)s AND bolt = %(b)s "
              "AND txid = %(t)s AND value IS DISTINCT FROM prev_value")
_APPLY = """
    INSERT INTO kv_state AS s (pipeline, bolt, namespace, key, txid, value, prev_value)
    SELECT pipeline, bolt, namespace, key, txid, value, NULL FROM kv_state_prepared
    WHERE pipeline = %(p)s AND bolt = %(b)s AND txid = %(t)s AND attempt = %(a)s
    ON CONFLICT (pipeline, bolt, namespace, key) DO UPDATE SET
        prev_value = CASE WHEN s.txid = EXCLUDED.txid THEN s.prev_value ELSE s.value END,
        value = EXCLUDED.value,
        txid = EXCLUDED.txid"""
# Deleted keys nobody reads as of before their txid any more (ordered commit: no txid below T
# is replayed once T commits), and keys absent both before and after T.
_DROP_DELETED = """
    DELETE FROM kv_state WHERE pipeline = %(p)s AND bolt = %(b)s AND value IS NULL
      AND (txid < %(t)s OR (txid = %(t)s AND prev_value IS NULL))"""


def _csv(text: str) -> str:
    return '"' + text.replace('"', '""') + '"'


class PostgresProvider(Provider):
    name = "postgres"

    def __init__(self, dsn: str, *, atomic_with_coordinator: bool):
        self.dsn = dsn
        self.atomic_with_coordinator = atomic_with_coordinator
        self._conn = db.connect(dsn, application_name="onceflow-kvstate")
        self._ensure_schema()

    def _ensure_schema(self) -> None:
        with db.transaction(self._conn) as cur:
            cur.execute("SELECT to_regclass('kv_state_bolts') IS NOT NULL")
            if cur.fetchone()[0]:
                return
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            cur.execute(next(p for p in db.migration_files()
                             if p.name == "006_kv_state.sql").read_text())
        log.info("kv state: created the kv_state tables in database %s",
                 self._conn.info.dbname)

    def close(self) -> None:
        self._conn.close()

    def read(self, pipeline: str, bolt: str, namespace: str, keys: Iterable[str], *,
             txid: int) -> dict[str, Any]:
        keys = list(keys)
        if not keys:
            return {}
        with db.transaction(self._conn) as cur:
            # One primary-key lookup per key, whatever the statistics say (LIMIT keeps the
            # planner from turning it into a join of its choice); compiling it (JIT) for a
            # large prefetch costs more than it saves.
            cur.execute("SET LOCAL jit = off")
            cur.execute(
                """SELECT k.key, s.txid, s.value FROM unnest(%(keys)s::text[]) AS k (key)
                   CROSS JOIN LATERAL (
                       SELECT txid,
                              CASE WHEN txid < %(t)s THEN value ELSE prev_value END::text AS value
                       FROM kv_state WHERE pipeline = %(p)s AND bolt = %(b)s
                         AND namespace = %(n)s AND key = k.key LIMIT 1) AS s""",
                {"p": pipeline, "b": bolt, "n": namespace, "keys": keys, "t": txid})
            rows = cur.fetchall()
        return _visible(rows, txid, namespace)

    def scan(self, pipeline: str, bolt: str, namespace: str, *, txid: int
             ) -> Iterator[tuple[str, Any]]:
        # Keyset pages, each its own short transaction: no cursor is held across the caller's
        # work between pages.
        after = None
        while True:
            with db.transaction(self._conn) as cur:
                cur.execute(
                    """SELECT key, txid, CASE WHEN txid < %(t)s THEN value ELSE prev_value END::text
                       FROM kv_state WHERE pipeline = %(p)s AND bolt = %(b)s
                         AND namespace = %(n)s AND (%(after)s::text IS NULL OR key > %(after)s)
                       ORDER BY key LIMIT %(limit)s""",
                    {"p": pipeline, "b": bolt, "n": namespace, "t": txid, "after": after,
                     "limit": _SCAN_PAGE})
                rows = cur.fetchall()
            yield from _visible(rows, txid, namespace).items()
            if len(rows) < _SCAN_PAGE:
                return
            after = rows[-1][0]

    def prepare(self, pipeline: str, bolt: str, ta: TransactionAttempt,
                changes: Iterable[Change], *, part: int = 0) -> int:
        check_name("pipeline", pipeline)
        check_name("bolt", bolt)
        changes = dedupe(changes)
        started = time.monotonic()
        head = f"{_csv(pipeline)},{_csv(bolt)},{int(ta.txid)},{int(ta.attempt)},{int(part)},"
        lines = [
            f"{head}{_csv(ns)},{_csv(key)},"
            f"{'' if value is DELETED else _csv(_json_text(value))}\n"
            for (ns, key), value in changes.items()
        ]
        keys = {"p": pipeline, "b": bolt, "t": ta.txid, "a": ta.attempt, "part": part}
        try:
            with db.transaction(self._conn) as cur:
                _refuse_committed(cur, keys, ta, pipeline, bolt)
                cur.execute(sql.SQL("DELETE FROM kv_state_prepared WHERE {} AND part = %(part)s")
                            .format(_ATTEMPT), keys)
                cur.copy_expert(
                    "COPY kv_state_prepared (pipeline, bolt, txid, attempt, part, namespace, key,"
                    " value) FROM STDIN (FORMAT csv)", io.StringIO("".join(lines)))
                cur.execute(
                    """INSERT INTO kv_state_attempts (pipeline, bolt, txid, attempt, part, changes)
                       VALUES (%(p)s, %(b)s, %(t)s, %(a)s, %(part)s, %(n)s)
                       ON CONFLICT (pipeline, bolt, txid, attempt, part)
                       DO UPDATE SET changes = EXCLUDED.changes, prepared_at = now()""",
                    {**keys, "n": len(lines)})
        except psycopg2.errors.UniqueViolation as error:
            raise ValueError(
                f"kv state {pipeline}/{bolt}: a key of part {part} of {ta} is prepared by another "
                "part too (a namespace belongs to one part), or by a concurrent prepare of the "
                f"same part ({error.diag.message_detail})") from error
        log.debug("kv state %s/%s: prepared %s part %d: %d changes (%.3fs)", pipeline, bolt, ta,
                  part, len(lines), time.monotonic() - started)
        return len(lines)

    def commit(self, pipeline: str, bolt: str, ta: TransactionAttempt, *, cur=None) -> int:
        if cur is None:
            with db.transaction(self._conn) as own:
                return self._commit(own, pipeline, bolt, ta)
        if not self.atomic_with_coordinator:
            self._refuse_cur(cur)
        theirs, mine = cur.connection.info, self._conn.info
        if (theirs.dbname, theirs.host, theirs.port) != (mine.dbname, mine.host, mine.port):
            raise ValueError(
                f"commit(cur=...) got a cursor of database {theirs.dbname} on {theirs.host}:"
                f"{theirs.port}, but this state lives in {mine.dbname} on {mine.host}:{mine.port}"
                ": pass the coordinator's cursor only to a state in the coordinator's database")
        return self._commit(cur, pipeline, bolt, ta)

    def _commit(self, cur, pipeline: str, bolt: str, ta: TransactionAttempt) -> int:
        started = time.monotonic()
        keys = {"p": pipeline, "b": bolt, "t": ta.txid, "a": ta.attempt}
        where = f"kv state {pipeline}/{bolt}"
        cur.execute("INSERT INTO kv_state_bolts (pipeline, bolt) VALUES (%(p)s, %(b)s) "
                    "ON CONFLICT DO NOTHING", keys)
        cur.execute("SELECT committed_txid, committed_attempt FROM kv_state_bolts "
                    "WHERE pipeline = %(p)s AND bolt = %(b)s FOR UPDATE", keys)
        committed = cur.fetchone()
        cur.execute("""SELECT txid, attempt, sum(changes) FROM kv_state_attempts
                       WHERE pipeline = %(p)s AND bolt = %(b)s AND txid <= %(t)s
                       GROUP BY txid, attempt ORDER BY txid, attempt""", keys)
        prepared = {(t, a): n for t, a, n in cur.fetchall()}
        mine = (ta.txid, ta.attempt) in prepared
        if committed == (ta.txid, ta.attempt) or (committed[0] > ta.txid and not mine):
            _drop_prepared(cur, keys)  # a retried task may have prepared it again: a duplicate
            log.info("%s: %s is committed already: nothing to do", where, ta)
            return 0
        if not mine:
            raise NotPrepared(f"{where}: {ta} has nothing prepared: prepare it (also with no "
                              "changes) before commit")
        if committed[0] > ta.txid:
            raise StaleBatch(f"{where}: {ta} is older than the committed txid {committed[0]}")
        lower = [TransactionAttempt(*t) for t in prepared if t[0] < ta.txid]
        if lower:
            raise RecoveryNeeded(f"{where}: cannot commit {ta}: attempts {lower} of lower txids "
                                 "are still prepared; run recover() first")
        reverted = 0
        if committed[0] == ta.txid:  # an earlier attempt of this txid committed here
            cur.execute(_RESET_NEW, keys)
            reverted = cur.rowcount
            cur.execute(_RESET_OLD, keys)
            reverted += cur.rowcount
        cur.execute(_APPLY, keys)
        applied = cur.rowcount
        cur.execute(_DROP_DELETED, keys)
        _drop_prepared(cur, keys)
        cur.execute("""UPDATE kv_state_bolts SET committed_txid = %(t)s,
                              committed_attempt = %(a)s, committed_at = now()
                       WHERE pipeline = %(p)s AND bolt = %(b)s""", keys)
        log.info("%s: committed %s: %d changes, %d keys of an earlier attempt reset first "
                 "(%.3fs)", where, ta, applied, reverted, time.monotonic() - started)
        return applied

    def rollback(self, pipeline: str, bolt: str, txid: int, attempt: int | None = None) -> int:
        keys = {"p": pipeline, "b": bolt, "t": txid, "a": attempt}
        match = ("pipeline = %(p)s AND bolt = %(b)s AND txid = %(t)s "
                 "AND (%(a)s::integer IS NULL OR attempt = %(a)s)")
        with db.transaction(self._conn) as cur:
            cur.execute("DELETE FROM kv_state_prepared WHERE " + match, keys)
            dropped = cur.rowcount
            cur.execute("DELETE FROM kv_state_attempts WHERE " + match, keys)
        log.info("kv state %s/%s: rolled back txid %d attempt %s: %d prepared changes dropped",
                 pipeline, bolt, txid, "all" if attempt is None else attempt, dropped)
        return dropped

    def prepared(self, pipeline: str, bolt: str) -> list[TransactionAttempt]:
        with db.transaction(self._conn) as cur:
            cur.execute("""SELECT DISTINCT txid, attempt FROM kv_state_attempts
                           WHERE pipeline = %s AND bolt = %s ORDER BY txid, attempt""",
                        (pipeline, bolt))
            return [TransactionAttempt(*row) for row in cur.fetchall()]

    def last_committed(self, pipeline: str, bolt: str) -> TransactionAttempt | None:
        with db.transaction(self._conn) as cur:
            cur.execute("""SELECT committed_txid, committed_attempt FROM kv_state_bolts
                           WHERE pipeline = %s AND bolt = %s AND committed_txid > 0""",
                        (pipeline, bolt))
            row = cur.fetchone()
        return TransactionAttempt(*row) if row else None


def _json_text(value: Any) -> str:
    return json.dumps(value, allow_nan=False, separators=(",", ":"))


def _refuse_committed(cur, keys: dict, ta: TransactionAttempt, pipeline: str, bolt: str) -> None:
    cur.execute("SELECT committed_txid, committed_attempt FROM kv_state_bolts "
                "WHERE pipeline = %(p)s AND bolt = %(b)s", keys)
    row = cur.fetchone()
    if row and (row[0] > ta.txid or row == (ta.txid, ta.attempt)):
        raise StaleBatch(f"kv state {pipeline}/{bolt}: {ta} cannot prepare: txid {row[0]} "
                         f"attempt {row[1]} is committed already")


def _drop_prepared(cur, keys: dict) -> None:
    for table in ("kv_state_prepared", "kv_state_attempts"):
        cur.execute(sql.SQL("DELETE FROM {} WHERE {}").format(sql.Identifier(table), _ATTEMPT),
                    keys)


def _visible(rows, txid: int, namespace: str) -> dict[str, Any]:
    """{key: value} of rows (key, stored txid, JSON text of value or prev chosen by SQL);
    SQL NULL is "absent", the text 'null' a stored JSON null."""
    out = {}
    for key, stored, text in rows:
        as_of(stored, txid, f"key {key!r} of {namespace!r}")
        if text is not None:
            out[key] = json.loads(text)
    return out

