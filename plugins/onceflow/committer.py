"""The commit phase: apply one transaction attempt's staged result, strictly in txid order.

ONE PostgreSQL transaction under the coordinator row's lock: fence the attempt, check every
processing group staged, apply every state's deltas (set-based upserts), keep the rejected
records, settle the backflow (failed records queued for replay or dead-lettered), advance
the partition offsets, drop the staging, and last write the commit record.
A crash anywhere before the final COMMIT leaves nothing; committing a committed txid again is a
logged no-op.

A state kept in another database (StateSpec.conn_id) is written first, in that database's own
transaction, and cannot be atomic with the coordinator: a crash after its write and before the
coordinator's COMMIT leaves it at ``txid`` while the coordinator still says txid - 1. The
replay (the same batch, or in opaque mode a re-planned one) then finds the stored txid equal to
its own and recomputes from prev_value, so the state ends exactly right.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from onceflow import backflow
from onceflow import state as state_tables
from onceflow import stateful as stateful_steps
from onceflow.coordinator import end_attempt, external_dsn, lock_pipeline
from onceflow.db import connection, transaction
from onceflow.pipeline import Pipeline
from onceflow.txn import Fenced, TransactionAttempt, current_attempt, delete_staging

log = logging.getLogger(__name__)

Step = Callable[[str], None]


def _no_step(_: str) -> None:
    pass


@dataclass(frozen=True)
class CommitResult:
    status: str  # "committed" | "already_committed" | "waiting"
    attempt: TransactionAttempt
    rows_applied: int = 0
    waited_s: float = 0.0
    blocking_txid: int | None = None
    blocking_state: str | None = None
    blocking_run_id: str | None = None


class MissingStaging(RuntimeError):
    """Commit was asked for while some processing group of the attempt has not staged."""


def _check_groups(cur, keys: dict, ta: TransactionAttempt, pipeline: str) -> None:
    cur.execute(
        """SELECT t.groups, array_agg(g.grp ORDER BY g.grp) FILTER (WHERE g.grp IS NOT NULL)
           FROM transactions t
           LEFT JOIN staged_groups g ON g.pipeline = t.pipeline AND g.txid = t.txid
                                     AND g.attempt = %(attempt)s
           WHERE t.pipeline = %(pipeline)s AND t.txid = %(txid)s GROUP BY t.groups""",
        keys,
    )
    groups, staged = cur.fetchone()
    missing = sorted(set(range(groups)) - set(staged or []))
    if missing:
        raise MissingStaging(
            f"{ta} of {pipeline}: processing group(s) {missing} of {groups} have not staged; "
            "run (or retry) their process task before commit"
        )


def _apply_external(cur, spec, dsn: str, keys: dict) -> int:
    """Copy this attempt's deltas for ``spec`` out of the coordinator and apply them in the
    state's own database (its own transaction)."""
    buf = io.StringIO()
    cur.copy_expert(
        cur.mogrify(
            """COPY (SELECT key, sum(delta)::bigint FROM staged_deltas
                     WHERE pipeline = %(pipeline)s AND txid = %(txid)s AND attempt = %(attempt)s
                       AND state_name = %(state)s GROUP BY key) TO STDOUT (FORMAT csv)""",
            {**keys, "state": spec.source_name},
        ).decode(),
        buf,
    )
    buf.seek(0)
    with connection(dsn, application_name="onceflow-commit-external") as external, \
            transaction(external) as ext:
        return state_tables.apply_csv(ext, spec, keys["txid"], buf)


def commit(conn, pipeline: Pipeline, ta: TransactionAttempt, *, on_step: Step = _no_step,
           state_dsns: Mapping[str, str] | None = None, coordinator_dsn: str | None = None
           ) -> CommitResult:
    """Commit ``ta`` if it is its turn; else return status "waiting" and change nothing.

    ``on_step(name)`` is called after each statement group (fault injection in tests);
    ``state_dsns`` gives the database of each state with a conn_id; ``coordinator_dsn`` (default
    ONCEFLOW_PG_DSN) lets stateful bolts' state provider find the coordinator's database.
    """
    bolts = stateful_steps.stateful_bolts(pipeline)
    provider = None
    if bolts:
        provider = stateful_steps.open_state_provider(
            pipeline, coordinator_dsn or os.environ.get("ONCEFLOW_PG_DSN", ""))
    try:
        return _commit(conn, pipeline, ta, on_step, state_dsns, bolts, provider)
    finally:
        if provider is not None:
            provider.close()


