"""Freshness of a kept-up pipeline through a real Airflow, beside Structured Streaming's
trigger-interval latency on the same records, and what the watcher costs when idle.

    python bench/bench_freshness.py --rate 1000,10000,50000 --seconds 60 --idle 600

Per rate R, a producer makes R records/s for --seconds (a chunk of R/4 records every 0.25 s,
on a schedule: a slow chunk does not lower the rate), each record ``{"k": KEY, "t":
PRODUCED}`` (its production time, seconds since the epoch). Then:

- **onceflow**: the producer appends the chunks to the PostgreSQL log of the pipeline
  ``fresh_<R>`` (bench/freshness_pipelines.py: ``keep_up=True``, counts per key, max_pending
  3, max_delay 6 s, a look every second). An Airflow of separate processes (API server,
  scheduler with Airflow's stock LocalExecutor, DAG processor, triggerer; a PostgreSQL
  metadata database of its own) starts every run: its source watcher in the triggerer, no
  run started by hand; processing on a local Spark Connect server (started and warmed up
  before any clock, as `onceflow spark start` does; or a running one, --spark-connect).
  Freshness is onceflow's own figure (onceflow.core.freshness, as `onceflow status` shows
  it): each record's wait from its arrival in the log (its ``produced_at``, the start of the
  producer's COPY: the chunk's production time within milliseconds) to its transaction's
  commit, p50 / p95 / max over the records of the rate's transactions whose records all
  arrived after the warm-up. One Airflow serves
  every rate: a rate's DAG is unpaused for its phase only (so one watcher runs), the others
  are paused.
- **Structured Streaming**: the producer writes each chunk as a JSON-lines file into a
  folder (a hidden temp name, then renamed: no half-written file is read); a query reads it
  with Spark's JSON source and ``trigger(processingTime=--trigger s)``, and a
  ``foreachBatch`` sink adds the micro-batch's counts per key to a PostgreSQL table in one
  transaction with a fence of micro-batch ids (exactly-once the usual way, as
  bench/peers.py). A record's latency is its micro-batch's commit time (when PostgreSQL's
  commit returned) minus its production time; p50 / p95 / max over the records of the
  micro-batches whose records were all produced after the warm-up (--warm-up). A local
  Spark session (local[2]) in this process, started before the clock.

Both systems' counts are checked against a recount of what was produced. Sizing per rate
(freshness_pipelines.sizing): ``min_records`` is --min-seconds of the rate (4 s) and
``batch_size`` --batch-seconds (10 s). A run costs seconds whatever its size (an Airflow
task, a Spark job, a commit); with a batch every 4 s and three in flight, the pipeline keeps
up while a run takes under 12 s, and a backlog after a slow run drains in batches of 10 s of
data. ``max_delay`` (6 s) only bounds a trickle: at a steady rate min_records comes first.
The default --trigger (4 s) gives Structured Streaming the same cadence.

--warm-up S (10): before a rate's measured records, S seconds of records at the rate are
produced, unmeasured, for each system, and the measured ones follow without a pause (the
batches of records made after the warm-up are measured): a kept-up pipeline runs for days, and
its freshness is the steady state's, not that of the first runs of an executor's fresh
worker or of Spark's first jobs of a plan (nor of a streaming query's first micro-batches).

--idle S: after the last rate, the last pipeline stays unpaused with no new record for S
seconds; the CPU seconds of the triggerer (its process and its trigger runner, the watcher
included) and of the watcher's PostgreSQL backend over that time, and that no run started
and no transaction was planned. The load average is printed before and after each phase.
Uses databases of its own (onceflow_bench_freshness*, dropped at the start) and a work
folder (--folder, emptied at the start).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from benchkit import (
    free_port,
    loadavg,
    local_connect_port,
    recreate_database,
    server_dsn,
    warm_spark_connect,
)

from onceflow.airflow.dag_file import TEXT as DAG_FILE

HERE = Path(__file__).resolve().parent

TICK = 0.25  # seconds between two chunks of a producer
KEYS = 997  # record i has the key k{i % KEYS}
UP_S = 300  # Airflow's start-up, at most



def expected_counts(records: int) -> dict[str, int]:
    """The counts per key of the first ``records`` records a producer makes."""
    whole, extra = divmod(records, KEYS)
    return {f"k{k}": whole + (k < extra) for k in range(KEYS) if whole + (k < extra)}


def produce(rate: int, seconds: float, write, mark_at: float = 0.0, on_mark=None) -> dict:
    """Call ``write(lines)`` with a chunk of ``rate * TICK`` JSON lines every TICK seconds
    for ``seconds``, on a schedule, the records numbered from 0 (their keys);
    ``on_mark()`` is called before the first chunk ``mark_at`` seconds in (the warm-up's
    end). Returns the records made, the rate achieved and how late the latest chunk started
    (a producer that cannot keep its schedule says so)."""
    per, ticks = max(1, round(rate * TICK)), max(1, round(seconds / TICK))
    produced, late = 0, 0.0
    start = time.monotonic()
    for tick in range(ticks):
        if on_mark is not None and tick == round(mark_at / TICK):
            on_mark()
        late = max(late, time.monotonic() - (start + tick * TICK))
        t = f"{time.time():.3f}"
        write([f'{{"k":"k{(produced + i) % KEYS}","t":{t}}}' for i in range(per)])
        produced += per
        time.sleep(max(0.0, start + (tick + 1) * TICK - time.monotonic()))
    elapsed = time.monotonic() - start
    return {"records": produced, "achieved": produced / elapsed,
            "late_s": late}


def weighted(spans: list[tuple[float, float, int]]) -> tuple[float, float, float]:
    from onceflow.core.freshness import weighted_quantile

    return (weighted_quantile(spans, 0.5), weighted_quantile(spans, 0.95),
            max(hi for _, hi, _ in spans))


# --- onceflow: a real Airflow ---------------------------------------------------------------

class Deployment:
    """Airflow's components, each a process group of this benchmark, in one AIRFLOW_HOME."""

    COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")

    def __init__(self, home: Path, meta: str, dsn: str, spark_port: int, spec: dict):

        from onceflow.airflow.environment import served_airflow_env, spark_connection

        self.home, self.meta, self.dsn = home, meta, dsn
        self.api_port = free_port()
        (home / "dags").mkdir(parents=True)
        (home / "dags" / "onceflow_pipelines.py").write_text(DAG_FILE)  # `onceflow dags`
        keep = {k: v for k, v in os.environ.items()
                if not k.startswith(("AIRFLOW", "ONCEFLOW", "SPARK", "PYSPARK"))}
        self.env = {
            **keep,
            **served_airflow_env(meta_dsn=meta, api_port=self.api_port, dsn=dsn,
                                 spark=spark_connection(spark_port), log_level="WARNING"),
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
            # a rate's DAG is unpaused for its phase only: one watcher at a time
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
            "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT": "600",
            "ONCEFLOW_PIPELINES": "freshness_pipelines:PIPELINES",
            "ONCEFLOW_RETRY_DELAY_SECONDS": "2",
            "BENCH_FRESHNESS": json.dumps(spec),
            "PYTHONPATH": str(HERE),  # the pipelines' module, as a user's package
        }
        self.procs: dict[str, subprocess.Popen] = {}

    def cli(self, *args: str) -> None:
        from onceflow.airflow import airflow_cli

        done = subprocess.run(airflow_cli(*args), env=self.env, cwd=self.home,
                              capture_output=True, text=True, timeout=UP_S)
        if done.returncode:
            raise RuntimeError(f"airflow {' '.join(args)} failed:\n"
                               f"{(done.stdout + done.stderr)[-3000:]}")

    def start(self, dag_ids: list[str]) -> None:
        from onceflow.airflow import airflow_cli
        from onceflow.airflow.environment import airflow_healthy

        self.cli("db", "migrate")
        for name in self.COMPONENTS:
            out = open(self.home / f"{name}.log", "ab")  # noqa: SIM115 (the process keeps it)
            self.procs[name] = subprocess.Popen(
                airflow_cli(name), env=self.env, cwd=self.home, stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + UP_S
        while True:
            self.check_alive()
            dags = self.query("SELECT count(*) FROM dag WHERE dag_id = ANY(%s)", (dag_ids,))
            if dags[0][0] == len(dag_ids) and airflow_healthy(self.api_port):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"Airflow was not up in {UP_S}s: logs in {self.home}")
            time.sleep(1)

    def query(self, query: str, params=(), dsn: str | None = None) -> list[tuple]:
        from airflow_run import _query

        return _query(dsn or self.meta, query, params)

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"Airflow's {name} exited ({proc.returncode}): its log is "
                                   f"{self.home / (name + '.log')}")

    def watching(self, pipeline: str) -> bool:
        """Whether a live triggerer runs the watcher of ``pipeline``'s source."""
        return bool(self.query("""
            SELECT 1 FROM trigger t JOIN asset_watcher w ON w.trigger_id = t.id
            JOIN asset a ON a.id = w.asset_id JOIN job j ON j.id = t.triggerer_id
            WHERE a.name = %s AND j.state = 'running'
              AND j.latest_heartbeat > now() - interval '10 seconds'""",
                                   (f"onceflow-source/{pipeline}",)))

    def unpause(self, dag_id: str, pipeline: str) -> None:
        """Unpause ``dag_id`` and wait until the watcher of ``pipeline`` runs."""
        self.cli("dags", "unpause", dag_id)
        # Airflow makes an unpaused DAG's asset watchers at a parse of its file: now, not at
        # the DAG processor's next (up to min_file_process_interval, 30 s by default)
        self.cli("dags", "reserialize")
        deadline = time.monotonic() + UP_S
        while not self.watching(pipeline):
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"no watcher of {pipeline} ran in time: logs in {self.home}")
            time.sleep(0.5)

    def runs(self, dag_id: str) -> dict[str, int]:
        return dict(self.query("SELECT state, count(*) FROM dag_run WHERE dag_id = %s "
                               "GROUP BY state", (dag_id,)))

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds so far of the triggerer's process tree and of the PostgreSQL
        backends of the source watchers' connections."""
        import psutil
        from airflow_run import _cpu_s

        out = {"triggerer": _cpu_s(self.procs["triggerer"].pid)}
        backends = self.query("SELECT pid FROM pg_stat_activity "
                              "WHERE application_name = 'onceflow-watch'", dsn=self.dsn)
        for (pid,) in backends:
            try:
                out[f"watcher's PostgreSQL backend {pid}"] = sum(
                    psutil.Process(pid).cpu_times()[:2])
            except psutil.Error:
                pass
        return out

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def onceflow_rate(airflow: Deployment, rate: int, seconds: float, warm_s: float,
                  pause_after: bool) -> dict:
    """One rate's phase: unpause its DAG, produce ``warm_s`` seconds (unmeasured) and
    ``seconds`` more without a pause, wait for every record's commit and the runs' ends,
    measure the transactions of records made after the warm-up (their first arrival)."""
    import freshness_pipelines

    from onceflow.core import freshness
    from onceflow.core.db import connection
    from onceflow.core.registry import get_pipeline

    name = freshness_pipelines.name(rate)
    pipeline, dag_id = get_pipeline(name), f"onceflow_{name}"
    airflow.unpause(dag_id, name)
    def committed() -> int:
        return int(airflow.query("""SELECT coalesce(sum("offset"), 0) FROM partition_offsets
                                    WHERE pipeline = %s""", (name,), airflow.dsn)[0][0])

    def drain(records: int, seconds: float) -> None:
        deadline = time.monotonic() + max(600.0, 10 * seconds)
        while committed() < records:
            airflow.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: {committed():,} of {records:,} records "
                                   f"committed in time: logs in {airflow.home}")
            time.sleep(0.5)
        drained = time.monotonic()
        while set(airflow.runs(dag_id)) - {"success", "failed"}:
            if time.monotonic() > drained + 120:
                raise TimeoutError(f"{dag_id}: runs not ended: {airflow.runs(dag_id)}")
            time.sleep(0.5)

    marked = {}
    with connection(airflow.dsn) as conn:
        def append(lines: list[str]) -> None:
            pipeline.source.append(conn, lines, chunk_size=len(lines))

        def mark() -> None:
            marked.update(at=time.time(), load=loadavg())

        made = produce(rate, warm_s + seconds, append, mark_at=warm_s, on_mark=mark)
    drain(made["records"], seconds)
    load_before, load_after = marked["load"], loadavg()
    sizes = airflow.query("""SELECT records, extract(epoch FROM committed_at - planned_at)
                             FROM transactions WHERE pipeline = %s AND state = 'committed'
                               AND first_arrival >= to_timestamp(%s) ORDER BY txid""",
                         (name, marked["at"]), airflow.dsn)
    with connection(airflow.dsn) as conn, conn.cursor() as cur:
        fresh = freshness.measure(cur, name, pipeline.source, last=len(sizes))
    counts = dict(airflow.query(f"SELECT key, value FROM {name}_counts", (), airflow.dsn))
    committed_records = airflow.query("""SELECT coalesce(sum(records), 0) FROM transactions
                                         WHERE pipeline = %s AND state = 'committed'""",
                                      (name,), airflow.dsn)[0][0]
    runs = airflow.runs(dag_id)
    if pause_after:
        airflow.cli("dags", "pause", dag_id)
    return {
        **made, "system": "onceflow keep-up", "rate": rate,
        "batches": len(sizes), "per_batch": (min(n for n, _ in sizes), max(n for n, _ in sizes)),
        "p50": fresh.p50_s, "p95": fresh.p95_s, "max": fresh.max_s,
        "run_s": statistics.median(float(s) for _, s in sizes),
        "ok": (counts == expected_counts(made["records"])
               and committed_records == made["records"]
               and fresh.records == sum(n for n, _ in sizes) and not runs.get("failed")),
        "runs": runs, "load": (load_before, load_after),
        "sizing": (pipeline.min_records, pipeline.batch_size),
    }


