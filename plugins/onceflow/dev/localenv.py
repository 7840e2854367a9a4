"""The embedded defaults: one place that sets up Airflow, Spark and PostgreSQL for a project
folder (the demo, the UI, the tests). Values already in the environment win.

The project folder is ``ONCEFLOW_HOME`` (run.sh sets it to the checkout), else the current
directory: ``.airflow/``, ``.pgdata/`` and ``.run/`` live there, and its ``dags/`` is the
DAGs folder.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from importlib.metadata import version
from pathlib import Path

from onceflow.airflow.environment import airflow_connection_json, spark_connection
from onceflow.core import settings
from onceflow.core.errors import ConfigError
from onceflow.dev import project_dir


def airflow_env(root: Path, dsn: str, connect_port: int | None = None) -> dict[str, str]:
    home = root / ".airflow"
    return {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(root / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        "AIRFLOW__CORE__PARALLELISM": "4",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
        "AIRFLOW_CONN_ONCEFLOW_PG": airflow_connection_json(dsn),
        "AIRFLOW_CONN_SPARK_DEFAULT": spark_connection(connect_port),
        "ONCEFLOW_PG_DSN": dsn,
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SPARK_LOG_DIR": str(root / ".run" / "spark-logs"),
        "ONCEFLOW_HOME": str(root),
    }


UI_PORT = 8080  # `onceflow ui`'s API server, unless --port or AIRFLOW__API__PORT says
LOG_PORTS = {"worker_log_server_port": 8793, "trigger_log_server_port": 8794}  # Airflow's


def port_free(port: int) -> bool:
    """Whether nothing listens on ``port`` of 127.0.0.1 (a bind succeeds)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ui_env(port: int | None = None, environ: Mapping[str, str] | None = None
           ) -> dict[str, str]:
    """The settings of `onceflow ui`'s Airflow: its API server on ``port`` (else
    AIRFLOW__API__PORT, else 8080), which must be free (a second Airflow on a shared host
    would answer instead), its task runners pointed at it, and the scheduler's and
    triggerer's log servers on 8793 and 8794, or on free ports where those are taken (a
    port set in the environment is kept)."""
    environ = os.environ if environ is None else environ
    if port is None:
        port = int(environ.get("AIRFLOW__API__PORT") or UI_PORT)
    if not port_free(port):
        raise ConfigError(f"port {port} of 127.0.0.1 is taken (another Airflow or server "
                          "listens there): pass --port with a free one")
    env = {"AIRFLOW__API__PORT": str(port),
           "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/"}
    for key, default in LOG_PORTS.items():
        name = f"AIRFLOW__LOGGING__{key.upper()}"
        env[name] = environ.get(name) or str(default if port_free(default) else free_port())
    return env


def apply_env(env: dict[str, str]) -> None:
    for key, value in env.items():
        os.environ.setdefault(key, value)
    # spark-submit must be found next to this interpreter.
    bindir = str(Path(sys.executable).parent)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


def airflow_db_ready(root: Path) -> None:
    """`airflow db migrate` once per Airflow version (a stamp file remembers)."""
    stamp = Path(os.environ["AIRFLOW_HOME"]) / f".migrated-{version('apache-airflow')}"
    if stamp.exists():
        return
    stamp.parent.mkdir(parents=True, exist_ok=True)
    print("onceflow: initialising the Airflow metadata database (once)", file=sys.stderr)
    from onceflow.airflow import airflow_cli  # Airflow's CLI only when a migration is due

    subprocess.run(airflow_cli("db", "migrate"), check=True, stdout=subprocess.DEVNULL)
    stamp.touch()


_launched = None  # the local Spark Connect server embedded_env(wait_spark=False) started


def embedded_env(*, warm_spark: bool = True, wait_spark: bool = True) -> str:
    """Find or start PostgreSQL (and, with ``warm_spark``, the local Spark Connect server),
    and set up the Airflow environment of the project folder (idempotent). Returns the DSN.
    ONCEFLOW_SPARK=submit chooses spark-submit instead of the warm Spark. ``wait_spark``
    False: return while the server's JVM starts; ``spark_ready()`` then waits for it, and no
    warm-up follows (onceflow.spark.warm_up): the caller's own batches come at once, and a
    warm-up would only compete with them for the CPU."""
    global _launched
    from onceflow.dev.localpg import ensure_postgres  # localpg is the checkout's own

    root = project_dir()
    dsn, how = ensure_postgres(root)
    print(f"onceflow: PostgreSQL: using {how}", file=sys.stderr)
    port = None
    # a Spark connection given in the environment wins: no local server to start for it
    if warm_spark and settings.get("spark") == "connect" \
            and "AIRFLOW_CONN_SPARK_DEFAULT" not in os.environ:
        from onceflow.spark import localspark  # pyspark: only when a local Spark starts

        _launched = localspark.launch(warm=wait_spark)
        port = _launched.port
        if wait_spark:
            spark_ready()
    apply_env(airflow_env(root, dsn, port))
    airflow_db_ready(root)
    return os.environ["ONCEFLOW_PG_DSN"]


def spark_ready() -> None:
    """Wait for the Spark Connect server embedded_env started, if it did (see there)."""
    global _launched
    if _launched is not None:
        launched, _launched = _launched, None
        print(f"onceflow: Spark: {launched.ready().line()}", file=sys.stderr)
