"""A real Spark standalone cluster on this machine, end to end: a Master and one Worker (their
own JVMs, started the way a cluster's machines start them: ``spark-class
org.apache.spark.deploy.master.Master`` / ``...deploy.worker.Worker spark://host:port``; the
pip package has no sbin scripts), then the outside pipeline (tests/outside/pageviews, reached
by reference only) through its Airflow DAG with the Spark connection of type ``spark`` and
host ``spark://127.0.0.1:PORT``: the process task spark-submits each batch to the cluster
(the driver here, in client mode; executors on the Worker), and ``onceflow verify`` re-runs
every committed batch on the cluster too: OK, and equal to an oracle of the test's own. A
second test puts a Spark Connect server on the cluster (its master is the cluster) and runs a
transaction through it: the warm Spark of a real deployment.

YARN and Kubernetes are the same code with another master URL in the connection, nothing
else in onceflow changes: ``{"conn_type": "spark", "host": "yarn"}`` (extras ``deploy-mode``,
``queue``) or ``{"conn_type": "spark", "host": "k8s://https://API:6443"}`` (extras
``deploy-mode``, ``namespace``; the image in the operator's ``conf``). What a cluster needs is
what this one needs: Python with onceflow and pyarrow where executors run (the user's package
is shipped by value with the functions Spark sends), PostgreSQL reachable from the driver and
the executors; with ``deploy-mode cluster`` the driver runs in the cluster too, and must import
the pipeline's declaration there (install the user's package in the image).

Kept fast for CI: one Worker with 2 cores, one transaction per path (one spark-submit
application, one verify application, one Connect server), the JVMs stopped at the end.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import pytest
from test_outside_pipeline import oracle, payloads

from helpers import (
    outside_pipeline,
    table,
)

REF = "pageviews.pipelines:PAGE_VIEWS"
SPARK_CLASS = Path(sys.executable).with_name("spark-class")


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (each held until all are chosen: the daemons bind them
    later, so two picks one after the other could return the same port)."""
    held = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            held.append(s)
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


