"""A Kafka topic as a source: storm-kafka's PartitionManager, with the committed offsets in
PostgreSQL.

Per partition the coordinator keeps the committed offset (committed with the txid, as for
every source); begin plans ``[start, end)`` from it and the partition's end offset as a
``read_committed`` consumer sees it (the last stable offset: records of open transactions
are not planned). The plan is stored before processing, and a replay reads the same range:
Kafka keeps a record's offset and bytes for as long as retention keeps the record.

Reading needs no Kafka connector jar: the ranges are cut into chunks of at most
``read_chunk`` offsets, spread over as many Spark tasks (``mapInArrow``), each chunk read by
a consumer assigned to its partition, positioned at ``start``, reading until its position
reaches ``end``. Offsets that hold no record (compaction, transaction markers, aborted
records) are normal: a chunk is done by position, not by a record count.

What the PartitionManager's traps become here, each said loudly:

- a planned range whose first records retention deleted: the reader fails the task naming
  the range; the next attempt re-plans from the partition's new log start and the skipped
  offsets are a gap in `onceflow status` (``out_of_range``, as for every source);
- a broker that lost data (end offsets below the committed ones, a topic gone, fewer
  partitions than were read): refused at begin (``KafkaDataLost``), nothing is read or
  committed, until the data is back or the pipeline is reset;
- a broker that does not answer: the task fails naming the broker (retried by Airflow).

The connection is an Airflow connection of the Kafka provider (conn type ``kafka``, default
``kafka_default``; its ``extra`` is the client's configuration), found the way Airflow finds
connections: the metadata database, a secrets backend, or ``AIRFLOW_CONN_KAFKA_DEFAULT``
(JSON, or a URI whose query holds the configuration) outside Airflow. The configuration is
resolved where the batch is planned and travels to the Spark tasks with the reader, like the
coordinator's DSN.

The modules: this one declares the source and plans its batches (a DAG file's parse
imports it); onceflow.sources.kafka_client resolves the connection and makes the
confluent-kafka clients (the client the provider uses, imported inside functions: a team
without Kafka installs nothing more, ``pip install onceflow[kafka]`` brings it);
onceflow.sources.kafka_read reads the ranges, in Spark's tasks and in Python.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar

from onceflow.core.errors import ConfigError, OnceflowError
from onceflow.core.offsets import committed_by_pipeline
from onceflow.core.planner import PartitionRange
from onceflow.core.source import PROBLEM, Position, require_topic
from onceflow.sources.json_records import JsonSchemaSource
from onceflow.sources.kafka_client import (
    DEFAULT_CONN_ID,
    KafkaDataLost,
    KafkaUnreachable,  # noqa: F401 (where the source's errors are imported from)
    admin,
    consumer,
    kafka_config,
    servers,
    text,
    unreachable,
)
from onceflow.sources.pglog import chunk_ranges

log = logging.getLogger(__name__)

CHUNK_SCHEMA = "chunk int, partition int, start long, end long"
# The record's own fields, besides its value (``payload`` or the decoded columns).
META_DDL = "kafka_key string, kafka_timestamp timestamp, kafka_headers string"
META_COLUMNS = ("kafka_key", "kafka_timestamp", "kafka_headers")
# What a begin's look at the broker resolved and made (KafkaSource.planning): the
# connection's configuration, one admin client, one consumer, the partitions and the
# offsets found by time; None outside a begin.
_planning: ContextVar[dict | None] = ContextVar("onceflow_kafka_planning", default=None)
# The admin clients a source watcher keeps from look to look (KafkaSource.watching), each
# with the configuration it was made from; None outside a watcher.
_watching: ContextVar[dict | None] = ContextVar("onceflow_kafka_watching", default=None)


def _reading():
    """onceflow.sources.kafka_read, where records are read: it imports pyarrow at its top."""
    # a DAG file's parse imports this declaration and must load no pyarrow
    from onceflow.sources import kafka_read

    return kafka_read


@dataclass(frozen=True, kw_only=True)
class KafkaSource(JsonSchemaSource):
    """A Kafka topic (see the module docstring).

    ``topic``: the Kafka topic, also the name the coordinator stores; ``conn_id``: the Airflow
    connection of type kafka whose extra is the client's configuration; ``read_chunk``:
    offsets per Spark reader task; ``timeout_s``: how long a request waits for the broker
    before the task fails naming it; ``json_schema``: the values' fields as Spark DDL of
    simple types, decoded as the chunks are read. Besides the value (``payload``, or the
    decoded columns) each record carries ``kafka_key`` (UTF-8 text), ``kafka_timestamp`` and
    ``kafka_headers`` (a JSON array of ``[key, value]`` pairs in order; a Python bolt's
    columns are of simple types). ``commit_to_kafka``: after each commit, the offsets
    PostgreSQL committed are written to the consumer group ``group_id`` (default
    ``onceflow-<pipeline>``), so Kafka's lag tools see the pipeline (see ``after_commit``).
    """

    kind: ClassVar[str] = "kafka"
    planned_counts: ClassVar[str] = "offsets"  # markers and compacted records hold none
    conn_id: str = DEFAULT_CONN_ID
    read_chunk: int = 200_000
    timeout_s: float = 30.0
    commit_to_kafka: bool = False
    group_id: str | None = None

    def validate(self) -> None:
        super().validate()
        require_topic(self.topic, "name the Kafka topic")
        if not isinstance(self.conn_id, str) or not self.conn_id:
            raise ConfigError(f"source.conn_id={self.conn_id!r} is invalid: name an Airflow "
                              f"connection of type kafka (default {DEFAULT_CONN_ID!r})")
        if not isinstance(self.read_chunk, int) or self.read_chunk <= 0:
            raise ConfigError(f"source.read_chunk={self.read_chunk!r} is invalid: give a "
                              "positive number of offsets")
        if not isinstance(self.timeout_s, int | float) or self.timeout_s <= 0:
            raise ConfigError(f"source.timeout_s={self.timeout_s!r} is invalid: give seconds "
                              "> 0")
        if not isinstance(self.commit_to_kafka, bool):
            raise ConfigError(f"source.commit_to_kafka={self.commit_to_kafka!r} is invalid: "
                              "give True or False")
        if self.group_id is not None and (not isinstance(self.group_id, str)
                                          or not self.group_id.strip()):
            raise ConfigError(f"source.group_id={self.group_id!r} is invalid: name the Kafka "
                              "consumer group the committed offsets are written to, or "
                              "leave it out (onceflow-<pipeline>)")
        if self.records is not None:
            clash = [name for name, _ in self.records.columns if name in META_COLUMNS]
            if clash:
                raise ConfigError(f"source.json_schema: column {clash[0]!r} is a name the "
                                  "Kafka source gives the record itself: rename it")

    @property
    def record_ddl(self) -> str:
        return f"{super().record_ddl}, {META_DDL}"

    def config(self) -> dict[str, Any]:
        """The connection's client configuration: looked up once in a begin (planning),
        else at each call, so a long-lived process (the watcher) sees a changed one."""
        return self._kept("config", lambda: kafka_config(self.conn_id))

    def _kept(self, what: str, make):
        """``make()``, made once per begin (see planning) for this connection and topic."""
        kept = _planning.get()
        if kept is None:
            return make()
        key = (what, self.conn_id, self.topic, self.timeout_s)
        if key not in kept:
            kept[key] = make()
        return kept[key]

    def _keep(self, what: str, value) -> None:
        kept = _planning.get()
        if kept is not None:
            kept[(what, self.conn_id, self.topic, self.timeout_s)] = value

    @contextmanager
    def planning(self) -> Iterator[None]:
        """A begin's requests to the broker share the connection's configuration, looked up
        once, and one admin client and one consumer, closed when the begin ends (a client
        per request would connect to the broker for each)."""
        if _planning.get() is not None:
            yield
            return
        kept: dict = {}
        token = _planning.set(kept)
        try:
            yield
        finally:
            _planning.reset(token)
            for (what, *_), client in kept.items():
                if what == "consumer":
                    client.close()

    @contextmanager
    def watching(self) -> Iterator[None]:
        """A watcher's looks share one admin client, made again when the connection's
        configuration (looked up at each look) changed: a look every few seconds would
        otherwise connect to the broker each time."""
        token = _watching.set({})
        try:
            yield
        finally:
            _watching.reset(token)

    def describe(self) -> str:
        return f"kafka topic {self.topic!r} (connection {self.conn_id!r})"

    @property
    def identity(self) -> str:
        return f"{self.kind}:{self.conn_id}"

    # -- where the topic is ----------------------------------------------------------------
    def _admin(self, config: Mapping[str, Any]):
        return self._kept("admin", lambda: self._watched_admin(config))

    def _watched_admin(self, config: Mapping[str, Any]):
        held = _watching.get()
        if held is None:
            return admin(config, self.timeout_s)
        key, made_from = (self.conn_id, self.topic, self.timeout_s), repr(sorted(config.items()))
        if key not in held or held[key][0] != made_from:
            held[key] = (made_from, admin(config, self.timeout_s))
        return held[key][1]

    def _partitions(self, admin, config) -> list[int] | None:
        """The topic's partitions, None when the broker does not know the topic."""
        # confluent_kafka: the optional `kafka` extra
        from confluent_kafka import KafkaError, KafkaException

        try:
            # every topic's metadata: a request naming the topic may make a broker create it
            metadata = admin.list_topics(timeout=self.timeout_s)
        except KafkaException as error:
            raise unreachable(config, self.conn_id, "a metadata request", error.args[0],
                               self.timeout_s) from None
        found = metadata.topics.get(self.topic)
        if found is None or (found.error is not None and found.error.code() in (
                KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC)):
            return None
        if found.error is not None:
            raise unreachable(config, self.conn_id, "a metadata request", found.error,
                               self.timeout_s)
        return sorted(found.partitions)

    def _watermarks(self, admin, config, partitions: list[int]) -> dict[int, Position]:
        # confluent_kafka: the optional `kafka` extra
      
        # confluent_kafka: the optional `kafka` extra
        from confluent_kafka import IsolationLevel, KafkaException, TopicPartition
        from confluent_kafka.admin import OffsetSpec

        out: dict[str, dict[int, int]] = {}
        for name, spec in (("earliest", OffsetSpec.earliest()), ("latest", OffsetSpec.latest())):
            futures = admin.list_offsets(
                {TopicPartition(self.topic, p): spec for p in partitions},
                isolation_level=IsolationLevel.READ_COMMITTED, request_timeout=self.timeout_s)
            try:
                out[name] = {tp.partition: f.result().offset for tp, f in futures.items()}
            except KafkaException as error:
                raise unreachable(config, self.conn_id, "a list-offsets request",
                                   error.args[0], self.timeout_s) from None
        return {p: Position(out["earliest"][p], out["latest"][p]) for p in partitions}

    def positions(self, cur) -> dict[int, Position]:
        """Per partition (log start, end offset under read_committed), as the broker says.
        A topic the broker does not know has no partitions."""
        config = self.config()
        admin = self._admin(config)
        partitions = self._partitions(admin, config)
        self._keep("partitions", partitions)
        return {} if not partitions else self._watermarks(admin, config, partitions)

    def positions_until(self, cur, enough) -> dict[int, Position]:
        """Positions, refused when the broker holds less than what was committed, or has no
        such topic (a batch planned from nothing would be an empty txid after another)."""
        positions = self.positions(cur)
        lost = self.lost(cur, positions)
        if lost:
            raise KafkaDataLost(" ".join(lost))
        if not positions:
            raise self._no_topic(self.config())
        return positions

    def _no_topic(self, config: Mapping[str, Any]) -> ConfigError:
        return ConfigError(
            f"source.topic={self.topic!r}: the Kafka broker {servers(config)} (connection "
            f"{self.conn_id!r}) has no such topic. Check the name, or create the topic "
            "(onceflow does not create topics in your cluster)")

    def lost(self, cur, positions: Mapping[int, Position]) -> list[str]:
        """What the broker lost: a sentence per pipeline and partition whose committed offset
        is past the end offset (or whose partition is gone), each with the fix."""
        out = []
        for pipeline, done in committed_by_pipeline(cur, self.topic, self.identity).items():
            fix = (f"Nothing is read or committed until the broker holds them again; to go on "
                   f"from what it holds now: onceflow reset --pipeline {pipeline} "
                   "--force-from-start (records counted before are kept)")
            behind = []
            for partition, offset in sorted(done.items()):
                position = positions.get(partition)
                if position is None and offset > 0:
                    behind.append(f"partition {partition} is gone (committed up to {offset})")
                elif position is not None and position.head < offset:
                    behind.append(f"partition {partition} ends at {position.head}, below the "
                                  f"committed offset {offset}")
            if behind:
                where = "the topic is gone" if not positions else "; ".join(behind)
                out.append(f"pipeline {pipeline!r}, Kafka topic {self.topic!r} on "
                           f"{self.conn_id!r}: the broker lost committed records ({where}: a "
                           "restart without its storage, a topic re-created, an unclean "
                           f"leader election). {fix}.")
        return out

    notices_heading: ClassVar[str] = "the Kafka topic needs someone to act"  # (status)

    def notices(self, cur, pipeline: str) -> list[tuple[str, str]]:
        """For `onceflow status`: the broker's data loss, if any (what, fix)."""
        positions = self.positions(cur)
        notes = []
        for sentence in self.lost(cur, positions):
            if sentence.startswith(f"pipeline {pipeline!r}"):
                what, _, fix = sentence.partition(". Nothing")
                notes.append((what + ".", "Nothing" + fix))
        return notes

    def ensure(self, conn, *, create: bool = False) -> None:
        config = self.config()
        admin = self._admin(config)
        partitions = self._partitions(admin, config)
        if not partitions:
            raise self._no_topic(config)
        with conn.cursor() as cur:
            read = {p for done in committed_by_pipeline(cur, self.topic, self.identity).values()
                    for p in done}
        conn.rollback()
        gone = sorted(read - set(partitions))
        if gone:
            raise ConfigError(
                f"source.topic={self.topic!r} has {len(partitions)} partitions now, but "
                f"partitions {gone} were read before: a Kafka topic never shrinks, so this is "
                "another topic of the same name. Restore the topic, or give the pipeline a "
                "new name (or `onceflow reset --force-from-start`)")

    def first_at(self, cur, partition: int, when: datetime, position: Position) -> int:
        """In a begin, one find-offset-by-time request answers every partition positions
        found, asked for the first of them; the others take their answer from it."""
        ms = int(when.timestamp() * 1000)
        found = self._kept(f"times {ms}", lambda: {})
        if partition not in found:
            known = self._kept("partitions", lambda: None) or []
            found.update(self._offsets_for_times(sorted({partition, *known}), ms))
        offset = found[partition]
        return offset if offset >= 0 else position.head

    def _offsets_for_times(self, partitions: list[int], ms: int) -> dict[int, int]:
        # confluent_kafka: the optional `kafka` extra
        from confluent_kafka import KafkaException, TopicPartition

        config = self.config()
        kept = _planning.get() is not None
        reader = self._kept("consumer", lambda: consumer(config, self.timeout_s))
        try:
            found = reader.offsets_for_times(
                [TopicPartition(self.topic, p, ms) for p in partitions], timeout=self.timeout_s)
        except KafkaException as error:
            raise unreachable(config, self.conn_id, "a find-offset-by-time request",
                              error.args[0], self.timeout_s) from None
        finally:
            if not kept:
                reader.close()
        return {tp.partition: tp.offset for tp in found}

    # -- the consumer group (commit_to_kafka) ------------------------------------------------
    def group_of(self, pipeline: str) -> str:
        return self.group_id or f"onceflow-{pipeline}"

    def after_commit(self, conn, pipeline: str) -> None:
        """With ``commit_to_kafka``: write the offsets PostgreSQL has committed for
        ``pipeline`` now to its consumer group, each with the txid that committed it as the
        offset's metadata. They are read after the commit, so the group is never ahead of
        PostgreSQL; writing them again is harmless, so a crash or a broker away before this
        leaves the group behind until the next commit writes the newer offsets (logged, the
        commit stands: PostgreSQL is the truth, the group a copy for Kafka's tools)."""
        if not self.commit_to_kafka:
            return
        with conn.cursor() as cur:
            cur.execute('SELECT partition, "offset", txid FROM partition_offsets '
                        "WHERE pipeline = %s AND topic = %s ORDER BY partition",
                        (pipeline, self.topic))
            done = cur.fetchall()
        conn.rollback()
        if not done:
            return
        group = self.group_of(pipeline)
        try:
            self.write_group_offsets(group, done)
        except OnceflowError as error:
            log.warning("pipeline %s: the offsets committed in PostgreSQL were not written to "
                        "Kafka consumer group %r (%s); the group shows more lag than there is "
                        "until a later commit writes them", pipeline, group, error)

    def write_group_offsets(self, group: str, done: Sequence[tuple[int, int, int]]) -> None:
        """Commit ``(partition, offset, txid)`` to ``group`` (a consumer that is no member:
        Kafka takes such commits for a group nobody consumes in)."""
        # confluent_kafka: the optional `kafka` extra
        from confluent_kafka import KafkaException, TopicPartition

        config = self.config()
        committer = consumer(config, self.timeout_s, group_id=group)
        try:
            wanted = [TopicPartition(self.topic, p, o, metadata=f"onceflow txid={t}")
                      for p, o, t in done]
            try:
                answered = committer.commit(offsets=wanted, asynchronous=False)
            except KafkaException as error:
                raise unreachable(config, self.conn_id, f"an offset commit for group "
                                   f"{group!r}", error.args[0], self.timeout_s) from None
            refused = [tp for tp in answered or [] if tp.error is not None]
            if refused:  # e.g. a group whose members consume: give the pipeline its own
                raise OnceflowError(
                    f"Kafka broker {servers(config)} refused the offsets of group {group!r} "
                    f"(partition {refused[0].partition}: {refused[0].error}): set "
                    "source.group_id to a group no consumer uses")
        finally:
            committer.close()

    # -- reading ---------------------------------------------------------------------------
    def read(self, spark, dsn: str, ranges: Iterable[PartitionRange]):
        pieces = chunk_ranges([r for r in ranges if r.size > 0], self.read_chunk)
        rows = [(i, p, s, e) for i, (p, s, e) in enumerate(pieces)]
        chunks = spark.createDataFrame(rows, CHUNK_SCHEMA)
        if len(rows) > 1:  # the chunks spread over as many Spark tasks (by hash)
            chunks = chunks.repartition(len(rows), "chunk")
        return chunks.mapInArrow(
            _reading().reader(self.config(), self.conn_id, self.topic, self.records,
                              self.max_record_bytes, self.timeout_s), self.read_ddl)

    def payloads(self, conn, ranges: Iterable[PartitionRange]
                 ) -> Iterator[tuple[int, int, str]]:
        for p, o, value, *_ in _reading().records(self.config(), self.conn_id, self.topic,
                                                  self.timeout_s, list(ranges)):
            yield p, o, text(value)

    def payloads_at(self, cur, positions: Iterable[tuple[int, int]]
                    ) -> dict[tuple[int, int], str]:
        return {(p, o): text(value) for p, o, value, *_ in _reading().records_at(
            self.config(), self.conn_id, self.topic, self.timeout_s, positions)}

    def replay_columns(self, rows: Sequence[tuple[int, int, str, int]]):
        """A replayed record's value comes from the backflow; its key, timestamp and headers
        are read again from the broker (null where retention deleted the record since)."""
        body = super().replay_columns(rows)
        wanted = {(r[0], r[1]) for r in rows}
        found = {}
        for p, o, _value, key, ts, headers in _reading().records_at(
                self.config(), self.conn_id, self.topic, self.timeout_s, wanted,
                missing_ok=True):
            found[(p, o)] = (key, ts, headers)
        if len(found) < len(wanted):
            log.warning("kafka topic %r: %d replayed record(s) are no longer on the broker: "
                        "their kafka_key, kafka_timestamp and kafka_headers are null",
                        self.topic, len(wanted) - len(found))
        meta = [found.get((r[0], r[1]), (None, None, None)) for r in rows]
        problem = {PROBLEM: body.pop(PROBLEM)} if PROBLEM in body else {}
        return {**body, **_reading().meta_arrays(meta), **problem}  # in read_ddl's order

