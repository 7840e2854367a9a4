"""The process task (ProcessBatchOperator): the batch through the topology in Spark, by
spark-submit or in the task over Spark Connect, and staged for the commit."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

from onceflow.airflow.operators.spark_client import (
    PROCESS_ENTRY_POINT,
    SPARK_DEFAULTS,
    build_checked,
    module_root,
    spark_connect_url,
)
from onceflow.airflow.operators.task import (
    PipelineTask,
    airflow_outcomes,
    attempt_of,
    lease_for_retry,
    mark_transaction_failed,
    noting_skips,
)
from onceflow.core import settings, txlog
from onceflow.core.connections import DEFAULT_CONN_ID
from onceflow.core.db import connection, transaction
from onceflow.core.errors import Fenced
from onceflow.core.registry import reference_of
from onceflow.sources.jvm import jvm_conf
from onceflow.spark.versions import check_pyspark_pair


class Processes(PipelineTask):
    """The processing phase (ProcessBatchOperator, TransactionOperator)."""

    def _ready_to_process(self, pipeline, dsn: str, ta) -> bool:
        """The fence, checked before any Spark work: False when the txid is committed
        already (nothing to do); Fenced when ``ta`` is not its current attempt."""

        with airflow_outcomes():
            with connection(dsn) as conn, transaction(conn) as cur:
                state = txlog.fence(cur, pipeline.name, ta)
            if state is txlog.TxState.COMMITTED:
                self.log.info("%s of %s is committed already: nothing to process", ta,
                              pipeline.name)
                return False
            if state is not txlog.TxState.PLANNED:
                raise Fenced(f"{ta} of {pipeline.name} is {state}: not processed")
        return True

    def _process_here(self, url: str, pipeline, dsn: str, ta, group: int) -> None:
        # imported here: pyspark loads with it: only where Spark is used
        from onceflow.spark.localspark import revive
        from onceflow.spark.processing import process_batch
        from onceflow.spark.session import SHARED_SESSION_KEY, connect_session

        started = time.monotonic()
        # the local server onceflow started died (killed mid-batch, say): started again here
        with airflow_outcomes():
            revived = revive(url)
        if revived is not None:
            self.log.warning("the Spark Connect server onceflow started at %s was gone: "
                             "started it again (%s) in %.1fs", url, revived.line(),
                             time.monotonic() - started)
        with airflow_outcomes(), connect_session(url, f"onceflow-{pipeline.name}",
                                                   shared=SHARED_SESSION_KEY) as spark:
            self.log.info("processing %s of %s, group %d on %s (session in %.2fs)", ta,
                          pipeline.name, group, url, time.monotonic() - started)
            process_batch(spark, dsn, pipeline, ta, group)


class ProcessBatchOperator(Processes, SparkSubmitOperator):
    """The processing phase of one (txid, attempt, group): on a warm Spark through Spark
    Connect, or by spark-submit, as the Spark connection says.

    :param pipeline: the registered pipeline's name.
    :param batch: one entry of begin's result (txid, attempt, group).
    :param pipeline_refs: where the pipeline is declared (passed on to the Spark driver).
    :param postgres_conn_id: the coordinator's PostgreSQL connection.

    ``conn_id`` is the Spark connection. Of type ``spark_connect`` (e.g.
    ``spark-connect://127.0.0.1:15002``): this task is a Spark Connect client and runs the
    processing phase here, with no JVM start. Of type ``spark``: ``spark-submit
    spark_tasks/process_batch.py`` to its master (``local[2]``, ``spark://host:7077``, yarn,
    k8s), other keyword arguments going to SparkSubmitOperator; the DSN reaches the driver
    through the environment (never the command line or the template fields) and the
    pipeline's reference and its module's folder go along. Either way the fence is checked
    first: a committed txid or a fenced attempt starts no Spark work.
    """

    template_fields = (*SparkSubmitOperator.template_fields, "batch")

    def __init__(self, *, pipeline: str, batch: Any, pipeline_refs: Iterable[str] = (),
                 postgres_conn_id: str = DEFAULT_CONN_ID, **kwargs):
        kwargs.setdefault("application", PROCESS_ENTRY_POINT)
        kwargs.setdefault("name", f"onceflow-{pipeline}")
        kwargs.setdefault("on_failure_callback", mark_transaction_failed)
        kwargs.setdefault("on_retry_callback", lease_for_retry)
        kwargs["conf"] = {**SPARK_DEFAULTS, **(kwargs.get("conf") or {})}
        venv_submit = Path(sys.executable).with_name("spark-submit")
        if venv_submit.exists():
            kwargs.setdefault("spark_binary", str(venv_submit))
        super().__init__(**kwargs)
        self._which(pipeline, pipeline_refs, postgres_conn_id)
        self.batch = batch  # one entry of begin's result

    def execute(self, context) -> None:
        ta = attempt_of(self.batch)
        group = int(self.batch.get("group", 0))
        with noting_skips(context, self.pipeline, ta):
            self._process(context, ta, group)

    def _process(self, context, ta, group: int) -> None:
        with airflow_outcomes():
            pipeline, dsn = self._pipeline(), self._dsn()
        with self._holding(pipeline, dsn, ta, handoff=True):
            self._process_held(context, pipeline, dsn, ta, group)

    def _process_held(self, context, pipeline, dsn: str, ta, group: int) -> None:
        if not self._ready_to_process(pipeline, dsn, ta):
            return
        url = spark_connect_url(self._conn_id)
        if url is not None:
            self._process_here(url, pipeline, dsn, ta, group)
            return
        with airflow_outcomes():  # a declaration error fails here, once, not in the driver
            check_pyspark_pair()
            build_checked(pipeline)

        ref = reference_of(pipeline)
        refs = [*self.pipeline_refs, *([ref] if ref and ref not in self.pipeline_refs else [])]
        self.application_args = [
            "--pipeline", pipeline.name, "--txid", str(ta.txid),
            "--attempt", str(ta.attempt), "--group", str(group),
            *[arg for r in refs for arg in ("--pipelines", r)],
        ]
        path = [p for p in (module_root(r) for r in refs) if p]
        self.env_vars = {
            **(self.env_vars or {}),
            settings.env_name("pg_dsn"): dsn,
            "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable),
            "PYSPARK_DRIVER_PYTHON": os.environ.get("PYSPARK_DRIVER_PYTHON", sys.executable),
            **({"PYTHONPATH": os.pathsep.join(
                [*path, *filter(None, [os.environ.get("PYTHONPATH")])])} if path else {}),
        }

        # onceflow's JVM reader travels with the application (added to the conf's jars)
        self.conf = jvm_conf(self.conf)
        self.log.info("processing %s of %s, group %d (spark-submit)", ta, pipeline.name, group)
        super().execute(context)
