"""Topologies: a pipeline's processing phase as bolts over streams of tuples, under the acker.

A topology reads one spout stream, ``records`` (the batch's source records: partition, offset,
payload), and passes tuples through bolts to sinks:

- ``Topology.bolt(name, input=..., outputs=..., fn=...)``: a DataFrame-level bolt, ``fn(df)``
  runs in the JVM. Its input carries the anchoring columns ``ANCHORS`` (``_root``, ``_tid``,
  ``_replays``); every output row must carry the ``_root``, ``_tid`` and ``_replays`` of the
  input row it came from (select ``*ANCHORS``). ``fn`` returns one DataFrame per output stream
  (a dict), or one DataFrame with a ``_stream`` column naming each row's stream. Optional
  columns: ``_fail`` (a non-null string fails the input tuple with that error; the row is not
  emitted) and ``_pos`` (tells several outputs of one input to one stream apart).
- ``Topology.record_bolt(name, input=..., outputs=..., fn=...)``: a per-record Python bolt,
  ``fn(values: dict) -> iterable`` of output dicts (of (stream, dict) pairs when it declares
  several streams). ``values`` holds the input's columns and ``_replays`` (how often this
  record failed before). Raising fails the input tuple; so does taking longer than the
  pipeline's ``tuple_timeout_ms`` (the seed's message timeout): a call still running then is
  interrupted (SIGALRM in the Python worker: pure Python code and blocking I/O stop; one long C
  call stops when it returns) and its outputs are dropped.
- sinks: ``count(stream, state)`` adds the stream's ``key`` (and ``delta``, default 1) to a
  state's deltas; ``reject(stream)`` keeps the record in rejected_records with its ``error``.

The acker (seed 000; spark_tasks/acker.py): every source record is a root, every tuple has a
64-bit id hashed from (root, bolt, stream, parent, position, attempt): xxhash64 in the JVM,
BLAKE2b in Python bolts. Messages: the spout's init [root, id of its tuple], each bolt's ack
[root, input id XOR the ids of its outputs] (a DataFrame bolt's as one message per input and
per output, the same XOR), fails [root, error]; sinks ack what they consume. The verdict is
one aggregation, ``group by root: bit_xor, bool_or(fail)``. All or nothing per root: only
roots whose tree completed reach the staged deltas and rejects; the others are the batch's
failures, handed to the backflow queues by the commit (payload, origin, error).

Root ids keep the origin readable without a join: ``replayed << 62 | partition << 40 | offset``.
With ``acker=False`` nothing is tracked (Storm's unreliable mode: a failed tuple's other
branches still count); it exists to measure what the acker costs.
"""

from __future__ import annotations

import hashlib
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from pyspark import StorageLevel
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from onceflow.kvstate.base import DELETED as _DELETED
from spark_tasks.acker import ACK, FAIL, verdicts

SPOUT = "records"
SPOUT_COLUMNS = "partition int, offset long, payload string"
ANCHORS = ("_root", "_tid", "_replays")
_OFFSET_BITS, _PARTITION_BITS = 40, 22
MAX_OFFSET, MAX_PARTITION = (1 << _OFFSET_BITS) - 1, (1 << _PARTITION_BITS) - 1
_MESSAGE_SCHEMA = "root long, kind string, value long, error string"
_LONG = (1 << 64) - 1


class TopologyError(ValueError):
    """A topology that cannot run as declared: the message names the bolt or stream and the fix."""


@dataclass(frozen=True)
class Bolt:
    name: str
    input: str
    outputs: Mapping[str, str]  # stream -> DDL of its data columns, e.g. "key string"
    fn: Callable
    per_record: bool
    key: str | None = None  # a stateful bolt: its input is partitioned by this field
    shards: int = 0  # a stateful bolt's namespaces (one Spark task each)


