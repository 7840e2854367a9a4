"""The commit task (CommitBatchOperator): commit the staged batch in txid order, waiting for
txid - 1 in the task a while and then deferred to the triggerer."""

from __future__ import annotations

import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseOperator

from onceflow.airflow.assets import emit, no_events
from onceflow.airflow.operators.task import (
    WAIT_IN_TASK_S,
    PipelineTask,
    airflow_outcomes,
    attempt_of,
    lease_for_retry,
    mark_transaction_failed,
    noting_skips,
    run_note,
)
from onceflow.airflow.triggers import CommitTurnTrigger, TurnListener, look_for_turn
from onceflow.core import freshness
from onceflow.core.commit import commit
from onceflow.core.connections import DEFAULT_CONN_ID
from onceflow.core.db import connection
from onceflow.core.errors import BlockedByEarlierTxid
from onceflow.core.registration import external_dsns
from onceflow.kvstate import open_state_provider


class Commits(PipelineTask):
    """The commit phase (CommitBatchOperator, TransactionOperator): needs ``batch`` (begin's
    result), ``poll_interval`` and ``wait_in_task``. A deferred commit resumes in
    ``execute_complete`` with the batch it deferred with."""

    batch: Any
    poll_interval: float
    wait_in_task: float

    def execute_complete(self, context, event: dict[str, Any] | None = None,
                         batch: Any = None, earlier: list | None = None) -> dict[str, Any]:
        if batch is not None:
            self.batch = batch
        # the txids this task committed before it deferred (a run that carried on): their
        # Asset events are recorded when the task ends, so they are given again
        self._earlier = [(int(t), dict(rows), list(ranges)) for t, rows, ranges in earlier or ()]
        if context and "outlet_events" in context:
            pipeline = self._pipeline()
            for txid, rows, ranges in self._earlier:
                emit(context, pipeline, txid=txid, table_rows=rows, ranges=ranges)
        return self._try_commit(float((event or {}).get("deadline", 0)) or time.time(), context)

    def _try_commit(self, deadline: float, context=None) -> dict[str, Any]:
        with noting_skips(context, self.pipeline, attempt_of(self.batch)):
            out = self._commit_turn(deadline, context)
        if getattr(self, "_may_carry_on", False) and out["status"] == "committed":
            # a run that may carry on plans first: its note is said once it ends
            self._unsaid = lambda notes: self._note(notes, out)
        else:
            run_note(context, lambda notes: self._note(notes, out))
        return out

    def _note(self, notes, out: dict[str, Any]) -> dict[str, Any]:
        batch = self.batch if isinstance(self.batch, list) else [self.batch]
        records = sum(int(b.get("records", 0)) for b in batch)
        if out["status"] != "already_committed":
            return notes.committed(self.pipeline, out["txid"], out["attempt"], records=records,
                                   failed=out["failed"], dead=out["dead"],
                                   waited_s=out["waited_s"], fresh_s=out.get("fresh_s"),
                                   earlier=[t for t, *_ in getattr(self, "_earlier", ())])
        if any(b.get("committed") for b in batch):  # begin found it committed
            return notes.no_op(self.pipeline, out["txid"])
        # this attempt committed it, on an earlier try of this task
        return notes.committed(self.pipeline, out["txid"], out["attempt"], records=records,
                               earlier_try=True)

    def _waited_here(self, dsn: str, pipeline: str, ta, deadline: float) -> bool:
        """Wait in the task for the turn (see the class docstring), up to ``wait_in_task``
        seconds. Returns whether it waited (then commit is tried again)."""

        if self.wait_in_task <= 0:
            return False
        until = min(deadline, time.time() + self.wait_in_task)
        started = time.monotonic()
        listener = TurnListener(dsn)
        try:
            while time.time() < until:
                last, hopeless = look_for_turn(dsn, pipeline, ta.txid, ta.attempt)
                if last >= ta.txid - 1 or hopeless:
                    break
                listener.wait(min(self.poll_interval, max(0.0, until - time.time())))
        finally:
            listener.close()
        self.log.info("%s waited %.2fs in the task for its turn", ta,
                      time.monotonic() - started)
        return True

    def _commit_turn(self, deadline: float, context=None) -> dict[str, Any]:
        ta = attempt_of(self.batch)
        with airflow_outcomes():
            pipeline = self._pipeline()
            dsn = self._dsn()
            with self._holding(pipeline, dsn, ta, handoff=False) as lease, \
                    connection(dsn) as conn:
                result = commit(conn, pipeline, ta, state_dsns=external_dsns(pipeline),
                                coordinator_dsn=dsn, open_state=open_state_provider)
                if result.status == "waiting" and not result.blocker.hopeless \
                        and self._waited_here(dsn, pipeline.name, ta, deadline):
                    result = commit(conn, pipeline, ta, state_dsns=external_dsns(pipeline),
                                    coordinator_dsn=dsn, open_state=open_state_provider)
                if result.status == "waiting" and not result.blocker.hopeless \
                        and time.time() < deadline:
                    # deferred: the triggerer holds the attempt from here on
                    lease.hand_over(pipeline.handoff_lease_s)
                fresh = None
                if result.status == "committed":  # for the run's note
                    with conn.cursor() as cur:
                        fresh = freshness.of_txid(cur, pipeline.name, ta.txid)
                    conn.rollback()
            if result.status == "waiting":
                blocker = result.blocker
                if blocker.hopeless:
                    # a permanent failure needs its fix before a re-run can help
                    first = ("Fix what its reason says (retrying cannot help until then), "
                             "then backfill" if blocker.permanent else "Backfill")
                    raise BlockedByEarlierTxid(
                        f"{ta} of {pipeline.name} cannot commit: {blocker.describe()}. "
                        f"{first} txid {blocker.txid}: trigger this DAG with "
                        f'{{"txid": {blocker.txid}}} or run `onceflow backfill --pipeline '
                        f"{pipeline.name}`; this txid is re-run after it")
                if time.time() >= deadline:
                    raise BlockedByEarlierTxid(
                        f"{ta} of {pipeline.name} waited for its turn until the commit timeout: "
                        f"{blocker.describe()}")
        if result.status == "waiting":
            self.log.info("%s waits for %s", ta, result.blocker.describe())
            self.defer(
                trigger=CommitTurnTrigger(pipeline.name, ta.txid, ta.attempt,
                                          self.postgres_conn_id, self.poll_interval, deadline,
                                          lease_s=pipeline.handoff_lease_s),
                method_name="execute_complete",
                kwargs={"batch": self.batch, **({"earlier": [
                    [t, rows, ranges] for t, rows, ranges in self._earlier]}
                    if getattr(self, "_earlier", ()) else {})},
            )
        if result.status == "committed":  # what a run that carries on gives again
            self._events = (ta.txid, dict(result.table_rows), list(result.ranges))
        if context and "outlet_events" in context:

            if result.status == "committed":
                emit(context, pipeline, txid=ta.txid, table_rows=result.table_rows,
                     ranges=result.ranges)
            elif not getattr(self, "_earlier", ()):
                no_events(self)  # committed before (an earlier try, another run): no event
        return {"txid": ta.txid, "attempt": ta.attempt, "status": result.status,
                "rows_applied": result.rows_applied, "waited_s": result.waited_s,
                "failed": result.failed, "dead": result.dead,
                "fresh_s": list(fresh) if fresh else None}


