"""onceflow's operators: a transaction's begin, process and commit tasks, and the one-task
transaction (transaction.py), with what their tasks share (the pipeline's loading, the run
note, failures told to Airflow)."""

from onceflow.airflow.operators.transaction import (
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
           "TransactionOperator", "airflow_outcomes", "lease_for_retry", "load_pipeline",
           "mark_transaction_failed", "run_note", "seconds_setting"]