class StatefulBolt(ABC):
    """A per-record bolt with key-value state across batches (seed 002's IStatefulBolt).

    Before its first tuple of a batch, ``init_state(state)`` gets the state of its shard: a
    KeyValueState as committed by the earlier txids (get / put / delete / iteration). Then
    ``execute(values)`` per tuple, returning outputs like a record bolt's function; raising
    fails the tuple and takes back its state changes. A record's state changes count only if
    its whole tuple tree completed (the acker), and only once its transaction commits.

    Hooks, called in the task that does the step: ``pre_prepare(txid)`` before the batch's
    changes are prepared (the processing task), ``pre_commit(txid)`` before they commit (the
    commit task), ``pre_rollback()`` before a failed or superseded attempt's are dropped.
    """

    def init_state(self, state) -> None:
        self.state = state

    @abstractmethod
    def execute(self, values: dict):
        """One tuple: its outputs (like a record bolt's function's)."""

    def pre_prepare(self, txid: int) -> None:  # noqa: B027 (an optional hook)
        """Does nothing unless the bolt overrides it."""

    def pre_commit(self, txid: int) -> None:  # noqa: B027 (an optional hook)
        """Does nothing unless the bolt overrides it."""

    def pre_rollback(self) -> None:  # noqa: B027 (an optional hook)
        """Does nothing unless the bolt overrides it."""


@dataclass(frozen=True)
class StateContext:
    """What a stateful bolt's tasks need to open their state."""

    pipeline: str
    txid: int
    provider: str
    config: str | None
    coordinator_dsn: str


@dataclass(frozen=True)
class Sink:
    stream: str
    state: str | None  # None: the reject sink


@dataclass
class Topology:
    name: str
    bolts: list[Bolt] = field(default_factory=list)
    sinks: list[Sink] = field(default_factory=list)

    def bolt(self, name: str, *, input: str, outputs: Mapping[str, str], fn: Callable
             ) -> Topology:
        self.bolts.append(Bolt(name, input, dict(outputs), fn, per_record=False))
        return self

    def record_bolt(self, name: str, *, input: str, outputs: Mapping[str, str], fn: Callable
                    ) -> Topology:
        self.bolts.append(Bolt(name, input, dict(outputs), fn, per_record=True))
        return self

    def stateful_bolt(self, name: str, *, input: str, key: str, outputs: Mapping[str, str],
                      bolt: StatefulBolt, shards: int = 2) -> Topology:
        """A per-record bolt with state, its input partitioned by ``key`` into ``shards``
        namespaces (Storm's fields grouping)."""
        self.bolts.append(Bolt(name, input, dict(outputs), bolt, per_record=True, key=key,
                               shards=shards))
        return self

    def stateful(self) -> list[Bolt]:
        return [b for b in self.bolts if b.key]

    def count(self, stream: str, state: str) -> Topology:
        self.sinks.append(Sink(stream, state))
        return self

    def reject(self, stream: str) -> Topology:
        self.sinks.append(Sink(stream, None))
        return self

    def streams(self) -> dict[str, str]:
        """Every stream and its data columns, the spout's first."""
        out = {SPOUT: SPOUT_COLUMNS}
        for bolt in self.bolts:
            out.update(bolt.outputs)
        return out

    def validate(self) -> Topology:
        known = {SPOUT: "the spout"}
        for bolt in self.bolts:
            if bolt.input not in known:
                raise TopologyError(
                    f"bolt {bolt.name!r}: input={bolt.input!r} is not a stream declared before "
                    f"it (known: {sorted(known)}); declare the bolt that emits it first"
                )
            if not bolt.outputs:
                raise TopologyError(f"bolt {bolt.name!r}: outputs is empty: declare at least "
                                    "one output stream (a bolt that only filters still emits)")
            for stream in bolt.outputs:
                if stream in known:
                    raise TopologyError(
                        f"bolt {bolt.name!r}: stream {stream!r} is already emitted by "
                        f"{known[stream]}: give each stream one emitter"
                    )
                known[stream] = f"bolt {bolt.name!r}"
        for bolt in self.stateful():
            if not (hasattr(bolt.fn, "execute") and hasattr(bolt.fn, "init_state")):
                raise TopologyError(f"stateful bolt {bolt.name!r}: bolt={bolt.fn!r} is not a "
                                    "StatefulBolt: subclass spark_tasks.topology.StatefulBolt")
            if bolt.key not in _columns(self.streams()[bolt.input]):
                raise TopologyError(
                    f"stateful bolt {bolt.name!r}: key={bolt.key!r} is not a column of its "
                    f"input {bolt.input!r} ({_columns(self.streams()[bolt.input])})")
            if not isinstance(bolt.shards, int) or bolt.shards < 1:
                raise TopologyError(f"stateful bolt {bolt.name!r}: shards={bolt.shards!r}: "
                                    "give a positive number of namespaces")
            fed = [b.name for b in self.bolts if b.input in bolt.outputs]
            if fed:
                raise TopologyError(
                    f"stateful bolt {bolt.name!r} feeds bolt(s) {fed}: a stateful bolt's "
                    "outputs may go to sinks only (its state changes count only for records "
                    "that completed, so nothing after it may fail them)")
        consumed = {b.input for b in self.bolts} | {s.stream for s in self.sinks}
        for sink in self.sinks:
            if sink.stream not in known:
                raise TopologyError(f"sink of stream {sink.stream!r}: no bolt emits it "
                                    f"(known: {sorted(known)})")
        unconsumed = sorted(set(known) - consumed)
        if unconsumed:
            raise TopologyError(
                f"stream(s) {unconsumed} are emitted but nothing consumes them, so their tuples "
                "would never be acked: add a bolt or a sink (count / reject) for each"
            )
        for sink in self.sinks:
            columns = _columns(self.streams()[sink.stream])
            need = {"key"} if sink.state else {"error"}
            if not need <= set(columns):
                raise TopologyError(
                    f"sink of stream {sink.stream!r} needs column(s) {sorted(need)}; the stream "
                    f"has {columns}"
                )
        return self


