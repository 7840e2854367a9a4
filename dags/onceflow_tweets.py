"""
### onceflow: tweets -> counts per URL and per domain, exactly once

One DAG run is one attempt of one transaction:

1. **begin** gives the run its transaction attempt: the txid from the trigger form (backfill),
   the run's own txid (Clear), the lowest failed txid (automatic backfill), or a new one, and
   stores the offsets it reads. Past `max_pending` uncommitted transactions the run is skipped;
2. **process** runs one Spark job per processing group on exactly those offsets and stages
   partial counts;
3. **commit** waits for txid - 1 to commit (deferred, no worker slot held), then applies the
   counts, the offsets and the commit record in one PostgreSQL transaction. Its log has one
   `COMMIT ... txid=N attempt=A prev_txid=N-1 rows=R waited=Ws` line.

Several runs may be active at once: processing overlaps, commits stay in txid order.
Connections: `onceflow_pg` (PostgreSQL) and `spark_default` (Spark master).
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta

from airflow.sdk import DAG, Param

from onceflow.operators import (
    BeginBatchOperator,
    CommitBatchOperator,
    ProcessBatchOperator,
    mark_transaction_failed,
)

PIPELINE = "tweets"

with DAG(
    dag_id="onceflow_tweets",
    description="Exactly-once URL and domain counts from the tweets topic",
    doc_md=__doc__,
    start_date=datetime(2026, 1, 1),
    schedule=None,
    catchup=False,
    max_active_runs=3,
    render_template_as_native_obj=True,
    tags=["onceflow", "exactly-once", "spark"],
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
        task_id="begin", pipeline=PIPELINE, batch_size="{{ params.batch_size }}",
        groups="{{ params.groups }}", txid="{{ params.txid }}",
    )
    # one process task per processing group of the batch
    process = ProcessBatchOperator.partial(
        task_id="process", pipeline=PIPELINE, conn_id="spark_default"
    ).expand(batch=begin.output)
    commit = CommitBatchOperator(task_id="commit", pipeline=PIPELINE, batch=begin.output)

    begin >> process >> commit
