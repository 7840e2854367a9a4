"""onceflow on the engines a team already runs, beyond one machine: Airflow with the
CeleryExecutor and a Spark standalone cluster, every part a process of its own.

- Redis (a private redis-server) is the Celery broker; the PostgreSQL server holds Airflow's
  metadata database and Celery's results (a fresh database) and onceflow's coordinator (a
  fresh database);
- Airflow: an API server, a scheduler, a DAG processor, a triggerer, and two
  ``airflow celery worker`` processes, each with its own working folder, Airflow home, copy of
  the DAG file and log folder (the way two machines have them);
- Spark: a standalone master, two workers, and a Spark Connect server whose master is the
  cluster; the Airflow connection spark_default (type spark_connect) points at it;
- the pipeline: the outside package's page views (tests/outside/pageviews, reached by
  reference only), landed as JSON-lines files in one folder. That folder, PostgreSQL and the
  broker are all that the workers and the Spark executors share.

The first test triggers four runs at once; the second lands more files, triggers four more
and kills (SIGKILL, by the process group the test started) the Celery worker that runs the
process task of the batch holding a marked record while that batch is on Spark; the task's
retry runs on the other worker. After each: every run succeeded, the txids committed in txid
order, the committed batches cover every landed record exactly once, and the states equal a
recount of the records the test wrote (tests/test_outside_pipeline.py's oracle).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from redis_server import RedisServer
from test_cluster import Cluster, free_ports
from test_outside_pipeline import oracle, payloads

from helpers import OUTSIDE
from onceflow.airflow.environment import (
    airflow_healthy,
    served_airflow_env,
    spark_connection,
    sqlalchemy_url,
)

ROOT = Path(__file__).resolve().parents[1]
REF = "pageviews.landed:PAGE_VIEWS_LANDED"
PIPELINE = "page_views_landed"
DAG_ID = f"onceflow_{PIPELINE}"
RUNS = 4  # per test, triggered at once
FILES, PER_FILE = 4, 300  # landed per test: 1200 records, three batches of 400 and the rest
UP_S = 300  # start-up of every part, on a loaded machine
RUNS_S = 400  # four runs (and a killed worker's retries); a hang only goes past it

# The trigger: what `airflow dags trigger` does, for several runs from one process.
TRIGGER = """
import sys
from airflow.api.common.trigger_dag import trigger_dag
from airflow.utils.types import DagRunTriggeredByType
dag_id, *run_ids = sys.argv[1:]
for run_id in run_ids:
    trigger_dag(dag_id, run_id=run_id, conf={}, triggered_by=DagRunTriggeredByType.CLI)
"""


def _query(dsn: str, query: str, params=()) -> list[tuple]:
    import psycopg2

    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(query, params)
            return cur.fetchall()
    finally:
        conn.close()


def _stop(*procs: subprocess.Popen, wait_s: float = 15) -> None:
    """Stop process groups this test started: SIGTERM to each, then SIGKILL to those still
    running after ``wait_s``."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + wait_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


