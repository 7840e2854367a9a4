"""A downstream DAG of the tweets example: it runs when the tweets pipeline commits (it is
scheduled on the Asset of the `domain_counts` state table, see onceflow.airflow.assets) and
logs the top domains, reading committed data only. Shipped to Airflow by the entry point
``tweets_report = "tweets_example.report:dag"`` in the group ``onceflow.dags``, which
onceflow's DAG file loads.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, task

from onceflow.airflow.assets import state_asset

with DAG(
    dag_id="tweets_top_domains",
    description="The top domains, after each commit of the tweets pipeline",
    schedule=[state_asset("tweets", "domain_counts")],
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["onceflow", "example"],
    default_args={"retries": 1},
) as dag:

    @task
    def report_top_domains(triggering_asset_events=None) -> list:
        """The ten domains with the most URLs, and the txid that committed them."""
        from onceflow.core.connections import resolve_dsn
        from onceflow.core.db import connection

        txids = [e.extra.get("txid") for events in (triggering_asset_events or {}).values()
                 for e in events]
        with connection(resolve_dsn()) as conn, conn.cursor() as cur:
            cur.execute("SELECT key, value FROM domain_counts ORDER BY value DESC, key LIMIT 10")
            top = cur.fetchall()
        print(f"after txid(s) {txids}: top domains {top}")
        return top

    report_top_domains()
