"""Airflow operators for the three phases of a transaction: begin, process, commit.

DAG files only wire these together; all logic lives in the library modules they call.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk import BaseOperator

from onceflow.connections import DEFAULT_CONN_ID, airflow_dsn

# The spark-submit application: the installed spark_tasks package's entry point file.
PROCESS_ENTRY_POINT = str(
    Path(importlib.util.find_spec("spark_tasks").origin).parent / "process_batch.py"
)


# Small batches on a few cores: Spark's 200 shuffle partitions and INFO logging only cost time.
SPARK_DEFAULTS = {
    "spark.sql.shuffle.partitions": "4",
    "spark.ui.enabled": "false",
    "spark.log.level": "WARN",
}


def _pipeline(name: str, batch_size: Any = None, groups: Any = None):
    from onceflow.pipeline import get_pipeline

    overrides = {}
    if batch_size not in (None, ""):
        overrides["batch_size"] = int(batch_size)
    if groups not in (None, ""):
        overrides["groups"] = int(groups)
    return get_pipeline(name, **overrides)


def _attempt(batch: Mapping[str, Any] | list):
    """The attempt of begin's result: one group's entry, or the list of all of them."""
    from onceflow.txn import TransactionAttempt

    if isinstance(batch, list):
        batch = batch[0]
    return TransactionAttempt(int(batch["txid"]), int(batch["attempt"]))


def _state_dsns(pipeline) -> dict[str, str]:
    """The DSN of every state kept outside the coordinator, from its Airflow connection."""
    return {spec.name: airflow_dsn(spec.conn_id) for spec in pipeline.external_states()}


def _batch_of(context) -> Mapping[str, Any] | None:
    batch = getattr(context.get("task"), "batch", None)
    if not isinstance(batch, Mapping | list):
        batch = context["ti"].xcom_pull(task_ids="begin")
    if isinstance(batch, list):
        batch = batch[0] if batch else None
    return batch


def mark_transaction_failed(context) -> None:
    """on_failure_callback of process and commit (after their last retry): mark the attempt's
    transaction failed so the next run adopts it. Fenced: a zombie attempt marks nothing."""
    from onceflow.coordinator import mark_failed
    from onceflow.db import connection

    task = context["task"]
    batch = _batch_of(context)
    if not batch:
        return
    error = context.get("exception")
    reason = f"{task.task_id} failed in run {context['run_id']}: {error!r}"
    with connection(airflow_dsn(getattr(task, "postgres_conn_id", DEFAULT_CONN_ID))) as conn:
        mark_failed(conn, batch["pipeline"], _attempt(batch), reason)


def inject_fault(point: str, txid: int, try_number: int) -> None:
    """Testing hook: ONCEFLOW_INJECT_FAULTS="POINT:TXID[:TRIES],..." makes ``POINT``
    (process.before, process.before.groupG, commit.after) raise for ``TXID`` on its first
    TRIES tries (all by default). Unset in normal operation."""
    for entry in filter(None, os.environ.get("ONCEFLOW_INJECT_FAULTS", "").split(",")):
        name, _, rest = entry.partition(":")
        want_txid, _, tries = rest.partition(":")
        if name == point and int(want_txid) == txid and (not tries or try_number <= int(tries)):
            raise RuntimeError(f"injected fault {point} for txid {txid} (try {try_number})")


class BeginBatchOperator(BaseOperator):
    """Give this DAG run its transaction attempt and store the batch's offset ranges.

    ``txid`` (from the trigger form) re-attempts that txid: a manual backfill. Past the
    pipeline's ``max_pending`` the task ends as skipped, and so does the run: nothing planned.
    Returns one entry per processing group (the process task maps over them).
    """

    template_fields = ("batch_size", "txid", "groups")

    def __init__(self, *, pipeline: str, postgres_conn_id: str = DEFAULT_CONN_ID,
                 batch_size: Any = None, txid: Any = None, groups: Any = None, **kwargs):
        super().__init__(**kwargs)
        self.pipeline = pipeline
        self.postgres_conn_id = postgres_conn_id
        self.batch_size = batch_size
        self.txid = txid
        self.groups = groups

    def execute(self, context) -> list[dict[str, Any]]:
        from airflow.exceptions import AirflowSkipException

        from onceflow.coordinator import MaxPendingReached, begin
        from onceflow.db import connection

        pipeline = _pipeline(self.pipeline, self.batch_size, self.groups)
        try:
            with connection(airflow_dsn(self.postgres_conn_id)) as conn:
                batch = begin(conn, pipeline, context["run_id"],
                              txid=int(self.txid) if self.txid not in (None, "") else None)
        except MaxPendingReached as full:
            raise AirflowSkipException(str(full)) from full
        self.log.info("%s: %s reads %d records in %d range(s)%s", pipeline.name, batch.attempt,
                      batch.records, len(batch.ranges),
                      " (committed already: nothing to do)" if batch.committed else "")
        return [
            {"pipeline": pipeline.name, "txid": batch.attempt.txid,
             "attempt": batch.attempt.attempt, "group": group, "groups": batch.groups,
             "records": sum(r.size for r, g in batch.ranges if g == group),
             "committed": batch.committed}
            for group in range(batch.groups)
        ]


class ProcessBatchOperator(SparkSubmitOperator):
    """spark-submit spark_tasks/process_batch.py for one (txid, attempt, group).

    Checks the fence first (no Spark start for a committed txid or a fenced attempt). The DSN
    reaches the Spark driver through the environment, resolved from the Airflow connection when
    the task runs (it is never rendered into the task's template fields).
    """

    template_fields = (*SparkSubmitOperator.template_fields, "batch")

    def __init__(self, *, pipeline: str, batch: Any, postgres_conn_id: str = DEFAULT_CONN_ID,
                 **kwargs):
        kwargs.setdefault("application", PROCESS_ENTRY_POINT)
        kwargs.setdefault("name", f"onceflow-{pipeline}")
        kwargs.setdefault("on_failure_callback", mark_transaction_failed)
        kwargs["conf"] = {**SPARK_DEFAULTS, **(kwargs.get("conf") or {})}
        venv_submit = Path(sys.executable).with_name("spark-submit")
        if venv_submit.exists():
            kwargs.setdefault("spark_binary", str(venv_submit))
        super().__init__(**kwargs)
        self.pipeline = pipeline
        self.batch = batch  # one entry of begin's result
        self.postgres_conn_id = postgres_conn_id

    def execute(self, context) -> None:
        from airflow.exceptions import AirflowFailException

        from onceflow.db import connection, transaction
        from onceflow.txn import Fenced, current_attempt

        ta = _attempt(self.batch)
        group = int(self.batch.get("group", 0))
        dsn = airflow_dsn(self.postgres_conn_id)
        try:
            with connection(dsn) as conn, transaction(conn) as cur:
                txn_state = current_attempt(cur, self.pipeline, ta)
        except Fenced as fenced:
            raise AirflowFailException(str(fenced)) from fenced
        if txn_state == "committed":
            self.log.info("%s of %s is committed already: nothing to process", ta, self.pipeline)
            return
        if txn_state != "planned":
            raise AirflowFailException(f"{ta} of {self.pipeline} is {txn_state}: not processed")
        inject_fault("process.before", ta.txid, context["ti"].try_number)
        inject_fault(f"process.before.group{group}", ta.txid, context["ti"].try_number)
        self.application_args = [
            "--pipeline", self.pipeline, "--txid", str(ta.txid),
            "--attempt", str(ta.attempt), "--group", str(group),
        ]
        self.env_vars = {
            **(self.env_vars or {}),
            "ONCEFLOW_PG_DSN": dsn,
            "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable),
            "PYSPARK_DRIVER_PYTHON": os.environ.get("PYSPARK_DRIVER_PYTHON", sys.executable),
        }
        self.log.info("processing %s of %s, group %d", ta, self.pipeline, group)
        super().execute(context)


class CommitBatchOperator(BaseOperator):
    """Commit the batch when its turn comes (txid - 1 committed), in one PostgreSQL transaction.

    While an earlier txid is uncommitted the task defers (no worker slot is held) to
    CommitTurnTrigger. Past ``commit_timeout`` it fails, naming the blocking txid, its state and
    the run to retry. Committing an already committed txid is a logged no-op; a fenced attempt
    fails at once, without retries.
    """

    template_fields = ("batch",)

    def __init__(self, *, pipeline: str, batch: Any, postgres_conn_id: str = DEFAULT_CONN_ID,
                 commit_timeout: timedelta = timedelta(hours=1), poll_interval: float = 2.0,
                 **kwargs):
        kwargs.setdefault("on_failure_callback", mark_transaction_failed)
        super().__init__(**kwargs)
        self.pipeline = pipeline
        self.batch = batch
        self.postgres_conn_id = postgres_conn_id
        self.commit_timeout = commit_timeout
        self.poll_interval = poll_interval

    def execute(self, context) -> dict[str, Any]:
        return self._try_commit(time.time() + self.commit_timeout.total_seconds(), context)

    def execute_complete(self, context, event: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._try_commit(float((event or {}).get("deadline", 0)) or time.time(), context)

    def _try_commit(self, deadline: float, context=None) -> dict[str, Any]:
        from airflow.exceptions import AirflowFailException

        from onceflow.committer import commit
        from onceflow.db import connection
        from onceflow.triggers import CommitTurnTrigger
        from onceflow.txn import Fenced

        pipeline = _pipeline(self.pipeline)
        ta = _attempt(self.batch)
        try:
            dsn = airflow_dsn(self.postgres_conn_id)
            with connection(dsn) as conn:
                result = commit(conn, pipeline, ta, state_dsns=_state_dsns(pipeline),
                                coordinator_dsn=dsn)
        except Fenced as fenced:
            raise AirflowFailException(str(fenced)) from fenced
        if result.status == "waiting":
            if time.time() >= deadline:
                raise TimeoutError(
                    f"{ta} of {pipeline.name} waited {self.commit_timeout} for its turn: txid "
                    f"{result.blocking_txid} is {result.blocking_state or 'not planned yet'}"
                    + (f" (run {result.blocking_run_id}); retry or clear that run"
                       if result.blocking_run_id else "; trigger a run to plan it")
                )
            self.log.info("%s waits for txid %s (%s, run %s) to commit", ta,
                          result.blocking_txid, result.blocking_state, result.blocking_run_id)
            self.defer(
                trigger=CommitTurnTrigger(pipeline.name, ta.txid, self.postgres_conn_id,
                                          self.poll_interval, deadline),
                method_name="execute_complete",
            )
        if context and "ti" in context:
            inject_fault("commit.after", ta.txid, context["ti"].try_number)
        return {"txid": ta.txid, "attempt": ta.attempt, "status": result.status,
                "rows_applied": result.rows_applied, "waited_s": result.waited_s}