class Airflow:
    """Airflow with the CeleryExecutor: each component and each worker a process group with
    a folder of its own (its working directory, AIRFLOW_HOME, DAGs folder and logs)."""

    COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
    WORKERS = ("worker-1", "worker-2")

    def __init__(self, folder: Path, meta: str, broker_port: int, coordinator: str,
                 spark_connect: int, landing: Path):
        self.folder, self.meta = folder, meta
        self.api_port, = free_ports(1)
        self.procs: dict[str, subprocess.Popen] = {}
        self.killed: set[str] = set()  # the workers a test killed
        # the environment of a machine: nothing of the test's own Airflow, onceflow or Spark
        # settings, only what the deployment configures
        keep = {k: v for k, v in os.environ.items()
                if not k.startswith(("AIRFLOW", "ONCEFLOW", "SPARK", "PYSPARK", "PAGEVIEWS"))}
        self.env = {
            **keep,
            **served_airflow_env(meta_dsn=meta, api_port=self.api_port, dsn=coordinator,
                                 spark=spark_connection(spark_connect),
                                 executor="CeleryExecutor"),
            "AIRFLOW__CELERY__BROKER_URL": f"redis://127.0.0.1:{broker_port}/0",
            "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + sqlalchemy_url(meta),
            "AIRFLOW__CELERY__WORKER_CONCURRENCY": "3",
            # one secret for the tokens the scheduler signs and the API server checks
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
            # a killed worker's task is failed (and retried) after 20 s without a heartbeat
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "20",
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "2",
            "AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL": "2",
            "ONCEFLOW_PIPELINES": REF,
            "ONCEFLOW_RETRY_DELAY_SECONDS": "1",
            "PYTHONPATH": str(OUTSIDE),  # the user's package, as each machine installs it
            "PAGEVIEWS_LANDING": str(landing),  # the shared folder, mounted on every machine
            # a killed worker's temporary folders (multiprocessing's) go with the test's
            "TMPDIR": str(folder / "tmp"),
        }
        (folder / "tmp").mkdir(parents=True, exist_ok=True)

    def home(self, name: str) -> Path:
        return self.folder / name

    def _env(self, name: str) -> dict[str, str]:
        home = self.home(name)
        if not home.exists():
            (home / "dags").mkdir(parents=True)
            (home / "logs").mkdir()
            shutil.copy(ROOT / "dags" / "onceflow_pipelines.py", home / "dags")
        return {**self.env, "AIRFLOW_HOME": str(home), "ONCEFLOW_HOME": str(home),
                "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
                "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(home / "logs")}

    def _start(self, name: str, *args: str) -> None:
        from onceflow.airflow import airflow_cli

        env = self._env(name)
        out = open(self.home(name) / "out.log", "ab")  # noqa: SIM115 (the process keeps it)
        self.procs[name] = subprocess.Popen(
            airflow_cli(*args), env=env, cwd=self.home(name), stdout=out,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def migrate(self) -> subprocess.Popen:
        """`airflow db migrate`, started (not waited for)."""
        self._start("migrate", "db", "migrate")
        return self.procs.pop("migrate")

    def start(self) -> None:
        for component in self.COMPONENTS:
            self._start(component, component)
        for worker in self.WORKERS:
            self._start(worker, "celery", "worker", "--celery-hostname", f"{worker}@%h",
                        "--skip-serve-logs", "--without-mingle", "--without-gossip")

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if name not in self.killed and proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}):\n{self.output(name)}")

    def output(self, name: str) -> str:
        path = self.home(name) / "out.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def ready(self, deadline: float) -> None:
        """Wait until the DAG is parsed and unpaused, the components report healthy and both
        workers say ready."""
        while True:
            self.check_alive()
            dag = _query(self.meta, "SELECT 1 FROM dag WHERE dag_id = %s AND NOT is_paused",
                         (DAG_ID,))
            workers = all(re.search(rf"{w}@\S+ ready", self.output(w)) for w in self.WORKERS)
            if dag and workers and self.healthy():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"Airflow was not up in time (dag {bool(dag)}, workers "
                                   f"{workers}); outputs under {self.folder}")
            time.sleep(1)

    def healthy(self) -> bool:
        return airflow_healthy(self.api_port)

    def trigger(self, run_ids: list[str]) -> None:
        done = subprocess.run([sys.executable, "-P", "-c", TRIGGER, DAG_ID, *run_ids],
                              env=self._env("trigger"), cwd=self.home("trigger"),
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr

    def wait(self, run_ids: list[str], deadline: float) -> dict[str, str]:
        """The runs' states once every one ended."""
        while True:
            self.check_alive()
            states = dict(_query(self.meta, "SELECT run_id, state FROM dag_run WHERE dag_id = "
                                            "%s AND run_id = ANY(%s)", (DAG_ID, run_ids)))
            if len(states) == len(run_ids) and all(s in ("success", "failed")
                                                   for s in states.values()):
                return states
            if time.monotonic() > deadline:
                raise TimeoutError(f"runs not done: {states}; outputs under {self.folder}")
            time.sleep(0.5)

    def ran_on(self, run_id: str, task_id: str, attempt: int) -> list[str]:
        """The workers whose log folders hold the log of that try of the task."""
        return [w for w in self.WORKERS if list(self.home(w).glob(
            f"logs/dag_id={DAG_ID}/run_id={run_id}/task_id={task_id}/**/attempt={attempt}.log"))]

    def task_logs(self) -> dict[str, str]:
        """Every task log of the DAG, by worker."""
        return {w: "\n".join(p.read_text(errors="replace") for p in sorted(
            self.home(w).glob(f"logs/dag_id={DAG_ID}/**/*.log"))) for w in self.WORKERS}

    def stop(self) -> None:
        _stop(*self.procs.values(), wait_s=5)  # nothing of theirs is kept


class Deployment:
    def __init__(self, airflow: Airflow, coordinator: str, landing: Path):
        self.airflow, self.coordinator, self.landing = airflow, coordinator, landing
        self.records: list[str] = []  # every record landed, for the recount
        self.files = 0

    def land(self, records: list[str]) -> None:
        """Land ``records`` in files of PER_FILE lines: written under a hidden name, then
        renamed into place, dated back past the folder's settle time."""
        for i in range(0, len(records), PER_FILE):
            self.files += 1
            final = self.landing / f"views-{self.files:03d}.jsonl"
            part = final.with_name("." + final.name)
            part.write_text("".join(r + "\n" for r in records[i:i + PER_FILE]))
            os.utime(part, (time.time() - 30, time.time() - 30))
            part.rename(final)
        self.records += records


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, template_db, server_dsn):
    from onceflow.core.db import connection
    from onceflow.core.registration import register
    from onceflow.core.registry import clear_cache, get_pipeline
    from onceflow.spark import localspark
    from onceflow_testing.plugin import fresh_database

    folder = tmp_path_factory.mktemp("celery-cluster")
    landing = folder / "shared" / "landing"  # what every machine mounts
    landing.mkdir(parents=True)
    started: list = []
    with fresh_database("onceflow_celery_", template_db) as coordinator, \
            fresh_database("onceflow_celery_meta_") as meta, \
            pytest.MonkeyPatch.context() as mp:
        try:
            redis = RedisServer(folder / "redis", persistent=False).start()
            started.append(redis.stop)
            connect_port, = free_ports(1)
            airflow = Airflow(folder / "airflow", meta, redis.port, coordinator, connect_port,
                              landing)
            migrating = airflow.migrate()  # while the Spark cluster starts
            started.append(lambda: _stop(migrating))
            cluster = Cluster(folder / "spark", workers=2, cores=1, memory="1g")
            started.append(cluster.stop)
            cluster.start()
            connect_folder = folder / "spark" / "connect"
            launch = localspark.launch(connect_port, master=cluster.url, driver_memory="1g",
                                       folder=connect_folder)
            started.append(lambda: localspark.stop(connect_port, folder=connect_folder))
            assert migrating.wait(timeout=UP_S) == 0, airflow.output("migrate")
            started.append(airflow.stop)  # stopped first: Spark's clients before Spark
            airflow.start()
            launch.ready(UP_S)
            assert "onceflow-spark-connect" in [a["name"] for a in cluster.state()["activeapps"]]
            # `onceflow init` of the pipeline, from the test (its package reached by reference)
            mp.syspath_prepend(str(OUTSIDE))
            mp.setenv("ONCEFLOW_PIPELINES", REF)
            mp.setenv("PAGEVIEWS_LANDING", str(landing))
            clear_cache()
            with connection(coordinator) as conn:
                register(conn, get_pipeline(PIPELINE), create_source=True)
            airflow.ready(time.monotonic() + UP_S)
            yield Deployment(airflow, coordinator, landing)
        finally:
            clear_cache()
            for stop in reversed(started):
                stop()


