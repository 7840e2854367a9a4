"""onceflow through a real Airflow (bench/compare.py's ``airflow`` systems): an API server, a
scheduler, a DAG processor and a triggerer (Airflow's stock LocalExecutor, a PostgreSQL
metadata database of their own), the project's DAG file, processing on the warm Spark (Spark
Connect). A pipeline's runs are triggered at once; the clock runs from the trigger to the
last run's end. Several pipelines (the DAG shapes) run one after the other on one Airflow.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchkit import free_port, recreate_database

from onceflow.airflow.dag_file import TEXT as DAG_FILE
from onceflow.airflow.environment import airflow_healthy, served_airflow_env

HERE = Path(__file__).resolve().parent


def _query(dsn: str, query: str, params=()):
    import psycopg2

    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(query, params)
            return cur.fetchall()
    finally:
        conn.close()


def begin_split(dsn: str, pipeline: str) -> dict[str, float]:
    """Medians over the committed attempts of where their begins' time went (seconds
    waiting for locks, indexing new source data, planning: onceflow.core.timings)."""
    rows = _query(dsn, """SELECT a.begin_lock_s, a.begin_index_s, a.begin_plan_s
                          FROM transactions t JOIN transaction_attempts a
                            ON a.pipeline = t.pipeline AND a.txid = t.txid
                           AND a.attempt = t.attempt
                          WHERE t.pipeline = %s AND t.state = 'committed'
                            AND a.begin_plan_s IS NOT NULL""", (pipeline,))
    if not rows:
        return {}
    return {name: statistics.median(float(row[i]) for row in rows)
            for i, name in enumerate(("lock_wait", "index", "plan"))}


WARM_UP = "onceflow_bench_warm_up"
IDLE_S = 3  # seconds of idle Airflow measured before the clock starts


class _Triggerer:
    """Triggers DAG runs as `airflow dags trigger` does, from a process that imported Airflow
    before any clock starts (the import takes seconds; a user's trigger from the UI goes to an
    API server that has it loaded)."""

    CODE = (
        "import json, sys\n"
        "from airflow.api.common.trigger_dag import trigger_dag\n"
        "from airflow.utils.types import DagRunTriggeredByType\n"
        "print('onceflow-bench: ready', flush=True)\n"
        "for line in sys.stdin:\n"
        "    ask = json.loads(line)\n"
        "    try:\n"
        "        for run_id in ask['run_ids']:\n"
        "            trigger_dag(ask['dag_id'], run_id=run_id, conf=ask['conf'],\n"
        "                        triggered_by=DagRunTriggeredByType.CLI)\n"
        "    except Exception as error:\n"
        "        print(f'onceflow-bench: failed: {error!r}', flush=True)\n"
        "    else:\n"
        "        print('onceflow-bench: done', flush=True)\n"
    )

    def __init__(self, env: dict) -> None:
        self.proc = subprocess.Popen([sys.executable, "-P", "-c", self.CODE], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._answer("ready")

    def __call__(self, dag_id: str, run_ids: list[str], conf: dict | None = None) -> None:
        """Trigger one run of ``dag_id`` per run id, at once."""
        self.proc.stdin.write(json.dumps({"dag_id": dag_id, "run_ids": run_ids,
                                          "conf": conf or {}}) + "\n")
        self.proc.stdin.flush()
        self._answer("done")

    def _answer(self, want: str) -> None:
        """Wait for the process's answer (its other output, Airflow's logging, is passed on)."""
        for line in self.proc.stdout:
            if not line.startswith("onceflow-bench: "):
                print(line, end="", flush=True)
                continue
            answer = line.removeprefix("onceflow-bench: ").strip()
            if answer != want:
                raise RuntimeError(f"the trigger process answered {answer!r}")
            return
        raise RuntimeError("the trigger process ended (its output is above)")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _wait_for_runs(meta: str, dag_id: str, runs: int, deadline: float, logs: Path) -> dict:
    """Wait until ``runs`` runs of ``dag_id`` ended; their count by state."""
    while True:
        done = dict(_query(meta, "SELECT state, count(*) FROM dag_run WHERE dag_id = %s "
                                 "GROUP BY state", (dag_id,)))
        if sum(done.get(s, 0) for s in ("success", "failed")) >= runs:
            return done
        if time.monotonic() > deadline:
            raise TimeoutError(f"{dag_id}: runs not done: {done} (logs in {logs})")
        time.sleep(0.1)  # the clock stops within 0.1 s of the last run's end


def _cpu_parts(pid: int) -> tuple[float, float]:
    """CPU seconds of a process itself, and of its ended children (waited for) and its live
    descendants (a lower bound: a descendant that ended unwaited for, such as a Spark Python
    worker whose daemon did not reap it, takes its CPU with it)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        t = proc.cpu_times()
        rest = t.children_user + t.children_system
        for child in proc.children(recursive=True):
            try:
                c = child.cpu_times()
                rest += c.user + c.system + c.children_user + c.children_system
            except psutil.Error:
                pass
        return t.user + t.system, rest
    except psutil.Error:
        return 0.0, 0.0


