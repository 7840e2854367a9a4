"""One way to get a SparkSession for every place the processing phase runs.

- under spark-submit: the master and resources come from spark-submit; nothing is overridden;
- as a Spark Connect client: SPARK_REMOTE (e.g. sc://127.0.0.1:15002) is used when set, and
  ``connect_session`` gives a task a session of its own or the one processing tasks share;
- directly (tests, benchmarks, the CLI): the setting ONCEFLOW_SPARK_MASTER (local[2]).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import os
import re
import shutil
import socket
import sys
import time
import uuid
from contextlib import contextmanager
from urllib.parse import urlparse

from pyspark import cloudpickle
from pyspark.errors import PySparkException
from pyspark.errors.exceptions.connect import SparkConnectGrpcException
from pyspark.sql import SparkSession
from pyspark.sql.connect.client.retries import DefaultPolicy

from onceflow.core import settings
from onceflow.core.errors import ConfigError, OnceflowError, SparkServerGone
from onceflow.sources.jvm import jvm_conf
from onceflow.spark.conf import processing_conf
from onceflow.spark.versions import check_pyspark_pair


def require_java() -> None:
    """Spark in this process needs a JVM: a clear error instead of Spark's own."""
    if os.environ.get("JAVA_HOME") or shutil.which("java"):
        return

    raise ConfigError("Java is missing: Spark needs a JDK 17 here (Debian: apt-get install "
                      "openjdk-17-jdk-headless), or set SPARK_REMOTE to a Spark Connect server")


def get_spark(app_name: str = "onceflow", master: str | None = None) -> SparkSession:
    check_pyspark_pair()
    # Python workers must run the interpreter that has onceflow and pyarrow installed.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    remote = os.environ.get("SPARK_REMOTE")
    if remote and master is None:
        spark = builder.remote(remote).getOrCreate()
        spark.client.set_retry_policies([retry_policy(server_retry_s())])  # connect_session's
        return spark
    require_java()
    if master or not _under_spark_submit():
        builder = builder.master(master or settings.get("spark_master"))
    if not _under_spark_submit():
        # Local mode runs in this JVM: its default driver memory is short for long test runs
        # and large batches with broadcast joins (the acker's failed roots).
        builder = builder.config("spark.driver.memory", settings.get("driver_memory"))
        # A long-lived session (tests, the CLI) runs many batches in one JVM. Every
        # broadcast hash join builds its relation in at least one memory page, however few
        # failed roots it holds, and the finished batches' broadcasts are freed
        # only after a GC lets Spark's ContextCleaner drop them: smaller pages and a regular
        # GC keep them from filling the heap ("Not enough memory to build and broadcast the
        # table" otherwise).
        builder = (builder.config("spark.buffer.pageSize", "4m")
                   .config("spark.cleaner.periodicGC.interval", "1min")
                   .config("spark.ui.enabled", "false"))
        for key, value in jvm_conf().items():  # onceflow's JVM reader (onceflow.sources.jvm)
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
                or top in ("onceflow", "pyspark"):
            continue
        cloudpickle.register_pickle_by_value(package)
        shipped.append(top)
    return shipped


# The Spark Connect session every processing task joins (connect_session's ``shared``), and the
# warm-up of a server onceflow starts (onceflow.spark.localspark): one for all pipelines, so that
# the Python workers a warm-up or an earlier task started are the ones the next task finds.
SHARED_SESSION_KEY = "onceflow"

# A shared Spark Connect session is renewed this often (seconds): the server closes a session
# left idle past its timeout (the one onceflow starts it with, or Spark's default) and refuses
# its id for ever after; a period shorter than that bounds how long tasks go without one.
SHARED_SESSION_PERIOD_S = 600


