"""Damaged bookkeeping (onceflow.ops.bookkeeping): partition offsets deleted or changed by
hand, a commit record reverted or forged by hand, committed ranges that do not tile. `status`
and `backfill` say so (exit 1), `repair` says what is wrong and fixes what it safely can with
--yes, in one transaction; the oracle is the source's own records, counted by the test."""

from __future__ import annotations

import json
from datetime import UTC

import pytest

from helpers import run_transaction, table, tweets_pipeline
from onceflow.cli import main
from onceflow.core.begin import begin
from onceflow.core.commit import commit
from onceflow.core.errors import Fenced
from onceflow.ops.verify import recount

OFFSETS = """SELECT partition, "offset", txid, instance_id::text, topic FROM partition_offsets
             WHERE pipeline = 'tweets' ORDER BY partition"""


@pytest.fixture
def committed(spark, conn, dsn):
    """Three committed txids reading every record of the topic."""
    pipeline = tweets_pipeline(conn, events=600, batch_size=200, poison_share=0,
                               flaky_share=0)
    for i in range(3):
        _, result = run_transaction(spark, dsn, conn, pipeline, f"run-{i}")
        assert result.status == "committed"
    return pipeline


def run(capsys, *argv: str) -> tuple[int, str]:
    """The command's exit code and what it printed, its lines wrapped back together."""
    capsys.readouterr()
    code = main([*argv, "--pipeline", "tweets"])
    out = capsys.readouterr()
    return code, " ".join((out.out + out.err).split())


def test_lost_or_changed_offsets_are_shown_and_written_again(committed, conn, capsys):
    heads = dict(table(conn, "SELECT partition, count(*) FROM source_log GROUP BY 1"))
    assert sum(heads.values()) == 600
    (instance,), = table(conn, "SELECT instance_id::text FROM pipelines")
    good = table(conn, OFFSETS)
    assert [(p, o, t, i) for p, o, t, i, _ in good] == [
        (p, heads[p], 3, instance) for p in range(4)]
    assert run(capsys, "status")[0] == 0
    with conn.cursor() as cur:  # by hand: three rows gone, one moved back, one made up
        cur.execute("DELETE FROM partition_offsets WHERE partition < 3")
        cur.execute('UPDATE partition_offsets SET "offset" = "offset" - 40')
        cur.execute("""INSERT INTO partition_offsets (pipeline, instance_id, topic, partition,
                                                      "offset", txid)
                       VALUES ('tweets', %s, 'tweets', 9, 70, 2)""", (instance,))
    conn.commit()

    code, out = run(capsys, "status")
    assert code == 1
    assert f"p0: log_start=0 head={heads[0]} committed=- (commit log: {heads[0]}) lag=0" in out
    assert f"p3: log_start=0 head={heads[3]} committed={heads[3] - 40} (commit log: " \
        f"{heads[3]}) lag=0" in out
    assert "PROBLEMS: the bookkeeping is damaged" in out
    assert f"p0 has no row, the commit log says {heads[0]} (txid 3)" in out
    # the freshness line's lag is the partitions' (both from the commit log's offsets), not
    # the 3 lost partitions' records and p3's 40 again
    assert "; lag 0 records, 0.0s" in out
    capsys.readouterr()
    assert main(["status", "--json", "--pipeline", "tweets"]) == 1
    shown = json.loads(capsys.readouterr().out)
    assert shown["freshness"]["lag_records"] == sum(p["lag"] for p in shown["partitions"]) == 0
    code, out = run(capsys, "backfill", "--dry-run")
    assert code == 1 and "partition_offsets disagrees with the commit log for 5" in out

    code, out = run(capsys, "repair")
    assert code == 1 and "would repair (pass --yes to do it)" in out
    assert "partition_offsets disagrees with the commit log for 5 partition(s)" in out
    assert f"p3 is at {heads[3] - 40} (txid 3), the commit log says {heads[3]} (txid 3)" in out
    assert "; and 1 more" in out  # p9, the fifth
    assert table(conn, "SELECT count(*) FROM partition_offsets") == [(2,)]  # a dry run
    code, out = run(capsys, "repair", "--yes")
    assert code == 0 and "repaired:" in out
    assert table(conn, OFFSETS) == good
    assert run(capsys, "repair") == (0, "repair tweets: nothing to repair")
    assert run(capsys, "status")[0] == 0
    report = recount(conn, committed)  # reads up to the committed offsets
    assert report.ok and report.records == 600, report.mismatches


def test_ranges_that_do_not_tile_are_said_not_fixed(committed, conn, capsys):
    (end,), = table(conn, "SELECT end_offset FROM batch_ranges WHERE txid = 1 AND "
                          "partition = 0")
    with conn.cursor() as cur:
        cur.execute("UPDATE batch_ranges SET start_offset = start_offset + 2 "
                    "WHERE txid = 2 AND partition = 0")
    conn.commit()
    code, out = run(capsys, "repair", "--yes")
    assert code == 1
    assert (f"partition 0: txid 2's committed range starts at {end + 2} but txid 1's ended "
            f"at {end}: it skips [{end}, {end + 2}) with no gap recorded") in out
    assert "no safe fix: `onceflow verify --pipeline tweets`" in out
    assert table(conn, "SELECT start_offset FROM batch_ranges WHERE txid = 2 AND "
                       "partition = 0") == [(end + 2,)]


