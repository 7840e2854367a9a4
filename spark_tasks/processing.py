"""The processing phase of one transaction attempt: read the planned ranges and the claimed
backflow items, run the pipeline's topology under the acker, stage the result keyed by
(txid, attempt, group): deltas and rejects of the completed roots, and the failed roots.

``process_batch`` is a function of a SparkSession and the batch's identity, so the same code
runs under spark-submit (process_batch.py), through Spark Connect, and directly in tests and
benchmarks with one shared session.
"""

from __future__ import annotations

import io
import json
import logging
import time
from contextlib import ExitStack
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
from pyarrow import csv as pacsv
from pyspark.sql import DataFrame, SparkSession

from onceflow.core import backflow, txlog
from onceflow.core import stateful as stateful_steps
from onceflow.core.db import connect, transaction
from onceflow.core.errors import Fenced, Permanent, SourceChanged
from onceflow.core.lease import AttemptLease
from onceflow.core.pipeline import Pipeline
from onceflow.core.staging import Staged, stage_group
from onceflow.core.topology import StateContext
from onceflow.core.txlog import TransactionAttempt, TxState
from onceflow.kvstate import DELETED, open_checked_provider
from onceflow.sources.kafka import KafkaDataLost
from onceflow.sources.landing.files import REPAIR_HINT
from onceflow.spark.collected import DELTA, REJECT
from onceflow.spark.records import batch_records, replayed_records
from onceflow.spark.runner import run_topology
from onceflow.spark.session import ship_code

log = logging.getLogger(__name__)


def _csv(table: pa.Table) -> io.BytesIO:
    """Arrow rows as header-less CSV (what COPY reads)."""
    buf = io.BytesIO()
    if table.num_rows:
        pacsv.write_csv(table, buf, pacsv.WriteOptions(include_header=False))
    buf.seek(0)
    return buf


@dataclass
class Staging:
    """A processed group's output as CSV for COPY, and its row counts; state changes by
    stateful bolt as (namespace, key, value or DELETED)."""

    deltas: io.BytesIO
    rejects: io.BytesIO
    failures: io.BytesIO
    failed: int = 0
    state_changes: dict[str, list] = field(default_factory=dict)
    tables: dict[str, tuple[list[str], io.BytesIO]] = field(default_factory=dict)


def _printable(table: pa.Table) -> pa.Table:
    """Error texts come from bolts' exceptions and may quote data: a NUL in them would break
    the COPY into staging, so it is spelled out."""
    i = table.schema.get_field_index("error")
    error = pc.replace_substring(table.column(i), "\x00", "\\u0000")
    return table.set_column(i, "error", error)


def typed_csv(rows: pa.Table, ta: TransactionAttempt, group: int
              ) -> tuple[list[str], io.BytesIO]:
    """A typed state's rows as CSV for COPY into its staging table: txid, attempt, grp,
    then its columns."""
    n = rows.num_rows
    head = pa.table({"txid": pa.repeat(pa.scalar(ta.txid, pa.int64()), n),
                     "attempt": pa.repeat(pa.scalar(ta.attempt, pa.int32()), n),
                     "grp": pa.repeat(pa.scalar(group, pa.int32()), n)})
    for name in rows.column_names:
        head = head.append_column(name, rows.column(name))
    return rows.column_names, _csv(head)


def staging_of(out, topic: str, payload_of, ta: TransactionAttempt | None = None,
               group: int = 0) -> Staging:
    """The run's outputs as staging: deltas, typed states' rows and rejects straight from
    Arrow; the failures with their payloads (``payload_of((partition, offset, replayed)) ->
    str``), which the backflow keeps for their replay."""
    table = out.table
    kind = table.column("kind")

    def part(n: int, names: list[str]) -> pa.Table:
        return table.filter(pc.equal(kind, n)).select(names)

    # In the order of the indexes they go into (staging; the commit reads them back in that
    # order for the states and rejected records): PostgreSQL then inserts next to the last
    # entry instead of all over the index.
    deltas = part(DELTA, ["state_name", "key", "delta"]).sort_by(
        [("state_name", "ascending"), ("key", "ascending")])
    rejects = part(REJECT, ["partition", "offset", "error"])
    if rejects.num_rows:  # a record two sinks rejected for two reasons: once, the least
        rejects = rejects.group_by(["partition", "offset"]).aggregate([("error", "min")]) \
            .select(["partition", "offset", "error_min"]) \
            .rename_columns(["partition", "offset", "error"]) \
            .sort_by([("partition", "ascending"), ("offset", "ascending")])
    rejects = _printable(rejects)
    rejects = rejects.add_column(0, "topic", pa.array([topic] * rejects.num_rows, pa.string()))
    failed = sorted(out.failed.items())
    failures = _printable(pa.table({
        "partition": pa.array([p for (p, _, _), _ in failed], pa.int32()),
        "offset": pa.array([o for (_, o, _), _ in failed], pa.int64()),
        "replayed": pa.array([r for (_, _, r), _ in failed], pa.bool_()),
        "payload": pa.array([payload_of(k) for k, _ in failed], pa.string()),
        "error": pa.array([e for _, e in failed], pa.string())}))
    changes = {bolt: [(ns, key, DELETED if value is None else json.loads(value))
                      for ns, key, value in rows] for bolt, rows in out.changes.items()}
    typed = {name: typed_csv(rows, ta, group) for name, rows in out.tables.items()}
    return Staging(_csv(deltas), _csv(rejects), _csv(failures), failures.num_rows, changes,
                   typed)