def shared_session_id(key: str, now: float | None = None) -> str:
    """The Spark Connect session id the tasks sharing ``key`` use in this period (a UUID)."""

    period = int((time.time() if now is None else now) // SHARED_SESSION_PERIOD_S)
    digest = hashlib.sha256(f"onceflow/{key}/{period}".encode()).digest()
    return str(uuid.UUID(bytes=digest[:16], version=4))


# The client's backoff: PySpark's own, with a lower ceiling so that a server that is back
# soon (a restart) is found soon.
_BACKOFF_MS = {"initial_backoff": 50, "backoff_multiplier": 4.0, "max_backoff": 5000,
               "jitter": 500, "min_jitter_threshold": 2000}


def server_retry_s() -> float:
    """How long a Spark Connect client goes on retrying a server that does not answer: the
    setting spark_connect_retry_s. PySpark's own policy retries for ten minutes and more, so a
    task of a server that is gone would wait that long; within this bound it fails and
    Airflow retries it."""
    return float(settings.get("spark_connect_retry_s"))


def retry_policy(budget_s: float):
    """PySpark's retry policy for a Spark Connect client (public:
    pyspark.sql.connect.client.retries.DefaultPolicy, set with
    SparkConnectClient.set_retry_policies), with as many retries as fit in ``budget_s``
    seconds of waiting, jitter included; a server's own retry delay is held to the same
    ceiling where the client has that setting (pyspark-client 4.0 has no
    ``max_server_retry_delay``; 4.1.3 and 4.2.0 have it)."""

    b = _BACKOFF_MS
    retries, waited, wait = 0, 0.0, float(b["initial_backoff"])
    while True:
        jitter = b["jitter"] if wait >= b["min_jitter_threshold"] else 0
        if waited + wait + jitter > budget_s * 1000:
            break
        retries, waited = retries + 1, waited + wait + jitter
        wait = min(float(b["max_backoff"]), wait * b["backoff_multiplier"])
    wanted = {"max_retries": retries, "max_server_retry_delay": b["max_backoff"], **b}
    return DefaultPolicy(**_accepted(DefaultPolicy, wanted))


def _accepted(cls, wanted: dict) -> dict:
    """The arguments of ``wanted`` the installed client's ``cls`` takes: each pyspark-client
    minor has its own set, and an unknown one would fail every task."""
    params = inspect.signature(cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return wanted
    return {k: v for k, v in wanted.items() if k in params}


def _gone(error: BaseException, host: str, port: int) -> bool:
    """Whether ``error`` is the Spark Connect server's going away: a Spark or gRPC error, and
    the server unavailable (gRPC's UNAVAILABLE) or no longer taking connections."""
    # imported here: grpc comes with Spark Connect: only where Spark is used
    import grpc

    spark_error, seen = False, set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, SparkConnectGrpcException) \
                and error.getGrpcStatusCode() == grpc.StatusCode.UNAVAILABLE:
            return True
        if isinstance(error, grpc.RpcError) and isinstance(error, grpc.Call) \
                and error.code() == grpc.StatusCode.UNAVAILABLE:
            return True
        spark_error = spark_error or isinstance(error, PySparkException | grpc.RpcError)
        error = error.__cause__ or error.__context__
    return spark_error and not _answers(host, port)


def _why(error: BaseException) -> str:
    """One line for a Spark Connect error: gRPC's details when it has them."""

    text = str(error)
    found = re.search(r'details = "([^"]*)"', text)
    first = found.group(1) if found else (text.strip().splitlines() or ["-"])[0]
    return f"{type(error).__name__}: {first[:300]}"


def _answers(host: str, port: int, timeout: float = 3) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError:
        return False
    return True


@contextmanager
def connect_session(url: str, app_name: str, shared: str | None = None):
    """A Spark Connect session for one task. A session of its own is released at the end (a
    session left open would stay on the server until it times out). ``shared``: the tasks
    with the same key join one session instead, left open for the next: a
    new session costs a new Python worker on the server before the first Python bolt or
    source read, a joined one finds its workers warm. The shared session changes
    every SHARED_SESSION_PERIOD_S, so the server holds a bounded few per key; when the
    server closed it anyway (a shorter idle timeout), the task takes a session of its own.

    A server that does not answer is a clear error, retried like any failure (a restarted
    server comes back). One that goes away while the task uses it (killed, crashed) is
    SparkServerGone within ``server_retry_s()`` seconds of the client's retries (the
    client's retry policy is set before its first call), not PySpark's ten minutes and more.
    """

    check_pyspark_pair()
    where = urlparse(url.replace("sc://", "http://", 1))
    host, port = where.hostname, where.port or 15002
    try:
        socket_error = None if _answers(host, port) else "connection refused or timed out"
    except OSError as error:
        socket_error = str(error)
    if socket_error is not None:
        raise OnceflowError(
            f"the Spark Connect server at {url} does not answer ({socket_error}): start it "
            "(`onceflow spark start` in local mode) or point the Spark connection at yours")

    policy = retry_policy(server_retry_s())

    def session(remote: str) -> SparkSession:
        # Created without options, so that no call precedes the bounded retry policy; the
        # settings follow (server_settings).
        created = SparkSession.builder.remote(remote).create()
        created.client.set_retry_policies([policy])
        return created

    wanted = processing_conf(static=False)
    spark, gone = None, False
    try:
        if shared is not None:
            # sc://host:port/;param=value;...: the session id is one more parameter
            joined = (url if "/;" in url else url.rstrip("/") + "/") + \
                f";session_id={shared_session_id(shared)}"
            try:  # the first round trip (the session's settings) says whether the server
                # still knows the id; a joined session mostly has them already
                spark = session(joined)
                held = spark.conf.getAll
                wanted = {k: v for k, v in wanted.items() if held.get(k) != v}
            except PySparkException as error:
                if "SESSION_CLOSED" not in str(error) or spark is None:
                    raise
                spark.client.close()
                spark, shared = None, None
        if spark is None:
            spark = session(url)
            wanted = {"spark.app.name": app_name, **wanted}
        for key, value in wanted.items():
            spark.conf.set(key, value)
        yield spark
    except Exception as error:
        if not _gone(error, host, port):
            raise
        gone = True
        raise SparkServerGone(
            f"the Spark server at {host}:{port} is gone ({_why(error)}); the client gave up "
            f"after {server_retry_s():.0f}s of retries "
            "(ONCEFLOW_SPARK_CONNECT_RETRY_S). The attempt is retried; in local mode the "
            "retry starts onceflow's server again") from error
    finally:
        try:
            if spark is None:
                pass
            elif shared is None and not gone:
                spark.stop()
            else:  # left open for the next task (or nothing to release on a server gone)
                spark.client.close()
        finally:
            # it would make a later spark-submit from this process look for a Connect URL
            os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)
