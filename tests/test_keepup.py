"""Keeping up, piece by piece on a real PostgreSQL: the declaration, the DAG scheduled on its
source's watched Asset, what a look at a source sees (records no transaction planned, when
the oldest arrived, for each source onceflow ships), when the watcher starts a run, a begin
that finds nothing (no empty transaction), and freshness (arrival to commit). The watcher
and the runs against a real scheduler and triggerer: tests/test_keepup_airflow.py."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg2
import pytest
from airflow.triggers.base import BaseEventTrigger

from helpers import another, produce, run_transaction, table, tweets_pipeline
from onceflow.airflow.dags import transaction_dag
from onceflow.airflow.triggers import SourceWatchTrigger
from onceflow.core import backflow, freshness, keepup
from onceflow.core.begin import begin, mark_failed
from onceflow.core.errors import ConfigError, NothingToPlan
from onceflow.core.keepup import Look, Runs, Watch
from onceflow.core.registration import register
from onceflow.core.registry import clear_cache, get_pipeline
from onceflow.ops import drain
from onceflow.ops.status import pipeline_status, render
from onceflow.sources.landing import LandingFolder
from onceflow.sources.segments import FileSegments, produce_segments
from onceflow.sources.table import TableSource
from tweets_example.data import generate


def _look(conn, pipeline, seen=None) -> Look:
    with conn.cursor() as cur:
        found = keepup.look(cur, pipeline, seen)
    conn.commit()
    return found


def _named(name: str, source):
    """The tweets pipeline as another one, reading ``source`` (its tables its own)."""
    return another(get_pipeline("tweets"), name, source=source, keep_up=True).validate()


def _age(conn, topic: str, seconds: float) -> None:
    """Make every record of ``topic`` look produced ``seconds`` ago."""
    with conn.cursor() as cur:
        cur.execute("UPDATE source_log SET produced_at = now() - make_interval(secs => %s) "
                    "WHERE topic = %s", (seconds, topic))
    conn.commit()


@pytest.mark.parametrize(("field", "value"), [
    ("min_records", 0), ("min_records", 1001), ("max_delay", -1), ("max_delay", "10s"),
    ("max_delay", timedelta(0)), ("watch_interval", 0), ("keep_up", "yes")])
def test_bad_keep_up_settings_are_refused_by_name(field, value):
    with pytest.raises(ConfigError, match=rf"pipeline\.{field}="):
        get_pipeline("tweets", batch_size=1000, **{field: value})


def test_a_kept_up_pipeline_is_scheduled_on_its_watched_source(monkeypatch):
    monkeypatch.setenv("ONCEFLOW_PIPELINES", "keepup_pipelines:KEEP_UP")
    clear_cache()
    try:
        dag = transaction_dag("keepup")
        pipeline = get_pipeline("keepup")
        (asset,) = dag.timetable.asset_condition.objects
        assert asset.uri == "onceflow-source://keepup/"
        (watcher,) = asset.watchers
        assert isinstance(watcher.trigger, BaseEventTrigger)
        # max_pending in flight, twice as many waiting in their begin for a place
        assert dag.max_active_runs == 3 * pipeline.max_pending == 9
        # the triggerer rebuilds the trigger from what it stores: the same settings
        classpath, kwargs = watcher.trigger.serialize()
        assert classpath == "onceflow.airflow.triggers.SourceWatchTrigger"
        again = SourceWatchTrigger(**kwargs)
        assert again.serialize() == (classpath, kwargs)
        assert (kwargs["min_records"], kwargs["max_delay_s"], kwargs["max_pending"],
                kwargs["dag_id"], kwargs["max_runs"]) == (8000, 6.0, 3, dag.dag_id, 9)
        with pytest.raises(ConfigError, match="keeps up"):
            transaction_dag("keepup", schedule="@hourly")
    finally:
        clear_cache()


def test_a_look_sees_unplanned_records_their_age_and_the_open_transactions(conn):
    pipeline = tweets_pipeline(conn, events=1000, batch_size=400, partitions=2, keep_up=True)
    _age(conn, pipeline.topic, 30)
    seen = _look(conn, pipeline)
    assert (seen.unread, seen.open, seen.begins, seen.adopt, seen.undecided) == \
        (1000, 0, 0, False, False)
    assert 29 <= seen.oldest_wait_s < 60
    begin(conn, pipeline, "run-1")
    seen = _look(conn, pipeline)
    assert (seen.unread, seen.open, seen.begins) == (600, 1, 1)
    begin(conn, pipeline, "run-2")
    begin(conn, pipeline, "run-3")
    seen = _look(conn, pipeline)
    assert (seen.unread, seen.open, seen.begins, seen.oldest_wait_s) == (0, 3, 3, None)
    produce(conn, pipeline.topic, list(generate(10, seed=3)))
    seen = _look(conn, pipeline)
    assert seen.unread == 10 and seen.oldest_wait_s < 5


def test_a_run_the_watcher_started_plans_no_empty_transaction(conn):
    pipeline = tweets_pipeline(conn, events=300, batch_size=400, keep_up=True)
    first = begin(conn, pipeline, "run-1", skip_empty=True)
    assert first.records == 300
    with pytest.raises(NothingToPlan, match="caught up"):
        begin(conn, pipeline, "run-2", skip_empty=True)
    assert table(conn, "SELECT count(*), max(txid) FROM transactions") == [(1, 1)]
    assert table(conn, "SELECT begins FROM pipelines") == [(2,)]  # counted all the same
    assert table(conn, "SELECT count(*) FROM transaction_runs WHERE run_id = 'run-2'") == \
        [(0,)]
    # a run someone started plans as before: an empty transaction if there is nothing
    empty = begin(conn, pipeline, "run-3")
    assert (empty.attempt.txid, empty.records) == (2, 0)


def test_a_run_of_an_asset_event_is_the_watchers_whatever_its_run_type():
    """started_by_watcher: a task's dag_run in the Task SDK has the SDK's DagRunType, whose
    str() is not its value; the scheduler's is a str. Either asset_triggered run is the
    watcher's (its begin skips an empty batch, it carries on); a manual one is not."""
    from types import SimpleNamespace

    from airflow.sdk.api.datamodels._generated import DagRunType as SdkRunType
    from airflow.utils.types import DagRunType

    from onceflow.airflow.operators.transaction import started_by_watcher

    for kind in (SdkRunType.ASSET_TRIGGERED, DagRunType.ASSET_TRIGGERED):
        assert started_by_watcher({"dag_run": SimpleNamespace(run_type=kind)}), kind
    for kind in (SdkRunType.MANUAL, DagRunType.MANUAL, None):
        assert not started_by_watcher({"dag_run": SimpleNamespace(run_type=kind)}), kind
    assert not started_by_watcher({})


