"""The runtime of per-record Python bolts: a mapInArrow function per bolt that calls the bolt's
function (or a StatefulBolt's ``execute``) once per tuple, under its time budget.

- ``pass_through_runner``: over the whole frame (onceflow.spark.chain): the rows of the bolt's
  input stream are replaced by its outputs (and a failure note when it raises or runs out of
  time), every other row passes through as it is, in Arrow, untouched by Python;
- ``record_runner``: over a stateful bolt's own input: its tuples, failures and state
  changes (one row per put or delete, with its record).

The time budget: a periodic timer (SIGALRM every few milliseconds, in the Python worker's
main thread) interrupts a call that has run past ``tuple_timeout_ms``; the per-call cost is
two clock reads, not two system calls.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc

from onceflow.core.topology import Bolt, StateContext, TopologyError, columns
from onceflow.kvstate import KeyValueState, open_provider
from onceflow.kvstate.base import DELETED as _DELETED
from onceflow.spark.acker import ACK, FAIL
from onceflow.spark.ids import blake64

STATE_FIELDS = ("_skey", "_sval", "_seq")


class TupleTimeout(TimeoutError):
    """A per-record bolt call ran past ``tuple_timeout_ms``."""


class _Watchdog:
    """Interrupts a per-record bolt call that runs past its budget: a periodic real-time
    timer whose SIGALRM handler raises TupleTimeout inside a call that started too long ago.
    Signals reach only the main thread (where Spark's Python worker runs a mapInArrow
    function); elsewhere the budget is checked when the call returns."""

    def __init__(self, timeout_ms: int) -> None:
        self.limit = timeout_ms / 1000
        self.timeout_ms = timeout_ms
        self.started: float | None = None
        self.armed = threading.current_thread() is threading.main_thread()
        self.previous = None
        if self.armed:
            self.previous = signal.signal(signal.SIGALRM, self._tick)
            tick = min(0.05, max(0.005, self.limit / 4))
            signal.setitimer(signal.ITIMER_REAL, tick, tick)

    def _tick(self, signum, frame) -> None:
        started = self.started
        if started is not None and time.perf_counter() - started > self.limit:
            self.started = None
            raise TupleTimeout(f"interrupted after {self.timeout_ms} ms, over "
                               f"tuple_timeout_ms={self.timeout_ms}")

    def call(self, fn, values: dict) -> list:
        """``fn(values)``'s outputs, as a list, within the budget."""
        self.started = started = time.perf_counter()
        try:
            outputs = list(fn(values) or ())
        finally:
            self.started = None
        elapsed = time.perf_counter() - started
        if elapsed > self.limit:
            raise TupleTimeout(f"took {elapsed * 1000:.0f} ms, over "
                               f"tuple_timeout_ms={self.timeout_ms}")
        return outputs

    def close(self) -> None:
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous or signal.SIG_DFL)


_ARROW = {"string": "string", "int": "int32", "bigint": "int64", "smallint": "int16",
          "tinyint": "int8", "double": "float64", "float": "float32", "boolean": "bool_",
          "date": "date32", "binary": "binary"}


def arrow_schema(cols: dict[str, str]):
    """The Arrow schema of Spark columns (name -> type), made where no Spark session is."""
    fields = []
    for name, kind in cols.items():
        if kind in _ARROW:
            arrow = getattr(pa, _ARROW[kind])()
        elif kind.startswith("timestamp"):
            arrow = pa.timestamp("us", tz="UTC") if kind == "timestamp" else pa.timestamp("us")
        elif kind.startswith("decimal"):
            p, _, sc = kind[kind.index("(") + 1:kind.index(")")].partition(",")
            arrow = pa.decimal128(int(p), int(sc or 0))
        else:
            raise TopologyError(f"column {name!r} is {kind}: a Python bolt's columns must be "
                                "of a simple type (string, int, bigint, double, boolean, "
                                "decimal, date, timestamp, binary)")
        fields.append(pa.field(name, arrow))
    return pa.schema(fields)


def _emit(bolt: Bolt, outputs: list, single: str | None) -> list[tuple[str, dict]]:
    out = []
    for item in outputs:
        stream, values = (single, item) if single else item
        if stream not in bolt.outputs:
            raise TopologyError(f"emitted to stream {stream!r}, which is not one of its "
                                f"declared outputs {sorted(bolt.outputs)}: emit to one of "
                                "those, or declare the stream in outputs")
        out.append((stream, values))
    return out


