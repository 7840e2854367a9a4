"""Reaching Spark from a task: spark-submit's entry point and settings, the Spark Connect URL
of a connection, and the Spark client imported in a thread while a one-task transaction
waits for a place (never beside a topology being built)."""

from __future__ import annotations

import importlib.util
import logging
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from airflow.providers.apache.spark.hooks.spark_connect import SparkConnectHook
from airflow.sdk import BaseHook

from onceflow.spark.conf import processing_conf

log = logging.getLogger(__name__)

# The spark-submit application: the installed onceflow.spark package's entry point file.
PROCESS_ENTRY_POINT = str(
    Path(importlib.util.find_spec("onceflow.spark").origin).parent / "process_batch.py"
)


# onceflow's processing settings (onceflow.spark.conf); INFO logging only costs time.
SPARK_DEFAULTS = {
    **processing_conf(),
    "spark.ui.enabled": "false",
    "spark.log.level": "WARN",
}


# Held while the Spark client is imported in spark_client_loading's thread and while a
# topology is built: two threads importing pyspark at once can see a partly initialised
# pyspark.sql (ImportError "cannot import name ... partially initialized module").
SPARK_IMPORTS = threading.Lock()


def build_checked(pipeline) -> None:
    """Build ``pipeline``'s topology (its declaration checked), never beside the thread that
    imports the Spark client."""
    with SPARK_IMPORTS:
        pipeline.build_topology()


def _import_spark_layer() -> None:
    started = time.monotonic()
    try:
        with SPARK_IMPORTS:
            for module in ("onceflow.spark.session", "onceflow.spark.localspark",
                           "onceflow.spark.processing"):
                importlib.import_module(module)
    except Exception:  # noqa: S110 (imported again where used, which then says what is wrong)
        pass
    else:
        log.debug("the Spark client and onceflow's Spark layer imported in %.2fs",
                  time.monotonic() - started)


@contextmanager
def spark_client_loading():
    """Yields ``start()``, which imports the Spark client and onceflow's Spark layer in a
    thread (once, however often it is called). A one-task transaction calls it when its
    begin starts to wait for a place among max_pending, so the imports are off the path to
    its commit; a begin that plans at once leaves them to its processing: beside the begin
    they would only delay the plan (the thread holds the GIL, and the declaration check
    waits for SPARK_IMPORTS). The thread is joined before the block ends, so that the
    processing never imports pyspark beside it."""
    thread = threading.Thread(target=_import_spark_layer, name="onceflow-spark-import",
                              daemon=True)

    def start() -> None:
        if thread.ident is None:
            thread.start()

    try:
        yield start
    finally:
        if thread.ident is not None:
            thread.join()


def module_root(ref: str | None) -> str | None:
    """The folder from which ``ref``'s module is imported (for PYTHONPATH of a process that
    must import it too), or None when it cannot be told."""
    if not ref:
        return None
    module = sys.modules.get(ref.partition(":")[0])
    origin = getattr(module, "__file__", None)
    if not origin:
        return None
    depth = module.__name__.count(".") + (1 if origin.endswith("__init__.py") else 0)
    return str(Path(origin).resolve().parents[depth])


def spark_connect_url(conn_id: str) -> str | None:
    """The Spark Connect URL of connection ``conn_id`` when its type is ``spark_connect``;
    None for a ``spark`` connection (spark-submit to its master)."""

    conn = BaseHook.get_connection(conn_id)
    if conn.conn_type != "spark_connect":
        return None

    return SparkConnectHook(conn_id).get_connection_url().rstrip("/")
