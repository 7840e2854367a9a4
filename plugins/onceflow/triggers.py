"""Deferrable waiting for a commit's turn, run by Airflow's triggerer.

This module is part of the installed onceflow package (not the DAGs folder), so the triggerer
can import it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent


def _last_committed(dsn: str, pipeline: str) -> int:
    import psycopg2

    conn = psycopg2.connect(dsn, application_name="onceflow-trigger")
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT last_committed_txid FROM pipelines WHERE name = %s", (pipeline,))
            row = cur.fetchone()
            return row[0] if row else 0
    finally:
        conn.close()


class CommitTurnTrigger(BaseTrigger):
    """Fires once ``pipeline``'s last committed txid reaches ``txid - 1`` (the commit's turn),
    or at ``deadline`` (epoch seconds); the event carries the deadline back to the operator,
    which decides.
    """

    def __init__(self, pipeline: str, txid: int, postgres_conn_id: str,
                 poll_interval: float = 2.0, deadline: float = 0.0):
        super().__init__()
        self.pipeline = pipeline
        self.txid = txid
        self.postgres_conn_id = postgres_conn_id
        self.poll_interval = poll_interval
        self.deadline = deadline

    def serialize(self) -> tuple[str, dict[str, Any]]:
        # Only ids go to the metadata database: the DSN is looked up again where this runs.
        return (
            "onceflow.triggers.CommitTurnTrigger",
            {"pipeline": self.pipeline, "txid": self.txid,
             "postgres_conn_id": self.postgres_conn_id, "poll_interval": self.poll_interval,
             "deadline": self.deadline},
        )

    async def run(self):
        from onceflow.connections import airflow_dsn_async

        dsn = await airflow_dsn_async(self.postgres_conn_id)
        while True:
            last = await asyncio.to_thread(_last_committed, dsn, self.pipeline)
            if last >= self.txid - 1 or time.time() >= self.deadline:
                yield TriggerEvent({"last_committed_txid": last, "deadline": self.deadline})
                return
            await asyncio.sleep(self.poll_interval)