def test_a_run_that_carries_on_plans_a_new_txid_only_for_a_full_start(conn):
    """begin(carry_on=True), as a keep-up run that committed asks for its next batch: a new
    txid, not its own again; none while fewer than min_records would be read, and what that
    look claimed (a replay) is left as it was."""
    pipeline = tweets_pipeline(conn, events=250, batch_size=100, keep_up=True, min_records=60,
                               max_pending=5)
    first = begin(conn, pipeline, "run-1", skip_empty=True)
    following = begin(conn, pipeline, "run-1", carry_on=True)
    assert [(b.attempt.txid, b.records) for b in (first, following)] == [(1, 100), (2, 100)]
    assert table(conn, "SELECT txid FROM transaction_runs WHERE run_id = 'run-1'") == [(2,)]
    with conn.cursor() as cur:  # one failed record waits in the backflow, unclaimed
        backflow.ensure_pointers(cur, pipeline.name)
        cur.execute("""INSERT INTO backflow_items (pipeline, partition, "offset", queue,
                                                   payload, failures, errors, first_txid,
                                                   last_txid)
                       SELECT %s, 0, 1, to_queue, '{}', 1, ARRAY['flaky'], 1, 1
                       FROM backflow_pointers WHERE pipeline = %s""",
                    (pipeline.name, pipeline.name))
    conn.commit()
    # 50 records and a replay wait: fewer than min_records
    with pytest.raises(NothingToPlan):
        begin(conn, pipeline, "run-1", carry_on=True)
    assert table(conn, "SELECT count(*), max(txid) FROM transactions") == [(2, 2)]
    assert table(conn, "SELECT claimed_txid FROM backflow_items") == [(None,)]
    produce(conn, pipeline.topic, list(generate(20, seed=5)))
    third = begin(conn, pipeline, "run-1", carry_on=True)
    assert (third.attempt.txid, third.records, third.replayed) == (3, 70, 1)


