"""A pipeline that keeps up by itself (tests/keepup_pipelines.py: keep_up=True, batch_size
10,000, min_records 8,000, max_delay 6 s, max_pending 3, a look every second), against a
real Airflow: an API server, a scheduler (LocalExecutor), a DAG processor and a triggerer, each
a process of its own that the test starts, on a PostgreSQL metadata database; processing on
a local Spark Connect server. No run is started by hand: the source watcher (an AssetWatcher
in the triggerer) starts them all.

In order, on one Airflow:

1. a backlog of 10 batches drains in full batches with max_pending transactions in flight,
   every run started by the Asset event; a backlog of 20 batches keeps max_pending in flight
   (1.5 of 3 at least on average while records wait, from the transactions' own
   timestamps: onceflow.ops.drain; 2.5 is the 1M-record drain's, bench_keepup_drain.py) and
   after every commit while min_records waited, a begin took up
   the next batch within one watch_interval (the committing run carries on, or a run waiting
   in its begin takes the place), from the transactions' own committed_at, planned_at and
   the begin's recorded planning seconds;
2. a steady producer (RATE records/s for SECONDS s) stays current: the p95 of the records'
   waits from arrival to commit is within max_delay, one look and a batch's processing time
   (the slowest of the phase's runs, from the watcher's look that started it to the commit),
   and a run that committed waits for its next batch instead of ending (runs carry several
   txids);
3. after the producer stops and the last batch commits, no run starts and no transaction is
   planned for IDLE_S seconds (60: sixty looks at the test's interval of 1 s, as many as the
   watcher takes in the issue's two minutes at its default interval of 2 s; ten max_delays);
4. the triggerer is killed (SIGKILL to the process group the test started) while a producer
   runs, `onceflow status` says plainly that no triggerer runs the watcher, and it is started
   again (status says it runs, in the new triggerer, and new records start its runs); then
   the scheduler is killed the same way (with the LocalExecutor its process group holds the
   task processes: the runs in flight die with it) while a backlog drains, and started
   again: every record is committed exactly
   once (the committed ranges tile each partition, the counts equal a recount of the records
   produced), no txid is planned or committed twice, and no transaction is empty.

ONCEFLOW_KEEPUP_RATE / ONCEFLOW_KEEPUP_SECONDS / ONCEFLOW_KEEPUP_IDLE_S change 2, 3 (the
defaults fit a loaded two-core machine), ONCEFLOW_KEEPUP_DRAIN_BATCHES the drain of 1. A drain
of a million records is bench/bench_keepup_drain.py. The freshness benchmark at 1,000 to
50,000 records/s, beside Structured Streaming, is bench/bench_freshness.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from test_celery_cluster import _query, _stop
from test_cluster import free_ports

from onceflow.airflow import airflow_cli
from onceflow.airflow.environment import airflow_healthy, served_airflow_env, spark_connection
from onceflow.core import freshness, keepup
from onceflow.core.db import connection
from onceflow.core.registration import register
from onceflow.core.registry import clear_cache, get_pipeline
from onceflow.ops import drain
from onceflow.ops.status import pipeline_status
from onceflow_testing.holds import hold_staging
from onceflow_testing.plugin import fresh_database

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
REF = "keepup_pipelines:KEEP_UP"
PIPELINE = "keepup"
DAG_ID = f"onceflow_{PIPELINE}"
RATE = int(os.environ.get("ONCEFLOW_KEEPUP_RATE", "1000"))
SECONDS = float(os.environ.get("ONCEFLOW_KEEPUP_SECONDS", "40"))
IDLE_S = float(os.environ.get("ONCEFLOW_KEEPUP_IDLE_S", "60"))
UP_S = 300  # start-up of every part, on a loaded machine
DRAIN_S = 300  # a backlog or a producer's records committed, at most
FINISHED = {"success", "failed", "skipped", "upstream_failed", "removed"}  # a task's last states


class Airflow:
    """Airflow's components, each a process group of the test's own in one AIRFLOW_HOME."""

    COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")

    def __init__(self, home: Path, meta: str, coordinator: str, spark_port: int):
        self.home, self.meta = home, meta
        self.procs: dict[str, subprocess.Popen] = {}
        api_port, = free_ports(1)
        (home / "dags").mkdir(parents=True)
        shutil.copy(ROOT / "dags" / "onceflow_pipelines.py", home / "dags")
        keep = {k: v for k, v in os.environ.items()
                if not k.startswith(("AIRFLOW", "ONCEFLOW", "SPARK", "PYSPARK"))}
        self.env = {
            **keep,
            **served_airflow_env(meta_dsn=meta, api_port=api_port, dsn=coordinator,
                                 spark=spark_connection(spark_port)),
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
            "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT": "600",
            # a killed triggerer's triggers go to the next one after 10 s without a heartbeat
            "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "10",
            # a killed scheduler's task instances are reset (and run again) by the next one
            # once its heartbeat is 15 s old, looked for every 5 s (defaults 30 s and 300 s)
            "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_THRESHOLD": "15",
            "AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": "5",
            "ONCEFLOW_PIPELINES": REF,
            "ONCEFLOW_RETRY_DELAY_SECONDS": "2",
            "PYTHONPATH": str(TESTS),  # the pipeline's module, as a user's package
            # a killed component's temporary folders (multiprocessing's) go with the test's
            "TMPDIR": str(home / "tmp"),
        }
        (home / "tmp").mkdir()
        self.api_port = api_port

    def run(self, *args: str) -> None:
        done = subprocess.run(airflow_cli(*args), env=self.env, cwd=self.home,
                              capture_output=True, text=True, timeout=UP_S)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]

    def start(self, name: str) -> None:
        out = open(self.home / f"{name}.log", "ab")  # noqa: SIM115 (the process keeps it)
        self.procs[name] = subprocess.Popen(
            airflow_cli(name), env=self.env, cwd=self.home, stdout=out,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def kill(self, name: str) -> int:
        """SIGKILL to the process group of ``name`` (the test started it); its exit status."""
        proc = self.procs[name]
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(timeout=30)

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}):\n{self.output(name)}")

    def output(self, name: str) -> str:
        path = self.home / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def healthy(self) -> bool:
        return airflow_healthy(self.api_port)

    def watching(self) -> bool:
        """Whether the triggerer runs the watcher of the pipeline's source."""
        return bool(_query(self.meta, """
            SELECT 1 FROM trigger t JOIN asset_watcher w ON w.trigger_id = t.id
            JOIN job j ON j.id = t.triggerer_id
            WHERE t.classpath = 'onceflow.airflow.triggers.SourceWatchTrigger'
              AND j.state = 'running'
              AND j.latest_heartbeat > now() - interval '5 seconds'"""))

    def ready(self, deadline: float) -> None:
        while True:
            self.check_alive()
            dag = _query(self.meta, "SELECT 1 FROM dag WHERE dag_id = %s AND NOT is_paused",
                         (DAG_ID,))
            if dag and self.healthy() and self.watching():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"Airflow was not up in time (dag {bool(dag)}); logs in "
                                   f"{self.home}")
            time.sleep(1)

    def runs(self) -> list[tuple]:
        """(run_id, run_type, triggered_by, state, start, end) of every run, oldest first."""
        return _query(self.meta, """SELECT run_id, run_type, triggered_by, state,
                                           extract(epoch FROM start_date),
                                           extract(epoch FROM end_date),
                                           extract(epoch FROM queued_at)
                                    FROM dag_run WHERE dag_id = %s ORDER BY id""", (DAG_ID,))

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds so far of the triggerer (with its trigger runner) and of the
        PostgreSQL backend of the source watcher's connection."""
        import psutil

        out = {}
        backends = _query(self.env["ONCEFLOW_PG_DSN"], "SELECT pid FROM pg_stat_activity "
                                                       "WHERE application_name = 'onceflow-watch'")
        pids = {"triggerer": self.procs["triggerer"].pid,
                **{f"watcher's backend {pid}": pid for (pid,) in backends}}
        for name, pid in pids.items():
            try:
                proc = psutil.Process(pid)
                procs = [proc, *proc.children(recursive=True)]
                out[name] = sum(sum(p.cpu_times()[:2]) for p in procs)
            except psutil.Error:
                pass
        return out

    def events(self) -> dict[str, float]:
        """Per run, when the watcher looked and decided the first Asset event it consumed
        (the look's database time, in the event's payload; the event's own timestamp is the
        triggerer's, a loop later)."""
        return dict(_query(self.meta, """
            SELECT r.run_id, extract(epoch FROM min(coalesce(
                (e.extra::json -> 'payload' ->> 'at')::timestamptz, e.timestamp)))
            FROM dag_run r
            JOIN dagrun_asset_event d ON d.dag_run_id = r.id
            JOIN asset_event e ON e.id = d.event_id
            WHERE r.dag_id = %s GROUP BY r.run_id""", (DAG_ID,)))

    def stop(self) -> None:
        _stop(*self.procs.values(), wait_s=5)


