"""Bad input to a Kafka source refused at begin (the Airflow task's first step), each naming
the field and the fix, nothing planned: a topic that is missing (deleted after `onceflow init`,
before anything was read), a connection without bootstrap servers, a topic whose partition
count shrank. The same refused by `onceflow init` with exit 2:
tests/test_kafka_source.py::test_bad_input_is_refused_with_the_field_and_the_fix. Against
the Tansu broker of tests/kafka_broker.py."""

from __future__ import annotations

import json

import pytest
import test_kafka_source
from test_kafka_source import TOPIC, cli, register_views, transactions

from helpers import table
from onceflow.core.begin import begin
from onceflow.core.errors import ConfigError, Permanent
from onceflow.sources.kafka import KafkaDataLost

broker = test_kafka_source.broker  # the fixture
views = test_kafka_source.views  # the fixture


def test_begin_refuses_a_missing_topic_no_bootstrap_servers_and_fewer_partitions(
        views, broker, conn, monkeypatch):
    register_views(conn, views)
    broker.kill()
    broker.start()  # memory storage: the topic is gone
    with pytest.raises(ConfigError, match=r"source.topic='page_views': the Kafka broker "
                                          r"127.0.0.1:\d+ \(connection 'kafka_default'\) has "
                                          r"no such topic. Check the name, or create the "
                                          r"topic"):
        begin(conn, views, "r1")
    assert transactions(conn) == []  # no empty txid planned from nothing

    broker.create_topic(TOPIC, 3)
    test_kafka_source.shrink_after_a_read(broker, conn)
    with pytest.raises(KafkaDataLost, match=r"pipeline 'kafka_views', Kafka topic "
                                            r"'page_views' on 'kafka_default': the broker lost "
                                            r"committed records \(partition 2 is gone "
                                            r"\(committed up to 5\).*onceflow reset --pipeline "
                                            r"kafka_views --force-from-start") as lost:
        begin(conn, views, "r2")
    assert isinstance(lost.value, Permanent)  # the attempt is not retried into the same
    assert transactions(conn) == []
    assert table(conn, 'SELECT partition, "offset" FROM partition_offsets') == [(2, 5)]
    status = cli("status", "--pipeline", "kafka_views")  # in the Kafka source's words
    assert status.returncode == 1, status.stdout + status.stderr
    assert "the Kafka topic needs someone to act:\n  pipeline 'kafka_views', Kafka topic " \
           "'page_views'" in status.stdout
    assert "source files" not in status.stdout

    monkeypatch.setenv("AIRFLOW_CONN_KAFKA_DEFAULT",
                       json.dumps({"conn_type": "kafka", "extra": {"group.id": "g"}}))
    with pytest.raises(ConfigError, match=r"source.conn_id='kafka_default': the connection's "
                                          r"extra has no 'bootstrap.servers' \(it has "
                                          r"\['group.id'\]\): set the client's configuration"):
        begin(conn, views, "r3")
    assert transactions(conn) == []


def test_init_says_a_missing_topic_with_exit_2_and_no_traceback(views, broker, conn):
    """`onceflow init` on a topic the broker lost since: exit 2, the field and the fix."""
    assert cli("init", "--pipeline", "kafka_views").returncode == 0
    broker.kill()
    broker.start()
    refused = cli("init", "--pipeline", "kafka_views")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "source.topic='page_views': the Kafka broker" in refused.stderr
    assert "Check the name, or create the topic" in refused.stderr
    assert "Traceback" not in refused.stderr