def _columns(ddl: str) -> list[str]:
    """The column names of a DDL string ("key string, n int"), parsed without Spark (the
    commit task validates topologies with no Spark session)."""
    names, depth, start = [], 0, 0
    for i, ch in enumerate(ddl + ","):
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif ch == "," and depth == 0:
            field = ddl[start:i].strip()
            if field:
                names.append(field.split()[0].strip("`"))
            start = i + 1
    return names


def root_id(partition, offset, replayed):
    """The root id of a source record as a column expression (see the module docstring)."""
    return (F.shiftleft(F.col(replayed).cast("long"), 62)
            .bitwiseOR(F.shiftleft(F.col(partition).cast("long"), _OFFSET_BITS))
            .bitwiseOR(F.col(offset)))


def origin(root: str = "_root") -> tuple:
    """(partition, offset) column expressions of a root id."""
    partition = F.shiftright(F.col(root), _OFFSET_BITS).bitwiseAND(F.lit(MAX_PARTITION))
    return (partition.cast("int").alias("partition"),
            F.col(root).bitwiseAND(F.lit(MAX_OFFSET)).alias("offset"))


def _message(df: DataFrame, kind: str, value=None, error=None) -> DataFrame:
    null = F.lit(None)
    return df.select(
        F.col("_root").alias("root"), F.lit(kind).alias("kind"),
        (value if value is not None else null).cast("long").alias("value"),
        (error if error is not None else null).cast("string").alias("error"),
    )


def _blake64(*parts) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


_STATE_FIELDS = ("_skey", "_sval", "_seq")


class TupleTimeout(TimeoutError):
    """A per-record bolt call ran past ``tuple_timeout_ms``."""


