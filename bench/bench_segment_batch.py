"""Where a file-segments batch's time goes, step by step, beside the landing folder's JSON
lines on the same events (issue 39).

Uses the events bench/compare.py made under ``--folder`` (its landing folder, two JSON-lines
files): fills a fresh database with the sources of bench/workload.py (``segments``: the
events produced as segments; ``landing-json``: the folder indexed), then times, for one
batch of ``--events`` records (half from each partition), each step as its own Spark job.
The segments read as payloads (no ``json_schema``, the topology parses them with
``from_json``), every step including the ones before it:

- ``scan offsets``: the pushed-down range read, counted (no payload decoded);
- ``+ payloads``: the payloads decoded too (their total length);
- ``+ refusal check``: the spout's look for records it refuses (octet length and NUL of
  every payload, as runner.run_topology does), counted;
- ``+ from_json``: the url and flaky fields and the corrupt-record column parsed, counted;

then, for the payload segments, the segments with ``json_schema`` and the landing folder
(``json_schema``): ``read + decode`` (the source's decoded records, counted) and
``topology``: run_topology(...).collect() of the workload's topology, as process_batch runs
it, looking for refusals both ways and as the source's may_refuse says (not: segments now
record their longest payload; before, a batch always looked); and
``process_batch``: the whole processing phase of one planned batch of that size (read,
topology, collect, staging in PostgreSQL), as a transaction's process step runs it.
Then ``--loop-rounds`` rounds of whole loops (begin, process, commit of every event of the
folder in batches of ``--events``, as compare.py's library path runs them), each source
in turn, each in a fresh database, checked against the folder's ground truth (exit 1 when one
is wrong).
Best of ``--repeat``, after one untimed round: wall seconds, and the JVM's CPU seconds (its
own and its Python workers'; a Spark Connect server's with ``--server-pid``), which move less
with a shared machine's load.
``--spark-connect URL`` runs it through that Spark Connect server (the library path), else
in a local session.

    python bench/compare.py --events 1000000 --batches 2 --systems streaming \\
        --sources landing-json --acker-events 0 --folder /var/tmp/seg-bench
    python bench/bench_segment_batch.py --folder /var/tmp/seg-bench \\
        --events 500000 [--spark-connect sc://127.0.0.1:15002]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from benchkit import loadavg, need_examples, recreate_database, server_dsn

need_examples()  # the examples' code and pipelines (bench/README.md)



def jvm_cpu(pid: int | None) -> float:
    """CPU seconds the process ``pid`` (the local session's JVM, or the Spark Connect
    server's) and its reaped children used so far; 0 when there is none to ask."""
    if pid is None:
        return 0.0
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def timed(repeat: int, action, pid: int | None = None) -> tuple[float, float, float]:
    """(the best wall seconds, the least JVM CPU seconds, the least CPU seconds of this
    driver) of ``repeat`` runs of ``action``, after one untimed run (plans and JIT warm). On
    a shared machine the CPU seconds move less with the load than the wall clock."""
    action()
    best, cpu, driver = float("inf"), float("inf"), float("inf")
    for _ in range(repeat):
        used, mine, started = jvm_cpu(pid), time.process_time(), time.perf_counter()
        action()
        best = min(best, time.perf_counter() - started)
        cpu = min(cpu, jvm_cpu(pid) - used)
        driver = min(driver, time.process_time() - mine)
    return best, cpu, driver


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, default=Path("/var/tmp/onceflow-bench"))
    parser.add_argument("--events", type=int, default=500_000,
                        help="records of the batch, half from each partition")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--spark-connect", metavar="URL", default=None)
    parser.add_argument("--server-pid", type=int, default=None,
                        help="with --spark-connect: the server's process, whose CPU seconds "
                             "are counted (a local server's pid: `onceflow spark status`)")
    parser.add_argument("--explain", action="store_true",
                        help="print the segments read's physical plan")
    parser.add_argument("--loop-rounds", type=int, default=2,
                        help="rounds of the whole-loop part (0: skip it)")
    args = parser.parse_args()
    os.environ["ONCEFLOW_BENCH_FOLDER"] = str(args.folder / "landing")
    os.environ["ONCEFLOW_PIPELINES"] = "workload:PIPELINES"
    files = sorted((args.folder / "landing").glob("part-*.json"))
    if len(files) != 2:
        raise SystemExit(f"{args.folder}/landing holds {len(files)} JSON-lines files, not 2: "
                         "run compare.py --batches 2 with this --folder first (see --help)")

    from compare import fill
    from pyspark.sql import functions as F
    from workload import SOURCES

    from onceflow.core.begin import begin
    from onceflow.core.db import connection, transaction
    from onceflow.core.planner import PartitionRange
    from onceflow.core.registration import register
    from onceflow.spark.processing import process_batch
    from onceflow.spark.records import batch_records
    from onceflow.spark.runner import run_topology
    from onceflow.spark.session import connect_session, get_spark

    server, _ = server_dsn()
    dsn = recreate_database(server, "onceflow_bench_segment_batch")
    fill(dsn, ["segments"], files, args.folder)
    segments, landing = SOURCES["segments"], SOURCES["landing-json"]
    with connection(dsn) as conn:
        register(conn, landing, create_source=True)
        with transaction(conn) as cur:
            landing.source.index(cur)
    half = args.events // 2
    ranges = [PartitionRange(p, 0, half) for p in (0, 1)]

    if args.spark_connect:
        session = connect_session(args.spark_connect, "onceflow-bench-segment-batch")
        spark, pid = session.__enter__(), args.server_pid
    else:
        session, spark = None, get_spark("onceflow-bench-segment-batch")
        spark.sparkContext.setLogLevel("ERROR")
        pid = spark.sparkContext._gateway.proc.pid

    def count(df, *cols):
        return lambda: df.agg(*cols).collect()

    def topology(pipeline, refusals=None):
        """The topology's run, looking for refusals as the source's may_refuse says (or
        as ``refusals`` says)."""
        source = pipeline.source
        if refusals is None:
            with connection(dsn) as conn, transaction(conn) as cur:
                refusals = source.may_refuse(cur, ranges)

        def run():
            run_topology(pipeline.build_topology(), batch_records(spark, dsn, source, ranges),
                         attempt=1, max_record_bytes=source.max_record_bytes,
                         refusals=refusals).collect()
        return run, refusals

    print(f"load average before: {loadavg()}", flush=True)
    rows = []
    # the segments as they were read before json_schema: payloads, parsed by the topology
    payload = dataclasses.replace(
        segments, source=dataclasses.replace(segments.source, json_schema=None),
        topology="workload:topology_payload")
    seg = payload.source.read(spark, dsn, ranges)
    if args.explain:
        seg.explain()
    size = F.octet_length("payload")
    decoded = seg.select(F.from_json(
        "payload", "url string, flaky int, _corrupt_record string",
        {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": "_corrupt_record"}).alias("j"))
    name = "segments, payloads + from_json"
    rows += [
        (name, "scan offsets", timed(args.repeat, count(seg, F.count("offset")), pid)),
        (name, "+ payloads", timed(args.repeat, count(seg, F.sum(size)), pid)),
        (name, "+ refusal check", timed(args.repeat, count(seg, F.count(
            F.when((size > payload.source.max_record_bytes)
                   | F.col("payload").contains("\u0000"), 1))), pid)),
        (name, "+ from_json", timed(args.repeat, count(
            decoded, F.count("j.url"), F.count("j._corrupt_record")), pid)),
    ]
    # the topology looking for refusals, as it did before the index knew each segment's
    # longest payload, and as may_refuse says now
    for name, pipeline, looks in (("segments, payloads + from_json", payload, (True, None)),
                                  ("segments, json_schema", segments, (True, None)),
                                  ("landing-json, json_schema", landing, (None,))):
        if pipeline is not payload:
            read = pipeline.source.read(spark, dsn, ranges)
            if args.explain:
                read.explain()
            rows.append((name, "read + decode", timed(args.repeat, count(
                read, F.count("url"), F.count("_corrupt_record")), pid)))
        for look in looks:
            run, refusals = topology(pipeline, look)
            rows.append((name, f"topology (refusals looked for: {refusals})",
                         timed(args.repeat, run, pid)))
    # the whole processing phase of one planned batch (read, topology, staging), as a
    # transaction's process step runs it; staged again each time (a re-run replaces it)
    with connection(dsn) as conn:
        planned = {name: begin(conn, dataclasses.replace(pipeline, batch_size=args.events),
                               "bench-segment-batch").attempt
                   for name, pipeline in (("segments", segments), ("landing", landing))}
        with transaction(conn) as cur:  # as segments indexed before largest_bytes read
            cur.execute("SELECT base_offset, partition, largest_bytes FROM source_segments")
            known = cur.fetchall()
            cur.execute("UPDATE source_segments SET largest_bytes = NULL")
    rows.append(("segments, payloads + from_json", "process_batch (refusals looked for)",
                 timed(args.repeat, lambda: process_batch(
                     spark, dsn, payload, planned["segments"]), pid)))
    with connection(dsn) as conn, transaction(conn) as cur:
        cur.executemany("UPDATE source_segments SET largest_bytes = %s "
                        "WHERE base_offset = %s AND partition = %s",
                        [(n, base, p) for base, p, n in known])
    for name, pipeline, attempt in (
            ("segments, json_schema", segments, planned["segments"]),
            ("landing-json, json_schema", landing, planned["landing"])):
        rows.append((name, "process_batch", timed(
            args.repeat, lambda pipeline=pipeline, attempt=attempt: process_batch(
                spark, dsn, pipeline, attempt), pid)))
    # whole loops, as compare.py's library path runs them: every event of the folder, in
    # batches of --events, in flight at once; a fresh database filled per run; the counts
    # checked against the folder's ground truth
    from compare import counts_ok, onceflow_loop, state_tables

    truth = json.loads((args.folder / "data.json").read_text())["truth"]
    looped = []
    for turn in range(args.loop_rounds):
        for name, pipeline in (("segments, payloads + from_json", payload),
                               ("segments, json_schema", segments),
                               ("landing-json, json_schema", landing)):
            pipeline = dataclasses.replace(pipeline, batch_size=args.events)
            loop_dsn = recreate_database(server, "onceflow_bench_segment_loop")
            source = "landing-json" if pipeline.source is landing.source else "segments"
            fill(loop_dsn, [source], files, args.folder)
            if pipeline.source is payload.source:  # as segments indexed before largest_bytes
                with connection(loop_dsn) as conn, transaction(conn) as cur:
                    cur.execute("UPDATE source_segments SET largest_bytes = NULL")
            used, mine, started = jvm_cpu(pid), time.process_time(), time.perf_counter()
            done = onceflow_loop(spark, loop_dsn, pipeline, len(files), pipeline.max_pending)
            looped.append((name, turn + 1, time.perf_counter() - started,
                           jvm_cpu(pid) - used, time.process_time() - mine,
                           done["process_s"], counts_ok(loop_dsn, *state_tables(pipeline),
                                                        truth)))
    print(f"load average after: {loadavg()}")
    print(f"\n{args.events} records, best of {args.repeat}"
          f" ({'Spark Connect' if args.spark_connect else 'local session'})")
    print(f"{'':32s} {'step':40s} {'wall s':>7s} {'JVM CPU s':>9s} {'driver CPU s':>12s}")
    for source, step, (seconds, cpu, driver) in rows:
        print(f"{source:32s} {step:40s} {seconds:7.2f} {cpu:9.2f} {driver:12.2f}")
    if looped:
        print(f"\nwhole loops: {len(files)} batches of {args.events} records, "
              "in flight at once (compare.py's library path)")
        print(f"{'':32s} {'round':>5s} {'wall s':>7s} {'JVM CPU s':>9s} {'driver CPU s':>12s} "
              f"{'process s (median)':>18s} check")
        for name, turn, seconds, cpu, driver, process, ok in looped:
            print(f"{name:32s} {turn:5d} {seconds:7.2f} {cpu:9.2f} {driver:12.2f} "
                  f"{process:18.2f} {'OK' if ok else 'WRONG'}")
    if session is not None:
        session.__exit__(None, None, None)
    else:
        spark.stop()
    return 0 if all(ok for *_, ok in looped) else 1


if __name__ == "__main__":
    sys.exit(main())
