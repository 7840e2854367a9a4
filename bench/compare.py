"""onceflow against what a user would pick instead, on the same data, in one run.

    python bench/compare.py --events 10000000 --batches 10

Generates the events once (seeded; reused while --events and --seed stay the same) as JSON
lines files (one per batch) in a landing folder, computes the ground truth in Python, then
runs each system asked for (--systems) on each source asked for (--sources):

- ``raw``: one Spark batch job, COPY out (bench/peers.py; no guarantees: the practical limit);
- ``streaming``: Spark Structured Streaming, foreachBatch upsert fenced by batchId
  (bench/peers.py), one file per micro-batch; on the JSON lines it reads text and parses it
  with from_json (as a bolt parses a payload); on CSV or Parquet files, Spark's CSV or
  Parquet source; the baseline of the "vs SS" columns;
- ``streaming-json``: the same with Spark's JSON source, as most users read JSON files (its
  parser takes each line's bytes; from_json decodes each payload first); the baseline of the
  "vs SS-json" column, the like of onceflow's W, whose landing folder decodes the events
  (``json_schema``);
- ``library``: onceflow without Airflow (onceflow.spark.loop.run_batches): --in-flight batches
  processed at once (default: max_pending, as many as the Airflow path runs), committed in
  txid order, one local Spark session in this process;
- ``connect``: the same through a Spark Connect server (the warm Spark of the Airflow path);
- ``airflow``: onceflow through a real Airflow scheduler (scheduler, triggerer,
  dag-processor, LocalExecutor, PostgreSQL metadata), the runs triggered at once; its DAG
  runs a transaction in one task (``dag_shape="single"``);
- ``airflow-phases``: the same on the same Airflow with a task per phase (begin >> process
  >> commit), the default shape.

**Sources** (``--sources``, default all; bench/workload.py declares W once per source, each
with its own topic and tables): ``segments`` (file segments, written by the producer API,
FileSegments.append: the files `onceflow import` writes too; their payloads decoded as they
are read, ``json_schema``, as the JSON lines folder's lines are), ``landing-json`` (the JSON
lines folder), ``landing-csv`` and ``landing-parquet`` (the same events as rows,
``peers.event_rows``, in CSV and Parquet files of a landing folder each), ``table`` (the
rows in a PostgreSQL table, keyed by an identity column, each row's JSON decoded as read,
``json_schema``) and ``pglog`` (the JSON payloads in the PostgreSQL log, decoded as read,
``json_schema``). ``connect`` and ``airflow`` run once per source (all sources'
pipelines on one Airflow, one after the other); ``raw``, ``streaming-json``, ``library``
and ``airflow-phases`` read the JSON lines only and run with ``landing-json``. Structured
Streaming reads the equivalent files: JSON lines for ``landing-json``, CSV and Parquet for
the landing folders of those; for ``table``, ``pglog`` and ``segments`` it reads the same
events from the JSON lines files (the output says so). Each database-held source (table,
log, segments) is filled in a fresh database before its system's clock starts. ``kafka``
reads the JSON payloads from a topic of 2 partitions on the broker of
AIRFLOW_CONN_KAFKA_DEFAULT, else a Tansu broker the run starts (benchkit.KafkaBroker),
produced once before the first clock, decoded as read (``json_schema``); Structured
Streaming is no peer there (its Kafka connector jar cannot be
installed on these machines: the output says so). Every
result is checked against the ground truth. The local session's systems share one JVM and
the Spark Connect server's runs one server, in the order of the tables: the first run of
each warms its JVM for the next (``--rounds 2`` measures warm figures on both sides).

Each system runs once by default (``--rounds``): measured as users run it, with no untimed
round of the same workload before the clock. The Spark Connect server of ``connect`` and
``airflow`` gets only onceflow's own generic warm-up (what `onceflow spark start` does);
``--server-warm-up N`` adds N untimed rounds of the workload, for comparison only.
Structured Streaming's JVM and session start (the local session's, which a user's
spark-submit of the query pays every time) is timed apart and is not in its wall seconds:
"vs SS" compares without it, "vs SS+JVM" with it. Then a table per source: wall seconds,
events/s, each against Structured Streaming (without and with its JVM start, and against its
JSON source), CPU seconds (the machine's busy CPU during the system's run: on two cores
that run CPU-bound, the figure that moves least with the machine's speed), the 1-minute load
average at the run's end; then the per-batch fixed cost of the warm Spark, the acker on and
off (the tweets example's topology, with its per-record Python bolt), and the load average
before and after (the machine must be quiet for the figures to mean anything).

    python bench/compare.py --events 5000000 --batches 5 \\
        --systems streaming,connect,airflow --acker-events 0            # every source
    python bench/compare.py --events 200000 --batches 2 \\
        --sources landing-csv,table --acker-events 0                    # two sources
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

from benchkit import (
    DB,
    ONE_PER_BATCH,
    KafkaBroker,
    ProcCpu,
    loadavg,
    need_examples,
    postmaster_pid,
    recreate_database,
    server_dsn,
)

HERE = Path(__file__).resolve().parent

need_examples()  # the examples' code and pipelines (bench/README.md)

import peers  # noqa: E402


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


JSON_SOURCES = ("segments", "landing-json", "table", "pglog")  # SS reads the JSON lines
HELD = ("segments", "table", "pglog", "kafka")  # filled before the clock
SOURCE_NAMES = ("segments", "landing-json", "landing-csv", "landing-parquet", "table", "pglog",
                "kafka")
# Per source: what it is, and what Structured Streaming reads for it
ABOUT = {
    "segments": "file segments (Parquet, produced into the log's index; payloads decoded as "
                "read, json_schema)",
    "landing-json": "JSON lines files in a landing folder",
    "landing-csv": "CSV files (the events as rows) in a landing folder",
    "landing-parquet": "Parquet files (the events as rows) in a landing folder",
    "table": "a PostgreSQL table (the events as rows, an identity key; rows decoded as "
             "read, json_schema)",
    "pglog": "the PostgreSQL log (the JSON payloads, decoded as read, json_schema)",
    "kafka": "a Kafka topic of 2 partitions on a Kafka-protocol broker this run starts (Tansu, "
             "memory storage; the JSON payloads decoded as read, json_schema)",
}
# Structured Streaming reads Kafka only with Spark's Kafka connector (spark-sql-kafka and the
# Kafka client jars), which cannot be installed on these machines: no peer for that source.
NO_KAFKA_PEER = ("Structured Streaming is no peer here: its Kafka connector jar "
                 "(spark-sql-kafka) cannot be installed on this machine")
KAFKA_PARTITIONS = 2
SS_READS = {"landing-csv": "the same CSV files", "landing-parquet": "the same Parquet files",
            "landing-json": "the same JSON lines files"}
# the form of the events each source needs on disk (beyond the JSON lines)
FORMS = {"landing-csv": "csv", "table": "csv", "landing-parquet": "parquet"}


def prepare(folder: Path, events: int, batches: int, seed: int,
            forms: set[str] = frozenset()) -> tuple[list[Path], dict]:
    """The landing folder's files and the ground truth (reused when already made), and the
    events as rows in the ``forms`` asked for (csv, parquet: a file per JSON lines file,
    in folders beside it), made when missing."""
    from tweets_example.data import generate

    landing, stamp = folder / "landing", folder / "data.json"
    want = {"events": events, "batches": batches, "seed": seed}
    if stamp.exists() and json.loads(stamp.read_text()).get("spec") == want:
        made = json.loads(stamp.read_text())
        files = sorted(landing.glob("part-*.json"))
    else:
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
        made = {"spec": want, "truth": {"urls": dict(urls), "domains": dict(domains)},
                "forms": []}
        stamp.write_text(json.dumps(made))
    for form in sorted(set(forms) - set(made.get("forms", []))):
        print(f"writing the events as rows, {form} ...", flush=True)
        target = rows_folder(folder, form)
        shutil.rmtree(target, ignore_errors=True)
        past = time.time() - 60
        for f in files:
            out = peers.write_rows(target, peers.event_rows(read_payloads([f])),
                                   f"{f.stem}.{form}", form)
            os.utime(out, (past, past))
        made["forms"] = sorted({*made.get("forms", []), form})
        stamp.write_text(json.dumps(made))
    return files, made["truth"]


def rows_folder(folder: Path, form: str) -> Path:
    """Where the events as rows of ``form`` are (bench/workload.py's folders of the sources
    that read them)."""
    return folder / {"csv": "landing-csv", "parquet": "landing-parquet"}[form]


def read_payloads(files: list[Path]):
    """The events of the JSON lines ``files``, in order."""
    for f in files:
        with open(f, encoding="utf-8", newline="") as lines:
            for line in lines:
                yield line.removesuffix("\n")


def fill(dsn: str, sources: list[str], files: list[Path], folder: Path) -> float:
    """Make the database-held sources of ``sources`` in the fresh database ``dsn``, untimed
    by the systems: the table created and filled (COPY of the CSV rows), the PostgreSQL log
    and the file segments produced, each pipeline registered. Returns the seconds it took."""
    from psycopg2 import sql
    from workload import SOURCES, TABLE, TABLE_KEY

    from onceflow.core.db import connection, transaction
    from onceflow.core.registration import register

    started = time.perf_counter()
    with connection(dsn) as conn:
        for source in sources:
            pipeline = SOURCES[source]
            if source == "table":
                schema, name = TABLE.split(".")
                table = sql.Identifier(schema, name)
                with transaction(conn) as cur:
                    cur.execute(sql.SQL(
                        "CREATE TABLE {} ({} bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
                        "id bigint, {} text, text text, url text)").format(
                        table, sql.Identifier(TABLE_KEY), sql.Identifier("user")))
                    columns = sql.SQL(", ").join(map(sql.Identifier, peers.ROW_FIELDS))
                    for f in sorted(rows_folder(folder, "csv").glob("part-*.csv")):
                        with open(f, encoding="utf-8") as rows:
                            cur.copy_expert(sql.SQL(
                                "COPY {} ({}) FROM STDIN (FORMAT csv, HEADER true)").format(
                                table, columns).as_string(cur), rows)
            if source == "kafka":  # the topic outlives the database: produced once a run
                produce_kafka(pipeline, files)
            register(conn, pipeline, create_source=True)
            if source == "pglog":
                pipeline.source.append(conn, read_payloads(files), chunk_size=200_000)
            elif source == "segments":
                shutil.rmtree(pipeline.source.root() / pipeline.topic, ignore_errors=True)
                pipeline.source.append(conn, read_payloads(files), chunk_size=1_000_000)
    return time.perf_counter() - started


def produce_kafka(pipeline, files: list[Path]) -> None:
    """The events of ``files`` produced to ``pipeline``'s topic (made with KAFKA_PARTITIONS
    partitions), round-robin, unless it holds them already. Batched, but the last event of
    each partition goes alone in its batch: Tansu's end offset is the last batch's base
    offset + 1 (benchkit.ONE_PER_BATCH), exact only when that batch holds one record."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    from onceflow.sources.kafka import kafka_config

    source, config = pipeline.source, kafka_config(pipeline.source.conn_id)
    events = sum(1 for _ in read_payloads(files))
    admin = AdminClient(config)
    if source.topic in admin.list_topics(timeout=30).topics:
        held = sum(p.head for p in source.positions(None).values())
        if held == events:
            return
        raise RuntimeError(f"Kafka topic {source.topic!r} holds {held} events, not {events}")
    for future in admin.create_topics([NewTopic(source.topic, KAFKA_PARTITIONS, 1)]).values():
        future.result(30)
    started = time.perf_counter()
    errors: list[str] = []

    def delivered(error, _message) -> None:
        if error is not None:
            errors.append(str(error))

    bulk = Producer({**config, "linger.ms": 20, "batch.num.messages": 10_000,
                     "queue.buffering.max.messages": 500_000, "enable.idempotence": False})
    tails = []  # the last event of each partition, sent alone after the others
    for i, payload in enumerate(read_payloads(files)):
        if i >= events - KAFKA_PARTITIONS:
            tails.append((i, payload))
            continue
        while True:
            try:
                bulk.produce(source.topic, payload.encode(), partition=i % KAFKA_PARTITIONS,
                             on_delivery=delivered)
                break
            except BufferError:  # the client's queue is full: let it send
                bulk.poll(0.1)
        if i % 10_000 == 0:
            bulk.poll(0)
    bulk.flush(600)
    alone = Producer({**config, **ONE_PER_BATCH})
    for i, payload in tails:
        alone.produce(source.topic, payload.encode(), partition=i % KAFKA_PARTITIONS,
                      on_delivery=delivered)
    alone.flush(60)
    held = sum(p.head for p in source.positions(None).values())
    if errors or held != events:
        raise RuntimeError(f"Kafka topic {source.topic!r}: {held} of {events} events held "
                           f"after producing ({errors[:3]})")
    print(f"Kafka: {events} events produced to {source.topic!r} in "
          f"{time.perf_counter() - started:.1f}s (before the clock)", flush=True)