class _Deadline:
    """Interrupts a per-record bolt call that runs past its budget: a one-shot real-time
    timer whose SIGALRM handler raises TupleTimeout inside the call. Signals reach only the
    main thread (where Spark's Python worker runs a mapInArrow function); elsewhere the budget
    is checked when the call returns."""

    def __init__(self, timeout_ms: int) -> None:
        self.seconds = timeout_ms / 1000
        self.timeout_ms = timeout_ms
        self.armed_ok = threading.current_thread() is threading.main_thread()
        self.previous = None
        if self.armed_ok:
            self.previous = signal.signal(signal.SIGALRM, self._expired)

    def _expired(self, signum, frame):
        raise TupleTimeout(f"interrupted after {self.timeout_ms} ms, over "
                           f"tuple_timeout_ms={self.timeout_ms}")

    def __enter__(self) -> _Deadline:
        self.started = time.perf_counter()
        if self.armed_ok:
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def __exit__(self, *exc) -> None:
        if self.armed_ok:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if exc[0] is None:
            elapsed_ms = (time.perf_counter() - self.started) * 1000
            if elapsed_ms > self.timeout_ms:
                raise TupleTimeout(f"took {elapsed_ms:.0f} ms, over "
                                   f"tuple_timeout_ms={self.timeout_ms}")

    def close(self) -> None:
        if self.armed_ok:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous or signal.SIG_DFL)


def _record_runner(bolt: Bolt, attempt: int, timeout_ms: int, out_fields: list[str],
                   arrow_schema, ctx: StateContext | None = None):
    """The mapInArrow function of a per-record bolt: tuples, acks, fails, and for a stateful
    bolt its state changes (kind "state", one row per put or delete, with its root) in one
    output."""
    single = next(iter(bolt.outputs)) if len(bolt.outputs) == 1 else None
    names = ("_kind", "_stream", "_root", "_tid", "_replays", "_value", "_error",
             *_STATE_FIELDS, *out_fields)

    def run(batches: Iterator) -> Iterator:
        import json

        import pyarrow as pa

        def add(cols, kind, stream, root, tid, replays, value, error, values=None, state=None):
            for name, v in zip(names[:10], (kind, stream, root, tid, replays, value, error,
                                            *(state or (None, None, None))), strict=True):
                cols[name].append(v)
            for name in out_fields:
                cols[name].append(None if values is None else values.get(name))

        call, tracked, namespace, provider = bolt.fn, None, None, None
        if bolt.key:
            batches = list(batches)  # the shard's keys are prefetched in one round trip
            tracked, namespace, provider = _open_state(bolt, ctx, batches)
            call = bolt.fn.execute
        seq = 0
        deadline = _Deadline(timeout_ms)
        try:
            for batch in batches:
                cols = {name: [] for name in names}
                for row in batch.to_pylist():
                    root, tid, replays = row.pop("_root"), row.pop("_tid"), row["_replays"]
                    if tracked is not None:
                        tracked.begin()
                    try:
                        outputs = []
                        with deadline:
                            for item in call(row) or ():
                                stream, values = (single, item) if single else item
                                if stream not in bolt.outputs:
                                    raise TopologyError(
                                        f"emitted to undeclared stream {stream!r}: declare "
                                        "it in outputs")
                                outputs.append((stream, values))
                    except Exception as exc:  # a failing bolt fails its input tuple only
                        if tracked is not None:
                            tracked.undo()
                        add(cols, FAIL, None, root, None, replays, None,
                            f"bolt {bolt.name}: {type(exc).__name__}: {exc}")
                        continue
                    if tracked is not None:
                        for key, value in tracked.log:
                            seq += 1
                            add(cols, "state", namespace, root, None, replays, None, None,
                                state=(key, None if value is _DELETED else json.dumps(value),
                                       seq))
                    # The ack [root, tid ^ xor(output ids)] is sent as its parts: tid on the
                    # first output's row (a row of its own when there is none), each output id
                    # as that output's row, which its consumer acks from the same row.
                    if not outputs:
                        add(cols, ACK, None, root, None, replays, tid, None)
                    for pos, (stream, values) in enumerate(outputs):
                        out_id = _blake64(root, bolt.name, stream, tid, pos, attempt)
                        add(cols, "tuple", stream, root, out_id, replays,
                            None if pos else tid, None, values)
                yield pa.RecordBatch.from_pydict(cols, schema=arrow_schema)
        finally:
            deadline.close()
            if provider is not None:
                provider.close()

    return run