class Producer:
    """Appends ``{"k": ...}`` records to the pipeline's log: at once, or ``rate`` a second
    in a thread (a chunk every 0.25 s, on a schedule, so a slow chunk does not lower the
    rate)."""

    def __init__(self, dsn: str):
        self.dsn = dsn
        self.pipeline = get_pipeline(PIPELINE)
        self.keys: Counter = Counter()
        self.produced = 0
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def append(self, n: int, conn) -> None:
        payloads = [json.dumps({"k": f"k{(self.produced + i) % 997}"}) for i in range(n)]
        self.pipeline.source.append(conn, payloads, chunk_size=max(1, n))
        self.keys.update(json.loads(p)["k"] for p in payloads)
        self.produced += n

    def now(self, n: int) -> None:
        with connection(self.dsn) as conn:
            self.append(n, conn)

    def steady(self, rate: int, seconds: float) -> None:
        def run():
            try:
                with connection(self.dsn) as conn:
                    start, ticks, per_tick = time.monotonic(), int(seconds * 4), rate // 4
                    for tick in range(ticks):
                        self.append(per_tick, conn)
                        time.sleep(max(0.0, start + (tick + 1) * 0.25 - time.monotonic()))
            except BaseException as error:  # said by join()
                self.error = error

        self.thread = threading.Thread(target=run, name="keepup-producer", daemon=True)
        self.thread.start()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()
        assert self.error is None, f"the producer failed: {self.error!r}"


