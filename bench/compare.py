"""onceflow against what a user would pick instead, on the same data, in one run.

    .venv/bin/python bench/compare.py --events 10000000 --batches 10

Generates the events once (seeded; reused while --events and --seed stay the same) as JSON
lines files (one per batch) in a landing folder, computes the ground truth in Python, then
runs, on that folder, each system asked for (--systems):

- ``raw``: one Spark batch job, COPY out (bench/peers.py; no guarantees: the practical limit);
- ``streaming``: Spark Structured Streaming, text file source parsed by from_json (as a
  bolt parses a payload), foreachBatch upsert fenced by batchId (bench/peers.py), one file
  per micro-batch; the baseline of the "vs SS" column;
- ``streaming-json``: the same with Spark's JSON source, as most users read JSON files (its
  parser takes each line's bytes; from_json decodes each payload first); the baseline of the
  "vs SS-json" column, the like of onceflow's W, whose landing folder decodes the events
  (``json_schema``);
- ``library``: onceflow without Airflow (spark_tasks.loop.run_batches): --in-flight batches
  processed at once (default: max_pending, as many as the Airflow path runs), committed in
  txid order, one local Spark session in this process;
- ``connect``: the same through a Spark Connect server (the warm Spark of the Airflow path);
- ``airflow``: onceflow through a real Airflow scheduler (scheduler, triggerer,
  dag-processor, LocalExecutor, PostgreSQL metadata), the runs triggered at once; its DAG
  runs a transaction in one task (``dag_shape="single"``);
- ``airflow-phases``: the same on the same Airflow with a task per phase (begin >> process
  >> commit), the default shape.

Each system but Airflow's runs ``--rounds`` times (default 2), the rounds interleaved, and
its fastest round counts: the first round of a system warms the JVM's code paths it runs
(the JIT), as a long-running deployment's are; the Airflow systems run once. The local
systems share one JVM, so each warms it for the next (Structured Streaming's second round is
that JVM's sixth run); the Spark Connect server of ``connect`` and ``airflow`` is a JVM of its
own, which first runs the workload ``--server-warm-up`` times (default 3, untimed, checked):
its JIT compiled 10,500 methods in its first run, 3,700 in the second, still 1,000 in the
seventh, which took 13.2 s against the second's 17.0 (a long-running server compiled them
long ago). Every round's result is checked against the ground truth. Then the table: wall
seconds, events/s, each against Structured Streaming, CPU seconds (the machine's busy CPU
during the system's run: on two cores that run CPU-bound, the figure that moves least with
the machine's speed), the per-batch fixed cost of the warm Spark, the acker on and off (the
tweets example's topology, with its per-record Python bolt), and the load average (the
machine must be quiet for the figures to mean anything).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from onceflow.dev import use_examples  # noqa: E402

use_examples()  # the checkout's examples (code, pipelines), as `bash run.sh demo` has them

import peers  # noqa: E402

from onceflow.dev.localpg import recreate_database  # noqa: E402


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


class CpuClock:
    """The machine's busy CPU seconds (every core, every process: Spark's JVM and Python
    workers, the driver, Airflow, PostgreSQL) since it was made. On a quiet two-core
    machine that runs CPU-bound this is what a system costs, and it moves less with the
    machine's speed than the wall clock. (A process tree's own figures miss what its
    short-lived children used: a Python worker reaped by no one in the tree.)"""

    def __init__(self):
        from airflow_run import machine_cpu_s

        self._now = machine_cpu_s
        self.start = self._now()

    def seconds(self) -> float:
        return self._now() - self.start


def prepare(folder: Path, events: int, batches: int, seed: int) -> tuple[list[Path], dict]:
    """The landing folder's files and the ground truth (reused when already made)."""
    from tweets_example.data import generate

    landing, stamp = folder / "landing", folder / "data.json"
    want = {"events": events, "batches": batches, "seed": seed}
    if stamp.exists() and json.loads(stamp.read_text()).get("spec") == want:
        truth = json.loads(stamp.read_text())["truth"]
        return sorted(landing.glob("part-*.json")), truth
    shutil.rmtree(folder, ignore_errors=True)
    print(f"generating {events} events in {batches} files ...", flush=True)
    payloads = list(generate(events, seed=seed, malformed_share=0.02, poison_share=0.0,
                             flaky_share=0.0))
    files = peers.write_json_lines(landing, payloads, batches)
    past = time.time() - 60
    for f in files:
        os.utime(f, (past, past))
    print("computing the ground truth ...", flush=True)
    urls, domains = peers.ground_truth(payloads)
    truth = {"urls": dict(urls), "domains": dict(domains)}
    stamp.write_text(json.dumps({"spec": want, "truth": truth}))
    return files, truth