class _Tracked:
    """A stateful bolt's view of its KeyValueState during one tuple: every put and delete is
    logged with the tuple (its root), and taken back if the tuple fails."""

    def __init__(self, state) -> None:
        self._state, self.log, self._undo = state, [], []

    def begin(self) -> None:
        self.log, self._undo = [], []

    def undo(self) -> None:
        for key, pending in reversed(self._undo):
            self._state.restore(key, pending)

    def get(self, key, default=None):
        return self._state.get(key, default)

    def put(self, key, value) -> None:
        self._undo.append((key, self._state.pending_value(key)))
        self._state.put(key, value)
        self.log.append((key, value))

    def delete(self, key) -> None:
        self._undo.append((key, self._state.pending_value(key)))
        self._state.delete(key)
        self.log.append((key, _DELETED))

    def __iter__(self):
        return iter(self._state)


def _open_state(bolt: Bolt, ctx: StateContext | None, batches):
    """The shard of a stateful bolt this task holds: (tracked state, namespace, provider)."""
    from pyspark import TaskContext

    from onceflow.kvstate import KeyValueState, open_provider

    if ctx is None:
        raise TopologyError(f"stateful bolt {bolt.name!r} needs its state: run the topology "
                            "through the processing phase (process_batch)")
    namespace = f"shard-{TaskContext.get().partitionId()}"
    keys = {str(k) for b in batches for k in b.column(bolt.key).to_pylist() if k is not None}
    provider = open_provider(ctx.provider, ctx.config, coordinator_dsn=ctx.coordinator_dsn)
    state = KeyValueState(provider, ctx.pipeline, bolt.name, namespace, ctx.txid,
                          prefetch=sorted(keys))
    tracked = _Tracked(state)
    bolt.fn.init_state(tracked)
    return tracked, namespace, provider


@dataclass
class TopologyOutput:
    """deltas: state_name, key, delta; rejects: partition, offset, error; failures: partition,
    offset, replayed, payload, error (one row per root whose tree did not complete);
    state_changes: bolt, namespace, key, value (JSON text, null for a delete)."""

    deltas: DataFrame
    rejects: DataFrame
    failures: DataFrame
    state_changes: DataFrame
    persisted: list[DataFrame] = field(default_factory=list)

    def unpersist(self) -> None:
        for df in self.persisted:
            df.unpersist()
        self.persisted.clear()