class Cluster:
    """A Spark standalone Master and ``workers`` Workers (``cores`` and ``memory`` each) on
    127.0.0.1, each a process group of its own."""

    def __init__(self, folder: Path, *, workers: int = 1, cores: int = 2, memory: str = "2g"):
        self.folder = folder
        self.workers, self.cores, self.memory = workers, cores, memory
        self.port, self.ui_port, *self.worker_ports = free_ports(2 + 2 * workers)
        self.procs: list[subprocess.Popen] = []
        self.env = {
            **os.environ,
            "SPARK_LOG_DIR": str(folder / "logs"), "SPARK_PID_DIR": str(folder / "pids"),
            "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable,
            "SPARK_WORKER_DIR": str(folder / "work"),
        }
        for sub in ("logs", "pids", "work"):
            (folder / sub).mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def _start(self, name: str, *args: str) -> None:
        log = open(self.folder / "logs" / f"{name}.out", "ab")  # the daemon keeps it
        proc = subprocess.Popen([str(SPARK_CLASS), *args], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=self.env, start_new_session=True)
        (self.folder / "pids" / f"{name}.pid").write_text(str(proc.pid))
        self.procs.append(proc)

    def state(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=3) as r:
            return json.load(r)

    def start(self, wait_s: float = 120) -> None:
        self._start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                    "--port", str(self.port), "--webui-port", str(self.ui_port))
        for i in range(self.workers):
            port, ui_port = self.worker_ports[2 * i:2 * i + 2]
            work = self.folder / "work" / f"worker-{i}"  # a machine's own folder
            self._start(f"worker-{i}", "org.apache.spark.deploy.worker.Worker", self.url,
                        "--host", "127.0.0.1", "--port", str(port), "--webui-port",
                        str(ui_port), "--cores", str(self.cores), "--memory", self.memory,
                        "--work-dir", str(work))
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"a Spark daemon exited ({proc.args[1]}):\n{self.logs()}")
            try:
                if self.state().get("aliveworkers", 0) >= self.workers:
                    return
            except (OSError, ValueError):  # not up yet, or not the master's page yet
                pass
            time.sleep(0.3)
        raise RuntimeError(f"the cluster had not {self.workers} alive worker(s) within "
                           f"{wait_s:.0f}s:\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted((self.folder / "logs").glob("*.out")))

    def apps(self) -> list[str]:
        state = self.state()
        return [a["name"] for a in state.get("activeapps", []) + state.get("completedapps", [])]

    def stop(self) -> None:
        for proc in reversed(self.procs):  # the worker (and its executors) first
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    running = Cluster(tmp_path_factory.mktemp("spark-cluster"))
    try:
        running.start()
        yield running
    finally:
        running.stop()


@pytest.fixture
def pageviews(monkeypatch, dsn, conn):
    """The outside pipeline, reachable the way a user makes it so, registered."""
    monkeypatch.setenv("SPARK_LOCAL_IP", "127.0.0.1")  # the driver, where executors call back
    monkeypatch.setenv("ONCEFLOW_RETRY_DELAY_SECONDS", "1")
    with outside_pipeline(monkeypatch, REF, conn) as pipeline:
        yield pipeline


def spark_connection(master: str) -> str:
    """The Airflow connection spark_default of a Spark master (spark-submit per batch)."""
    return json.dumps({"conn_type": "spark", "host": master})


@pytest.mark.timeout(420)
def test_a_pipeline_through_its_dag_on_a_standalone_cluster(cluster, pageviews, conn, dsn,
                                                            airflow_db, monkeypatch):
    from onceflow.airflow import transaction_dag

    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", spark_connection(cluster.url))
    records = payloads(500, seed=11)
    pageviews.source.append(conn, records)

    dag = transaction_dag(pageviews)
    dr = dag.test(logical_date=datetime.now(UTC).replace(microsecond=0),
                  run_conf={"batch_size": 1000})  # one transaction: one application
    assert str(dr.state) == "success", cluster.logs()
    assert table(conn, "SELECT txid, state, records FROM transactions") == [
        (1, "committed", 500)]
    # it ran on the cluster: the Master saw the application
    assert any(name.startswith("onceflow-page_views") for name in cluster.apps()), \
        cluster.apps()

    countries, pages, rejected, failing = oracle(records)
    assert dict(table(conn, "SELECT key, value FROM views_per_country")) == dict(countries)
    assert dict(table(conn, "SELECT key, value FROM views_per_page")) == dict(pages)
    assert table(conn, "SELECT count(*) FROM rejected_records") == [(rejected,)]
    assert table(conn, "SELECT count(*) FROM backflow_items")[0][0] == failing > 0

    # verify re-runs the committed batch with a session on the cluster too
    before = len(cluster.apps())
    verified = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "verify", "--pipeline", "page_views"],
        env={**os.environ, "ONCEFLOW_SPARK_MASTER": cluster.url, "ONCEFLOW_DRIVER_MEMORY": "1g"},
        capture_output=True, text=True, timeout=300)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "verify page_views (re-run): OK: 1 committed txids re-run" in verified.stdout
    assert len(cluster.apps()) == before + 1


@pytest.mark.timeout(420)
def test_a_spark_connect_server_on_the_cluster(cluster, pageviews, conn, dsn, airflow_db,
                                               monkeypatch, tmp_path):
    """The warm Spark of a deployment: a Connect server whose master is the cluster; the
    process task is its client, the user's code shipped by value to the cluster's executors."""
    from onceflow.airflow import transaction_dag
    from onceflow.dev.localenv import spark_connection as connect_connection
    from onceflow.spark import localspark

    port, = free_ports(1)
    folder = tmp_path / "connect"
    localspark.start(port, master=cluster.url, driver_memory="1g", folder=folder)
    try:
        assert "onceflow-spark-connect" in [a["name"] for a in cluster.state()["activeapps"]]
        monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", connect_connection(port))
        records = payloads(300, seed=12)
        pageviews.source.append(conn, records)
        dr = transaction_dag(pageviews).test(
            logical_date=datetime.now(UTC).replace(microsecond=0), run_conf={"batch_size": 1000})
        assert str(dr.state) == "success", (folder / f"server-{port}.log").read_text()[-3000:]
    finally:
        localspark.stop(port, folder=folder)
    countries, pages, _, failing = oracle(records)
    assert table(conn, "SELECT txid, state FROM transactions") == [(1, "committed")]
    assert dict(table(conn, "SELECT key, value FROM views_per_country")) == dict(countries)
    assert dict(table(conn, "SELECT key, value FROM views_per_page")) == dict(pages)
    assert table(conn, "SELECT count(*) FROM backflow_items")[0][0] == failing