def _sight(unread=0, *, open_=0, begins=0, oldest=None, adopt=False, undecided=False,
           replays=0, replay_wait=None) -> Look:
    return Look(datetime.now(UTC), begins, open_, adopt, unread, oldest, replays, replay_wait,
                undecided)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_watcher_drains_a_backlog_with_max_pending_in_flight():
    pipeline = get_pipeline("tweets", batch_size=1000, max_pending=3, keep_up=True,
                            min_records=100, max_delay=5)
    clock = Clock()
    watch = Watch(pipeline, clock=clock)
    assert watch.decide(_sight(10_000)) == "backlog"
    clock.now += 0.5
    assert watch.decide(_sight(10_000)) is None  # two events are SPACING_S apart
    clock.now += 2
    assert watch.decide(_sight(10_000)) == "backlog"
    clock.now += 2
    assert watch.decide(_sight(10_000)) == "backlog"
    clock.now += 2
    assert watch.decide(_sight(10_000)) is None  # three runs asked for: max_pending
    # two begins planned: two transactions open, one event still outstanding
    clock.now += 2
    assert watch.decide(_sight(8_000, open_=2, begins=2)) is None
    # the third began, one committed: a place is free
    clock.now += 2
    assert watch.decide(_sight(7_000, open_=2, begins=3)) == "backlog"
    # the end of the backlog: what the outstanding run reads is not asked for again
    clock.now += 2
    assert watch.decide(_sight(900, open_=2, begins=3)) is None
    clock.now += 2
    assert watch.decide(_sight(0, open_=1, begins=4)) is None
    assert watch.fired == 4


def test_the_drain_figures_of_a_backlog_planned_at_once():
    # (txid, records, planned_at, committed_at, taken up): one transaction took the whole
    # backlog, then two planned together; records waited no time unplanned
    one = drain.figures([(1, 500, 100.0, 104.0, 99.5)], 100, 2.0)
    assert (one["in_flight_waiting"], one["in_flight_drain"]) == (1.0, 1.0), one
    two = drain.figures([(1, 500, 100.0, 104.0, 99.5), (2, 500, 100.0, 102.0, 99.5)], 100, 2.0)
    assert (two["in_flight_waiting"], two["in_flight_drain"]) == (2.0, 1.5), two
    assert two["commit_to_plan_max_s"] is None and two["records"] == 1000, two


def test_with_the_dags_runs_the_watcher_keeps_a_place_waiting_behind_max_pending():
    pipeline = get_pipeline("tweets", batch_size=1000, max_pending=3, keep_up=True,
                            min_records=100, max_delay=5)
    clock = Clock()
    watch = Watch(pipeline, clock=clock, max_runs=6)
    assert watch.decide(_sight(10_000), Runs(0, 0)) == "backlog"
    clock.now += 0.5
    # Airflow has not made the run yet: a second event would fold into the first's run
    assert watch.decide(_sight(10_000), Runs(0, 0)) is None
    for made in range(1, 6):  # each event's run made, one more asked for at once
        clock.now += 0.5
        assert watch.decide(_sight(10_000), Runs(made, made)) == "backlog", made
    clock.now += 2
    # six runs: three in flight, three waiting in their begin for a place
    assert watch.decide(_sight(7_000, open_=3), Runs(6, 6)) is None
    clock.now += 2
    # one committed, its run ended, a waiting one planned: a place for one more run
    assert watch.decide(_sight(6_000, open_=3), Runs(5, 6)) == "backlog"
    clock.now += 2
    # what the runs still to plan will read is not asked for again
    assert watch.decide(_sight(2_050, open_=3, oldest=1.0), Runs(5, 7)) is None
    clock.now += 2
    assert watch.decide(_sight(2_600, open_=3, oldest=1.0), Runs(5, 7)) == "records"
    clock.now += 2
    assert watch.decide(_sight(0, open_=1), Runs(1, 8)) is None  # drained
    assert watch.fired == 8
    # a trickle waits for min_records or max_delay, as without the run count
    clock.now += 2
    assert watch.decide(_sight(50, oldest=1.0), Runs(0, 8)) is None
    clock.now += 5
    assert watch.decide(_sight(60, oldest=6.0), Runs(0, 8)) == "delay"


