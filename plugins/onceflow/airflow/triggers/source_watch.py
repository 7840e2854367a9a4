"""The source watcher of a pipeline that keeps up by itself (``Pipeline(keep_up=True)``,
docs/keep-up.md), run by Airflow's triggerer: Airflow's event-driven scheduling.

The transaction DAG of such a pipeline is scheduled on its source's Asset
(onceflow.airflow.assets.source_asset: ``onceflow-source://<pipeline>``), whose AssetWatcher
is a ``SourceWatchTrigger``. Every ``watch_interval`` seconds the trigger looks at the
pipeline's coordinator and source (onceflow.core.keepup: a few indexed queries, no Spark)
and, when a run should start, yields an event; Airflow records an Asset event and the
scheduler starts a DAG run for it, at most ``max_active_runs`` at a time. A run the
watcher started plans no empty transaction: its begin ends it without a txid when it finds
nothing to read (``skip_empty``).

Manual runs (Trigger, a backfill with ``{"txid": N}``) go on beside it: they are runs of the
same DAG, and the watcher counts every begin. Pausing the DAG stops the watcher (Airflow
runs the watchers of active DAGs only).

A keep-up DAG allows ``max_runs`` active runs (onceflow.core.keepup.max_runs): the runs past
``max_pending`` wait in their begin and plan the moment a transaction commits. The watcher
asks Airflow how many runs the DAG has (the Task SDK's run count, as Airflow's own
ExternalTaskSensor trigger does) to keep them there, and LISTENs to the pipeline's commit
announcements, so a commit makes it look at once instead of at its next interval.

This module is part of the installed package (not the DAGs folder), so the triggerer can
import it; it loads no operator and no Spark.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Iterable
from typing import Any

from airflow.triggers.base import BaseEventTrigger, TriggerEvent
from psycopg2 import sql

from onceflow.core import keepup, txlog
from onceflow.core.connections import DEFAULT_CONN_ID
from onceflow.core.db import connect
from onceflow.core.lease import this_process
from onceflow.core.pipeline import Pipeline
from onceflow.core.registry import get_pipeline

# The classpath Airflow stores for the trigger (onceflow.airflow.triggers exports it).
CLASSPATH = "onceflow.airflow.triggers.SourceWatchTrigger"
PRUNE_EVERY_S = 300.0  # sightings every pipeline committed past are forgotten this often
QUIET_S = 300.0  # a look that keeps failing for the same reason is logged again after this
OUTSTANDING_LOOK_S = 0.5  # between looks while an event's run is still to be made
RUNS_TIMEOUT_S = 5.0  # the longest a look waits for Airflow's count of the DAG's runs
RUNS_RETRY_S = 60.0  # how long a watcher Airflow did not answer counts begins instead

log = logging.getLogger(__name__)


class _Looker:
    """A connection of its own to the coordinator (autocommit: each look sees what is
    committed), and the source's watching() context (what it keeps from look to look), both
    opened again after an error."""

    def __init__(self, dsn: str, pipeline: Pipeline):
        self.dsn, self.pipeline = dsn, pipeline
        self.conn = None
        # each look runs in a thread of asyncio.to_thread's: the source's watching() context
        # variables live in a context of the looker's own, which every look enters
        self.context: contextvars.Context | None = None
        self.watching = contextlib.ExitStack()
        self.heads: dict[int, int] | None = None
        self.pruned = time.monotonic()
        self.recorded, self.record_failed = float("-inf"), False

    def look(self) -> keepup.Look | None:
        if self.conn is None or self.conn.closed:
            self.conn = connect(self.dsn, application_name="onceflow-watch")
            self.conn.autocommit = True
        if self.context is None:
            self.context = contextvars.copy_context()
            self.context.run(self.watching.enter_context, self.pipeline.source.watching())
        try:
            return self.context.run(self._look)
        except Exception:
            self.close()
            raise

    def _look(self) -> keepup.Look | None:
        with self.conn.cursor() as cur:
            seen = keepup.look(cur, self.pipeline, self.heads)
            if seen is not None:
                self.heads = seen.heads
            if time.monotonic() - self.pruned > PRUNE_EVERY_S:
                keepup.prune_sightings(cur, self.pipeline)
                self.pruned = time.monotonic()
        return seen

    def record(self, seen: keepup.Look | None, runs: keepup.Runs | None, max_runs: int,
               event: str | None) -> None:
        """What this look saw and did, for status (onceflow.core.keepup.record_watch): at
        each event, else at most every RECORD_EVERY_S. Never fails the watcher."""
        now = time.monotonic()
        if seen is None or (event is None and now - self.recorded < keepup.RECORD_EVERY_S):
            return
        try:
            with self.conn.cursor() as cur:
                keepup.record_watch(cur, self.pipeline, this_process(), seen, runs, max_runs,
                                    event)
            self.recorded = now
        except Exception as error:  # noqa: BLE001 (an older schema: status cannot tell)
            if not self.record_failed:
                log.warning("pipeline %s: the watcher's state is not recorded (%s: %s)",
                            self.pipeline.name, type(error).__name__, error)
                self.record_failed = True

    def close(self) -> None:
        if self.context is not None:
            context, self.context = self.context, None
            context.run(self.watching.close)
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class _CommitListener:
    """A connection LISTENing on the commit announcements (txlog.TURN_CHANNEL, whose payload
    is the pipeline's name): ``pause`` returns early when the pipeline committed or failed a
    transaction. Without it (it could not connect) ``pause`` just sleeps."""

    def __init__(self, dsn: str, pipeline: str):
        self.dsn, self.pipeline = dsn, pipeline
        self.conn = None

    def _open(self) -> None:
        self.conn = connect(self.dsn, application_name="onceflow-watch-listen")
        self.conn.autocommit = True
        with self.conn.cursor() as cur:
            cur.execute(sql.SQL("LISTEN {}").format(sql.Identifier(txlog.TURN_CHANNEL)))

    def _heard(self) -> bool:
        self.conn.poll()
        mine = any(n.payload == self.pipeline for n in self.conn.notifies)
        self.conn.notifies.clear()
        return mine

    async def pause(self, seconds: float) -> None:
        try:
            if self.conn is None or self.conn.closed:
                await asyncio.to_thread(self._open)
            if self._heard():
                return
            loop, readable = asyncio.get_running_loop(), asyncio.Event()
            until = time.monotonic() + seconds
            loop.add_reader(self.conn.fileno(), readable.set)
            try:
                while (left := until - time.monotonic()) > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(readable.wait(), left)
                    readable.clear()
                    if self._heard():
                        return
            finally:
                loop.remove_reader(self.conn.fileno())
        except Exception:  # noqa: BLE001 (the database away: the looks say so; sleep instead)
            self.close()
            await asyncio.sleep(max(0.0, seconds))

    def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()
            self.conn = None


def _dag_runs(dag_id: str) -> keepup.Runs:
    """The DAG's runs, from Airflow (the Task SDK's count, answered by the triggerer). Raises
    where no triggerer answers (a trigger run by hand)."""
    # the Task SDK's task runner: only the triggerer counts runs, not the DAG processor
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    active = RuntimeTaskInstance.get_dr_count(dag_id=dag_id, states=["queued", "running"])
    return keepup.Runs(active=int(active), total=int(RuntimeTaskInstance.get_dr_count(
        dag_id=dag_id)))


class SourceWatchTrigger(BaseEventTrigger):
    """Watches a keep-up pipeline's source and coordinator; yields an event each time a
    transaction run should start (onceflow.core.keepup says when). Runs for as long as the
    DAG scheduled on the Asset is active. Its keyword arguments are the pipeline's settings
    at the DAG's parse: a changed declaration is a new trigger."""

    def __init__(self, pipeline: str, pipeline_refs: Iterable[str] = (),
                 postgres_conn_id: str = DEFAULT_CONN_ID, watch_interval: float = 2.0,
                 min_records: int = 1, max_delay_s: float = 10.0, max_pending: int = 3,
                 batch_size: int = 20_000, dag_id: str | None = None,
                 max_runs: int | None = None):
        super().__init__()
        self.pipeline = pipeline
        self.pipeline_refs = list(pipeline_refs)
        self.postgres_conn_id = postgres_conn_id
        self.watch_interval = float(watch_interval)
        self.min_records = int(min_records)
        self.max_delay_s = float(max_delay_s)
        self.max_pending = int(max_pending)
        self.batch_size = int(batch_size)
        self.dag_id = dag_id or f"onceflow_{pipeline}"
        self.max_runs = int(max_runs) if max_runs else \
            (1 + keepup.WAITING_RUNS) * self.max_pending
        self._ask_runs_after = 0.0

    def serialize(self) -> tuple[str, dict[str, Any]]:
        # Names and settings only: the DSN is looked up where the trigger runs.
        return CLASSPATH, {
            "pipeline": self.pipeline, "pipeline_refs": self.pipeline_refs,
            "postgres_conn_id": self.postgres_conn_id, "watch_interval": self.watch_interval,
            "min_records": self.min_records, "max_delay_s": self.max_delay_s,
            "max_pending": self.max_pending, "batch_size": self.batch_size,
            "dag_id": self.dag_id, "max_runs": self.max_runs}

    def _load(self) -> Pipeline:
        return get_pipeline(self.pipeline, tuple(self.pipeline_refs),
                            batch_size=self.batch_size, min_records=self.min_records,
                            max_delay=self.max_delay_s, max_pending=self.max_pending,
                            watch_interval=self.watch_interval)

    async def _runs(self) -> keepup.Runs | None:
        # A count that does not come back in time would stop the looks (and status would say
        # the watcher is not running): the watcher then counts begins instead, as where
        # Airflow gives no count, and asks Airflow again only after a while.
        if time.monotonic() < self._ask_runs_after:
            return None
        try:
            return await asyncio.wait_for(asyncio.to_thread(_dag_runs, self.dag_id),
                                          timeout=max(self.watch_interval, RUNS_TIMEOUT_S))
        except Exception as error:  # noqa: BLE001 (then the begins tell, see keepup)
            self.log.warning("pipeline %s: Airflow does not tell the runs of DAG %s "
                             "(%s: %s); counting begins instead for %.0fs", self.pipeline,
                             self.dag_id, type(error).__name__, error, RUNS_RETRY_S)
            self._ask_runs_after = time.monotonic() + RUNS_RETRY_S
            return None

    async def run(self):
        pipeline, looker, listener, said = None, None, None, (None, 0.0)
        self._ask_runs_after = 0.0
        try:
            while True:
                runs = None
                try:
                    if looker is None:
                        # imported here, in the triggerer: a DAG file's parse does not
                        # import the postgres provider's hook
                        from onceflow.airflow.hooks import OnceflowHook

                        dsn = await OnceflowHook.adsn(self.postgres_conn_id)
                        pipeline = await asyncio.to_thread(self._load)
                        looker, watch = _Looker(dsn, pipeline), keepup.Watch(pipeline)
                        watch.max_runs = self.max_runs
                        listener = _CommitListener(dsn, pipeline.name)
                        self.log.info("watching the source of pipeline %s (%s) every %.1fs: "
                                      "a run at %d records or after %.1fs, %d in flight at "
                                      "most", pipeline.name, pipeline.source.describe(),
                                      self.watch_interval, self.min_records,
                                      self.max_delay_s, self.max_pending)
                    runs = await self._runs()
                    seen = await asyncio.to_thread(looker.look)
                except Exception as error:  # the database away, a folder gone: look again
                    text = f"{type(error).__name__}: {error}"
                    if text != said[0] or time.monotonic() - said[1] > QUIET_S:
                        self.log.warning("pipeline %s: cannot look at its source now (%s); "
                                         "looking again every %.1fs", self.pipeline, text,
                                         self.watch_interval)
                        said = (text, time.monotonic())
                else:
                    why = watch.decide(seen, runs)
                    if why is not None:
                        payload = {"pipeline": self.pipeline, "reason": why, "event": watch.fired}
                        if seen is not None:
                            payload.update(records=seen.unread, open=seen.open,
                                           oldest_wait_s=seen.oldest_wait_s,
                                           at=seen.now.isoformat())
                        if runs is not None:
                            payload.update(runs=runs.active)
                        self.log.info("pipeline %s: a run should start (%s): %s",
                                      self.pipeline, why, payload)
                    await asyncio.to_thread(looker.record, seen, runs, self.max_runs, why)
                    if why is not None:
                        yield TriggerEvent(payload)
                # an event whose run Airflow has not made yet: look again soon, so that the
                # next one is asked for as soon as it is made
                pause = min(self.watch_interval, OUTSTANDING_LOOK_S) \
                    if runs is not None and watch.outstanding else self.watch_interval
                if listener is None:
                    await asyncio.sleep(pause)
                else:
                    await listener.pause(pause)
        finally:
            if listener is not None:
                listener.close()
            if looker is not None:
                await asyncio.to_thread(looker.close)
