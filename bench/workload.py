"""The benchmark's workload W as onceflow pipelines: JSON events from a landing folder of
JSON-lines files, counted per URL and per domain (the lower-cased host), the same rule as
bench/peers.py (tweets_example.topology.parse).

- ``W``: the JVM-only topology on decoded records: the landing folder declares the events'
  schema (``json_schema``, decoded as the lines are read), a DataFrame bolt finds the domain
  and the rejection reason, two count sinks, a reject sink. What a user writes for JSON
  lines, as a Structured Streaming user reads them with Spark's JSON source.
  Its transaction DAG is one task per run (``dag_shape="single"``); ``W_PHASES`` is the same
  pipeline with a task per phase (begin >> process >> commit), its own topic and tables.
- ``W_IDNA``: the tweets example's topology (a Python bolt normalizes each domain with IDNA,
  per record): what the acker's cost is measured on.

Reached by reference (``workload:PIPELINES`` with bench/ on PYTHONPATH), like a user's
pipeline; the folder comes from ONCEFLOW_BENCH_FOLDER.
"""

from __future__ import annotations

import dataclasses
import os

from onceflow import ANCHORS, SPOUT, Pipeline, StateSpec, Topology
from onceflow.sources.landing import LandingFolder

# The events' fields the workload reads: the tweets example's (a wrongly typed flaky makes an
# event malformed, as in the peers' from_json schema)
TWEET = "url string, flaky int"
FOLDER = os.environ.get("ONCEFLOW_BENCH_FOLDER", "/var/tmp/onceflow-bench/landing")
# Transactions in flight at once (the Airflow DAG's max_active_runs).
MAX_PENDING = int(os.environ.get("ONCEFLOW_BENCH_MAX_PENDING", "3"))


def _parse(records):
    from pyspark.sql import functions as F

    from tweets_example.topology import classify_typed

    parsed = classify_typed(records)
    null = F.lit(None).cast("string")
    out = F.when(F.col("error").isNull(), F.array(
        F.struct(F.lit("urls").alias("_stream"), F.col("url").alias("key"),
                 null.alias("error")),
        F.struct(F.lit("domains").alias("_stream"), F.col("domain").alias("key"),
                 null.alias("error")),
    )).otherwise(F.array(F.struct(F.lit("rejects").alias("_stream"), null.alias("key"),
                                  F.col("error").alias("error"))))
    return parsed.select(*ANCHORS, F.explode(out).alias("t")).select(*ANCHORS, "t.*")


def topology(pipeline=None) -> Topology:
    return (
        Topology("w")
        .bolt("parse", input=SPOUT, fn=_parse, outputs={
            "urls": "key string", "domains": "key string", "rejects": "error string"})
        .count("urls", "url_counts")
        .count("domains", "domain_counts")
        .reject("rejects")
    )


def _source(topic: str, json_schema: str | None = None) -> LandingFolder:
    return LandingFolder(topic=topic, path=FOLDER, partitions=2, chunk_bytes=16 << 20,
                         settle_s=0.0, json_schema=json_schema)


W = Pipeline(
    name="bench_w", description="Benchmark W: URL and domain counts, JVM bolts only.",
    source=_source("bench_w", TWEET), topology="workload:topology",
    states=(StateSpec("w_url_counts", source="url_counts"),
            StateSpec("w_domain_counts", source="domain_counts")),
    batch_size=1_000_000, max_pending=MAX_PENDING, retries=1, attempt_lease_s=1800,
    dag_shape="single",
)

W_PHASES = dataclasses.replace(
    W, name="bench_w_phases", source=_source("bench_w_phases", TWEET), dag_shape="phases",
    description="Benchmark W, a task per phase.",
    states=(StateSpec("wp_url_counts", source="url_counts"),
            StateSpec("wp_domain_counts", source="domain_counts")))

W_IDNA = Pipeline(
    name="bench_w_idna", description="Benchmark W with a per-record Python bolt (IDNA).",
    source=_source("bench_w_idna"), topology="tweets_example.topology:topology",
    states=(StateSpec("wi_url_counts", source="url_counts"),
            StateSpec("wi_domain_counts", source="domain_counts")),
    batch_size=1_000_000, max_pending=MAX_PENDING, retries=1, attempt_lease_s=1800,
)

PIPELINES = (W, W_PHASES, W_IDNA)