def onceflow_loop(spark, dsn: str, pipeline, batches: int, in_flight: int = 1) -> dict:
    """begin, process, commit until the folder is read: the library path
    (onceflow.spark.loop.run_batches, ``in_flight`` batches processed at once)."""
    from airflow_run import begin_split

    from onceflow.core.db import connection
    from onceflow.core.registration import register
    from onceflow.spark.loop import run_batches

    with connection(dsn) as conn:
        register(conn, pipeline, create_source=True)
    done = run_batches(spark, dsn, pipeline, in_flight=in_flight, max_batches=batches * 2,
                       run_prefix="bench")
    return {"seconds": done.seconds, "batches": len(done.process_s), "in_flight": in_flight,
            "process_s": statistics.median(done.process_s) if done.process_s else 0.0,
            "load": loadavg().split()[0],
            "commit_s": statistics.median(done.commit_s) if done.commit_s else 0.0,
            "begin_s": begin_split(dsn, pipeline.name)}


def counts_ok(dsn: str, url_table: str, domain_table: str, truth: dict) -> bool:
    """Whether the tables hold exactly the ground truth's counts (a key counted 0 times is
    absent)."""
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
    from onceflow.spark.processing import process_batch
    from onceflow.spark.session import SHARED_SESSION_KEY, connect_session

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
                        help="rounds of the acker figure, off and on in turn (the order "
                             "turned each round); the best of "
                             "each counts (default 2)")
    parser.add_argument("--folder", type=Path, default=Path("/var/tmp/onceflow-bench"))
    parser.add_argument("--spark-connect", metavar="URL", default=None,
                        help="the Spark Connect server of the connect and airflow systems "
                             "(sc://host:port, running and warm); default: a local one this "
                             "run starts, warms up and stops")
    parser.add_argument("--server-warm-up", type=int, default=0, metavar="N",
                        help="rounds of the workload the Spark Connect server runs, untimed "
                             "and checked, before the connect and airflow systems (default "
                             "0: only onceflow's generic warm-up, as users run it)")
    parser.add_argument("--timeline", type=Path, default=None,
                        help="airflow: write each task's queued, start and end time and "
                             "each transaction's planned and committed time and its begin's "
                             "split (lock wait, index, plan) to this JSON file")
    parser.add_argument("--rounds", type=int, default=1,
                        help="times each system runs but Airflow's, interleaved; the fastest "
                             "counts, each is checked (default 1: as users run it)")
    parser.add_argument("--in-flight", type=int, default=None,
                        help="library paths: batches processed at once, committed in order "
                             "(default: the pipeline's max_pending, the runs in flight of "
                             "the Airflow path; 1: one after the other)")
    parser.add_argument("--steps", default=None, choices=SOURCE_NAMES,
                        help="also split onceflow's CPU by process and step on this source "
                             "(one batch at a time on the Spark Connect server, acker on "
                             "and off)")
    parser.add_argument("--sources", default="all",
                        help="comma-separated sources the connect and airflow systems read, "
                             f"each once: {', '.join(SOURCE_NAMES)}; or all (the default)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give 1 or more")
    if args.server_warm_up < 0:
        parser.error(f"--server-warm-up {args.server_warm_up}: give 0 or more")
    if args.acker_rounds < 1:
        parser.error(f"--acker-rounds {args.acker_rounds}: give 1 or more")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    asked = [s.strip() for s in args.sources.split(",") if s.strip()]
    unknown = sorted(set(asked) - {*SOURCE_NAMES, "all"})
    if unknown or not asked:
        parser.error(f"--sources {args.sources!r}: "
                     + (f"unknown {', '.join(unknown)}" if unknown else "names no source")
                     + f"; give a comma list of {', '.join(SOURCE_NAMES)}, or all")
    sources = list(SOURCE_NAMES) if "all" in asked else \
        [s for s in SOURCE_NAMES if s in asked]
    broker = KafkaBroker(args.folder) if "kafka" in sources else None
    try:
        return run(args, systems, sources)
    finally:
        if broker is not None:
            broker.stop()


