"""A pytest plugin for testing pipelines against the real services: a real PostgreSQL (one
fresh database per test, cloned from a migrated template), one local SparkSession for the
whole run, and an Airflow home of the run's own (under pytest-xdist: per worker). The suite
loads it with ``-p onceflow_testing.plugin`` (pyproject.toml's addopts). It is the checkout's
(tests/onceflow_testing/), not the package's: it needs onceflow.dev, and it registers the
examples (onceflow.dev.use_examples) and puts tests/ on the path of every process the tests
start (the fault harness's agents, benchmarks run as scripts).

Fixtures: ``dsn`` (a fresh migrated database; also ONCEFLOW_PG_DSN and the Airflow connection
onceflow_pg for the test), ``conn`` (a connection to it), ``second_dsn`` (an empty second
database), ``spark`` (the shared session), ``airflow_db`` (Airflow's metadata database,
migrated once), ``server_dsn`` (the server's DSN).

The PostgreSQL is found as everywhere (onceflow.dev.localpg): ONCEFLOW_PG_DSN, the server on
127.0.0.1:5432, or a private cluster started for the project folder.

With the environment variable CI set (to anything but "" or "false"), hypothesis runs under
the profile "onceflow-ci": derandomized (the same examples on every run, so CI cannot pass
once and fail the next time on the same code) and without per-example deadlines (a loaded
machine is not a failure). An explicit ``--hypothesis-profile`` wins.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import psycopg2
import pytest
from psycopg2 import sql

from onceflow.core import db

_state: dict = {}
_counter = itertools.count()


def pytest_configure(config) -> None:
    """Before anything imports Airflow: PostgreSQL found, an Airflow home of this run's own."""
    from onceflow.dev import use_examples
    from onceflow.dev.localenv import airflow_env, apply_env, project_dir
    from onceflow.dev.localpg import ensure_postgres, private_data_dir, running_private

    # the suite runs the examples' pipelines and DAGs, registered as `bash run.sh demo` has
    # them (for this process and every one it starts: Airflow's, Spark's, the CLI's)
    use_examples()
    tests = str(Path(__file__).resolve().parents[1])
    os.environ["PYTHONPATH"] = os.pathsep.join([tests, os.environ["PYTHONPATH"]])
    root = project_dir()
    # A private cluster the suite starts is the suite's to stop; one already running (the
    # demo's, say) is left as it was.
    was_running = running_private(private_data_dir(root))
    server, how = ensure_postgres(root)
    started_pg = not was_running and running_private(private_data_dir(root))
    home = tempfile.mkdtemp(prefix="onceflow-airflow-")
    os.environ["AIRFLOW_HOME"] = home
    made = [home]
    # File segments without a path of their own land in a folder of this run's own: runs
    # (and pytest-xdist workers) side by side use the same topic names.
    if not os.environ.get("ONCEFLOW_SEGMENTS_DIR"):
        os.environ["ONCEFLOW_SEGMENTS_DIR"] = tempfile.mkdtemp(prefix="onceflow-segments-")
        made.append(os.environ["ONCEFLOW_SEGMENTS_DIR"])
    # Spark's scratch folders (spark-*, blockmgr-*, pyspark-*) of every JVM the run starts, in
    # a folder of the run's own: a JVM the fault tests kill never deletes its own, and
    # SparkSubmit and Spark Connect put some under java.io.tmpdir whatever the local dirs.
    scratch = tempfile.mkdtemp(prefix="onceflow-spark-")
    os.environ["SPARK_LOCAL_DIRS"] = scratch
    os.environ["SPARK_SUBMIT_OPTS"] = " ".join(
        filter(None, [os.environ.get("SPARK_SUBMIT_OPTS"), f"-Djava.io.tmpdir={scratch}"]))
    made.append(scratch)
    apply_env(airflow_env(root, server))
    # One template per run: runs may overlap on one server.
    _state.update(server=server, how=how, home=home, root=root, made=made,
                  started_pg=started_pg, template=f"onceflow_test_template_{os.getpid()}")
    # py4j logs "Closing down clientserver connection" from __del__ after pytest closed its
    # streams.
    logging.getLogger("py4j").setLevel(logging.WARNING)
    _hypothesis_profile(config)


def pytest_unconfigure(config) -> None:
    """The run leaves nothing of its own behind: its temporary folders (Spark's scratch
    folder among them), and the private PostgreSQL cluster if this process started it."""
    for folder in _state.get("made", ()):
        shutil.rmtree(folder, ignore_errors=True)
    if _state.get("started_pg"):
        from onceflow.dev.localpg import private_data_dir, stop_private

        stop_private(private_data_dir(_state["root"]))


CI_PROFILE = "onceflow-ci"