def test_status_shows_the_watcher_and_says_when_no_triggerer_runs_it(conn):
    pipeline = tweets_pipeline(conn, events=100, batch_size=400, partitions=2, keep_up=True)
    with conn.cursor() as cur:
        before = pipeline_status(cur, pipeline.source, pipeline.name,
                                 watch_interval=pipeline.watch_interval)
        assert pipeline_status(cur, pipeline.source, pipeline.name).watcher == {}
    assert not before.watcher["running"] and "no watcher has looked yet" in before.watcher["line"]
    seen = _look(conn, pipeline)
    with conn.cursor() as cur:
        keepup.record_watch(cur, pipeline, "host-a pid 7", seen, Runs(4, 9), 6, "backlog")
        keepup.record_watch(cur, pipeline, "host-a pid 7", seen, Runs(4, 9), 6)  # no event
    conn.commit()
    with conn.cursor() as cur:
        status = pipeline_status(cur, pipeline.source, pipeline.name,
                                 watch_interval=pipeline.watch_interval)
    w = status.watcher
    assert (w["running"], w["holder"], w["event_reason"], w["runs_active"], w["runs_waiting"],
            w["max_runs"], w["fix"]) == (True, "host-a pid 7", "backlog", 4, 4, 6, "-")
    assert w["looked_s_ago"] < 5 and w["event_s_ago"] < 5
    text = " ".join(" ".join(render(status)).split())  # the lines wrapped back
    assert "watcher: last look 0s ago in the triggerer (host-a pid 7), last event 0s ago " \
           "(backlog); runs 4 of 6 active, 4 not planned yet" in text, text
    # the triggerer died: the watcher's last look grows old
    with conn.cursor() as cur:
        cur.execute("UPDATE source_watchers SET looked_at = now() - interval '90 seconds'")
    conn.commit()
    with conn.cursor() as cur:
        status = pipeline_status(cur, pipeline.source, pipeline.name,
                                 watch_interval=pipeline.watch_interval)
    assert not status.watcher["running"]
    text = " ".join(" ".join(render(status)).split())
    assert "watcher: NOT RUNNING: no triggerer runs the watcher (its last look was 90s ago, " \
           "by host-a pid 7)" in text, text
    assert "`airflow triggerer`" in status.watcher["fix"]


def test_the_watcher_waits_for_min_records_or_max_delay_and_is_quiet_when_caught_up():
    pipeline = get_pipeline("tweets", batch_size=1000, max_pending=3, keep_up=True,
                            min_records=100, max_delay=5)
    clock = Clock()
    watch = Watch(pipeline, clock=clock)
    for _ in range(50):  # caught up: nothing, however long
        clock.now += 2
        assert watch.decide(_sight(0)) is None
    clock.now += 2
    assert watch.decide(_sight(40, oldest=1.0)) is None  # a trickle: it waits
    clock.now += 2
    assert watch.decide(_sight(99, oldest=4.9)) is None
    clock.now += 2
    assert watch.decide(_sight(99, oldest=5.0)) == "delay"  # the oldest waited max_delay
    clock.now += 2
    assert watch.decide(_sight(120, oldest=7.0)) is None  # its run will read them
    clock.now += 2
    assert watch.decide(_sight(0, open_=1, begins=1)) is None
    clock.now += 2
    assert watch.decide(_sight(100, open_=1, begins=1, oldest=0.5)) == "records"
    # an event that started no run (merged into another by Airflow) is given up in time
    clock.now += 2
    assert watch.decide(_sight(150, open_=1, begins=1, oldest=1.0)) is None
    clock.now += keepup.MAX_TTL_S + 1
    assert watch.decide(_sight(150, open_=1, begins=1, oldest=6.0)) == "records"
    # arrival unknown: the wait counts from when the watcher first saw the records
    watch = Watch(pipeline, clock=clock)
    assert watch.decide(_sight(10)) is None
    clock.now += 5
    assert watch.decide(_sight(10)) == "delay"


