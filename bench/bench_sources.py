"""Read N demo events through the processing phase from each source kind: the PostgreSQL log
(COPY through mapInArrow) and the file-segment log (Spark's Parquet reader).

    .venv/bin/python bench/bench_sources.py --events 10000000 --batch-size 2500000

Prints, per kind: produce time, then processing events/s (transform and staging included;
the Spark session start is reported apart), and verify. Uses a database of its own
(onceflow_bench_sources, dropped at the start) and a segments folder under .run/.
"""

from __future__ import annotations

import argparse
import shutil
import time

from bench_transactions import fresh_database

from helpers import produce
from onceflow.core import db
from onceflow.core.begin import begin
from onceflow.core.commit import commit
from onceflow.core.registration import register
from onceflow.core.registry import get_pipeline
from onceflow.dev import use_examples
from onceflow.dev.localenv import project_dir
from onceflow.dev.localpg import ensure_postgres
from onceflow.sources.segments import produce_segments

use_examples()  # the checkout's examples (code, pipelines), as `bash run.sh demo` has them

from tweets_example.data import generate  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=10_000_000)
    parser.add_argument("--batch-size", type=int, default=2_500_000)
    parser.add_argument("--kinds", default="postgres,files")
    args = parser.parse_args()

    server, how = ensure_postgres(project_dir())
    dsn = fresh_database(server, "onceflow_bench_sources")
    conn = db.connect(dsn)
    db.migrate(conn)
    root = project_dir() / ".run" / "bench-segments"
    shutil.rmtree(root, ignore_errors=True)
    print(f"PostgreSQL: {how}; {args.events:,} events per source kind")

    from spark_tasks.processing import process_batch
    from spark_tasks.session import get_spark

    t = time.monotonic()
    spark = get_spark("onceflow-bench-sources")
    spark.sparkContext.setLogLevel("ERROR")
    print(f"Spark session start: {time.monotonic() - t:.1f}s (not counted below)")

    for kind in args.kinds.split(","):
        name = {"postgres": "tweets", "files": "tweets_files"}[kind]
        pipeline = get_pipeline(name, batch_size=args.batch_size, max_pending=1000,
                                **({"source_path": str(root)} if kind == "files" else {}))
        register(conn, pipeline, create_source=True)
        t = time.monotonic()
        events = generate(args.events, seed=5)
        if kind == "files":
            produce_segments(conn, root, pipeline.topic, events, chunk_size=1_000_000)
        else:
            produce(conn, pipeline.topic, events, chunk_size=200_000)
        print(f"[{kind}] produced in {time.monotonic() - t:.1f}s")
        done, processing = 0, 0.0
        while done < args.events:
            batch = begin(conn, pipeline, f"bench-{kind}-{done}")
            t = time.monotonic()
            process_batch(spark, dsn, pipeline, batch.attempt)
            processing += time.monotonic() - t
            commit(conn, pipeline, batch.attempt)
            done += batch.records
        print(f"[{kind}] processing phase: {done:,} events in {processing:.1f}s = "
              f"{done / processing:,.0f} events/s")
    spark.stop()


if __name__ == "__main__":
    main()