class _Run:
    def __init__(self, attempt: int, acker: bool, timeout_ms: int,
                 state: StateContext | None = None) -> None:
        self.attempt, self.acker, self.timeout_ms = attempt, acker, timeout_ms
        self.state = state
        self.state_changes: dict[str, DataFrame] = {}
        self.persisted: list[DataFrame] = []
        self.messages: list[DataFrame] = []

    def keep(self, df: DataFrame) -> DataFrame:
        """Persist a DataFrame read by several branches (a stream and the acker's messages),
        so the one Spark job that collects the output computes it once."""
        df = df.persist(StorageLevel.MEMORY_AND_DISK)
        self.persisted.append(df)
        return df

    def message(self, df: DataFrame, kind: str, value=None, error=None) -> None:
        if self.acker:
            self.messages.append(_message(df, kind, value, error))

    def frame_bolt(self, bolt: Bolt, inp: DataFrame) -> dict[str, DataFrame]:
        result = bolt.fn(inp)
        if isinstance(result, DataFrame):
            if "_stream" not in result.columns:
                if len(bolt.outputs) > 1:
                    raise TopologyError(
                        f"bolt {bolt.name!r} returned one DataFrame without a _stream column "
                        f"but declares streams {sorted(bolt.outputs)}: add _stream, or return "
                        "a dict of DataFrames by stream"
                    )
                result = result.withColumn("_stream", F.lit(next(iter(bolt.outputs))))
            combined = self.keep(result)
            result = {s: combined.where(F.col("_stream") == s) for s in bolt.outputs}
        if not isinstance(result, Mapping) or set(result) != set(bolt.outputs):
            raise TopologyError(
                f"bolt {bolt.name!r} must return a DataFrame per declared stream "
                f"{sorted(bolt.outputs)}; it returned {type(result).__name__} "
                f"{sorted(result) if isinstance(result, Mapping) else ''}"
            )
        streams = {}
        for stream, df in result.items():
            data = _columns(bolt.outputs[stream])
            missing = [c for c in (*ANCHORS, *data) if c not in df.columns]
            if missing:
                raise TopologyError(
                    f"bolt {bolt.name!r}, stream {stream!r}: output lacks column(s) {missing}; "
                    f"carry the anchoring columns {list(ANCHORS)} of each input row and the "
                    f"declared columns {data}"
                )
            if "_fail" in df.columns:
                self.message(df.where(F.col("_fail").isNotNull()), FAIL,
                             error=F.concat(F.lit(f"bolt {bolt.name}: "), F.col("_fail")))
                df = df.where(F.col("_fail").isNull())
            pos = F.col("_pos") if "_pos" in df.columns else F.lit(0)
            tid = F.xxhash64("_root", F.lit(bolt.name), F.lit(stream), "_tid", pos,
                             *data, F.lit(self.attempt))
            out = df.select("_root", tid.alias("_tid"), F.col("_replays").cast("int"),
                            *[F.col(c) for c in data])
            streams[stream] = out
        return streams

    def record_bolt(self, bolt: Bolt, inp: DataFrame) -> dict[str, DataFrame]:
        in_data = _columns(_stream_ddl(inp))
        fields: dict[str, str] = {}
        for stream, ddl in bolt.outputs.items():
            for f in StructType.fromDDL(ddl).fields:
                kind = f.dataType.simpleString()
                if fields.setdefault(f.name, kind) != kind:
                    raise TopologyError(
                        f"bolt {bolt.name!r}: column {f.name!r} is {fields[f.name]} in one "
                        f"stream and {kind} in {stream!r}: use one type or another name"
                    )
        ddl = ("_kind string, _stream string, _root long, _tid long, _replays int, "
               "_value long, _error string, _skey string, _sval string, _seq long"
               + "".join(f", {name} {kind}" for name, kind in fields.items()))
        schema = StructType.fromDDL(ddl)
        from pyspark.sql.pandas.types import to_arrow_schema

        runner = _record_runner(bolt, self.attempt, self.timeout_ms, list(fields),
                                to_arrow_schema(schema), self.state)
        inp = inp.select(*ANCHORS, *in_data)
        if bolt.key:  # fields grouping: one task, one namespace per shard
            inp = inp.repartition(bolt.shards, bolt.key)
        combined = self.keep(inp.mapInArrow(runner, schema))
        if bolt.key:
            self.state_changes[bolt.name] = combined.where(F.col("_kind") == "state").select(
                "_root", F.col("_stream").alias("namespace"), F.col("_skey").alias("key"),
                F.col("_sval").alias("value"), F.col("_seq").alias("seq"))
        if self.acker:
            self.messages.append(
                combined.where(F.col("_value").isNotNull() | (F.col("_kind") == FAIL)).select(
                    F.col("_root").alias("root"),
                    F.when(F.col("_kind") == FAIL, F.lit(FAIL)).otherwise(F.lit(ACK))
                    .alias("kind"),
                    F.col("_value").alias("value"), F.col("_error").alias("error")))
        return {
            stream: combined.where((F.col("_kind") == "tuple") & (F.col("_stream") == stream))
            .select(*ANCHORS, *_columns(ddl_))
            for stream, ddl_ in bolt.outputs.items()
        }


