"""Topologies: a pipeline's processing phase as bolts over streams of tuples, under the acker.

This module is the declaration API only (no pyspark import): a pipeline module can declare
its topology without loading Spark, and the begin and commit tasks stay light. The Spark side
is onceflow.spark.frame (wiring), onceflow.spark.runner (the acker's messages, sinks) and
onceflow.spark.record_bolts (the per-record Python bolts' runtime).

A topology reads one spout stream, ``records`` (the batch's source records: partition, offset,
payload; or, from a source that decodes its records, partition, offset, the declared columns
and ``_corrupt_record``: ``spout_columns``, set from the pipeline's source), and passes tuples
through bolts to sinks:

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
- sinks: ``sink(stream, state)`` (or ``count``) feeds a state: a count state adds the
  stream's ``key`` (and ``delta``, default 1); a typed state, upsert or append table reads
  the columns its declaration names. ``reject(stream)`` keeps the record in
  rejected_records with its ``error``.

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

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

SPOUT = "records"
SPOUT_COLUMNS = "partition int, offset long, payload string"
ANCHORS = ("_root", "_tid", "_replays")
# Columns of the runner's frame besides the streams' (onceflow.spark.frame.META): no stream's.
RESERVED = ("_kind", "_stream", "_root", "_tid", "_replays", "_error", "_skey", "_sval", "_seq")
# Spark types that order a typed state's Last measures (order_by)
ORDERABLE = ("bigint", "int", "smallint", "tinyint", "date", "timestamp", "timestamp_ntz")


class TopologyError(ValueError):
    """A topology that cannot run as declared: the message names the bolt or stream, the field
    and the fix. (Pipeline.build_topology raises it as a DeclarationError: retrying cannot
    help.) This module imports nothing of onceflow's: a Spark worker that unpickles a bolt
    imports it first."""


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
    # The spout's columns (Pipeline.build_topology sets them from the source)
    spout_columns: str = SPOUT_COLUMNS

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

    def without_stateful(self) -> tuple[Topology, set[str]]:
        """This topology without its stateful bolts and the sinks of their streams (what can
        be re-run without the key-value state), and the states those sinks fed."""
        fed = {s for b in self.stateful() for s in b.outputs}
        kept = Topology(self.name, [b for b in self.bolts if not b.key],
                        [s for s in self.sinks if s.stream not in fed], self.spout_columns)
        return kept, {s.state for s in self.sinks if s.stream in fed and s.state}

    def sink(self, stream: str, state: str) -> Topology:
        """The stream's tuples go to the state (or upsert / append table) fed by ``state``:
        a count state adds ``delta`` (1 when absent) per ``key``; a typed one reads its key
        and measure columns from the stream."""
        self.sinks.append(Sink(stream, state))
        return self

    def count(self, stream: str, state: str) -> Topology:
        """Same as sink(): the name reads better for count states."""
        return self.sink(stream, state)

    def reject(self, stream: str) -> Topology:
        self.sinks.append(Sink(stream, None))
        return self

    def streams(self) -> dict[str, str]:
        """Every stream and its data columns, the spout's first."""
        out = {SPOUT: self.spout_columns}
        for bolt in self.bolts:
            out.update(bolt.outputs)
        return out

    def emitters(self) -> dict[str, str]:
        """Every stream and what emits it ("the spout", "bolt 'parse'")."""
        out = {SPOUT: "the spout"}
        for bolt in self.bolts:
            out.update({stream: f"bolt {bolt.name!r}" for stream in bolt.outputs})
        return out

    def typed_columns(self) -> dict[str, str]:
        """Every column of every stream and its Spark type. One name has one type in a
        topology: the runner keeps every stream's tuples in one frame, a column per name."""
        emitters = self.emitters()
        out: dict[str, str] = {}
        owner: dict[str, str] = {}
        for stream, ddl in self.streams().items():
            for name, kind in column_types(ddl).items():
                where = f"stream {stream!r} ({emitters.get(stream, 'the spout')})"
                if name in RESERVED:
                    raise TopologyError(f"{where}: column {name!r} is a name onceflow keeps for "
                                        "itself: rename it in the stream's columns")
                if name in out and out[name] != kind:
                    raise TopologyError(
                        f"column {name!r} is {out[name]} in {owner[name]} and {kind} in {where}: "
                        "one name has one type in a topology: give both the same type, or "
                        "rename one of them")
                out.setdefault(name, kind)
                owner.setdefault(name, where)
        return out

    def validate(self, shapes: Mapping | None = None, states: Collection[str] | None = None
                 ) -> Topology:
        """Refuse what cannot run (TopologyError), before any data: the streams' wiring, one
        type per column name, and what each sink needs of its stream. ``shapes``: the typed
        states' shapes (onceflow.core.tables.Shape) by the sink name that feeds them, whose
        key and measure columns must be in the stream, of a type that converts without loss
        (``Shape.conversion_loss`` says what would be lost). ``states``: every sink name the
        declared states are fed by; given, a sink into another name (its tuples would be
        dropped) and a state no sink feeds are refused."""
        shapes = shapes or {}
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
        self.typed_columns()
        for bolt in self.stateful():
            if not (hasattr(bolt.fn, "execute") and hasattr(bolt.fn, "init_state")):
                raise TopologyError(f"stateful bolt {bolt.name!r}: bolt={bolt.fn!r} is not a "
                                    "StatefulBolt: subclass onceflow.StatefulBolt")
            if bolt.key not in columns(self.streams()[bolt.input]):
                raise TopologyError(
                    f"stateful bolt {bolt.name!r}: key={bolt.key!r} is not a column of its "
                    f"input {bolt.input!r} ({columns(self.streams()[bolt.input])})")
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
            self._check_sink(sink, known, shapes, states)
        if states is not None:
            unfed = sorted(set(states) - {s.state for s in self.sinks if s.state})
            if unfed:
                raise TopologyError(
                    f"state(s) fed by {unfed} would stay empty: no sink of the topology feeds "
                    "them: add .sink(stream, name) for each (the state's source=, else its "
                    "name), or remove the state")
        return self

    def _check_sink(self, sink: Sink, emitters: Mapping[str, str], shapes: Mapping,
                    states: Collection[str] | None) -> None:
        types = column_types(self.streams()[sink.stream])
        have = ", ".join(types) or "no column"
        where = f"stream {sink.stream!r} (emitted by {emitters[sink.stream]})"
        if sink.state is None:
            if "error" not in types:
                raise TopologyError(
                    f"the reject sink of {where} needs column 'error', the reason kept with "
                    f"each rejected record; the stream has {have}: add 'error string' to "
                    "its columns")
            return
        if states is not None and sink.state not in states:
            raise TopologyError(
                f"sink of {where} into {sink.state!r}: no state is fed by {sink.state!r} (the "
                f"states are fed by {sorted(states)}), so its tuples would be dropped: declare "
                f"StateSpec({sink.state!r}) (or a state with source={sink.state!r}), or sink "
                "into one of those")
        shape = shapes.get(sink.state)
        if shape is None:
            if "key" not in types:
                raise TopologyError(
                    f"count state {sink.state!r} counts column 'key' of {where}, which the "
                    f"stream does not carry (it has {have}): name the counted column key "
                    "(and an optional delta bigint)")
            return
        state = f"state {shape.name!r} (fed by sink {sink.state!r})"
        for column, pg_type, what in shape.targets():
            if column not in types:
                raise TopologyError(
                    f"{state}: {what} reads column {column!r}, which {where} does not carry "
                    f"(it has {have}): add it to the stream's columns, or name one it has")
            loss = shape.conversion_loss(types[column], pg_type)
            if loss:
                raise TopologyError(
                    f"{state}: {what} stores column {column!r} of {where}, a "
                    f"{types[column]}, as {pg_type}: {loss}: declare a type that holds "
                    f"every value (e.g. {holding_type(types[column])}), or convert the "
                    "column in its bolt")
        for column in shape.inputs():
            if column not in types:
                what = "order_by" if column == shape.order_by else "a Count"
                raise TopologyError(
                    f"{state}: {what} reads column {column!r}, which {where} does not carry "
                    f"(it has {have}): add it to the stream's columns, or name one it has")
        if shape.order_by:
            kind = types[shape.order_by]
            if kind.split("(")[0] not in ORDERABLE:
                raise TopologyError(
                    f"{state}: order_by={shape.order_by!r} is a {kind} column of {where}; "
                    f"order Last measures by one of type {', '.join(ORDERABLE)}")