def test_the_watcher_starts_adoptions_decisions_and_replays():
    pipeline = get_pipeline("tweets", batch_size=1000, max_pending=2, keep_up=True,
                            min_records=100, max_delay=5)
    clock = Clock()
    watch = Watch(pipeline, clock=clock)
    assert watch.decide(None) == "initialise"  # no begin ever ran: a first run registers it
    clock.now += 2
    assert watch.decide(_sight(0, open_=2, adopt=True, begins=1)) == "adopt"
    clock.now += 2
    assert watch.decide(_sight(0, open_=1, undecided=True, begins=2)) == "start"
    clock.now += 2
    assert watch.decide(_sight(0, open_=0, replays=3, replay_wait=1.0, begins=3)) is None
    clock.now += 2
    assert watch.decide(_sight(0, open_=0, replays=3, replay_wait=6.0, begins=3)) == "replays"


def test_a_failed_transaction_is_adopted_after_a_back_off_a_permanent_one_never(conn):
    pipeline = tweets_pipeline(conn, events=300, batch_size=100, keep_up=True)
    one, two = begin(conn, pipeline, "run-1"), begin(conn, pipeline, "run-2")
    mark_failed(conn, pipeline.name, one.attempt, "boom")
    mark_failed(conn, pipeline.name, two.attempt, "bad setting", permanent=True)
    assert _look(conn, pipeline).adopt is False  # within the back-off
    with conn.cursor() as cur:
        cur.execute("UPDATE transaction_attempts SET ended_at = ended_at - interval '20 s'")
    conn.commit()
    assert _look(conn, pipeline).adopt is True
    with conn.cursor() as cur:
        cur.execute("UPDATE transaction_attempts SET permanent = true")
    conn.commit()
    assert _look(conn, pipeline).adopt is False


def test_freshness_is_arrival_to_commit_over_the_records(spark, conn, dsn):
    # two batches of 100 records: the first arrived 20 to 10 s before its commit, evenly
    assert freshness.weighted_quantile([(10.0, 20.0, 100)], 0.5) == pytest.approx(15, abs=0.01)
    assert freshness.weighted_quantile([(10.0, 20.0, 100), (0.0, 0.0, 100)], 0.95) == \
        pytest.approx(19, abs=0.01)
    assert freshness.weighted_quantile([], 0.5) is None
    pipeline = tweets_pipeline(conn, events=400, batch_size=200, partitions=1,
                               malformed_share=0, poison_share=0, flaky_share=0)
    with conn.cursor() as cur:  # offsets 0..399 arrived 400..1 s ago, one a second
        cur.execute("""UPDATE source_log SET produced_at = now()
                           - make_interval(secs => 400 - "offset") WHERE topic = %s""",
                    (pipeline.topic,))
    conn.commit()
    for run in ("run-1", "run-2"):
        _, result = run_transaction(spark, dsn, conn, pipeline, run)
        assert result.status == "committed"
    # the oracle: every record's own wait, from its produced_at to its batch's commit
    waits = sorted(float(w) for (w,) in table(conn, """
        SELECT EXTRACT(EPOCH FROM t.committed_at - l.produced_at) FROM source_log l
        JOIN batch_ranges b ON b.partition = l.partition AND l."offset" >= b.start_offset
             AND l."offset" < b.end_offset
        JOIN transactions t ON t.pipeline = b.pipeline AND t.txid = b.txid"""))
    assert len(waits) == 400
    with conn.cursor() as cur:
        fresh = freshness.measure(cur, pipeline.name, pipeline.source)
        status = pipeline_status(cur, pipeline.source, pipeline.name)
    conn.commit()
    assert (fresh.transactions, fresh.records, fresh.lag_records, fresh.lag_s) == (2, 400, 0, 0)
    assert fresh.p50_s == pytest.approx(waits[199], abs=1.5)
    assert fresh.p95_s == pytest.approx(waits[379], abs=1.5)
    assert fresh.max_s == pytest.approx(waits[-1], abs=0.01)
    assert status.freshness["p95_s"] == pytest.approx(fresh.p95_s, abs=0.01)
    shown = " ".join(" ".join(render(status)).split())
    assert f"freshness p50 {fresh.p50_s:.1f}s, p95 {fresh.p95_s:.1f}s" in shown
    assert "lag 0 records, 0.0s" in shown
    produce(conn, pipeline.topic, ["{}"] * 5)
    _age(conn, pipeline.topic, 7)
    with conn.cursor() as cur:
        records, seconds = freshness.lag(cur, pipeline.name, pipeline.source)
    assert records == 5 and 7 <= seconds < 30


