"""Transactions under failure, phase functions called directly (real PostgreSQL, real Spark):
attempts and fencing, adoption, max_pending, opaque re-planning, a state in a second database,
processing groups, and a randomized run with faults at every boundary."""

from __future__ import annotations

import pytest

from helpers import assert_exact, table, tweets_events, tweets_pipeline
from onceflow.core.begin import begin, mark_failed
from onceflow.core.commit import MissingStaging, commit
from onceflow.core.db import connect
from onceflow.core.errors import Fenced, MaxPendingReached
from onceflow.core.pipeline import StateSpec
from onceflow.core.txlog import TransactionAttempt
from onceflow.ops.verify import recount as verify
from onceflow.spark.processing import process_batch


def ranges_of(batch):
    return [(r.partition, r.start, r.end) for r, _ in batch.ranges]


def test_a_new_attempt_fences_the_old_one(spark, conn, dsn):
    payloads = tweets_events(400)
    # a lease longer than the test: the old attempt, silent here, is fenced, not abandoned
    pipeline = tweets_pipeline(conn, payloads=payloads, batch_size=200, attempt_lease_s=3600)
    old = begin(conn, pipeline, "run-1")
    process_batch(spark, dsn, pipeline, old.attempt)
    new = begin(conn, pipeline, "run-2", txid=1)  # a manual backfill of txid 1
    assert new.attempt == TransactionAttempt(1, 2) and new.ranges == old.ranges
    # the old attempt's staging is gone and it can neither stage nor commit
    assert table(conn, "SELECT count(*) FROM staged_groups") == [(0,)]
    with pytest.raises(Fenced):
        process_batch(spark, dsn, pipeline, old.attempt)
    with pytest.raises(Fenced):
        commit(conn, pipeline, old.attempt)
    process_batch(spark, dsn, pipeline, new.attempt)
    assert commit(conn, pipeline, new.attempt).status == "committed"
    assert table(conn, """SELECT attempt, run_id, outcome FROM transaction_attempts
                          ORDER BY attempt""") == [(1, "run-1", "fenced"),
                                                   (2, "run-2", "committed")]
    # a run asking for a committed txid has nothing to do
    done = begin(conn, pipeline, "run-3", txid=1)
    assert done.committed and done.attempt == new.attempt
    assert process_batch(spark, dsn, pipeline, done.attempt) is None
    assert commit(conn, pipeline, done.attempt).status == "already_committed"
    assert_exact(conn, pipeline, payloads, read_all=False)  # txid 1's 200 records, once
    assert verify(conn, pipeline).ok


def test_a_new_run_adopts_the_lowest_failed_txid_first(conn):
    pipeline = tweets_pipeline(conn, events=600, batch_size=100)
    first, second, third = (begin(conn, pipeline, f"run-{i}") for i in (1, 2, 3))
    assert mark_failed(conn, "tweets", third.attempt, "boom")
    assert mark_failed(conn, "tweets", first.attempt, "boom")
    assert not mark_failed(conn, "tweets", TransactionAttempt(2, 9), "zombie")  # fenced
    adopted = begin(conn, pipeline, "run-4")
    assert adopted.attempt == TransactionAttempt(1, 2) and adopted.ranges == first.ranges
    assert begin(conn, pipeline, "run-5").attempt == TransactionAttempt(3, 2)
    assert second.attempt.txid == 2
    with pytest.raises(LookupError, match="txid=9 does not exist"):
        begin(conn, pipeline, "run-6", txid=9)


def test_max_pending_bounds_the_transactions_in_flight(spark, conn, dsn):
    pipeline = tweets_pipeline(conn, events=1000, batch_size=100, max_pending=2)
    first = begin(conn, pipeline, "run-1")
    begin(conn, pipeline, "run-2")
    with pytest.raises(MaxPendingReached, match="max_pending=2 .* txids 1, 2 are uncommitted"):
        begin(conn, pipeline, "run-3")
    assert table(conn, "SELECT count(*) FROM transactions") == [(2,)]
    process_batch(spark, dsn, pipeline, first.attempt)
    commit(conn, pipeline, first.attempt)
    assert begin(conn, pipeline, "run-3").attempt.txid == 3


def test_transactional_mode_never_changes_a_batch(conn):
    pipeline = tweets_pipeline(conn, events=400, batch_size=200)
    first = begin(conn, pipeline, "run-1")
    smaller = tweets_pipeline(conn, batch_size=50)
    again = begin(conn, smaller, "run-2", txid=1)
    assert again.ranges == first.ranges and again.records == 200