def idle(airflow: Deployment, rate: int, seconds: float) -> dict:
    """The last pipeline, caught up, for ``seconds``: CPU of the triggerer and the watcher's
    backend; runs started and transactions planned meanwhile."""
    import freshness_pipelines

    name = freshness_pipelines.name(rate)
    dag_id = f"onceflow_{name}"

    def planned() -> int:
        return airflow.query("SELECT count(*) FROM transactions WHERE pipeline = %s", (name,),
                             airflow.dsn)[0][0]

    runs, txs, load_before = sum(airflow.runs(dag_id).values()), planned(), loadavg()
    cpu = airflow.cpu_s()
    time.sleep(seconds)
    airflow.check_alive()
    used = {k: v - cpu[k] for k, v in airflow.cpu_s().items() if k in cpu}
    return {"seconds": seconds, "cpu": used, "watching": airflow.watching(name),
            "runs_started": sum(airflow.runs(dag_id).values()) - runs,
            "planned": planned() - txs, "load": (load_before, loadavg()), "pipeline": name}


def run_onceflow(args, server: str, spec: dict) -> tuple[list[dict], dict | None]:
    import tempfile

    import freshness_pipelines

    from onceflow.core.db import connection
    from onceflow.core.registration import register
    from onceflow.core.registry import clear_cache, get_pipeline
    from onceflow.spark import localspark

    clear_cache()
    dsn = recreate_database(server, "onceflow_bench_freshness")
    meta = recreate_database(server, "onceflow_bench_freshness_meta", migrate=False)
    with connection(dsn) as conn:  # `onceflow init`
        for rate in args.rates:
            register(conn, get_pipeline(freshness_pipelines.name(rate)), create_source=True)
    spark_dir = args.folder / "spark-connect"
    port = (local_connect_port(args.spark_connect) if args.spark_connect
            else warm_spark_connect(spark_dir)[0])
    airflow = Deployment(Path(tempfile.mkdtemp(prefix="airflow-", dir=args.folder)), meta, dsn,
                         port, spec)
    results, quiet = [], None
    try:
        started = time.monotonic()
        airflow.start([f"onceflow_{freshness_pipelines.name(r)}" for r in args.rates])
        print(f"Airflow up in {time.monotonic() - started:.1f}s (logs in {airflow.home})",
              flush=True)
        for i, rate in enumerate(args.rates):
            last = i == len(args.rates) - 1
            r = onceflow_rate(airflow, rate, args.seconds, args.warm_up,
                              pause_after=not last)
            print(line(r), flush=True)
            results.append(r)
        if args.idle:
            print(f"idle for {args.idle:.0f}s ...", flush=True)
            quiet = idle(airflow, args.rates[-1], args.idle)
            print(idle_line(quiet), flush=True)
    finally:
        airflow.stop()
        if not args.spark_connect:
            localspark.stop(port, folder=spark_dir)
    return results, quiet


