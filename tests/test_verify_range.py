"""`onceflow verify --txids A..B` and `--last N`: only those txids run again; a clean range
passes, a change inside it is found and named, a change outside it is reported as such (not
blamed on the range); bad arguments are refused with the flag, the value and the fix."""

from __future__ import annotations

import pytest

from helpers import run_transaction, table
from onceflow.cli import main
from onceflow.core.registration import register
from onceflow.core.registry import get_pipeline
from onceflow.ops.verify import rerun
from tweets_example.data import generate

RECORDS, BATCH, TXIDS = 480, 120, 4


@pytest.fixture
def history(spark, conn, dsn):
    """The tweets pipeline with four committed txids (malformed, flaky and poison records:
    rejects, replays by later txids, dead letters)."""
    pipeline = get_pipeline("tweets", batch_size=BATCH)
    register(conn, pipeline, create_source=True)
    pipeline.source.append(conn, generate(RECORDS, seed=39, malformed_share=0.05,
                                          poison_share=0.01, flaky_share=0.03))
    for i in range(TXIDS):
        _, result = run_transaction(spark, dsn, conn, pipeline, f"run-{i}")
        assert result.status == "committed"
    assert table(conn, "SELECT last_committed_txid FROM pipelines WHERE name = 'tweets'") \
        == [(TXIDS,)]
    return pipeline


def _records(conn, first: int, last: int) -> int:
    return table(conn, """SELECT coalesce(sum(end_offset - start_offset), 0)::int
                          FROM batch_ranges WHERE pipeline = 'tweets'
                            AND txid BETWEEN %s AND %s""", (first, last))[0][0]


def _replays(conn, first: int, last: int) -> int:
    return table(conn, "SELECT count(*)::int FROM batch_replays WHERE pipeline = 'tweets' "
                       "AND txid BETWEEN %s AND %s", (first, last))[0][0]


def _key_at(conn, state: str, txid: int) -> str:
    rows = table(conn, f"SELECT key FROM {state} WHERE txid = %s ORDER BY key LIMIT 1",
                 (txid,))
    assert rows, f"no key of {state} was last written by txid {txid}"
    return rows[0][0]


def test_a_clean_range_passes_and_reads_only_its_batches(spark, conn, dsn, history, capsys):
    full = rerun(conn, dsn, history, spark)
    assert full.ok, full.mismatches
    assert full.contributions == TXIDS  # every commit recorded what it added, as re-run
    assert full.records == _records(conn, 1, TXIDS)
    assert _replays(conn, 2, 3) > 0  # the range re-runs replays too

    seen: list[str] = []
    ranged = rerun(conn, dsn, history, spark, txids=(2, 3), progress=seen.append,
                   chunk_records=1)
    assert ranged.ok, ranged.mismatches
    assert (ranged.txids, ranged.txids_checked, ranged.contributions) == (2, 2, 2)
    assert ranged.records == _records(conn, 2, 3) < full.records
    assert ranged.replays == _replays(conn, 2, 3)
    assert ranged.totals == f"every table adds up to what txids 1..{TXIDS} recorded"
    assert "verify tweets (re-run of txids 2..3): OK: 2 committed txids re-run of 1..4" \
        in ranged.line()
    # one Spark job per txid here (chunk_records=1), each told as it ends
    n2, n3 = _records(conn, 2, 2), _records(conn, 2, 3)
    assert seen[0] == f"re-running txids 2..3: 2 batches, {n3} records, {ranged.replays} replays"
    assert f"txids 2..2 re-run: {n2} of {n3} records ({100 * n2 // n3}%)" in seen
    assert f"txids 3..3 re-run: {n3} of {n3} records (100%)" in seen

    # The records of txids 1 and 4 made unreadable: a re-run that read them would differ.
    with conn.cursor() as cur:
        cur.execute("""UPDATE source_log s SET payload = 'not json'
                       FROM batch_ranges b
                       WHERE b.pipeline = 'tweets' AND b.txid IN (1, 4)
                         AND s.topic = 'tweets' AND s.partition = b.partition
                         AND s."offset" >= b.start_offset AND s."offset" < b.end_offset""")
        assert cur.rowcount == _records(conn, 1, 1) + _records(conn, 4, 4)
    conn.commit()
    assert not rerun(conn, dsn, history, spark).ok  # the full re-run reads them
    assert rerun(conn, dsn, history, spark, txids=(2, 3)).ok  # the range does not

    # the CLI: --txids 2..3 and --last 2, progress on stderr with the elapsed time
    capsys.readouterr()
    assert main(["verify", "--pipeline", "tweets", "--txids", "2..3"]) == 0
    out = capsys.readouterr()
    assert "verify tweets (re-run of txids 2..3): OK" in out.out
    assert f"verify tweets: txids 2..3 re-run: {n3} of {n3} records (100%) (" in out.err


def test_last_n_re_runs_the_newest_txids(spark, conn, dsn, history, capsys):
    assert main(["verify", "--pipeline", "tweets", "--last", "2"]) == 0
    out = capsys.readouterr()
    assert "verify tweets (re-run of txids 3..4): OK: 2 committed txids re-run of 1..4, " \
        f"{_records(conn, 3, 4)} records" in out.out
    assert "re-running txids 3..4: 2 batches" in out.err
    # more than there are: all of them, said so
    assert main(["verify", "--pipeline", "tweets", "--last", "9"]) == 0
    out = capsys.readouterr()
    assert "--last 9: only 4 committed txid(s): re-running txids 1..4" in out.err
    assert "verify tweets (re-run of txids 1..4): OK" in out.out