def check_exact(deployment: Deployment, txids: int) -> None:
    """Every txid committed, in txid order; the committed batches cover each landed record
    once; the states equal the recount."""
    db = deployment.coordinator
    done = _query(db, """SELECT txid, state FROM transactions WHERE pipeline = %s
                         ORDER BY committed_at, txid""", (PIPELINE,))
    assert done == [(t, "committed") for t in range(1, txids + 1)], done
    times = [t for t, in _query(db, "SELECT committed_at FROM transactions WHERE pipeline = %s "
                                    "ORDER BY txid", (PIPELINE,))]
    assert all(a < b for a, b in zip(times, times[1:], strict=False)), times
    # the offset log: per partition the committed ranges follow one another from 0 to the
    # head (no record read twice, none left out), and the head is every line landed
    ranges = _query(db, """SELECT partition, start_offset, end_offset FROM batch_ranges
                           WHERE pipeline = %s ORDER BY partition, start_offset""", (PIPELINE,))
    heads = dict(_query(db, "SELECT partition, sum(records) FROM landing_files "
                            "WHERE topic = %s GROUP BY partition", (PIPELINE,)))
    assert sum(heads.values()) == len(deployment.records)
    for partition, head in heads.items():
        mine = [(s, e) for p, s, e in ranges if p == partition and e > s]
        assert mine[0][0] == 0 and mine[-1][1] == head, (partition, mine, head)
        assert all(a[1] == b[0] for a, b in zip(mine, mine[1:], strict=False)), mine
    assert dict(_query(db, "SELECT partition, \"offset\" FROM partition_offsets "
                           "WHERE pipeline = %s", (PIPELINE,))) == heads
    countries, pages, rejected, failing = oracle(deployment.records)
    assert dict(_query(db, "SELECT key, value FROM landed_views_per_country")) == dict(countries)
    assert dict(_query(db, "SELECT key, value FROM landed_views_per_page")) == dict(pages)
    assert _query(db, "SELECT count(*) FROM rejected_records") == [(rejected,)]
    parked = _query(db, "SELECT (SELECT count(*) FROM backflow_items) "
                        "+ (SELECT count(*) FROM dead_letters)")[0][0]
    assert parked == failing > 0


