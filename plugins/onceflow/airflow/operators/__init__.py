"""onceflow's operators: a transaction's begin, process and commit tasks, and the one-task
transaction (transaction.py), with what their tasks share (the pipeline's loading, the run
note, failures told to Airflow)."""

from onceflow.airflow.operators.transaction import (
    WAIT_IN_TASK_S,
    BeginBatchOperator,
    CommitBatchOperator,
    ProcessBatchOperator,
    TransactionOperator,
    airflow_outcomes,
    lease_for_retry,
    load_pipeline,
    mark_transaction_failed,
    run_note,
    seconds_setting,
)

__all__ = ["BeginBatchOperator", "CommitBatchOperator", "ProcessBatchOperator",
           "TransactionOperator", "WAIT_IN_TASK_S", "airflow_outcomes", "lease_for_retry",
           "load_pipeline", "mark_transaction_failed", "run_note", "seconds_setting"]
