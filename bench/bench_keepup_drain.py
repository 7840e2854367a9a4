"""A kept-up pipeline draining a backlog through a real Airflow: how many transactions are in
flight, and how long records wait for a plan after a commit.

    python bench/bench_keepup_drain.py --records 1000000 --batch-size 20000

The pipeline is bench/freshness_pipelines.py's (``keep_up=True``, counts per key, the topology
in the JVM only, a one-task DAG, a PostgreSQL log of two partitions) with ``max_pending``
--max-pending (3), ``batch_size`` --batch-size, ``min_records`` --min-records and
``watch_interval`` --watch-interval (2 s, the default). An Airflow of separate processes (API
server, scheduler with Airflow's stock LocalExecutor, DAG processor, triggerer; a PostgreSQL
metadata database of its own) starts every run: the source watcher in the triggerer, no run
started by hand; processing on a local Spark Connect server, started and warmed up first (or a
running one, --spark-connect).

Once the watcher runs, --records records are appended to the log at once (the backlog), and
the benchmark waits until every one is committed. The figures come from the transactions'
own timestamps (``planned_at`` to ``committed_at``: onceflow.ops.drain):

- **in flight while records wait**: the transactions open on average from the first plan to
  the last (records waited unplanned all that time);
- **in flight over the drain**: the same to the last commit (the last batches' tail too);
- **commit to plan**: the longest wait from a commit to the next plan while more than
  ``min_records`` records waited unplanned, and how many commits waited longer than
  ``watch_interval``.

The counts are checked against a recount of what was produced. The load average is printed
before and after. Uses databases of its own (onceflow_bench_drain*, dropped at the start) and
a work folder (--folder, emptied at the start).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchkit import (
    loadavg,
    local_connect_port,
    recreate_database,
    server_dsn,
    warm_spark_connect,
)

RATE = 1000  # the name of the pipeline (fresh_<RATE>); the sizes are given, not derived


def run(args, server: str, spec: dict) -> dict:
    import freshness_pipelines
    from bench_freshness import Deployment, expected_counts

    from onceflow.core.db import connection
    from onceflow.core.registration import register
    from onceflow.core.registry import clear_cache, get_pipeline
    from onceflow.ops import drain
    from onceflow.spark import localspark

    clear_cache()
    name = freshness_pipelines.name(RATE)
    dag_id = f"onceflow_{name}"
    dsn = recreate_database(server, "onceflow_bench_drain")
    meta = recreate_database(server, "onceflow_bench_drain_meta", migrate=False)
    pipeline = get_pipeline(name)
    with connection(dsn) as conn:  # `onceflow init`
        register(conn, pipeline, create_source=True)
    spark_dir = args.folder / "spark-connect"
    port = (local_connect_port(args.spark_connect) if args.spark_connect
            else warm_spark_connect(spark_dir)[0])
    airflow = Deployment(Path(tempfile.mkdtemp(prefix="airflow-", dir=args.folder)), meta, dsn,
                         port, spec)
    try:
        airflow.start([dag_id])
        airflow.unpause(dag_id, name)
        print(f"Airflow up, the watcher running (logs in {airflow.home})", flush=True)
        payloads = [json.dumps({"k": f"k{i % 997}", "t": 0}) for i in range(args.records)]
        load_before = loadavg()
        with connection(dsn) as conn:
            pipeline.source.append(conn, payloads, chunk_size=100_000)
        print(f"{args.records:,} records appended; load average {load_before}", flush=True)
        deadline = time.monotonic() + args.timeout
        while True:
            done = int(airflow.query("""SELECT coalesce(sum("offset"), 0) FROM
                                        partition_offsets WHERE pipeline = %s""", (name,),
                                     dsn)[0][0])
            if done >= args.records:
                break
            airflow.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{done:,} of {args.records:,} records committed in "
                                   f"{args.timeout:.0f}s: logs in {airflow.home}")
            time.sleep(1)
        load_after = loadavg()
        with connection(dsn) as conn, conn.cursor() as cur:
            spans = drain.spans(cur, name)
        counts = dict(airflow.query(f"SELECT key, value FROM {name}_counts", (), dsn))
        runs = airflow.runs(dag_id)
    finally:
        airflow.stop()
        if not args.spark_connect:
            localspark.stop(port, folder=spark_dir)
    figures = drain.figures(spans, pipeline.batch_start_records, pipeline.watch_interval)
    return {**figures, "ok": counts == expected_counts(args.records), "runs": runs,
            "load": (load_before, load_after), "max_pending": pipeline.max_pending,
            "batch_size": pipeline.batch_size, "min_records": pipeline.batch_start_records,
            "watch_interval": pipeline.watch_interval}


def line(r: dict) -> str:
    slow = r["slow_after_commit"]
    return (f"drain of {r['records']:,} records, batch_size {r['batch_size']:,}, max_pending "
            f"{r['max_pending']}: {r['transactions']} transactions in {r['seconds']:.0f}s; in "
            f"flight {r['in_flight_waiting']:.2f} on average while records waited, "
            f"{r['in_flight_drain']:.2f} over the drain; commit to next plan at most "
            f"{r['commit_to_plan_max_s']}s while records waited ({len(slow)} commits over "
            f"watch_interval {r['watch_interval']:g}s{': ' + str(slow[:5]) if slow else ''}); "
            f"runs {r['runs']}; counts {'exact' if r['ok'] else 'WRONG'}; load average "
            f"{r['load'][0]} -> {r['load'][1]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_000_000, help="the backlog (1000000)")
    parser.add_argument("--batch-size", type=int, default=20_000,
                        help="(default 20000; 2500 at least)")
    parser.add_argument("--min-records", type=int, default=8_000,
                        help="(default 8000; 1000 at least)")
    parser.add_argument("--max-pending", type=int, default=3, help="(default 3)")
    parser.add_argument("--watch-interval", type=float, default=2.0, help="seconds (2)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds (3600)")
    parser.add_argument("--folder", type=Path, default=Path("/var/tmp/onceflow-bench-drain"),
                        help="work folder, emptied at the start")
    parser.add_argument("--spark-connect", metavar="URL", default=None,
                        help="processing on this running, warm Spark Connect server "
                             "(sc://127.0.0.1:PORT); default: a local one this run starts, "
                             "warms up and stops")
    args = parser.parse_args(argv)
    if args.records < 1 or args.max_pending < 1 or not 0 < args.min_records <= args.batch_size:
        parser.error("--records and --max-pending must be 1 or more, --min-records above 0 "
                     "and at most --batch-size")
    # freshness_pipelines sizes by seconds of a rate: these seconds give the sizes asked for
    spec = {"rates": [RATE], "min_s": args.min_records / RATE,
            "batch_s": args.batch_size / RATE, "max_delay_s": 6.0,
            "watch_interval": args.watch_interval, "max_pending": args.max_pending}
    os.environ["BENCH_FRESHNESS"] = json.dumps(spec)  # this process declares it as Airflow does
    os.environ["ONCEFLOW_PIPELINES"] = "freshness_pipelines:PIPELINES"
    import freshness_pipelines  # (after BENCH_FRESHNESS: it declares the pipeline at import)

    least = freshness_pipelines.sizing(RATE, {"min_s": 0, "batch_s": 0})
    if freshness_pipelines.sizing(RATE, spec) != (args.min_records, args.batch_size):
        parser.error(f"--min-records {args.min_records} and --batch-size {args.batch_size}: "
                     f"the pipeline's are at least {least[0]} and {least[1]} "
                     "(freshness_pipelines.sizing)")
    shutil.rmtree(args.folder, ignore_errors=True)
    args.folder.mkdir(parents=True)

    server, _ = server_dsn()
    print(f"load average before: {loadavg()}", flush=True)
    result = run(args, server, spec)
    print(line(result), flush=True)
    print(json.dumps(result, default=str))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