def committed_records(dsn: str) -> int:
    return int(_query(dsn, """SELECT coalesce(sum("offset"), 0) FROM partition_offsets
                              WHERE pipeline = %s""", (PIPELINE,))[0][0])


def wait_committed(deployment, records: int, deadline_s: float = DRAIN_S) -> None:
    deadline = time.monotonic() + deadline_s
    while committed_records(deployment.dsn) < records:
        deployment.airflow.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{committed_records(deployment.dsn)} of {records} records "
                               f"committed; logs in {deployment.airflow.home}")
        time.sleep(0.5)


def txids(dsn: str, after: int = 0) -> list[tuple]:
    """(txid, state, records, planned_at, committed_at, run_id) of every txid past ``after``."""
    return _query(dsn, """SELECT txid, state, records, extract(epoch FROM planned_at),
                                 extract(epoch FROM committed_at), run_id
                          FROM transactions WHERE pipeline = %s AND txid > %s ORDER BY txid""",
                  (PIPELINE, after))


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """The most spans ``(start, end)`` open at one moment."""
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


class Deployment:
    def __init__(self, airflow: Airflow, dsn: str):
        self.airflow, self.dsn = airflow, dsn
        self.producer = Producer(dsn)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, template_db, spark_connect_server):
    home = tmp_path_factory.mktemp("keepup-airflow")
    with fresh_database("onceflow_keepup_", template_db) as dsn, \
            fresh_database("onceflow_keepup_meta_") as meta, \
            pytest.MonkeyPatch.context() as mp:
        airflow = Airflow(home, meta, dsn, spark_connect_server)
        try:
            mp.setenv("ONCEFLOW_PIPELINES", REF)
            clear_cache()
            with connection(dsn) as conn:  # `onceflow init`
                register(conn, get_pipeline(PIPELINE), create_source=True)
            airflow.run("db", "migrate")
            for component in Airflow.COMPONENTS:
                airflow.start(component)
            airflow.ready(time.monotonic() + UP_S)
            yield Deployment(airflow, dsn)
        finally:
            airflow.stop()
            clear_cache()


