"""The warm Spark: a local Spark Connect server onceflow starts and supervises, processing
tasks as its clients. Its lifecycle from the CLI, a clear error when it is down, and a server
killed in the middle of a batch: that try fails, the retry on the restarted server commits,
nothing counted twice."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from helpers import (
    outside_pipeline,
    table,
)
from onceflow.dev.localenv import spark_connection
from onceflow.spark import localspark

RUNNER = Path(__file__).with_name("dag_runner.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_server_starts_answers_and_stops_from_the_cli(tmp_path):
    env = {**os.environ, "ONCEFLOW_HOME": str(tmp_path),
           "ONCEFLOW_SPARK_CONNECT_PORT": str(free_port())}

    def spark(action):
        return subprocess.run([sys.executable, "-m", "onceflow.cli", "spark", action],
                              env=env, capture_output=True, text=True, timeout=180)

    assert spark("status").returncode == 1
    started = spark("start")
    assert started.returncode == 0 and "Spark Connect server running at sc://" in \
        started.stdout, started.stderr
    assert spark("start").returncode == 0  # idempotent
    assert spark("status").returncode == 0
    assert spark("stop").stdout.strip() == "stopped"
    assert spark("status").returncode == 1
    jar = spark("jar")  # onceflow's JVM reader, for a Spark it does not start
    assert jar.returncode == 0 and Path(jar.stdout.strip()).is_file(), jar.stderr
    assert "--conf spark.onceflow.jvmReader=true" in jar.stderr


MIXED = """
import sys
from onceflow.core.errors import ConfigError
from onceflow.spark.session import get_spark
try:
    get_spark("mixed", master="local[1]")
except ConfigError as error:
    print("REFUSED", error)
"""


def test_a_pyspark_and_a_pyspark_client_of_two_versions_are_refused_at_start(tmp_path):
    """What pip leaves when it installs pyspark-client of one version beside pyspark of
    another: two dist-infos for one pyspark/ folder. (Here a pyspark-client 4.1.3 dist-info
    first on the path, in front of this environment's pyspark.) A local server and a session
    are refused before any Spark starts, naming both versions and the fix; exit 2."""
    from importlib import metadata

    pyspark = metadata.version("pyspark")
    info = tmp_path / "pyspark_client-4.1.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pyspark-client\n"
                                   "Version: 4.1.3\n")
    env = {**os.environ, "ONCEFLOW_HOME": str(tmp_path),
           "ONCEFLOW_SPARK_CONNECT_PORT": str(free_port()),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path),
                                                       os.environ.get("PYTHONPATH")]))}
    started = subprocess.run([sys.executable, "-m", "onceflow.cli", "spark", "start"],
                             env=env, capture_output=True, text=True, timeout=180)
    said = f"pyspark {pyspark} and pyspark-client 4.1.3 are installed together"
    assert started.returncode == 2 and said in started.stderr, started.stdout + started.stderr
    assert f"pip install --force-reinstall --no-deps pyspark=={pyspark} " \
           f"pyspark-client=={pyspark}" in started.stderr and "Traceback" not in started.stderr
    assert not list(tmp_path.rglob("server-*.pid"))  # nothing was started
    session = subprocess.run([sys.executable, "-c", MIXED], env=env, capture_output=True,
                             text=True, timeout=180)
    assert f"REFUSED {said}" in session.stdout, session.stdout + session.stderr


def test_a_server_this_process_started_is_not_taken_for_alive_once_it_exits():
    """A child that exited is a zombie until reaped, and signal 0 still finds a zombie: stop()
    of a server started in-process waited its whole 30 s for one."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while not Path(f"/proc/{child.pid}/stat").read_text().split(") ")[1].startswith("Z"):
        assert time.monotonic() < deadline, "the child never exited"
        time.sleep(0.05)
    assert localspark._alive(child.pid) is False
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert localspark._alive(running.pid) is True
    finally:
        running.kill()
        running.wait()


