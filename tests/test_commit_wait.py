"""Waiting for the commit's turn: in the task first (up to wait_in_task), then deferred to a
trigger that holds no worker slot."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from helpers import table, tweets_pipeline
from onceflow.airflow.operators import CommitBatchOperator
from onceflow.airflow.triggers import CommitTurnTrigger
from onceflow.core.begin import begin
from onceflow.core.commit import commit
from onceflow.spark.processing import process_batch


@pytest.fixture(autouse=True)
def earlier_runs_keep_working(monkeypatch):
    """txid 1 stands for a run still at work, whose lease reports these tests do not make:
    a lease longer than a test on a loaded machine (unless a test says its run died)."""
    monkeypatch.setenv("ONCEFLOW_ATTEMPT_LEASE_S", "3600")


@pytest.fixture
def two_batches(spark, conn, dsn):
    pipeline = tweets_pipeline(conn, events=600, batch_size=300)
    first, second = begin(conn, pipeline, "run-1"), begin(conn, pipeline, "run-2")
    for batch in (first, second):
        process_batch(spark, dsn, pipeline, batch.attempt)
    return pipeline, first, second


# A poll interval the tests never sit out: a waiter woken only by its next look would take
# this long, one woken by an announcement returns within seconds.
POLL = 600


def _operator(batch):
    return CommitBatchOperator(task_id="commit", pipeline="tweets", poll_interval=0.2,
                               batch={"txid": batch.attempt.txid,
                                      "attempt": batch.attempt.attempt})


def _listening(conn) -> bool:
    """Whether a waiter LISTENs for the announcements (onceflow.airflow.triggers.TurnListener):
    from then on, no commit or failure announced can be missed by it."""
    return table(conn, """SELECT count(*) FROM pg_stat_activity
                          WHERE datname = current_database()
                            AND application_name = 'onceflow-trigger-listen'
                            AND query LIKE 'LISTEN%%'""") != [(0,)]


def _meanwhile(dsn: str, act, wait, timeout: float = 240):
    """``wait()`` while another thread, once the waiter listens, runs ``act(conn)`` on a
    connection of its own (txid 1 ending): the waiter is surely waiting when txid 1 ends, by
    an observed state, not a delay. Returns (what wait returned, seconds from the act's
    start until wait returned)."""
    from onceflow.core.db import connect

    acted: list[float] = []
    errors: list[BaseException] = []

    def later():
        c = connect(dsn)
        try:
            deadline = time.monotonic() + timeout
            while not _listening(c):
                if time.monotonic() > deadline:
                    raise AssertionError(f"the waiter never listened within {timeout:.0f}s")
                time.sleep(0.05)
            acted.append(time.monotonic())
            act(c)
        except BaseException as error:  # reported by the test
            errors.append(error)
        finally:
            c.close()

    helper = threading.Thread(target=later)
    helper.start()
    try:
        out = wait()
        returned = time.monotonic()
    finally:
        helper.join()
    assert not errors, errors
    assert acted, "the waiter returned before txid 1 ended"
    return out, returned - acted[0]


def _first_event(trigger):
    async def first():
        async for event in trigger.run():
            return event

    return asyncio.run(first())


def test_commit_defers_after_its_wait_in_the_task_while_an_earlier_txid_is_open(
        spark, conn, dsn):
    """txid 1 is still processing: txid 2's commit waits in the task for wait_in_task, then
    defers (no worker slot held while it waits longer)."""
    from airflow.sdk.exceptions import TaskDeferred

    pipeline = tweets_pipeline(conn, events=600, batch_size=300)
    first, second = begin(conn, pipeline, "run-1"), begin(conn, pipeline, "run-2")
    process_batch(spark, dsn, pipeline, second.attempt)
    operator = CommitBatchOperator(task_id="commit", pipeline="tweets", poll_interval=0.2,
                                   wait_in_task=1.0, batch={"txid": 2, "attempt": 1})
    started = time.monotonic()
    with pytest.raises(TaskDeferred) as deferred:
        operator._try_commit(time.time() + 3600)
    # it waited its wait_in_task, then deferred: long before its deadline an hour away
    assert 1.0 <= time.monotonic() - started < 600
    assert first.attempt.txid == 1
    trigger = deferred.value.trigger
    assert isinstance(trigger, CommitTurnTrigger)
    classpath, kwargs = trigger.serialize()
    assert classpath == "onceflow.airflow.triggers.CommitTurnTrigger"
    assert kwargs["txid"] == 2 and "dsn" not in kwargs  # no secret in the metadata database


def test_commit_wait_past_the_timeout_names_the_blocking_txid(two_batches):
    from airflow.sdk.exceptions import AirflowFailException

    _, _, second = two_batches
    with pytest.raises(AirflowFailException,
                       match=r"until the commit timeout: txid 1 is planned \(run run-1, "):
        _operator(second)._try_commit(time.time() - 1)


def test_a_failed_earlier_txid_fails_the_waiting_commit_at_once_naming_the_backfill(
        two_batches, conn):
    """The waiting commit does not sit out its timeout behind a txid nobody will re-run: it
    fails (without retries) and says which txid to backfill and how."""
    from airflow.sdk.exceptions import AirflowFailException

    from onceflow.core.begin import mark_failed

    _, first, second = two_batches
    assert mark_failed(conn, "tweets", first.attempt, "process failed after its last retry")
    with pytest.raises(AirflowFailException) as failed:
        _operator(second)._try_commit(time.time() + 3600)
    text = str(failed.value)
    assert "txid 1 is failed (run run-1): process failed after its last retry" in text
    assert 'trigger this DAG with {"txid": 1}' in text and "onceflow backfill" in text


def test_an_abandoned_earlier_txid_wakes_the_trigger(two_batches, conn):
    """txid 1's run died (no report within its lease): the trigger fires instead of polling
    until the deadline, and the operator names the txid."""
    from airflow.sdk.exceptions import AirflowFailException

    _, first, second = two_batches
    with conn.cursor() as cur:
        cur.execute("UPDATE transactions SET heartbeat_at = now() - interval '2 hours' "
                    "WHERE txid = 1")
    conn.commit()
    deadline = time.time() + 3600
    trigger = CommitTurnTrigger("tweets", 2, 1, "onceflow_pg", 0.1, deadline)

    event = _first_event(trigger)
    # fired because txid 1 is abandoned, not at its deadline an hour away
    assert time.time() < deadline and event.payload["last_committed_txid"] == 0
    with pytest.raises(AirflowFailException, match="it is abandoned"):
        _operator(second).execute_complete({}, event.payload)


def test_trigger_fires_when_the_turn_comes_and_the_commit_goes_through(two_batches, dsn):
    pipeline, first, second = two_batches
    trigger = CommitTurnTrigger("tweets", second.attempt.txid, second.attempt.attempt,
                                "onceflow_pg", 0.1, time.time() + 3600)

    event, _ = _meanwhile(dsn, lambda c: commit(c, pipeline, first.attempt),
                          lambda: _first_event(trigger))
    assert event.payload["last_committed_txid"] == 1
    result = _operator(second).execute_complete({}, event.payload)
    assert result["status"] == "committed" and result["txid"] == 2


@pytest.mark.parametrize("earlier", ["commits", "fails"])
def test_the_trigger_wakes_when_the_earlier_txid_ends_not_at_its_next_poll(two_batches, dsn,
                                                                            earlier):
    """A waiting commit LISTENs for commits and failures (txlog.TURN_CHANNEL): txid 1's end
    wakes txid 2's trigger at once, long before its next look (a 10 min poll interval here:
    without the announcement the trigger would sleep that long)."""
    from onceflow.core.begin import mark_failed

    pipeline, first, second = two_batches
    trigger = CommitTurnTrigger("tweets", 2, 1, "onceflow_pg", POLL, time.time() + 2 * POLL)

    def end_first(c):
        if earlier == "commits":
            commit(c, pipeline, first.attempt)
        else:
            mark_failed(c, pipeline.name, first.attempt, "a test fails it")

    event, took = _meanwhile(dsn, end_first, lambda: _first_event(trigger))
    assert took < POLL / 2
    assert event.payload["last_committed_txid"] == (1 if earlier == "commits" else 0)


def _commit_requested(conn, batch) -> None:
    """The earlier txid's commit task has run (its processing is done): it is committing."""
    from onceflow.core import txlog

    with conn.cursor() as cur:
        txlog.request_commit(cur, "tweets", batch.attempt)
    conn.commit()


