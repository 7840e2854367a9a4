"""The source watcher of a pipeline that keeps up by itself (``Pipeline(keep_up=True)``,
docs/keep-up.md), run by Airflow's triggerer: Airflow's event-driven scheduling.

The transaction DAG of such a pipeline is scheduled on its source's Asset
(onceflow.airflow.assets.source_asset: ``onceflow-source://<pipeline>``), whose AssetWatcher
is a ``SourceWatchTrigger``. Every ``watch_interval`` seconds the trigger looks at the
pipeline's coordinator and source (onceflow.core.keepup: a few indexed queries, no Spark)
and, when a run should start, yields an event; Airflow records an Asset event and the
scheduler starts a DAG run for it, at most ``max_active_runs`` (the pipeline's
``max_pending``) at a time. A run the watcher started plans no empty transaction: its begin
ends it without a txid when it finds nothing to read (``skip_empty``).

Manual runs (Trigger, a backfill with ``{"txid": N}``) go on beside it: they are runs of the
same DAG, and the watcher counts every begin. Pausing the DAG stops the watcher (Airflow
runs the watchers of active DAGs only).

This module is part of the installed package (not the DAGs folder), so the triggerer can
import it; it loads no operator and no Spark.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

from airflow.triggers.base import BaseEventTrigger, TriggerEvent

from onceflow.airflow.hooks import OnceflowHook
from onceflow.core import keepup
from onceflow.core.connections import DEFAULT_CONN_ID
from onceflow.core.db import connect
from onceflow.core.pipeline import Pipeline
from onceflow.core.registry import get_pipeline

# The classpath Airflow stores for the trigger (onceflow.airflow.triggers exports it).
CLASSPATH = "onceflow.airflow.triggers.SourceWatchTrigger"
PRUNE_EVERY_S = 300.0  # sightings every pipeline committed past are forgotten this often
QUIET_S = 300.0  # a look that keeps failing for the same reason is logged again after this


class _Looker:
    """A connection of its own to the coordinator (autocommit: each look sees what is
    committed), opened again after an error."""

    def __init__(self, dsn: str, pipeline: Pipeline):
        self.dsn, self.pipeline = dsn, pipeline
        self.conn = None
        self.heads: dict[int, int] | None = None
        self.pruned = time.monotonic()

    def look(self) -> keepup.Look | None:
        if self.conn is None or self.conn.closed:
            self.conn = connect(self.dsn, application_name="onceflow-watch")
            self.conn.autocommit = True
        try:
            with self.conn.cursor() as cur:
                seen = keepup.look(cur, self.pipeline, self.heads)
                if seen is not None:
                    self.heads = seen.heads
                if time.monotonic() - self.pruned > PRUNE_EVERY_S:
                    keepup.prune_sightings(cur, self.pipeline)
                    self.pruned = time.monotonic()
            return seen
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class SourceWatchTrigger(BaseEventTrigger):
    """Watches a keep-up pipeline's source and coordinator; yields an event each time a
    transaction run should start (onceflow.core.keepup says when). Runs for as long as the
    DAG scheduled on the Asset is active. Its keyword arguments are the pipeline's settings
    at the DAG's parse: a changed declaration is a new trigger."""

    def __init__(self, pipeline: str, pipeline_refs: Iterable[str] = (),
                 postgres_conn_id: str = DEFAULT_CONN_ID, watch_interval: float = 2.0,
                 min_records: int = 1, max_delay_s: float = 10.0, max_pending: int = 3,
                 batch_size: int = 20_000):
        super().__init__()
        self.pipeline = pipeline
        self.pipeline_refs = list(pipeline_refs)
        self.postgres_conn_id = postgres_conn_id
        self.watch_interval = float(watch_interval)
        self.min_records = int(min_records)
        self.max_delay_s = float(max_delay_s)
        self.max_pending = int(max_pending)
        self.batch_size = int(batch_size)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        # Names and settings only: the DSN is looked up where the trigger runs.
        return CLASSPATH, {
            "pipeline": self.pipeline, "pipeline_refs": self.pipeline_refs,
            "postgres_conn_id": self.postgres_conn_id, "watch_interval": self.watch_interval,
            "min_records": self.min_records, "max_delay_s": self.max_delay_s,
            "max_pending": self.max_pending, "batch_size": self.batch_size}

    def _load(self) -> Pipeline:
        return get_pipeline(self.pipeline, tuple(self.pipeline_refs),
                            batch_size=self.batch_size, min_records=self.min_records,
                            max_delay=self.max_delay_s, max_pending=self.max_pending,
                            watch_interval=self.watch_interval)

    async def run(self):
        pipeline, looker, said = None, None, (None, 0.0)
        try:
            while True:
                try:
                    if looker is None:
                        dsn = await OnceflowHook.adsn(self.postgres_conn_id)
                        pipeline = await asyncio.to_thread(self._load)
                        looker, watch = _Looker(dsn, pipeline), keepup.Watch(pipeline)
                        self.log.info("watching the source of pipeline %s (%s) every %.1fs: "
                                      "a run at %d records or after %.1fs, %d in flight at "
                                      "most", pipeline.name, pipeline.source.describe(),
                                      self.watch_interval, self.min_records,
                                      self.max_delay_s, self.max_pending)
                    seen = await asyncio.to_thread(looker.look)
                except Exception as error:  # the database away, a folder gone: look again
                    text = f"{type(error).__name__}: {error}"
                    if text != said[0] or time.monotonic() - said[1] > QUIET_S:
                        self.log.warning("pipeline %s: cannot look at its source now (%s); "
                                         "looking again every %.1fs", self.pipeline, text,
                                         self.watch_interval)
                        said = (text, time.monotonic())
                else:
                    why = watch.decide(seen)
                    if why is not None:
                        payload = {"pipeline": self.pipeline, "reason": why, "event": watch.fired}
                        if seen is not None:
                            payload.update(records=seen.unread, open=seen.open,
                                           oldest_wait_s=seen.oldest_wait_s,
                                           at=seen.now.isoformat())
                        self.log.info("pipeline %s: a run should start (%s): %s",
                                      self.pipeline, why, payload)
                        yield TriggerEvent(payload)
                await asyncio.sleep(self.watch_interval)
        finally:
            if looker is not None:
                await asyncio.to_thread(looker.close)