def _stream_ddl(df: DataFrame) -> str:
    return ", ".join(f"{f.name} {f.dataType.simpleString()}" for f in df.schema.fields
                     if f.name not in ANCHORS)


@dataclass
class Wired:
    """A topology wired over a source: its streams, the spout, the acker's messages."""

    run: _Run
    spout: DataFrame
    streams: dict[str, DataFrame]
    sinks: dict[int, DataFrame]  # what each sink (by position) consumes

    def messages(self) -> DataFrame:
        """Every acker message of the batch: root, kind, value, error."""
        if not self.run.messages:
            return self.spout.sparkSession.createDataFrame([], _MESSAGE_SCHEMA)
        return union_all(self.run.messages)


def wire(topology: Topology, source: DataFrame, *, attempt: int, acker: bool = True,
         tuple_timeout_ms: int = 30_000, state: StateContext | None = None) -> Wired:
    """The lazy plan of ``topology`` over ``source`` (partition, offset, payload, replays,
    replayed): the spout, every bolt, the sinks, and the acker's messages.

    Every tuple id is XORed in twice: when emitted (in the emitter's ack, or the spout's
    init) and when acked by its consumer. Every emission is computed from the tuple's own row
    (the framework hashes the id in the JVM, a Python bolt returns it with the row). Where the
    consumer's ack is computed from that same row too (a DataFrame bolt or a sink consuming
    it), the two halves are combined before they are sent, as Storm combines what a bolt owes
    the acker into one message: their XOR is 0 and leaves the shuffle. What a Python bolt
    computes on its own, its ack of each input (or its fail), is a message, and so is the
    emission half of each tuple it consumes. The verdict is the same as with every message
    sent apart; only the volume the aggregation shuffles differs.
    """
    topology.validate()
    consumers: dict[str, list[str]] = {}
    for bolt in topology.bolts:
        consumers.setdefault(bolt.input, []).append(bolt.name)
    for i, sink in enumerate(topology.sinks):
        consumers.setdefault(sink.stream, []).append(f"$sink{i}")
    python_bolts = {b.name for b in topology.bolts if b.per_record}
    run = _Run(attempt, acker, tuple_timeout_ms, state)
    root = root_id("partition", "offset", "replayed")
    spout = run.keep(source.select(
        root.alias("_root"),
        F.xxhash64(root, F.lit("$spout"), F.lit(attempt)).alias("_tid"),
        F.col("replays").cast("int").alias("_replays"),
        "partition", "offset", "payload", "replayed",
    ))
    streams = {SPOUT: spout.select(*ANCHORS, "partition", "offset", "payload")}

    def take(stream: str, consumer: str) -> DataFrame:
        """A stream as one consumer sees it. A stream with several consumers gives each its
        own copy of every tuple (Storm's one tuple per subscriber): an implicit tee acks the
        emitted tuple and emits one copy per consumer, whose id hashes in the consumer."""
        df = streams[stream]
        if len(consumers[stream]) > 1:
            df = df.withColumn("_tid", F.xxhash64("_tid", F.lit(consumer)))
        if consumer in python_bolts:  # the emission half; the Python bolt sends the ack
            run.message(df, ACK, F.col("_tid"))
        return df

    for bolt in topology.bolts:
        if not bolt.key:
            inp = take(bolt.input, bolt.name)
            streams.update(run.record_bolt(bolt, inp) if bolt.per_record
                           else run.frame_bolt(bolt, inp))
    # Stateful bolts last, fed only by roots whose tree completed everywhere else: a state
    # change counts only if its record counts, and nothing a failed record wrote is read by
    # another record of the batch (their outputs go to sinks only, so nothing after them
    # can fail a root).
    stateful = topology.stateful()
    if stateful:
        done = None
        if acker:
            done = F.broadcast(run.keep(verdicts(union_all(run.messages) if run.messages else
                                                 spout.sparkSession.createDataFrame(
                                                     [], _MESSAGE_SCHEMA),
                                                 errors=False, require_init=False)
                                        .where(~F.col("complete"))
                                        .select(F.col("root").alias("_root"))))
        for bolt in stateful:
            inp = take(bolt.input, bolt.name)
            if done is not None:
                inp = inp.join(done, "_root", "left_anti")
            streams.update(run.record_bolt(bolt, inp))
    sinks = {i: take(sink.stream, f"$sink{i}") for i, sink in enumerate(topology.sinks)}
    return Wired(run, spout, streams, sinks)


