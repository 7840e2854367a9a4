"""Running a topology over a batch in Spark in one pass over the data: the frame.

The topology is compiled into a linear chain over one wide DataFrame, the **frame**. A row is
a tuple of some stream (``_kind`` "tuple", ``_stream`` its name, the stream's columns set),
or a note for the end: a failure ("fail": the record's tree cannot complete) or a state
change of a stateful bolt ("state"). The frame's columns are fixed before anything runs: the
anchoring columns, the notes' columns, and the union of every stream's declared columns (a
name has one type in the whole topology).

- A per-record Python bolt is a ``mapInArrow`` over the whole frame: the rows of its input
  stream are handed to the bolt one by one and replaced by its outputs (and a failure note
  when it raises or runs out of time); every other row passes through untouched. No row is
  read twice, nothing is cached.
- A DataFrame bolt gets its input stream as a DataFrame. When that stream is the only thing in
  the frame (the usual first bolt, on the spout), the frame simply becomes the bolt's output;
  otherwise the frame is cached there (a split point) and the rest joins the output again.
- A stream with several consumers is teed: each tuple becomes one copy per consumer.
- At the end one projection turns every row into an output: a delta of a count sink (state,
  key, delta), a rejected record, or a note; one aggregation by (state, key) sums the deltas.
  With the acker the verdict is all or nothing, settled by passes: the first computes every
  output as if nothing failed, and when it holds no failure note (the usual batch) it is the
  answer. Otherwise the records with a note are left out whole (a broadcast anti-join) and
  the batch is computed again, until no pass finds a failure outside them; each becomes one
  failure (for the backflow). So a record whose tree failed anywhere contributes nothing, and
  no tuple is ever shuffled by its record.

Why this is still Storm's acker: every tuple is emitted and acked by onceflow's own code in
the same pass, so the two XOR halves of each tuple id are formed together and cancel (Storm
folds a bolt's ack into one message in the same way); the verdict keeps the other half, the
failures, and the passes apply them per record. The reference acker (onceflow.spark.acker)
states the rule it implements.

Stateful bolts read and write key-value state, so they run on records that completed
everywhere else: there the verdict is one aggregation by record (cached), the stateful bolts
run on the inputs of complete records, and a record that fails there is dropped as a whole.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
from pyspark import StorageLevel
from pyspark.sql import DataFrame, Observation
from pyspark.sql import functions as F

from onceflow.core.tables import ORDER, SPARK_JSON, Shape, spark_type
from onceflow.core.topology import (
    ANCHORS,
    SPOUT,
    Bolt,
    StateContext,
    Topology,
    TopologyError,
    column_types,
    columns,
)
from onceflow.sources.json_records import PROBLEM
from onceflow.spark.ids import MAX_OFFSET, MAX_PARTITION, OFFSET_BITS, origin, root_id
from onceflow.spark.record_bolts import RECORD_META, pass_through_runner, record_runner

TUPLE, FAIL, STATE = "tuple", "fail", "state"
# Notes' and state changes' columns, besides the anchors (_root, _tid, _replays).
META = {"_kind": "string", "_stream": "string", "_root": "bigint", "_tid": "bigint",
        "_replays": "int", "_error": "string", "_skey": "string", "_sval": "string",
        "_seq": "bigint"}
# What a topology's run yields, one row per output; ``kind``: 0 delta, 1 rejected record,
# 2 failed record (for the backflow), 3 state change of a stateful bolt.
DELTA, REJECT, FAILED, CHANGE = 0, 1, 2, 3
OUTPUT = ("kind int, state_name string, key string, delta long, partition int, offset long, "
          "replayed boolean, error string, bolt string, namespace string, value string, "
          "root long")


# The acker's verdict: at most this many passes over a batch (see TopologyRun._settle).
MAX_PASSES = 4
# Typed tuples travel as JSON through the verdict (timestamps keep their microseconds).
JSON_OPTIONS = SPARK_JSON


def pa_array(values: list):
    return pa.array(values, pa.string())


def _rank(order_by: str | None, cols: Mapping[str, str]):
    """What orders a typed state's Last measures, as a bigint: the ``order_by`` column
    (a number, a date's day, a timestamp's microsecond), else the record's root id."""
    if order_by is None:
        return F.col("_root")
    kind = cols[order_by]
    column = F.col(order_by)
    if kind == "date":
        return F.unix_date(column).cast("bigint")
    if kind.startswith("timestamp"):
        return F.unix_micros(column.cast("timestamp"))
    return column.cast("bigint")


def frame_columns(topology: Topology) -> dict[str, str]:
    """Every column of the frame and its Spark type (META, then the streams' columns: one
    type per name, Topology.typed_columns)."""
    return {**META, **topology.typed_columns()}


def _typed(names: Mapping[str, str], present: dict) -> list:
    """A select list in frame order: what ``present`` gives, typed nulls for the rest."""
    return [(present[n] if n in present else F.lit(None)).cast(t).alias(n)
            for n, t in names.items()]


