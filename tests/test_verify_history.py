"""`onceflow verify` over histories a user's fixes leave: a measure widened after its records
went to the dead letters (the documented procedure, end to end, with no `onceflow init`), and
a committed chunk of a landed file edited in place (that txid is reported, the others are
still checked, and the exit code says the check is incomplete)."""

from __future__ import annotations

import os
import random
import time
from decimal import Decimal

import pytest

from helpers import OUTSIDE, produce, run_transaction, table
from onceflow.cli import main
from onceflow.core.registration import register
from onceflow.core.registry import clear_cache, get_pipeline

DECLARATION = '''
from onceflow import Count, Max, Pipeline, PostgresLog, StateSpec, Sum


def amounts(largest):
    return Pipeline(name="amounts", source=PostgresLog(topic="amounts", partitions=2),
                    topology="amounts.topology:build", batch_size=1000, max_replays=1,
                    retries=0,
                    states=(StateSpec("amounts_totals", source="totals",
                                      key={"merchant": "text"},
                                      measures={"revenue": Sum("amount", "numeric(12,2)"),
                                                "largest": Max("amount", largest),
                                                "orders": Count()}),))


NARROW = amounts("numeric(5,2)")
WIDE = amounts("numeric(8,2)")
'''


@pytest.fixture
def declared(monkeypatch, tmp_path):
    """The user's package (tests/outside/amounts) and a module declaring the pipeline with
    `largest` in numeric(5,2) (NARROW) or, once the user widened it, numeric(8,2) (WIDE);
    ``use(name)`` makes the CLI see that one."""
    (tmp_path / "widening.py").write_text(DECLARATION)
    for path in (OUTSIDE, tmp_path):
        monkeypatch.syspath_prepend(str(path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(OUTSIDE), str(tmp_path), os.environ.get("PYTHONPATH")])))

    def use(name: str):
        monkeypatch.setenv("ONCEFLOW_PIPELINES", f"widening:{name}")
        clear_cache()
        return get_pipeline("amounts")

    yield use
    clear_cache()


def _order(merchant: str, amount: str) -> str:
    return f'{{"merchant": "{merchant}", "amount": {amount}}}'


def _staged_type(conn) -> str:
    return table(conn, """SELECT format_type(atttypid, atttypmod) FROM pg_attribute
                          WHERE attrelid = 'onceflow_staging."amounts.amounts_totals"'::regclass
                            AND attname = 'largest'""")[0][0]


