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
from pyspark.sql import functions as F

from onceflow import stateful as stateful_steps
from onceflow.coordinator import load_batch
from onceflow.db import connect, transaction
from onceflow.kvstate import DELETED
from onceflow.pipeline import Pipeline, load_callable
from onceflow.staging import Staged, stage_group
from onceflow.txn import Fenced, TransactionAttempt, current_attempt
from spark_tasks.topology import StateContext, TopologyOutput, run_topology, union_all

log = logging.getLogger(__name__)


def _csv(table: pa.Table) -> io.BytesIO:
    """Arrow rows as header-less CSV (what COPY reads)."""
    buf = io.BytesIO()
    if table.num_rows:
        pacsv.write_csv(table, buf, pacsv.WriteOptions(include_header=False))
    buf.seek(0)
    return buf


@dataclass
class Collected:
    """A processed group's output as CSV for COPY, and its row counts; state changes by
    stateful bolt as (namespace, key, value or DELETED)."""

    deltas: io.BytesIO
    rejects: io.BytesIO
    failures: io.BytesIO
    failed: int = 0
    state_changes: dict[str, list] = field(default_factory=dict)


_COLUMNS = {"state_name": "string", "key": "string", "delta": "long", "partition": "int",
            "offset": "long", "error": "string", "replayed": "boolean", "payload": "string",
            "bolt": "string", "namespace": "string", "value": "string"}


def _tagged(kind: int, df: DataFrame) -> DataFrame:
    return df.select(F.lit(kind).alias("kind"), *[
        (F.col(name) if name in df.columns else F.lit(None)).cast(kind_).alias(name)
        for name, kind_ in _COLUMNS.items()])


def collect_output(out: TopologyOutput, topic: str) -> Collected:
    """Deltas, rejects, failures and state changes, collected in ONE Spark job (a union,
    split again by Arrow); the topology persisted what several branches read, so it is
    computed once."""
    parts = (out.deltas, out.rejects, out.failures, out.state_changes)
    both = union_all([_tagged(kind, df) for kind, df in enumerate(parts)])
    try:
        table = both.toArrow()
    finally:
        out.unpersist()
    kind = table.column("kind")

    def part(n: int, names: list[str]) -> pa.Table:
        return table.filter(pc.equal(kind, n)).select(names)

    deltas = part(0, ["state_name", "key", "delta"])
    rejects = part(1, ["partition", "offset", "error"])
    rejects = rejects.add_column(0, "topic", pa.array([topic] * rejects.num_rows, pa.string()))
    failures = part(2, ["partition", "offset", "replayed", "payload", "error"])
    changes: dict[str, list] = {}
    for bolt, namespace, key, value in zip(*part(3, ["bolt", "namespace", "key", "value"])
                                           .to_pydict().values(), strict=True):
        changes.setdefault(bolt, []).append(
            (namespace, key, DELETED if value is None else json.loads(value)))
    return Collected(_csv(deltas), _csv(rejects), _csv(failures), failures.num_rows, changes)


def read_claimed(spark: SparkSession, conn, pipeline: str, txid: int, group: int
                 ) -> tuple[DataFrame | None, int]:
    """The backflow items this txid's batch holds for ``group`` (claimed at planning), as
    source records with their failure count, and how many there are."""
    with conn.cursor() as cur:
        cur.execute(
            """SELECT partition, "offset", payload, failures FROM backflow_items
               WHERE pipeline = %s AND claimed_txid = %s AND claimed_grp = %s
               ORDER BY partition, "offset" """,
            (pipeline, txid, group),
        )
        rows = cur.fetchall()
    conn.rollback()
    if not rows:
        return None, 0
    table = pa.table({
        "partition": pa.array([r[0] for r in rows], pa.int32()),
        "offset": pa.array([r[1] for r in rows], pa.int64()),
        "payload": pa.array([r[2] for r in rows], pa.string()),
        "replays": pa.array([r[3] for r in rows], pa.int32()),
        "replayed": pa.array([True] * len(rows), pa.bool_()),
    })
    return spark.createDataFrame(table), len(rows)


