"""Read N demo events through the processing phase from each source kind: the PostgreSQL log
(COPY through mapInArrow) and the file-segment log (Spark's Parquet reader).

    python bench/bench_sources.py --events 10000000 --batch-size 2500000

Prints, per kind: produce time, then processing events/s (transform and staging included;
the Spark session start is reported apart), and verify. Uses a database of its own
(onceflow_bench_sources, dropped at the start) and a segments folder under .run/.

Segment reads (measured with it before bench_segment_layout.py): segments imported
as `onceflow import` writes them (400,000 records per partition), batches smaller than a
segment, each batch's begin / processing / commit time and a Python read of its ranges
(``payloads``, as verify reads them):

    python bench/bench_sources.py --kinds files --import --partitions 8 \
        --events 3200000 --batch-size 1000000 --batches 2

``--row-group-rows N`` writes the segments with N rows per row group instead of
onceflow's ROW_GROUP_ROWS (1048576 or more: one row group per segment, the former layout).
With SPARK_REMOTE set, the batches run on that Spark Connect server.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

from benchkit import need_examples, project_dir, recreate_database, server_dsn

from onceflow.core import db
from onceflow.core.begin import begin
from onceflow.core.commit import commit
from onceflow.core.registration import register
from onceflow.core.registry import get_pipeline
from onceflow.sources.pglog import PostgresLog
from onceflow.sources.segments import FileSegments, import_segments, produce_segments

need_examples()  # the examples' code and pipelines (bench/README.md)

from tweets_example.data import generate  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=10_000_000)
    parser.add_argument("--batch-size", type=int, default=2_500_000)
    parser.add_argument("--kinds", default="postgres,files")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--import", dest="imported", action="store_true",
                        help="files: import the events with their partition and offset "
                             "(segments as `onceflow import` writes them) instead of producing")
    parser.add_argument("--batches", type=int, default=None,
                        help="process only this many batches (default: all the events)")
    parser.add_argument("--row-group-rows", type=int, default=None,
                        help="files: rows per row group of the segments written")
    args = parser.parse_args()
    if args.row_group_rows:
        from onceflow.sources import segments

        segments.ROW_GROUP_ROWS = args.row_group_rows

    server, how = server_dsn()
    dsn = recreate_database(server, "onceflow_bench_sources", migrate=False)
    conn = db.connect(dsn)
    db.migrate(conn)
    root = project_dir() / ".run" / "bench-segments"
    shutil.rmtree(root, ignore_errors=True)
    print(f"PostgreSQL: {how}; {args.events:,} events per source kind")

    from pyspark.sql import functions as F

    from onceflow.spark.processing import process_batch
    from onceflow.spark.session import get_spark

    t = time.monotonic()
    spark = get_spark("onceflow-bench-sources")
    if not os.environ.get("SPARK_REMOTE"):
        spark.sparkContext.setLogLevel("ERROR")
    print(f"Spark session start: {time.monotonic() - t:.1f}s (not counted below); "
          f"load average {os.getloadavg()[0]:.2f}")

    for kind in args.kinds.split(","):
        name = {"postgres": "tweets", "files": "tweets_files"}[kind]
        source = (FileSegments(topic="tweets_files", path=str(root), partitions=args.partitions)
                  if kind == "files" else PostgresLog(topic="tweets", partitions=args.partitions))
        pipeline = get_pipeline(name, batch_size=args.batch_size, max_pending=1000,
                                source=source)
        register(conn, pipeline, create_source=True)
        t = time.monotonic()
        events = generate(args.events, seed=5)
        if kind == "files" and args.imported:
            import numpy as np
            import pyarrow as pa

            payloads = pa.array(list(events), pa.string())
            at = np.arange(len(payloads))
            import_segments(conn, root, pipeline.topic, pa.table({
                "partition": pa.array(at % args.partitions, pa.int32()),
                "offset": pa.array(at // args.partitions, pa.int64()),
                "payload": payloads}))
        elif kind == "files":
            produce_segments(conn, root, pipeline.topic, events, chunk_size=1_000_000)
        else:
            source.append(conn, events, chunk_size=200_000)
        print(f"[{kind}] produced in {time.monotonic() - t:.1f}s")
        done, processing, whole, reading, spark_reads = 0, 0.0, 0.0, 0.0, 0.0
        batches = 0
        while done < args.events and batches != args.batches:
            batches += 1
            started = time.monotonic()
            batch = begin(conn, pipeline, f"bench-{kind}-{done}")
            t = time.monotonic()
            process_batch(spark, dsn, pipeline, batch.attempt)
            phase = time.monotonic() - t
            commit(conn, pipeline, batch.attempt)
            took = time.monotonic() - started
            ranges = [r for r, _ in batch.ranges]
            t = time.monotonic()
            (read, _), = source.read(spark, dsn, ranges).agg(
                F.count("*"), F.sum(F.length("payload"))).collect()  # the payloads decoded
            spark_read = time.monotonic() - t
            t = time.monotonic()
            assert sum(1 for _ in source.payloads(conn, ranges)) == read == batch.records
            python = time.monotonic() - t
            print(f"[{kind}] batch of {batch.records:,}: {took:.1f}s whole (processing "
                  f"{phase:.1f}s); its ranges read again: Spark {spark_read:.1f}s, "
                  f"payloads() {python:.1f}s; load {os.getloadavg()[0]:.2f}")
            processing, whole, reading = processing + phase, whole + took, reading + python
            spark_reads += spark_read
            done += batch.records
        print(f"[{kind}] processing phase: {done:,} events in {processing:.1f}s = "
              f"{done / processing:,.0f} events/s; whole batches {whole:.1f}s; reads "
              f"again: Spark {spark_reads:.1f}s, payloads() {reading:.1f}s; load average "
              f"{os.getloadavg()[0]:.2f}")
    spark.stop()


if __name__ == "__main__":
    main()
