"""The tweets demo's Kafka side (`bash run.sh demo --source kafka`, whose DAG runs are the
demo's own): without a Kafka connection it starts a test broker, says so, and stops it at
the end; with one it uses it and starts nothing; `produce` without one is refused. The
tweets it produces are counted on the broker by the test's own client."""

from __future__ import annotations

import json
import socket

import pytest
from kafka_broker import Tansu

from onceflow.core.errors import ConfigError
from tweets_example import demo
from tweets_example.data import generate


def _args(*argv: str):
    args = demo.build_parser().parse_args(["--source", "kafka", *argv])
    args.pipeline = demo.SOURCES[args.source]
    return args


def _ends(bootstrap: str, topic: str) -> dict[int, int]:
    from confluent_kafka import Consumer, TopicPartition

    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": "oracle"})
    try:
        meta = reader.list_topics(topic, timeout=10).topics[topic]
        return {p: reader.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                for p in meta.partitions}
    finally:
        reader.close()


def test_without_a_connection_the_demo_starts_a_test_broker_and_says_so(monkeypatch, capsys):
    monkeypatch.delenv("AIRFLOW_CONN_KAFKA_DEFAULT", raising=False)
    with pytest.raises(ConfigError, match=r"no Airflow connection 'kafka_default' is "
                                          r"configured: set AIRFLOW_CONN_KAFKA_DEFAULT"), \
            demo._kafka(_args(), throwaway_ok=False):
        pass  # (tweets-demo produce: a broker that stops at its end would keep nothing)
    with demo._kafka(_args(), throwaway_ok=True) as kafka:
        said = " ".join(capsys.readouterr().out.split())
        bootstrap = kafka["bootstrap.servers"]
        assert f"no Airflow connection 'kafka_default' is configured, so this demo started a " \
               f"throwaway test broker on {bootstrap} (Tansu" in said
        assert "it is stopped, and its records gone, when the demo ends" in said
        assert demo._produce_kafka(kafka, generate(203, seed=1), "tweets_kafka") == 203
        assert "created the topic 'tweets_kafka' (4 partitions)" in capsys.readouterr().out
        assert _ends(bootstrap, "tweets_kafka") == {0: 51, 1: 51, 2: 51, 3: 50}
    host, port = bootstrap.split(":")
    with pytest.raises(OSError):  # stopped
        socket.create_connection((host, int(port)), timeout=1).close()


def test_with_a_connection_the_demo_uses_it(tmp_path, monkeypatch, capsys):
    broker = Tansu(tmp_path).start()
    try:
        monkeypatch.setenv("AIRFLOW_CONN_KAFKA_DEFAULT", json.dumps(
            {"conn_type": "kafka", "extra": {"bootstrap.servers": broker.bootstrap}}))
        with demo._kafka(_args(), throwaway_ok=True) as kafka:
            assert kafka["bootstrap.servers"] == broker.bootstrap
            assert "one_per_batch" not in kafka
            assert demo._produce_kafka(kafka, generate(40, seed=2), "tweets_kafka") == 40
        said = capsys.readouterr().out
        assert f"Kafka: the Airflow connection 'kafka_default' ({broker.bootstrap})" in said
        assert "throwaway" not in said
        # (batched, as for a real Kafka: Tansu reports a batch's records only when the next
        # batch comes, so its end offsets are not a count here; the acknowledgements are)
        ends = _ends(broker.bootstrap, "tweets_kafka")
        assert len(ends) == 4 and all(0 < end <= 10 for end in ends.values()), ends
    finally:
        broker.stop()