def process_batch(spark: SparkSession, dsn: str, pipeline: Pipeline, ta: TransactionAttempt,
                  group: int = 0) -> Staged | None:
    """Process group ``group`` of ``ta``'s batch and stage the result.

    Returns None, doing nothing, when the txid is committed already (a re-run after the
    commit); raises Fenced when ``ta`` is not the current attempt.
    """

    started = time.monotonic()
    with ExitStack() as cleanup:
        conn = connect(dsn, application_name=f"onceflow-process-{pipeline.name}")
        cleanup.callback(conn.close)
        with transaction(conn) as cur:
            # Fail fast before any Spark work; the real fence is in stage_group.
            txn_state = current_attempt(cur, pipeline.name, ta)
            if txn_state == "committed":
                log.info("%s of %s is committed already: nothing to process", ta, pipeline.name)
                return None
            if txn_state != "planned":
                raise Fenced(f"{ta} of {pipeline.name} is {txn_state}: nothing to process")
            batch = load_batch(cur, pipeline.name, ta.txid)
            cur.execute("SELECT topic FROM pipelines WHERE name = %s", (pipeline.name,))
            topic = cur.fetchone()[0]
        topology = load_callable(pipeline.topology)(pipeline)
        stateful = topology.validate().stateful()
        provider = None
        if stateful:
            provider = stateful_steps.open_checked_provider(pipeline, dsn)
            cleanup.callback(provider.close)
            stateful_steps.wait_for_turn(conn, pipeline.name, ta.txid)
            stateful_steps.recover(conn, provider, pipeline, stateful)
        ranges = [r for r, g in batch.ranges if g == group]
        eden = sum(r.size for r in ranges)
        replayed, replayed_n = (read_claimed(spark, conn, pipeline.name, ta.txid, group)
                                if batch.replayed else (None, 0))
        if eden or replayed_n:
            source = replayed
            if eden:
                source = _read_source(spark, dsn, pipeline, topic, ranges)
                if replayed_n:
                    source = source.unionByName(replayed)
            context = StateContext(pipeline.name, ta.txid, pipeline.state_provider,
                                   pipeline.state_provider_config, dsn) if stateful else None
            out = run_topology(topology, source, attempt=ta.attempt, acker=pipeline.acker,
                               tuple_timeout_ms=pipeline.tuple_timeout_ms, state=context)
            collected = collect_output(out, topic)
        else:
            collected = Collected(io.BytesIO(), io.BytesIO(), io.BytesIO())
        if provider is not None:
            stateful_steps.prepare_states(provider, pipeline, stateful, ta, group,
                                          collected.state_changes)
        staged = stage_group(conn, pipeline.name, ta, group, deltas_csv=collected.deltas,
                             rejects_csv=collected.rejects, failures_csv=collected.failures,
                             records=eden, replayed=replayed_n)
    log.info("PROCESSED pipeline=%s %s group=%d records=%d replayed=%d failed=%d in %.2fs",
             pipeline.name, ta, group, staged.records, staged.replayed, staged.failed,
             time.monotonic() - started)
    return staged


def _read_source(spark: SparkSession, dsn: str, pipeline: Pipeline, topic: str, ranges
                 ) -> DataFrame:
    """The planned source ranges as records never failed before (replays 0)."""
    if pipeline.source == "files":
        from spark_tasks.segment_reader import read_segment_ranges

        records = read_segment_ranges(spark, dsn, topic, ranges)
    else:
        from spark_tasks.source_reader import read_ranges

        records = read_ranges(spark, dsn, topic, ranges)
    return records.select("partition", "offset", "payload", F.lit(0).alias("replays"),
                          F.lit(False).alias("replayed"))
