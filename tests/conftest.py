"""Shared fixtures: a real PostgreSQL (one fresh database per test, cloned from a migrated
template), one local SparkSession for the whole run, and an Airflow home of the session's own.

The environment is set before anything imports Airflow.
"""

from __future__ import annotations

import itertools
import logging
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import psycopg2
import pytest
from psycopg2 import sql

from onceflow import db
from onceflow.localenv import airflow_connection_json, airflow_env, apply_env
from onceflow.localpg import ensure_postgres

ROOT = Path(__file__).resolve().parents[1]
_SERVER_DSN, _HOW = ensure_postgres(ROOT)
_AIRFLOW_HOME = tempfile.mkdtemp(prefix="onceflow-airflow-")
os.environ["AIRFLOW_HOME"] = _AIRFLOW_HOME
apply_env(airflow_env(ROOT, _SERVER_DSN))
TEMPLATE = f"onceflow_test_template_{os.getpid()}"  # one per run: runs may overlap
# py4j logs "Closing down clientserver connection" from __del__ after pytest closed its streams.
logging.getLogger("py4j").setLevel(logging.WARNING)
_counter = itertools.count()


def pytest_report_header(config):
    return f"onceflow: PostgreSQL from {_HOW}; AIRFLOW_HOME={_AIRFLOW_HOME}"


def _admin():
    conn = psycopg2.connect(db.with_database(_SERVER_DSN, "postgres"))
    conn.autocommit = True
    return conn


def _exec(admin, statement: str, *names: str) -> None:
    with admin.cursor() as cur:
        cur.execute(sql.SQL(statement).format(*map(sql.Identifier, names)))


@pytest.fixture(scope="session")
def template_db():
    """A database with every migration applied; each test's database is a copy of it."""
    admin = _admin()
    _exec(admin, "DROP DATABASE IF EXISTS {} WITH (FORCE)", TEMPLATE)
    _exec(admin, "CREATE DATABASE {}", TEMPLATE)
    conn = db.connect(db.with_database(_SERVER_DSN, TEMPLATE))
    db.migrate(conn)
    conn.close()
    yield TEMPLATE
    _exec(admin, "DROP DATABASE IF EXISTS {} WITH (FORCE)", TEMPLATE)
    admin.close()


@contextmanager
def _fresh_database(prefix: str, template: str | None = None):
    """A new database (a copy of ``template`` if given), dropped afterwards. Yields its DSN."""
    name = f"{prefix}{os.getpid()}_{next(_counter)}"
    admin = _admin()
    _exec(admin, "DROP DATABASE IF EXISTS {} WITH (FORCE)", name)
    if template:
        _exec(admin, "CREATE DATABASE {} TEMPLATE {}", name, template)
    else:
        _exec(admin, "CREATE DATABASE {}", name)
    try:
        yield db.with_database(_SERVER_DSN, name)
    finally:
        _exec(admin, "DROP DATABASE IF EXISTS {} WITH (FORCE)", name)
        admin.close()


@pytest.fixture
def dsn(template_db, monkeypatch):
    """A fresh, migrated database for this test; also what the Airflow connection points at."""
    with _fresh_database("onceflow_t", template_db) as test_dsn:
        monkeypatch.setenv("ONCEFLOW_PG_DSN", test_dsn)
        monkeypatch.setenv("AIRFLOW_CONN_ONCEFLOW_PG", airflow_connection_json(test_dsn))
        yield test_dsn


@pytest.fixture
def second_dsn(template_db):
    """An empty second database: a state kept outside the coordinator's database."""
    with _fresh_database("onceflow_s") as second:
        yield second


@pytest.fixture
def conn(dsn):
    c = db.connect(dsn)
    yield c
    c.close()


@pytest.fixture(scope="session")
def spark():
    """One local SparkSession for every test that calls the processing phase directly."""
    from spark_tasks.session import get_spark

    session = get_spark("onceflow-tests", master="local[2]")
    session.sparkContext.setLogLevel("WARN")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def airflow_db():
    """Airflow's metadata database (SQLite in the session's AIRFLOW_HOME), migrated once."""
    from onceflow.localenv import airflow_db_ready

    airflow_db_ready(ROOT)
    return _AIRFLOW_HOME
