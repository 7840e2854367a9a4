"""Build a pipeline's transaction DAG: begin >> process (mapped over groups) >> commit.

Used by the files in dags/, which stay one call each (wiring only; nothing heavy at import).
Airflow's safe-mode parsing only opens DAG files whose text contains "airflow" and "dag":
a DAG file that only calls this must say both words (its docstring does).
"""

from __future__ import annotations

import os
import sys
from datetime import datetime, timedelta

from airflow.sdk import DAG, Param

from onceflow.operators import (
    BeginBatchOperator,
    CommitBatchOperator,
    ProcessBatchOperator,
    mark_transaction_failed,
)


def transaction_dag(dag_id: str, pipeline: str, *, description: str, doc_md: str,
                    tags: tuple[str, ...] = ()) -> DAG:
    """One DAG run = one attempt of one transaction of ``pipeline``."""
    with DAG(
        dag_id=dag_id,
        description=description,
        doc_md=doc_md,
        start_date=datetime(2026, 1, 1),
        schedule=None,
        catchup=False,
        max_active_runs=3,
        render_template_as_native_obj=True,
        tags=["onceflow", "exactly-once", "spark", *tags],
        default_args={
            # a task's last failure marks its attempt failed: the next run adopts the txid
            "on_failure_callback": mark_transaction_failed,
            "retries": 2,
            "retry_delay": timedelta(
                seconds=float(os.environ.get("ONCEFLOW_RETRY_DELAY_SECONDS", "10"))),
        },
        params={
            "batch_size": Param(20_000, type="integer", minimum=1,
                                description="Records per new transaction, across all partitions."),
            "groups": Param(1, type="integer", minimum=1,
                            description="Parallel Spark tasks per new transaction."),
            "txid": Param(None, type=["null", "integer"], minimum=1,
                          description="Re-attempt this txid (backfill). Empty: the next one."),
        },
    ) as dag:
        begin = BeginBatchOperator(
            task_id="begin", pipeline=pipeline, batch_size="{{ params.batch_size }}",
            groups="{{ params.groups }}", txid="{{ params.txid }}",
        )
        # one process task per processing group of the batch
        process = ProcessBatchOperator.partial(
            task_id="process", pipeline=pipeline, conn_id="spark_default"
        ).expand(batch=begin.output)
        commit = CommitBatchOperator(task_id="commit", pipeline=pipeline, batch=begin.output)

        begin >> process >> commit
    # The DAG belongs to the file that called this (the UI shows that file's code).
    dag.fileloc = sys._getframe(1).f_globals.get("__file__", dag.fileloc)
    return dag