def test_each_source_says_when_its_records_arrived(conn, dsn, tmp_path):
    before = datetime.now(UTC) - timedelta(seconds=1)
    # file segments: when a segment was indexed
    segments = FileSegments(topic="seg", path=str(tmp_path / "segments"), partitions=1)
    seg_pipeline = _named("seg", segments)
    register(conn, seg_pipeline, create_source=True)
    produce_segments(conn, Path(segments.path), "seg", ["a", "b", "c"])
    seen = _look(conn, seg_pipeline)
    assert seen.unread == 3 and 0 <= seen.oldest_wait_s < 30
    with conn.cursor() as cur:
        assert before <= segments.arrivals(cur, [(0, 2)])[(0, 2)] <= datetime.now(UTC)

    # a landing folder: a file's modification time; files not indexed yet count, estimated
    folder = tmp_path / "landing"
    folder.mkdir()
    landing = LandingFolder(topic="landed", path=str(folder), settle_s=0.0)
    land_pipeline = _named("landed", landing)
    register(conn, land_pipeline, create_source=True)
    path = folder / "a.jsonl"
    path.write_text("".join(f'{{"n": {i}}}\n' for i in range(100)))
    landed_at = time.time() - 42
    os.utime(path, (landed_at, landed_at))
    seen = _look(conn, land_pipeline)
    assert seen.unread >= 1 and 41 <= seen.oldest_wait_s < 80  # not indexed: the listing
    assert table(conn, "SELECT count(*) FROM landing_files") == [(0,)]  # nothing indexed
    begin(conn, land_pipeline, "land-1")  # indexes and plans the 100 records
    more = folder / "b.jsonl"
    more.write_text("".join(f'{{"n": {i}}}\n' for i in range(10)))
    os.utime(more, (landed_at + 10, landed_at + 10))
    with conn.cursor() as cur:
        landing.index(cur)
        arrived = landing.arrivals(cur, [(0, 0), (0, 105)])
    conn.commit()
    assert arrived[(0, 0)].timestamp() == pytest.approx(landed_at, abs=0.01)
    assert arrived[(0, 105)].timestamp() == pytest.approx(landed_at + 10, abs=0.01)
    seen = _look(conn, land_pipeline)
    assert seen.unread == 10 and 31 <= seen.oldest_wait_s < 70

    # a user's table: its time column, or when the watcher first saw its head
    with psycopg2.connect(dsn) as c, c.cursor() as cur:
        cur.execute("""CREATE TABLE events (id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY
                       KEY, url text, at timestamptz NOT NULL)""")
        cur.execute("INSERT INTO events (url, at) SELECT 'u', now() - interval '1 hour' "
                    "FROM generate_series(1, 5)")
    c.close()
    timed = TableSource(topic="events_t", table="events", key="id", time_column="at")
    by_sight = TableSource(topic="events_s", table="events", key="id")
    timed_pipeline = _named("timed", timed)
    sight_pipeline = _named("sighted", by_sight)
    for pipeline in (timed_pipeline, sight_pipeline):
        register(conn, pipeline, create_source=True)
    seen = _look(conn, timed_pipeline)
    assert seen.unread == 5 and 3590 <= seen.oldest_wait_s < 3700
    seen = _look(conn, sight_pipeline)
    assert seen.unread == 5 and seen.oldest_wait_s < 30  # first seen by this look
    assert table(conn, "SELECT partition, head FROM source_sightings WHERE topic = "
                       "'events_s'") == [(0, 6)]
    batch = begin(conn, sight_pipeline, "sight-1")
    assert table(conn, "SELECT first_arrival IS NOT NULL FROM transactions t WHERE "
                       "pipeline = %s AND txid = %s", (sight_pipeline.name, batch.attempt.txid)
                 ) == [(True,)]
