"""Waiting for the commit's turn without a worker slot: the operator defers to a trigger."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from helpers import tweets_pipeline
from onceflow.committer import commit
from onceflow.coordinator import begin
from onceflow.operators import CommitBatchOperator
from onceflow.triggers import CommitTurnTrigger
from spark_tasks.processing import process_batch


@pytest.fixture
def two_batches(spark, conn, dsn):
    pipeline = tweets_pipeline(conn, events=600, batch_size=300)
    first, second = begin(conn, pipeline, "run-1"), begin(conn, pipeline, "run-2")
    for batch in (first, second):
        process_batch(spark, dsn, pipeline, batch.attempt)
    return pipeline, first, second


def _operator(batch):
    return CommitBatchOperator(task_id="commit", pipeline="tweets", poll_interval=0.2,
                               batch={"txid": batch.attempt.txid,
                                      "attempt": batch.attempt.attempt})


def test_commit_defers_while_an_earlier_txid_is_open(two_batches):
    from airflow.exceptions import TaskDeferred

    _, _, second = two_batches
    with pytest.raises(TaskDeferred) as deferred:
        _operator(second)._try_commit(time.time() + 60)
    trigger = deferred.value.trigger
    assert isinstance(trigger, CommitTurnTrigger)
    classpath, kwargs = trigger.serialize()
    assert classpath == "onceflow.triggers.CommitTurnTrigger"
    assert kwargs["txid"] == 2 and "dsn" not in kwargs  # no secret in the metadata database


def test_commit_wait_past_the_timeout_names_the_blocking_txid(two_batches):
    _, _, second = two_batches
    with pytest.raises(TimeoutError, match=r"txid 1 is planned \(run run-1\); retry or clear"):
        _operator(second)._try_commit(time.time() - 1)


def test_trigger_fires_when_the_turn_comes_and_the_commit_goes_through(two_batches, dsn):
    from onceflow.db import connect

    pipeline, first, second = two_batches
    trigger = CommitTurnTrigger("tweets", second.attempt.txid, "onceflow_pg", 0.1,
                                time.time() + 60)

    def commit_first_later():
        time.sleep(0.5)
        c = connect(dsn)
        commit(c, pipeline, first.attempt)
        c.close()

    async def first_event():
        async for event in trigger.run():
            return event

    helper = threading.Thread(target=commit_first_later)
    started = time.monotonic()
    helper.start()
    event = asyncio.run(first_event())
    helper.join()
    assert event.payload["last_committed_txid"] == 1
    assert time.monotonic() - started >= 0.5
    result = _operator(second).execute_complete({}, event.payload)
    assert result["status"] == "committed" and result["txid"] == 2
