"""The commit phase: strict order, one PostgreSQL transaction, exactly once."""

from __future__ import annotations

import pytest

from helpers import assert_exact, run_transaction, table, tweets_events, tweets_pipeline
from onceflow.core.begin import begin
from onceflow.core.commit import MissingStaging, commit
from onceflow.core.errors import Fenced
from onceflow.core.txlog import TransactionAttempt
from onceflow.ops.verify import recount as verify
from spark_tasks.processing import process_batch

COMMIT_STEPS = ["locked", "state:url_counts", "state:domain_counts", "rejects", "backflow",
                "offsets", "staging", "commit_record"]


class Crash(RuntimeError):
    pass


def crash_at(step_name):
    def on_step(step):
        if step == step_name:
            raise Crash(step)
    return on_step


def snapshot(conn):
    """Everything a commit writes."""
    return {
        "url_counts": table(conn, "SELECT * FROM url_counts ORDER BY key"),
        "domain_counts": table(conn, "SELECT * FROM domain_counts ORDER BY key"),
        "rejected": table(conn, 'SELECT pipeline, partition, "offset", error, txid '
                                "FROM rejected_records ORDER BY 2, 3"),
        "offsets": table(conn, 'SELECT partition, "offset", txid FROM partition_offsets '
                               "ORDER BY 1"),
        "transactions": table(conn, "SELECT txid, attempt, state FROM transactions ORDER BY 1"),
        "last_committed": table(conn, "SELECT last_committed_txid FROM pipelines"),
        "staged": table(conn, "SELECT count(*) FROM staged_deltas"),
        "queued": table(conn, 'SELECT partition, "offset", queue, failures, claimed_txid '
                              "FROM backflow_items ORDER BY 1, 2"),
        "dead": table(conn, 'SELECT partition, "offset" FROM dead_letters ORDER BY 1, 2'),
        "pointers": table(conn, "SELECT to_queue, swaps FROM backflow_pointers"),
    }


def test_txid_n_plus_1_never_commits_before_n(spark, conn, dsn):
    payloads = tweets_events(2000)
    pipeline = tweets_pipeline(conn, payloads=payloads, batch_size=800)
    first = begin(conn, pipeline, "run-1")
    second = begin(conn, pipeline, "run-2")
    # the second batch's processing finishes first
    process_batch(spark, dsn, pipeline, second.attempt)
    waiting = commit(conn, pipeline, second.attempt)
    assert waiting.status == "waiting"
    assert (waiting.blocker.txid, waiting.blocker.state, waiting.blocker.run_id) == (
        1, "planned", "run-1")
    assert table(conn, "SELECT count(*) FROM url_counts") == [(0,)]
    assert table(conn, "SELECT last_committed_txid FROM pipelines") == [(0,)]

    process_batch(spark, dsn, pipeline, first.attempt)
    assert commit(conn, pipeline, first.attempt).status == "committed"
    assert commit(conn, pipeline, second.attempt).status == "committed"
    order = table(conn, """SELECT txid FROM transactions WHERE state = 'committed'
                           ORDER BY committed_at""")
    assert order == [(1,), (2,)]
    assert_exact(conn, pipeline, payloads, read_all=False)
    assert verify(conn, pipeline).ok


@pytest.mark.parametrize("step", COMMIT_STEPS)
def test_a_crash_inside_the_commit_leaves_nothing_and_the_rerun_applies_once(
        spark, conn, dsn, step):
    payloads = tweets_events(1500)
    pipeline = tweets_pipeline(conn, payloads=payloads, batch_size=1000)
    run_transaction(spark, dsn, conn, pipeline, "run-1")  # txid 1 committed: state not empty
    batch = begin(conn, pipeline, "run-2")  # claims txid 1's failed records for replay
    process_batch(spark, dsn, pipeline, batch.attempt)
    before = snapshot(conn)
    assert before["queued"] and all(claim == 2 for *_, claim in before["queued"])
    staged_before = table(conn, "SELECT count(*) FROM staged_deltas")

    with pytest.raises(Crash):
        commit(conn, pipeline, batch.attempt, on_step=crash_at(step))
    after_crash = snapshot(conn)
    assert {k: v for k, v in after_crash.items() if k not in ("staged", "transactions")} == {
        k: v for k, v in before.items() if k not in ("staged", "transactions")}
    assert after_crash["staged"] == staged_before  # staging kept for the re-run
    assert (2, 1, "planned") in after_crash["transactions"]

    assert commit(conn, pipeline, batch.attempt).status == "committed"
    committed = snapshot(conn)
    assert_exact(conn, pipeline, payloads, read_all=True)
    assert verify(conn, pipeline).ok
    # a replayed commit of a committed txid changes nothing
    assert commit(conn, pipeline, batch.attempt).status == "already_committed"
    assert snapshot(conn) == committed


def test_offsets_advance_exactly_to_the_planned_ends(spark, conn, dsn):
    pipeline = tweets_pipeline(conn, events=1000, batch_size=600)
    batch, result = run_transaction(spark, dsn, conn, pipeline, "run-1")
    assert result.status == "committed"
    assert table(conn, 'SELECT partition, "offset", txid FROM partition_offsets ORDER BY 1') == [
        (r.partition, r.end, 1) for r, _ in batch.ranges]
    assert sum(r.size for r, _ in batch.ranges) == 600


def test_a_zombie_attempt_cannot_commit(spark, conn, dsn):
    pipeline = tweets_pipeline(conn, events=300)
    batch = begin(conn, pipeline, "run-1")
    process_batch(spark, dsn, pipeline, batch.attempt)
    with pytest.raises(Fenced):
        commit(conn, pipeline, TransactionAttempt(batch.attempt.txid, 7))
    assert table(conn, "SELECT count(*) FROM url_counts") == [(0,)]


def test_commit_refuses_while_processing_has_not_staged(conn):
    pipeline = tweets_pipeline(conn, events=300)
    batch = begin(conn, pipeline, "run-1")
    with pytest.raises(MissingStaging, match=r"group\(s\) \[0\]"):
        commit(conn, pipeline, batch.attempt)


def test_begin_again_in_the_same_run_reattempts_its_txid_with_the_same_ranges(conn):
    pipeline = tweets_pipeline(conn, events=300, batch_size=100)
    first = begin(conn, pipeline, "run-1")
    again = begin(conn, pipeline, "run-1")
    assert again.attempt == TransactionAttempt(first.attempt.txid, 2)
    assert again.ranges == first.ranges
    other = begin(conn, pipeline, "run-2")
    assert other.attempt.txid == 2
    assert min(r.start for r, _ in other.ranges) >= min(r.end for r, _ in first.ranges)


def test_verify_notices_a_wrong_count(spark, conn, dsn):
    pipeline = tweets_pipeline(conn, events=500)
    run_transaction(spark, dsn, conn, pipeline, "run-1")
    assert verify(conn, pipeline).ok
    with conn.cursor() as cur:
        cur.execute("UPDATE domain_counts SET value = value + 1 WHERE key = "
                    "(SELECT min(key) FROM domain_counts)")
    conn.commit()
    report = verify(conn, pipeline)
    assert not report.ok
    assert "domain_counts" in report.mismatches[0] and "FAILED" in report.line()