@dataclass
class _Chain:
    topology: Topology
    attempt: int
    acker: bool
    timeout_ms: int
    state: StateContext | None
    cols: dict[str, str] = field(default_factory=dict)
    cached: list[DataFrame] = field(default_factory=list)
    frame: DataFrame | None = None
    live: set[str] = field(default_factory=set)  # streams with tuple rows in the frame
    notes: bool = False  # the frame holds notes (failures) besides tuples

    def __post_init__(self) -> None:
        self.cols = frame_columns(self.topology)
        # consumers of each stream, in declaration order (bolts, then sinks)
        self.consumers: dict[str, list[str]] = {}
        for bolt in self.topology.bolts:
            self.consumers.setdefault(bolt.input, []).append(bolt.name)
        for i, sink in enumerate(self.topology.sinks):
            self.consumers.setdefault(sink.stream, []).append(f"$sink{i}")

    def cache(self, df: DataFrame) -> DataFrame:
        df = df.persist(StorageLevel.MEMORY_AND_DISK)
        self.cached.append(df)
        return df

    # -- the stream a consumer reads ---------------------------------------------------------
    def name_for(self, stream: str, consumer: str) -> str:
        """A teed stream's copy for ``consumer`` (the stream itself when it has one)."""
        return stream if len(self.consumers.get(stream, [])) <= 1 else f"{stream}@{consumer}"

    def tee(self, produced: list[str]) -> None:
        """Each tuple of a stream with several consumers becomes one copy per consumer,
        whose id hashes in the consumer (Storm's one tuple per subscriber)."""
        teed = {s: self.consumers[s] for s in produced if len(self.consumers.get(s, [])) > 1}
        if not teed:
            return
        copies = F.lit(None)
        for stream, consumers in teed.items():
            copies = F.when((F.col("_kind") == TUPLE) & (F.col("_stream") == stream),
                            F.array(*[F.lit(c) for c in consumers])).otherwise(copies)
        frame = self.frame.withColumn("_copy", F.explode_outer(copies))
        self.frame = frame.withColumn("_stream", F.when(
            F.col("_copy").isNotNull(), F.concat("_stream", F.lit("@"), "_copy"))
            .otherwise(F.col("_stream"))).withColumn("_tid", F.when(
                F.col("_copy").isNotNull(), F.xxhash64("_tid", "_copy"))
            .otherwise(F.col("_tid"))).drop("_copy")
        for stream, consumers in teed.items():
            self.live.discard(stream)
            self.live |= {f"{stream}@{c}" for c in consumers}

    # -- bolts -----------------------------------------------------------------------------
    def dataframe_bolt(self, bolt: Bolt) -> None:
        stream = self.name_for(bolt.input, bolt.name)
        view_cols = [*ANCHORS, *columns(self.topology.streams()[bolt.input])]
        alone = self.live == {stream} and not self.notes
        frame = self.frame if alone else self.cache(self.frame)
        mine = frame.where((F.col("_kind") == TUPLE) & (F.col("_stream") == stream))
        result = bolt.fn(mine.select(*view_cols))
        outputs = self._bolt_outputs(bolt, result)
        if not alone:
            rest = frame.where((F.col("_kind") != TUPLE) | (F.col("_stream") != stream))
            outputs = rest.unionByName(outputs)
        self.frame = outputs
        self.live = (self.live - {stream}) | set(bolt.outputs)
        self.notes = self.notes or self.acker
        self.tee(list(bolt.outputs))

    def _bolt_outputs(self, bolt: Bolt, result) -> DataFrame:
        """A DataFrame bolt's result in frame form: tuples with their new ids, and a failure
        note for every row whose ``_fail`` is set."""
        if isinstance(result, Mapping):
            if set(result) != set(bolt.outputs):
                raise TopologyError(f"bolt {bolt.name!r} must return a DataFrame per declared "
                                    f"stream {sorted(bolt.outputs)}; it returned "
                                    f"{sorted(result)}")
            parts = [df.withColumn("_stream", F.lit(s)) for s, df in result.items()]
            result = parts[0]
            for part in parts[1:]:
                result = result.unionByName(part, allowMissingColumns=True)
        if not isinstance(result, DataFrame):
            raise TopologyError(f"bolt {bolt.name!r} returned {type(result).__name__}: return "
                                "a DataFrame (with a _stream column when it has several "
                                "output streams) or a dict of DataFrames by stream")
        have = set(result.columns)  # one schema look-up per bolt
        if "_stream" not in have:
            if len(bolt.outputs) > 1:
                raise TopologyError(
                    f"bolt {bolt.name!r} returned one DataFrame without a _stream column but "
                    f"declares streams {sorted(bolt.outputs)}: add _stream, or return a dict "
                    "of DataFrames by stream")
            result = result.withColumn("_stream", F.lit(next(iter(bolt.outputs))))
        data = {c for ddl in bolt.outputs.values() for c in columns(ddl)}
        missing = [c for c in (*ANCHORS, *sorted(data)) if c not in have]
        if missing:
            raise TopologyError(
                f"bolt {bolt.name!r}: output lacks column(s) {missing}; carry the anchoring "
                f"columns {list(ANCHORS)} of each input row and the declared columns")
        pos = F.col("_pos") if "_pos" in have else F.lit(0)
        fail = F.col("_fail").cast("string") if "_fail" in have else F.lit(None).cast("string")
        # A row for a stream the bolt does not declare would reach no consumer and vanish
        # with its record counted complete: it fails its input tuple instead, named.
        declared = sorted(bolt.outputs)
        emitted = F.col("_stream").cast("string")
        fail = F.coalesce(fail, F.when(
            emitted.isNull() | ~emitted.isin(*declared),
            F.concat(F.lit("emitted _stream="),
                     F.coalesce(F.concat(F.lit("'"), emitted, F.lit("'")), F.lit("null")),
                     F.lit(f", which is not one of its declared outputs {declared}: emit "
                           "one of those, or declare the stream in outputs"))))
        tid = F.xxhash64("_root", F.lit(bolt.name), "_stream", "_tid", pos,
                         *[F.col(c) for c in sorted(data)], F.lit(self.attempt))
        present = {c: F.col(c) for c in data}
        present.update(
            _kind=F.when(fail.isNull(), F.lit(TUPLE)).otherwise(F.lit(FAIL)),
            _stream=F.when(fail.isNull(), F.col("_stream")),
            _root=F.col("_root"), _tid=F.when(fail.isNull(), tid), _replays=F.col("_replays"),
            _error=F.when(fail.isNotNull(), F.concat(F.lit(f"bolt {bolt.name}: "), fail)))
        out = result.select(*_typed(self.cols, present))
        if not self.acker:  # no failure routing: a failed tuple is simply not emitted
            out = out.where(F.col("_kind") == TUPLE)
        return out

    def record_bolt(self, bolt: Bolt) -> None:
        stream = self.name_for(bolt.input, bolt.name)
        runner = pass_through_runner(bolt, stream, self.attempt, self.timeout_ms,
                                     columns(self.topology.streams()[bolt.input]),
                                     self.cols, self.acker)
        self.frame = self.frame.mapInArrow(runner, ", ".join(
            f"`{n}` {t}" for n, t in self.cols.items()))
        self.live = (self.live - {stream}) | set(bolt.outputs)
        self.notes = self.notes or self.acker
        self.tee(list(bolt.outputs))


