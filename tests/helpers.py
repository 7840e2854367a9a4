"""Small building blocks the tests share."""

from __future__ import annotations

from onceflow.committer import CommitResult, commit
from onceflow.coordinator import Batch, begin, register
from onceflow.examples.tweets import generate
from onceflow.pipeline import Pipeline, get_pipeline
from onceflow.source import produce


def tweets_pipeline(conn, *, events: int = 0, batch_size: int = 1000, seed: int = 7,
                    malformed_share: float = 0.05, poison_share: float = 0.0005,
                    flaky_share: float = 0.001, state_dsns=None, **overrides) -> Pipeline:
    """The demo pipeline registered in ``conn``'s database, with ``events`` produced."""
    pipeline = get_pipeline("tweets", batch_size=batch_size, **overrides)
    register(conn, pipeline, state_dsns, create_topic=True)
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