def commit_lines(deployment: Deployment) -> dict[int, list[str]]:
    """The COMMIT lines of the task logs on both workers, by txid, with the worker."""
    found: dict[int, list[str]] = {}
    for worker, text in deployment.airflow.task_logs().items():
        for txid, prev in re.findall(rf"COMMIT pipeline={PIPELINE} txid=(\d+) attempt=\d+ "
                                     r"prev_txid=(\d+)", text):
            assert int(prev) == int(txid) - 1
            found.setdefault(int(txid), []).append(worker)
    return found


def kill_machine(worker: subprocess.Popen) -> set[int]:
    """SIGKILL a Celery worker and every process under it, as a machine's death would: its
    process group, and the groups of its task processes (Airflow puts each task in a group of
    its own). The group is stopped first, so that no new task starts while they are listed.
    Returns the pids killed, once every one is gone."""
    os.killpg(worker.pid, signal.SIGSTOP)
    tree = psutil.Process(worker.pid).children(recursive=True)
    groups = {worker.pid}
    for proc in tree:
        try:
            groups.add(os.getpgid(proc.pid))
        except ProcessLookupError:
            pass
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    worker.wait(timeout=30)
    _, alive = psutil.wait_procs(tree, timeout=30)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes outlived their worker: {alive}"
    return {worker.pid, *(p.pid for p in tree)}