def _cpu_s(pid: int) -> float:
    """CPU seconds of a process and its descendants (see _cpu_parts)."""
    return sum(_cpu_parts(pid))


# The scheduler's descendants are the LocalExecutor's worker processes, the task processes
# they run and the log server it starts: reported apart from the scheduler's own loop.
TASK_RUNS = "task runs (executor workers)"


def component_cpu(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each component's process tree, the scheduler's split in two:
    the scheduler itself, and the task runs (TASK_RUNS)."""
    out = {}
    for name, pid in pids.items():
        if name == "scheduler":
            out[name], out[TASK_RUNS] = _cpu_parts(pid)
        else:
            out[name] = _cpu_s(pid)
    return out


def machine_cpu_s() -> float:
    """The machine's busy CPU seconds so far (every core, every process)."""
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) \
        - getattr(t, "guest_nice", 0.0)


def _spark_server_pid(spark_url: str) -> int | None:
    """The pid of the process listening on the Spark Connect URL's port."""
    import psutil

    port = int(spark_url.rsplit(":", 1)[1].split("/")[0])
    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
            return conn.pid
    return None


def _idle_workers(scheduler_pid: int) -> int:
    """How many of the LocalExecutor's worker processes under the scheduler wait for work
    (Airflow titles an idle one ``... LocalExecutor: <idle>``)."""
    import psutil

    idle = 0
    try:
        workers = psutil.Process(scheduler_pid).children(recursive=True)
    except psutil.Error:
        return 0
    for worker in workers:
        try:
            title = " ".join(worker.cmdline())
        except psutil.Error:
            continue
        idle += "LocalExecutor: <idle>" in title
    return idle


def _write_timeline(path: Path, meta: str, dsn: str, dag_id: str, pipeline: str,
                    started: float) -> None:
    """Every task instance's queued, start and end time and every transaction's planned and
    committed time and its begin's split (lock wait, index, plan seconds), in seconds from
    the first trigger, as JSON (where the Airflow path's time goes)."""
    zero = time.time() - (time.monotonic() - started)
    tasks = _query(meta, """SELECT run_id, task_id, map_index, try_number, state,
                                   extract(epoch FROM queued_dttm), extract(epoch FROM start_date),
                                   extract(epoch FROM end_date)
                            FROM task_instance WHERE dag_id = %s ORDER BY start_date""",
                   (dag_id,))
    txs = _query(dsn, """SELECT t.txid, extract(epoch FROM t.planned_at),
                                extract(epoch FROM t.committed_at), a.begin_lock_s,
                                a.begin_index_s, a.begin_plan_s
                         FROM transactions t LEFT JOIN transaction_attempts a
                           ON a.pipeline = t.pipeline AND a.txid = t.txid
                          AND a.attempt = t.attempt
                         WHERE t.pipeline = %s ORDER BY t.txid""", (pipeline,))

    def rel(t):
        return None if t is None else round(float(t) - zero, 3)

    Path(path).write_text(json.dumps({
        "tasks": [{"run": r, "task": t, "map_index": m, "try": n, "state": st,
                   "queued": rel(q), "start": rel(s), "end": rel(e)}
                  for r, t, m, n, st, q, s, e in tasks],
        "transactions": [{"txid": x, "planned": rel(p), "committed": rel(c),
                          "begin": {"lock_wait": lock, "index": index, "plan": plan}}
                         for x, p, c, lock, index, plan in txs]}, indent=1))
    print(f"timeline written to {path}", flush=True)