def read_claimed(spark: SparkSession, conn, pipeline: Pipeline, txid: int, group: int
                 ) -> tuple[DataFrame | None, dict[tuple[int, int], str]]:
    """The backflow items this txid's batch holds for ``group`` (claimed at planning), as
    source records with their failure count, and their payloads by position."""
    with conn.cursor() as cur:
        rows = backflow.claimed(cur, pipeline.name, txid, group)
    conn.rollback()
    if not rows:
        return None, {}
    return (replayed_records(spark, pipeline.source, rows),
            {(p, o): payload for p, o, payload, _ in rows})


# The permanent errors a source's reader raises in Spark's executors: they reach the driver as
# Spark's own error, holding the Python traceback's text, so they are found there by name.
EXECUTOR_PERMANENT: tuple[type[Permanent], ...] = (KafkaDataLost,)


def _permanent(error: BaseException) -> Permanent | None:
    """The permanent error a Spark failure carries, if any: a landed file that changed under
    the batch (the line a reader refused it with, onceflow.sources.landing) or a reader's
    EXECUTOR_PERMANENT error. It then fails the task at once (retries read the same bytes, or
    the same empty broker) with its own text in the transaction's failure, which a Spark
    error's repr would bury."""
    for line in str(error).splitlines():
        if REPAIR_HINT in line:
            return SourceChanged(line[line.find("landed file"):] if "landed file" in line
                                 else line.strip())
        for kind in EXECUTOR_PERMANENT:
            marker = f"{kind.__name__}: "
            if marker in line:
                return kind(line[line.find(marker) + len(marker):].strip())
    return None


def process_batch(spark: SparkSession, dsn: str, pipeline: Pipeline, ta: TransactionAttempt,
                  group: int = 0, *, stage=stage_group) -> Staged | None:
    """Process group ``group`` of ``ta``'s batch and stage the result.

    Returns None, doing nothing, when the txid is committed already (a re-run after the
    commit); raises Fenced when ``ta`` is not the current attempt. The attempt's lease is
    renewed while it runs. ``stage``: what writes the staging (stage_group's signature; the
    fault tests stage from a process they kill).
    """
    started = time.monotonic()
    with ExitStack() as cleanup:
        conn = connect(dsn, application_name=f"onceflow-process-{pipeline.name}")
        cleanup.callback(conn.close)
        with transaction(conn) as cur:
            # Fail fast before any Spark work; the real fence is in stage_group.
            state = txlog.fence(cur, pipeline.name, ta)
            if state is TxState.COMMITTED:
                log.info("%s of %s is committed already: nothing to process", ta, pipeline.name)
                return None
            if state is not TxState.PLANNED:
                raise Fenced(f"{ta} of {pipeline.name} is {state}: nothing to process")
            batch = txlog.load_batch(cur, pipeline.name, ta.txid)
            ranges = batch.ranges_of(group)
            # (a replayed record is looked at again: its failure was not a refusal, but
            # max_record_bytes may have changed since)
            refusals = bool(batch.replayed) or pipeline.source.may_refuse(cur, ranges)
        cleanup.enter_context(AttemptLease(dsn, pipeline.name, ta,
                                           pipeline.attempt_heartbeat_s,
                                           lease_s=pipeline.lease_s))
        ship_code(pipeline.ref, pipeline.topology)
        topology = pipeline.build_topology()
        stateful = topology.stateful()
        provider = None
        if stateful:
            provider = open_checked_provider(pipeline, dsn)
            cleanup.callback(provider.close)
            stateful_steps.wait_for_turn(conn, pipeline.name, ta.txid)
            stateful_steps.recover(conn, provider, pipeline, stateful)
        eden = sum(r.size for r in ranges)
        replayed, replay_payloads = (read_claimed(spark, conn, pipeline, ta.txid, group)
                                     if batch.replayed else (None, {}))
        if eden or replay_payloads:
            source = replayed
            if eden:
                source = batch_records(spark, dsn, pipeline.source, ranges)
                if replayed is not None:
                    source = source.unionByName(replayed)
            context = StateContext(pipeline.name, ta.txid, pipeline.state_provider,
                                   pipeline.state_provider_config, dsn) if stateful else None
            try:
                out = run_topology(topology, source, attempt=ta.attempt, acker=pipeline.acker,
                                   tuple_timeout_ms=pipeline.tuple_timeout_ms, state=context,
                                   max_record_bytes=pipeline.source.max_record_bytes,
                                   refusals=refusals, max_key_bytes=pipeline.max_key_bytes,
                                   shapes={spec.source_name: spec.shape()
                                           for spec in pipeline.typed_states()}).collect()
            except Exception as error:
                permanent = _permanent(error)
                if permanent is None:
                    raise
                raise permanent from error
            eden_failed = [(p, o) for p, o, again in out.failed if not again]
            with transaction(conn) as cur:
                payloads = pipeline.source.payloads_at(cur, eden_failed) if eden_failed else {}

            def payload_of(position) -> str:
                partition, offset, again = position
                return (replay_payloads if again else payloads)[(partition, offset)]

            collected = staging_of(out, pipeline.topic, payload_of, ta, group)
        else:
            collected = Staging(io.BytesIO(), io.BytesIO(), io.BytesIO())
        if provider is not None:
            stateful_steps.prepare_states(provider, pipeline, stateful, ta, group,
                                          collected.state_changes)
        staged = stage(conn, pipeline.name, ta, group, deltas_csv=collected.deltas,
                      rejects_csv=collected.rejects, failures_csv=collected.failures,
                      records=eden, replayed=len(replay_payloads),
                      stateful=tuple(b.name for b in stateful),
                      tables={spec.name: collected.tables[spec.source_name]
                              for spec in pipeline.typed_states()
                              if spec.source_name in collected.tables})
    log.info("PROCESSED pipeline=%s %s group=%d records=%d replayed=%d failed=%d in %.2fs",
             pipeline.name, ta, group, staged.records, staged.replayed, staged.failed,
             time.monotonic() - started)
    return staged