def test_a_backlog_drains_in_full_batches_with_max_pending_in_flight(deployment):
    pipeline = get_pipeline(PIPELINE)
    backlog = 10 * pipeline.batch_size
    # txid 1's staging is held at its last statement: the runs after it plan and process
    # meanwhile, so the backlog is seen with max_pending transactions open (and a fourth
    # never planned), however fast a batch is on this machine
    with hold_staging(deployment.dsn, PIPELINE, txid=1, attempt=1) as hold:
        deployment.producer.now(backlog)
        waiter = hold.wait_for_waiter()
        assert "INSERT INTO staged_groups" in waiter.query, waiter
        deadline = time.monotonic() + 120
        while len(txids(deployment.dsn)) < pipeline.max_pending:
            assert time.monotonic() < deadline, txids(deployment.dsn)
            time.sleep(0.2)
        time.sleep(3)  # a few of the watcher's looks and the scheduler's loops
        held = txids(deployment.dsn)
        assert [(t, s) for t, s, *_ in held] == [(1, "planned"), (2, "planned"),
                                                 (3, "planned")], held
    wait_committed(deployment, backlog)
    time.sleep(3)  # the last run ends after its commit
    done = txids(deployment.dsn)
    assert [(t, s, n) for t, s, n, *_ in done] == \
        [(t, "committed", pipeline.batch_size) for t in range(1, 11)]
    in_flight = most_at_once([(planned, committed) for *_, planned, committed, _ in done])
    assert in_flight == pipeline.max_pending, f"at most {in_flight} transactions in flight"
    runs = deployment.airflow.runs()
    assert {(kind, by.lower()) for _, kind, by, *_ in runs} == {("asset_triggered", "asset")}
    assert {run for *_, run in done} <= {run_id for run_id, *_ in runs}
    ran = [(start, end) for *_, start, end, _ in runs if start is not None and end is not None]
    assert most_at_once(ran) <= 3 * pipeline.max_pending  # the DAG's max_active_runs
    # A run may carry on with more batches (TransactionOperator); where it took the batch of
    # a run the watcher had started and that was not yet waiting in its begin (a task's
    # start takes long on a loaded machine), that run plans nothing: its task is skipped and
    # no empty transaction is planned. At most the runs waiting past max_pending are so.
    idle = {run_id for run_id, *_ in runs} - {run for *_, run in done}
    assert len(idle) <= keepup.WAITING_RUNS * pipeline.max_pending, idle
    # such a run's task may still be starting or looking when the last commit lands: it is
    # waited for, and it must end skipped
    deadline = time.monotonic() + 120
    while True:
        ends = dict(((run, state) for run, state in _query(
            deployment.airflow.meta, "SELECT run_id, state FROM task_instance WHERE dag_id = %s",
            (DAG_ID,)) if run in idle))
        if set(ends) == idle and all(s in FINISHED for s in ends.values()):
            break
        assert time.monotonic() < deadline, ends
        time.sleep(1)
    assert set(ends.values()) <= {"skipped"}, ends
    print(f"{len(done)} txids in {len(runs)} runs, {len(idle)} of which planned nothing")


