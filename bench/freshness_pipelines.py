"""The pipelines of bench/bench_freshness.py: one kept-up pipeline per rate measured,
``fresh_<rate>``, reached by reference (``freshness_pipelines:PIPELINES`` with bench/ on
PYTHONPATH) as a user's package is.

Records are JSON objects ``{"k": KEY, "t": PRODUCED}`` in a PostgreSQL log of two
partitions; the state ``fresh_<rate>_counts`` holds how many records each key had (a recount
of what was produced checks every commit). The topology runs in the JVM only, as
tests/keepup_pipelines.py's: the benchmark measures keeping up (the watcher, Airflow, a
batch's fixed cost), not a Python bolt.

BENCH_FRESHNESS (JSON, set by the benchmark for every Airflow component) gives the rates
and the sizing: ``{"rates": [...], "min_s": 4, "batch_s": 10, "max_delay_s": 6,
"watch_interval": 1, "max_pending": 3}``. A pipeline's ``min_records`` is ``min_s`` seconds
of its rate and its ``batch_size`` ``batch_s`` seconds (see ``sizing``).
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

from onceflow import ANCHORS, SPOUT, Pipeline, PostgresLog, StateSpec, Topology

DEFAULTS = {"rates": [1000], "min_s": 4.0, "batch_s": 10.0, "max_delay_s": 6.0,
            "watch_interval": 1.0, "max_pending": 3}
SPEC = {**DEFAULTS, **json.loads(os.environ.get("BENCH_FRESHNESS") or "{}")}


def name(rate: int) -> str:
    return f"fresh_{rate}"


def sizing(rate: int, spec: dict = SPEC) -> tuple[int, int]:
    """(min_records, batch_size) at ``rate`` records/s: ``min_s`` and ``batch_s`` seconds of
    records (at least 1,000 and 2,500). With a steady producer a batch starts every
    ``min_s`` seconds; while ``max_pending`` runs are in flight that keeps up as long as a
    run takes under ``max_pending * min_s`` seconds. A batch of ``batch_s`` seconds (more
    than ``min_s``) lets a backlog left by a slow run drain in larger batches, each run's
    fixed cost spread over more records."""
    # round: bench_keepup_drain.py gives sizes as seconds of a rate (1001 / 1000 * 1000 is
    # 1000.9999999999999)
    return (max(1000, round(rate * spec["min_s"])),
            max(2500, round(rate * spec["batch_s"])))


def pipeline(rate: int, spec: dict = SPEC) -> Pipeline:
    min_records, batch_size = sizing(rate, spec)
    return Pipeline(
        name=name(rate),
        description=f"Counts per key at {rate:,} records/s, kept up by the source watcher.",
        source=PostgresLog(topic=name(rate), partitions=2),
        topology="freshness_pipelines:build",
        states=(StateSpec(f"{name(rate)}_counts"),),
        batch_size=batch_size,
        max_pending=int(spec["max_pending"]),
        keep_up=True,
        min_records=min_records,
        max_delay=timedelta(seconds=float(spec["max_delay_s"])),
        watch_interval=float(spec["watch_interval"]),
        dag_shape="single",  # a run is one task, as users of keep-up would choose
        retries=2,
    )


PIPELINES = tuple(pipeline(int(rate)) for rate in SPEC["rates"])


def build(pipeline=None):
    from pyspark.sql import functions as F  # only where Spark runs the batch

    def keys(records):
        key = F.get_json_object("payload", "$.k")
        return records.select(*ANCHORS, key.alias("key")).where(F.col("key").isNotNull())

    return (Topology("fresh")
            .bolt("keys", input=SPOUT, fn=keys, outputs={"keys": "key string"})
            .count("keys", f"{pipeline.name}_counts"))
