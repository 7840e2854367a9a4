"""How cost grows: with the events, the distinct keys a batch changes, the transactions in
flight, and the committed history (issue 39's scaling table).

    python bench/bench_scaling.py --parts events,keys,inflight,history

Parts (--parts, comma-separated):

- ``events``: the library path (onceflow.spark.loop.run_batches, one local Spark session) on
  --events N events (each of --sizes) in --batch-size batches, from file segments (or the
  PostgreSQL log: --source postgres), through JVM bolts only (bench/workload.py's topology,
  decoding each payload with from_json): wall s, events/s, per-batch process and commit
  medians. --in-flight batches are processed at once.
- ``keys``: the commit of a batch that changes K distinct keys of a count state (each of
  --keys). The batch is planned by begin over a few records; its staging (K rows ``url_counts,
  key, 1``) is written by onceflow.core.staging.stage_group, what processing does last, so the
  figure is the commit alone, without Spark. Round 1 inserts K new keys; rounds 2.. update the
  same K keys of a state that holds them. Prints the commit's time per step (on_step), wall
  and the server backend's CPU (steadier on a loaded machine), rows applied per second, and
  PASS/FAIL of the 1M-key commit against --commit-target seconds.
- ``inflight``: the events workload at 1, 2, 3 batches in flight (--inflight-events events).
- ``history``: --history small transactions (--history-records records each) through begin,
  stage_group (--history-records distinct keys, as processing would stage them) and commit,
  without Spark: the begin's and the commit's cost at the 1st, 100th, 500th and last batch
  (medians over 11 neighbours), flat or not.

Uses a database of its own (onceflow_bench_scaling, dropped at the start of each part) and a
segments folder under /var/tmp/onceflow-bench-scaling. Prints the load average before and
after each part. Larger sizes (not run in CI; minutes to hours on a small machine):

    python bench/bench_scaling.py --parts events --sizes 10000000,100000000
    python bench/bench_scaling.py --parts keys --keys 10000000
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from benchkit import loadavg, migrated_database, need_examples, server_dsn, timed

need_examples()  # the examples' code and pipelines (bench/README.md)


from onceflow import FileSegments, Pipeline, PostgresLog, StateSpec  # noqa: E402
from onceflow.core.begin import begin  # noqa: E402
from onceflow.core.commit import commit  # noqa: E402
from onceflow.core.db import connection  # noqa: E402
from onceflow.core.registration import register  # noqa: E402
from onceflow.core.staging import stage_group  # noqa: E402

DATABASE = "onceflow_bench_scaling"
TOPIC = "scaling"


def pipeline_for(name: str, source, batch_size: int, max_pending: int = 3,
                 kind: str = "opaque") -> Pipeline:
    return Pipeline(
        name=name, description="bench_scaling", source=source,
        topology="workload:topology_payload", batch_size=batch_size, max_pending=max_pending,
        states=(StateSpec(f"{name}_url_counts", kind, source="url_counts"),
                StateSpec(f"{name}_domain_counts", kind, source="domain_counts")))


def source_of(kind: str, root: Path, partitions: int = 2):
    if kind == "files":
        return FileSegments(topic=TOPIC, path=str(root), partitions=partitions)
    return PostgresLog(topic=TOPIC, partitions=partitions)


def produce(conn, kind: str, root: Path, events: int, pipeline: Pipeline) -> float:
    """Append ``events`` generated tweets to the pipeline's topic; the seconds it took."""
    from onceflow.sources.segments import produce_segments
    from tweets_example.data import generate

    register(conn, pipeline, create_source=True)
    started = time.monotonic()
    payloads = generate(events, seed=7)
    if kind == "files":
        produce_segments(conn, root, TOPIC, payloads, chunk_size=1_000_000)
    else:
        pipeline.source.append(conn, payloads, chunk_size=200_000)
    return time.monotonic() - started


# -- events and inflight -------------------------------------------------------------------