# --- Structured Streaming -------------------------------------------------------------------

class LatencySink:
    """A ``foreachBatch`` function: the micro-batch's counts per key added to
    ``ss_counts`` and its id to the fence ``ss_batches`` in one PostgreSQL transaction (a
    replayed id is skipped); per micro-batch, when the commit returned and how many records
    of each production time it held."""

    def __init__(self, dsn: str):
        self.dsn = dsn
        self.conn = None
        self.committed: list[tuple[float, dict[float, int]]] = []
        self.records = 0
        self.lock = threading.Lock()

    def __call__(self, batch, batch_id: int) -> None:
        import psycopg2
        from psycopg2.extras import execute_values

        table = batch.groupBy("k", "t").count().toArrow().to_pydict()
        if not table["k"]:
            return
        keys, times = Counter(), Counter()
        for k, t, n in zip(table["k"], table["t"], table["count"], strict=True):
            keys[k] += n
            times[t] += n
        if self.conn is None or self.conn.closed:
            self.conn = psycopg2.connect(self.dsn)
        try:
            with self.conn, self.conn.cursor() as cur:
                cur.execute("LOCK TABLE ss_batches IN SHARE ROW EXCLUSIVE MODE")
                cur.execute("SELECT 1 FROM ss_batches WHERE batch_id = %s", (batch_id,))
                if cur.fetchone():
                    return
                execute_values(cur, "INSERT INTO ss_counts AS c (key, value) VALUES %s "
                                    "ON CONFLICT (key) DO UPDATE SET value = c.value + "
                                    "EXCLUDED.value", sorted(keys.items()), page_size=1000)
                cur.execute("INSERT INTO ss_batches (batch_id) VALUES (%s)", (batch_id,))
        except Exception:
            self.conn.close()
            raise
        done = time.time()  # PostgreSQL's commit returned
        with self.lock:
            self.committed.append((done, dict(times)))
            self.records += sum(times.values())