def test_the_client_retries_a_server_that_is_gone_for_a_bounded_time(monkeypatch):
    """PySpark's default policy waits ten minutes and more before it gives up on a server
    (the issue: a query failed 609 s after its server was killed); onceflow's client gives
    up within ONCEFLOW_SPARK_CONNECT_RETRY_S (30 s by default), a server's own retry delay
    included."""
    from pyspark.sql.connect.client.retries import DefaultPolicy

    from onceflow.core.errors import ConfigError
    from onceflow.spark.session import retry_policy, server_retry_s

    def waits_ms(policy) -> list[int]:
        state, out = policy.to_state(), []
        while (wait := state.next_attempt()) is not None:
            out.append(wait)
        return out

    assert sum(waits_ms(DefaultPolicy())) > 600_000
    assert server_retry_s() == 30
    bounded = retry_policy(server_retry_s())
    assert 20_000 < sum(waits_ms(bounded)) <= 30_000
    assert bounded.max_server_retry_delay <= 5_000
    # a client without that setting (pyspark-client 4.0's) is given only what it takes
    from onceflow.spark.session import _accepted

    def old_policy(max_retries=15, backoff_multiplier=4.0, initial_backoff=50,
                   max_backoff=60000, jitter=500, min_jitter_threshold=2000):
        return max_retries
    assert _accepted(old_policy, {"max_retries": 3, "max_server_retry_delay": 5000}) == \
        {"max_retries": 3}
    assert sum(waits_ms(retry_policy(10))) <= 10_000
    assert waits_ms(retry_policy(0)) == []
    monkeypatch.setenv("ONCEFLOW_SPARK_CONNECT_RETRY_S", "a while")
    with pytest.raises(ConfigError, match="ONCEFLOW_SPARK_CONNECT_RETRY_S='a while' is "
                                          "invalid: give a number of seconds"):
        server_retry_s()


@pytest.fixture
def pageviews(monkeypatch, dsn, conn):
    with outside_pipeline(monkeypatch, "pageviews.pipelines:PAGE_VIEWS", conn) as found:
        yield found


def run_dag(env: dict, timeout: float = 400) -> dict:
    logical = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=7)
    proc = subprocess.run([sys.executable, str(RUNNER), logical.isoformat(), "{}",
                           "onceflow_page_views"], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]) | {"log": out}


@pytest.mark.timeout(400)
def test_a_server_that_is_down_is_a_clear_error(pageviews, conn, airflow_db):
    port = free_port()  # nothing listens there
    pageviews.source.append(conn, [json.dumps({"country": "de", "page": "/"})])
    result = run_dag({"AIRFLOW_CONN_SPARK_DEFAULT": spark_connection(port),
                      "ONCEFLOW_RETRY_DELAY_SECONDS": "1"})
    assert result["state"] == "failed"
    assert f"the Spark Connect server at sc://127.0.0.1:{port} does not answer" in \
        result["log"]
    assert "onceflow spark start" in result["log"]
    assert table(conn, "SELECT state FROM transactions") == [("failed",)]


