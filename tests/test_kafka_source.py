"""The Kafka source against a Kafka-protocol broker the test starts (Tansu, memory storage;
tests/kafka_broker.py), read with confluent-kafka, exact against an oracle that counts from
the records the test produced (the broker's acknowledgements: partition, offset, value).

A user's own pipeline (tests/outside/pageviews/kafka.py) through its Airflow DAG and through
the library path; then the PartitionManager's cases: start policies, transaction markers in
the ranges, a broker that lost data (killed and restarted: memory storage), a broker that
stops answering (SIGSTOP) and comes back, a topic with more partitions, and bad input.
Tansu cannot add partitions (CreatePartitions): a topic re-created with more partitions and
the same records stands for partitions added (the source cannot tell them apart). Records
deleted by retention: tests/test_kafka_retention.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import pytest
from kafka_broker import Tansu
from test_outside_pipeline import oracle, payloads

from helpers import outside_pipeline, run_transaction, table
from onceflow.core.begin import begin
from onceflow.core.errors import ConfigError
from onceflow.sources.kafka import KafkaDataLost, KafkaSource, KafkaUnreachable

REF = "pageviews.kafka:KAFKA_VIEWS"
TOPIC = "page_views"


@pytest.fixture
def broker(tmp_path, monkeypatch):
    b = Tansu(tmp_path).start()
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA_DEFAULT", b.conn_json())
    try:
        yield b
    finally:
        if b.proc is not None and b.proc.poll() is None:
            os.kill(b.proc.pid, signal.SIGCONT)  # a test that paused it
        b.stop()


@pytest.fixture
def views(broker, monkeypatch):
    """The user's Kafka pipeline, reachable by reference; its topic of 3 partitions."""
    broker.create_topic(TOPIC, 3)
    with outside_pipeline(monkeypatch, REF):
        from onceflow.core.registry import get_pipeline

        yield get_pipeline("kafka_views")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onceflow.cli", *args], capture_output=True,
                          text=True, timeout=300)


def assert_exact(conn, produced: list[tuple[int, int, str]]) -> None:
    """The committed counts are the oracle's, from the produced values alone."""
    countries, pages, rejected, failing = oracle([v for _, _, v in produced])
    assert dict(table(conn, "SELECT key, value FROM views_per_country")) == dict(countries)
    assert dict(table(conn, "SELECT key, value FROM views_per_page")) == dict(pages)
    assert table(conn, "SELECT count(*) FROM rejected_records") == [(rejected,)]
    parked = table(conn, "SELECT count(*) FROM backflow_items")[0][0] + \
        table(conn, "SELECT count(*) FROM dead_letters")[0][0]
    assert parked == failing


def committed_offsets(conn) -> dict[int, int]:
    return dict(table(conn, """SELECT partition, "offset" FROM partition_offsets
                               WHERE pipeline = 'kafka_views'"""))


def ends(produced) -> dict[int, int]:
    out: dict[int, int] = {}
    for p, o, _ in produced:
        out[p] = max(out.get(p, 0), o + 1)
    return out


def test_a_kafka_pipeline_runs_through_its_dag_exactly_once(views, broker, dsn, conn,
                                                            airflow_db, warm_spark):
    """Through the DAG on the warm Spark: plain records and a committed transaction's
    (its markers take offsets the reader passes by position), failed records replayed from
    the backflow with their key and headers; then verify and status per partition."""
    from onceflow.airflow import transaction_dag

    done = cli("init", "--pipeline", "kafka_views")
    assert done.returncode == 0, done.stderr
    produced = broker.produce(TOPIC, payloads(240, seed=3), partitions=3)
    produced += broker.produce(TOPIC, payloads(60, seed=4), partitions=3,
                               transactional_id="views-tx")
    marked = {p: o for p, o in ends(produced).items()}
    dag = transaction_dag(views)
    base = datetime.now(UTC).replace(microsecond=0)
    for i in range(3):  # 300 records and the failures' replays, in batches of 150
        dr = dag.test(logical_date=base + timedelta(seconds=i))
        assert str(dr.state) == "success"
    assert_exact(conn, produced)
    # each partition's commit marker is one offset past its last record: committed past it
    positions = views.source.positions(None)
    assert {p: pos.head for p, pos in positions.items()} == {p: o + 1 for p, o in
                                                            marked.items()}
    assert committed_offsets(conn) == {p: pos.head for p, pos in positions.items()}

    verified = cli("verify", "--pipeline", "kafka_views")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    status = cli("status", "--pipeline", "kafka_views")
    assert status.returncode == 0, status.stderr
    for p, pos in positions.items():
        assert f"p{p}: log_start=0 head={pos.head} committed={pos.head} lag=0" in status.stdout
    assert "gaps (records gone before they were read): none" in status.stdout


