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

confluent-kafka (the client the provider uses) is imported only here, inside functions: a
team without Kafka installs nothing more (``pip install onceflow[kafka]`` brings it).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar

from onceflow.core.errors import ConfigError, OnceflowError, Permanent, SourceShortfall
from onceflow.core.offsets import committed_by_pipeline
from onceflow.core.planner import PartitionRange
from onceflow.core.source import PROBLEM, Position, require_topic
from onceflow.sources.json_records import JsonRecords, JsonSchemaSource
from onceflow.sources.pglog import chunk_ranges

log = logging.getLogger(__name__)

DEFAULT_CONN_ID = "kafka_default"
CHUNK_SCHEMA = "chunk int, partition int, start long, end long"
# The record's own fields, besides its value (``payload`` or the decoded columns).
META_DDL = "kafka_key string, kafka_timestamp timestamp, kafka_headers string"
META_COLUMNS = ("kafka_key", "kafka_timestamp", "kafka_headers")
# Client options onceflow sets itself on every consumer it makes.
_READER = {"enable.auto.commit": False, "enable.auto.offset.store": False,
           "enable.partition.eof": True, "auto.offset.reset": "error",
           "isolation.level": "read_committed"}
# Options that name Python callables: they cannot travel to Spark's executors as text.
_CALLBACKS = ("error_cb", "throttle_cb", "stats_cb", "log_cb", "oauth_cb", "on_commit")


class KafkaUnreachable(OnceflowError, ConnectionError):
    """The broker did not answer within the source's ``timeout_s`` (retried by Airflow)."""


class KafkaDataLost(Permanent):
    """The broker holds less than what was committed: refused until a person decides."""


def _missing_extra() -> ConfigError:
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
        raise _missing_extra() from None
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


def _servers(config: Mapping[str, Any]) -> str:
    return str(config.get("bootstrap.servers"))