def test_a_backlog_keeps_max_pending_in_flight_and_plans_at_each_commit(deployment):
    """While records wait, max_pending transactions are open (runs wait in their begin for a
    place), and a commit is followed by a plan within a look."""
    pipeline = get_pipeline(PIPELINE)
    wait_committed(deployment, deployment.producer.produced)
    before = len(txids(deployment.dsn))
    backlog = int(os.environ.get("ONCEFLOW_KEEPUP_DRAIN_BATCHES", "20")) * pipeline.batch_size
    target = deployment.producer.produced + backlog
    deployment.producer.now(backlog)
    wait_committed(deployment, target)
    with connection(deployment.dsn) as conn, conn.cursor() as cur:
        done = drain.spans(cur, PIPELINE, before)
    assert sum(n for _, n, *_ in done) == backlog
    figures = drain.figures(done, pipeline.batch_start_records, pipeline.watch_interval)
    runs = {run for *_, run in txids(deployment.dsn, before)}
    print(f"drain of {backlog:,} records, max_pending={pipeline.max_pending}: {figures}; "
          f"{len(done)} txids in {len(runs)} runs; load average {os.getloadavg()[0]:.1f}")
    # Batches of about 1 s on a quiet machine: the first three runs, one scheduler loop
    # apart, are a good part of such a drain (15 batches gave 1.67-2.34 of 3, 20 gave 2.92).
    # Runs that did not carry on gave 0.85 here; the 1M-record drain of bench_keepup_drain.py,
    # where the start weighs little, is the 2.5 of 3 figure.
    assert figures["in_flight_waiting"] >= 1.5, figures
    # After every commit while min_records or more waited, a begin took up the next batch
    # within one watch_interval of that commit's committed_at: the run that committed carries
    # on, or a run waiting in its begin takes the place. Taken up is the batch's planned_at
    # less the seconds its begin recorded indexing and planning it (transaction_attempts);
    # the plan written is printed above (planning took up to 0.6 s at load 50 on 2 cores).
    assert figures["commit_to_plan_max_s"] <= pipeline.watch_interval, figures
    assert not figures["slow_after_commit"], figures
    assert len(figures["after_commits"]) >= len(done) // 2, figures  # (held at most commits)


def test_a_steady_producer_is_kept_current(deployment):
    pipeline = get_pipeline(PIPELINE)
    before = len(txids(deployment.dsn))
    phase = RATE // 4 * int(SECONDS * 4)
    target = deployment.producer.produced + phase
    deployment.producer.steady(RATE, SECONDS)
    deployment.producer.join()
    wait_committed(deployment, target)
    time.sleep(3)
    done = txids(deployment.dsn, before)
    assert all(state == "committed" and 0 < n <= pipeline.batch_size
               for _, state, n, *_ in done), done
    with connection(deployment.dsn) as conn, conn.cursor() as cur:
        fresh = freshness.measure(cur, PIPELINE, pipeline.source, last=len(done))
    # a batch's processing time: from the watcher's decision (the look that yielded the Asset
    # event its run consumed) to the commit. The slowest records are the slowest batch's, so
    # the p95 of the records' waits is held against the slowest batch (a p95 over a handful
    # of runs interpolates below it).
    # (a run that carried on took up its later batches at their plan, not at the look)
    asked, first_of_run = deployment.airflow.events(), {}
    for txid, *_, run in done:
        first_of_run.setdefault(run, txid)
    run_s = {txid: float(committed - (asked[run] if first_of_run[run] == txid else planned))
             for txid, _, _, planned, committed, run in done}
    bound = pipeline.max_delay_s + pipeline.watch_interval + max(run_s.values())
    with connection(deployment.dsn) as conn, conn.cursor() as cur:
        each = freshness.by_txid(cur, PIPELINE, [t for t, *_ in done])
    for txid, _, n, *_ in done:
        print(f"  txid {txid}: {n:,} records, waited {each[txid][0]:.1f}-{each[txid][1]:.1f}s, "
              f"look to commit {run_s[txid]:.1f}s")
    print(f"steady {RATE}/s for {SECONDS:.0f}s: {len(done)} transactions, freshness p50 "
          f"{fresh.p50_s:.2f}s p95 {fresh.p95_s:.2f}s max {fresh.max_s:.2f}s; slowest run "
          f"{max(run_s.values()):.2f}s; bound {bound:.2f}s")
    assert (fresh.transactions, fresh.records) == (len(done), phase)
    assert fresh.p95_s <= bound, fresh
    # fewer than min_records waited after each commit: a run that committed waited for its
    # next batch (max_delay) instead of ending, so runs carried several txids
    assert len({run for *_, run in done}) < len(done), done
    assert fresh.lag_records == 0