def _commit(conn, pipeline: Pipeline, ta: TransactionAttempt, on_step: Step,
            state_dsns: Mapping[str, str] | None, bolts: list, provider) -> CommitResult:
    with transaction(conn) as cur:
        cur.execute(
            """UPDATE transactions SET commit_requested_at = now()
               WHERE pipeline = %s AND txid = %s AND attempt = %s
                 AND commit_requested_at IS NULL""",
            (pipeline.name, ta.txid, ta.attempt),
        )
    with transaction(conn) as cur:
        _, last_committed, instance_id, _ = lock_pipeline(cur, pipeline.name)
        txn_state = current_attempt(cur, pipeline.name, ta, lock="update")
        if txn_state == "committed":
            log.info("COMMIT pipeline=%s %s: already committed, nothing to do", pipeline.name, ta)
            return CommitResult("already_committed", ta)
        if txn_state != "planned":
            raise Fenced(f"{ta} of {pipeline.name} is {txn_state}: it may not commit")
        if last_committed != ta.txid - 1:
            cur.execute(
                "SELECT state, run_id FROM transactions WHERE pipeline = %s AND txid = %s",
                (pipeline.name, last_committed + 1),
            )
            blocking_state, blocking_run = cur.fetchone() or (None, None)
            return CommitResult("waiting", ta, blocking_txid=last_committed + 1,
                                blocking_state=blocking_state, blocking_run_id=blocking_run)
        keys = {"pipeline": pipeline.name, "txid": ta.txid, "attempt": ta.attempt}
        _check_groups(cur, keys, ta, pipeline.name)
        on_step("locked")
        rows = 0
        for spec in pipeline.external_states():
            rows += _apply_external(cur, spec, external_dsn(spec, state_dsns), keys)
            on_step(f"external:{spec.name}")
        if bolts:
            stateful_steps.recover(conn, provider, pipeline, bolts, cur)
            rows += stateful_steps.commit_states(cur, provider, pipeline, bolts, ta)
            on_step("kv_state")
        for spec in pipeline.states:
            if spec.conn_id is None:
                rows += state_tables.apply_source(
                    cur, spec, ta.txid, state_tables.staged_source(),
                    {**keys, "state": spec.source_name},
                )
                on_step(f"state:{spec.name}")
        cur.execute(
            """INSERT INTO rejected_records (pipeline, topic, partition, "offset", error, txid)
               SELECT pipeline, topic, partition, "offset", error, txid FROM staged_rejects
               WHERE pipeline = %(pipeline)s AND txid = %(txid)s AND attempt = %(attempt)s
               ON CONFLICT DO NOTHING""",
            keys,
        )
        on_step("rejects")
        settled = backflow.settle(cur, pipeline, ta)
        on_step("backflow")
        cur.execute(
            """INSERT INTO partition_offsets
                   (pipeline, instance_id, topic, partition, "offset", txid)
               SELECT pipeline, %(instance)s, topic, partition, end_offset, txid
               FROM batch_ranges WHERE pipeline = %(pipeline)s AND txid = %(txid)s
               ON CONFLICT (pipeline, partition) DO UPDATE
               SET "offset" = EXCLUDED."offset", txid = EXCLUDED.txid, topic = EXCLUDED.topic,
                   instance_id = EXCLUDED.instance_id, updated_at = now()""",
            {**keys, "instance": str(instance_id)},
        )
        on_step("offsets")
        delete_staging(cur, pipeline.name, ta.txid)
        on_step("staging")
        cur.execute(
            """UPDATE transactions
               SET state = 'committed', committed_at = now(), rows_applied = %(rows)s,
                   commit_wait_s = EXTRACT(EPOCH FROM now() - commit_requested_at),
                   failed = %(failed)s
               WHERE pipeline = %(pipeline)s AND txid = %(txid)s
               RETURNING commit_wait_s""",
            {**keys, "rows": rows, "failed": settled.failed},
        )
        waited = cur.fetchone()[0] or 0.0
        end_attempt(cur, pipeline.name, ta, "committed", "")
        cur.execute("UPDATE pipelines SET last_committed_txid = %s WHERE name = %s",
                    (ta.txid, pipeline.name))
        on_step("commit_record")
    log.info(
        "COMMIT pipeline=%s txid=%d attempt=%d prev_txid=%d rows=%d replayed_ok=%d "
        "failed=%d (queued %d, dead %d) waited=%.2fs", pipeline.name, ta.txid, ta.attempt,
        ta.txid - 1, rows, settled.replayed_ok, settled.failed, settled.queued, settled.dead,
        waited,
    )
    return CommitResult("committed", ta, rows_applied=rows, waited_s=waited)