@pytest.mark.timeout(600)
def test_a_server_killed_in_the_middle_of_a_batch(pageviews, conn, airflow_db, tmp_path):
    """The JVM of the server onceflow started is killed (SIGKILL, by its pid) while a batch is
    in its hands. The try fails within the client's retry bound, saying the server is gone
    (not PySpark's ten minutes of retries); its retry starts the server again (onceflow owns
    it: its pid file is in the run folder) and commits the batch, counted once."""
    port = free_port()
    home = tmp_path / "home"  # ONCEFLOW_HOME of the runs: where they find the server's files
    folder = home / ".run" / "spark-connect"
    # launched without waiting (as the demo does while it sets up Airflow): its JVM cannot
    # answer yet; ready() waits until it does
    launched = localspark.launch(port, driver_memory="1g", folder=folder)
    assert not localspark.status(port, folder=folder).running
    assert launched.ready().running
    assert launched.ready().running  # again: the status, no second wait or warm-up
    import psutil  # its JVM runs with onceflow's options (JIT thresholds, GC)

    first = localspark.status(port, folder=folder).pid
    server = psutil.Process(first)
    jvm = next(p for p in [server, *server.children(recursive=True)] if p.name() == "java")
    assert set(localspark.SERVER_JAVA_OPTIONS.split()) <= set(jvm.cmdline())
    release = tmp_path / "release"
    views = [json.dumps({"country": c, "page": "/p"}) for c in ("de", "fr", "de")] + [
        json.dumps({"country": "hold", "page": str(release)})]
    pageviews.source.append(conn, views)
    proc = subprocess.Popen(
        [sys.executable, str(RUNNER),
         (datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=9)).isoformat(), "{}",
         "onceflow_page_views"],
        env={**os.environ, "AIRFLOW_CONN_SPARK_DEFAULT": spark_connection(port),
             "ONCEFLOW_HOME": str(home), "ONCEFLOW_RETRY_DELAY_SECONDS": "1",
             "ONCEFLOW_SPARK_CONNECT_RETRY_S": "10"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend(
        (time.monotonic(), line) for line in proc.stdout), daemon=True)
    reader.start()
    gone = f"the Spark server at 127.0.0.1:{port} is gone"
    try:
        deadline = time.monotonic() + 240
        while not Path(str(release) + ".reached").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "never in the batch"
            time.sleep(0.2)
        os.kill(jvm.pid, signal.SIGKILL)  # the server's JVM dies with a batch in its hands
        killed = time.monotonic()
        release.touch()  # the batch's Python worker, left without its JVM, may end
        proc.wait(timeout=400)
        reader.join(timeout=10)
    finally:
        proc.kill()
        localspark.stop(port, folder=folder)
        try:  # what is left of the killed server's process group (its Python workers)
            os.killpg(first, signal.SIGKILL)
        except ProcessLookupError:
            pass
    out = "".join(line for _, line in lines)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["state"] == "success", out[-3000:]
    assert result["tries"]["process[0]"] == 2
    failed_at = next(at for at, line in lines if gone in line)
    assert failed_at - killed < 60, "the try failed within the bound, not after minutes"
    assert "the client gave up after 10s of retries" in out
    assert "was gone: started it again" in out  # by the retry, before it connected
    assert dict(table(conn, "SELECT key, value FROM views_per_country")) == {
        "DE": 2, "FR": 1, "HOLD": 1}  # what was produced, each view counted once
    assert table(conn, "SELECT txid, attempt, state FROM transactions") == [
        (1, 1, "committed")]


def _worker_pids(spark) -> set[int]:
    def pids(batches):
        import os

        import pyarrow as pa

        for _ in batches:
            yield pa.RecordBatch.from_pydict({"pid": [os.getpid()]})

    return {row["pid"] for row in spark.range(2, numPartitions=1)
            .mapInArrow(pids, "pid long").collect()}


def _process_clock_now() -> float:
    """Now, on the clock psutil gives process start times by (the boot time in whole seconds
    plus clock ticks): comparing those with time.time() could be off by up to a second."""
    import psutil

    marker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        return psutil.Process(marker.pid).create_time()
    finally:
        marker.kill()
        marker.wait()


