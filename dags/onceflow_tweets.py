"""
### onceflow: tweets -> counts per URL and per domain, exactly once (Airflow DAG)

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

from onceflow.dagfactory import transaction_dag

dag = transaction_dag(
    "onceflow_tweets",
    pipeline="tweets",
    description="Exactly-once URL and domain counts from the tweets topic",
    doc_md=__doc__,
)