class CommitBatchOperator(Commits, BaseOperator):
    """Commit the batch when its turn comes (txid - 1 committed), in one PostgreSQL transaction.

    :param pipeline: the registered pipeline's name.
    :param batch: begin's result.
    :param pipeline_refs: where the pipeline is declared, besides the registry.
    :param postgres_conn_id: the coordinator's PostgreSQL connection.
    :param commit_timeout: how long to wait for the turn (default: the pipeline's
        ``commit_timeout_s``).
    :param poll_interval: seconds between looks at the commit log while waiting.
    :param wait_in_task: seconds a commit waits for its turn in the task before it defers
        (0: defer at once).

    While an earlier txid is uncommitted and alive (processing or committing, reporting within
    its lease), the task first waits for its turn here, up to ``wait_in_task`` seconds, woken by
    the commit announcements: the earlier batch is usually seconds from its commit, and a
    deferral costs a trigger, a new task process and the scheduler's delays, seconds under load
    (docs/design.md). Past that it defers (no worker slot is held) to CommitTurnTrigger, which
    keeps this attempt's lease alive. A DAG lets ``max_pending`` + 1 runs in flight, so the
    waits hold a bounded few slots. When the earlier txid failed or its run died, it fails at
    once, naming the txid to backfill. Committing an already committed txid is a logged no-op; a
    fenced attempt ends as skipped.
    """

    template_fields = ("batch",)

    def __init__(self, *, pipeline: str, batch: Any, pipeline_refs: Iterable[str] = (),
                 postgres_conn_id: str = DEFAULT_CONN_ID,
                 commit_timeout: timedelta | None = None, poll_interval: float = 2.0,
                 wait_in_task: float = WAIT_IN_TASK_S, **kwargs):
        kwargs.setdefault("on_failure_callback", mark_transaction_failed)
        kwargs.setdefault("on_retry_callback", lease_for_retry)
        super().__init__(**kwargs)
        self._which(pipeline, pipeline_refs, postgres_conn_id)
        self.batch = batch
        self.commit_timeout = commit_timeout
        self.poll_interval = poll_interval
        self.wait_in_task = wait_in_task

    def execute(self, context) -> dict[str, Any]:
        timeout = (self.commit_timeout.total_seconds() if self.commit_timeout
                   else self._pipeline().commit_timeout_s)
        return self._try_commit(time.time() + timeout, context)
