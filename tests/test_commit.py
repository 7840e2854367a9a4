"""The commit phase: strict order, one PostgreSQL transaction, exactly once."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from helpers import (
    assert_exact,
    run_transaction,
    table,
    table_stats,
    tweets_events,
    tweets_pipeline,
)
from onceflow.core import state_tables
from onceflow.core.begin import begin
from onceflow.core.commit import MissingStaging, commit
from onceflow.core.errors import Fenced
from onceflow.core.staging import stage_group
from onceflow.core.txlog import TransactionAttempt
from onceflow.ops.verify import recount as verify
from onceflow.spark.processing import process_batch

COMMIT_STEPS = ["locked", "state:url_counts", "state:domain_counts", "contributions",
                "rejects", "backflow", "offsets", "commit_record"]


class Crash(RuntimeError):
    """An error raised at a step of the commit, in this process: what its transaction leaves
    when it rolls back. What a process killed at each step leaves (SIGKILL inside and after
    the commit's transaction, a PostgreSQL crash) is tested in tests/test_faults.py."""


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
def test_an_error_inside_the_commit_leaves_nothing_and_the_rerun_applies_once(
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


def stage(conn, pipeline, attempt, group, rows, records=0):
    """Stage ``rows`` (state, key, delta) for one group, as processing would."""
    stage_group(conn, pipeline.name, attempt, group,
                deltas_csv=io.StringIO("".join(f"{s},{k},{d}\n" for s, k, d in rows)),
                rejects_csv=io.StringIO(), records=records)


def figure(conn, rows):
    """(keys, total, digest) per sink of a batch's rows, summed here from the rows."""
    with conn.cursor() as cur:
        weight = state_tables.key_weights(cur, sorted({k for _, k, _ in rows}))
    conn.commit()
    per: dict[str, dict[str, int]] = {}
    for sink, key, delta in rows:
        per.setdefault(sink, {})[key] = per.get(sink, {}).get(key, 0) + delta
    return {sink: (len(d), sum(d.values()), sum(weight[k] * v for k, v in d.items()))
            for sink, d in per.items()}


def recorded(conn, txid):
    return {sink: (keys, int(total), int(digest)) for sink, keys, total, digest in table(
        conn, "SELECT state_name, keys, total, digest FROM batch_contributions "
              "WHERE txid = %s", (txid,))}


def test_the_contributions_record_adds_up_what_each_group_staged(conn):
    """Each group sums its contribution when it stages; the commit adds the groups' figures
    up. A key both groups staged counts once; a re-staged group and a retried attempt
    replace their own figures; the record equals the sums over the committed batch's rows,
    and the state tables add up to it."""
    pipeline = tweets_pipeline(conn, events=300, groups=2)
    first = begin(conn, pipeline, "run-1")
    stage(conn, pipeline, first.attempt, 0, [("url_counts", "u/a", 9)])
    retry = begin(conn, pipeline, "run-1")  # attempt 2: attempt 1's figure counts nowhere
    assert retry.attempt == TransactionAttempt(1, 2)
    g0 = [("url_counts", "u/a", 2), ("url_counts", "u/b", 1), ("domain_counts", "a", 3)]
    g1 = [("url_counts", "u/a", 5), ("url_counts", "u/c", -1), ("domain_counts", "a", 1),
          ("domain_counts", "b", 4)]
    stage(conn, pipeline, retry.attempt, 0, g0)
    stage(conn, pipeline, retry.attempt, 1, [("url_counts", "u/z", 100)])
    stage(conn, pipeline, retry.attempt, 1, g1)  # a re-run of group 1: replaces its figure
    assert table(conn, "SELECT grp, state_name, keys FROM staged_contributions "
                       "WHERE txid = 1 AND attempt = 2 ORDER BY 1, 2") == [
        (0, "domain_counts", 1), (0, "url_counts", 2), (1, "domain_counts", 2),
        (1, "url_counts", 2)]
    assert commit(conn, pipeline, retry.attempt).status == "committed"
    want = figure(conn, g0 + g1)
    assert want["url_counts"][:2] == (3, 7) and want["domain_counts"][:2] == (2, 8)
    assert recorded(conn, 1) == want
    with conn.cursor() as cur:  # txid 1 is the first: each table holds exactly its record
        for spec in pipeline.states:
            assert state_tables.totals(cur, spec) == want[spec.source_name]
    conn.commit()
    assert table(conn, "SELECT count(*) FROM staged_contributions") == [(0,)]

    # one group: its own figure is the record
    second = begin(conn, pipeline, "run-2")
    rows = [("url_counts", "u/a", 1), ("url_counts", "u/d", 2)]
    stage(conn, pipeline, second.attempt, 0, rows)
    stage(conn, pipeline, second.attempt, 1, [])
    assert commit(conn, pipeline, second.attempt).status == "committed"
    assert recorded(conn, 2) == figure(conn, rows)


def test_groups_staged_before_the_migration_get_their_figures_from_their_rows(conn):
    """Migration 019 sums the figures of groups staged by an older onceflow (staging with
    no staged_contributions rows); the commit then records what they add."""
    pipeline = tweets_pipeline(conn, events=300)
    batch = begin(conn, pipeline, "run-1")
    rows = [("url_counts", "u/a", 2), ("url_counts", "u/b", 3), ("domain_counts", "a", 5)]
    stage(conn, pipeline, batch.attempt, 0, rows)
    migration = Path(__file__).resolve().parents[1] / "sql" / "019_group_contributions.sql"
    with conn.cursor() as cur:
        cur.execute("DELETE FROM staged_contributions")  # as an older onceflow staged it
        cur.execute(migration.read_text())
    conn.commit()
    assert commit(conn, pipeline, batch.attempt).status == "committed"
    assert recorded(conn, 1) == figure(conn, rows)


def test_the_commit_proves_its_staged_rows_without_reading_them_again(conn):
    """The commit's proof that a batch's staging is whole: a probe per group and sink of
    the staged deltas, counted by the groups' logged contributions, not a count of every
    row (PostgreSQL's counters show it read a few). A group whose rows are gone (what a
    crash does to all of them) still fails the commit, which names the shortfall."""
    from onceflow.core import staging
    from onceflow.core.db import transaction
    from onceflow.core.errors import StagingIncomplete

    pipeline = tweets_pipeline(conn, events=300, groups=2)
    batch = begin(conn, pipeline, "run-1")
    g0 = [("url_counts", f"u/{i}", 1) for i in range(3000)] + [("domain_counts", "a", 3000)]
    stage(conn, pipeline, batch.attempt, 0, g0)
    stage(conn, pipeline, batch.attempt, 1, [("url_counts", "u/x", 1)])
    before = table_stats(conn, "staged_deltas")["read"]
    with transaction(conn) as cur:
        proof = staging.proof(cur, pipeline.name, batch.attempt, 2)
    assert proof.whole and proof.found[0] == proof.expected[0] == 3002
    assert table_stats(conn, "staged_deltas")["read"] - before <= 10
    with conn.cursor() as cur:
        cur.execute("DELETE FROM staged_deltas WHERE grp = 1")
    conn.commit()
    with pytest.raises(StagingIncomplete, match=r"recorded \(3002, 0, 0\), found \(3001, 0, 0"):
        commit(conn, pipeline, batch.attempt)


def staged_txids(conn) -> list[tuple]:
    """(txid, staged rows, markers, figures) of each txid with some staging left."""
    return table(conn, """SELECT txid, sum(d)::int, sum(g)::int, sum(c)::int FROM (
                              SELECT txid, count(*) AS d, 0 AS g, 0 AS c FROM staged_deltas
                              GROUP BY 1
                              UNION ALL SELECT txid, 0, count(*), 0 FROM staged_groups
                              GROUP BY 1
                              UNION ALL SELECT txid, 0, 0, count(*) FROM staged_contributions
                              GROUP BY 1) s GROUP BY 1 ORDER BY 1""")


def test_an_error_after_the_commit_leaves_its_staging_to_the_next_commit(conn):
    """The staging is deleted after the commit's COMMIT, out of the serial section. An error
    in between leaves the txid committed and its staging behind, read by nothing: a retry of
    the commit deletes it, and so does the next txid's commit."""
    pipeline = tweets_pipeline(conn, events=300)
    rows = [("url_counts", "u/a", 2), ("domain_counts", "a", 2)]
    first = begin(conn, pipeline, "run-1")
    stage(conn, pipeline, first.attempt, 0, rows)
    with pytest.raises(Crash):
        commit(conn, pipeline, first.attempt, on_step=crash_at("committed"))
    assert table(conn, "SELECT last_committed_txid FROM pipelines") == [(1,)]
    assert table(conn, "SELECT key, value FROM url_counts") == [("u/a", 2)]
    assert staged_txids(conn) == [(1, 2, 1, 2)]  # rows, marker, figures: left behind
    assert commit(conn, pipeline, first.attempt).status == "already_committed"
    assert staged_txids(conn) == []

    second = begin(conn, pipeline, "run-2")
    stage(conn, pipeline, second.attempt, 0, rows)
    with pytest.raises(Crash):
        commit(conn, pipeline, second.attempt, on_step=crash_at("committed"))
    third = begin(conn, pipeline, "run-3")
    stage(conn, pipeline, third.attempt, 0, rows)
    assert [t for t, *_ in staged_txids(conn)] == [2, 3]
    assert commit(conn, pipeline, third.attempt).status == "committed"
    assert staged_txids(conn) == []
    assert table(conn, "SELECT key, value FROM url_counts") == [("u/a", 6)]
    assert recorded(conn, 2) == recorded(conn, 3) == figure(conn, rows)