def test_a_change_inside_the_range_is_found_and_one_outside_is_not_blamed_on_it(
        spark, conn, dsn, history, capsys):
    inside, outside = _key_at(conn, "url_counts", 3), _key_at(conn, "url_counts", 1)
    value, prev = table(conn, "SELECT value, prev_value FROM url_counts WHERE key = %s",
                        (inside,))[0]

    def change(key: str, by: int) -> None:
        with conn.cursor() as cur:
            cur.execute("UPDATE url_counts SET value = value + %s WHERE key = %s", (by, key))
        conn.commit()

    # a key txid 3 wrote last, one more than its records say: found by key, in the range
    change(inside, 1)
    report = rerun(conn, dsn, history, spark, txids=(2, 3))
    assert not report.ok and report.outside == 0
    assert report.line().startswith("verify tweets (re-run of txids 2..3): FAILED (2 "
                                    "mismatches in txids 2..3)")
    assert f"url_counts[{inside!r}]: txid 3 added {value - prev + 1} (value {value + 1}, " \
        f"prev_value {prev}), re-run {value - prev}" in report.mismatches, report.mismatches
    assert any("perhaps the mismatches above" in m for m in report.mismatches)
    # the same change seen from txid 4 alone: outside it, and said so
    report = rerun(conn, dsn, history, spark, txids=(4, 4))
    assert report.found == report.outside == 1
    assert "txids 4..4 OK, FAILED outside them (1 mismatch" in report.line()
    assert "cannot locate" in report.mismatches[0]
    change(inside, -1)
    assert rerun(conn, dsn, history, spark, txids=(2, 3)).ok

    # a key txid 1 wrote last: txids 2..3 are clean, the tables are not
    change(outside, 5)
    report = rerun(conn, dsn, history, spark, txids=(2, 3))
    assert report.found == report.outside == 1, report.mismatches
    assert not any("txid 2" in m or "txid 3" in m for m in report.mismatches)
    assert report.mismatches[0].startswith("url_counts: its values add up to ")
    assert "txids 2..3 cannot locate" in report.mismatches[0]
    assert "txids 2..3 OK, FAILED outside them" in report.line()
    capsys.readouterr()
    assert main(["verify", "--pipeline", "tweets", "--txids", "2..3"]) == 1
    assert "FAILED outside them" in capsys.readouterr().out
    full = rerun(conn, dsn, history, spark)  # the full re-run finds the key
    assert full.found == 1 and full.mismatches[0].startswith(f"url_counts[{outside!r}]: ")
    change(outside, -5)

    # what txid 3's commit recorded adding, changed: found for txid 3
    with conn.cursor() as cur:
        cur.execute("""UPDATE batch_contributions SET total = total + 1
                       WHERE pipeline = 'tweets' AND txid = 3 AND state_name = 'domain_counts'""")
        assert cur.rowcount == 1
    conn.commit()
    report = rerun(conn, dsn, history, spark, txids=(2, 3))
    assert report.outside == 0 and report.found == 2, report.mismatches
    assert report.mismatches[0].startswith("txid 3: its commit recorded adding ")
    assert "keys to domain_counts, the re-run adds " in report.mismatches[0]
    report = rerun(conn, dsn, history, spark, txids=(1, 2))  # the totals see it from 1..2
    assert report.found == report.outside == 1
    assert report.mismatches[0].startswith("domain_counts: its values add up to ")


@pytest.mark.parametrize("argv, message", [
    (["--txids", "5..3"], "argument --txids: '5..3' ends before it starts: give A..B with "
                          "A <= B (3..5)"),
    (["--txids", "two"], "argument --txids: 'two' is not a txid range: give A..B"),
    (["--txids", "0..2"], "argument --txids: '0..2': txids start at 1"),
    (["--last", "0"], "argument --last: 0: give 1 or more"),
])
def test_malformed_ranges_exit_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["verify", "--pipeline", "tweets", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_ranges_the_history_does_not_have_exit_2_with_the_fix(spark, conn, dsn, history,
                                                               capsys):
    for argv, message in [
        (["--txids", "2..9"], "--txids 2..9: txid 9 is beyond the last committed txid 4 of "
                              "pipeline 'tweets': give --txids 2..4, or --last N"),
        (["--txids", "7"], "--txids 7..7: txid 7 is beyond the last committed txid 4"),
        (["--txids", "2..3", "--last", "2"], "--txids 2..3 and --last 2 both given: give one"),
        (["--recount", "--last", "2"], "--recount counts every record below the committed "
                                       "offsets and takes no --last 2: drop --last"),
    ]:
        capsys.readouterr()
        assert main(["verify", "--pipeline", "tweets", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert f"onceflow verify: error: {message}" in err and "Traceback" not in err, err
        assert "starting Spark" not in err  # refused before any work


def test_a_range_of_a_pipeline_with_nothing_committed_is_refused(conn, capsys):
    register(conn, get_pipeline("tweets"), create_source=True)
    assert main(["verify", "--pipeline", "tweets", "--last", "1"]) == 2
    assert "--last 1: pipeline 'tweets' has no committed txid yet: nothing to verify" in \
        capsys.readouterr().err