def test_no_run_starts_once_the_source_is_caught_up(deployment):
    # the producer's last records are committed (the test before); the runs end
    wait_committed(deployment, deployment.producer.produced)
    deadline = time.monotonic() + 60
    while any(state not in ("success", "failed")
              for _, _, _, state, *_ in deployment.airflow.runs()):
        assert time.monotonic() < deadline, deployment.airflow.runs()
        time.sleep(1)
    runs, planned = deployment.airflow.runs(), txids(deployment.dsn)
    cpu = deployment.airflow.cpu_s()
    time.sleep(IDLE_S)
    used = {k: v - cpu.get(k, 0.0) for k, v in deployment.airflow.cpu_s().items()}
    print(f"idle for {IDLE_S:.0f}s, CPU seconds: " + ", ".join(
        f"{k} {v:.2f}" for k, v in sorted(used.items())))
    assert deployment.airflow.watching()
    assert deployment.airflow.runs() == runs
    assert txids(deployment.dsn) == planned
    assert all(n > 0 for _, _, n, *_ in planned)  # no empty transaction, ever


def watcher(dsn: str) -> dict:
    """What `onceflow status --json` says of the pipeline's watcher."""
    pipeline = get_pipeline(PIPELINE)
    with connection(dsn) as conn, conn.cursor() as cur:
        return pipeline_status(cur, pipeline.source, PIPELINE,
                               watch_interval=pipeline.watch_interval).watcher


def running_tasks(meta: str) -> list[tuple]:
    """(run_id, task_id, try_number) of the DAG's task instances running now."""
    return _query(meta, """SELECT run_id, task_id, try_number FROM task_instance
                           WHERE dag_id = %s AND state = 'running'""", (DAG_ID,))