def run_events(server: str, spark, args, events: int, in_flights: list[int]) -> list[dict]:
    """One topic of ``events`` events; a pipeline of its own (own offsets and state) per
    in-flight count, each reading the whole topic."""
    from onceflow.spark.loop import run_batches

    dsn = migrated_database(server, DATABASE)
    root = args.folder / "segments"
    shutil.rmtree(root, ignore_errors=True)
    out = []
    with connection(dsn) as conn:
        for n, in_flight in enumerate(in_flights):
            pipeline = pipeline_for(f"scaling_if{in_flight}", source_of(args.source, root),
                                    args.batch_size)
            if n == 0:
                print(f"  produced {events:,} events ({args.source}) in "
                      f"{produce(conn, args.source, root, events, pipeline):.1f}s", flush=True)
            register(conn, pipeline, create_source=True)
            load = loadavg()
            done = run_batches(spark, dsn, pipeline, in_flight=in_flight,
                               max_batches=-(-events // args.batch_size) + 1,
                               run_prefix="scaling")
            r = {"events": events, "in_flight": in_flight, "seconds": done.seconds,
                 "records": done.records, "batches": len(done.process_s),
                 "process_s": statistics.median(done.process_s),
                 "commit_s": statistics.median(done.commit_s), "load": f"{load} -> {loadavg()}"}
            out.append(r)
            print(f"  {events:>11,} events, {in_flight} in flight: {r['seconds']:.1f}s = "
                  f"{events / r['seconds']:,.0f} events/s; {r['batches']} batches, per batch "
                  f"process {r['process_s']:.2f}s, commit {r['commit_s']:.2f}s; "
                  f"{'OK' if r['records'] == events else 'WRONG record count'} "
                  f"(load {r['load']})", flush=True)
    return out


# -- keys ------------------------------------------------------------------------------------

def deltas_csv(keys: int, state: str = "url_counts") -> io.StringIO:
    buf = io.StringIO()
    buf.writelines(f"{state},https://k.example/{i:09d},1\n" for i in range(keys))
    buf.seek(0)
    return buf


def backend_cpu(pid: int) -> float:
    """CPU seconds (user + system) the server process ``pid`` has used; 0 where it cannot be
    read (a server on another machine). Steadier than wall time on a loaded machine."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class StepClock:
    """The commit's steps (on_step) as seconds since the previous one, wall and the
    backend's CPU."""

    def __init__(self, backend_pid: int):
        self.pid = backend_pid
        self.last = time.perf_counter()
        self.last_cpu = backend_cpu(backend_pid)
        self.steps: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def __call__(self, name: str) -> None:
        now, cpu = time.perf_counter(), backend_cpu(self.pid)
        self.steps[name] = self.steps.get(name, 0.0) + now - self.last
        self.cpu[name] = self.cpu.get(name, 0.0) + cpu - self.last_cpu
        self.last, self.last_cpu = now, cpu


def run_keys(server: str, args, keys: int) -> list[dict]:
    dsn = migrated_database(server, DATABASE)
    pipeline = pipeline_for("scaling_keys", PostgresLog(topic=TOPIC, partitions=1), 10,
                            kind=args.state_kind)
    state = f"{pipeline.name}_url_counts"
    out = []
    with connection(dsn) as conn:
        produce(conn, "postgres", args.folder, 10 * args.key_rounds, pipeline)
        for n in range(args.key_rounds):
            batch = begin(conn, pipeline, f"keys-{n}")
            csv_in = deltas_csv(keys)
            stage_cpu = backend_cpu(conn.get_backend_pid())
            stage_s, _ = timed(lambda b=batch, rows=csv_in: stage_group(
                conn, pipeline.name, b.attempt, 0, deltas_csv=rows,
                rejects_csv=io.StringIO(), records=b.records))
            stage_cpu = backend_cpu(conn.get_backend_pid()) - stage_cpu
            clock = StepClock(conn.get_backend_pid())
            load = loadavg()
            seconds, done = timed(lambda b=batch, c=clock: commit(conn, pipeline, b.attempt,
                                                                   on_step=c))
            clock("after")  # what commit() does after its last step
            applied = done.table_rows[state]
            cpu = sum(clock.cpu.values())
            # the serial section: up to the COMMIT that releases the pipeline's lock (the
            # staging is deleted after it)
            names = list(clock.steps)
            end = names.index("committed") + 1 if "committed" in names else len(names)
            serial = sum(clock.steps[k] for k in names[:end])
            r = {"keys": keys, "round": n + 1, "stage_s": stage_s, "commit_s": seconds,
                 "serial_s": serial, "apply_s": clock.steps[f"state:{pipeline.name}_url_counts"],
                 "applied": applied, "steps": clock.steps, "cpu": clock.cpu, "load": load}
            out.append(r)
            kind = "new keys" if n == 0 else "updates"
            print(f"  {keys:>11,} keys, round {n + 1} ({kind}): commit {seconds:.2f}s, "
                  f"serial {serial:.2f}s "
                  f"({applied / seconds:,.0f} rows/s; apply {r['apply_s']:.2f}s = "
                  f"{applied / r['apply_s']:,.0f} rows/s; backend CPU {cpu:.2f}s); staging "
                  f"written in {stage_s:.2f}s (backend CPU {stage_cpu:.2f}s; load {load})",
                  flush=True)
            print("      steps, wall (backend CPU): " + ", ".join(
                f"{k} {v:.3f}s ({clock.cpu[k]:.2f})" for k, v in clock.steps.items()
                if v >= 0.001), flush=True)
    return out


# -- history ---------------------------------------------------------------------------------

def run_history(server: str, args) -> dict:
    dsn = migrated_database(server, DATABASE)
    size = args.history_records
    pipeline = pipeline_for("scaling_history", PostgresLog(topic=TOPIC, partitions=2), size)
    begins, commits = [], []
    with connection(dsn) as conn:
        produce(conn, "postgres", args.folder, args.history * size, pipeline)
        for n in range(args.history):
            begin_s, batch = timed(lambda n=n: begin(conn, pipeline, f"history-{n}"))
            # distinct keys per batch, from a key space 10 batches wide: the state grows to
            # 10 batches' keys and later batches update them
            first = n % 10 * size
            rows = "".join(f"url_counts,https://h.example/{first + i},1\n" for i in range(size))
            stage_group(conn, pipeline.name, batch.attempt, 0, deltas_csv=io.StringIO(rows),
                        rejects_csv=io.StringIO(), records=batch.records)
            commit_s, _ = timed(lambda b=batch: commit(conn, pipeline, b.attempt))
            begins.append(begin_s)
            commits.append(commit_s)
            if (n + 1) % 100 == 0:
                print(f"  {n + 1} transactions", flush=True)

    def near(series: list[float], at: int) -> float:
        i = min(max(at - 1, 0), len(series) - 1)
        return statistics.median(series[max(0, i - 5):i + 6])

    marks = sorted({1, 100, 500, args.history} & set(range(1, args.history + 1)))
    r = {"marks": marks, "begin_ms": [near(begins, m) * 1000 for m in marks],
         "commit_ms": [near(commits, m) * 1000 for m in marks]}
    print("  batch      " + "".join(f"{m:>9}" for m in marks))
    print("  begin ms   " + "".join(f"{v:>9.1f}" for v in r["begin_ms"]))
    print("  commit ms  " + "".join(f"{v:>9.1f}" for v in r["commit_ms"]))
    for what in ("begin_ms", "commit_ms"):
        first, last = r[what][0], r[what][-1]
        verdict = "flat" if last <= first * 1.5 + 1.0 else "GROWS"
        print(f"  {what.split('_')[0]}: batch {marks[-1]} / batch 1 = {last / first:.2f}x: "
              f"{verdict}")
    return r


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="events,keys,inflight,history",
                        help="comma-separated: events, keys, inflight, history")
    parser.add_argument("--sizes", default="1000000",
                        help="events: comma-separated event counts (default 1000000)")
    parser.add_argument("--batch-size", type=int, default=250_000,
                        help="events, inflight: records per transaction (default 250000)")
    parser.add_argument("--in-flight", type=int, default=3,
                        help="events: batches processed at once (default 3)")
    parser.add_argument("--inflight-events", type=int, default=1_000_000,
                        help="inflight: events of the 1/2/3 in-flight runs (default 1000000)")
    parser.add_argument("--source", choices=("files", "postgres"), default="files",
                        help="events, inflight: file segments or the PostgreSQL log")
    parser.add_argument("--keys", default="100000,1000000",
                        help="keys: comma-separated distinct keys per batch")
    parser.add_argument("--key-rounds", type=int, default=2,
                        help="keys: batches per size (1: new keys, then updates; default 2)")
    parser.add_argument("--state-kind", choices=("opaque", "transactional"), default="opaque",
                        help="keys: the count states' kind (default opaque)")
    parser.add_argument("--commit-target", type=float, default=3.0,
                        help="keys: seconds a 1M-key commit may take (default 3)")
    parser.add_argument("--history", type=int, default=1000,
                        help="history: transactions (default 1000)")
    parser.add_argument("--history-records", type=int, default=100,
                        help="history: records (and staged keys) per transaction")
    parser.add_argument("--folder", type=Path, default=Path("/var/tmp/onceflow-bench-scaling"))
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - {"events", "keys", "inflight", "history"}
    if unknown:
        parser.error(f"--parts: {sorted(unknown)} unknown; give events, keys, inflight, "
                     "history")
    if args.key_rounds < 1 or args.history < 1:
        parser.error("--key-rounds and --history: give 1 or more")


    server, how = server_dsn()
    print(f"PostgreSQL: {how}; load average {loadavg()}", flush=True)
    ok = True
    spark = None
    try:
        if {"events", "inflight"} & set(parts):
            import peers

            spark = peers.local_session("onceflow-bench-scaling")
            spark.range(1).count()  # the JVM and session are up before any clock starts
        if "events" in parts:
            print(f"\nevents (load average {loadavg()})", flush=True)
            for events in (int(s) for s in args.sizes.split(",")):
                run_events(server, spark, args, events, [args.in_flight])
        if "inflight" in parts:
            print(f"\ntransactions in flight (load average {loadavg()})", flush=True)
            run_events(server, spark, args, args.inflight_events, [1, 2, 3])
        if spark is not None:
            spark.stop()
            spark = None
        if "keys" in parts:
            print(f"\ndistinct keys per batch, {args.state_kind} states (load average "
                  f"{loadavg()})", flush=True)
            for keys in (int(s) for s in args.keys.split(",")):
                for r in run_keys(server, args, keys):
                    if keys == 1_000_000:
                        passed = r["commit_s"] <= args.commit_target
                        ok = ok and passed
                        print(f"  1M-key commit, round {r['round']}: {r['commit_s']:.2f}s "
                              f"<= {args.commit_target}s: {'PASS' if passed else 'FAIL'} "
                              f"(serial section {r['serial_s']:.2f}s)")
        if "history" in parts:
            print(f"\ncommitted history (load average {loadavg()})", flush=True)
            run_history(server, args)
    finally:
        if spark is not None:
            spark.stop()
    print(f"\nload average after: {loadavg()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