def test_a_commit_record_changed_by_hand_is_found_and_restored(committed, spark, conn, dsn,
                                                               capsys):
    state = table(conn, "SELECT key, value, txid FROM url_counts ORDER BY key")
    with conn.cursor() as cur:  # by hand: txid 3 "not committed", and the coordinator agrees
        cur.execute("UPDATE transactions SET state = 'planned', "
                    "heartbeat_at = now() - interval '1 hour' WHERE txid = 3")
        cur.execute("UPDATE pipelines SET last_committed_txid = 2")
    conn.commit()
    problem = ("txid 3 is planned but attempt 1 committed it: its commit record was changed "
               "by hand")
    code, out = run(capsys, "status")
    assert code == 1 and problem in out
    assert "txid 3 (abandoned)" not in out  # not offered to the next run or backfill
    assert "last_committed_txid is 2 but the commit log says 3" in out
    code, out = run(capsys, "backfill", "--dry-run")
    assert code == 1 and "txid=3" not in out and problem in out
    code, out = run(capsys, "repair")
    assert code == 1 and problem in out
    assert "will: mark txid 3 committed again (attempt 1)" in out
    assert "last_committed_txid is 2 but the transaction log says 3" in out
    assert table(conn, "SELECT state FROM transactions WHERE txid = 3") == [("planned",)]

    # the next run does not adopt it (it plans txid 4); a backfill asked for by hand would
    batch = begin(conn, committed, "run-4")
    assert batch.attempt.txid == 4 and batch.records == 0
    batch = begin(conn, committed, "run-again", txid=3)
    assert (batch.attempt.txid, batch.attempt.attempt) == (3, 2)
    code, out = run(capsys, "repair", "--yes")
    assert code == 0 and "repaired:" in out
    assert table(conn, """SELECT t.attempt, t.state, a.attempt, a.outcome
                          FROM transactions t JOIN transaction_attempts a USING (pipeline, txid)
                          WHERE txid = 3 ORDER BY a.attempt""") == [
        (1, "committed", 1, "committed"), (1, "committed", 2, "fenced")]
    assert table(conn, "SELECT last_committed_txid FROM pipelines") == [(3,)]
    with pytest.raises(Fenced):  # the adopted attempt can never commit the batch again
        commit(conn, committed, batch.attempt)
    assert table(conn, "SELECT key, value, txid FROM url_counts ORDER BY key") == state
    assert run(capsys, "repair") == (0, "repair tweets: nothing to repair")

    # by hand the other way: txid 4, planned, marked committed without its commit
    with conn.cursor() as cur:
        cur.execute("UPDATE transactions SET state = 'committed' WHERE txid = 4")
        cur.execute("UPDATE pipelines SET last_committed_txid = 4")
    conn.commit()
    code, out = run(capsys, "status")
    assert code == 1 and "txid 4 is committed but no commit of it left its marks" in out
    code, out = run(capsys, "repair", "--yes")
    assert code == 0 and "did: mark txid 4 failed" in out
    assert table(conn, "SELECT state FROM transactions WHERE txid = 4") == [("failed",)]
    assert table(conn, "SELECT last_committed_txid FROM pipelines") == [(3,)]
    code, out = run(capsys, "status")  # no damage left; a failed txid stalls the pipeline
    assert code == 1 and "PROBLEMS" not in out
    assert "STALLED until someone acts (each is listed above): txid 4 failed" in out
    report = recount(conn, committed)
    assert report.ok and report.records == 600, report.mismatches


def test_a_restored_commit_record_is_whole_and_status_reads_it(committed, conn, capsys):
    """A commit record reverted by hand with its committed_at: repair restores the time from
    the commit's own record (its attempt's end), else now, and says which; status and its
    freshness line never crash on a NULL committed_at."""
    ended = dict(table(conn, "SELECT txid, ended_at FROM transaction_attempts "
                             "WHERE outcome = 'committed'"))
    with conn.cursor() as cur:  # the repro
        cur.execute("UPDATE transactions SET state = 'planned', committed_at = NULL "
                    "WHERE txid = 2")
        cur.execute("UPDATE pipelines SET last_committed_txid = 1")
        # and txid 3 stamped by an older repair (committed, no time), its attempt's end gone
        cur.execute("UPDATE transactions SET committed_at = NULL WHERE txid = 3")
        cur.execute("UPDATE transaction_attempts SET ended_at = NULL WHERE txid = 3")
    conn.commit()
    code, out = run(capsys, "status")
    assert code == 1 and "Traceback" not in out
    assert "txid 2 is planned but attempt 1 committed it" in out
    assert "txid 3 is committed (attempt 1) but its committed_at is gone" in out
    (before,), = table(conn, "SELECT now()")
    code, out = run(capsys, "repair", "--yes")
    assert code == 0, out
    assert ("did: mark txid 2 committed again (attempt 1), committed_at from its committing "
            f"attempt's end ({ended[2].astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC)") in out
    assert "did: set its committed_at now (no record of when it committed is left)" in out
    rows = dict(table(conn, "SELECT txid, committed_at FROM transactions WHERE state = "
                            "'committed'"))
    assert sorted(rows) == [1, 2, 3] and rows[2] == ended[2] and rows[3] >= before
    assert run(capsys, "repair") == (0, "repair tweets: nothing to repair")
    code, out = run(capsys, "status")
    assert code == 0 and "last 3 transaction(s)" in out, out