def test_a_killed_triggerer_or_scheduler_loses_nothing_and_plans_no_txid_twice(deployment):
    airflow, producer = deployment.airflow, deployment.producer
    pipeline = get_pipeline(PIPELINE)
    before = len(txids(deployment.dsn))
    producer.steady(RATE // 2, 20)
    time.sleep(8)
    held = watcher(deployment.dsn)
    assert held["running"], held
    assert airflow.kill("triggerer") == -signal.SIGKILL  # the fault happened
    # status says so plainly once the watcher missed its looks, and how to fix it
    deadline = time.monotonic() + 60
    while (gone := watcher(deployment.dsn))["running"]:
        assert time.monotonic() < deadline, gone
        time.sleep(1)
    assert gone["line"].startswith("watcher: NOT RUNNING: no triggerer runs the watcher"), gone
    assert "`airflow triggerer`" in gone["fix"] and held["holder"] in gone["line"], gone
    airflow.start("triggerer")
    restarted = time.time()
    deadline = time.monotonic() + UP_S
    while not (back := watcher(deployment.dsn))["running"]:
        assert time.monotonic() < deadline, back
        time.sleep(1)
    assert back["holder"] != held["holder"], back  # the new triggerer's process
    producer.join()
    wait_committed(deployment, producer.produced)
    # a run may carry on without the triggerer (it waits for its next batch itself) until
    # the records stop; once the runs ended, new records start a run of the new triggerer's
    deadline = time.monotonic() + 60
    while any(state not in ("success", "failed") for _, _, _, state, *_ in airflow.runs()):
        assert time.monotonic() < deadline, airflow.runs()
        time.sleep(1)
    ended = {run for *_, run in txids(deployment.dsn, before)}
    producer.now(pipeline.batch_start_records)
    wait_committed(deployment, producer.produced)
    assert any(planned > restarted and run not in ended
               for _, _, _, planned, *_, run in txids(deployment.dsn, before))
    assert len(_query(airflow.meta, "SELECT id FROM job WHERE job_type = 'TriggererJob'")) == 2

    # the scheduler, while a backlog drains with a transaction in flight: planned, not yet
    # committed, and its run's task running (on a loaded machine the runs may go one at a
    # time, and a run's task also runs before it plans and after it commits)
    before = len(txids(deployment.dsn))
    producer.now(5 * pipeline.batch_size)
    deadline = time.monotonic() + DRAIN_S

    def in_flight() -> list[tuple]:
        open_runs = {run for _, state, *_, run in txids(deployment.dsn, before)
                     if state != "committed"}
        return [task for task in running_tasks(airflow.meta) if task[0] in open_runs]

    while not (running := in_flight()):
        airflow.check_alive()
        assert time.monotonic() < deadline, f"no transaction in flight; logs in {airflow.home}"
        time.sleep(0.1)
    assert airflow.kill("scheduler") == -signal.SIGKILL  # the fault happened
    open_at_kill = [t for t, state, *_ in txids(deployment.dsn, before) if state != "committed"]
    assert open_at_kill, "no transaction was in flight when the scheduler died"
    time.sleep(2)
    airflow.start("scheduler")
    wait_committed(deployment, producer.produced)
    assert len(_query(airflow.meta, "SELECT id FROM job WHERE job_type = 'SchedulerJob'")) == 2
    # a task killed with the scheduler ran again (a later try of the same task instance)
    tries = {(run, task): n for run, task, n in _query(
        airflow.meta, "SELECT run_id, task_id, try_number FROM task_instance "
                      "WHERE dag_id = %s", (DAG_ID,))}
    assert any(tries[(run, task)] > n for run, task, n in running), (running, tries)

    done = txids(deployment.dsn)
    assert [t for t, *_ in done] == list(range(1, len(done) + 1))
    assert all(state == "committed" and n > 0 for _, state, n, *_ in done)
    assert _query(deployment.dsn, """SELECT txid, count(*) FROM transaction_attempts
                                     WHERE pipeline = %s AND outcome = 'committed'
                                     GROUP BY txid HAVING count(*) <> 1""", (PIPELINE,)) == []
    # the committed ranges tile every partition from 0 to its head, in txid order
    ranges = _query(deployment.dsn, """SELECT partition, start_offset, end_offset FROM
                                       batch_ranges WHERE pipeline = %s
                                       ORDER BY partition, txid""", (PIPELINE,))
    heads = dict(_query(deployment.dsn, "SELECT partition, next_offset FROM "
                                        "source_partitions WHERE topic = 'keepup_events'"))
    for partition, head in heads.items():
        mine = [(s, e) for p, s, e in ranges if p == partition and e > s]
        assert mine[0][0] == 0 and mine[-1][1] == head
        assert all(a[1] == b[0] for a, b in zip(mine, mine[1:], strict=False))
    counts = dict(_query(deployment.dsn, "SELECT key, value FROM counts"))
    assert counts == dict(producer.keys)  # every record counted once
