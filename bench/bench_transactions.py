"""Throughput of whole transactions (begin -> process -> commit), phase functions called
directly with one warm SparkSession, on a fresh database.

    python bench/bench_transactions.py --events 1000000 --batch-size 250000

Prints the Spark session start apart, then per transaction and overall: events/s of the
processing phase, commit seconds, and end-to-end events/s; with --verify, the committed state
against a recount of the events (exit 1 when they differ). Uses ONCEFLOW_PG_DSN's server (or
the one on 127.0.0.1:5432) and a database of its own (onceflow_bench), dropped at the start.
With SPARK_REMOTE set, the session is that Spark Connect server's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from benchkit import need_examples, recreate_database, server_dsn

from onceflow.core import db
from onceflow.core.begin import begin
from onceflow.core.commit import commit
from onceflow.core.registration import register
from onceflow.core.registry import get_pipeline
from onceflow.ops.verify import recount as verify

need_examples()  # the examples' code and pipelines (bench/README.md)

from tweets_example.data import generate  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--batch-size", type=int, default=250_000)
    parser.add_argument("--verify", action="store_true",
                        help="recount the committed state at the end (onceflow verify "
                             "--recount); exit 1 when it differs")
    args = parser.parse_args()

    server, how = server_dsn()
    dsn = recreate_database(server, "onceflow_bench")
    conn = db.connect(dsn)
    db.migrate(conn)
    pipeline = get_pipeline("tweets", batch_size=args.batch_size)
    register(conn, pipeline, create_source=True)
    t = time.monotonic()
    pipeline.source.append(conn, generate(args.events, seed=1))
    print(f"PostgreSQL: {how}; produced {args.events} events in {time.monotonic() - t:.1f}s")

    from onceflow.spark.processing import process_batch
    from onceflow.spark.session import get_spark

    t = time.monotonic()
    spark = get_spark("onceflow-bench")
    if not os.environ.get("SPARK_REMOTE"):  # a Spark Connect session has no SparkContext
        spark.sparkContext.setLogLevel("ERROR")
    print(f"Spark session start: {time.monotonic() - t:.1f}s (not counted below)")

    total_proc = total_commit = 0.0
    done = txid = 0
    while done < args.events:
        txid += 1
        t0 = time.monotonic()
        batch = begin(conn, pipeline, f"bench-{txid}")
        t1 = time.monotonic()
        process_batch(spark, dsn, pipeline, batch.attempt)
        t2 = time.monotonic()
        result = commit(conn, pipeline, batch.attempt)
        t3 = time.monotonic()
        total_proc += t2 - t1
        total_commit += t3 - t2
        done += batch.records
        print(f"txid {txid}: {batch.records} events, begin {t1 - t0:.2f}s, process {t2 - t1:.2f}s "
              f"({batch.records / (t2 - t1):,.0f} ev/s), commit {t3 - t2:.2f}s "
              f"({result.rows_applied} rows)")
    print(f"processing phase: {done / total_proc:,.0f} events/s; commit total {total_commit:.2f}s;"
          f" end to end {done / (total_proc + total_commit):,.0f} events/s over {txid} "
          "transactions")
    ok = True
    if args.verify:
        t = time.monotonic()
        report = verify(conn, pipeline)
        print(report.line(), f"({time.monotonic() - t:.1f}s)")
        ok = report.ok
    spark.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