def run_topology(topology: Topology, source: DataFrame, *, attempt: int, acker: bool = True,
                 tuple_timeout_ms: int = 30_000, state: StateContext | None = None
                 ) -> TopologyOutput:
    """Run ``topology`` over ``source`` (partition, offset, payload, replays, replayed).

    Lazy: nothing runs until the caller collects the output (one Spark job); then call
    ``unpersist()``.
    """
    wired = wire(topology, source, attempt=attempt, acker=acker,
                 tuple_timeout_ms=tuple_timeout_ms, state=state)
    run, spout = wired.run, wired.spout
    bad = None
    if acker:
        # Persisted: every sink's anti-join and the failures read it; computed once.
        bad = F.broadcast(run.keep(verdicts(wired.messages(), require_init=False)
                                   .where(~F.col("complete"))
                                   .select(F.col("root").alias("_root"), "error")))

    def completed(df: DataFrame) -> DataFrame:
        return df if bad is None else df.join(bad, "_root", "left_anti")

    taken = wired.sinks
    deltas = [completed(taken[i]).select(
        F.lit(s.state).alias("state_name"), F.col("key").cast("string").alias("key"),
        (F.col("delta") if "delta" in taken[i].columns else F.lit(1))
        .cast("long").alias("delta"))
        for i, s in enumerate(topology.sinks) if s.state]
    rejects = [completed(taken[i]).select(*origin(), F.col("error").cast("string"))
               for i, s in enumerate(topology.sinks) if not s.state]
    spark = source.sparkSession
    deltas_df = (union_all(deltas) if deltas else
                 spark.createDataFrame([], "state_name string, key string, delta long"))
    deltas_df = deltas_df.groupBy("state_name", "key").agg(F.sum("delta").alias("delta"))
    rejects_df = (union_all(rejects) if rejects else
                  spark.createDataFrame([], "partition int, offset long, error string"))
    if bad is None:
        failures = spark.createDataFrame(
            [], "partition int, offset long, replayed boolean, payload string, error string")
    else:
        failures = spout.join(bad, "_root").select(
            "partition", "offset", "replayed", "payload",
            F.coalesce("error", F.lit("tuple tree incomplete: some tuple was never acked"))
            .alias("error"),
        )
    # A stateful bolt's changes by completed roots only; per key the last one made.
    changes = [completed(df).groupBy("namespace", "key").agg(
        F.max_by("value", "seq").alias("value")).select(
        F.lit(name).alias("bolt"), "namespace", "key", "value")
        for name, df in run.state_changes.items()]
    state_df = (union_all(changes) if changes else spark.createDataFrame(
        [], "bolt string, namespace string, key string, value string"))
    return TopologyOutput(deltas_df, rejects_df, failures, state_df, run.persisted)


def union_all(dfs: list[DataFrame]) -> DataFrame:
    """The rows of every DataFrame (by column name)."""
    out = dfs[0]
    for df in dfs[1:]:
        out = out.unionByName(df)
    return out