def run_topology(topology: Topology, source: DataFrame, *, attempt: int, acker: bool = True,
                 tuple_timeout_ms: int = 30_000, state: StateContext | None = None,
                 max_record_bytes: int = 64 * 1024, max_key_bytes: int = 2000,
                 by_root: bool = False, shapes: Mapping[str, Shape] | None = None,
                 refusals: bool = True) -> TopologyRun:
    """Plan ``topology`` over ``source`` (partition, offset, the spout's record columns,
    replays, replayed; ``_problem`` too when the records are not payloads, see
    onceflow.spark.records).

    Lazy: ``collect()`` on the result runs it (one Spark job) and returns the outputs.
    ``by_root``: deltas keep their record's root (verify's re-run). ``shapes``: the typed
    states (onceflow.core.tables.Shape) by the sink that feeds them. ``refusals``: whether
    the spout may refuse a record (Source.may_refuse); False spares the count of refused
    records, and a record refused all the same fails the run naming it.
    """
    shapes = dict(shapes or {})
    topology.validate(shapes)
    chain = _Chain(topology, attempt, acker, tuple_timeout_ms, state)
    root = root_id("partition", "offset", "replayed")
    record = [c for c in columns(topology.spout_columns) if c not in ("partition", "offset")]
    if "payload" in record:
        size = F.octet_length("payload")
        problem = (F.when(size > max_record_bytes, F.concat(
            F.lit("oversized record ("), size.cast("string"),
            F.lit(f" bytes, over max_record_bytes={max_record_bytes})")))
            .when(F.col("payload").contains("\u0000"),
                  F.lit("payload holds a NUL character, which PostgreSQL text cannot store")))
    else:  # a decoding source found the records' problems where it read them
        problem = F.col(PROBLEM)
    # The spout, read once: the records it refuses are counted on the way (an observed
    # metric) and read again only when there are some (rare). The count is not free (the
    # observation cuts the scan's generated code in two), so it is left out when the source
    # knows there are none; a record refused then fails the run.
    spout = source.select(
        root.alias("_root"), F.xxhash64(root, F.lit("$spout"), F.lit(attempt)).alias("_tid"),
        F.col("replays").cast("int").alias("_replays"), "partition", "offset", *record,
        problem.alias("_problem"))
    observed = None
    if refusals:
        observed = Observation(f"onceflow_spout_{uuid.uuid4().hex}")
        kept = spout.observe(observed, F.count("_problem").alias("refused")) \
            .where(F.col("_problem").isNull())
    else:
        unexpected = F.concat(
            F.lit("the spout refused the record at partition "),
            F.col("partition").cast("string"), F.lit(" offset "), F.col("offset").cast("string"),
            F.lit(" ("), F.col("_problem"), F.lit("), which its source had said none of this "
                                                  "batch could be (Source.may_refuse): "
                                                  "report this to onceflow"))
        kept = spout.where(F.assert_true(F.col("_problem").isNull(), unexpected).isNull())
    chain.frame = kept.select(*_typed(chain.cols, {
        "_kind": F.lit(TUPLE), "_stream": F.lit(SPOUT), "_root": F.col("_root"),
        "_tid": F.col("_tid"), "_replays": F.col("_replays"), "partition": F.col("partition"),
        "offset": F.col("offset"), **{c: F.col(c) for c in record}}))
    chain.live = {SPOUT}
    chain.tee([SPOUT])
    for bolt in topology.bolts:
        if bolt.key:
            continue  # stateful bolts: after the verdict
        if bolt.per_record:
            chain.record_bolt(bolt)
        else:
            chain.dataframe_bolt(bolt)
    refused = spout.where(F.col("_problem").isNotNull()).select(
        F.lit(REJECT).alias("kind"), *origin(), F.lit(False).alias("replayed"),
        F.col("_problem").alias("error"), F.col("_root").alias("root"))
    return TopologyRun(chain, refused, observed, max_key_bytes, by_root, shapes)


@dataclass
class Collected:
    """A run's outputs, collected: ``table`` (the OUTPUT rows, Arrow), and as Python values
    deltas {(state, key): delta} (or {(state, key, root)} by root), rejected {(partition,
    offset): error}, failed {(partition, offset, replayed): error}, state changes {bolt:
    [(namespace, key, JSON value or None)]}. The deltas by (state, key) and the rejects are
    made from the table when first asked for: staging reads the table, and a state of a
    million keys would otherwise cost a million Python tuples per batch."""

    table: object
    _rejected: dict | None  # made from the table when first asked for (rejected)
    failed: dict
    changes: dict
    seconds: float = 0.0
    tables: dict = field(default_factory=dict)  # typed state -> Arrow rows (typed_rows)
    _deltas: dict | None = None  # made when first asked for; set by split when by root

    @property
    def rejected(self) -> dict:
        if self._rejected is None:  # a record rejected for two reasons: the least, as ever
            table = self.table
            rows = table.filter(pc.equal(table.column("kind"), REJECT))
            self._rejected = {}
            for position, error in zip(zip(rows.column("partition").to_pylist(),
                                           rows.column("offset").to_pylist(), strict=True),
                                       rows.column("error").to_pylist(), strict=True):
                if position not in self._rejected or error < self._rejected[position]:
                    self._rejected[position] = error
        return self._rejected

    @property
    def deltas(self) -> dict:
        if self._deltas is not None:
            return self._deltas
        table = self.table
        deltas = table.filter(pc.equal(table.column("kind"), DELTA))
        keys = zip(deltas.column("state_name").to_pylist(), deltas.column("key").to_pylist(),
                   strict=True)
        self._deltas = dict(zip(keys, deltas.column("delta").to_pylist(), strict=True))
        return self._deltas