def test_the_library_path_reads_key_timestamp_and_headers(broker, dsn, conn, spark,
                                                          monkeypatch):
    """run_batches on a SparkSession, the source read in chunks of 10 offsets: the record's
    key, timestamp and headers are columns beside the decoded json_schema's."""
    from onceflow.core.planner import PartitionRange
    from onceflow.spark.loop import run_batches
    from onceflow.spark.records import batch_records

    broker.create_topic("events", 2)
    produced = broker.produce("events", [json.dumps({"n": i}) for i in range(50)],
                              partitions=2)
    with outside_pipeline(monkeypatch, "pageviews.kafka:EVENTS", conn, "events") as pipeline:
        done = run_batches(spark, dsn, pipeline, in_flight=2)
        assert done.records == 50 and done.committed[:2] == [1, 2]
        assert dict(table(conn, "SELECT key, value FROM by_key")) == \
            {f"k{i}:n={i}": 1 for i in range(50)}
        rows = batch_records(spark, dsn, pipeline.source,
                             [PartitionRange(1, 0, 2)]).collect()
    assert [(r.offset, r.n, r.kafka_key, json.loads(r.kafka_headers)) for r in rows] \
        == [(0, 1, "k1", [["n", "1"]]), (1, 3, "k3", [["n", "3"]])]
    assert all(abs((r.kafka_timestamp - datetime.now()).total_seconds()) < 600 for r in rows)
    # The backflow's reads by position: exactly the positions asked, from the ranges that
    # cover them (neighbours in one range, a far one alone, a deleted one absent).
    from onceflow.sources.kafka_read import NEAR, covering

    assert covering([(0, 3), (0, 1), (1, 4), (0, 1 + NEAR), (0, 2 + 2 * NEAR)]) == [
        PartitionRange(0, 1, 2 + NEAR), PartitionRange(0, 2 + 2 * NEAR, 3 + 2 * NEAR),
        PartitionRange(1, 4, 5)]
    at = [(0, 3), (0, 20), (1, 0), (1, 24)]
    assert pipeline.source.payloads_at(None, at) == {
        (p, o): v for p, o, v in produced if (p, o) in at}
    assert committed_offsets_of(conn, "events") == ends(produced)


def committed_offsets_of(conn, pipeline: str) -> dict[int, int]:
    return dict(table(conn, 'SELECT partition, "offset" FROM partition_offsets '
                            "WHERE pipeline = %s", (pipeline,)))


def transactions(conn) -> list[tuple]:
    return table(conn, "SELECT txid, state FROM transactions WHERE pipeline = 'kafka_views' "
                       "ORDER BY txid")


def shrink_after_a_read(broker, conn) -> None:
    """As if kafka_views had read partition 2 up to offset 5, then the topic (memory storage,
    the broker restarted) made again with two partitions."""
    with conn.cursor() as cur:
        cur.execute("""INSERT INTO partition_offsets (pipeline, instance_id, topic, partition,
                           "offset", txid)
                       SELECT name, instance_id, topic, 2, 5, 1 FROM pipelines
                       WHERE name = 'kafka_views'""")
    conn.commit()
    broker.kill()
    broker.start()
    broker.create_topic(TOPIC, 2)


def register_views(conn, pipeline):
    from onceflow.core.registration import register

    register(conn, pipeline, create_source=True)
    return pipeline