def report(deployment: Deployment, runs: list[str], seconds: float) -> None:
    """What the runs did (shown with pytest -rP): wall time, txids in commit order with their
    attempt and records, which worker ran each run's tasks."""
    rows = _query(deployment.coordinator, """
        SELECT t.txid, t.attempt, t.records, r.run_id FROM transactions t
        JOIN transaction_runs r ON r.pipeline = t.pipeline AND r.txid = t.txid
        WHERE t.pipeline = %s AND r.run_id = ANY(%s) ORDER BY t.committed_at""",
                  (PIPELINE, runs))
    print(f"{len(runs)} runs in {seconds:.1f}s; {len(deployment.records)} records landed in "
          f"{deployment.files} files so far; commit order (txid, attempt, records, run):")
    airflow = deployment.airflow
    for txid, attempt, records, run_id in rows:
        where = {task: ",".join(w.removeprefix("worker-") for a in (1, 2)
                                for w in airflow.ran_on(run_id, task, a))
                 for task in ("begin", "process", "commit")}
        print(f"  txid {txid} attempt {attempt}: {records} records, run {run_id}, workers "
              + " ".join(f"{t}={w}" for t, w in where.items()))
    # tries that did not succeed, and why (their log's last lines)
    for run_id, task_id, try_number, state in _query(airflow.meta, """
            SELECT run_id, task_id, try_number, state FROM task_instance_history
            WHERE dag_id = %s AND run_id = ANY(%s) ORDER BY run_id, task_id, try_number""",
                                                     (DAG_ID, runs)):
        print(f"  {run_id} {task_id} try {try_number}: {state}")
        for worker in airflow.ran_on(run_id, task_id, try_number):
            log = next(airflow.home(worker).glob(f"logs/dag_id={DAG_ID}/run_id={run_id}/"
                                                 f"task_id={task_id}/**/attempt={try_number}.log"))
            print("    " + "\n    ".join(log.read_text(errors="replace").splitlines()[-6:]))
    timeouts = (airflow.home("scheduler") / "out.log").read_text(errors="replace").count(
        "Detected a task instance without a heartbeat")
    print(f"  the scheduler found {timeouts} task(s) without a heartbeat so far")


@pytest.mark.timeout(900)
def test_runs_at_once_on_two_celery_workers_and_a_spark_cluster(deployment):
    airflow = deployment.airflow
    deployment.land(payloads(FILES * PER_FILE, seed=21))
    runs = [f"celery_a_{i}" for i in range(RUNS)]
    started = time.monotonic()
    airflow.trigger(runs)
    states = airflow.wait(runs, time.monotonic() + RUNS_S)
    report(deployment, runs, time.monotonic() - started)
    assert set(states.values()) == {"success"}, (states, airflow.task_logs())
    check_exact(deployment, RUNS)
    commits = commit_lines(deployment)
    assert sorted(commits) == list(range(1, RUNS + 1))
    assert all(len(w) == 1 for w in commits.values()), commits  # one commit per txid
    # the tasks ran on both machines
    ran = {w for run in runs for task in ("begin", "process", "commit")
           for w in airflow.ran_on(run, task, 1)}
    assert ran == set(Airflow.WORKERS), ran