@pytest.mark.parametrize("earlier", ["processing", "staged", "committing"])
def test_a_commit_waits_for_its_turn_in_the_task_instead_of_deferring(
        spark, conn, dsn, earlier):
    """txid 1 is processing, processed, or committing: txid 2's commit waits for it in the
    task (no deferral, no new task process) and commits as soon as txid 1's commit is
    announced."""
    pipeline = tweets_pipeline(conn, events=600, batch_size=300)
    first, second = begin(conn, pipeline, "run-1"), begin(conn, pipeline, "run-2")
    process_batch(spark, dsn, pipeline, second.attempt)
    if earlier != "processing":
        process_batch(spark, dsn, pipeline, first.attempt)
    if earlier == "committing":
        _commit_requested(conn, first)

    def end_first(c):
        if earlier == "processing":
            process_batch(spark, dsn, pipeline, first.attempt)
        commit(c, pipeline, first.attempt)

    operator = CommitBatchOperator(task_id="commit", pipeline="tweets", poll_interval=POLL,
                                   wait_in_task=2 * POLL, batch={"txid": 2, "attempt": 1})
    result, took = _meanwhile(dsn, end_first,
                              lambda: operator._try_commit(time.time() + 3 * POLL))
    assert result["status"] == "committed" and result["txid"] == 2
    assert took < POLL / 2  # woken by the announcement, not at its next look


def test_wait_in_task_0_defers_at_once(two_batches):
    from airflow.sdk.exceptions import TaskDeferred

    _, _, second = two_batches
    operator = CommitBatchOperator(task_id="commit", pipeline="tweets", poll_interval=0.2,
                                   wait_in_task=0, batch={"txid": 2, "attempt": 1})
    with pytest.raises(TaskDeferred):  # deferred, not waiting in the task until its deadline
        operator._try_commit(time.time() + 3600)