@pytest.mark.timeout(300)
def test_processing_tasks_share_one_warmed_up_session_and_its_python_workers(tmp_path):
    """`onceflow spark start` warms the server up in the background: the session processing
    tasks share already has its Python workers when the first task joins it, and the next
    task finds the same ones. A session of its own starts new workers; a shared session the
    server closed (an idle timeout) is replaced by a session of the task's own."""
    import psutil
    from pyspark.sql import SparkSession

    from onceflow.spark.session import (
        SHARED_SESSION_KEY,
        SHARED_SESSION_PERIOD_S,
        connect_session,
        retry_policy,
        server_retry_s,
        shared_session_id,
    )

    key = SHARED_SESSION_KEY
    port = free_port()
    folder = tmp_path / "server"
    url = localspark.start(port, driver_memory="1g", folder=folder, warm=True).url
    warmed_id = shared_session_id(key)
    log = folder / f"server-{port}.log"
    try:
        deadline = time.monotonic() + 180
        while "warmed up in" not in log.read_text(errors="replace"):
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.5)
        # the warm-up read through onceflow's JVM readers (a batch's first read is not cold)
        assert "warm-up: onceflow's JVM readers read" in log.read_text(errors="replace")
        def started(pids: set[int]) -> list[float]:
            return [psutil.Process(pid).create_time() for pid in pids]

        joined_at = _process_clock_now()
        with connect_session(url, "first", shared=key) as spark:
            assert spark.session_id == shared_session_id(key)
            # the bounded retry policy, set before the session's first call
            assert [p.max_retries for p in spark.client.get_retry_policies()] == [
                retry_policy(server_retry_s()).max_retries]
            spark.range(3).createOrReplaceTempView("left_by_the_first")
            first = _worker_pids(spark)
        with connect_session(url, "second", shared=key) as spark:
            assert spark.range(0).sparkSession.table("left_by_the_first").count() == 3
            second = _worker_pids(spark)
        # both tasks ran on Python workers the warm-up had started before either joined
        if shared_session_id(key) == warmed_id:  # (not across a period's end)
            assert max(started(first | second)) < joined_at
        own_at = _process_clock_now()
        with connect_session(url, "own") as spark:  # a session of its own: a new worker
            own = spark.session_id
            assert own != shared_session_id(key)
            mine = _worker_pids(spark)
        assert mine.isdisjoint(first | second) and min(started(mine)) > own_at
        # the server closed the shared session (an idle timeout): a task takes its own
        closing = SparkSession.builder.remote(
            f"{url}/;session_id={shared_session_id(key)}").create()
        closing.stop()
        with connect_session(url, "after", shared=key) as spark:
            assert spark.session_id != shared_session_id(key)
            assert spark.range(5).count() == 5
    finally:
        localspark.stop(port, folder=folder)
    period = SHARED_SESSION_PERIOD_S
    assert shared_session_id("views", now=0) == shared_session_id("views", now=period - 1)
    assert shared_session_id("views", now=0) != shared_session_id("views", now=period)
    assert shared_session_id("views", now=0) != shared_session_id("clicks", now=0)


def test_the_local_server_reads_json_lines_in_its_jvm(spark_connect_server, conn, dsn,
                                                      tmp_path):
    """The server onceflow starts has onceflow's jar and settings: a Connect client's
    landing-folder read is done by the JVM reader there, with the rows the rules give."""
    from onceflow.core.planner import PartitionRange
    from onceflow.sources.jvm import jvm_reader
    from onceflow.sources.landing import LandingFolder
    from onceflow.spark.session import connect_session

    folder = tmp_path / "lines"
    folder.mkdir()
    source = LandingFolder(topic="connect_lines", path=str(folder), chunk_bytes=256,
                           settle_s=0.0, json_schema="s string, i int")
    source.ensure(conn, create=True)
    path = folder / "a.jsonl"
    path.write_bytes(b'{"s": "a", "i": 1}\nnot json\n{"i": 2}\r\n{"s": "\\u00e9"}\n')
    os.utime(path, (time.time() - 5, time.time() - 5))
    with conn, conn.cursor() as cur:
        source.positions(cur)
    with ExitStack() as stack:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no setting the session cannot take (a static one)
            remote = stack.enter_context(
                connect_session(f"sc://127.0.0.1:{spark_connect_server}", "jvm-reader"))
        assert jvm_reader(remote)
        # planned without PySpark's DataFrame debugging (onceflow.spark.conf), the server's
        assert remote.conf.get("spark.python.sql.dataFrameDebugging.enabled") == "false"
        rows = [tuple(r) for r in source.read(remote, dsn, [PartitionRange(0, 0, 4)])
                .orderBy("offset").collect()]
    assert rows == [(0, 0, "a", 1, None, None), (0, 1, None, None, "not json", None),
                    (0, 2, None, 2, None, None), (0, 3, "\u00e9", None, None, None)]
