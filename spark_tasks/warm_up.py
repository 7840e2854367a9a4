"""A new Spark Connect server's warm-up (onceflow.spark.localspark starts it in a process of
its own once the server answers): the shared session's Python workers started with pyarrow
and the JSON-lines decoder imported, and the shapes a batch runs run once, so that the first
batch costs what the later ones do (docs/design.md).

pyarrow and pyspark are imported here at the top: localspark, which the CLI imports, runs this
module as a process and never imports it.
"""

from __future__ import annotations

import logging
import signal
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
from pyspark.sql import functions as F

from onceflow.core.source import PROBLEM
from onceflow.sources import json_arrow
from onceflow.sources.json_records import JsonRecords
from onceflow.sources.jvm import jvm_reader
from onceflow.sources.landing.read import file_chunk, jvm_lines
from onceflow.sources.segments import jvm_segments
from onceflow.sources.segments.write import write_segment
from onceflow.spark.session import SHARED_SESSION_KEY, connect_session

log = logging.getLogger(__name__)

WARM_UP_LIMIT_S = 300  # a background warm-up ends by then, done or not


def warm_up(url: str) -> float:
    """Make a new server's first batch cost what the later ones do: start the Python workers
    of the session processing tasks share (onceflow.spark.session.SHARED_SESSION_KEY) with
    pyarrow and the JSON-lines decoder imported, and run the shapes a batch runs (an Arrow
    read of decoded records and of payloads, JSON parsing, onceflow's JVM readers, an
    aggregation collected as Arrow) so the JVM has loaded and compiled them before a batch
    needs them (docs/design.md). Returns the seconds it took."""
    started = time.monotonic()

    def decoded(batches):
        records = JsonRecords("url string, n long")
        for batch in batches:
            lines = [b'{"url": "http://host%d/p", "n": %d}' % (i % 97, i)
                     for i in batch.column("id").to_pylist()]
            columns, problems = json_arrow.decode(records.columns, lines, 65536)
            yield pa.RecordBatch.from_arrays(
                [batch.column("id"), *columns.values(), problems],
                names=["id", *columns, PROBLEM])

    with connect_session(url, "onceflow-warm-up", shared=SHARED_SESSION_KEY) as spark:
        rows = spark.range(20_000, numPartitions=4).mapInArrow(
            decoded, "id long, url string, n long, _corrupt_record string, _problem string")
        events = rows.select(F.to_json(F.struct(F.concat(
            F.lit("http://host"), (F.col("id") % 97).cast("string"), F.lit("/p")).alias("url"),
            F.col("id").alias("n"))).alias("payload"), "url")
        doc = F.from_json("payload", "url string, n long, _corrupt_record string",
                          {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": "_corrupt_record"})

        def aggregate(frame, url_column) -> None:
            parsed = frame.select(
                F.lower(F.regexp_extract(url_column, r"^https?://([^/]+)", 1)).alias("host"),
                F.xxhash64(url_column).alias("id"))
            parsed.groupBy("host").agg(F.count(F.lit(1)).alias("n"),
                                       F.bit_xor("id").alias("x")).toArrow()

        for url_column in (F.col("url"), F.col("j.url")):  # decoded, then parsed by a bolt
            aggregate(events.select(doc.alias("j"), "url"), url_column)
        if jvm_reader(spark):
            try:
                for frame in _jvm_reads(spark):
                    aggregate(frame, F.col("url"))
            except Exception as error:  # executors on other machines cannot see the files
                log.warning("warm-up: onceflow's JVM readers skipped (%s)", str(error)[:300])
            else:
                log.info("warm-up: onceflow's JVM readers read %d records each",
                         2 * WARM_UP_RECORDS)
    return time.monotonic() - started


WARM_UP_RECORDS = 100_000  # per JVM reader: enough calls for the JIT to compile its loops


def _jvm_reads(spark):
    """onceflow's JVM readers (a landing folder's JSON lines, file segments) over a file of
    generated records each, decoded as a declared json_schema is: their classes are loaded
    and compiled before a batch needs them. The files live in a folder of their own while
    the frames are read."""
    records = JsonRecords("url string, n long")
    n = WARM_UP_RECORDS
    lines = [f'{{"url": "http://host{i % 97}/p{i % 1013}", "n": {i}}}' for i in range(n)]
    with tempfile.TemporaryDirectory(prefix="onceflow-warm-up-") as folder:
        landed = Path(folder) / "events.jsonl"
        landed.write_text("\n".join(lines) + "\n")
        segment = Path(folder) / "segment.parquet"
        write_segment(segment, 0, 0, lines, datetime.now(UTC))
        for _ in range(2):
            yield jvm_lines(spark, [file_chunk(str(landed), n)], [(0, 0, n)], records, 65536)
            yield jvm_segments(spark, [(str(segment), 0)], [(0, 0, n)], records, 65536)



if __name__ == "__main__":  # localspark.start(warm=True) runs: python -m onceflow.spark.warm_up URL
    if len(sys.argv) == 2:
        # A server stopped meanwhile must not leave this process waiting on it for ever:
        # SIGALRM's default action ends it, wherever it waits (a gRPC call in C included).
        signal.alarm(WARM_UP_LIMIT_S)
        logging.basicConfig(level=logging.INFO, format="onceflow: %(message)s")
        try:
            print(f"onceflow: Spark Connect server warmed up in {warm_up(sys.argv[1]):.1f}s",
                  flush=True)
        except Exception as error:  # a warm-up is a courtesy: the server works without it
            print(f"onceflow: warm-up of {sys.argv[1]} failed: {error}", flush=True)
    else:
        sys.exit("usage: python -m onceflow.spark.warm_up sc://HOST:PORT")
