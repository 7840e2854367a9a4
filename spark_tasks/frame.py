"""The frame: a topology compiled into a linear chain over one wide DataFrame.

A row is a tuple of some stream (``_kind`` "tuple", ``_stream`` its name, the stream's columns
set), or a note for the end: a failure ("fail": the record's tree cannot complete) or a state
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

What the frame's rows become at the end (outputs, the acker's verdict) is onceflow.spark.runner.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pyspark import StorageLevel
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from onceflow.core.topology import ANCHORS, Bolt, StateContext, Topology, TopologyError, columns
from onceflow.spark.record_bolts import pass_through_runner

TUPLE, FAIL, STATE = "tuple", "fail", "state"
# Notes' and state changes' columns, besides the anchors (_root, _tid, _replays).
META = {"_kind": "string", "_stream": "string", "_root": "bigint", "_tid": "bigint",
        "_replays": "int", "_error": "string", "_skey": "string", "_sval": "string",
        "_seq": "bigint"}


def frame_columns(topology: Topology) -> dict[str, str]:
    """Every column of the frame and its Spark type (META, then the streams' columns: one
    type per name, Topology.typed_columns)."""
    return {**META, **topology.typed_columns()}


def frame_select(names: Mapping[str, str], present: dict) -> list:
    """A select list in frame order: what ``present`` gives, typed nulls for the rest."""
    return [(present[n] if n in present else F.lit(None)).cast(t).alias(n)
            for n, t in names.items()]


@dataclass
class Chain:
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
        out = result.select(*frame_select(self.cols, present))
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