def overhead(meta: str, dsn: str, dag_id: str, pipeline: str, triggered: float,
             first: int) -> dict:
    """A transaction's overhead through Airflow, from the transactions' and Airflow's own
    timestamps: the first trigger (``triggered``, epoch seconds) to the first txid
    planned, and per run of the first wave (the ``first`` lowest txids: those that plan
    without waiting for a place under max_pending) its task's start to its txid planned,
    and what the begin itself recorded of that (lock wait, index, plan)."""
    tasks = dict(_query(meta, """SELECT run_id, min(extract(epoch FROM start_date))
                                 FROM task_instance WHERE dag_id = %s GROUP BY run_id""",
                        (dag_id,)))
    plans = _query(dsn, """SELECT a.run_id, extract(epoch FROM a.started_at), a.begin_lock_s,
                                  a.begin_index_s, a.begin_plan_s
                           FROM transaction_attempts a
                           WHERE a.pipeline = %s ORDER BY a.txid, a.attempt""", (pipeline,))
    if not plans:
        return {}
    waves = [(float(at) - float(tasks[run]), lock, index, plan)
             for run, at, lock, index, plan in plans[:first] if tasks.get(run) is not None]
    return {"trigger_to_first_plan_s": float(plans[0][1]) - triggered,
            "start_to_plan_s": [round(w[0], 3) for w in waves],
            "begin_lock_s": [w[1] for w in waves], "begin_index_s": [w[2] for w in waves],
            "begin_plan_s": [w[3] for w in waves]}