def test_opaque_replan_supersedes_later_transactions_seed_scenario(spark, conn, dsn):
    """Seed 001: A reads 1-50, B reads 51-100, A fails, A reads 1-40, so B must read 41-...
    (one partition, offsets from 0)."""
    payloads = tweets_events(120)
    pipeline = tweets_pipeline(conn, payloads=payloads, batch_size=50, mode="opaque",
                               partitions=1)
    a = begin(conn, pipeline, "run-a")
    b = begin(conn, pipeline, "run-b")
    assert (ranges_of(a), ranges_of(b)) == ([(0, 0, 50)], [(0, 50, 100)])
    process_batch(spark, dsn, pipeline, b.attempt)  # B is processed, waiting for A
    mark_failed(conn, "tweets", a.attempt, "A failed")

    a2 = begin(conn, tweets_pipeline(conn, batch_size=40, mode="opaque", partitions=1), "run-c")
    assert a2.attempt == TransactionAttempt(1, 2) and ranges_of(a2) == [(0, 0, 40)]
    assert table(conn, "SELECT txid, state FROM transactions ORDER BY 1") == [
        (1, "planned"), (2, "superseded")]
    with pytest.raises(Fenced):
        commit(conn, pipeline, b.attempt)  # B's old batch can never commit
    process_batch(spark, dsn, pipeline, a2.attempt)
    commit(conn, pipeline, a2.attempt)

    b2 = begin(conn, pipeline, "run-d")  # adopts the superseded B, re-planned from A's new end
    assert b2.attempt == TransactionAttempt(2, 2) and ranges_of(b2) == [(0, 40, 90)]
    process_batch(spark, dsn, pipeline, b2.attempt)
    commit(conn, pipeline, b2.attempt)
    c = begin(conn, pipeline, "run-e")
    assert ranges_of(c) == [(0, 90, 120)]
    process_batch(spark, dsn, pipeline, c.attempt)
    commit(conn, pipeline, c.attempt)
    assert table(conn, 'SELECT "offset" FROM partition_offsets') == [(120,)]
    assert_exact(conn, pipeline, payloads, read_all=True)  # B's first batch counted nowhere
    report = verify(conn, pipeline)
    assert report.ok and report.records == 120


class Crash(RuntimeError):
    pass


def test_a_state_in_a_second_database_survives_a_crash_between_the_two_commits(
        spark, conn, dsn, second_dsn):
    """The state in the second database is written, then the coordinator's commit crashes.
    The replay, with a different (opaque, re-planned) batch, leaves it exactly right."""
    states = (StateSpec("url_counts"), StateSpec("domain_counts", conn_id="state2"))
    dsns = {"domain_counts": second_dsn}
    payloads = tweets_events(900)
    pipeline = tweets_pipeline(conn, payloads=payloads, batch_size=400, mode="opaque",
                               states=states, state_dsns=dsns)
    run_first = begin(conn, pipeline, "run-1")
    process_batch(spark, dsn, pipeline, run_first.attempt)
    commit(conn, pipeline, run_first.attempt, state_dsns=dsns)

    batch = begin(conn, pipeline, "run-2")
    process_batch(spark, dsn, pipeline, batch.attempt)

    def crash(step):
        if step == "external:domain_counts":
            raise Crash(step)

    with pytest.raises(Crash):
        commit(conn, pipeline, batch.attempt, on_step=crash, state_dsns=dsns)
    second = connect(second_dsn)
    assert table(second, "SELECT DISTINCT txid FROM domain_counts") == [(2,)]  # written ahead
    assert table(conn, "SELECT last_committed_txid FROM pipelines") == [(1,)]
    assert not verify(conn, pipeline, dsns).ok  # the second database is ahead for now

    smaller = tweets_pipeline(conn, batch_size=150, mode="opaque", states=states,
                              state_dsns=dsns)
    replay = begin(conn, smaller, "run-3", txid=2)
    assert replay.records == 150 != batch.records  # a different batch
    process_batch(spark, dsn, pipeline, replay.attempt)
    commit(conn, pipeline, replay.attempt, state_dsns=dsns)
    # the first try's domains, written ahead in the second database, counted nowhere
    assert_exact(conn, pipeline, payloads, read_all=False, state_conns={"domain_counts": second})
    assert verify(conn, pipeline, dsns).ok
    second.close()


def test_groups_are_processed_apart_and_committed_together(spark, conn, dsn):
    payloads = tweets_events(800)
    pipeline = tweets_pipeline(conn, payloads=payloads, batch_size=800, groups=2)
    batch = begin(conn, pipeline, "run-1")
    assert batch.groups == 2 and {g for _, g in batch.ranges} == {0, 1}
    process_batch(spark, dsn, pipeline, batch.attempt, group=1)
    with pytest.raises(MissingStaging, match=r"group\(s\) \[0\] of 2"):
        commit(conn, pipeline, batch.attempt)
    process_batch(spark, dsn, pipeline, batch.attempt, group=0)
    process_batch(spark, dsn, pipeline, batch.attempt, group=1)  # a retried group: replaces
    assert commit(conn, pipeline, batch.attempt).status == "committed"
    assert_exact(conn, pipeline, payloads, read_all=True)  # the retried group counted once
    assert verify(conn, pipeline).ok
