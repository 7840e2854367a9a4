"""The environment of an Airflow of separate processes (API server, scheduler, DAG processor,
triggerer) that runs onceflow's DAGs: its metadata database's URL, onceflow's two connections
in Airflow's JSON form, and whether it says it is healthy. The benchmarks and the tests start
such Airflows; a deployment's own settings (docs/deployment.md) name the same values."""

from __future__ import annotations

import json
import sys
import urllib.request

from psycopg2.extensions import parse_dsn

from onceflow.core.connections import DSN_ENV, LIBPQ_EXTRAS


def airflow_connection_json(dsn: str) -> str:
    """An Airflow connection (JSON form: no URI escaping of passwords) for a libpq DSN."""
    p = parse_dsn(dsn)
    conn = {
        "conn_type": "postgres",
        "host": p.get("host", "127.0.0.1"),
        "port": int(p.get("port", 5432)),
        "login": p.get("user"),
        "password": p.get("password"),
        "schema": p.get("dbname", "onceflow"),
        # the DSN's other libpq parameters (sslmode, ...): dsn_from_connection reads them back
        "extra": {k: v for k, v in p.items() if k in LIBPQ_EXTRAS} or None,
    }
    return json.dumps({k: v for k, v in conn.items() if v is not None})


def spark_connection(connect_port: int | None) -> str:
    """The Airflow connection ``spark_default``: a local Spark Connect server's (the warm
    Spark), or spark-submit in local mode when ``connect_port`` is None."""
    if connect_port:
        return json.dumps({"conn_type": "spark_connect", "host": "127.0.0.1",
                           "port": connect_port})
    return json.dumps({"conn_type": "spark", "host": "local[2]"})


def sqlalchemy_url(dsn: str) -> str:
    """Airflow's metadata database URL (SQLAlchemy, psycopg2) for a libpq DSN."""
    p = parse_dsn(dsn)
    auth = p.get("user", "postgres") + (f":{p['password']}" if p.get("password") else "")
    return f"postgresql+psycopg2://{auth}@{p.get('host', '127.0.0.1')}:" \
           f"{p.get('port', 5432)}/{p['dbname']}"


def served_airflow_env(*, meta_dsn: str, api_port: int, dsn: str, spark: str,
                       executor: str = "LocalExecutor",
                       log_level: str = "INFO") -> dict[str, str]:
    """The settings an Airflow of separate processes (API server, scheduler, DAG processor,
    triggerer: the tests' and benchmarks' deployments) needs beside its home folders: its
    metadata database, its API for the task runners, heartbeats of a second so that a test
    sees a change quickly, and onceflow's connections (``spark``: the ``spark_default``
    connection's JSON)."""
    return {
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__EXECUTOR": executor,
        "AIRFLOW__CORE__PARALLELISM": "6",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": sqlalchemy_url(meta_dsn),
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(api_port),
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{api_port}/execution/",
        "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "1",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "1",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": log_level,
        "AIRFLOW_CONN_ONCEFLOW_PG": airflow_connection_json(dsn),
        "AIRFLOW_CONN_SPARK_DEFAULT": spark,
        DSN_ENV: dsn,
        "PYSPARK_PYTHON": sys.executable,
    }


def airflow_healthy(api_port: int) -> bool:
    """Whether the Airflow answering on ``api_port`` says its metadata database, scheduler,
    triggerer and DAG processor are healthy."""
    try:
        with urllib.request.urlopen(
                f"http://127.0.0.1:{api_port}/api/v2/monitor/health", timeout=3) as r:
            health = json.load(r)
    except (OSError, ValueError):
        return False
    return all((health.get(c) or {}).get("status") == "healthy"
               for c in ("metadatabase", "scheduler", "triggerer", "dag_processor"))