def run(args, systems: list[str], sources: list[str]) -> int:
    """Every system asked for on every source asked for, then the report (see the module
    docstring); 0 when every result was exact."""
    json_lines = "landing-json" in sources  # the systems that read the JSON lines only

    server, _ = server_dsn()
    os.environ["ONCEFLOW_BENCH_FOLDER"] = str(args.folder / "landing")
    os.environ["ONCEFLOW_PIPELINES"] = "workload:PIPELINES"
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE),
                                                             os.environ.get("PYTHONPATH")]))
    files, truth = prepare(args.folder, args.events, args.batches, args.seed,
                           {FORMS[s] for s in sources if s in FORMS})
    from onceflow.core.registry import get_pipeline

    batch = -(-args.events // args.batches)
    w = get_pipeline("bench_w", batch_size=batch)
    if args.in_flight is None:
        args.in_flight = w.max_pending
    from workload import EVENT_DDL, SOURCES

    # per (source, system name): its result; a JSON-lines Structured Streaming run is
    # reported under "json" and shown with every source it is the baseline of
    results: dict[tuple[str, str], dict] = {}
    print(f"load average before: {loadavg()}", flush=True)
    spark, jvm_s = None, None
    ss_forms = []  # the Structured Streaming runs: (results key, reader, folder)
    if "streaming" in systems:
        if set(sources) & set(JSON_SOURCES):
            ss_forms.append((("json", SS_NAME), "text", args.folder / "landing"))
        for source, reader, label in (("landing-csv", "csv", "CSV"),
                                      ("landing-parquet", "parquet", "Parquet")):
            if source in sources:
                ss_forms.append(((source, f"{SS_NAME}, {label} source"), reader,
                                 rows_folder(args.folder, reader)))
    if "streaming-json" in systems and set(sources) & set(JSON_SOURCES):
        ss_forms.append((("json", SS_JSON_NAME), "json", args.folder / "landing"))
    if ss_forms or "raw" in systems or json_lines and "library" in systems:
        started = time.perf_counter()
        spark = peers.local_session("onceflow-bench")
        spark.range(1).count()  # the JVM and session are up before any clock starts
        jvm_s = time.perf_counter() - started
        print(f"Structured Streaming's JVM and session start: {jvm_s:.1f}s (timed apart)",
              flush=True)

    postmaster = postmaster_pid(server)
    driver = {"driver (the bench process)": os.getpid()}

    def raw(reader: str, paths: list[Path]) -> dict:
        name = f"{DB}_raw_{reader}"
        dsn = recreate_database(server, name)
        procs = ProcCpu(driver, postmaster=postmaster, databases=(name,))
        r = peers.raw_spark(spark, paths, dsn, "raw_", reader=reader,
                            schema=EVENT_DDL)
        return {**r, "proc_cpu": procs.stop(),
                "ok": peers.check(dsn, "raw_", truth["urls"], truth["domains"]),
                "load": loadavg().split()[0]}

    def streaming(reader: str, folder: Path) -> dict:
        name = f"{DB}_ss_{reader}"
        dsn = recreate_database(server, name)
        checkpoint = args.folder / f"checkpoint-{reader}"
        shutil.rmtree(checkpoint, ignore_errors=True)
        procs = ProcCpu(driver, postmaster=postmaster, databases=(name,))
        r = peers.structured_streaming(spark, folder, dsn, "ss_", checkpoint,
                                       files_per_trigger=max(1, len(files) // args.batches),
                                       reader=reader, schema=EVENT_DDL)
        return {**r, "proc_cpu": procs.stop(),
                "ok": peers.check(dsn, "ss_", truth["urls"], truth["domains"]),
                "load": loadavg().split()[0]}

    def library() -> dict:
        dsn = recreate_database(server, f"{DB}_lib")
        procs = ProcCpu(driver, postmaster=postmaster, databases=(f"{DB}_lib",))
        r = onceflow_loop(spark, dsn, w, args.batches, args.in_flight)
        return {**r, "proc_cpu": procs.stop(), "ok": counts_ok(dsn, *state_tables(w), truth)}

    local = [(key, lambda reader=reader, folder=folder: streaming(reader, folder))
             for key, reader, folder in ss_forms]
    if "raw" in systems:  # the practical limit, per form of the events on disk
        for source, reader, paths in (
                ("landing-json", "text", files),
                ("landing-csv", "csv", sorted(rows_folder(args.folder, "csv").glob("*.csv"))),
                ("landing-parquet", "parquet",
                 sorted(rows_folder(args.folder, "parquet").glob("*.parquet")))):
            if source in sources:
                local.insert(0, ((source, RAW_NAME),
                                 lambda reader=reader, paths=paths: raw(reader, paths)))
    if json_lines and "library" in systems:
        local.append((("landing-json", "onceflow library (local session)"), library))
    rounds(results, local, args.rounds, CpuClock)
    if spark is not None:
        spark.stop()
        spark = None
        os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)
    url, ours = args.spark_connect, False
    if not url and ({"connect", "airflow", "airflow-phases"} & set(systems)
                    or args.acker_events or args.steps):
        from onceflow.spark import localspark
        from onceflow.spark.warm_up import warm_up

        ours = not localspark.status(folder=args.folder / "spark-connect").running
        url = localspark.start(folder=args.folder / "spark-connect").url
        # a long-lived server, as a user's is: warmed up before any clock starts (what
        # `onceflow spark start` does in the background)
        print(f"Spark Connect server warmed up in {warm_up(url):.1f}s", flush=True)
    warm_ok, split = True, None
    try:
        if args.server_warm_up and {"connect", "airflow", "airflow-phases"} & set(systems):
            warm_ok = warm_server(url, server, w, args, truth)
        if "connect" in systems:
            from airflow_run import _spark_server_pid

            from onceflow.spark.session import connect_session

            name = LIBRARY_NAME
            server_pid = _spark_server_pid(url)
            with connect_session(url, "onceflow-bench") as remote:
                remote.range(1).count()

                def connect(source: str) -> dict:
                    pipeline = get_pipeline(SOURCES[source].name, batch_size=batch)
                    dsn = recreate_database(server, f"{DB}_connect")
                    filled = fill(dsn, [source], files, args.folder)
                    cpu = CpuClock()  # the filling is not the system's
                    procs = ProcCpu({**driver, "Spark Connect server": server_pid},
                                    postmaster=postmaster,
                                    databases=(f"{DB}_connect",))
                    r = onceflow_loop(remote, dsn, pipeline, args.batches, args.in_flight)
                    if source in HELD:
                        r["filled_s"] = filled
                    return {**r, "cpu_total_s": cpu.seconds(), "proc_cpu": procs.stop(),
                            "ok": counts_ok(dsn, *state_tables(pipeline), truth)}

                rounds(results, [((source, name), lambda source=source: connect(source))
                                 for source in sources], args.rounds, CpuClock)
            if json_lines:
                results["landing-json", name]["fixed_s"] = fixed_cost(
                    url, recreate_database(server, f"{DB}_fixed"), get_pipeline(
                        "bench_w", batch_size=1))
        wanted = []  # (results key, pipeline)
        if "airflow" in systems:
            wanted += [((source, AIRFLOW_NAME), SOURCES[source])
                       for source in sources]
        if "airflow-phases" in systems and json_lines:
            wanted.append((("landing-json", "onceflow through Airflow, 3 tasks"),
                           get_pipeline("bench_w_phases")))
        if wanted:
            from airflow_run import run_airflow

            dsn = recreate_database(server, f"{DB}_airflow")
            filled = fill(dsn, [s for s in sources if s in HELD], files, args.folder)
            print(f"Airflow's sources filled in {filled:.1f}s", flush=True)
            ran = run_airflow(dsn, server, url, args.folder, [p.name for _, p in wanted],
                              batch, args.batches, args.timeline)
            for key, pipeline in wanted:
                r = ran[pipeline.name]
                r["ok"] = counts_ok(dsn, *state_tables(pipeline), truth)
                results[key] = r
        if args.steps:
            try:
                split = step_split(url, server, files, args.steps, batch, args)
            except Exception as error:  # noqa: BLE001 (the comparison above still reports)
                print(f"the step split failed: {error!r}", flush=True)
                warm_ok = False
        acker = {}
        if args.acker_events:
            acker = acker_cost(server, url, args)
    finally:
        if ours:  # the server this run started goes with it, whatever happened
            localspark.stop(folder=args.folder / "spark-connect")
    report(results, acker, jvm_s, sources, args)
    if split:
        print_steps(split, args.steps, args.events)
    if not warm_ok:
        print("a warm-up round of the Spark Connect server gave a wrong result (above)")
    return 0 if warm_ok and all(r.get("ok") for r in results.values()) else 1


SS_NAME = "Structured Streaming"
RAW_NAME = "raw Spark batch"
LIBRARY_NAME = "onceflow library (Spark Connect)"
AIRFLOW_NAME = "onceflow through Airflow, one task"
SS_JSON_NAME = "Structured Streaming, JSON source"


def state_tables(pipeline) -> tuple[str, str]:
    """The pipeline's url and domain count tables."""
    by_source = {spec.source: spec.name for spec in pipeline.states}
    return by_source["url_counts"], by_source["domain_counts"]


def warm_server(url: str, server: str, pipeline, args, truth: dict) -> bool:
    """The workload ``--server-warm-up`` times on the Spark Connect server, before any of
    its clocks starts; whether every round's result was right."""
    from onceflow.spark.session import connect_session

    ok = True
    with connect_session(url, "onceflow-bench-warm-up") as remote:
        for n in range(args.server_warm_up):
            dsn = recreate_database(server, f"{DB}_warm_up")
            r = onceflow_loop(remote, dsn, pipeline, args.batches, args.in_flight)
            right = counts_ok(dsn, "w_url_counts", "w_domain_counts", truth)
            ok = ok and right
            print(f"Spark Connect server warm-up round {n + 1} of {args.server_warm_up}: "
                  f"{r['seconds']:.1f}s, {'OK' if right else 'WRONG'}", flush=True)
    return ok


def rounds(results: dict, systems: list, count: int, clock) -> None:
    """Run each of ``systems`` ((key, run() -> result dict)) ``count`` times, the rounds
    interleaved (every system once, then again), and keep per key its fastest round,
    with its CPU seconds (``clock()``: a CpuClock started; unless the run measured its own,
    leaving out its set-up); a system is OK only if every round's result was."""
    for n in range(count):
        for name, run in systems:
            if count > 1:
                print(f"round {n + 1} of {count}: {name}", flush=True)
            cpu = clock()
            r = run()
            r.setdefault("cpu_total_s", cpu.seconds())
            best = results.get(name)
            ok = r["ok"] and (best is None or best["ok"])
            if best is None or r["seconds"] < best["seconds"]:
                best = r
            results[name] = {**best, "ok": ok}


def acker_cost(server: str, url: str, args) -> dict:
    """The tweets topology (a per-record Python bolt) on the first files, acker on and off,
    through the warm Spark; the best of --acker-rounds rounds each, the order turned each
    round (off, on, then on, off): the first run also starts the bolt's Python workers."""
    from onceflow.core.registry import get_pipeline
    from onceflow.spark.session import connect_session

    share = max(1, args.batches * args.acker_events // args.events)
    out = {}
    with connect_session(url, "onceflow-bench-acker") as remote:
        order = [(False, True) if n % 2 == 0 else (True, False) for n in range(args.acker_rounds)]
        for acker in (setting for pair in order for setting in pair):
            pipeline = get_pipeline("bench_w_idna", batch_size=args.acker_events // share,
                                    acker=acker)
            dsn = recreate_database(server, f"{DB}_acker")
            r = onceflow_loop(remote, dsn, pipeline, share)
            out.setdefault(acker, []).append(r["seconds"])
    return {"events": args.acker_events, "off_s": min(out[False]), "on_s": min(out[True]),
            "rounds": args.acker_rounds}


def report(results: dict, acker: dict, jvm_s: float | None, sources: list[str],
           args) -> None:
    """The table per source (see the module docstring), then the details."""
    print(f"\n{args.events} events, {args.batches} batches; load average {loadavg()}")
    if jvm_s is not None:
        print(f"Structured Streaming's JVM and session start: {jvm_s:.1f}s, not in its wall "
              "seconds (a spark-submit of the query pays it each time)")
    print("vs SS: against Structured Streaming on the source's files (JSON lines: text parsed "
          "with from_json); vs SS+JVM: the same with its JVM and session start added; "
          "vs SS-json: against its JSON source")
    print("CPU s: the machine's busy CPU seconds during the system's run (every process: "
          "Spark, Airflow, PostgreSQL); load: the 1-minute load average at the run's end")
    header = (f"{'system':<36} {'wall s':>8} {'events/s':>10} {'vs SS':>7} {'vs SS+JVM':>9} "
              f"{'vs SS-json':>10} {'CPU s':>7} {'load':>5}  check")
    for source in sources:
        rows = {name: r for (where, name), r in results.items() if where == source}
        json_ss = {name: r for (where, name), r in results.items() if where == "json"}
        if source in JSON_SOURCES:
            rows = {**json_ss, **rows}
        if not rows:
            continue
        reads = SS_READS.get(source, "the same events from the JSON lines files")
        peer = NO_KAFKA_PEER if source == "kafka" else f"Structured Streaming reads {reads}"
        print(f"\nsource {source}: {ABOUT[source]}; {peer}")
        print(header)
        ss = next((r["seconds"] for name, r in rows.items()
                   if name.startswith(SS_NAME) and name != SS_JSON_NAME), None)
        ss_json = rows.get(SS_JSON_NAME, {}).get("seconds")
        for name, r in rows.items():
            own = name.startswith(SS_NAME)  # its own JVM start is not in its seconds either
            seconds = r["seconds"]
            rate = args.events / seconds
            ratio = f"{ss / seconds:.2f}x" if ss else "-"
            with_jvm = "-"
            if ss and jvm_s is not None:
                with_jvm = f"{(ss + jvm_s) / (seconds + (jvm_s if own else 0)):.2f}x"
            ratio_json = f"{ss_json / seconds:.2f}x" if ss_json else "-"
            cpu = r.get("cpu_total_s")
            cpu_text = f"{cpu:.1f}" if cpu is not None else "-"
            print(f"{name:<36} {seconds:>8.1f} {rate:>10,.0f} {ratio:>7} {with_jvm:>9} "
                  f"{ratio_json:>10} {cpu_text:>7} {r.get('load', '-'):>5}  "
                  f"{'OK' if r.get('ok') else 'WRONG'}")
    print()
    for (source, name), r in results.items():
        name = f"{name} [{source}]"
        if r.get("proc_cpu"):
            print(f"  {name}: CPU s by process (/proc): " + ", ".join(
                f"{k} {v:.1f}" for k, v in sorted(r["proc_cpu"].items(),
                                                  key=lambda kv: -kv[1])))
        if "process_s" in r:
            print(f"  {name}: {r['in_flight']} in flight; per batch: process "
                  f"{r['process_s']:.2f}s, commit "
                  f"{r['commit_s']:.2f}s" + (f", fixed cost of a warm task {r['fixed_s']:.2f}s"
                                             if "fixed_s" in r else ""))
        if "filled_s" in r:
            print(f"  {name}: source filled in {r['filled_s']:.1f}s (before the clock)")
        if "task_s" in r:
            print(f"  {name}: task medians " + ", ".join(
                f"{k} {v:.2f}s" for k, v in r["task_s"].items()))
        if r.get("begin_s"):
            print(f"  {name}: begin medians: " + ", ".join(
                f"{k.replace('_', ' ')} {v:.3f}s" for k, v in r["begin_s"].items()))
        if r.get("overhead"):
            o = r["overhead"]
            print(f"  {name}: overhead: trigger to first txid planned "
                  f"{o['trigger_to_first_plan_s']:.2f}s; first wave, task start to txid "
                  f"planned {', '.join(f'{v:.2f}' for v in o['start_to_plan_s'])}s (in the "
                  "begin: lock wait " + ", ".join(f"{v or 0:.2f}" for v in o["begin_lock_s"])
                  + "; index " + ", ".join(f"{v or 0:.2f}" for v in o["begin_index_s"])
                  + "; plan " + ", ".join(f"{v or 0:.2f}" for v in o["begin_plan_s"]) + ")")
        if "cpu_s" in r:  # task runs: the scheduler's descendants (LocalExecutor workers)
            parts = ", ".join(f"{k} {v:.1f}" for k, v in r["cpu_s"].items())
            print(f"  {name}: CPU seconds during the runs (process trees, lower bounds): "
                  f"{parts}")
    summary(results, sources, args.events)
    if acker:
        cost = acker["on_s"] / acker["off_s"] - 1
        print(f"acker (tweets topology, Python bolt, {acker['events']} events): off "
              f"{acker['off_s']:.1f}s, on {acker['on_s']:.1f}s: costs {cost:.1%}"
              + (" (one round: the first, acker off, also started the bolt's Python workers)"
                 if acker["rounds"] == 1 else ""))
    print(f"load average after: {loadavg()}")


def step_split(url: str, server: str, files: list[Path], source: str, batch: int,
               args) -> dict:
    """Where onceflow's CPU goes, by process and step: ``source``'s pipeline on the Spark
    Connect server, one batch at a time (so that steps do not overlap), acker on and off,
    the CPU of every process by kind (benchkit.ProcCpu) noted at each step's end: begin;
    processing up to the staging (reading, the topology's Spark job, the Arrow collect,
    the CSV for COPY: Spark Connect calls from the driver); the staging COPY; the commit's
    statement groups (its on_step names). Per acker setting: {step: {kind: CPU s}}, its
    wall seconds, and whether the counts were exact."""
    from airflow_run import _spark_server_pid
    from workload import SOURCES

    from onceflow.core.begin import begin
    from onceflow.core.commit import commit
    from onceflow.core.db import connection
    from onceflow.core.registration import register
    from onceflow.core.registry import get_pipeline
    from onceflow.core.staging import stage_group
    from onceflow.kvstate import open_state_provider
    from onceflow.spark.processing import process_batch
    from onceflow.spark.session import connect_session

    roots = {"driver (the bench process)": os.getpid(),
             "Spark Connect server": _spark_server_pid(url)}
    postmaster, out = postmaster_pid(server), {}
    with connect_session(url, "onceflow-bench-steps") as remote:
        remote.range(1).count()
        for acker in (True, False):
            pipeline = get_pipeline(SOURCES[source].name, batch_size=batch, acker=acker)
            dsn = recreate_database(server, f"{DB}_steps")
            fill(dsn, [source] if source in HELD else [], files, args.folder)
            with connection(dsn) as conn:
                register(conn, pipeline, create_source=True)
            procs = ProcCpu(roots, postmaster=postmaster, databases=(f"{DB}_steps",))

            def stage(*a, procs=procs, **kw):
                procs.mark("process: read, topology, collect, CSV (Spark Connect calls)")
                staged = stage_group(*a, **kw)
                procs.mark("process: staging COPY")
                return staged

            started = time.perf_counter()
            with connection(dsn, application_name="onceflow-bench-steps") as conn:
                for n in range(args.batches):
                    planned = begin(conn, pipeline, f"steps-{n}")
                    procs.mark("begin")
                    for group in range(planned.groups):
                        process_batch(remote, dsn, pipeline, planned.attempt, group, stage=stage)
                    procs.mark("process: the rest (lease, fence)")
                    commit(conn, pipeline, planned.attempt, open_state=open_state_provider,
                           on_step=lambda name, procs=procs: procs.mark(f"commit: {name}"))
                    procs.mark("commit: after the last statement group")
            seconds = time.perf_counter() - started
            procs.stop()
            steps: dict[str, dict[str, float]] = {}
            for step, kinds in procs.steps():
                into = steps.setdefault(step, {})
                for kind, v in kinds.items():
                    into[kind] = into.get(kind, 0.0) + v
            out[acker] = {"steps": steps, "seconds": seconds,
                          "ok": counts_ok(dsn, *state_tables(pipeline), json.loads(
                              (args.folder / "data.json").read_text())["truth"])}
    return out


def print_steps(split: dict, source: str, events: int) -> None:
    """The step split as a table: CPU s per 1M events by step and process kind."""
    per_m = 1e6 / events
    kinds = sorted({k for r in split.values() for kinds in r["steps"].values() for k in kinds})
    print(f"\nwhere onceflow's CPU goes, {source}, one batch at a time on the Spark Connect "
          "server: CPU s per 1M events by step and process (/proc)")
    for acker, r in split.items():
        print(f"acker {'on' if acker else 'off'}: wall {r['seconds']:.1f}s, "
              f"{'OK' if r['ok'] else 'WRONG'}")
        print("| step | " + " | ".join(kinds) + " | all |")
        print("| --- |" + " --- |" * (len(kinds) + 1))
        totals = dict.fromkeys(kinds, 0.0)
        for step, by in r["steps"].items():
            for k in kinds:
                totals[k] += by.get(k, 0.0)
            print(f"| {step} | " + " | ".join(f"{by.get(k, 0.0) * per_m:.2f}" for k in kinds)
                  + f" | {sum(by.values()) * per_m:.2f} |")
        print("| all | " + " | ".join(f"{totals[k] * per_m:.2f}" for k in kinds)
              + f" | {sum(totals.values()) * per_m:.2f} |")


def summary(results: dict, sources: list[str], events: int) -> None:
    """The opening table of bench/RESULTS.md: per source, CPU seconds per million events
    (from /proc, the processes each system started) and wall seconds of Structured
    Streaming, onceflow's library path and onceflow through Airflow, and the raw limit."""
    per_m = 1e6 / events

    def cell(r: dict | None, what: str) -> str:
        if not r:
            return "-"
        if what == "wall":
            return f"{r['seconds']:.1f}" + ("" if r.get("ok") else " WRONG")
        cpu = r.get("proc_cpu")
        return f"{sum(cpu.values()) * per_m:.1f}" if cpu else "-"

    print("\nCPU s per 1M events (/proc, every process the system started) and wall s")
    print("| source | SS CPU/M | library CPU/M | Airflow CPU/M | SS wall | library wall | "
          "Airflow wall | raw limit wall (CPU/M) | load |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for source in sources:
        form = source if source in ("landing-csv", "landing-parquet") else "landing-json"
        ss = next((r for (where, name), r in results.items()
                   if name.startswith(SS_NAME) and name != SS_JSON_NAME
                   and where == ("json" if form == "landing-json" else source)), None)
        lib = results.get((source, LIBRARY_NAME))
        air = results.get((source, AIRFLOW_NAME))
        raw = results.get((form, RAW_NAME))
        if source == "kafka":  # neither reads Kafka here (NO_KAFKA_PEER)
            ss = raw = None
        if not (ss or lib or air):
            continue
        raw_text = f"{raw['seconds']:.1f} ({cell(raw, 'cpu')})" if raw else "-"
        load = "/".join(r["load"] for r in (ss, lib, air) if r and r.get("load"))
        print(f"| {source} | {cell(ss, 'cpu')} | {cell(lib, 'cpu')} | {cell(air, 'cpu')} | "
              f"{cell(ss, 'wall')} | {cell(lib, 'wall')} | {cell(air, 'wall')} | {raw_text} | "
              f"{load} |")
    if "kafka" in sources:
        print(f"kafka: {NO_KAFKA_PEER}; nor can the raw Spark job (the same connector)")


if __name__ == "__main__":
    sys.exit(main())