class TopologyRun:
    """A planned run: ``output`` (one DataFrame, the OUTPUT columns, without the records
    the spout refused) and ``collect()``."""

    def __init__(self, chain: _Chain, refused: DataFrame, observed: Observation | None,
                 max_key_bytes: int, by_root: bool,
                 shapes: Mapping[str, Shape] | None = None):
        self.chain, self.refused, self.observed = chain, refused, observed
        self.max_key_bytes, self.by_root = max_key_bytes, by_root
        self.shapes = dict(shapes or {})
        self.kept: DataFrame | None = None  # the outputs later passes read (cached)
        self._output: DataFrame | None = None
        # The acker's verdict on a topology without stateful bolts is settled by passes
        # (_settle); with stateful bolts it is one aggregation by record, in the plan.
        self.settles = chain.acker and not chain.topology.stateful()
        # Count and reject sinks only: the first pass aggregates before it checks keys
        # (_lean); typed states (JSON keys) and stateful bolts take the exact plan.
        self.lean = None if self.shapes or chain.topology.stateful() else self._lean()

    @property
    def output(self) -> DataFrame:
        """The exact plan's outputs (see _rows), planned when first asked for: a batch the
        lean plan settles never needs it (planning it is costly in a local session, where
        each DataFrame step is a call into the JVM)."""
        if self._output is None:
            self._output = self._plan()
        return self._output

    def _bad_text(self, key, what: str):
        """Why a text key PostgreSQL cannot store or index fails its record (else null)."""
        limit = self.max_key_bytes
        return (F.when(key.isNull(), F.lit(f"{what} is null"))
                .when(key.contains("\u0000"),
                      F.lit(f"{what} holds a NUL character, which PostgreSQL text cannot "
                            "store"))
                .when(F.octet_length(key) > limit,
                      F.concat(F.lit(f"{what} of "), F.octet_length(key).cast("string"),
                               F.lit(f" bytes is over max_key_bytes={limit} (a PostgreSQL "
                                     "index entry must fit in a third of a page)"))))

    def _bad_key(self, shape: Shape | None = None):
        """Why a tuple's key, or a typed tuple's values, cannot be stored (else null): a
        record that would break staging, or one whose value its declared type cannot hold
        (1780.25 in a numeric(5,2)), fails alone instead of failing its batch for ever,
        named with its table, column, value and type. The first reason in the declaration's
        order is the record's."""
        if shape is None:
            return self._bad_text(F.col("key").cast("string"), "state key")
        keys = {c for c, _ in shape.key}
        checked: set[str] = set()
        reasons = []
        for column, pg_type, whats in shape.typed_inputs():
            value = F.col(column)
            if column in keys and column not in checked:
                reasons.append(self._bad_text(value.cast("string"), f"key column {column}")
                               if pg_type == "text" else
                               F.when(value.isNull(), F.lit(f"key column {column} is null")))
            elif pg_type == "text":
                reasons.append(F.when(value.cast("string").contains("\u0000"), F.lit(
                    f"column {column} holds a NUL character, which PostgreSQL text cannot "
                    "store")))
            checked.add(column)
            if pg_type != "text":  # the value fits the declared type (numeric(p,s): digits)
                reasons.append(F.when(
                    value.isNotNull() & value.try_cast(spark_type(pg_type)).isNull(),
                    F.concat(F.lit(f"{' and '.join(whats)}: value "), value.cast("string"),
                             F.lit(f" does not fit {pg_type}"))))
        return F.coalesce(*reasons) if reasons else F.lit(None).cast("string")

    def _typed_row(self, shape: Shape):
        """A typed state's tuple as one JSON text (its inputs and its order), which passes
        the verdict like a count state's key; _typed_states decodes it."""
        fields = [F.col(c) for c in shape.inputs()]
        if shape.ordered:
            fields.append(_rank(shape.order_by, self.chain.cols).alias(ORDER))
        return F.to_json(F.struct(*fields), JSON_OPTIONS)

    def _rows(self, frame: DataFrame, sinks: list[tuple[str, object]], pending: dict
              ) -> DataFrame:
        """Every row of ``frame`` as an output row: a delta of a count sink (a key PostgreSQL
        cannot store fails its record), a rejected record, a failure note, a state change,
        or a pending tuple of a stateful bolt's input (``_pending``, with its columns).
        ``sinks``: (stream, Sink) pairs.

        Two projections: the first finds, once per row, what is wrong with a sink tuple's key
        (``_bad``) and the key itself (a typed tuple's JSON); the second reads them. Written
        as one, the checks would be evaluated again inside every expression that tests the
        row's kind (Spark keeps a projection of a costly column referenced several times)."""
        chain = self.chain
        bad, state = F.lit(None).cast("string"), F.lit(None).cast("string")
        counted, rejected = F.lit(False), F.lit(False)
        key = F.col("key").cast("string") if "key" in chain.cols else F.lit(None).cast("string")
        typed_tuple = F.lit(False)  # a typed state's tuple counts once: no delta column
        error = F.col("_error")
        for stream, sink in sinks:
            mine = (F.col("_kind") == TUPLE) & (F.col("_stream") == stream)
            if sink.state:
                shape = self.shapes.get(sink.state)
                where = f"table {shape.name}: " if shape else f"sink {sink.state}: "
                bad = F.when(mine, F.concat(F.lit(where), self._bad_key(shape))).otherwise(bad)
                state = F.when(mine, F.lit(sink.state)).otherwise(state)
                counted = counted | mine
                if shape is not None:
                    key = F.when(mine, self._typed_row(shape)).otherwise(key)
                    typed_tuple = typed_tuple | mine
            else:
                rejected = rejected | mine
                error = F.when(mine, F.col("error").cast("string")).otherwise(error)
        waiting = F.lit(False)
        for stream in pending:
            waiting = waiting | ((F.col("_kind") == TUPLE) & (F.col("_stream") == stream))
        delta = F.col("delta").cast("long") if "delta" in chain.cols else F.lit(1).cast("long")
        delta = F.when(typed_tuple, F.lit(1).cast("long")).otherwise(delta)
        extra = sorted({c for b in pending.values()
                        for c in columns(chain.topology.streams()[b.input])})
        first = frame.select(
            "_root", "_tid", "_replays", "_stream", "_kind", "_skey", "_sval", "_seq",
            waiting.alias("_pending"), counted.alias("_counted"), rejected.alias("_rejected"),
            state.alias("state_name"), bad.alias("_bad"), key.alias("_key"),
            delta.alias("_delta"), error.alias("_err"),
            *[F.col(c).alias(f"in_{c}") for c in extra])
        is_bad = F.col("_bad").isNotNull()
        kind = (F.when(F.col("_kind") == FAIL, F.lit(FAILED))
                .when(F.col("_kind") == STATE, F.lit(CHANGE))
                .when(F.col("_counted") & ~is_bad, F.lit(DELTA))
                .when(F.col("_counted"), F.lit(FAILED if chain.acker else REJECT))
                .when(F.col("_rejected"), F.lit(REJECT)))
        return first.select(
            "_root", "_tid", "_replays", "_stream", "_pending", kind.alias("kind"),
            "state_name",
            F.when(F.col("_kind") == STATE, F.col("_skey"))
            .when(F.col("_counted") & ~is_bad, F.col("_key")).alias("out_key"),
            F.when(F.col("_counted") & ~is_bad,
                   F.coalesce("_delta", F.lit(1).cast("long"))).alias("delta"),
            F.when(F.col("_counted") & is_bad, F.col("_bad")).otherwise(F.col("_err"))
            .alias("error"), "_sval", "_seq", *[f"in_{c}" for c in extra])

    def _lean(self) -> DataFrame:
        """The outputs of a topology whose sinks are counts and rejects, aggregated first and
        checked after: the OUTPUT rows plus ``_bad``, why a count row's key cannot be stored.

        The exact plan (_rows) checks every tuple's key before the aggregation, because a key
        PostgreSQL cannot store fails (or, without the acker, rejects) its record, and asks
        each tuple's kind and state through comparisons of its stream name, per tuple, a
        large share of the topology's CPU. Here a tuple is given
        the number of its output (a count state, rejected, a failure note) once, the rows
        are aggregated by (output, key, root, error), and the keys are checked on the
        aggregate, a few thousand rows. A bad key is rare and its records are not known
        here: ``_first_pass`` then runs the exact plan instead."""
        chain = self.chain
        counts = [(chain.name_for(s.stream, f"$sink{i}"), s)
                  for i, s in enumerate(chain.topology.sinks) if s.state]
        rejects = [chain.name_for(s.stream, f"$sink{i}")
                   for i, s in enumerate(chain.topology.sinks) if not s.state]
        states = list(dict.fromkeys(sink.state for _, sink in counts))  # two sinks may feed one
        rejected, failed = len(states), len(states) + 1  # output numbers after the states
        tuple_ = F.col("_kind") == TUPLE
        out = F.when(F.col("_kind") == FAIL, F.lit(failed))
        for stream, sink in counts:
            out = out.when(tuple_ & (F.col("_stream") == stream), F.lit(states.index(sink.state)))
        if rejects:
            out = out.when(tuple_ & F.col("_stream").isin(*rejects), F.lit(rejected))
        key = F.col("key").cast("string") if "key" in chain.cols else F.lit(None).cast("string")
        delta = F.col("delta").cast("long") if "delta" in chain.cols else F.lit(None)
        error = F.col("error").cast("string") if "error" in chain.cols \
            else F.lit(None).cast("string")
        numbered = chain.frame.select(F.col("_root"), out.alias("_out"), key.alias("key"),
                                      delta.alias("_delta"), error.alias("_err"),
                                      F.col("_error"))
        out = F.col("_out")
        counted = out < rejected
        rows = numbered.select(
            out, F.when(counted, F.col("key")).alias("key"),
            F.when(counted, F.coalesce("_delta", F.lit(1).cast("long"))).otherwise(
                F.lit(0).cast("long")).alias("delta"),
            F.when((out >= rejected) | F.lit(self.by_root), F.col("_root")).alias("root"),
            F.when(out == rejected, F.col("_err")).when(out == failed, F.col("_error"))
            .alias("error"))
        grouped = rows.groupBy("_out", "key", "root", "error").agg(F.sum("delta").alias("delta"))
        kind = F.when(counted, F.lit(DELTA)).when(out == rejected, F.lit(REJECT)) \
            .when(out == failed, F.lit(FAILED))
        state = F.lit(None).cast("string")
        for n, name in enumerate(states):
            state = F.when(out == n, F.lit(name)).otherwise(state)
        return grouped.select(
            kind.cast("int").alias("kind"), state.alias("state_name"), "key", "delta",
            *origin("root"),
            (F.shiftright("root", 62).bitwiseAND(F.lit(1)) == 1).alias("replayed"), "error",
            F.lit(None).cast("string").alias("bolt"),
            F.lit(None).cast("string").alias("namespace"),
            F.lit(None).cast("string").alias("value"), "root",
            F.when(counted, self._bad_text(F.col("key"), "state key")).alias("_bad"))

    def _first_pass(self) -> pa.Table:
        """The outputs as if nothing failed: the lean plan's, unless it found a key that
        cannot be stored (then the exact plan's, which fails or rejects its records)."""
        if self.lean is not None:
            table = self.lean.toArrow()
            bad = table.column("_bad")
            if bad.null_count == len(bad):
                return table.drop_columns(["_bad"])
        return self.output.toArrow()

    def _plan(self, excluded: DataFrame | None = None) -> DataFrame:
        chain = self.chain
        topology = chain.topology
        stateful = {chain.name_for(b.input, b.name): b for b in topology.stateful()}
        fed = {s for b in stateful.values() for s in b.outputs}
        sinks = [(chain.name_for(s.stream, f"$sink{i}"), s)
                 for i, s in enumerate(topology.sinks) if s.stream not in fed]
        rows = self._rows(chain.frame, sinks, stateful)
        if not chain.acker:
            return self._finish(rows.select(
                "kind", "state_name", F.col("out_key").alias("key"),
                F.coalesce("delta", F.lit(0).cast("long")).alias("delta"),
                F.when(F.col("kind") == REJECT, F.col("_root")).alias("root"), "error"))
        if not stateful:
            if excluded is not None:  # a later pass: see _settle
                if self.kept is None:
                    self.kept = chain.cache(rows.where(
                        F.col("kind").isin(DELTA, REJECT, FAILED)).select(
                        "_root", "kind", "state_name", "out_key", "delta", "error"))
                rows = self.kept
            return self._finish(self._verdict(rows, excluded))
        # With stateful bolts, the verdict is one aggregation by record that also gathers
        # each complete record's pending tuples for them.
        aggs = [
            F.bool_or(F.col("kind") == FAILED).alias("failed"),
            F.min(F.when(F.col("kind") == FAILED, F.col("error"))).alias("why"),
            F.collect_list(F.when(F.col("kind") == DELTA, F.struct(
                "state_name", F.col("out_key").alias("key"), "delta"))).alias("deltas"),
            F.min(F.when(F.col("kind") == REJECT, F.col("error"))).alias("rejected")]
        if stateful:
            inputs = [c for c in rows.columns if c.startswith("in_")]
            aggs.append(F.collect_list(F.when(F.col("_pending"), F.struct(
                "_tid", "_replays", "_stream", *inputs))).alias("waiting"))
        per_root = rows.groupBy("_root").agg(*aggs)
        return self._with_stateful(chain.cache(per_root), stateful)

    def _verdict(self, rows: DataFrame, excluded: DataFrame | None) -> DataFrame:
        """Every delta, rejection and failure note of the records not ``excluded`` (a
        DataFrame of ``_root``: the records already found failed, left out whole by a
        broadcast anti-join). A failure note keeps its root and reason, not its state."""
        kept = rows  # rows of no kind (a tuple no sink reads) go after the aggregation
        if excluded is not None:
            kept = kept.join(F.broadcast(excluded), "_root", "left_anti")
        return kept.select(
            "kind", F.when(F.col("kind") != FAILED, F.col("state_name")).alias("state_name"),
            F.col("out_key").alias("key"),
            F.coalesce("delta", F.lit(0).cast("long")).alias("delta"),
            F.col("_root").alias("root"), "error")

    def _settle(self) -> pa.Table:
        """The acker's verdict, all or nothing per record, in as few passes as the data
        allows. Pass 1 computes every output as if nothing failed. When it holds no
        failure note, that is the answer: one pass, no shuffle by record. Otherwise the
        failed records are left out whole and the batch is computed again, until a pass
        finds no failure outside the records already left out (a bolt may fail a record
        in one pass and not in another: a timeout); the failed records then become one
        failure row each, with their least reason. The second pass caches the outputs it
        computes, and any later pass reads them: the bolts run at most twice, and the
        passes end by the third (a fourth happens only if the cache was lost)."""

        failed: dict[int, str] = {}
        plan = None
        for _ in range(MAX_PASSES):
            table = self._first_pass() if plan is None else plan.toArrow()
            notes = table.filter(pc.equal(table.column("kind"), FAILED))
            new: dict[int, str] = {}
            for root, error in zip(notes.column("root").to_pylist(),
                                   notes.column("error").to_pylist(), strict=True):
                why = error or "tuple tree incomplete"
                if root not in failed and (root not in new or why < new[root]):
                    new[root] = why
            if not new:
                break
            failed.update(new)
            spark = self.chain.frame.sparkSession
            plan = self._plan(spark.createDataFrame(pa.table(
                {"_root": pa.array(list(failed), pa.int64())})))
        else:
            raise RuntimeError(
                f"the topology's bolts failed new records on each of {MAX_PASSES} passes over "
                "the batch: the attempt fails and is retried")
        if not failed:
            return table
        roots = sorted(failed)
        columns = {
            "kind": pa.array([FAILED] * len(roots), pa.int32()),
            "delta": pa.array([0] * len(roots), pa.int64()),
            "partition": pa.array([(r >> OFFSET_BITS) & MAX_PARTITION for r in roots],
                                  pa.int32()),
            "offset": pa.array([r & MAX_OFFSET for r in roots], pa.int64()),
            "replayed": pa.array([bool((r >> 62) & 1) for r in roots], pa.bool_()),
            "error": pa.array([failed[r] for r in roots], pa.string()),
            "root": pa.array(roots, pa.int64())}
        return pa.concat_tables([table, _rows_like(table.schema, columns)])

    def _explode(self, per_root: DataFrame, also_failed=None) -> DataFrame:
        """One output row per delta of a complete record, per rejected record, per failed
        record (for the backflow). ``also_failed``: a further failure reason (a stateful
        bolt's) that fails a record complete so far."""
        item = "struct<kind:int,state_name:string,key:string,delta:bigint,error:string>"
        failed, why = F.col("failed"), F.col("why")
        if also_failed is not None:
            failed = failed | also_failed.isNotNull()
            why = F.coalesce(why, also_failed)
        fail = F.array(F.struct(F.lit(FAILED).alias("kind"), F.lit(None).cast("string"),
                                F.lit(None).cast("string"), F.lit(0).cast("long"),
                                F.coalesce(why, F.lit("tuple tree incomplete")))
                       .cast(item))
        ok = F.transform("deltas", lambda d: F.struct(
            F.lit(DELTA), d["state_name"], d["key"], d["delta"],
            F.lit(None).cast("string")).cast(item))
        rejected = F.when(F.col("rejected").isNotNull(), F.array(F.struct(
            F.lit(REJECT), F.lit(None).cast("string"), F.lit(None).cast("string"),
            F.lit(0).cast("long"), F.col("rejected")).cast(item))).otherwise(
            F.array().cast(f"array<{item}>"))
        items = F.when(failed, fail).otherwise(F.concat(ok, rejected))
        return per_root.select("_root", F.explode(items).alias("o")).select(
            "o.kind", "o.state_name", "o.key", "o.delta",
            F.col("_root").alias("root"), "o.error")

    def _with_stateful(self, per_root: DataFrame, stateful: dict) -> DataFrame:
        """Stateful bolts run on the inputs of records complete everywhere else; a record that
        fails in one is dropped as a whole; state changes count for complete records only,
        the last change per key."""

        chain = self.chain
        waiting = per_root.where(~F.col("failed")).select(
            "_root", F.explode("waiting").alias("w")).select("_root", "w.*")
        outputs = None
        for stream, bolt in stateful.items():
            data = columns(chain.topology.streams()[bolt.input])
            tuples = waiting.where(F.col("_stream") == stream).select(
                "_root", "_tid", "_replays", *[F.col(f"in_{c}").alias(c) for c in data])
            out_types = {}
            for ddl in bolt.outputs.values():
                out_types.update(column_types(ddl))
            runner = record_runner(bolt, chain.attempt, chain.timeout_ms, out_types,
                                   chain.state)
            ddl = ", ".join(f"`{n}` {t}" for n, t in {**RECORD_META, **out_types}.items())
            ran = tuples.repartition(bolt.shards, bolt.key).mapInArrow(runner, ddl)
            # state changes: "bolt|namespace" in _stream, so that each bolt's are found again
            ran = ran.withColumn("_stream", F.when(
                F.col("_kind") == STATE, F.concat(F.lit(f"{bolt.name}|"), F.col("_stream")))
                .otherwise(F.col("_stream")))
            ran = ran.select(*_typed(chain.cols, {c: F.col(c) for c in ran.columns}))
            outputs = ran if outputs is None else outputs.unionByName(ran)
        sinks = [(s.stream, s) for s in chain.topology.sinks
                 if any(s.stream in b.outputs for b in stateful.values())]
        rows = chain.cache(self._rows(outputs, sinks, {}))
        verdict = rows.groupBy("_root").agg(
            F.min(F.when(F.col("kind") == FAILED, F.col("error"))).alias("stateful_why"))
        bad = verdict.where(F.col("stateful_why").isNotNull())
        first = self._explode(per_root.join(bad, "_root", "left"), F.col("stateful_why"))
        good = rows.join(bad.select("_root"), "_root", "left_anti")
        more = good.where(F.col("kind") == DELTA).select(
            "kind", "state_name", F.col("out_key").alias("key"), "delta",
            F.lit(None).cast("bigint").alias("root"), F.lit(None).cast("string").alias("error"))
        changes = good.where(F.col("kind") == CHANGE).groupBy("_stream", "out_key").agg(
            F.max_by("_sval", "_seq").alias("value"), F.first("state_name").alias("s"))
        bolt_of = F.lit(None).cast("string")
        for bolt in stateful.values():
            bolt_of = F.when(F.col("_stream").startswith(f"{bolt.name}|"),
                             F.lit(bolt.name)).otherwise(bolt_of)
        change_rows = changes.select(
            F.lit(CHANGE).alias("kind"), F.lit(None).cast("string").alias("state_name"),
            F.col("out_key").alias("key"), F.lit(0).cast("long").alias("delta"),
            F.lit(None).cast("int").alias("partition"), F.lit(None).cast("long").alias("offset"),
            F.lit(None).cast("boolean").alias("replayed"),
            F.lit(None).cast("string").alias("error"), bolt_of.alias("bolt"),
            F.substring_index("_stream", "|", -1).alias("namespace"), "value",
            F.lit(None).cast("bigint").alias("root"))
        return self._finish(first.unionByName(more)).unionByName(change_rows,
                                                                 allowMissingColumns=True)

    def _finish(self, outputs: DataFrame) -> DataFrame:
        """Sum the deltas by (state, key) (and record, with by_root); rejected and failed
        records stay one row each (collect adds the records the spout refused).

        A typed state's tuples (JSON in ``key``) are decoded first into its own columns
        ``_t<i>_<column>`` and grouped by their key columns in the same aggregation as the
        count states' deltas: one shuffle for every state. An append table's identical rows
        are grouped too, then copied back (``delta`` times)."""
        root = F.when((F.col("kind") != DELTA) | F.lit(self.by_root), F.col("root"))
        rows = outputs.withColumn("root", root)
        aggs = [F.sum("delta").alias("delta")]
        appended = F.lit(False)
        typed: list[str] = []  # the typed states' columns (no schema round trip to find them)
        if self.shapes:
            rows, aggs, appended, typed = self._decode_typed(rows, aggs)
        # Rows of other kinds (a tuple no sink reads) are one group here, dropped from the
        # collected table (collect): a filter on the kind would be pushed below the
        # aggregation and evaluate the kind (the key checks) twice per row.
        grouped = rows.groupBy("kind", "state_name", "key", "root", "error").agg(*aggs)
        if self.shapes:  # an append table's rows come back as many times as they were
            copies = F.when(appended, F.array_repeat(F.lit(1), F.col("delta").cast("int")))
            grouped = grouped.withColumn("_copy", F.explode(F.coalesce(
                copies, F.array(F.lit(1))))).drop("_copy")
        out = grouped.select(
            "kind", "state_name", "key", "delta", *origin("root"),
            (F.shiftright("root", 62).bitwiseAND(F.lit(1)) == 1).alias("replayed"), "error",
            F.lit(None).cast("string").alias("bolt"),
            F.lit(None).cast("string").alias("namespace"),
            F.lit(None).cast("string").alias("value"), "root", *typed)
        return out

    def _decode_typed(self, rows: DataFrame, aggs: list):
        """Each typed state's JSON tuples decoded into its columns, ``key`` replaced by its
        key columns' JSON (what the aggregation groups by), and the aggregations of its
        measures (see onceflow.core.tables: sum, count, min, max, last), and the names of
        the columns these aggregations give."""
        cols = self.chain.cols
        decoded, key = [], F.col("key")
        appended = F.lit(False)
        for i, (name, shape) in enumerate(self.shapes.items()):
            mine = (F.col("kind") == DELTA) & (F.col("state_name") == name)
            schema = ", ".join(f"`{c}` {cols[c]}" for c in shape.inputs())
            if shape.ordered:
                schema += f", `{ORDER}` bigint"
            decoded.append(F.when(mine, F.from_json("key", schema, JSON_OPTIONS)).alias(f"_j{i}"))
            if shape.append:
                appended = appended | (F.col("state_name") == name)
        rows = rows.select("*", *decoded)  # parsed once per row, then read by column
        keyed = []
        names: list[str] = []
        for i, (name, shape) in enumerate(self.shapes.items()):
            j = F.col(f"_j{i}")

            def col(column: str, pg_type: str, j=j):
                return j[column].cast(spark_type(pg_type))

            def out(column: str, i=i) -> str:
                return f"_t{i}_{column}"

            if shape.append:
                keyed += [col(c, t).alias(out(c)) for c, t in shape.columns]
                aggs += [F.first(out(c)).alias(out(c)) for c, _ in shape.columns]
                names += [out(c) for c, _ in shape.columns]
                continue
            keyed += [col(c, t).alias(out(c)) for c, t in shape.key]
            aggs += [F.first(out(c)).alias(out(c)) for c, _ in shape.key]
            names += [out(c) for c, _ in shape.key]
            key = F.when(F.col("state_name") == name, F.to_json(F.struct(
                *[j[c] for c, _ in shape.key]), JSON_OPTIONS)).otherwise(key)
            for measure_name, measure in shape.measures:
                if measure.column:
                    keyed.append(col(measure.column, measure.type).alias(out(measure_name)))
                stored = spark_type(measure.staged_type())
                value = F.col(out(measure_name))
                if measure.agg == "sum":
                    agg = F.sum(value * F.col("delta")).cast(stored)
                elif measure.agg == "count":
                    agg = F.sum(F.col("delta") if measure.column is None
                                else F.when(value.isNotNull(), F.col("delta")).otherwise(0))
                    agg = agg.cast("bigint")
                elif measure.agg in ("min", "max"):
                    agg = getattr(F, measure.agg)(value)
                else:
                    agg = F.max_by(value, F.col(out(ORDER)))
                aggs.append(agg.alias(out(measure_name)))
                names.append(out(measure_name))
            if shape.ordered:
                keyed.append(j[ORDER].alias(out(ORDER)))
                aggs.append(F.max(out(ORDER)).alias(out(ORDER)))
                names.append(out(ORDER))
        rows = rows.select("kind", "state_name", key.alias("key"), "root", "error", "delta",
                           *keyed)
        return rows, aggs, appended, names

    def collect(self) -> Collected:
        """Run it (one Spark job; with the acker, one more per pass after a failure, see
        _settle; one more when the spout refused records) and split the outputs."""
        started = time.monotonic()
        try:
            table = self._settle() if self.settles else self._first_pass()
            # rows of no kind (see _finish); without the acker no failure is routed
            kept = (DELTA, REJECT, FAILED, CHANGE) if self.chain.acker else (DELTA, REJECT)
            table = table.filter(pc.is_in(table.column("kind"), pa.array(kept, pa.int32())))
            if self.observed is not None and self.observed.get.get("refused"):
                # read again for them: few, named
                refused = self.refused.toArrow()
                table = pa.concat_tables([table, _rows_like(table.schema, {
                    c: refused.column(c) for c in refused.column_names})])
        finally:
            self.unpersist()
        return split(table, self.by_root, time.monotonic() - started, self.shapes)

    def unpersist(self) -> None:
        for df in self.chain.cached:
            df.unpersist()
        self.chain.cached.clear()


