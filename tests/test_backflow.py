"""Backflow on real PostgreSQL and Spark: failed records replay and count exactly once, poison
ends in the dead letters without stalling anything, queue swaps while transactions are in
flight lose and duplicate nothing, and an oracle of the tests' own (helpers.assert_exact,
from the produced records alone) accounts for every record after each commit."""

from __future__ import annotations

import json

import pytest

from helpers import assert_exact, run_transaction, table, tweets_pipeline
from onceflow.cli import main
from onceflow.core.backflow import queue_sizes, replay_dead_letters
from onceflow.core.begin import begin, mark_failed
from onceflow.core.commit import commit
from onceflow.core.db import transaction
from onceflow.core.txlog import lock_pipeline
from onceflow.spark.processing import process_batch


def verified(conn, pipeline) -> Checked:
    """The committed state against the tests' own oracle (helpers.assert_exact) over the
    records this test produced into the topic."""
    payloads = [p for (p,) in table(conn, "SELECT payload FROM source_log WHERE topic = %s",
                                    (pipeline.topic,))]
    return Checked(assert_exact(conn, pipeline, payloads, read_all=False))


class Checked:
    """What the oracle found, as counts: records counted or rejected, queued, dead."""

    def __init__(self, exact):
        self.queued, self.dead = len(exact.queued), len(exact.dead)
        self.records = exact.read - self.queued - self.dead


def sizes(conn, pipeline):
    with conn.cursor() as cur:
        result = queue_sizes(cur, pipeline.name)
    conn.commit()
    return result


def marked(conn, key: str) -> set[tuple[int, int]]:
    """Origins of the produced tweets carrying ``key`` (flaky) or a refused host (poison)."""
    rows = table(conn, 'SELECT partition, "offset", payload FROM source_log')
    out = set()
    for p, o, payload in rows:
        try:
            doc = json.loads(payload)
        except ValueError:
            continue
        if not isinstance(doc, dict) or not isinstance(doc.get("url"), str):
            continue
        if (key == "flaky" and doc.get("flaky")) or (key == "poison" and ".." in doc["url"]):
            out.add((p, o))
    return out


def test_a_record_that_fails_then_succeeds_counts_exactly_once(spark, dsn, conn):
    pipeline = tweets_pipeline(conn, events=1200, batch_size=500, flaky_share=0.03,
                               poison_share=0.0)
    flaky = marked(conn, "flaky")
    assert len(flaky) > 10
    seen_queued = 0
    for i in range(8):
        run_transaction(spark, dsn, conn, pipeline, f"run-{i}")
        report = verified(conn, pipeline)
        seen_queued = max(seen_queued, report.queued)
    assert seen_queued > 0  # flaky records did wait in the queues
    assert report.queued == report.dead == 0 and report.records == 1200
    # each flaky record failed once or twice, then completed: in the state exactly once
    failed = table(conn, "SELECT sum(failed) FROM transactions")[0][0]
    assert len(flaky) < failed <= 2 * len(flaky)
    replayed = table(conn, "SELECT sum(replayed) FROM transactions")[0][0]
    assert replayed == failed


