"""A pipeline that keeps up by itself, for tests/test_keepup_airflow.py (a real Airflow starts its
runs): ``keepup_pipelines:KEEP_UP`` (ONCEFLOW_PIPELINES, with this folder on PYTHONPATH).

Records are JSON objects ``{"k": KEY}``; the state ``counts`` holds how many records each key
had, so a recount from the records produced checks every commit. The topology runs in the
JVM only (no per-record Python bolt): a batch costs little, and the tests measure Airflow and
the watcher, not a bolt.
"""

from __future__ import annotations

import os
from datetime import timedelta

from onceflow import ANCHORS, SPOUT, Pipeline, PostgresLog, StateSpec, Topology

KEEP_UP = Pipeline(
    name="keepup",
    description="Counts per key, kept up by the source watcher.",
    source=PostgresLog(topic="keepup_events", partitions=2),
    topology="keepup_pipelines:build",
    states=(StateSpec("counts"),),
    # KEEPUP_BATCH_SIZE, KEEPUP_MIN_RECORDS: other sizes for a benchmark at other rates
    batch_size=int(os.environ.get("KEEPUP_BATCH_SIZE", "10000")),
    max_pending=3,
    keep_up=True,
    min_records=int(os.environ.get("KEEPUP_MIN_RECORDS", "8000")),
    max_delay=timedelta(seconds=6),
    watch_interval=1.0,
    dag_shape="single",  # a run is one task: a third of Airflow's cost per batch
    retries=2,
)


def build(pipeline=None):
    from pyspark.sql import functions as F  # only where Spark runs the batch

    def keys(records):
        key = F.get_json_object("payload", "$.k")
        return records.select(*ANCHORS, key.alias("key")).where(F.col("key").isNotNull())

    return (Topology("keepup")
            .bolt("keys", input=SPOUT, fn=keys, outputs={"keys": "key string"})
            .count("keys", "counts"))
