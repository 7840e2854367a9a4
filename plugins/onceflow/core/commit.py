"""The commit phase: apply one transaction attempt's staged result, strictly in txid order.

ONE PostgreSQL transaction under the coordinator row's lock: fence the attempt, prove the
staging whole (every group staged, every staged row still there), apply every state's deltas
(set-based upserts), record what it added to each count state (batch_contributions, for
`onceflow verify --txids`: its groups' figures added up), keep the rejected records, settle
the backflow (failed records queued for replay or dead-lettered), advance the partition
offsets, and last write the commit record. A crash anywhere before the final COMMIT leaves
nothing; committing a committed txid again is a logged no-op. Staging found incomplete
(PostgreSQL lost its unlogged tables in a crash) fails the attempt: the next run processes the
batch again.

The staging is deleted after that COMMIT, in a second transaction, out of the serial section:
nothing reads a committed txid's staging (a commit of it stops at the fence, its groups can no
longer stage). A crash between the two transactions leaves it behind; a retry of the commit,
or the next txid's commit, deletes it (every txid up to the committed one).

A state kept in another database (StateSpec.conn_id) is written first, in that database's own
transaction, and cannot be atomic with the coordinator: a crash after its write and before the
coordinator's COMMIT leaves it at ``txid`` while the coordinator still says txid - 1. The
replay (the same batch, or in opaque mode a re-planned one) then finds the stored txid equal to
its own and recomputes from prev_value (onceflow.core.opaque), so the state ends exactly right.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field

from onceflow.core import backflow, offsets, rejects, settings, staging, tables, txlog
from onceflow.core import state_tables as state_tables
from onceflow.core import stateful as stateful_steps
from onceflow.core.db import connection, transaction
from onceflow.core.errors import (
    ConfigError,
    Fenced,
    OnceflowError,
    StagingIncomplete,
    StateOverflow,
)
from onceflow.core.pipeline import Pipeline
from onceflow.core.registration import external_dsn
from onceflow.core.txlog import Blocker, TransactionAttempt, TxState

log = logging.getLogger(__name__)

# The commit's own memory for sorts and hashes (SET LOCAL: this transaction only). A state's
# apply joins the batch's keys with the state table; at the server's default a large batch
# spills its hash join to disk, on the one serial step.
COMMIT_WORK_MEM = "64MB"

Step = Callable[[str], None]
# Opens the key-value store of a pipeline's stateful bolts (pipeline, coordinator DSN).
OpenState = Callable[[Pipeline, str], object]


def _no_step(_: str) -> None:
    pass


@dataclass(frozen=True)
class CommitResult:
    status: str  # "committed" | "already_committed" | "waiting"
    attempt: TransactionAttempt
    rows_applied: int = 0
    waited_s: float = 0.0
    failed: int = 0  # records handed to the backflow or the dead letters
    dead: int = 0
    blocker: Blocker | None = None
    ranges: tuple[str, ...] = ()  # what the txid read, "p0:[0,500)"
    # rows applied per state table (key-value state of stateful bolts apart: in rows_applied)
    table_rows: Mapping[str, int] = field(default_factory=dict)


class MissingStaging(OnceflowError):
    """Commit was asked for while some processing group of the attempt has not staged."""


def _apply_external(cur, pipeline: str, spec, dsn: str, keys: dict, groups: int) -> int:
    """Copy this attempt's deltas for ``spec`` out of the coordinator and apply them in the
    state's own database (its own transaction)."""
    buf = io.StringIO()
    if spec.typed:
        tables.copy_out(cur, pipeline, spec.shape(), groups, keys, buf)
        buf.seek(0)
        with connection(dsn, application_name="onceflow-commit-external") as external, \
                transaction(external) as ext:
            return tables.apply_csv(ext, spec.shape(), spec.opaque, keys["txid"], buf)
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
           state_dsns: Mapping[str, str] | None = None, coordinator_dsn: str | None = None,
           open_state: OpenState | None = None) -> CommitResult:
    """Commit ``ta`` if it is its turn; else return status "waiting" and change nothing.

    ``on_step(name)`` is called after each statement group (fault injection in tests);
    ``state_dsns`` gives the database of each state with a conn_id (default: from its
    connection); ``coordinator_dsn`` (default ONCEFLOW_PG_DSN) lets stateful bolts' state
    provider find the coordinator's database; ``open_state(pipeline, coordinator_dsn)`` opens
    that provider (onceflow.kvstate.open_state_provider), needed when the batch changed
    stateful bolts' state.
    """
    with transaction(conn) as cur:
        txlog.request_commit(cur, pipeline.name, ta)
    try:
        with ExitStack() as cleanup:
            result = _commit(conn, pipeline, ta, on_step, state_dsns,
                             coordinator_dsn or settings.get("pg_dsn") or "", cleanup,
                             open_state)
    except StagingIncomplete as incomplete:
        with transaction(conn) as cur:
            if txlog.mark_failed(cur, pipeline.name, ta, str(incomplete)):
                log.error("COMMIT pipeline=%s %s refused, attempt failed: %s", pipeline.name,
                          ta, incomplete)
        raise
    except StateOverflow as overflow:  # nothing was written: the txid waits for the fix
        raise StateOverflow(f"pipeline {pipeline.name!r}, {ta}: {overflow} (after the fix, "
                            f"the next run adopts it; or `onceflow backfill --pipeline "
                            f"{pipeline.name}`)") from overflow
    if result.status != "waiting":
        # Out of the serial section: staging of a committed txid is never read again, and a
        # crash before this leaves it to the next commit (or to a retry of this one).
        on_step("committed")
        with transaction(conn) as cur:
            staging.delete_committed(cur, pipeline.name, ta.txid)
        on_step("staging")
        pipeline.source.after_commit(conn, pipeline.name)  # e.g. a Kafka group's offsets
    return result


