"""One way to get a SparkSession for every place the processing phase runs.

- under spark-submit: the master and resources come from spark-submit; nothing is overridden;
- as a Spark Connect client: SPARK_REMOTE (e.g. sc://127.0.0.1:15002) is used when set, and
  ``connect_session`` gives a task a session of its own or the one processing tasks share;
- directly (tests, benchmarks, the CLI): local mode, ``ONCEFLOW_SPARK_MASTER`` or local[2].
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from contextlib import contextmanager

from pyspark.sql import SparkSession

from spark_tasks.conf import processing_conf
from spark_tasks.jvm import jvm_conf


def require_java() -> None:
    """Spark in this process needs a JVM: a clear error instead of Spark's own."""
    if os.environ.get("JAVA_HOME") or shutil.which("java"):
        return
    from onceflow.core.errors import ConfigError

    raise ConfigError("Java is missing: Spark needs a JDK 17 here (Debian: apt-get install "
                      "openjdk-17-jdk-headless), or set SPARK_REMOTE to a Spark Connect server")


def get_spark(app_name: str = "onceflow", master: str | None = None) -> SparkSession:
    # Python workers must run the interpreter that has onceflow and pyarrow installed.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    remote = os.environ.get("SPARK_REMOTE")
    if remote and master is None:
        return builder.remote(remote).getOrCreate()
    require_java()
    master = master or os.environ.get("ONCEFLOW_SPARK_MASTER")
    if master:
        builder = builder.master(master)
    elif not _under_spark_submit():
        builder = builder.master("local[2]")
    if not _under_spark_submit():
        # Local mode runs in this JVM: its default 1g is short for long test runs and 1M-row
        # batches with broadcast joins (the acker's failed roots).
        builder = builder.config("spark.driver.memory",
                                 os.environ.get("ONCEFLOW_DRIVER_MEMORY", "2g"))
        # A long-lived session (tests, benchmarks, the CLI) runs many batches in one JVM. Every
        # broadcast hash join builds its relation in at least one memory page (64 MB with a 2g
        # driver) even for a few failed roots, and the finished batches' broadcasts are freed
        # only after a GC lets Spark's ContextCleaner drop them: smaller pages and a regular
        # GC keep them from filling the heap (measured: 617 -> 167 MB of long arrays after
        # 15 first-seen batches; a suite run had died of "Not enough memory to build and
        # broadcast the table").
        builder = (builder.config("spark.buffer.pageSize", "4m")
                   .config("spark.cleaner.periodicGC.interval", "1min")
                   .config("spark.ui.enabled", "false"))
        for key, value in jvm_conf().items():  # onceflow's JVM reader (spark_tasks.jvm)
            builder = builder.config(key, value)
    for key, value in processing_conf().items():
        builder = builder.config(key, value)
    return builder.config("spark.ui.showConsoleProgress", "false").getOrCreate()


def _under_spark_submit() -> bool:
    # spark-submit starts the Python driver with a JVM already running and this set; its
    # master and conf are then already decided.
    return "PYSPARK_GATEWAY_PORT" in os.environ


def ship_code(*refs: object) -> list[str]:
    """Make the user's code reach Spark's Python workers wherever they run (local workers
    started before its folder was on PYTHONPATH, a cluster's executors, a Spark Connect
    server): the packages of ``refs`` ("module:attr" strings or objects) that are not
    installed in site-packages are pickled by value with the functions Spark ships. Returns
    the package names shipped."""
    import importlib
    import sys

    from pyspark import cloudpickle

    shipped = []
    for ref in refs:
        if ref is None:
            continue
        name = ref.partition(":")[0] if isinstance(ref, str) else getattr(ref, "__module__", "")
        top = name.split(".")[0]
        if not top or top in sys.builtin_module_names:
            continue
        try:
            package = importlib.import_module(top)
        except ImportError:
            continue
        origin = getattr(package, "__file__", "") or ""
        if not origin or "site-packages" in origin or "dist-packages" in origin \
                or top in ("onceflow", "spark_tasks", "pyspark"):
            continue
        cloudpickle.register_pickle_by_value(package)
        shipped.append(top)
    return shipped


# The Spark Connect session every processing task joins (connect_session's ``shared``), and the
# warm-up of a server onceflow starts (spark_tasks.localspark): one for all pipelines, so that
# the Python workers a warm-up or an earlier task started are the ones the next task finds.
SHARED_SESSION_KEY = "onceflow"

# A shared Spark Connect session is renewed this often (seconds): the server closes a session
# left idle past its timeout (15 min as onceflow starts it, 60 by default) and refuses its id
# for ever after; a period shorter than that bounds how long tasks go without one.
SHARED_SESSION_PERIOD_S = 600


def shared_session_id(key: str, now: float | None = None) -> str:
    """The Spark Connect session id the tasks sharing ``key`` use in this period (a UUID)."""
    import hashlib
    import uuid

    period = int((time.time() if now is None else now) // SHARED_SESSION_PERIOD_S)
    digest = hashlib.sha256(f"onceflow/{key}/{period}".encode()).digest()
    return str(uuid.UUID(bytes=digest[:16], version=4))


@contextmanager
def connect_session(url: str, app_name: str, shared: str | None = None):
    """A Spark Connect session for one task. A session of its own is released at the end (a
    session left open would stay on the server until it times out). ``shared``: the tasks
    with the same key join one session instead, left open for the next: a
    new session costs a new Python worker on the server (~1.3 s before the first Python
    bolt or source read), a joined one finds its workers warm. The shared session changes
    every SHARED_SESSION_PERIOD_S, so the server holds a bounded few per key; when the
    server closed it anyway (a shorter idle timeout), the task takes a session of its own.
    A server that does not answer is a clear error, retried like any failure (a restarted
    server comes back)."""
    import socket
    from urllib.parse import urlparse

    from onceflow.core.errors import OnceflowError

    where = urlparse(url.replace("sc://", "http://", 1))
    try:
        socket.create_connection((where.hostname, where.port or 15002), timeout=3).close()
    except OSError as error:
        raise OnceflowError(
            f"the Spark Connect server at {url} does not answer ({error}): start it "
            "(`onceflow spark start` in local mode) or point the Spark connection at yours"
        ) from error
    from pyspark.errors import PySparkException
    from pyspark.sql import SparkSession

    def builder(remote: str):
        out = SparkSession.builder.remote(remote).appName(app_name)
        # set with the app name: one round trip (the server's own settings hold the rest)
        for key, value in processing_conf(static=False).items():
            out = out.config(key, value)
        return out

    spark = None
    if shared is not None:
        # sc://host:port/;param=value;...: the session id is one more parameter
        joined = (url if "/;" in url else url.rstrip("/") + "/") + \
            f";session_id={shared_session_id(shared)}"
        try:  # the first round trips (the session's options, its version) say whether
            # the server still knows the id
            spark = builder(joined).create()
            spark.version  # noqa: B018
        except PySparkException as error:
            if "SESSION_CLOSED" not in str(error):
                raise
            if spark is not None:
                spark.client.close()
            spark, shared = None, None
    if spark is None:
        spark = builder(url).create()
    try:
        yield spark
    finally:
        try:
            if shared is None:
                spark.stop()
            else:  # left open for the next task; the connection goes
                spark.client.close()
        finally:
            # it would make a later spark-submit from this process look for a Connect URL
            os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)
