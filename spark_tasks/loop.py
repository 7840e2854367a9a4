"""Transactions without Airflow: begin, process and commit in a loop on one SparkSession, with
several batches processed at once (the library path; what the Airflow DAG does with
``max_active_runs`` runs in flight).

``run_batches`` begins a transaction whenever fewer than ``in_flight`` are being processed,
processes each in a thread of its own (Spark runs their jobs side by side on the one
session, so the driver's work for one batch, staging and planning, overlaps another's Spark
job), and commits them strictly in txid order, each as soon as it and every earlier one are
processed. It stops when a batch comes back empty (the source is read to its end) or after
``max_batches``.

A failure (of processing, of a begin, or a commit that must wait for a txid planned by someone
else) stops the loop: no new batch begins, the batches before the failed one are committed in
order, the failed one and every later one are marked failed, and the error is raised. The
next begin, of this loop or of an Airflow run, adopts them in txid order (new attempts of
the same records, in transactional mode).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from onceflow.core.begin import begin, mark_failed
from onceflow.core.commit import commit
from onceflow.core.db import connection
from onceflow.core.errors import OnceflowError, is_permanent
from onceflow.core.pipeline import Pipeline, check
from onceflow.core.registration import ensure_ready
from onceflow.core.txlog import Batch
from onceflow.kvstate import open_state_provider
from onceflow.spark.processing import process_batch

log = logging.getLogger(__name__)


class CommitWaiting(OnceflowError):
    """A batch of the loop could not commit: an earlier txid, not the loop's, is open."""


@dataclass
class LoopResult:
    """What a loop did: the txids committed, in order (the last may be an empty batch that
    found the source read to its end), the records they held, and how long processing and
    commit took per batch that held records (seconds, in txid order)."""

    committed: list[int] = field(default_factory=list)
    process_s: list[float] = field(default_factory=list)
    commit_s: list[float] = field(default_factory=list)
    records: int = 0
    seconds: float = 0.0


def run_batches(spark, dsn: str, pipeline: Pipeline, *, in_flight: int = 1,
                max_batches: int | None = None, run_prefix: str = "loop") -> LoopResult:
    """Run ``pipeline``'s transactions on ``spark`` until its source is read to the end (or
    ``max_batches`` non-empty batches), ``in_flight`` processed at once, committed in txid
    order. ``in_flight`` must be within 1..``pipeline.max_pending``; 2-3 keeps both of a
    small machine's cores busy (more only adds memory pressure)."""
    check(isinstance(in_flight, int) and 1 <= in_flight <= pipeline.max_pending, "in_flight",
          in_flight, f"give 1..max_pending={pipeline.max_pending} of pipeline "
          f"{pipeline.name!r} (or raise its max_pending)")
    check(max_batches is None or (isinstance(max_batches, int) and max_batches >= 1),
          "max_batches", max_batches, "give 1 or more (None: until the source is read)")
    result = LoopResult()
    started = time.perf_counter()

    def process(batch: Batch) -> float:
        t0 = time.perf_counter()
        for group in range(batch.groups):
            process_batch(spark, dsn, pipeline, batch.attempt, group)
        return time.perf_counter() - t0

    pending: deque[tuple[Batch, Future]] = deque()
    begun = 0
    last = False  # the source is read to its end, or max_batches are begun
    failure: BaseException | None = None  # what is raised at the end
    broken = False  # a batch failed: it and every later one cannot commit
    with connection(dsn, application_name=f"onceflow-loop-{pipeline.name}") as conn, \
            ThreadPoolExecutor(in_flight, thread_name_prefix="onceflow-batch") as pool:
        # registered (as the first begin of an Airflow run does): a table another pipeline
        # holds is refused before any batch begins
        ensure_ready(conn, pipeline)
        while True:
            while not last and failure is None and not broken and len(pending) < in_flight:
                try:
                    batch = begin(conn, pipeline, f"{run_prefix}-{time.time_ns()}-{begun}")
                except Exception as error:  # noqa: BLE001 (raised once the begun ones end)
                    failure = error
                    break
                begun += 1
                empty = batch.records == 0 and batch.replayed == 0
                last = empty or (max_batches is not None and begun >= max_batches)
                pending.append((batch, pool.submit(process, batch)))
            if not pending:
                break
            batch, processed = pending.popleft()
            error = processed.exception()
            if not broken and error is None:
                t0 = time.perf_counter()
                try:
                    done = commit(conn, pipeline, batch.attempt,
                                  open_state=open_state_provider)
                except Exception as commit_error:  # noqa: BLE001 (raised at the end)
                    error = commit_error
                else:
                    if done.status != "waiting":
                        result.committed.append(batch.attempt.txid)
                        if batch.records or batch.replayed:
                            result.process_s.append(processed.result())
                            result.commit_s.append(time.perf_counter() - t0)
                            result.records += batch.records + batch.replayed
                        continue
                    blocker = done.blocker.txid if done.blocker else "an earlier txid"
                    error = CommitWaiting(
                        f"pipeline {pipeline.name!r}: {batch.attempt} cannot commit before "
                        f"txid {blocker}, which another run planned and has not committed: "
                        "finish or fail that run, then run the loop again")
            if not broken:
                broken = True
                failure = failure or error
                log.error("pipeline %s: %s failed: %s; no new batch begins", pipeline.name,
                          batch.attempt, error)
            # this batch and every later one: failed, so the next begin adopts them in order
            mark_failed(conn, pipeline.name, batch.attempt,
                        str(error) if error is not None else
                        f"an earlier batch of the loop failed: {failure}",
                        permanent=is_permanent(error))
    result.seconds = time.perf_counter() - started
    if failure is not None:
        raise failure
    return result
