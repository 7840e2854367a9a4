"""The begin task (BeginBatchOperator): plan the next transaction, or adopt one a failed run
left, and hand its batch to the process task."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from airflow.sdk import BaseOperator

from onceflow.airflow.compat import AirflowSkipException
from onceflow.airflow.operators.spark_client import build_checked
from onceflow.airflow.operators.task import (
    PipelineTask,
    airflow_outcomes,
    plan_setting,
    run_note,
    seconds_setting,
    started_by_watcher,
)
from onceflow.airflow.triggers import TurnListener
from onceflow.core import txlog
from onceflow.core.begin import begin
from onceflow.core.connections import DEFAULT_CONN_ID
from onceflow.core.db import connection
from onceflow.core.errors import MaxPendingReached
from onceflow.core.registration import ensure_ready


class Begins(PipelineTask):
    """The begin phase (BeginBatchOperator, TransactionOperator): needs ``batch_size``,
    ``groups``, ``txid``, ``wait_for_slot`` and ``poll_interval``. A plan setting left None
    is the run's param of that name (the trigger form of onceflow's DAGs), read directly:
    a ``{{ params.x }}`` template would cost a Jinja compile per field in every task."""

    batch_size: Any
    groups: Any
    txid: Any
    wait_for_slot: float
    poll_interval: float

    def _plan_settings(self, batch_size: Any, txid: Any, groups: Any,
                       wait_for_slot: float | None, poll_interval: float) -> None:
        self.batch_size = batch_size
        self.txid = txid
        self.groups = groups
        self.wait_for_slot = seconds_setting("wait_for_slot", wait_for_slot, "begin_wait_s")
        self.poll_interval = poll_interval

    def _begin(self, context, waiting=None) -> list[dict[str, Any]]:
        """Plan the run's batch (onceflow.core.begin); ``waiting()``, if given, is called
        when the begin starts to wait for a place among max_pending."""
        try:
            with airflow_outcomes():
                form = context.get("params") or {}
                setting = {name: plan_setting(name, form.get(name), "the run's param")
                           if getattr(self, name) is None else
                           plan_setting(name, getattr(self, name), "the task's argument")
                           for name in ("batch_size", "groups", "txid")}
                pipeline = self._pipeline(batch_size=setting["batch_size"],
                                          groups=setting["groups"])
                # the declaration, checked before a txid is planned (the DAG's parse does
                # not import the topology): a bad one fails the run naming it, no retry
                build_checked(pipeline)
                txid = setting["txid"]
                # a run the source watcher started plans no transaction of no records
                skip_empty = started_by_watcher(context)
                self._planning = pipeline  # the settings a carried-on batch keeps
                with connection(self._dsn()) as conn:
                    ensure_ready(conn, pipeline)
                    batch = self._begin_when_free(pipeline, lambda: begin(
                        conn, pipeline, context["run_id"], txid=txid,
                        lease_s=self._first_lease(pipeline), skip_empty=skip_empty), waiting)
        except AirflowSkipException as skip:  # max_pending, or nothing to read
            why = str(skip)
            run_note(context, lambda notes: notes.nothing_planned(self.pipeline, why))
            raise
        except Exception as error:
            cause = error.__cause__ or error
            run_note(context, lambda notes: notes.no_txid(self.pipeline, cause))
            raise
        return self._planned(context, pipeline, batch)

    def _planned(self, context, pipeline, batch) -> list[dict[str, Any]]:
        ta = batch.attempt
        run_note(context, lambda notes: notes.no_op(pipeline.name, ta.txid) if batch.committed
                 else notes.planned(pipeline.name, ta.txid, ta.attempt, batch.records))
        self.log.info("%s: %s reads %d records in %d range(s)%s", pipeline.name, batch.attempt,
                      batch.records, len(batch.ranges),
                      " (committed already: nothing to do)" if batch.committed else "")
        return [
            {"pipeline": pipeline.name, "txid": batch.attempt.txid,
             "attempt": batch.attempt.attempt, "group": group, "groups": batch.groups,
             "records": sum(r.size for r in batch.ranges_of(group)),
             "committed": batch.committed}
            for group in range(batch.groups)
        ]

    def _first_lease(self, pipeline) -> int | None:
        """The lease begin gives the attempt: the hand-over lease, as the run goes on in its
        process tasks (TransactionOperator goes on in the same task: the pipeline's)."""
        return pipeline.handoff_lease_s

    def _begin_when_free(self, pipeline, attempt, waiting=None):
        """``attempt()`` (begin); while it finds ``max_pending`` transactions open, wait for
        a commit (LISTEN on the announcements, a look every poll_interval) and try again,
        for up to ``wait_for_slot`` seconds; then MaxPendingReached goes up (a skip).
        ``waiting()`` is called once, when the wait starts."""

        until = time.monotonic() + self.wait_for_slot
        started, listener = time.monotonic(), None
        try:
            while True:
                try:
                    batch = attempt()
                except MaxPendingReached as full:
                    if time.monotonic() >= until:
                        raise
                    if listener is None:  # listening before the next look: no commit missed
                        self.log.info("%s; waiting up to %.0fs for one to commit",
                                      full, self.wait_for_slot)
                        # named, so that a run that carries on leaves the place to it
                        listener = TurnListener(self._dsn(),
                                                txlog.begin_waiter_name(pipeline.name))
                        if waiting is not None:
                            waiting()
                        continue
                    listener.wait(min(self.poll_interval, max(0.0, until - time.monotonic())))
                    continue
                if listener is not None:
                    self.log.info("%s: a place freed after %.2fs", pipeline.name,
                                  time.monotonic() - started)
                return batch
        finally:
            if listener is not None:
                listener.close()


class BeginBatchOperator(Begins, BaseOperator):
    """Give this DAG run its transaction attempt and store the batch's offset ranges.

    :param pipeline: the registered pipeline's name.
    :param pipeline_refs: ``module:attribute`` references where the pipeline is declared,
        besides entry points and ``ONCEFLOW_PIPELINES``.
    :param postgres_conn_id: the coordinator's PostgreSQL connection.
    :param batch_size: records for a new transaction (default: the run's ``batch_size``
        param, else the pipeline's own).
    :param groups: processing groups for a new transaction (default: the run's ``groups``
        param, else the pipeline's own).
    :param txid: re-attempt this txid (a manual backfill); empty: the run's ``txid`` param,
        else the next one.
    :param wait_for_slot: seconds a run past the pipeline's ``max_pending`` waits here for a
        transaction to commit (woken by the commit's announcement) before it ends as skipped
        (0: at once). Default: the setting ONCEFLOW_BEGIN_WAIT_S (300).
    :param poll_interval: seconds between looks while waiting, besides the announcements.

    The first begin of a pipeline applies onceflow's migrations and registers it. Past the
    pipeline's ``max_pending`` the task waits for a free place (the DAG lets one run more
    than ``max_pending`` start, two in a one-task DAG: onceflow.airflow.dags.STANDBY_RUNS, so
    the next transaction is planned the moment one commits, not scheduler loops later); if
    none frees in ``wait_for_slot`` seconds the task (and run) ends as skipped: nothing
    planned. Returns one entry per processing group (the process task maps over them).
    """

    template_fields = ("batch_size", "txid", "groups")

    def __init__(self, *, pipeline: str, pipeline_refs: Iterable[str] = (),
                 postgres_conn_id: str = DEFAULT_CONN_ID, batch_size: Any = None,
                 txid: Any = None, groups: Any = None, wait_for_slot: float | None = None,
                 poll_interval: float = 2.0, **kwargs):
        super().__init__(**kwargs)
        self._which(pipeline, pipeline_refs, postgres_conn_id)
        self._plan_settings(batch_size, txid, groups, wait_for_slot, poll_interval)

    def execute(self, context) -> list[dict[str, Any]]:
        return self._begin(context)
