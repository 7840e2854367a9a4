"""
### onceflow: the tweets pipeline on the file-segment source (Airflow DAG)

The same transaction as `onceflow_tweets` (begin >> process >> commit, exactly once), reading
Parquet segment files (one folder per partition, indexed in PostgreSQL) instead of the
PostgreSQL log: the bulk-data source kind. Produce into it with
`onceflow produce --pipeline tweets_files`.
"""

from __future__ import annotations

from onceflow.dagfactory import transaction_dag

dag = transaction_dag(
    "onceflow_tweets_files",
    pipeline="tweets_files",
    description="Exactly-once URL and domain counts from tweets in Parquet segment files",
    doc_md=__doc__,
    tags=("files",),
)