def streaming_rate(spark, server: str, folder: Path, rate: int, seconds: float,
                   trigger: float, warm_s: float) -> dict:
    from airflow_run import _query

    from onceflow.core.db import connection

    dsn = recreate_database(server, "onceflow_bench_freshness_ss", migrate=False)
    with connection(dsn) as conn, conn.cursor() as cur:
        cur.execute("""CREATE TABLE ss_counts (key text PRIMARY KEY, value bigint NOT NULL);
                       CREATE TABLE ss_batches (batch_id bigint PRIMARY KEY)""")
        conn.commit()
    landing, checkpoint = folder / f"ss-{rate}" / "in", folder / f"ss-{rate}" / "checkpoint"
    landing.mkdir(parents=True)
    sink = LatencySink(dsn)
    query = (spark.readStream.schema("k string, t double").json(str(landing))
             .writeStream.foreachBatch(sink).option("checkpointLocation", str(checkpoint))
             .trigger(processingTime=f"{trigger:g} seconds").start())
    files = iter(range(1 << 30))

    def write(lines: list[str]) -> None:
        name = f"part-{next(files):06d}.json"
        temp = landing / f".{name}.tmp"
        temp.write_text("\n".join(lines) + "\n", encoding="utf-8")
        os.replace(temp, landing / name)

    def drain(records: int, seconds: float) -> None:
        deadline = time.monotonic() + max(600.0, 10 * seconds)
        while sink.records < records:
            if query.exception() is not None:
                raise RuntimeError(f"the streaming query failed: {query.exception()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"Structured Streaming: {sink.records:,} of "
                                   f"{records:,} records committed in time")
            time.sleep(0.2)

    marked = {}

    def mark() -> None:
        marked.update(at=time.time(), load=loadavg())

    try:
        made = produce(rate, warm_s + seconds, write, mark_at=warm_s, on_mark=mark)
        drain(made["records"], seconds)
        load_after = loadavg()
        load_before = marked["load"]
    finally:
        query.stop()
        if sink.conn is not None:
            sink.conn.close()
    # (a record's time is written to the millisecond)
    measured = [(done, times) for done, times in sink.committed
                if min(times) >= marked["at"] - 0.001]
    spans = [(done - t, done - t, n) for done, times in measured for t, n in times.items()]
    p50, p95, most = weighted(spans)
    counts = dict(_query(dsn, "SELECT key, value FROM ss_counts"))
    sizes = [sum(times.values()) for _, times in measured]
    return {**made, "system": f"Structured Streaming, trigger {trigger:g} s", "rate": rate,
            "batches": len(sizes), "per_batch": (min(sizes), max(sizes)),
            "p50": p50, "p95": p95, "max": most, "run_s": None,
            "ok": (counts == expected_counts(made["records"])
                   and sink.records == made["records"]),
            "load": (load_before, load_after)}


