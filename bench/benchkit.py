"""Pieces the bench scripts share: the load average, a migrated database of a script's own,
a timer, a warm Spark Connect server."""

from __future__ import annotations

import time
from pathlib import Path

from onceflow.core import db
from onceflow.dev.localpg import recreate_database


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages (the machine must be quiet for figures to mean
    anything)."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def migrated_database(server_dsn: str, name: str) -> str:
    """A fresh database ``name`` (dropped first) with onceflow's schema; its DSN."""
    dsn = recreate_database(server_dsn, name, migrate=False)
    with db.connection(dsn) as conn:
        db.migrate(conn)
    return dsn


def timed(fn):
    """(seconds, fn()) ."""
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def warm_spark_connect(folder: Path) -> tuple[int, str]:
    """A local Spark Connect server on a free port, keeping its files in ``folder``, warmed up
    before any clock starts (its start and warm-up printed apart). (port, url); stop it with
    onceflow.spark.localspark.stop(port, folder=folder)."""
    from airflow_run import _free_port

    from onceflow.spark import localspark

    port, started = _free_port(), time.monotonic()
    url = localspark.start(port, folder=folder).url
    print(f"Spark Connect server up and warmed up in "
          f"{time.monotonic() - started + localspark.warm_up(url):.1f}s", flush=True)
    return port, url
