"""Running a topology over a batch in Spark in one pass over the data.

The topology is compiled into a linear chain over one wide DataFrame, the **frame**
(onceflow.spark.frame: its rows, the bolts, the tees). What the frame becomes:

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

Beside it: the key checks (onceflow.spark.keys), the typed states' encoding
(onceflow.spark.typed_states), and the collected outputs (onceflow.spark.collected).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, Observation
from pyspark.sql import functions as F

from onceflow.core.tables import Shape
from onceflow.core.topology import SPOUT, StateContext, Topology, column_types, columns
from onceflow.sources.json_records import PROBLEM
from onceflow.spark.collected import (
    CHANGE,
    DELTA,
    FAILED,
    REJECT,
    Collected,
    rows_like,
    split,
)
from onceflow.spark.frame import FAIL, STATE, TUPLE, Chain, frame_select
from onceflow.spark.ids import MAX_OFFSET, MAX_PARTITION, OFFSET_BITS, origin, root_id
from onceflow.spark.keys import bad_key, bad_text
from onceflow.spark.record_bolts import RECORD_META, record_runner
from onceflow.spark.typed_states import decode_typed, typed_row

# The acker's verdict: at most this many passes over a batch (see TopologyRun._settle).
MAX_PASSES = 4


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
    chain = Chain(topology, attempt, acker, tuple_timeout_ms, state)
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
    chain.frame = kept.select(*frame_select(chain.cols, {
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


class TopologyRun:
    """A planned run: ``output`` (one DataFrame, the OUTPUT columns, without the records
    the spout refused) and ``collect()``."""

    def __init__(self, chain: Chain, refused: DataFrame, observed: Observation | None,
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
                why = bad_key(self.max_key_bytes, shape)
                bad = F.when(mine, F.concat(F.lit(where), why)).otherwise(bad)
                state = F.when(mine, F.lit(sink.state)).otherwise(state)
                counted = counted | mine
                if shape is not None:
                    key = F.when(mine, typed_row(shape, chain.cols)).otherwise(key)
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
            F.when(counted, bad_text(F.col("key"), "state key", self.max_key_bytes)).alias("_bad"))

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
        return pa.concat_tables([table, rows_like(table.schema, columns)])

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
            ran = ran.select(*frame_select(chain.cols, {c: F.col(c) for c in ran.columns}))
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
            decoded = decode_typed(self.shapes, self.chain.cols, rows, aggs)
            rows, aggs, appended, typed = (decoded.rows, decoded.aggs, decoded.appended,
                                           decoded.columns)
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
                table = pa.concat_tables([table, rows_like(table.schema, {
                    c: refused.column(c) for c in refused.column_names})])
        finally:
            self.unpersist()
        return split(table, self.by_root, time.monotonic() - started, self.shapes)

    def unpersist(self) -> None:
        for df in self.chain.cached:
            df.unpersist()
        self.chain.cached.clear()
