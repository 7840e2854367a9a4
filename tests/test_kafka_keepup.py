"""``keep_up=True`` on a Kafka topic: the source watcher looks at the partitions' end offsets
and starts the runs, none by hand.

The pipeline (tests/outside/pageviews/kafka.py: KAFKA_KEEPUP, a run once 60 records wait or
the oldest waited 2 s) has its transaction DAG built; the watcher is the trigger that DAG's
Asset carries, rebuilt from what it serializes, as Airflow's triggerer does, and run on an
event loop of the test's own. Each event it yields is one transaction through the library
path (begin as a watcher's run: it plans no empty txid, then process and commit on Spark).
Against the Tansu broker of tests/kafka_broker.py, exact against an oracle that counts from
what the test produced. A real triggerer and scheduler starting such runs are
tests/test_keepup_airflow.py's (on a PostgreSQL log): the watcher is the same code."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import test_kafka_source
from test_kafka_source import assert_exact, committed_offsets_of, ends
from test_outside_pipeline import payloads

from helpers import outside_pipeline, table
from onceflow.core.begin import NothingToPlan, begin
from onceflow.core.commit import commit
from onceflow.kvstate import open_state_provider

REF = "pageviews.kafka:KAFKA_KEEPUP"
TOPIC = "keepup_views"


broker = test_kafka_source.broker  # the fixture


class Watcher:
    """The DAG's source watcher run on an event loop in a thread; its events in a queue."""

    def __init__(self, trigger):
        self.trigger, self.events = trigger, queue.Queue()
        self.loop = asyncio.new_event_loop()
        self.task = None
        self.thread = threading.Thread(target=self._run, name="kafka-watcher", daemon=True)

    def _run(self) -> None:
        async def watch():
            async for event in self.trigger.run():
                self.events.put(event.payload)

        self.task = self.loop.create_task(watch())
        try:
            self.loop.run_until_complete(self.task)
        except asyncio.CancelledError:
            pass
        except BaseException as error:  # noqa: BLE001 (said by the test)
            self.events.put({"error": repr(error)})
        finally:
            self.loop.close()

    def __enter__(self) -> Watcher:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.task is not None:
            self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(30)
        assert not self.thread.is_alive()


def test_produced_records_start_transactions_without_a_manual_run(broker, dsn, conn, spark,
                                                                  monkeypatch):
    """90 records start a run at once (over min_records); 30 more, fewer than min_records,
    start one after max_delay; then the watcher stays quiet. Every transaction comes from an
    event, none is empty, the counts are the oracle's and the committed offsets the broker's
    acknowledged ends. The watcher's looks (each in a thread of its event loop's) share one
    admin client: counted at the source's client factory, where every one is made."""
    from onceflow.airflow import transaction_dag
    from onceflow.airflow.triggers import SourceWatchTrigger
    from onceflow.sources import kafka
    from onceflow.spark.processing import process_batch

    made, looks = [], []

    def counted(real, into):
        def call(*args, **kwargs):
            into.append(threading.current_thread().name)
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(kafka, "admin", counted(kafka.admin, made))
    monkeypatch.setattr(kafka.KafkaSource, "heads",
                        counted(kafka.KafkaSource.heads, looks))
    broker.create_topic(TOPIC, 3)
    with outside_pipeline(monkeypatch, REF):
        from onceflow.core.registration import register
        from onceflow.core.registry import get_pipeline

        pipeline = get_pipeline("kafka_keepup")
        register(conn, pipeline, create_source=True)
        (asset,) = transaction_dag(pipeline).timetable.asset_condition.objects
        (dag_watcher,) = asset.watchers
        classpath, kwargs = dag_watcher.trigger.serialize()
        assert classpath == "onceflow.airflow.triggers.SourceWatchTrigger"
        produced: list[tuple[int, int, str]] = []
        reasons: list[str] = []
        with Watcher(SourceWatchTrigger(**kwargs)) as watcher:
            def run_on_event(timeout_s: float) -> str | None:
                try:
                    event = watcher.events.get(timeout=timeout_s)
                except queue.Empty:
                    return None
                assert "error" not in event, event
                try:
                    batch = begin(conn, pipeline, f"watched-{len(reasons)}", skip_empty=True)
                except NothingToPlan:
                    reasons.append(f"{event['reason']} (nothing)")
                    return event["reason"]
                process_batch(spark, dsn, pipeline, batch.attempt, 0)
                commit(conn, pipeline, batch.attempt, open_state=open_state_provider)
                reasons.append(event["reason"])
                return event["reason"]

            assert run_on_event(3.0) is None  # nothing produced: no event
            produced += broker.produce(TOPIC, payloads(90, seed=31), partitions=3)
            assert run_on_event(30.0) == "records"
            assert committed_offsets_of(conn, "kafka_keepup") == ends(produced)
            produced += broker.produce(TOPIC, payloads(30, seed=32), partitions=3)
            started = time.monotonic()
            assert run_on_event(30.0) == "delay"
            assert time.monotonic() - started >= 1.5  # it waited for max_delay (2 s)
            assert run_on_event(4.0) is None  # caught up: quiet
    assert reasons == ["records", "delay"]
    # the watcher looked many times on one admin client; each begin made its own (main thread)
    watched = [name for name in looks if name != "MainThread"]
    assert len(watched) >= 5, looks
    assert len([name for name in made if name != "MainThread"]) == 1, (made, looks)
    assert committed_offsets_of(conn, "kafka_keepup") == ends(produced)
    assert_exact(conn, produced)
    assert table(conn, "SELECT txid, records FROM transactions WHERE pipeline = "
                       "'kafka_keepup' ORDER BY txid") == [(1, 90), (2, 30)]
