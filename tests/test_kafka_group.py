"""``KafkaSource(commit_to_kafka=True)``: after each commit the offsets PostgreSQL committed
are written to the pipeline's consumer group, so Kafka's own lag tools see the pipeline.
Against the Tansu broker of tests/kafka_broker.py; the group's offsets are read back with
confluent-kafka's own ``Consumer.committed`` (no onceflow code) and compared with
PostgreSQL's and with the oracle's ends (the broker's acknowledgements of what the test
produced)."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal

import pytest
import test_kafka_source
from test_kafka_source import TOPIC, assert_exact, committed_offsets, ends, register_views
from test_outside_pipeline import payloads

from helpers import run_transaction
from onceflow.core.begin import begin
from onceflow.core.commit import commit
from onceflow.kvstate import open_state_provider

broker = test_kafka_source.broker  # the fixture
views = test_kafka_source.views  # the fixture


def group_offsets(broker, group: str, partitions: int = 3) -> dict[int, int]:
    """The group's committed offsets as Kafka answers them (-1001: none committed)."""
    from confluent_kafka import Consumer, TopicPartition

    reader = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": group,
                       "enable.auto.commit": False})
    try:
        found = reader.committed([TopicPartition(TOPIC, p) for p in range(partitions)],
                                 timeout=10)
    finally:
        reader.close()
    return {tp.partition: tp.offset for tp in found}


def test_each_commit_writes_the_committed_offsets_to_the_group(views, broker, dsn, conn,
                                                               spark):
    """The group follows PostgreSQL commit by commit, never ahead of it: a crash after the
    PostgreSQL commit and before the offsets reach Kafka leaves the group behind until the
    commit's retry writes them; a broker that does not answer then does not undo the commit
    (logged), and the next commit writes the newer offsets. The end: the group's offsets are
    the oracle's ends and the counts are exact."""
    pipeline = dataclasses.replace(
        views, batch_size=120, source=dataclasses.replace(views.source, commit_to_kafka=True))
    group = "onceflow-kafka_views"
    register_views(conn, pipeline)
    produced = broker.produce(TOPIC, payloads(300, seed=21), partitions=3)
    assert group_offsets(broker, group) == {0: -1001, 1: -1001, 2: -1001}  # none yet

    run_transaction(spark, dsn, conn, pipeline, "r1")
    assert committed_offsets(conn) == {0: 40, 1: 40, 2: 40}
    assert group_offsets(broker, group) == committed_offsets(conn)

    # a crash after the PostgreSQL commit, before the Kafka offset commit
    from onceflow.spark.processing import process_batch

    class Crash(Exception):
        pass

    def crash_after_commit(step: str) -> None:
        if step == "staging":
            raise Crash(step)

    batch = begin(conn, pipeline, "r2")
    process_batch(spark, dsn, pipeline, batch.attempt, 0)
    with pytest.raises(Crash):
        commit(conn, pipeline, batch.attempt, on_step=crash_after_commit,
               open_state=open_state_provider)
    in_pg = committed_offsets(conn)
    assert in_pg != {0: 40, 1: 40, 2: 40}  # the crash came after PostgreSQL's commit
    assert group_offsets(broker, group) == {0: 40, 1: 40, 2: 40}  # behind, not ahead
    again = commit(conn, pipeline, batch.attempt, open_state=open_state_provider)  # a retry
    assert again.status == "already_committed"
    assert group_offsets(broker, group) == in_pg

    # the broker does not answer the offset commit: the commit stands, the group stays behind
    # (the commit itself asks the broker for its log starts: it is paused after the commit)
    def pause_after_commit(step: str) -> None:
        if step == "staging":
            os.kill(broker.proc.pid, signal.SIGSTOP)

    batch = begin(conn, pipeline, "r3")
    process_batch(spark, dsn, pipeline, batch.attempt, 0)
    # the source's own logger, heard directly: what configured logging before in this process
    # (an Airflow's dictConfig disables the loggers that exist then) decides where the root's
    # output goes, and whether this logger is on
    heard: list[str] = []
    ear = logging.Handler(logging.WARNING)
    ear.emit = lambda record: heard.append(record.getMessage())
    source_log = logging.getLogger("onceflow.sources.kafka")
    source_log.addHandler(ear)
    was_disabled, source_log.disabled = source_log.disabled, False
    was_level = source_log.level
    source_log.setLevel(logging.WARNING)  # a level set on "onceflow" before would drop it
    try:
        done = commit(conn, pipeline, batch.attempt, on_step=pause_after_commit,
                      open_state=open_state_provider)
    finally:
        os.kill(broker.proc.pid, signal.SIGCONT)
        source_log.removeHandler(ear)
        source_log.disabled = was_disabled
        source_log.setLevel(was_level)
    assert done.status == "committed"
    assert any("the offsets committed in PostgreSQL were not written to Kafka consumer group "
               "'onceflow-kafka_views'" in line for line in heard), heard
    assert group_offsets(broker, group) == in_pg != committed_offsets(conn)

    for i in range(4, 10):  # the rest, then the failures' replays
        batch, _ = run_transaction(spark, dsn, conn, pipeline, f"r{i}")
        assert group_offsets(broker, group) == committed_offsets(conn)
        if batch.records + batch.replayed == 0:
            break
    assert_exact(conn, produced)
    assert group_offsets(broker, group) == committed_offsets(conn) == ends(produced)


def test_the_group_is_configurable_and_off_by_default(views, broker, dsn, conn, spark):
    """Without commit_to_kafka nothing is written to Kafka; group_id names the group."""
    register_views(conn, views)
    produced = broker.produce(TOPIC, payloads(60, seed=22), partitions=3)
    run_transaction(spark, dsn, conn, views, "r1")
    assert group_offsets(broker, "onceflow-kafka_views") == {0: -1001, 1: -1001, 2: -1001}
    mine = dataclasses.replace(views, source=dataclasses.replace(
        views.source, commit_to_kafka=True, group_id="views-lag"))
    run_transaction(spark, dsn, conn, mine, "r2")  # (the first batch's failures replayed)
    assert group_offsets(broker, "views-lag") == committed_offsets(conn) == ends(produced)
    assert group_offsets(broker, "onceflow-kafka_views") == {0: -1001, 1: -1001, 2: -1001}