def pass_through_runner(bolt: Bolt, stream: str, attempt: int, timeout_ms: int,
                        in_cols: list[str], frame_cols: dict[str, str], acker: bool):
    """The mapInArrow function of a per-record bolt over the frame (see the module
    docstring). A failure becomes a note ``_kind`` "fail" with the reason (dropped without
    the acker: Storm's unreliable mode)."""
    single = next(iter(bolt.outputs)) if len(bolt.outputs) == 1 else None
    schema = arrow_schema(frame_cols)
    produced = ("_kind", "_stream", "_root", "_tid", "_replays", "_error",
                *sorted({c for ddl in bolt.outputs.values() for c in columns(ddl)}))
    wanted = ["_root", "_tid", "_replays", *in_cols]

    def run(batches: Iterator) -> Iterator:
        def conform(batch):
            """The frame's rows as they came, in the declared schema (Spark's input batches
            may order or flag their columns otherwise)."""
            return pa.RecordBatch.from_arrays(
                [batch.column(f.name).cast(f.type) for f in schema], schema=schema)

        watchdog = _Watchdog(timeout_ms)
        try:
            for batch in batches:
                mask = pc.fill_null(pc.and_(pc.equal(batch.column("_kind"), "tuple"),
                                            pc.equal(batch.column("_stream"), stream)), False)
                if not pc.any(mask).as_py():
                    yield conform(batch)
                    continue
                rest = batch.filter(pc.invert(mask))
                if rest.num_rows:
                    yield conform(rest)
                cols = {name: [] for name in produced}
                for row in batch.filter(mask).select(wanted).to_pylist():
                    root, tid, replays = row.pop("_root"), row.pop("_tid"), row["_replays"]
                    try:
                        outputs = _emit(bolt, watchdog.call(bolt.fn, row), single)
                    except Exception as exc:  # a failing bolt fails its input tuple only
                        if acker:
                            for name, v in zip(produced, (
                                    "fail", None, root, None, replays,
                                    f"bolt {bolt.name}: {type(exc).__name__}: {exc}"),
                                    strict=False):
                                cols[name].append(v)
                            for name in produced[6:]:
                                cols[name].append(None)
                        continue
                    for pos, (out_stream, values) in enumerate(outputs):
                        out_id = blake64(root, bolt.name, out_stream, tid, pos, attempt)
                        for name, v in zip(produced, ("tuple", out_stream, root, out_id,
                                                      replays, None), strict=False):
                            cols[name].append(v)
                        for name in produced[6:]:
                            cols[name].append(values.get(name))
                n = len(cols["_kind"])
                if n:
                    yield pa.RecordBatch.from_arrays(
                        [pa.array(cols[f.name], f.type) if f.name in cols
                         else pa.nulls(n, f.type) for f in schema], schema=schema)
        finally:
            watchdog.close()

    return run


RECORD_META = {"_kind": "string", "_stream": "string", "_root": "bigint", "_tid": "bigint",
               "_replays": "int", "_value": "bigint", "_error": "string", "_skey": "string",
               "_sval": "string", "_seq": "bigint"}


def record_runner(bolt: Bolt, attempt: int, timeout_ms: int, out_types: dict[str, str],
                  ctx: StateContext | None = None):
    """The mapInArrow function of a stateful bolt over its input (schema: RECORD_META and
    ``out_types``): tuples, failures, and its state changes (kind "state", one row per put or
    delete, with its root)."""
    single = next(iter(bolt.outputs)) if len(bolt.outputs) == 1 else None
    out_fields = list(out_types)
    names = (*RECORD_META, *out_fields)
    schema = arrow_schema({**RECORD_META, **out_types})

    def run(batches: Iterator) -> Iterator:
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
        watchdog = _Watchdog(timeout_ms)
        try:
            for batch in batches:
                cols = {name: [] for name in names}
                for row in batch.to_pylist():
                    root, tid, replays = row.pop("_root"), row.pop("_tid"), row["_replays"]
                    if tracked is not None:
                        tracked.begin()
                    try:
                        outputs = _emit(bolt, watchdog.call(call, row), single)
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
                        out_id = blake64(root, bolt.name, stream, tid, pos, attempt)
                        add(cols, "tuple", stream, root, out_id, replays,
                            None if pos else tid, None, values)
                yield pa.RecordBatch.from_pydict(cols, schema=schema)
        finally:
            watchdog.close()
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
    # imported here: pyspark loads only where Spark is used
    from pyspark import TaskContext

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