@pytest.mark.timeout(900)
def test_a_celery_worker_killed_mid_task(deployment):
    """The worker running a batch's process task is killed while that batch is on Spark
    (held there by a marked record until the test lets it go); the task's retry runs on the
    other worker and the batch commits once, in its turn."""
    airflow = deployment.airflow
    release = deployment.landing.parent / "release"  # the marked record's page: a path
    records = payloads(FILES * PER_FILE, seed=22)
    marked = len(records) // 2 + 7
    records[marked] = json.dumps({"country": "hold", "page": str(release)})
    txids_before = len(_query(deployment.coordinator, "SELECT 1 FROM transactions"))
    deployment.land(records)
    runs = [f"celery_b_{i}" for i in range(RUNS)]
    started = time.monotonic()
    airflow.trigger(runs)

    reached = Path(str(release) + ".reached")
    deadline = time.monotonic() + RUNS_S
    while not reached.exists():  # a Spark executor's Python worker is on the marked record
        airflow.check_alive()
        assert time.monotonic() < deadline, f"the marked record was never reached: " \
                                            f"{airflow.task_logs()}"
        time.sleep(0.2)
    # which batch holds it: the file's base offset plus its line, in that batch's ranges
    file_no, line = divmod(len(deployment.records) - len(records) + marked, PER_FILE)
    name = f"%/views-{file_no + 1:03d}.jsonl"
    (partition, offset), = _query(deployment.coordinator, """
        SELECT partition, base_offset + %s FROM landing_files
        WHERE topic = %s AND path LIKE %s""", (line, PIPELINE, name))
    (txid, run_id), = _query(deployment.coordinator, """
        SELECT r.txid, r.run_id FROM batch_ranges b
        JOIN transaction_runs r ON r.pipeline = b.pipeline AND r.txid = b.txid
        WHERE b.pipeline = %s AND b.partition = %s AND b.start_offset <= %s
          AND b.end_offset > %s""", (PIPELINE, partition, offset, offset))
    assert run_id in runs
    (pid, state, try_number), = _query(airflow.meta, """
        SELECT pid, state, try_number FROM task_instance
        WHERE dag_id = %s AND run_id = %s AND task_id = 'process'""", (DAG_ID, run_id))
    assert (state, try_number) == ("running", 1)
    worker, = airflow.ran_on(run_id, "process", 1)
    victim = airflow.procs[worker]
    task = psutil.Process(pid)
    assert victim.pid in [p.pid for p in task.parents()]  # the task is that worker's

    killed = kill_machine(victim)
    airflow.killed.add(worker)
    assert pid in killed  # the task's process died with its worker
    release.touch()  # the killed try's Spark job may finish now; nothing takes its result

    states = airflow.wait(runs, time.monotonic() + RUNS_S)
    report(deployment, runs, time.monotonic() - started)
    print(f"killed {worker} (pid {victim.pid}) and {len(killed) - 1} processes under it while "
          f"txid {txid}'s process task (pid {pid}) was on Spark")
    assert set(states.values()) == {"success"}, (states, airflow.task_logs())
    (state, try_number), = _query(airflow.meta, """
        SELECT state, try_number FROM task_instance
        WHERE dag_id = %s AND run_id = %s AND task_id = 'process'""", (DAG_ID, run_id))
    assert (state, try_number) == ("success", 2)
    other, = set(Airflow.WORKERS) - {worker}
    assert airflow.ran_on(run_id, "process", 2) == [other]
    check_exact(deployment, txids_before + RUNS)
    commits = commit_lines(deployment)
    assert sorted(commits) == list(range(1, txids_before + RUNS + 1))
    assert all(len(w) == 1 for w in commits.values()), commits
    assert commits[txid] == [other]  # after the kill, the other worker did the rest


@pytest.mark.timeout(600)
def test_a_run_whose_workers_do_not_see_the_folder_fails_saying_so(deployment):
    """The landing folder gone from the workers (moved away: on one machine, what an unmounted
    share looks like): the run fails at its begin, on a Celery worker, with the rule in its
    task log; nothing is planned. Back in place, nothing was lost."""
    airflow, landing = deployment.airflow, deployment.landing
    txids_before = len(_query(deployment.coordinator, "SELECT 1 FROM transactions"))
    away = landing.with_name("unmounted")
    landing.rename(away)
    try:
        run = "celery_c_0"
        airflow.trigger([run])
        states = airflow.wait([run], time.monotonic() + RUNS_S)
    finally:
        away.rename(landing)
    assert states == {run: "failed"}
    (state, tries), = _query(airflow.meta, """SELECT state, try_number FROM task_instance
                                             WHERE dag_id = %s AND run_id = %s
                                               AND task_id = 'begin'""", (DAG_ID, run))
    assert (state, tries) == ("failed", 1)  # a configuration error: not retried
    worker, = airflow.ran_on(run, "begin", 1)
    log = next(airflow.home(worker).glob(
        f"logs/dag_id={DAG_ID}/run_id={run}/task_id=begin/attempt=1.log")).read_text()
    assert f"source.path='{landing}': the folder '{landing}' is not visible here (host " in log
    assert "every Airflow worker and Spark executor must see the same folder (see " \
           "docs/deployment.md)" in log
    assert len(_query(deployment.coordinator, "SELECT 1 FROM transactions")) == txids_before
    if deployment.records:  # the earlier tests' runs
        check_exact(deployment, txids_before)