def test_poison_ends_in_dead_letters_and_everything_else_counts(spark, dsn, conn):
    pipeline = tweets_pipeline(conn, events=1500, batch_size=400, poison_share=0.02,
                               flaky_share=0.0, max_replays=2)
    poison = marked(conn, "poison")
    assert len(poison) > 10
    # the URL of a poison record is emitted by the other branch: all or nothing drops it
    poison_urls = {json.loads(p)["url"] for (p,) in table(
        conn, "SELECT payload FROM source_log WHERE payload LIKE '%%..%%'")}
    for i in range(9):
        run_transaction(spark, dsn, conn, pipeline, f"run-{i}")
        verified(conn, pipeline)
        assert not table(conn, "SELECT key FROM url_counts WHERE key = ANY(%s)",
                         (list(poison_urls),))
    dead = table(conn, 'SELECT partition, "offset", failures, errors FROM dead_letters')
    assert {(p, o) for p, o, _, _ in dead} == poison
    assert all(n == 3 and len(errors) == 3 for _, _, n, errors in dead)  # 1 try + 2 replays
    assert all(e.startswith("bolt normalize_domain: UnicodeError") for *_, errs in dead
               for e in errs)
    report = verified(conn, pipeline)
    assert report.dead == len(poison) and report.queued == 0
    # the source was read to its end by txid 4 (1500 / 400): no partition waited for poison
    heads = dict(table(conn, "SELECT partition, next_offset FROM source_partitions"))
    offsets = dict(table(conn, 'SELECT partition, "offset" FROM partition_offsets'))
    assert offsets == heads
    assert table(conn, "SELECT min(txid) FROM partition_offsets")[0][0] <= 4

    # two are put back (their cause is not fixed here): replayed again, they die again, and
    # nothing is lost or counted on the way
    first_two = sorted(poison)[:2]
    with transaction(conn) as cur:
        lock_pipeline(cur, pipeline.name)
        assert replay_dead_letters(cur, pipeline.name, positions=first_two) == 2
    assert verified(conn, pipeline).queued == 2
    for i in range(3):
        run_transaction(spark, dsn, conn, pipeline, f"again-{i}")
    report = verified(conn, pipeline)
    assert report.dead == len(poison) and report.queued == 0
    errors = dict(((p, o), e) for p, o, e in table(
        conn, 'SELECT partition, "offset", errors FROM dead_letters'))
    assert "put back from the dead letters by a user" in errors[first_two[0]]


def test_queue_swaps_while_transactions_are_in_flight_lose_and_duplicate_nothing(
        spark, dsn, conn):
    pipeline = tweets_pipeline(conn, events=2000, batch_size=300, flaky_share=0.06,
                               poison_share=0.01, max_replays=1, replay_cap=10, max_pending=3)
    # txid 1 commits alone: its failures go to the from-queue, and as the to-queue is empty
    # the commit swaps them in
    run_transaction(spark, dsn, conn, pipeline, "run-0")
    first = sizes(conn, pipeline)
    assert first.swaps == 1 and first.to_items > 10 and first.from_items == 0
    # three in flight: txid 2 claims 10, txid 3 the rest, txid 4 none
    batches = [begin(conn, pipeline, f"run-{i}") for i in (1, 2, 3)]
    assert [b.replayed for b in batches] == [10, first.to_items - 10, 0]
    assert sizes(conn, pipeline).to_claimed == first.to_items
    # processing finishes out of order; commits in order. txid 2's failures go to the
    # from-queue while txid 3 holds claims (no swap); txid 3's commit empties the to-queue
    # and swaps while txid 4 is in flight
    for b in reversed(batches):
        process_batch(spark, dsn, pipeline, b.attempt)
    claims = {b.attempt.txid: set(table(
        conn, 'SELECT partition, "offset" FROM backflow_items WHERE claimed_txid = %s',
        (b.attempt.txid,))) for b in batches}
    assert not set.intersection(*claims.values())
    swaps = []
    for b in batches:
        assert commit(conn, pipeline, b.attempt).status == "committed"
        verified(conn, pipeline)
        swaps.append(sizes(conn, pipeline).swaps)
    assert swaps == [1, 2, 2]
    # a failed txid keeps its claims; a re-attempt processes exactly the same replays
    more = begin(conn, pipeline, "run-4")
    held = table(conn, 'SELECT partition, "offset" FROM backflow_items WHERE claimed_txid = %s '
                       "ORDER BY 1, 2", (more.attempt.txid,))
    mark_failed(conn, pipeline.name, more.attempt, "test: killed")
    again = begin(conn, pipeline, "run-5")
    assert again.attempt.txid == more.attempt.txid and again.attempt.attempt == 2
    assert table(conn, 'SELECT partition, "offset" FROM backflow_items WHERE claimed_txid = %s '
                       "ORDER BY 1, 2", (more.attempt.txid,)) == held
    process_batch(spark, dsn, pipeline, again.attempt)
    commit(conn, pipeline, again.attempt)
    for i in range(3):
        run_transaction(spark, dsn, conn, pipeline, f"drain-{i}")
        report = verified(conn, pipeline)
    assert report.records + report.queued + report.dead == 2000 and report.dead > 0