def _commit(conn, pipeline: Pipeline, ta: TransactionAttempt, on_step: Step,
            state_dsns: Mapping[str, str] | None, coordinator_dsn: str, cleanup: ExitStack,
            open_state: OpenState | None) -> CommitResult:
    with transaction(conn) as cur:
        coordinator = txlog.lock_pipeline(cur, pipeline.name)
        cur.execute("SELECT set_config('work_mem', %s, true)", (COMMIT_WORK_MEM,))
        state = txlog.fence(cur, pipeline.name, ta, lock="update")
        if state is TxState.COMMITTED:
            log.info("COMMIT pipeline=%s %s: already committed, nothing to do", pipeline.name, ta)
            return CommitResult("already_committed", ta)
        if state is not TxState.PLANNED:
            raise Fenced(f"{ta} of {pipeline.name} is {state}: it may not commit")
        if coordinator.last_committed != ta.txid - 1:
            return CommitResult("waiting", ta, blocker=txlog.blocker(
                cur, pipeline.name, coordinator.last_committed + 1))
        batch = txlog.load_batch(cur, pipeline.name, ta.txid)
        groups = batch.groups
        proof = staging.proof(cur, pipeline.name, ta, groups)
        if proof.missing_groups:
            raise MissingStaging(
                f"{ta} of {pipeline.name}: processing group(s) {proof.missing_groups} of "
                f"{groups} have not staged; run (or retry) their process task before commit")
        if not proof.whole:
            raise StagingIncomplete(
                f"{ta} of {pipeline.name}: staging is not whole (deltas, rejects, failures "
                f"recorded {proof.expected}, found {proof.found}; PostgreSQL may have crashed "
                "and emptied its unlogged staging tables, a begin made a state's staging "
                "again for a changed declaration, or a worker of an onceflow older "
                "than its database staged it without its figures: upgrade every worker): the "
                "batch is processed again")
        on_step("locked")
        keys = {"pipeline": pipeline.name, "txid": ta.txid, "attempt": ta.attempt}
        rows = 0
        table_rows: dict[str, int] = {}
        for spec in pipeline.external_states():
            table_rows[spec.table] = _apply_external(
                cur, pipeline.name, spec, external_dsn(spec, state_dsns), keys, groups)
            on_step(f"external:{spec.name}")
        if proof.stateful:
            bolts = stateful_steps.stateful_bolts(pipeline, proof.stateful)
            if open_state is None:
                raise ConfigError(
                    f"{ta} of {pipeline.name} changed stateful bolts' state: commit needs "
                    "open_state=onceflow.kvstate.open_state_provider to reach their store")
            provider = open_state(pipeline, coordinator_dsn)
            cleanup.callback(provider.close)
            stateful_steps.recover(conn, provider, pipeline, bolts, cur)
            rows += stateful_steps.commit_states(cur, provider, pipeline, bolts, ta)
            on_step("kv_state")
        for spec in pipeline.states:
            if spec.conn_id is None and spec.typed:
                table_rows[spec.table] = tables.apply_batch(
                    cur, spec.shape(), spec.opaque, ta.txid,
                    tables.staged_batch(pipeline.name, spec.shape(), groups), keys)
                on_step(f"state:{spec.name}")
            elif spec.conn_id is None:
                params = {**keys, "state": spec.source_name}
                table_rows[spec.table] = state_tables.apply_source(
                    cur, spec, ta.txid, state_tables.staged_source(groups), params,
                    keys=state_tables.staged_keys(cur, params) if groups == 1 else None)
                on_step(f"state:{spec.name}")
        rows += sum(table_rows.values())
        state_tables.record_contributions(cur, pipeline.name, ta)
        on_step("contributions")
        rejects.keep(cur, pipeline.name, ta.txid, ta.attempt)
        on_step("rejects")
        settled = backflow.settle(cur, pipeline, ta, batch.replayed)
        on_step("backflow")
        offsets.advance(cur, pipeline.name, coordinator.instance_id, ta.txid)
        on_step("offsets")
        waited = txlog.mark_committed(cur, pipeline.name, ta, rows=rows, failed=settled.failed)
        on_step("commit_record")
    log.info(
        "COMMIT pipeline=%s txid=%d attempt=%d prev_txid=%d rows=%d replayed_ok=%d "
        "failed=%d (queued %d, dead %d) waited=%.2fs", pipeline.name, ta.txid, ta.attempt,
        ta.txid - 1, rows, settled.replayed_ok, settled.failed, settled.queued, settled.dead,
        waited,
    )
    return CommitResult("committed", ta, rows_applied=rows, waited_s=waited,
                        failed=settled.failed, dead=settled.dead,
                        ranges=tuple(f"p{r.partition}:[{r.start},{r.end})"
                                     for r, _ in batch.ranges),
                        table_rows=table_rows)
