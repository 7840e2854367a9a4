"""The one-task transaction (TransactionOperator, a pipeline's ``dag_shape="single"``): begin,
process and commit in one task, with the three phases' own code (operators/begin.py,
process.py, commit.py).

DAG files only wire these together (onceflow.airflow.dags); all logic lives in onceflow.core.
How onceflow's outcomes show in Airflow:

- a fenced attempt (a duplicate run, a zombie that woke up late) and a run past max_pending
  that no commit made room for within ``wait_for_slot`` end as **skipped**, with the reason
  in the log: nothing is wrong, another attempt carries on;
- a permanent error (a bad setting, an unknown txid or pipeline, an unreachable database)
  fails the task at once, without retries (``AirflowFailException``);
- anything else is retried, and after the last retry marks the transaction failed, so that
  the next run adopts it.

A task that holds a transaction attempt (process, commit, the one-task transaction) reports
its lease while it runs; between two tasks of a run (begin to process, process to commit, a
retry's delay, a deferred commit) the attempt has the longer hand-over lease
(onceflow.core.lease).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseOperator

from onceflow.airflow.operators.begin import Begins
from onceflow.airflow.operators.commit import Commits
from onceflow.airflow.operators.process import Processes
from onceflow.airflow.operators.spark_client import spark_client_loading, spark_connect_url
from onceflow.airflow.operators.task import (
    WAIT_IN_TASK_S,
    airflow_outcomes,
    attempt_of,
    lease_for_retry,
    mark_transaction_failed,
    noting_skips,
    run_note,
    started_by_watcher,
)
from onceflow.core import keepup, txlog
from onceflow.core.begin import begin
from onceflow.core.connections import DEFAULT_CONN_ID
from onceflow.core.db import connection
from onceflow.core.errors import ConfigError, MaxPendingReached, NothingToPlan

# The most txids a keep-up run commits in turn (TransactionOperator): a run stays a bounded
# piece of work in Airflow's pages and logs; the watcher starts the next.
CARRY_ON_TXIDS = 30
# How often a run that committed looks at the source while it waits for its next batch: the
# records' wait for the look is half of it.
LINGER_LOOK_S = 0.25


class TransactionOperator(Begins, Processes, Commits, BaseOperator):
    """A whole transaction in one task: begin, process every group on a Spark Connect server,
    commit in txid order (a pipeline's ``dag_shape="single"``).

    :param pipeline: the registered pipeline's name.
    :param pipeline_refs: where the pipeline is declared, besides the registry.
    :param postgres_conn_id: the coordinator's PostgreSQL connection.
    :param conn_id: the Spark connection; of type ``spark_connect`` (a spark-submit per batch
        is the three-task DAG's).
    :param batch_size, groups, txid, wait_for_slot: as BeginBatchOperator's.
    :param commit_timeout, wait_in_task: as CommitBatchOperator's.
    :param poll_interval: seconds between looks while waiting for a place or the turn.

    The phases are the three operators' own, in order, with the same fences, outcomes, run notes
    and log lines (BEGIN, PROCESSED, COMMIT), so the transaction is as exactly once as in three
    tasks; what changes is what Airflow sees: one task per run. A run costs Airflow one task
    process instead of three and no scheduling hop between the phases (figures in
    bench/RESULTS.md). A retry starts again at begin, which gives the run
    a new attempt of its own txid (the old one is fenced). Groups are processed side by side on
    the one Spark session. Waiting for the turn to commit defers the task as the commit task
    does; it resumes at the commit, the batch carried in the deferral.

    A run the source watcher started (keep-up) **carries on**: once it committed, it begins
    the next batch in the same task while ``batch_start_records`` wait and fewer than
    ``max_pending`` are open (onceflow.core.begin's ``carry_on``), up to CARRY_ON_TXIDS txids
    a run. Airflow makes at most one run of a DAG per scheduler loop, and a run's task takes
    seconds to start; batches that commit faster than that would otherwise drain one or two
    at a time. Where fewer wait, the run waits for its next batch with the watcher's rule
    (``min_records``, or the oldest waited ``max_delay``), looking at the source every
    LINGER_LOOK_S, instead of leaving it to a new run's start (the watcher counts it as a run
    still to plan); it ends when no record came for a ``watch_interval`` or a run waits in
    its begin for the place. Each txid is its own transaction as before (its BEGIN,
    PROCESSED and COMMIT lines, fences and lease); the run's note and its Asset events name
    every txid it committed, and a retry begins again at the run's newest txid. A run
    waiting in its begin for a place takes it first; a run still starting may find its
    batch taken and plan nothing (skipped, no empty transaction).
    """

    template_fields = ("batch_size", "txid", "groups")

    def __init__(self, *, pipeline: str, pipeline_refs: Iterable[str] = (),
                 postgres_conn_id: str = DEFAULT_CONN_ID, conn_id: str = "spark_default",
                 batch_size: Any = None, txid: Any = None, groups: Any = None,
                 wait_for_slot: float | None = None, commit_timeout: timedelta | None = None,
                 poll_interval: float = 2.0, wait_in_task: float = WAIT_IN_TASK_S, **kwargs):
        kwargs.setdefault("on_failure_callback", mark_transaction_failed)
        kwargs.setdefault("on_retry_callback", lease_for_retry)
        super().__init__(**kwargs)
        self._which(pipeline, pipeline_refs, postgres_conn_id)
        self._plan_settings(batch_size, txid, groups, wait_for_slot, poll_interval)
        self.conn_id = conn_id
        self.commit_timeout = commit_timeout
        self.wait_in_task = wait_in_task
        self.batch: list[dict[str, Any]] | None = None

    def execute(self, context) -> dict[str, Any]:
        self._earlier: list[tuple[int, dict[str, int], list[str]]] = []
        # a begin that waits for a place imports the Spark client meanwhile; one that plans
        # at once leaves it to the processing
        with spark_client_loading() as load_spark:
            self.batch = self._begin(context, waiting=load_spark)
        with airflow_outcomes():
            pipeline, dsn = self._pipeline(), self._dsn()
        while True:
            ta = attempt_of(self.batch)
            self._may_carry_on = started_by_watcher(context) \
                and len(self._earlier) + 1 < CARRY_ON_TXIDS
            with self._holding(pipeline, dsn, ta, handoff=False):
                out = self._transact(context, pipeline, dsn, ta)
            following = self._carry_on(context, dsn) \
                if self._may_carry_on and out["status"] == "committed" else None
            if following is None:
                if self._may_carry_on and out["status"] == "committed":
                    run_note(context, self._unsaid)
                return out
            self._earlier.append(self._events)
            self.batch = following

    def _carry_on(self, context, dsn: str) -> list[dict[str, Any]] | None:
        """The next batch of a keep-up run that just committed (see the class docstring), or
        None: a run waits in its begin (woken by the commit, it takes the place), no record
        came for a ``watch_interval``, or ``max_pending`` are open again."""
        pipeline, due, done = self._planning, "committed", len(self._earlier) + 1
        while True:
            try:
                with connection(dsn) as conn:
                    with conn.cursor() as cur:
                        waiting = txlog.begin_waiters(cur, pipeline.name)
                    conn.rollback()
                    if waiting:
                        raise MaxPendingReached(
                            f"{waiting} run(s) wait in their begin for the place")
                    batch = begin(conn, pipeline, context["run_id"], carry_on=True,
                                  start_records=1 if due == "delay" else None)
            except NothingToPlan as nothing:
                if due != "committed":  # it waited, and another run took the batch
                    self.log.info("%s: the run ends after %d txid(s): %s", pipeline.name,
                                  done, nothing)
                    return None
                started = time.monotonic()
                due = self._waited_for_batch(dsn, pipeline)
                if due is None:
                    self.log.info("%s: the run ends after %d txid(s): fewer than %d records "
                                  "waited, and none started a batch in %.1fs (%s)",
                                  pipeline.name, done, pipeline.batch_start_records,
                                  time.monotonic() - started, self._stopped_waiting)
                    return None
                continue
            except MaxPendingReached as nothing:
                self.log.info("%s: the run ends after %d txid(s): %s", pipeline.name, done,
                              nothing)
                return None
            except Exception as error:  # noqa: BLE001 (its txid committed: the run succeeded)
                self.log.warning("%s: the run does not carry on after %d txid(s) (%s: %s); "
                                 "the watcher starts the next", pipeline.name, done,
                                 type(error).__name__, error)
                return None
            self.log.info("%s: the run carries on with %s (after %d committed; %s)",
                          pipeline.name, batch.attempt, done,
                          "records waited" if due == "committed" else f"waited for {due}")
            return self._planned(context, pipeline, batch)

    def _waited_for_batch(self, dsn: str, pipeline) -> str | None:
        """_next_batch_due, None where a look failed (its txid committed: the run ends well,
        and the watcher starts the next)."""
        try:
            return self._next_batch_due(dsn, pipeline)
        except Exception as error:  # noqa: BLE001
            self._stopped_waiting = f"a look failed: {type(error).__name__}: {error}"
            return None

    def _next_batch_due(self, dsn: str, pipeline) -> str | None:
        """Wait for the next batch by the watcher's rule (onceflow.core.keepup): "records"
        once ``batch_start_records`` wait, "delay" once the oldest waited ``max_delay``,
        "adopt" when a transaction is to be adopted; None when no record came for a
        ``watch_interval``, a run waits in its begin, or ``max_pending`` are open."""
        every = min(pipeline.watch_interval, LINGER_LOOK_S)
        quiet_since = unread_since = time.monotonic()
        heads = None
        with connection(dsn, application_name="onceflow-linger") as conn, \
                pipeline.source.watching():
            conn.autocommit = True  # each look sees what is committed, and holds nothing
            while True:
                time.sleep(every)
                with conn.cursor() as cur:
                    if txlog.begin_waiters(cur, pipeline.name):
                        self._stopped_waiting = "a run waits in its begin for the place"
                        return None
                    seen = keepup.look(cur, pipeline, heads)
                now = time.monotonic()
                if seen is None or seen.open >= pipeline.max_pending:
                    self._stopped_waiting = f"max_pending={pipeline.max_pending} are open"
                    return None
                if seen.adopt:
                    return "adopt"
                heads = seen.heads
                if seen.unread >= pipeline.batch_start_records:
                    return "records"
                if seen.unread <= 0:
                    unread_since = now
                    if now - quiet_since >= pipeline.watch_interval:
                        self._stopped_waiting = (f"no record came for watch_interval="
                                                 f"{pipeline.watch_interval:g}s")
                        return None
                    continue
                quiet_since = now
                waited = seen.oldest_wait_s if seen.oldest_wait_s is not None \
                    else now - unread_since
                if waited >= pipeline.max_delay_s:
                    return "delay"

    def _first_lease(self, pipeline) -> int | None:
        return None  # processing and commit follow in this task

    def _transact(self, context, pipeline, dsn: str, ta) -> dict[str, Any]:
        with noting_skips(context, self.pipeline, ta), airflow_outcomes():
            url = spark_connect_url(self.conn_id)
            if url is None:
                raise ConfigError(
                    f"connection {self.conn_id!r} is not of type spark_connect: a one-task "
                    f"transaction DAG processes on a Spark Connect server. Point it at one "
                    f"(spark-connect://host:15002), or declare pipeline {self.pipeline!r} "
                    "with dag_shape='phases' to spark-submit each batch")
            groups = [int(entry["group"]) for entry in self.batch]
            ready = groups if self._ready_to_process(pipeline, dsn, ta) else []
            if len(ready) == 1:
                self._process_here(url, pipeline, dsn, ta, ready[0])
            elif ready:

                with ThreadPoolExecutor(len(ready), thread_name_prefix="onceflow-group") as pool:
                    for done in [pool.submit(self._process_here, url, pipeline, dsn, ta, g)
                                 for g in ready]:
                        done.result()
        timeout = (self.commit_timeout.total_seconds() if self.commit_timeout
                   else pipeline.commit_timeout_s)
        return self._try_commit(time.time() + timeout, context)