def _short_timeout(config: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
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
        raise _missing_extra() from None
    options = {**config, **_short_timeout(config, timeout_s), **_READER}
    options["group.id"] = group_id or config.get("group.id") or "onceflow-reader"
    options.setdefault("logger", logging.getLogger("onceflow.kafka.client"))
    return Consumer(options)


def _unreachable(config: Mapping[str, Any], conn_id: str, what: str, error: object,
                 timeout_s: float) -> KafkaUnreachable:
    return KafkaUnreachable(
        f"Kafka broker {_servers(config)} (connection {conn_id!r}) did not answer {what} "
        f"within {timeout_s:g}s ({error}): check that the broker is up and reachable from "
        "here; the task is retried")


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
        return kafka_config(self.conn_id)

    def describe(self) -> str:
        return f"kafka topic {self.topic!r} (connection {self.conn_id!r})"

    @property
    def identity(self) -> str:
        return f"{self.kind}:{self.conn_id}"

    # -- where the topic is ----------------------------------------------------------------
    def _admin(self, config: Mapping[str, Any]):
        try:
            # confluent_kafka: the optional `kafka` extra
            from confluent_kafka.admin import AdminClient
        except ImportError:
            raise _missing_extra() from None
        return AdminClient({**config, **_short_timeout(config, self.timeout_s),
                            "logger": logging.getLogger("onceflow.kafka.client")})

    def _partitions(self, admin, config) -> list[int] | None:
        """The topic's partitions, None when the broker does not know the topic."""
        # confluent_kafka: the optional `kafka` extra
        from confluent_kafka import KafkaError, KafkaException

        try:
            # every topic's metadata: a request naming the topic may make a broker create it
            metadata = admin.list_topics(timeout=self.timeout_s)
        except KafkaException as error:
            raise _unreachable(config, self.conn_id, "a metadata request", error.args[0],
                               self.timeout_s) from None
        found = metadata.topics.get(self.topic)
        if found is None or (found.error is not None and found.error.code() in (
                KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC)):
            return None
        if found.error is not None:
            raise _unreachable(config, self.conn_id, "a metadata request", found.error,
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
                raise _unreachable(config, self.conn_id, "a list-offsets request",
                                   error.args[0], self.timeout_s) from None
        return {p: Position(out["earliest"][p], out["latest"][p]) for p in partitions}

    def positions(self, cur) -> dict[int, Position]:
        """Per partition (log start, end offset under read_committed), as the broker says.
        A topic the broker does not know has no partitions."""
        config = self.config()
        admin = self._admin(config)
        partitions = self._partitions(admin, config)
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
            f"source.topic={self.topic!r}: the Kafka broker {_servers(config)} (connection "
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
        # confluent_kafka: the optional `kafka` extra
        from confluent_kafka import KafkaException, TopicPartition

        config = self.config()
        reader = consumer(config, self.timeout_s)
        try:
            found = reader.offsets_for_times(
                [TopicPartition(self.topic, partition, int(when.timestamp() * 1000))],
                timeout=self.timeout_s)
        except KafkaException as error:
            raise _unreachable(config, self.conn_id, "a find-offset-by-time request",
                               error.args[0], self.timeout_s) from None
        finally:
            reader.close()
        offset = found[0].offset
        return offset if offset >= 0 else position.head

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
                raise _unreachable(config, self.conn_id, f"an offset commit for group "
                                   f"{group!r}", error.args[0], self.timeout_s) from None
            refused = [tp for tp in answered or [] if tp.error is not None]
            if refused:  # e.g. a group whose members consume: give the pipeline its own
                raise OnceflowError(
                    f"Kafka broker {_servers(config)} refused the offsets of group {group!r} "
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
            _reader(self.config(), self.conn_id, self.topic, self.records,
                    self.max_record_bytes, self.timeout_s), self.read_ddl)

    def _records(self, ranges: Iterable[PartitionRange], *, missing_ok: bool = False
                 ) -> Iterator[tuple]:
        config = self.config()
        reader = consumer(config, self.timeout_s)
        try:
            for r in ranges:
                if r.size > 0:
                    yield from read_range(reader, config, self.conn_id, self.topic,
                                          r.partition, r.start, r.end, self.timeout_s,
                                          missing_ok=missing_ok)
        finally:
            reader.close()

    def payloads(self, conn, ranges: Iterable[PartitionRange]
                 ) -> Iterator[tuple[int, int, str]]:
        for p, o, value, *_ in self._records(list(ranges)):
            yield p, o, _text(value)

    def payloads_at(self, cur, positions: Iterable[tuple[int, int]]
                    ) -> dict[tuple[int, int], str]:
        ranges = [PartitionRange(p, o, o + 1) for p, o in sorted(set(positions))]
        return {(p, o): _text(value) for p, o, value, *_ in self._records(ranges)}

    def replay_columns(self, rows: Sequence[tuple[int, int, str, int]]):
        """A replayed record's value comes from the backflow; its key, timestamp and headers
        are read again from the broker (null where retention deleted the record since)."""
        import pyarrow as pa  # lazy: `import onceflow` loads no pyarrow

        body = super().replay_columns(rows)
        wanted = sorted({(r[0], r[1]) for r in rows})
        found = {}
        for p, o, _value, key, ts, headers in self._records(
                [PartitionRange(p, o, o + 1) for p, o in wanted], missing_ok=True):
            found[(p, o)] = (key, ts, headers)
        if len(found) < len(wanted):
            log.warning("kafka topic %r: %d replayed record(s) are no longer on the broker: "
                        "their kafka_key, kafka_timestamp and kafka_headers are null",
                        self.topic, len(wanted) - len(found))
        meta = [found.get((r[0], r[1]), (None, None, None)) for r in rows]
        problem = {PROBLEM: body.pop(PROBLEM)} if PROBLEM in body else {}
        return {**body, **_meta_arrays(meta, pa), **problem}  # in read_ddl's order


def _text(value: bytes | None) -> str:
    return "" if value is None else value.decode("utf-8", "replace")


def _meta_arrays(meta: Sequence[tuple], pa) -> dict[str, Any]:
    """The kafka_key, kafka_timestamp and kafka_headers columns of ``meta`` rows."""
    return {
        "kafka_key": pa.array([m[0] for m in meta], pa.string()),
        "kafka_timestamp": pa.array([m[1] for m in meta], pa.timestamp("ms", tz="UTC")).cast(
            pa.timestamp("us", tz="UTC")),
        "kafka_headers": pa.array([None if not m[2] else json.dumps(m[2]) for m in meta],
                                  pa.string()),
    }


def read_range(reader, config: Mapping[str, Any], conn_id: str, topic: str, partition: int,
               start: int, end: int, timeout_s: float, *, missing_ok: bool = False
               ) -> Iterator[tuple]:
    """The records of ``[start, end)`` of one partition as (partition, offset, value, key,
    timestamp ms, headers), read by ``reader`` assigned and positioned at ``start`` until
    its position reaches ``end``. Offsets without a record are skipped; a range that cannot
    be read whole fails, naming why (``missing_ok``: gives nothing instead)."""
    # confluent_kafka: the optional `kafka` extra
    from confluent_kafka import KafkaError, KafkaException, TopicPartition

    # The broker's log start and high watermark first: a range it no longer holds whole is
    # named now (some brokers answer a fetch past their end with silence, not an error).
    try:
        low, high = reader.get_watermark_offsets(TopicPartition(topic, partition),
                                                 timeout=timeout_s, cached=False)
    except KafkaException as error:
        code = error.args[0].code()
        if code not in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION,
                        KafkaError._UNKNOWN_TOPIC):
            raise _unreachable(config, conn_id, f"a list-offsets request for partition "
                               f"{partition}", error.args[0], timeout_s) from None
        if missing_ok:
            return
        raise KafkaDataLost(
            f"Kafka topic {topic!r} partition {partition} is gone from the broker "
            f"({error.args[0].str()}) with the planned range [{start}, {end}): the broker lost "
            "the topic (a restart without its storage?). Nothing of this batch is "
            "committed") from None
    if missing_ok and (start < low or end > high):
        return
    if end > high:
        raise KafkaDataLost(
            f"Kafka topic {topic!r} partition {partition} ends at offset {high}, below the "
            f"planned end {end} of [{start}, {end}): the broker lost records of a planned "
            "batch (a restart without its storage?). Nothing of this batch is committed")
    if start < low:
        raise SourceShortfall(
            f"SourceShortfall: Kafka topic {topic!r} partition {partition} offsets [{start}, "
            f"{end}): the log starts at {low}: retention deleted records of a planned batch; "
            "the next attempt re-plans from the log start and records the gap")
    reader.assign([TopicPartition(topic, partition, start)])
    position, quiet_since = start, time.monotonic()
    try:
        while position < end:
            messages = reader.consume(num_messages=min(10_000, end - position), timeout=1.0)
            if messages:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > timeout_s:
                raise _unreachable(config, conn_id, f"a fetch of partition {partition} at "
                                   f"offset {position}", "no records and no end of partition",
                                   timeout_s)
            for m in messages:
                error = m.error()
                if error is None:
                    offset = m.offset()
                    if offset >= end:
                        position = end
                        break
                    if offset >= position:
                        headers = [(k, None if v is None else v.decode("utf-8", "replace"))
                                   for k, v in (m.headers() or [])]
                        key = m.key()
                        yield (partition, offset, m.value(),
                               None if key is None else key.decode("utf-8", "replace"),
                               m.timestamp()[1] if m.timestamp()[0] else None, headers)
                        position = offset + 1
                    continue
                code = error.code()
                if code == KafkaError._PARTITION_EOF:
                    if m.offset() < end:
                        raise KafkaDataLost(
                            f"Kafka topic {topic!r} partition {partition} ends at offset "
                            f"{m.offset()}, below the planned end {end} of [{start}, {end}): "
                            "the broker lost records of a planned batch (a restart without "
                            "its storage?). Nothing of this batch is committed")
                    position = end  # every record below the end was delivered before it
                elif code in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC,
                              KafkaError._UNKNOWN_PARTITION):
                    raise KafkaDataLost(
                        f"Kafka topic {topic!r} partition {partition} is gone from the broker "
                        f"({error.str()}) with the planned range [{start}, {end}): the broker "
                        "lost the topic (a restart without its storage?). Nothing of this "
                        "batch is committed")
                elif code in (KafkaError.OFFSET_OUT_OF_RANGE, KafkaError._AUTO_OFFSET_RESET):
                    low, high = reader.get_watermark_offsets(
                        TopicPartition(topic, partition), timeout=timeout_s, cached=False)
                    if position >= high:
                        raise KafkaDataLost(
                            f"Kafka topic {topic!r} partition {partition} ends at offset "
                            f"{high}, below the planned end {end} of [{start}, {end}): the "
                            "broker lost records of a planned batch (a restart without its "
                            "storage?). Nothing of this batch is committed")
                    raise SourceShortfall(
                        f"SourceShortfall: Kafka topic {topic!r} partition {partition} "
                        f"offsets [{start}, {end}): offset {position} is out of range (the "
                        f"log starts at {low}): retention deleted records of a planned batch; "
                        "the next attempt re-plans from the log start and records the gap")
                elif error.fatal() or not (error.retriable() or code in (
                        KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN,
                        KafkaError._TIMED_OUT, KafkaError._RESOLVE)):
                    raise _unreachable(config, conn_id, f"a fetch of partition {partition}",
                                       error.str(), timeout_s)
    finally:
        reader.unassign()


