"""The Kafka source's client side: the connection's configuration, the confluent-kafka
clients made from it, and the errors a broker's answers become (onceflow.sources.kafka
declares the source, onceflow.sources.kafka_read reads its ranges in Spark's tasks).

The connection is an Airflow connection of the Kafka provider (conn type ``kafka``, default
``kafka_default``; its ``extra`` is the client's configuration), found the way Airflow finds
connections: the metadata database, a secrets backend, or ``AIRFLOW_CONN_KAFKA_DEFAULT``
(JSON, or a URI whose query holds the configuration) outside Airflow.

confluent-kafka (the client the provider uses) and the provider are imported inside the
functions: a team without Kafka installs nothing more (``pip install onceflow[kafka]``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from onceflow.core.errors import ConfigError, OnceflowError, Permanent

DEFAULT_CONN_ID = "kafka_default"
# Client options onceflow sets itself on every consumer it makes.
_READER = {"enable.auto.commit": False, "enable.auto.offset.store": False,
           "enable.partition.eof": True, "auto.offset.reset": "error",
           "isolation.level": "read_committed"}
# Options that name Python callables: they cannot travel to Spark's executors as text.
_CALLBACKS = ("error_cb", "throttle_cb", "stats_cb", "log_cb", "oauth_cb", "on_commit")
CLIENT_LOG = "onceflow.kafka.client"


class KafkaUnreachable(OnceflowError, ConnectionError):
    """The broker did not answer within the source's ``timeout_s`` (retried by Airflow)."""


class KafkaDataLost(Permanent):
    """The broker holds less than what was committed: refused until a person decides."""


def missing_extra() -> ConfigError:
    return ConfigError(
        "the Kafka source needs confluent-kafka and Airflow's Kafka provider: "
        "pip install 'onceflow[kafka]' (with -c constraints.txt)")


def kafka_config(conn_id: str = DEFAULT_CONN_ID, *, setting: str = "source.conn_id"
                 ) -> dict[str, Any]:
    """The client configuration of the Airflow connection ``conn_id`` (its ``extra``),
    through the Kafka provider's hook, checked: ``bootstrap.servers`` set, no callback."""
    try:  # the Kafka provider: the optional `kafka` extra
        from airflow.providers.apache.kafka.hooks.base import KafkaBaseHook
    except ImportError:
        raise missing_extra() from None
    try:
        conn = KafkaBaseHook.get_connection(conn_id)
    except Exception as error:  # the SDK raises its own not-found type
        raise ConfigError(
            f"{setting}={conn_id!r}: no such connection ({error}). Create the Airflow "
            f"connection of type kafka, e.g. export AIRFLOW_CONN_{conn_id.upper()}="
            "'{\"conn_type\": \"kafka\", \"extra\": {\"bootstrap.servers\": "
            "\"host:9092\"}}'") from None
    config = dict(conn.extra_dejson or {})
    if not config.get("bootstrap.servers"):
        raise ConfigError(
            f"{setting}={conn_id!r}: the connection's extra has no 'bootstrap.servers' (it "
            f"has {sorted(config) or 'nothing'}): set the client's configuration as the "
            "connection's extra, e.g. {\"bootstrap.servers\": \"host:9092\"}")
    given = [key for key in _CALLBACKS if key in config]
    if given:
        raise ConfigError(
            f"{setting}={conn_id!r}: the connection's extra sets {', '.join(given)}, which "
            "names a Python callable; the Kafka source's readers run in Spark's executors "
            "and take text options only: use the client's own options (e.g. "
            "sasl.mechanism with sasl.username / sasl.password)")
    return config


def text(value: bytes | None) -> str:
    """A record's value or key as text (bytes not UTF-8 replaced)."""
    return "" if value is None else value.decode("utf-8", "replace")


def servers(config: Mapping[str, Any]) -> str:
    return str(config.get("bootstrap.servers"))


def short_timeout(config: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
    """Client options bounding how long a request to a broker that is down may take."""
    ms = max(1000, int(timeout_s * 1000))
    return {"socket.timeout.ms": ms, "socket.connection.setup.timeout.ms": ms,
            **({} if "reconnect.backoff.max.ms" in config else
               {"reconnect.backoff.max.ms": 1000})}


def consumer(config: Mapping[str, Any], timeout_s: float, group_id: str | None = None):
    """A consumer that reads by assignment only (no group membership, no offset commits)."""
    try:
        # confluent_kafka: the optional `kafka` extra
        from confluent_kafka import Consumer
    except ImportError:
        raise missing_extra() from None
    options = {**config, **short_timeout(config, timeout_s), **_READER}
    options["group.id"] = group_id or config.get("group.id") or "onceflow-reader"
    options.setdefault("logger", logging.getLogger(CLIENT_LOG))
    return Consumer(options)


def admin(config: Mapping[str, Any], timeout_s: float):
    """An admin client (metadata, list-offsets)."""
    try:
        # confluent_kafka: the optional `kafka` extra
        from confluent_kafka.admin import AdminClient
    except ImportError:
        raise missing_extra() from None
    return AdminClient({**config, **short_timeout(config, timeout_s),
                        "logger": logging.getLogger(CLIENT_LOG)})


def unreachable(config: Mapping[str, Any], conn_id: str, what: str, error: object,
                timeout_s: float) -> KafkaUnreachable:
    return KafkaUnreachable(
        f"Kafka broker {servers(config)} (connection {conn_id!r}) did not answer {what} "
        f"within {timeout_s:g}s ({error}): check that the broker is up and reachable from "
        "here; the task is retried")