def test_a_broker_killed_mid_batch_lost_its_data_and_is_refused(views, broker, dsn, conn,
                                                                spark):
    """Memory storage: SIGKILL and a restart lose every record. The batch planned before is
    refused as it is read, the next begin refuses to plan, nothing is committed, and status
    says what was lost and the fix."""
    register_views(conn, views)
    produced = broker.produce(TOPIC, payloads(300, seed=5), partitions=3)
    run_transaction(spark, dsn, conn, views, "r1")  # 150 committed
    before = committed_offsets(conn)
    batch = begin(conn, views, "r2")  # the first batch's failures replayed, then from 50
    assert batch.records + batch.replayed == 150 and {r.start for r, _ in batch.ranges} == {50}
    broker.kill()
    broker.start()  # the same port, empty
    broker.create_topic(TOPIC, 3)
    broker.produce(TOPIC, payloads(30, seed=6), partitions=3)  # 10 per partition: below 50
    from onceflow.spark.processing import process_batch

    with pytest.raises(Exception, match=r"partition \d ends at offset 10, below the planned "
                                        r"end \d+ of \[50, \d+\): the broker lost records"):
        process_batch(spark, dsn, views, batch.attempt, 0)
    with pytest.raises(KafkaDataLost, match=r"pipeline 'kafka_views', Kafka topic "
                                            r"'page_views' on 'kafka_default': the broker lost "
                                            r"committed records \(partition 0 ends at 10, below "
                                            r"the committed offset 50"):
        begin(conn, views, "r3")
    assert committed_offsets(conn) == before == {0: 50, 1: 50, 2: 50}
    assert [s for _, s in transactions(conn)][0] == "committed"
    assert len([s for _, s in transactions(conn) if s == "committed"]) == 1
    status = cli("status", "--pipeline", "kafka_views")
    assert status.returncode == 1, status.stderr  # stalled until someone acts
    said = " ".join(status.stdout.split())  # (the notice is wrapped)
    assert "Kafka topic 'page_views' on 'kafka_default': the broker lost committed records " \
           "(partition 0 ends at 10, below the committed offset 50" in said
    assert "-> Nothing is read or committed until the broker holds them again; to go on from " \
           "what it holds now: onceflow reset --pipeline kafka_views --force-from-start" in said
    assert "p0: log_start=0 head=10 committed=50 lag=-40" in status.stdout
    assert produced  # the oracle of the first 150: exact
    assert sum(dict(table(conn, "SELECT key, value FROM views_per_page")).values()) + \
        table(conn, "SELECT count(*) FROM rejected_records")[0][0] + \
        table(conn, "SELECT count(*) FROM backflow_items")[0][0] + \
        table(conn, "SELECT count(*) FROM dead_letters")[0][0] == 150