def onceflow_loop(spark, dsn: str, pipeline, batches: int, in_flight: int = 1) -> dict:
    """begin, process, commit until the folder is read: the library path
    (spark_tasks.loop.run_batches, ``in_flight`` batches processed at once)."""
    from onceflow.core.db import connection
    from onceflow.core.registration import register
    from spark_tasks.loop import run_batches

    with connection(dsn) as conn:
        register(conn, pipeline, create_source=True)
    done = run_batches(spark, dsn, pipeline, in_flight=in_flight, max_batches=batches * 2,
                       run_prefix="bench")
    return {"seconds": done.seconds, "batches": len(done.process_s), "in_flight": in_flight,
            "process_s": statistics.median(done.process_s) if done.process_s else 0.0,
            "commit_s": statistics.median(done.commit_s) if done.commit_s else 0.0}


def counts_ok(dsn: str, url_table: str, domain_table: str, truth: dict) -> bool:
    def positive(counts):
        return {k: v for k, v in counts.items() if v}

    return (peers.read_table(dsn, url_table) == positive(truth["urls"])
            and peers.read_table(dsn, domain_table) == positive(truth["domains"]))


def fixed_cost(url: str, dsn: str, pipeline) -> float:
    """What a processing task costs beyond its data: a one-record batch, processed the way the
    Airflow task does (the Spark Connect session processing tasks share, the fence, the
    lease, staging)."""
    from onceflow.core.begin import begin
    from onceflow.core.commit import commit
    from onceflow.core.db import connect
    from onceflow.core.registration import register
    from spark_tasks.processing import process_batch
    from spark_tasks.session import SHARED_SESSION_KEY, connect_session

    conn = connect(dsn)
    register(conn, pipeline, create_source=True)
    costs = []
    for n in range(3):
        batch = begin(conn, pipeline, f"fixed-{n}")
        t0 = time.perf_counter()
        with connect_session(url, "onceflow-bench-fixed", shared=SHARED_SESSION_KEY) as spark:
            process_batch(spark, dsn, pipeline, batch.attempt)
        costs.append(time.perf_counter() - t0)
        commit(conn, pipeline, batch.attempt)
    conn.close()
    return statistics.median(costs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=10_000_000)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--systems",
                        default="raw,streaming,streaming-json,library,connect,airflow,"
                                "airflow-phases",
                        help="comma-separated: raw, streaming, streaming-json, library, "
                             "connect, airflow, airflow-phases")
    parser.add_argument("--acker-events", type=int, default=2_000_000,
                        help="events for the acker on/off figure (0: skip it)")
    parser.add_argument("--acker-rounds", type=int, default=2,
                        help="rounds of the acker figure, off and on in turn; the best of "
                             "each counts (default 2)")
    parser.add_argument("--folder", type=Path, default=Path("/var/tmp/onceflow-bench"))
    parser.add_argument("--spark-connect", metavar="URL", default=None,
                        help="the Spark Connect server of the connect and airflow systems "
                             "(sc://host:port, running and warm); default: a local one this "
                             "run starts, warms up and stops")
    parser.add_argument("--server-warm-up", type=int, default=3, metavar="N",
                        help="rounds of the workload the Spark Connect server runs, untimed "
                             "and checked, before the connect and airflow systems (default "
                             "3): its JIT compiles Spark's code paths over several runs, as "
                             "the local systems' shared JVM does by running one after the "
                             "other; 0: none")
    parser.add_argument("--timeline", type=Path, default=None,
                        help="airflow: write each task's queued, start and end time and "
                             "each transaction's planned and committed time to this JSON "
                             "file")
    parser.add_argument("--rounds", type=int, default=2,
                        help="times each system runs but Airflow's, interleaved; the fastest "
                             "counts, each is checked (default 2: the first warms the JVM's "
                             "code paths, as a long-running deployment's are)")
    parser.add_argument("--in-flight", type=int, default=None,
                        help="library paths: batches processed at once, committed in order "
                             "(default: the pipeline's max_pending, the runs in flight of "
                             "the Airflow path; 1: one after the other)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give 1 or more")
    if args.server_warm_up < 0:
        parser.error(f"--server-warm-up {args.server_warm_up}: give 0 or more")
    if args.acker_rounds < 1:
        parser.error(f"--acker-rounds {args.acker_rounds}: give 1 or more")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]

    from onceflow.dev.localpg import ensure_postgres

    server, _ = ensure_postgres(Path.cwd())
    os.environ["ONCEFLOW_BENCH_FOLDER"] = str(args.folder / "landing")
    os.environ["ONCEFLOW_PIPELINES"] = "workload:PIPELINES"
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE),
                                                             os.environ.get("PYTHONPATH")]))
    files, truth = prepare(args.folder, args.events, args.batches, args.seed)
    from onceflow.core.registry import get_pipeline

    batch = -(-args.events // args.batches)
    w = get_pipeline("bench_w", batch_size=batch)
    if args.in_flight is None:
        args.in_flight = w.max_pending
    results: dict[str, dict] = {}
    print(f"load average before: {loadavg()}", flush=True)
    spark = None
    if {"raw", "streaming", "streaming-json", "library"} & set(systems):
        spark = peers.local_session("onceflow-bench")
        spark.range(1).count()  # the JVM and session are up before any clock starts

    def raw() -> dict:
        dsn = recreate_database(server, "onceflow_bench_raw")
        r = peers.raw_spark(spark, files, dsn, "raw_")
        return {**r, "ok": peers.check(dsn, "raw_", truth["urls"], truth["domains"])}

    def streaming(reader: str) -> dict:
        dsn = recreate_database(server, f"onceflow_bench_ss_{reader}")
        checkpoint = args.folder / f"checkpoint-{reader}"
        shutil.rmtree(checkpoint, ignore_errors=True)
        r = peers.structured_streaming(spark, args.folder / "landing", dsn, "ss_", checkpoint,
                                       files_per_trigger=max(1, len(files) // args.batches),
                                       reader=reader)
        return {**r, "ok": peers.check(dsn, "ss_", truth["urls"], truth["domains"])}

    def library() -> dict:
        dsn = recreate_database(server, "onceflow_bench_lib")
        r = onceflow_loop(spark, dsn, w, args.batches, args.in_flight)
        return {**r, "ok": counts_ok(dsn, "w_url_counts", "w_domain_counts", truth)}

    local = {"raw": ("raw Spark batch", raw),
             "streaming": ("Structured Streaming", lambda: streaming("text")),
             "streaming-json": ("Structured Streaming, JSON source",
                                lambda: streaming("json")),
             "library": ("onceflow library (local session)", library)}
    rounds(results, [local[s] for s in local if s in systems], args.rounds, CpuClock)
    if spark is not None:
        spark.stop()
        spark = None
        os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)
    url, ours = args.spark_connect, False
    if not url and ({"connect", "airflow", "airflow-phases"} & set(systems)
                    or args.acker_events):
        from spark_tasks import localspark

        ours = not localspark.status(folder=args.folder / "spark-connect").running
        url = localspark.start(folder=args.folder / "spark-connect").url
        # a long-lived server, as a user's is: warmed up before any clock starts (what
        # `onceflow spark start` does in the background)
        print(f"Spark Connect server warmed up in {localspark.warm_up(url):.1f}s", flush=True)
    warm_ok = True
    try:
        if args.server_warm_up and {"connect", "airflow", "airflow-phases"} & set(systems):
            warm_ok = warm_server(url, server, w, args, truth)
        if "connect" in systems:
            from spark_tasks.session import connect_session

            name = "onceflow library (Spark Connect)"
            with connect_session(url, "onceflow-bench") as remote:
                remote.range(1).count()

                def connect() -> dict:
                    dsn = recreate_database(server, "onceflow_bench_connect")
                    r = onceflow_loop(remote, dsn, w, args.batches, args.in_flight)
                    return {**r, "ok": counts_ok(dsn, "w_url_counts", "w_domain_counts",
                                                 truth)}

                rounds(results, [(name, connect)], args.rounds, CpuClock)
            results[name]["fixed_s"] = fixed_cost(
                url, recreate_database(server, "onceflow_bench_fixed"), get_pipeline(
                    "bench_w", batch_size=1))
        shapes = {"airflow": ("bench_w", "onceflow through Airflow, one task", "w_"),
                  "airflow-phases": ("bench_w_phases", "onceflow through Airflow, 3 tasks", "wp_")}
        wanted = [s for s in shapes if s in systems]
        if wanted:
            from airflow_run import run_airflow

            dsn = recreate_database(server, "onceflow_bench_airflow")
            ran = run_airflow(dsn, server, url, args.folder, [shapes[s][0] for s in wanted], batch,
                              args.batches, args.timeline)
            for system in wanted:
                pipeline, name, prefix = shapes[system]
                r = ran[pipeline]
                r["ok"] = counts_ok(dsn, f"{prefix}url_counts", f"{prefix}domain_counts", truth)
                results[name] = r
        acker = {}
        if args.acker_events:
            acker = acker_cost(server, url, args)
    finally:
        if ours:  # the server this run started goes with it, whatever happened
            localspark.stop(folder=args.folder / "spark-connect")
    report(results, acker, args)
    if not warm_ok:
        print("a warm-up round of the Spark Connect server gave a wrong result (above)")
    return 0 if warm_ok and all(r.get("ok") for r in results.values()) else 1


def warm_server(url: str, server: str, pipeline, args, truth: dict) -> bool:
    """The workload ``--server-warm-up`` times on the Spark Connect server, before any of
    its clocks starts; whether every round's result was right."""
    from spark_tasks.session import connect_session

    ok = True
    with connect_session(url, "onceflow-bench-warm-up") as remote:
        for n in range(args.server_warm_up):
            dsn = recreate_database(server, "onceflow_bench_warm_up")
            r = onceflow_loop(remote, dsn, pipeline, args.batches, args.in_flight)
            right = counts_ok(dsn, "w_url_counts", "w_domain_counts", truth)
            ok = ok and right
            print(f"Spark Connect server warm-up round {n + 1} of {args.server_warm_up}: "
                  f"{r['seconds']:.1f}s, {'OK' if right else 'WRONG'}", flush=True)
    return ok


def rounds(results: dict, systems: list, count: int, clock) -> None:
    """Run each of ``systems`` ((name, run() -> result dict)) ``count`` times, the rounds
    interleaved (every system once, then again), and keep per system its fastest round,
    with its CPU seconds (``clock()``: a CpuClock started); a system is OK only if every
    round's result was."""
    for n in range(count):
        for name, run in systems:
            if count > 1:
                print(f"round {n + 1} of {count}: {name}", flush=True)
            cpu = clock()
            r = run()
            r["cpu_total_s"] = cpu.seconds()
            best = results.get(name)
            ok = r["ok"] and (best is None or best["ok"])
            if best is None or r["seconds"] < best["seconds"]:
                best = r
            results[name] = {**best, "ok": ok}


def acker_cost(server: str, url: str, args) -> dict:
    """The tweets topology (a per-record Python bolt) on the first files, acker on and off,
    through the warm Spark; the best of --acker-rounds rounds each."""
    from onceflow.core.registry import get_pipeline
    from spark_tasks.session import connect_session

    share = max(1, args.batches * args.acker_events // args.events)
    out = {}
    with connect_session(url, "onceflow-bench-acker") as remote:
        for acker in (False, True) * args.acker_rounds:
            pipeline = get_pipeline("bench_w_idna", batch_size=args.acker_events // share,
                                    acker=acker)
            dsn = recreate_database(server, "onceflow_bench_acker")
            r = onceflow_loop(remote, dsn, pipeline, share)
            out.setdefault(acker, []).append(r["seconds"])
    return {"events": args.acker_events, "off_s": min(out[False]), "on_s": min(out[True])}


def report(results: dict, acker: dict, args) -> None:
    ss = results.get("Structured Streaming", {}).get("seconds")
    ss_json = results.get("Structured Streaming, JSON source", {}).get("seconds")
    print(f"\n{args.events} events, {args.batches} batches; load average {loadavg()}")
    print("vs SS: against Structured Streaming reading text and parsing with from_json; "
          "vs SS-json: against its JSON source")
    print("CPU s: the machine's busy CPU seconds during the system's run (every process: "
          "Spark, Airflow, PostgreSQL)")
    print(f"{'system':<36} {'wall s':>8} {'events/s':>10} {'vs SS':>7} {'vs SS-json':>10} "
          f"{'CPU s':>7}  check")
    for name, r in results.items():
        rate = args.events / r["seconds"]
        ratio = f"{ss / r['seconds']:.2f}x" if ss else "-"
        ratio_json = f"{ss_json / r['seconds']:.2f}x" if ss_json else "-"
        cpu = r.get("cpu_total_s")
        cpu_text = f"{cpu:.1f}" if cpu is not None else "-"
        print(f"{name:<36} {r['seconds']:>8.1f} {rate:>10,.0f} {ratio:>7} {ratio_json:>10} "
              f"{cpu_text:>7}  {'OK' if r.get('ok') else 'WRONG'}")
    for name, r in results.items():
        if "process_s" in r:
            print(f"  {name}: {r['in_flight']} in flight; per batch: process "
                  f"{r['process_s']:.2f}s, commit "
                  f"{r['commit_s']:.2f}s" + (f", fixed cost of a warm task {r['fixed_s']:.2f}s"
                                             if "fixed_s" in r else ""))
        if "task_s" in r:
            print(f"  {name}: task medians " + ", ".join(
                f"{k} {v:.2f}s" for k, v in r["task_s"].items()))
        if "cpu_s" in r:  # the task processes are the scheduler's (LocalExecutor) children
            parts = ", ".join(f"{k} {v:.1f}" for k, v in r["cpu_s"].items())
            print(f"  {name}: CPU seconds during the runs (process trees, lower bounds): "
                  f"{parts}")
    if acker:
        cost = acker["on_s"] / acker["off_s"] - 1
        print(f"acker (tweets topology, Python bolt, {acker['events']} events): off "
              f"{acker['off_s']:.1f}s, on {acker['on_s']:.1f}s: costs {cost:.1%}")


if __name__ == "__main__":
    sys.exit(main())
