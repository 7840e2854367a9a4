"""The processing phase of one transaction attempt: read the planned ranges, run the
pipeline's transform, stage the result keyed by (txid, attempt, group).

``process_batch`` is a function of a SparkSession and the batch's identity, so the same code
runs under spark-submit (process_batch.py), through Spark Connect, and directly in tests and
benchmarks with one shared session.
"""

from __future__ import annotations

import io
import logging
import time
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from pyarrow import csv as pacsv
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from onceflow.coordinator import load_batch
from onceflow.db import connect, transaction
from onceflow.pipeline import Pipeline, load_callable
from onceflow.staging import Staged, stage_group
from onceflow.txn import Fenced, TransactionAttempt, current_attempt

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchOutput:
    """What a pipeline's transform returns.

    deltas: state_name, key, delta (one row per state and key, or several to be summed);
    rejects: partition, offset, error (records the pipeline could not use).
    """

    deltas: DataFrame
    rejects: DataFrame


def _csv(table: pa.Table) -> io.BytesIO:
    """Arrow rows as header-less CSV (what COPY reads)."""
    buf = io.BytesIO()
    if table.num_rows:
        pacsv.write_csv(table, buf, pacsv.WriteOptions(include_header=False))
    buf.seek(0)
    return buf


def collect_output(out: BatchOutput, topic: str) -> tuple[io.BytesIO, io.BytesIO]:
    """Deltas and rejects as CSV, collected in ONE Spark job (a union split again by Arrow),
    without caching the source. Each branch of the union still reads the source: measured
    faster than persisting it at 1M events, but a single aggregation would read it once."""
    null = F.lit(None)
    both = out.deltas.select(
        F.lit(True).alias("is_delta"), "state_name", "key", F.col("delta").cast("long"),
        null.cast("int").alias("partition"), null.cast("long").alias("offset"),
        null.cast("string").alias("error"),
    ).unionByName(out.rejects.select(
        F.lit(False).alias("is_delta"), null.cast("string").alias("state_name"),
        null.cast("string").alias("key"), null.cast("long").alias("delta"),
        F.col("partition").cast("int"), F.col("offset").cast("long"), F.col("error"),
    ))
    table = both.toArrow()
    is_delta = table.column("is_delta")
    deltas = table.filter(is_delta).select(["state_name", "key", "delta"])
    rejects = table.filter(pc.invert(is_delta)).select(["partition", "offset", "error"])
    rejects = rejects.add_column(0, "topic", pa.array([topic] * rejects.num_rows, pa.string()))
    return _csv(deltas), _csv(rejects)


def process_batch(spark: SparkSession, dsn: str, pipeline: Pipeline, ta: TransactionAttempt,
                  group: int = 0) -> Staged | None:
    """Process group ``group`` of ``ta``'s batch and stage the result.

    Returns None, doing nothing, when the txid is committed already (a re-run after the
    commit); raises Fenced when ``ta`` is not the current attempt.
    """
    from spark_tasks.source_reader import read_ranges

    started = time.monotonic()
    conn = connect(dsn, application_name=f"onceflow-process-{pipeline.name}")
    try:
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
        ranges = [r for r, g in batch.ranges if g == group]
        records = sum(r.size for r in ranges)
        if records:
            if pipeline.source == "files":
                from spark_tasks.segment_reader import read_segment_ranges

                source = read_segment_ranges(spark, dsn, topic, ranges)
            else:
                source = read_ranges(spark, dsn, topic, ranges)
            out = load_callable(pipeline.transform)(source, pipeline)
            deltas, rejects = collect_output(out, topic)
        else:
            deltas, rejects = io.BytesIO(), io.BytesIO()
        staged = stage_group(conn, pipeline.name, ta, group, deltas_csv=deltas,
                             rejects_csv=rejects, records=records)
    finally:
        conn.close()
    log.info("PROCESSED pipeline=%s %s group=%d records=%d in %.2fs", pipeline.name, ta, group,
             records, time.monotonic() - started)
    return staged