def _hypothesis_profile(config) -> None:
    """Under CI, hypothesis derandomized and without deadlines (see the module docstring)."""
    if os.environ.get("CI", "").strip().lower() in ("", "0", "false", "no"):
        return
    try:
        from hypothesis import settings
    except ImportError:
        return
    settings.register_profile(CI_PROFILE, derandomize=True, deadline=None,
                              print_blob=True)
    chosen = None
    try:
        chosen = config.getoption("hypothesis_profile")
    except ValueError:  # hypothesis's pytest plugin is not loaded
        pass
    if chosen is None:
        settings.load_profile(CI_PROFILE)


def pytest_report_header(config):
    return f"onceflow: PostgreSQL from {_state['how']}; AIRFLOW_HOME={_state['home']}"


def _admin():
    conn = psycopg2.connect(db.with_database(_state["server"], "postgres"))
    conn.autocommit = True
    return conn


def _exec(admin, statement: str, *names: str) -> None:
    with admin.cursor() as cur:
        cur.execute(sql.SQL(statement).format(*map(sql.Identifier, names)))


@pytest.fixture(scope="session")
def server_dsn() -> str:
    return _state["server"]


@pytest.fixture(scope="session")
def template_db():
    """A database with every migration applied; each test's database is a copy of it."""
    template = _state["template"]
    admin = _admin()
    _exec(admin, "DROP DATABASE IF EXISTS {} WITH (FORCE)", template)
    _exec(admin, "CREATE DATABASE {}", template)
    conn = db.connect(db.with_database(_state["server"], template))
    db.migrate(conn)
    conn.close()
    yield template
    _exec(admin, "DROP DATABASE IF EXISTS {} WITH (FORCE)", template)
    admin.close()


@contextmanager
def fresh_database(prefix: str, template: str | None = None):
    """A new database (a copy of ``template`` if given), dropped afterwards. Yields its DSN."""
    name = f"{prefix}{os.getpid()}_{next(_counter)}"
    admin = _admin()
    _exec(admin, "DROP DATABASE IF EXISTS {} WITH (FORCE)", name)
    if template:
        _exec(admin, "CREATE DATABASE {} TEMPLATE {}", name, template)
    else:
        _exec(admin, "CREATE DATABASE {}", name)
    try:
        yield db.with_database(_state["server"], name)
    finally:
        _exec(admin, "DROP DATABASE IF EXISTS {} WITH (FORCE)", name)
        admin.close()


@pytest.fixture
def dsn(template_db, monkeypatch):
    """A fresh, migrated database for this test; also what the Airflow connection points at."""
    from onceflow.dev.localenv import airflow_connection_json

    with fresh_database("onceflow_t", template_db) as test_dsn:
        monkeypatch.setenv("ONCEFLOW_PG_DSN", test_dsn)
        monkeypatch.setenv("AIRFLOW_CONN_ONCEFLOW_PG", airflow_connection_json(test_dsn))
        yield test_dsn


@pytest.fixture
def second_dsn(template_db):
    """An empty second database: a state kept outside the coordinator's database."""
    with fresh_database("onceflow_s") as second:
        yield second


@pytest.fixture
def conn(dsn):
    c = db.connect(dsn)
    yield c
    c.close()


@pytest.fixture(scope="session")
def spark():
    """One local SparkSession for every test that calls the processing phase directly."""
    from onceflow.spark.session import get_spark

    session = get_spark("onceflow-tests", master="local[2]")
    session.sparkContext.setLogLevel("WARN")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def airflow_db():
    """Airflow's metadata database (SQLite in the run's AIRFLOW_HOME), migrated once, with the
    DAGs folder's DAGs in it: two DAG runs started at once on an empty database would both
    insert them, and one would fail on the duplicate."""
    import subprocess

    from onceflow.airflow import airflow_cli
    from onceflow.dev.localenv import airflow_db_ready

    airflow_db_ready(_state["root"])
    done = subprocess.run(airflow_cli("dags", "reserialize"), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError("`airflow dags reserialize` failed in the test run's AIRFLOW_HOME:\n"
                           + (done.stdout + done.stderr)[-3000:])
    return _state["home"]


@pytest.fixture(scope="session")
def spark_connect_server(tmp_path_factory):
    """A Spark Connect server of this run's own (local mode, a free port): the warm Spark
    that processing tasks reach through a ``spark_connect`` connection. Yields its port."""
    import socket

    from onceflow.spark import localspark

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = tmp_path_factory.mktemp("spark-connect")
    localspark.start(port, driver_memory="1g", folder=folder)
    yield port
    localspark.stop(port, folder=folder)


@pytest.fixture
def warm_spark(spark_connect_server, monkeypatch):
    """Processing tasks of this test run on the warm Spark (the Airflow connection
    spark_default becomes the Connect server's)."""
    from onceflow.dev.localenv import spark_connection

    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", spark_connection(spark_connect_server))
    return spark_connect_server


@pytest.fixture
def spark_submit(monkeypatch):
    """Processing tasks of this test run by spark-submit in local mode."""
    from onceflow.dev.localenv import spark_connection

    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", spark_connection(None))
