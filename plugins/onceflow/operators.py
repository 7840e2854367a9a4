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


def _pipeline(name: str, batch_size: Any = None):
    from onceflow.pipeline import get_pipeline

    overrides = {}
    if batch_size not in (None, ""):
        overrides["batch_size"] = int(batch_size)
    return get_pipeline(name, **overrides)


def _attempt(batch: Mapping[str, Any]):
    from onceflow.txn import TransactionAttempt

    return TransactionAttempt(int(batch["txid"]), int(batch["attempt"]))


class BeginBatchOperator(BaseOperator):
    """Give this DAG run its transaction (txid, attempt) and store the batch's offset ranges.

    A retry or a Clear of the run keeps its txid. Returns the batch for the next tasks.
    """

    template_fields = ("batch_size",)

    def __init__(self, *, pipeline: str, postgres_conn_id: str = DEFAULT_CONN_ID,
                 batch_size: Any = None, **kwargs):
        super().__init__(**kwargs)
        self.pipeline = pipeline
        self.postgres_conn_id = postgres_conn_id
        self.batch_size = batch_size

    def execute(self, context) -> dict[str, Any]:
        from onceflow.coordinator import begin
        from onceflow.db import connect

        pipeline = _pipeline(self.pipeline, self.batch_size)
        conn = connect(airflow_dsn(self.postgres_conn_id))
        try:
            batch = begin(conn, pipeline, context["run_id"])
        finally:
            conn.close()
        self.log.info("%s: %s reads %d records in %d range(s)%s", pipeline.name, batch.attempt,
                      batch.records, len(batch.ranges), " (reused)" if batch.reused else "")
        return {
            "pipeline": pipeline.name,
            "txid": batch.attempt.txid,
            "attempt": batch.attempt.attempt,
            "records": batch.records,
            "groups": batch.groups,
        }


class ProcessBatchOperator(SparkSubmitOperator):
    """spark-submit spark_tasks/process_batch.py for one (txid, attempt, group).

    The DSN reaches the Spark driver through the environment, resolved from the Airflow
    connection when the task runs (it is never rendered into the task's template fields).
    """

    template_fields = (*SparkSubmitOperator.template_fields, "batch")

    def __init__(self, *, pipeline: str, batch: Any, group: int = 0,
                 postgres_conn_id: str = DEFAULT_CONN_ID, **kwargs):
        kwargs.setdefault("application", PROCESS_ENTRY_POINT)
        kwargs.setdefault("name", f"onceflow-{pipeline}")
        kwargs["conf"] = {**SPARK_DEFAULTS, **(kwargs.get("conf") or {})}
        venv_submit = Path(sys.executable).with_name("spark-submit")
        if venv_submit.exists():
            kwargs.setdefault("spark_binary", str(venv_submit))
        super().__init__(**kwargs)
        self.pipeline = pipeline
        self.batch = batch
        self.group = group
        self.postgres_conn_id = postgres_conn_id

    def execute(self, context) -> None:
        ta = _attempt(self.batch)
        self.application_args = [
            "--pipeline", self.pipeline, "--txid", str(ta.txid),
            "--attempt", str(ta.attempt), "--group", str(self.group),
        ]
        self.env_vars = {
            **(self.env_vars or {}),
            "ONCEFLOW_PG_DSN": airflow_dsn(self.postgres_conn_id),
            "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable),
            "PYSPARK_DRIVER_PYTHON": os.environ.get("PYSPARK_DRIVER_PYTHON", sys.executable),
        }
        self.log.info("processing %s of %s, group %d", ta, self.pipeline, self.group)
        super().execute(context)


class CommitBatchOperator(BaseOperator):
    """Commit the batch when its turn comes (txid - 1 committed), in one PostgreSQL transaction.

    While an earlier txid is uncommitted the task defers (no worker slot is held) to
    CommitTurnTrigger. Past ``commit_timeout`` it fails, naming the blocking txid, its state and
    the run to retry. Committing an already committed txid is a logged no-op.
    """

    template_fields = ("batch",)

    def __init__(self, *, pipeline: str, batch: Any, postgres_conn_id: str = DEFAULT_CONN_ID,
                 commit_timeout: timedelta = timedelta(hours=1), poll_interval: float = 2.0,
                 **kwargs):
        super().__init__(**kwargs)
        self.pipeline = pipeline
        self.batch = batch
        self.postgres_conn_id = postgres_conn_id
        self.commit_timeout = commit_timeout
        self.poll_interval = poll_interval

    def execute(self, context) -> dict[str, Any]:
        return self._try_commit(time.time() + self.commit_timeout.total_seconds())

    def execute_complete(self, context, event: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._try_commit(float((event or {}).get("deadline", 0)) or time.time())

    def _try_commit(self, deadline: float) -> dict[str, Any]:
        from onceflow.coordinator import commit
        from onceflow.db import connect
        from onceflow.triggers import CommitTurnTrigger

        pipeline = _pipeline(self.pipeline)
        ta = _attempt(self.batch)
        conn = connect(airflow_dsn(self.postgres_conn_id))
        try:
            result = commit(conn, pipeline, ta)
        finally:
            conn.close()
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
        return {"txid": ta.txid, "attempt": ta.attempt, "status": result.status,
                "rows_applied": result.rows_applied, "waited_s": result.waited_s}