def _reader(config: dict[str, Any], conn_id: str, topic: str, records: JsonRecords | None,
            max_bytes: int, timeout_s: float):
    """The Spark task: each chunk row's records, read whole (see read_range), decoded with
    ``records`` when the source declares a schema."""

    def read(batches: Iterator) -> Iterator:
        import pyarrow as pa  # lazy: `import onceflow` loads no pyarrow

        kafka = consumer(config, timeout_s)
        try:
            for batch in batches:
                cols = batch.to_pydict()
                for partition, start, end in zip(cols["partition"], cols["start"], cols["end"],
                                                 strict=True):
                    rows = list(read_range(kafka, config, conn_id, topic, partition, start,
                                           end, timeout_s))
                    for piece in range(0, len(rows), 32_768):
                        yield _batch(rows[piece:piece + 32_768], records, max_bytes, pa)
        finally:
            kafka.close()

    return read


def _batch(rows: list[tuple], records: JsonRecords | None, max_bytes: int, pa):
    """Arrow record batch of read_range rows, in the source's read_ddl order."""
    keys = {"partition": pa.array([r[0] for r in rows], pa.int32()),
            "offset": pa.array([r[1] for r in rows], pa.int64())}
    values = [r[2] for r in rows]
    if records is None:
        body: dict[str, Any] = {"payload": pa.array([_text(v) for v in values], pa.string())}
        problem: dict[str, Any] = {}
    else:
        body, problems = records.decode([v or b"" for v in values], max_bytes)
        problem = {PROBLEM: problems}
    meta = _meta_arrays([(r[3], r[4], r[5]) for r in rows], pa)
    columns = {**keys, **body, **meta, **problem}
    return pa.RecordBatch.from_arrays(list(columns.values()), names=list(columns))

