"""Small building blocks the tests share."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from onceflow.core.begin import begin
from onceflow.core.commit import CommitResult, commit
from onceflow.core.pipeline import Pipeline
from onceflow.core.registration import register
from onceflow.core.registry import clear_cache, get_pipeline
from onceflow.core.txlog import Batch
from onceflow.sources import catalog
from onceflow.sources.pglog import PostgresLog
from tweets_example.data import generate
from tweets_example.pipelines import TWEETS

OUTSIDE = Path(__file__).parent / "outside"  # the outside pipeline package (pageviews)

# The tweets pipeline with a one-task transaction DAG, reached as "helpers:TWEETS_SINGLE"
# (tests/test_single_task_dag.py)
TWEETS_SINGLE = dataclasses.replace(TWEETS, name="tweets_single", dag_shape="single")
# The tweets pipeline whose dead letters are replayed only after a person approves, reached as
# "helpers:TWEETS_APPROVED" (tests/test_ui.py)
TWEETS_APPROVED = dataclasses.replace(TWEETS, name="tweets_approved", dead_letter_approval=True)


@contextmanager
def outside_pipeline(monkeypatch, ref: str, conn=None, name: str = "page_views"
                     ) -> Iterator[Pipeline | None]:
    """The outside package reachable the way a user makes it so: its folder on PYTHONPATH and
    ``ref`` in ONCEFLOW_PIPELINES (this process and every one it starts). With ``conn``:
    the pipeline ``name`` registered (its source created), yielded."""
    monkeypatch.syspath_prepend(str(OUTSIDE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(OUTSIDE), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("ONCEFLOW_PIPELINES", ref)
    clear_cache()
    found = None
    if conn is not None:
        found = get_pipeline(name)
        register(conn, found, create_source=True)
    try:
        yield found
    finally:
        clear_cache()


def produce(conn, topic: str, payloads) -> int:
    """Append payloads to a PostgreSQL-log topic."""
    return PostgresLog(topic=topic).append(conn, payloads)


def ensure_topic(conn, topic: str, partitions: int) -> None:
    catalog.ensure_topic(conn, topic, partitions, create=True)


def read_ranges(spark, dsn: str, topic: str, ranges, chunk: int = 100_000):
    return PostgresLog(topic=topic, read_chunk=chunk).read(spark, dsn, ranges)


def delete_before(conn, topic: str, before: int, partition: int | None = None, *,
                  force: bool = True) -> int:
    """Retention (forced by default: these tests delete records pipelines have not read)."""
    from onceflow.core.registry import pipelines
    from onceflow.ops import retention

    known = pipelines()
    source = next((p.source for p in known.values() if p.topic == topic),
                  PostgresLog(topic=topic))
    plan = retention.apply(conn, source, before, partition=partition, force=force,
                           pipelines=known)
    return plan.deletes


def tweets_pipeline(conn, *, events: int = 0, batch_size: int = 1000, seed: int = 7,
                    malformed_share: float = 0.05, poison_share: float = 0.0005,
                    flaky_share: float = 0.001, state_dsns=None, **overrides) -> Pipeline:
    """The tweets example's pipeline registered in ``conn``'s database, with ``events``
    produced."""
    source = {k: overrides.pop(k) for k in ("partitions", "max_record_bytes") if k in overrides}
    if source:
        overrides["source"] = dataclasses.replace(get_pipeline("tweets").source, **source)
    pipeline = get_pipeline("tweets", batch_size=batch_size, **overrides)
    register(conn, pipeline, state_dsns, create_source=True)
    if events:
        produce(conn, pipeline.topic, generate(
            events, seed=seed, malformed_share=malformed_share, poison_share=poison_share,
            flaky_share=flaky_share))
    return pipeline


def run_transaction(spark, dsn: str, conn, pipeline: Pipeline, run_id: str
                    ) -> tuple[Batch, CommitResult]:
    """begin -> process -> commit, the phase functions called directly."""
    from spark_tasks.processing import process_batch

    batch = begin(conn, pipeline, run_id)
    for group in range(batch.groups):
        process_batch(spark, dsn, pipeline, batch.attempt, group)
    return batch, commit(conn, pipeline, batch.attempt)


def table(conn, query: str, params=()) -> list[tuple]:
    with conn.cursor() as cur:
        cur.execute(query, params)
        rows = cur.fetchall()
    conn.commit()
    return rows