def holding_type(kind: str) -> str:
    """The PostgreSQL type that holds every value of a Spark column type (an example for a
    fix)."""
    base = kind.split("(")[0]
    if base == "decimal":
        return kind.replace("decimal", "numeric").replace(" ", "")
    return {"tinyint": "smallint", "smallint": "smallint", "int": "integer", "bigint": "bigint",
            "float": "double precision", "double": "double precision", "boolean": "boolean",
            "date": "date", "timestamp": "timestamptz", "timestamp_ntz": "timestamp"
            }.get(base, "text")


def _fields(ddl: str) -> list[str]:
    """The top-level fields of a DDL string ("key string, n int, m map<string,int>")."""
    fields, depth, start = [], 0, 0
    for i, ch in enumerate(ddl + ","):
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif ch == "," and depth == 0:
            field = ddl[start:i].strip()
            if field:
                fields.append(field)
            start = i + 1
    return fields


_ALIASES = {"long": "bigint", "integer": "int", "short": "smallint", "byte": "tinyint",
            "real": "float", "dec": "decimal", "numeric": "decimal"}


def column_types(ddl: str) -> dict[str, str]:
    """Column name -> Spark type of a DDL string, parsed without Spark (the commit task
    validates topologies with no Spark session); type aliases are made one (long: bigint)."""
    out = {}
    for entry in _fields(ddl):
        name, _, kind = entry.partition(" ")
        if not kind.strip():
            raise TopologyError(f"column {name!r} in {ddl!r} has no type: write "
                                "'name type', e.g. 'key string'")
        kind = re.sub(r"\s*([,()<>])\s*", r"\1", kind.strip().lower())
        base = kind.split("(")[0].split("<")[0].strip()
        out[name.strip("`")] = _ALIASES.get(base, base) + kind[len(base):]
    return out


def columns(ddl: str) -> list[str]:
    """The column names of a DDL string."""
    return [f.split()[0].strip("`") for f in _fields(ddl)]