def run_streaming(args, server: str) -> list[dict]:
    from onceflow.spark.session import get_spark

    # the project's local session (as bench/peers.py's): 2 cores, 2g driver, no UI
    spark = get_spark("onceflow-bench-freshness", master="local[2]")
    spark.sparkContext.setLogLevel("ERROR")  # not the stop of a query between two triggers
    spark.range(1).count()  # the JVM and the session are up before any clock starts
    results = []
    try:
        for rate in args.rates:
            r = streaming_rate(spark, server, args.folder, rate, args.seconds, args.trigger,
                               args.warm_up)
            print(line(r), flush=True)
            results.append(r)
    finally:
        spark.stop()
    return results


# --- report ---------------------------------------------------------------------------------

HEADER = (f"{'system':<36} {'rate/s':>8} {'made/s':>8} {'batches':>7} {'records per batch':>19} "
          f"{'p50 s':>6} {'p95 s':>6} {'max s':>6} {'run s':>6} {'load':>12}  check")


def line(r: dict) -> str:
    lo, hi = r["per_batch"]
    run = f"{r['run_s']:.1f}" if r.get("run_s") is not None else "-"
    load = f"{r['load'][0].split()[0]} -> {r['load'][1].split()[0]}"
    return (f"{r['system']:<36} {r['rate']:>8,} {r['achieved']:>8,.0f} {r['batches']:>7} "
            f"{f'{lo:,}-{hi:,}':>19} {r['p50']:>6.1f} {r['p95']:>6.1f} {r['max']:>6.1f} "
            f"{run:>6} {load:>12}  "
            f"{'OK' if r['ok'] else 'WRONG'}")


