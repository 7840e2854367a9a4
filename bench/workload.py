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
- ``SOURCES``: W once per kind of source onceflow ships (bench/compare.py ``--sources``),
  each with its own topic and tables, the same counts: ``landing-json`` is ``W``;
  ``landing-csv`` and ``landing-parquet`` read the events as rows (``EVENT_DDL``) from CSV
  and Parquet files in landing folders beside ``W``'s (Parquet ``typed``: the rows' columns,
  as a Structured Streaming user reads them); ``table`` reads them as rows of a
  PostgreSQL table (``TABLE``, keyed by an identity column), each row's JSON decoded as it is
  read (``json_schema``: its url column); ``pglog`` reads the JSON payloads from the
  PostgreSQL log, ``segments`` from file segments (under ``SEGMENTS``), both decoding them
  as they are read (``json_schema``, as ``W``'s landing folder does); ``kafka`` from a
  Kafka topic (the connection kafka_default), decoded the same way.
  A row form holds a malformed event as a row without a url: counted nowhere, as the JSON
  form's rejected event is.

Reached by reference (``workload:PIPELINES`` with bench/ on PYTHONPATH), like a user's
pipeline; the folder comes from ONCEFLOW_BENCH_FOLDER.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from onceflow import (
    ANCHORS,
    SPOUT,
    FileSegments,
    KafkaSource,
    LandingFolder,
    Pipeline,
    PostgresLog,
    StateSpec,
    TableSource,
    Topology,
)

# The events' fields the workload reads: the tweets example's (a wrongly typed flaky makes an
# event malformed, as in the peers' from_json schema)
TWEET = "url string, flaky int"
FOLDER = os.environ.get("ONCEFLOW_BENCH_FOLDER", "/var/tmp/onceflow-bench/landing")
# Transactions in flight at once (the Airflow DAG's max_active_runs).
MAX_PENDING = int(os.environ.get("ONCEFLOW_BENCH_MAX_PENDING", "3"))
# The other sources' places, beside the JSON lines folder (bench/compare.py fills them)
CSV_FOLDER = str(Path(FOLDER).parent / "landing-csv")
PARQUET_FOLDER = str(Path(FOLDER).parent / "landing-parquet")
SEGMENTS = str(Path(FOLDER).parent / "segments")
TABLE = "public.bench_events"
TABLE_KEY = "seq"  # an identity column: the table source's offsets
# An event as a row (CSV, Parquet, the table): the JSON event's fields, a malformed event's
# all null
EVENT_DDL = "id long, user string, text string, url string"


def _parse(records):
    from tweets_example.topology import classify_typed

    return _emit(classify_typed(records))


def _emit(parsed):
    """Classified events (url, domain, error) -> the urls, domains and rejects tuples."""
    from pyspark.sql import functions as F

    null = F.lit(None).cast("string")
    out = F.when(F.col("error").isNull(), F.array(
        F.struct(F.lit("urls").alias("_stream"), F.col("url").alias("key"),
                 null.alias("error")),
        F.struct(F.lit("domains").alias("_stream"), F.col("domain").alias("key"),
                 null.alias("error")),
    )).otherwise(F.array(F.struct(F.lit("rejects").alias("_stream"), null.alias("key"),
                                  F.col("error").alias("error"))))
    return parsed.select(*ANCHORS, F.explode(out).alias("t")).select(*ANCHORS, "t.*")


def _parse_payload(records):
    """Events as JSON payloads (the PostgreSQL log, file segments): parsed by from_json."""
    from tweets_example.topology import parse

    return _emit(parse(records))


def _rows(url):
    """Events as rows, ``url`` their url column: classified as decoded JSON events."""
    def parse(records):
        from pyspark.sql import functions as F

        from tweets_example.topology import classify_typed

        return _emit(classify_typed(records.select(
            *ANCHORS, url(F).alias("url"), F.lit(None).cast("int").alias("flaky"),
            F.lit(None).cast("string").alias("_corrupt_record"))))

    return parse


# CSV lines (the landing folder's payload is the line), and typed rows (a Parquet row's
# columns, a table row's JSON decoded by the source)
_parse_csv = _rows(lambda F: F.from_csv("payload", EVENT_DDL).getField("url"))
_parse_typed_row = _rows(lambda F: F.col("url"))


def topology(pipeline=None, parse=_parse) -> Topology:
    return (
        Topology("w")
        .bolt("parse", input=SPOUT, fn=parse, outputs={
            "urls": "key string", "domains": "key string", "rejects": "error string"})
        .count("urls", "url_counts")
        .count("domains", "domain_counts")
        .reject("rejects")
    )


def topology_payload(pipeline=None) -> Topology:
    return topology(pipeline, _parse_payload)


def topology_csv(pipeline=None) -> Topology:
    return topology(pipeline, _parse_csv)


def topology_typed_row(pipeline=None) -> Topology:
    return topology(pipeline, _parse_typed_row)


def _source(topic: str, json_schema: str | None = None, **kw) -> LandingFolder:
    return LandingFolder(**{"topic": topic, "path": FOLDER, "partitions": 2,
                            "chunk_bytes": 16 << 20, "settle_s": 0.0,
                            "json_schema": json_schema, **kw})


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


def _variant(name: str, source, topology: str, prefix: str, what: str) -> Pipeline:
    return dataclasses.replace(
        W, name=name, source=source, topology=topology, description=f"Benchmark W {what}.",
        states=(StateSpec(f"{prefix}url_counts", source="url_counts"),
                StateSpec(f"{prefix}domain_counts", source="domain_counts")))


# source name (bench/compare.py --sources) -> W reading it
SOURCES = {
    "segments": _variant("bench_w_segments", FileSegments(
        topic="bench_w_segments", path=SEGMENTS, partitions=2, json_schema=TWEET),
        "workload:topology", "ws_", "from file segments"),
    "landing-json": W,
    "landing-csv": _variant("bench_w_csv", _source(
        "bench_w_csv", path=CSV_FOLDER, format="csv", csv_header=True),
        "workload:topology_csv", "wc_", "from CSV files"),
    "landing-parquet": _variant("bench_w_parquet", _source(
        "bench_w_parquet", path=PARQUET_FOLDER, format="parquet", schema=EVENT_DDL,
        typed=True), "workload:topology_typed_row", "wq_", "from Parquet files"),
    "table": _variant("bench_w_table", TableSource(
        topic="bench_w_table", table=TABLE, key=TABLE_KEY, json_schema="url string"),
        "workload:topology_typed_row", "wt_", "from a PostgreSQL table"),
    "pglog": _variant("bench_w_pglog", PostgresLog(
        topic="bench_w_pglog", partitions=2, json_schema=TWEET),
        "workload:topology", "wl_", "from the PostgreSQL log"),
    # its broker and connection (kafka_default) are bench/compare.py's
    "kafka": _variant("bench_w_kafka", KafkaSource(
        topic="bench_w_kafka", json_schema=TWEET), "workload:topology", "wk_",
        "from a Kafka topic"),
}

PIPELINES = (W, W_PHASES, W_IDNA, *(p for p in SOURCES.values() if p is not W))
