"""A local Spark Connect server: the warm Spark that processing tasks use in local mode.

A JVM and a SparkSession take seconds to start, a spark-submit of each batch more; a Spark
Connect client is a fraction of that (docs/deployment.md). So in local mode onceflow starts one
long-lived Connect server (``onceflow spark start``, idempotent; ``status``, ``stop``) and the
processing tasks are its clients, through an Airflow connection of type ``spark_connect``
(``spark-connect://127.0.0.1:15002``). A cluster user points that connection at their own
Connect server, or keeps a ``spark`` connection to submit to a master.

The server runs this interpreter as its Python workers, so every package installed here
(onceflow, the user's pipelines) is importable there; a pipeline reached only by reference is
shipped by value with the functions Spark sends (onceflow.spark.session.ship_code). Its pid,
log and the settings it was started with live in ``$ONCEFLOW_HOME/.run/spark-connect/``.

A server onceflow started is its to keep running: when it died (killed, crashed, out of
memory), the next processing task, or the retry of the one it failed, starts it again with
the same settings before it connects (``revive``). ``stop`` ends that: a server stopped on
purpose is not started again.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from onceflow.core import settings
from onceflow.core.errors import ConfigError, Unreachable
from onceflow.sources.jvm import jvm_conf
from onceflow.spark.conf import processing_conf

DEFAULT_PORT = settings.get("spark_connect_port")
SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
# The server JVM's options. A long-lived server runs many planner paths only a few times per
# batch; raised JIT thresholds leave them interpreted while the batches' hot loops still
# compile. The parallel collector suits a batch's throughput work better than G1's barriers.
SERVER_JAVA_OPTIONS = "-XX:CompileThresholdScaling=10 -XX:+UseParallelGC"


@dataclass(frozen=True)
class ServerStatus:
    running: bool
    pid: int | None
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"sc://127.0.0.1:{self.port}"

    def line(self) -> str:
        if self.running:
            return f"Spark Connect server running at {self.url} (pid {self.pid}, log {self.log})"
        return f"Spark Connect server not running (would listen at {self.url}; log {self.log})"


def _dir(folder: Path | None = None) -> Path:
    if folder is not None:
        return Path(folder)
    # ONCEFLOW_HOME (run.sh: the checkout), else the current directory
    return Path(settings.get("home") or Path.cwd()) / ".run" / "spark-connect"


def _answers(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout):
            return True
    except OSError:
        return False


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:  # a server this process started and that has exited: reaped here, or it would
        # stay a zombie that signal 0 still finds (and stop() would wait its whole wait_s)
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:  # not this process's child: another one reaps it
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie of another process (the one that started the server, not reaping it yet)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return True


def status(port: int = DEFAULT_PORT, *, folder: Path | None = None) -> ServerStatus:
    folder = _dir(folder)
    pid_file = folder / f"server-{port}.pid"
    pid = int(pid_file.read_text()) if pid_file.exists() else None
    running = _alive(pid) and _answers(port)
    return ServerStatus(running, pid if _alive(pid) else None, port, folder / f"server-{port}.log")


def start(port: int = DEFAULT_PORT, *, master: str | None = None, wait_s: float = 90,
          driver_memory: str | None = None, folder: Path | None = None,
          warm: bool = False) -> ServerStatus:
    """Start the server unless it runs; wait until it answers. Idempotent, also across
    processes (one starts it, the others wait for it). ``folder``: where its pid and log go
    (default $ONCEFLOW_HOME/.run/spark-connect). ``warm``: once it answers, warm it up in the
    background (onceflow.spark.warm_up, in a process of its own whose output goes to the
    server's log)."""
    with _starting(_dir(folder), port):
        return launch(port, master=master, driver_memory=driver_memory, folder=folder,
                      warm=warm).ready(wait_s)


@contextmanager
def _starting(folder: Path, port: int):
    """An exclusive lock on starting the server of ``port``: two tasks that find it gone
    start one server, not two on one port."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"server-{port}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def revive(url: str, *, wait_s: float = 90) -> ServerStatus | None:
    """Start again the local server at ``url`` if onceflow started it there and it died:
    its pid file is still in the run folder (``stop`` removes it) and that process is gone.
    Same port, folder and settings as it was started with. Returns its status when it was
    started again; None when there is nothing to do (not local, not onceflow's, stopped on
    purpose, or running: a process that is alive but does not answer is left alone)."""

    where = urlparse(url.replace("sc://", "http://", 1))
    if where.hostname not in ("127.0.0.1", "localhost") or where.port is None:
        return None
    folder, port = _dir(None), where.port
    with _starting(folder, port):
        pid_file = folder / f"server-{port}.pid"
        pid = pid_file.read_text().strip() if pid_file.exists() else ""
        if not pid.isdigit() or _alive(int(pid)):
            return None
        settings_file = folder / f"server-{port}.json"
        settings = json.loads(settings_file.read_text()) if settings_file.exists() else {}
        return launch(port, master=settings.get("master"),
                      driver_memory=settings.get("driver_memory"), folder=folder).ready(wait_s)


@dataclass
class Launch:
    """A server being started (``launch``): ``ready()`` waits until it answers. The JVM takes
    seconds to start, time in which its caller can do work of its own (the demo builds its
    Airflow meanwhile)."""

    port: int
    folder: Path
    warm: bool
    proc: subprocess.Popen | None = None  # None: it was running already

    def ready(self, wait_s: float = 90) -> ServerStatus:
        """The server's status once it answers (then its warm-up starts, with ``warm``);
        Unreachable with its log's end if it does not within ``wait_s``."""
        if self.proc is None:
            return status(self.port, folder=self.folder)
        proc, self.proc = self.proc, None
        log = self.folder / f"server-{self.port}.log"
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if _answers(self.port):
                if self.warm:
                    with open(log, "ab") as out:
                        subprocess.Popen(
                            [sys.executable, "-m", "onceflow.spark.warm_up",
                             f"sc://127.0.0.1:{self.port}"], stdout=out,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env=_own_env())
                return status(self.port, folder=self.folder)
            if proc.poll() is not None:
                break
            time.sleep(0.3)
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        proc.kill()
        raise Unreachable(f"the Spark Connect server did not start on port {self.port} "
                          f"within {wait_s:.0f}s; its log ({log}) ends:\n{tail}")


def _own_env() -> dict[str, str]:
    """This environment without a Spark Connect client's markers (set while this process
    holds a Connect session): a server or a warm-up started from here must not inherit them."""
    return {k: v for k, v in os.environ.items()
            if k not in ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED")}


def launch(port: int = DEFAULT_PORT, *, master: str | None = None,
           driver_memory: str | None = None, folder: Path | None = None,
           warm: bool = False) -> Launch:
    """Start the server unless it runs, without waiting for it (see ``start``)."""
    folder = _dir(folder)
    if status(port, folder=folder).running:
        return Launch(port, folder, warm)
    if _answers(port):
        raise ConfigError(f"port {port} is taken by another program: set "
                          "ONCEFLOW_SPARK_CONNECT_PORT to a free port")
    # imported here: pyspark loads with it: only where Spark is used
    from onceflow.spark.session import require_java
    from onceflow.spark.versions import check_pyspark_pair

    check_pyspark_pair()
    require_java()
    folder.mkdir(parents=True, exist_ok=True)
    submit = Path(sys.executable).with_name("spark-submit")
    conf = {
        "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.connect.grpc.binding.port": str(port),
        **processing_conf(),
        "spark.ui.enabled": "false",
        "spark.driver.memory": driver_memory or settings.get("driver_memory"),
        # a long-lived driver: small memory pages and a regular GC free finished batches'
        # broadcasts (see onceflow.spark.session), and forgotten client sessions expire
        "spark.buffer.pageSize": "4m",
        "spark.cleaner.periodicGC.interval": "1min",
        "spark.connect.session.manager.defaultSessionTimeout": "15min",
        "spark.driver.extraJavaOptions": SERVER_JAVA_OPTIONS,
        **jvm_conf(),  # onceflow's JVM reader (onceflow.sources.jvm), when it serves this Spark
    }
    cmd = [str(submit) if submit.exists() else "spark-submit", "--class", SERVER_CLASS,
           "--name", "onceflow-spark-connect",
           "--master", master or settings.get("spark_master"),
           *[arg for k, v in conf.items() for arg in ("--conf", f"{k}={v}")]]
    env = {**_own_env(), "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable),
           "SPARK_LOG_DIR": str(folder)}
    with open(folder / f"server-{port}.log", "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, stdin=subprocess.DEVNULL)
    (folder / f"server-{port}.pid").write_text(str(proc.pid))
    # what revive() starts it again with
    (folder / f"server-{port}.json").write_text(json.dumps(
        {"master": master, "driver_memory": driver_memory}))
    return Launch(port, folder, warm, proc)


def stop(port: int = DEFAULT_PORT, wait_s: float = 30, *, folder: Path | None = None) -> bool:
    """Stop the server (SIGTERM, then SIGKILL). Returns whether one was running."""
    current = status(port, folder=folder)
    if current.pid is None:
        return False
    try:
        os.killpg(current.pid, signal.SIGTERM)
    except OSError:
        os.kill(current.pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while _alive(current.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _alive(current.pid):
        os.killpg(current.pid, signal.SIGKILL)
    (_dir(folder) / f"server-{port}.pid").unlink(missing_ok=True)
    return True