def idle_line(quiet: dict) -> str:
    cpu = ", ".join(f"{k} {v:.2f}" for k, v in sorted(quiet["cpu"].items()))
    return (f"idle {quiet['seconds']:.0f}s ({quiet['pipeline']}, watcher running: "
            f"{quiet['watching']}): CPU seconds {cpu}; runs started {quiet['runs_started']}, "
            f"transactions planned {quiet['planned']}; load average {quiet['load'][0]} -> "
            f"{quiet['load'][1]}")


def report(results: list[dict], quiet: dict | None, args) -> None:
    print(f"\n{args.seconds:g} s per rate; freshness (onceflow) and latency (Structured "
          "Streaming): a record's production to its commit, over every record")
    print("run s: onceflow's median from a transaction's plan to its commit; load: the "
          "1-minute load average before and after the measured records")
    print(HEADER)
    for r in results:
        print(line(r))
    for r in results:
        if "sizing" in r:
            print(f"  fresh_{r['rate']}: min_records {r['sizing'][0]:,}, batch_size "
                  f"{r['sizing'][1]:,}; runs {r['runs']}")
        if r["late_s"] > 1:
            print(f"  {r['system']} at {r['rate']:,}/s: the producer fell behind its schedule "
                  f"by up to {r['late_s']:.1f}s")
    if quiet:
        print(idle_line(quiet))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="1000,10000,50000",
                        help="records per second, comma-separated (default 1000,10000,50000)")
    parser.add_argument("--seconds", type=float, default=60, help="per rate (default 60)")
    parser.add_argument("--warm-up", type=float, default=10, metavar="SECONDS",
                        help="per rate and system, seconds of records produced and committed "
                             "before the measured ones (default 10; 0: none)")
    parser.add_argument("--trigger", type=float, default=4.0,
                        help="Structured Streaming's processingTime trigger, seconds (4)")
    parser.add_argument("--idle", type=float, default=120, metavar="SECONDS",
                        help="seconds of idle watcher measured after the last rate (default "
                             "120; 0: none)")
    parser.add_argument("--systems", default="onceflow,streaming",
                        help="comma-separated: onceflow, streaming (default both)")
    parser.add_argument("--min-seconds", type=float, default=4.0,
                        help="a pipeline's min_records in seconds of its rate (default 4)")
    parser.add_argument("--batch-seconds", type=float, default=10.0,
                        help="a pipeline's batch_size in seconds of its rate (default 10)")
    parser.add_argument("--max-delay", type=float, default=6.0, help="seconds (default 6)")
    parser.add_argument("--folder", type=Path, default=Path("/var/tmp/onceflow-bench-freshness"),
                        help="work folder, emptied at the start")
    parser.add_argument("--spark-connect", metavar="URL", default=None,
                        help="onceflow's processing on this running, warm Spark Connect server "
                             "(sc://127.0.0.1:PORT); default: a local one this run starts, "
                             "warms up and stops")
    args = parser.parse_args(argv)
    try:
        args.rates = [int(r) for r in args.rate.split(",") if r.strip()]
    except ValueError:
        parser.error(f"--rate {args.rate!r}: give whole numbers of records per second, "
                     "comma-separated (e.g. 1000,10000)")
    if not args.rates or min(args.rates) < 4:
        parser.error(f"--rate {args.rate!r}: give rates of 4 records/s or more")
    if args.seconds < 1 or args.trigger <= 0 or args.idle < 0 or args.warm_up < 0:
        parser.error("--seconds must be 1 or more, --trigger above 0, --idle and --warm-up "
                     "0 or more")
    if not 0 < args.min_seconds <= args.batch_seconds:
        parser.error(f"--min-seconds {args.min_seconds:g} must be above 0 and at most "
                     f"--batch-seconds {args.batch_seconds:g}")
    systems = {s.strip() for s in args.systems.split(",") if s.strip()}
    if not systems or systems - {"onceflow", "streaming"}:
        parser.error(f"--systems {args.systems!r}: give onceflow, streaming or both")
    spec = {"rates": args.rates, "min_s": args.min_seconds, "batch_s": args.batch_seconds,
            "max_delay_s": args.max_delay, "watch_interval": 1.0, "max_pending": 3}
    # this process declares the same pipelines as the Airflow components
    os.environ["BENCH_FRESHNESS"] = json.dumps(spec)
    os.environ["ONCEFLOW_PIPELINES"] = "freshness_pipelines:PIPELINES"
    shutil.rmtree(args.folder, ignore_errors=True)
    args.folder.mkdir(parents=True)


    server, _ = server_dsn()
    print(f"load average before: {loadavg()}", flush=True)
    results, quiet = [], None
    if "onceflow" in systems:
        ran, quiet = run_onceflow(args, server, spec)
        results += ran
    if "streaming" in systems:
        results += run_streaming(args, server)
    report(results, quiet, args)
    print(f"load average after: {loadavg()}")
    idle_ok = quiet is None or (quiet["runs_started"] == 0 and quiet["planned"] == 0
                                and quiet["watching"])
    return 0 if all(r["ok"] for r in results) and idle_ok else 1


if __name__ == "__main__":
    sys.exit(main())