def test_a_superseded_transaction_releases_its_claims(spark, dsn, conn):
    pipeline = tweets_pipeline(conn, events=900, batch_size=200, flaky_share=0.1,
                               poison_share=0.0, mode="opaque", replay_cap=5)
    run_transaction(spark, dsn, conn, pipeline, "run-0")
    b2 = begin(conn, pipeline, "run-1")
    b3 = begin(conn, pipeline, "run-2")
    assert b2.replayed == 5 and b3.replayed == 5
    claimed3 = set(table(conn, 'SELECT partition, "offset" FROM backflow_items '
                               "WHERE claimed_txid = 3"))
    # txid 2 fails and is re-attempted with a bigger batch_size: its opaque re-plan changes,
    # so txid 3 is superseded and its claims go back to the to-queue, to be planned again
    mark_failed(conn, pipeline.name, b2.attempt, "test: killed")
    bigger = type(pipeline)(**{**pipeline.__dict__, "batch_size": 260})
    b2again = begin(conn, bigger, "run-3")
    assert b2again.attempt.txid == 2
    state3 = table(conn, "SELECT state FROM transactions WHERE txid = 3")[0][0]
    assert state3 == "superseded"
    assert not table(conn, "SELECT 1 FROM backflow_items WHERE claimed_txid = 3")
    free = set(table(conn, 'SELECT partition, "offset" FROM backflow_items '
                           "WHERE claimed_txid IS NULL"))
    assert claimed3 <= free
    process_batch(spark, dsn, bigger, b2again.attempt)
    commit(conn, bigger, b2again.attempt)
    verified(conn, bigger)


def test_status_and_replay_dead_letters_cli(spark, dsn, conn, capsys):
    pipeline = tweets_pipeline(conn, events=400, batch_size=200, poison_share=0.03,
                               flaky_share=0.0, max_replays=0)
    run_transaction(spark, dsn, conn, pipeline, "run-0")
    dead = table(conn, 'SELECT partition, "offset" FROM dead_letters ORDER BY 1, 2')
    assert dead
    assert main(["status", "--pipeline", "tweets"]) == 0
    out = capsys.readouterr().out
    assert f"dead letters: {len(dead)}" in out and "from-queue holds 0" in out
    assert f"{len(dead):>6} x bolt normalize_domain: UnicodeError" in out  # by reason
    assert any(line.strip().startswith(f"p{p}:{o} failures=1") for p, o in dead
               for line in out.splitlines())
    assert max(map(len, out.splitlines())) <= 100
    assert main(["replay-dead-letters", "--pipeline", "tweets"]) == 2
    assert "nothing chosen" in capsys.readouterr().err
    assert main(["replay-dead-letters", "--pipeline", "tweets", "--record", "x"]) == 2
    assert "--record='x' is invalid: give PARTITION:OFFSET" in capsys.readouterr().err
    p, o = dead[0]
    assert main(["replay-dead-letters", "--pipeline", "tweets", "--record", f"{p}:{o}"]) == 0
    assert "put 1 dead letter(s) of tweets back" in capsys.readouterr().out
    assert main(["replay-dead-letters", "--pipeline", "tweets",
                 "--error-contains", "UnicodeError"]) == 0
    assert f"put {len(dead) - 1} dead letter" in capsys.readouterr().out
    assert main(["verify", "--pipeline", "tweets", "--recount"]) == 0
    assert f"+ {len(dead)} queued for replay + 0 dead letters" in capsys.readouterr().out


@pytest.mark.parametrize("field, value, message", [
    ("max_replays", -1, "pipeline.max_replays=-1 is invalid"),
    ("replay_cap", 1000, "pipeline.replay_cap=1000 is invalid: give a number of records from 1"),
    ("tuple_timeout_ms", 0, "pipeline.tuple_timeout_ms=0 is invalid"),
    ("acker", "yes", "pipeline.acker='yes' is invalid: give True or False"),
])
def test_bad_backflow_settings_are_refused(field, value, message):
    from onceflow.core.errors import ConfigError
    from onceflow.core.registry import get_pipeline

    with pytest.raises(ConfigError, match=message):
        get_pipeline("tweets", batch_size=1000, **{field: value})
