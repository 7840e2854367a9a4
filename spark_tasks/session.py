"""One way to get a SparkSession for every place the processing phase runs.

- under spark-submit: the master and resources come from spark-submit; nothing is overridden;
- as a Spark Connect client: SPARK_REMOTE (e.g. sc://127.0.0.1:15002) is used when set;
- directly (tests, benchmarks, the CLI): local mode, ``ONCEFLOW_SPARK_MASTER`` or local[2].
"""

from __future__ import annotations

import os
import shutil
import sys

from pyspark.sql import SparkSession

# Spark's default of 200 shuffle partitions doubles a 10M-row aggregation on 2 cores.
DEFAULT_SHUFFLE_PARTITIONS = os.environ.get("ONCEFLOW_SHUFFLE_PARTITIONS", "4")


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
    return (
        builder.config("spark.sql.shuffle.partitions", DEFAULT_SHUFFLE_PARTITIONS)
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )


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