@pytest.mark.timeout(900)
def test_widening_a_measure_then_replaying_its_dead_letters_commits_and_verifies(
        declared, spark, dsn, conn, capsys):
    """1780.25 does not fit `largest` numeric(5,2): it fails in txid 1 and in its replay
    (txid 2, max_replays 1), then is a dead letter. The documented fix: widen the declaration
    and the table, `onceflow replay-dead-letters`; the next txid's begin makes the staging
    follow the declaration (it kept numeric(5,2), and COPY failed with `numeric field
    overflow`), the txid commits the record, and `onceflow verify` exits 0, counting the
    record once, where it committed. The table equals a recount of every order written."""
    narrow = declared("NARROW")
    register(conn, narrow, create_source=True)  # `onceflow init`, once, before any data
    rng = random.Random(48)
    written: list[tuple[str, str]] = []
    for txid in range(1, 3):
        orders = [(rng.choice("abc"), f"{rng.randrange(1, 99999) / 100:.2f}")
                  for _ in range(15)]
        if txid == 1:
            orders[4] = ("b", "1780.25")
        produce(conn, narrow.topic, [_order(m, a) for m, a in orders])
        written += orders
        batch, result = run_transaction(spark, dsn, conn, narrow, f"run-{txid}")
        assert batch.attempt.txid == txid and result.status == "committed"
        assert batch.replayed == (0 if txid == 1 else 1)
    [(failures, errors, dead_txid)] = table(conn, "SELECT failures, errors, txid "
                                                  "FROM dead_letters")
    assert (failures, dead_txid) == (2, 2) and len(errors) == 2
    assert errors[0] == ("table amounts_totals: measures['largest'] = Max('amount', "
                         "'numeric(5,2)'): value 1780.25 does not fit numeric(5,2)")

    # the fix, as docs/write-your-own-pipeline.md gives it: the declaration, the table
    wide = declared("WIDE")
    with conn.cursor() as cur:
        cur.execute("ALTER TABLE amounts_totals ALTER COLUMN largest TYPE numeric(8,2), "
                    "ALTER COLUMN prev_largest TYPE numeric(8,2)")
    conn.commit()
    capsys.readouterr()
    assert main(["replay-dead-letters", "--pipeline", "amounts",
                 "--error-contains", "does not fit"]) == 0
    assert "put 1 dead letter(s) of amounts back" in capsys.readouterr().out
    assert _staged_type(conn) == "numeric(5,2)"  # what made COPY fail: init made it so

    more = [("a", "12.50"), ("c", "640.00")]
    produce(conn, wide.topic, [_order(m, a) for m, a in more])
    written += more
    batch, result = run_transaction(spark, dsn, conn, wide, "run-3")
    assert batch.attempt.txid == 3 and batch.replayed == 1
    assert result.status == "committed" and result.dead == 0
    assert _staged_type(conn) == "numeric(8,2)"  # begin made it follow the declaration
    assert table(conn, "SELECT count(*) FROM dead_letters UNION ALL "
                       "SELECT count(*) FROM backflow_items") == [(0,), (0,)]
    # the record was read by txid 1 and replayed by txids 2 and 3: three tries, one count
    assert table(conn, "SELECT array_agg(txid ORDER BY txid) FROM batch_replays") == [
        ([2, 3],)]

    # an independent count: plain Python over the orders the test wrote
    want: dict[str, list] = {}
    for merchant, amount in written:
        value = Decimal(amount)
        t = want.setdefault(merchant, [Decimal(0), value, 0])
        t[0] += value
        t[1] = max(t[1], value)
        t[2] += 1
    got = {m: [revenue, largest, n] for m, revenue, largest, n in table(
        conn, "SELECT merchant, revenue, largest, orders FROM amounts_totals")}
    assert got == want and want["b"][1] == Decimal("1780.25")

    # it counted the record three times before (in txid 1 and in each replay round)
    assert main(["verify", "--pipeline", "amounts"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("verify amounts (re-run): OK: 3 committed txids re-run, "
                          f"{len(written)} records + 2 replays; amounts_totals 3 keys"), out
    assert out.rstrip().endswith("; 2 tries of records their commit failed and a later txid "
                                 "replayed, compared as failed"), out


LANDED = """
from onceflow import LandingFolder, StateSpec
from tweets_example.pipelines import TWEETS

LANDED = TWEETS.with_settings(
    name="landed", batch_size=100,
    source=LandingFolder(topic="landed", path={path!r}, partitions=1, chunk_bytes=4096,
                         settle_s=0.0),
    states=(StateSpec("landed_url_counts", source="url_counts"),
            StateSpec("landed_domain_counts", source="domain_counts")))
"""


@pytest.mark.timeout(900)
def test_a_committed_chunk_edited_in_place_is_reported_and_the_other_txids_are_checked(
        spark, conn, dsn, tmp_path, monkeypatch, capsys):
    """Three txids, one landed file each; the file of txid 2 is edited in place after its
    commit (its size and modification time kept). `onceflow verify` names txid 2 with its
    reader's refusal in one line, re-runs and checks txids 1 and 3, and exits 3; a state row
    of txid 3 changed by hand is still found (exit 1)."""
    from tweets_example.data import generate

    folder = tmp_path / "landing"
    folder.mkdir()
    (tmp_path / "landed_pipeline.py").write_text(LANDED.format(path=str(folder)))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("ONCEFLOW_PIPELINES", "landed_pipeline:LANDED")
    clear_cache()
    pipeline = get_pipeline("landed")
    register(conn, pipeline, create_source=True)
    events = list(generate(300, seed=48, malformed_share=0.05, poison_share=0,
                           flaky_share=0))
    for i in range(3):
        path = folder / f"{i}.jsonl"
        path.write_text("".join(p + "\n" for p in events[100 * i:100 * (i + 1)]))
        settled = time.time() - 60
        os.utime(path, (settled, settled))
        batch, result = run_transaction(spark, dsn, conn, pipeline, f"run-{i}")
        assert batch.attempt.txid == i + 1 and result.status == "committed"

    path = folder / "1.jsonl"
    data, before = path.read_bytes(), path.stat()
    at = data.index(b"http")
    path.write_bytes(data[:at] + b"HTTP" + data[at + 4:])
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size

    capsys.readouterr()
    assert main(["verify", "--pipeline", "landed"]) == 3
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert lines[0].startswith(f"  txid 2 could not be re-read: IllegalStateException: landed "
                               f"file '{path}' changed after it was indexed: bytes ["), out.out
    assert lines[0].endswith("refused. `onceflow repair` says what changed and how to go on")
    assert len(lines) == 2 and len(lines[0]) <= 450
    assert lines[1].startswith("verify landed (re-run): INCOMPLETE (1 txid could not be "
                               "re-read): 2 of 3 committed txids re-run (1 could not be "
                               "re-read: partial check), 200 records"), lines[1]
    assert "txids 1..3 could not be read (IllegalStateException: landed file" in out.err
    assert "Traceback" not in out.err and "\tat " not in out.err

    # a state row of txid 3 changed by hand is found next to the unreadable txid
    with conn.cursor() as cur:
        cur.execute("UPDATE landed_url_counts SET value = value + 1 WHERE txid = 3 AND key = "
                    "(SELECT min(key) FROM landed_url_counts WHERE txid = 3)")
        assert cur.rowcount == 1
    conn.commit()
    assert main(["verify", "--pipeline", "landed"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("  txid 2 could not be re-read: IllegalStateException: ")
    assert lines[1].startswith("  landed_url_counts[") and ": txid 3 added " in lines[1]
    assert lines[-1].startswith("verify landed (re-run): FAILED (1 mismatch; 1 txid could not "
                                "be re-read)"), lines
    clear_cache()


def test_a_parked_record_the_re_run_no_longer_fails_is_a_note_not_a_mismatch():
    """A dead letter whose cause was fixed (a type widened) before it was put back: its
    commits failed it, so it is not counted, and the state is exact; said, not failed."""
    from onceflow.ops.verify import VerifyReport
    from onceflow.ops.verify.compare import Failure, account_failures

    report = VerifyReport("amounts", "re-run", txids=2, txids_checked=2)
    account_failures(report, [], {(0, 4): "dead", (1, 2): "queued"}, [], set())
    assert report.ok and report.dead == report.queued == 1
    assert report.notes == [
        "record p0:4 is a dead letter the re-run does not fail: once its cause is fixed, "
        "`onceflow replay-dead-letters` puts it back",
        "record p1:2 is queued for replay, and the re-run does not fail it: its replay "
        "counts it"]
    # a record the re-run fails that went nowhere is still a mismatch
    account_failures(report, [Failure(0, 9, 2, "boom")], {}, [], set())
    assert report.found == 1 and "record p0:9 fails in txid 2 (boom)" in report.mismatches[0]