def test_a_broker_that_stops_answering_fails_naming_it_then_exactly_once(views, broker, dsn,
                                                                         conn, spark):
    """SIGSTOP: the broker keeps its data but answers nothing. begin fails naming it; once
    it is back, begin plans; stopped again during processing, the task fails naming it; the
    retry (the same attempt) reads the same records and the result is exact."""
    from onceflow.core.commit import commit
    from onceflow.kvstate import open_state_provider
    from onceflow.spark.processing import process_batch

    register_views(conn, views)
    produced = broker.produce(TOPIC, payloads(120, seed=7), partitions=3)
    os.kill(broker.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(KafkaUnreachable, match=rf"Kafka broker {broker.bootstrap} "
                                                   r"\(connection 'kafka_default'\) did not "
                                                   r"answer"):
            begin(conn, views, "r1")
    finally:
        os.kill(broker.proc.pid, signal.SIGCONT)
    assert transactions(conn) == []
    batch = begin(conn, views, "r1")
    assert batch.records == 120
    os.kill(broker.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(Exception, match=rf"Kafka broker {broker.bootstrap} .*did not "
                                            "answer"):
            process_batch(spark, dsn, views, batch.attempt, 0)
    finally:
        os.kill(broker.proc.pid, signal.SIGCONT)
    process_batch(spark, dsn, views, batch.attempt, 0)
    commit(conn, views, batch.attempt, open_state=open_state_provider)
    assert_exact(conn, produced)
    assert committed_offsets(conn) == ends(produced)


@pytest.mark.parametrize("policy", ["latest", "timestamp"])
def test_start_policies(views, broker, dsn, conn, spark, policy):
    """latest: the records produced before the pipeline's first plan are not read;
    timestamp:T: the first record at or after T in each partition."""
    import dataclasses

    old = broker.produce(TOPIC, payloads(30, seed=8), partitions=3)
    when = None
    if policy == "timestamp":
        time.sleep(1.2)
        when = datetime.now(UTC)
        time.sleep(0.2)
        old += broker.produce(TOPIC, payloads(30, seed=9), partitions=3)
        pipeline = dataclasses.replace(views, start_policy=f"timestamp:{when.isoformat()}")
    else:
        pipeline = dataclasses.replace(views, start_policy="latest")
    register_views(conn, pipeline)
    batch, _ = run_transaction(spark, dsn, conn, pipeline, "r1")
    new = broker.produce(TOPIC, payloads(60, seed=10), partitions=3)
    run_transaction(spark, dsn, conn, pipeline, "r2")
    if policy == "latest":
        assert batch.records == 0
        assert_exact(conn, new)
        assert committed_offsets(conn) == {0: 30, 1: 30, 2: 30}
    else:
        assert batch.records == 30 and {r.start for r, _ in batch.ranges} == {10}
        assert_exact(conn, [r for r in old if r[1] >= 10] + new)
        assert committed_offsets(conn) == {0: 40, 1: 40, 2: 40}


def test_a_topic_with_more_partitions_is_read_from_each_new_ones_start(views, broker, dsn,
                                                                      conn, spark):
    """Tansu cannot add partitions: the topic is re-created with 4 partitions and the same
    records in the first 3 (what the source sees of partitions added). The new partition is
    read from its start; the result is exact over every record."""
    register_views(conn, views)
    values = payloads(90, seed=11)
    first = broker.produce(TOPIC, values, partitions=3)
    run_transaction(spark, dsn, conn, views, "r1")
    run_transaction(spark, dsn, conn, views, "r2")
    assert committed_offsets(conn) == {0: 30, 1: 30, 2: 30}
    broker.kill()
    broker.start()
    broker.create_topic(TOPIC, 4)
    assert broker.produce(TOPIC, values, partitions=3) == first
    added = broker.produce(TOPIC, payloads(40, seed=12), partitions=4)
    ensure = cli("init", "--pipeline", "kafka_views")
    assert ensure.returncode == 0, ensure.stderr
    batch, _ = run_transaction(spark, dsn, conn, views, "r3")
    assert {r.partition: r.start for r, _ in batch.ranges if r.size}[3] == 0
    assert_exact(conn, first + added)
    assert committed_offsets(conn) == {0: 40, 1: 40, 2: 40, 3: 10}


def test_bad_input_is_refused_with_the_field_and_the_fix(broker, dsn, monkeypatch, conn):
    """A missing topic, a connection without bootstrap servers, a topic that shrank: refused
    by `onceflow init` (exit 2) naming the field and the fix."""
    with outside_pipeline(monkeypatch, REF):
        missing = cli("init", "--pipeline", "kafka_views")
        assert missing.returncode == 2
        assert "source.topic='page_views': the Kafka broker" in missing.stderr
        assert "has no such topic" in missing.stderr and "Traceback" not in missing.stderr

        broker.create_topic(TOPIC, 3)
        assert cli("init", "--pipeline", "kafka_views").returncode == 0
        shrink_after_a_read(broker, conn)
        shrunk = cli("init", "--pipeline", "kafka_views")
        assert shrunk.returncode == 2
        assert "has 2 partitions now, but partitions [2] were read before" in shrunk.stderr

        monkeypatch.setenv("AIRFLOW_CONN_KAFKA_DEFAULT",
                           json.dumps({"conn_type": "kafka", "extra": {"group.id": "g"}}))
        nobootstrap = cli("init", "--pipeline", "kafka_views")
        assert nobootstrap.returncode == 2
        assert "source.conn_id='kafka_default': the connection's extra has no " \
               "'bootstrap.servers'" in nobootstrap.stderr
    with pytest.raises(ConfigError, match=r"source.json_schema: column 'kafka_key'"):
        KafkaSource(topic="t", json_schema="kafka_key string").validate()


def test_a_kafka_topic_named_as_a_log_topic_is_checked_against_its_own_pipelines(
        views, broker, dsn, conn, spark):
    """A team that produced its events to onceflow's log under the topic's own name, then
    reads the topic from Kafka: the log pipeline's committed offsets (five partitions, past
    the Kafka topic's ends) are not the Kafka topic's. Neither "partitions read before" at
    registration nor "the broker lost committed records" at begin: the Kafka pipeline commits
    exactly, and each pipeline is stored with its source."""
    import dataclasses

    from helpers import another, produce, tweets_events
    from onceflow.core.registration import register
    from onceflow.core.registry import get_pipeline

    tweets = get_pipeline("tweets")
    log_views = another(tweets, "log_views", batch_size=1000, source=dataclasses.replace(
        tweets.source, topic=TOPIC, partitions=5))
    register(conn, log_views, create_source=True)
    produce(conn, TOPIC, tweets_events(1000, malformed_share=0, poison_share=0, flaky_share=0))
    run_transaction(spark, dsn, conn, log_views, "log-1")
    read = committed_offsets_of(conn, "log_views")
    assert set(read) == {0, 1, 2, 3, 4} and min(read.values()) > 30, read

    register_views(conn, views)  # three partitions: 3 and 4 were read only by the log
    produced = broker.produce(TOPIC, payloads(90, seed=9), partitions=3)  # 30 each
    run_transaction(spark, dsn, conn, views, "kafka-1")
    assert committed_offsets(conn) == ends(produced) == {0: 30, 1: 30, 2: 30}
    assert_exact(conn, produced)
    assert committed_offsets_of(conn, "log_views") == read
    assert table(conn, "SELECT name, source FROM pipelines ORDER BY name") == [
        ("kafka_views", "kafka:kafka_default"), ("log_views", "postgres-log")]
    status = cli("status", "--pipeline", "kafka_views")
    assert status.returncode == 0, status.stdout + status.stderr
    assert "lost" not in status.stdout


def test_a_begin_looks_at_the_broker_with_one_lookup_and_one_client_of_each_kind(
        broker, dsn, conn, monkeypatch):
    """A begin on a topic of 8 partitions with a timestamp start policy: the connection is
    looked up once, one admin client and one consumer are made (the offsets by time of all
    partitions in one request), and the plan starts at each partition's first record at or
    after T. Counted at the Airflow hook and at the source's client factories (every
    confluent-kafka client it makes is made there)."""
    import dataclasses

    from airflow.providers.apache.kafka.hooks.base import KafkaBaseHook

    from onceflow.sources import kafka

    broker.create_topic("events", 8)
    broker.produce("events", [json.dumps({"n": i}) for i in range(16)], partitions=8)
    time.sleep(1.2)
    when = datetime.now(UTC)
    time.sleep(0.2)
    after = broker.produce("events", [json.dumps({"n": i}) for i in range(16)], partitions=8)
    made: list[str] = []

    def counted(name, real):
        def make(*args, **kwargs):
            made.append(name)
            return real(*args, **kwargs)
        return make

    lookup = KafkaBaseHook.get_connection
    with outside_pipeline(monkeypatch, "pageviews.kafka:EVENTS", conn, "events") as pipeline:
        pipeline = dataclasses.replace(pipeline, start_policy=f"timestamp:{when.isoformat()}")
        monkeypatch.setattr(KafkaBaseHook, "get_connection", classmethod(
            lambda cls, conn_id: made.append("lookup") or lookup(conn_id)))
        monkeypatch.setattr(kafka, "consumer", counted("Consumer", kafka.consumer))
        monkeypatch.setattr(kafka, "admin", counted("AdminClient", kafka.admin))
        batch = begin(conn, pipeline, "r1")
    assert sorted(made) == ["AdminClient", "Consumer", "lookup"]
    assert batch.records == 16
    assert sorted((r.partition, r.start, r.end) for r, _ in batch.ranges) == \
        [(p, min(o for q, o, _ in after if q == p), ends(after)[p]) for p in range(8)]


def test_status_names_a_kafka_txids_planned_count_offsets(broker, dsn, conn, monkeypatch):
    """A Kafka txid's planned count is of offsets (a commit marker takes one and holds no
    record): `onceflow status` heads that column "offsets", a PostgreSQL log's "records"."""
    from onceflow.core.planner import PartitionRange
    from onceflow.ops.status import pipeline_status, render

    broker.create_topic("events", 2)
    produced = broker.produce("events", [json.dumps({"n": i}) for i in range(6)],
                              partitions=2, transactional_id="events-tx")
    with outside_pipeline(monkeypatch, "pageviews.kafka:EVENTS", conn, "events") as pipeline:
        batch = begin(conn, pipeline, "r1")
        with conn.cursor() as cur:
            lines = render(pipeline_status(cur, pipeline.source, "events"))
        conn.rollback()
        read = list(pipeline.source.payloads(conn, [PartitionRange(r.partition, r.start, r.end)
                                                   for r, _ in batch.ranges]))
    offsets = sum(end + 1 for end in ends(produced).values())  # each partition's marker
    assert batch.records == offsets == 8 and len(read) == len(produced) == 6
    header = next(line for line in lines if line.lstrip().startswith("txid"))
    assert header.split()[5] == "offsets"
    assert any(line.split()[:3] == ["1", "1", "planned"] and line.split()[5] == "8"
               for line in lines)