def run_airflow(dsn: str, server: str, spark_url: str, folder: Path, pipelines: list[str],
                batch_size: int, runs: int, timeline: Path | None = None) -> dict[str, dict]:
    """``runs`` transactions of each of ``pipelines`` (one after the other, on one Airflow),
    all of a pipeline's triggered at once; per pipeline its wall seconds, runs by state,
    task medians and CPU seconds per component. ``timeline``: a JSON file per pipeline
    (``<stem>-<pipeline>.json``) of every task's and transaction's times."""
    from onceflow.core.db import connection
    from onceflow.core.registration import register
    from onceflow.core.registry import get_pipeline

    with connection(dsn) as conn:  # what `onceflow init` does on a user's machine
        for pipeline in pipelines:
            register(conn, get_pipeline(pipeline), create_source=True)
    from benchkit import DB

    meta = recreate_database(server, f"{DB}_airflow_meta", migrate=False)
    home = Path(tempfile.mkdtemp(prefix="onceflow-bench-airflow-"))
    dags = home / "dags"  # the project's DAG file and the warm-up DAG
    dags.mkdir()
    (dags / "onceflow_pipelines.py").write_text(DAG_FILE)  # what `onceflow dags` prints
    shutil.copy(HERE / "airflow_dags" / "bench_warm_up.py", dags)
    api_port = free_port()
    host, _, port = spark_url.removeprefix("sc://").partition(":")
    env = {
        **os.environ,
        # Airflow's stock executor (LocalExecutor), as users run it
        **served_airflow_env(
            meta_dsn=meta, api_port=api_port, dsn=dsn,
            spark=json.dumps({"conn_type": "spark_connect", "host": host, "port": int(port)}),
            log_level=os.environ.get("ONCEFLOW_BENCH_AIRFLOW_LOG", "WARNING")),
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT": "600",
        "ONCEFLOW_RETRY_DELAY_SECONDS": "5",
        # on a loaded machine the API server answers a task's calls slowly: the default
        # timeout (5 s) fails tasks before they run
        "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT": os.environ.get(
            "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT", "60"),
    }
    from onceflow.airflow import airflow_cli

    airflow = airflow_cli()
    setup = time.monotonic()
    subprocess.run([*airflow, "db", "migrate"], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    logs = home / "component-logs"
    logs.mkdir()
    procs = []
    for component in ("api-server", "scheduler", "dag-processor", "triggerer"):
        out = open(logs / f"{component}.log", "wb")  # noqa: SIM115 (closed with the process)
        procs.append(subprocess.Popen([*airflow, component], env=env, stdout=out,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    dag_ids = [f"onceflow_{pipeline}" for pipeline in pipelines]
    trigger, finished, kept = None, False, False
    try:
        deadline = time.monotonic() + 300
        while len(_query(meta, "SELECT 1 FROM dag WHERE dag_id = ANY(%s) AND NOT is_paused",
                         ([*dag_ids, WARM_UP],))) < len(dag_ids) + 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{dag_ids} never appeared (logs in {logs})")
            time.sleep(1)
        # Airflow is up before the clock starts, as it is for a user who triggers runs: the
        # components report healthy and have had a few seconds to settle after start-up.
        while not airflow_healthy(api_port):
            if time.monotonic() > deadline:
                raise TimeoutError(f"Airflow's components never reported healthy ({logs})")
            time.sleep(1)
        print(f"Airflow up in {time.monotonic() - setup:.1f}s (metadata database migrated, "
              "DAGs parsed, components healthy)", flush=True)
        trigger = _Triggerer(env)
        # and its executor's worker processes have each run a task (see bench_warm_up.py)
        warming = time.monotonic()
        trigger(WARM_UP, ["warm_up"])
        if _wait_for_runs(meta, WARM_UP, 1, deadline, logs).get("failed"):
            raise RuntimeError(f"the warm-up DAG {WARM_UP} failed: task logs under {home}/logs")
        # A run is done when its tasks said so; the executor's worker behind a task may still
        # be busy a few seconds more (seen: four of six warm-up tasks' workers 5 s after their
        # run ended, so that three of the measured runs' first five tasks waited 1.2 s for one)
        while _idle_workers(procs[1].pid) < int(env["AIRFLOW__CORE__PARALLELISM"]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the executor's workers never became idle ({logs})")
            time.sleep(0.1)
        print(f"Airflow's workers warmed up in {time.monotonic() - warming:.1f}s", flush=True)
        cpu_pids = {c: p.pid for c, p in zip(("api-server", "scheduler", "dag-processor",
                                              "triggerer"), procs, strict=True)}
        spark_pid = _spark_server_pid(spark_url)
        if spark_pid:
            cpu_pids["Spark Connect server"] = spark_pid
        idle_before = component_cpu(cpu_pids)
        time.sleep(IDLE_S)  # settle; what each component burns with no run in flight
        cpu_before = component_cpu(cpu_pids)
        print("CPU seconds per second, idle: " + ", ".join(
            f"{c} {(cpu_before[c] - idle_before[c]) / IDLE_S:.2f}" for c in cpu_before),
            flush=True)
        from benchkit import ProcCpu, postmaster_pid
        from psycopg2.extensions import parse_dsn

        postmaster = postmaster_pid(server)
        databases = tuple(parse_dsn(d)["dbname"] for d in (dsn, meta))
        results = {}
        for pipeline, dag_id in zip(pipelines, dag_ids, strict=True):
            cpu_before = component_cpu(cpu_pids)
            machine = machine_cpu_s()
            tracked = ProcCpu({**cpu_pids, "trigger (CLI)": trigger.proc.pid},
                              postmaster=postmaster, databases=databases,
                              descendants={"scheduler": TASK_RUNS})
            started, triggered = time.monotonic(), time.time()
            trigger(dag_id, [f"bench_{i:03d}" for i in range(runs)], {"batch_size": batch_size})
            done = _wait_for_runs(meta, dag_id, runs, time.monotonic() + 3600, logs)
            seconds = time.monotonic() - started
            machine = machine_cpu_s() - machine
            proc_cpu = tracked.stop()
            if done.get("failed"):
                kept = True
                print(f"{done['failed']} Airflow run(s) of {dag_id} failed: task logs under "
                      f"{home}/logs", file=sys.stderr)
            # a descendant alive before that ended unreaped takes its earlier CPU with it:
            # the difference can then fall below zero, a lower bound that 0 also is
            cpu = {c: max(0.0, v - cpu_before[c])
                   for c, v in component_cpu(cpu_pids).items()}
            durations = _query(meta, """SELECT task_id, extract(epoch FROM end_date - start_date)
                                        FROM task_instance
                                        WHERE dag_id = %s AND state = 'success'""", (dag_id,))
            per_task = {}
            for task, d in durations:
                per_task.setdefault(task, []).append(float(d))
            if timeline is not None:
                _write_timeline(timeline.with_name(f"{timeline.stem}-{pipeline}.json"), meta,
                                dsn, dag_id, pipeline, started)
            results[pipeline] = {
                "seconds": seconds, "runs": dict(done),
                "task_s": {t: statistics.median(v) for t, v in sorted(per_task.items())},
                "begin_s": begin_split(dsn, pipeline), "cpu_s": cpu, "cpu_total_s": machine,
                "proc_cpu": proc_cpu,
                "overhead": overhead(meta, dsn, dag_id, pipeline, triggered,
                                     get_pipeline(pipeline).max_pending),
                "load": Path("/proc/loadavg").read_text().split()[0]}
        finished = True
        return results
    finally:
        if trigger is not None:
            trigger.close()
        for proc in procs:
            try:
                os.killpg(proc.pid, 15)
            except OSError:
                pass
        for proc in procs:  # nothing of theirs is kept: 5 s to stop, then killed
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(timeout=30)
        if finished and not kept:  # a failure keeps the Airflow home: it names the logs there
            shutil.rmtree(home, ignore_errors=True)