def _rows_like(schema, columns: Mapping[str, object]):
    """Output rows made in Python (Arrow arrays by column) with ``schema``: the other
    columns null."""
    n = len(next(iter(columns.values())))
    return pa.table({f.name: columns[f.name].cast(f.type) if f.name in columns
                     else pa.nulls(n, f.type) for f in schema}, schema=schema)


def typed_rows(table, shapes: Mapping[str, Shape], by_root: bool = False) -> dict:
    """Each typed state's rows in an OUTPUT table: Arrow tables with the state's staging
    columns (and ``root``, by_root)."""

    out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        rows = table.filter(pc.and_(pc.equal(table.column("kind"), DELTA),
                                    pc.equal(table.column("state_name"), name)))
        names = [c for c, _ in shape.staged()]
        picked = rows.select([f"_t{i}_{c}" for c in names] + (["root"] if by_root else []))
        out[name] = picked.rename_columns(names + (["root"] if by_root else []))
    return out


def split(table, by_root: bool = False, seconds: float = 0.0,
          shapes: Mapping[str, Shape] | None = None) -> Collected:
    """An OUTPUT table as Python values (see Collected)."""

    out = Collected(table, None, {}, {}, seconds)
    if shapes:
        out.tables = typed_rows(table, shapes, by_root)
        table = table.filter(pc.invert(pc.fill_null(pc.is_in(
            table.column("state_name"), pa_array(list(shapes))), False)))
        out.table = table
    # rejects: made from the table when asked for (a batch may have thousands; staging reads
    # the table)
    small = table.filter(pc.is_in(table.column("kind"), pa.array(
        (DELTA, FAILED, CHANGE) if by_root else (FAILED, CHANGE), pa.int32())))
    if by_root:
        out._deltas = {}
    for row in small.to_pylist():
        kind = row["kind"]
        if kind == DELTA:
            k = (row["state_name"], row["key"], row["root"])
            out._deltas[k] = out._deltas.get(k, 0) + row["delta"]
        elif kind == FAILED:
            out.failed[(row["partition"], row["offset"], row["replayed"])] = row["error"]
        elif kind == CHANGE:
            out.changes.setdefault(row["bolt"], []).append(
                (row["namespace"], row["key"], row["value"]))
    return out
