"""
### onceflow: the tweets pipeline with a stateful bolt (Airflow DAG)

The `onceflow_tweets` transaction plus first-seen detection: a stateful bolt keeps every URL
it has seen (checkpointed key-value state: prepared at the end of processing, committed with
the txid) and emits a URL only the first time, across batches; `first_seen_urls` must hold
exactly 1 per URL. It reads the `tweets` topic with offsets of its own. A batch reads the
state after the previous txid committed, so its runs process one after another.
"""

from __future__ import annotations

from onceflow.dagfactory import transaction_dag

dag = transaction_dag(
    "onceflow_tweets_first_seen",
    pipeline="tweets_first_seen",
    description="Exactly-once URL counts and first-seen URLs (a stateful bolt) from tweets",
    doc_md=__doc__,
    tags=("stateful",),
)
