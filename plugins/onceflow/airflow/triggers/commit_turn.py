"""Deferrable waiting for a commit's turn, run by Airflow's triggerer.

This module is part of the installed onceflow package (not the DAGs folder), so the triggerer
can import it.
"""

from __future__ import annotations

import asyncio
import select
import time
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent
from psycopg2 import sql

from onceflow.core import txlog
from onceflow.core.db import connect, transaction
from onceflow.core.lease import this_process


def look_for_turn(dsn: str, pipeline: str, txid: int, attempt: int,
                  lease_s: int | None = None) -> tuple[int, bool]:
    """(last committed txid, whether the blocking txid cannot commit without a new run),
    reporting the waiting attempt alive on the way (``lease_s``: the lease it gives; None
    keeps the one it has)."""

    conn = connect(dsn, application_name="onceflow-trigger")
    try:
        with transaction(conn) as cur:
            txlog.heartbeat(cur, pipeline, txlog.TransactionAttempt(txid, attempt),
                            lease_s=lease_s, holder=this_process())
            last = txlog.last_committed(cur, pipeline)
            hopeless = last < txid - 1 and txlog.blocker(cur, pipeline, last + 1).hopeless
        return last, hopeless
    finally:
        conn.close()


class TurnListener:
    """A connection LISTENing on txlog.TURN_CHANNEL: ``wait(timeout)`` returns when a commit
    or a failure was announced (for any pipeline: the caller looks again) or at the timeout.
    Listening starts before the first look, so an announcement between a look and the wait
    is not missed."""

    def __init__(self, dsn: str, application_name: str = "onceflow-trigger-listen"):
        self.conn = connect(dsn, application_name=application_name)
        self.conn.autocommit = True
        with self.conn.cursor() as cur:
            cur.execute(sql.SQL("LISTEN {}").format(sql.Identifier(txlog.TURN_CHANNEL)))

    def wait(self, timeout: float) -> None:
        if not self.conn.notifies:
            select.select([self.conn], [], [], timeout)
        self.conn.poll()
        self.conn.notifies.clear()

    def close(self) -> None:
        self.conn.close()


class CommitTurnTrigger(BaseTrigger):
    """Fires once ``pipeline``'s last committed txid reaches ``txid - 1`` (the commit's turn),
    once the txid it waits for cannot commit without a new run (failed, or its run died), or
    at ``deadline`` (epoch seconds). The operator decides what the event means. Each look
    reports the waiting attempt's lease, giving it ``lease_s`` (the hand-over lease: when it
    fires, the task resumes only once Airflow schedules it).
    """

    def __init__(self, pipeline: str, txid: int, attempt: int, postgres_conn_id: str,
                 poll_interval: float = 2.0, deadline: float = 0.0,
                 lease_s: int | None = None):
        super().__init__()
        self.pipeline = pipeline
        self.txid = txid
        self.attempt = attempt
        self.postgres_conn_id = postgres_conn_id
        self.poll_interval = poll_interval
        self.deadline = deadline
        self.lease_s = lease_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        # Only ids go to the metadata database: the DSN is looked up again where this runs.
        return (
            "onceflow.airflow.triggers.CommitTurnTrigger",
            {"pipeline": self.pipeline, "txid": self.txid, "attempt": self.attempt,
             "postgres_conn_id": self.postgres_conn_id, "poll_interval": self.poll_interval,
             "deadline": self.deadline, "lease_s": self.lease_s},
        )

    async def run(self):
        # imported here, in the triggerer: a task that only defers to this trigger does not
        # import the postgres provider's hook
        from onceflow.airflow.hooks import OnceflowHook

        dsn = await OnceflowHook.adsn(self.postgres_conn_id)
        listener = await asyncio.to_thread(TurnListener, dsn)
        try:
            while True:
                last, hopeless = await asyncio.to_thread(
                    look_for_turn, dsn, self.pipeline, self.txid, self.attempt, self.lease_s)
                if last >= self.txid - 1 or hopeless or time.time() >= self.deadline:
                    yield TriggerEvent({"last_committed_txid": last,
                                        "deadline": self.deadline})
                    return
                # woken by an announced commit or failure; else a look every poll_interval
                # (it also keeps this attempt's lease alive)
                await asyncio.to_thread(listener.wait, self.poll_interval)
        finally:
            await asyncio.to_thread(listener.close)
