"""onceflow's operators: a transaction's begin, process and commit tasks (begin.py,
process.py, commit.py), and the one-task transaction (transaction.py), with what their tasks
share (task.py: the pipeline's loading, the run note, failures told to Airflow) and how they
reach Spark (spark_client.py)."""

from onceflow.airflow.operators.begin import BeginBatchOperator
from onceflow.airflow.operators.commit import CommitBatchOperator
from onceflow.airflow.operators.process import ProcessBatchOperator
from onceflow.airflow.operators.task import (
    WAIT_IN_TASK_S,
    airflow_outcomes,
    lease_for_retry,
    load_pipeline,
    mark_transaction_failed,
    run_note,
    seconds_setting,
)
from onceflow.airflow.operators.transaction import TransactionOperator

__all__ = ["BeginBatchOperator", "CommitBatchOperator", "ProcessBatchOperator",
           "TransactionOperator", "WAIT_IN_TASK_S", "airflow_outcomes", "lease_for_retry",
           "load_pipeline", "mark_transaction_failed", "run_note", "seconds_setting"]
