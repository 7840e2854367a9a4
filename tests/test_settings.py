"""onceflow's settings in one place (onceflow.core.settings): the registry and
docs/configuration.md's table agree; no other library module reads an ONCEFLOW_ variable; the
reading order (the variable, Airflow's configuration where Airflow is loaded, the default)
and the refusal of bad values; the Airflow options in a real Airflow's config view, and one
of them set as AIRFLOW__ONCEFLOW__... being what a dag.test() run uses."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from helpers import table, tweets_pipeline
from onceflow.airflow.get_provider_info import get_provider_info
from onceflow.core import settings
from onceflow.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"
# The library onceflow installs, but for the checkout's own helpers (plugins/onceflow/dev/).
LIBRARY = [ROOT / "plugins" / "onceflow", ROOT / "spark_tasks"]
OWN = ROOT / "plugins" / "onceflow" / "core" / "settings.py"
NAME = re.compile(r"ONCEFLOW_[A-Z0-9_]+")


def documented() -> dict[str, list[str]]:
    """The rows of the table under "## Settings": variable -> its other cells."""
    text = DOC.read_text()
    section = text[text.index("## Settings"):]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].startswith("`ONCEFLOW_"):
            rows[cells[0].strip("`")] = [c.replace("`", "") for c in cells[1:]]
    return rows


def test_the_table_documents_every_setting_and_nothing_else():
    rows = documented()
    known = {s.env for s in settings.REGISTRY}
    assert set(rows) == known, (f"in the registry, not documented: {sorted(known - set(rows))}; "
                                f"documented, not in the registry: {sorted(set(rows) - known)}")
    for setting in settings.REGISTRY:
        option, default, meaning = rows[setting.env]
        assert option == (f"[onceflow] {setting.key}" if setting.airflow else ""), setting.env
        assert default == setting.default_text(), setting.env
        assert meaning, setting.env
    assert len({s.key for s in settings.REGISTRY}) == len(settings.REGISTRY)


def test_the_providers_config_section_is_the_airflow_settings():
    section = get_provider_info()["config"]["onceflow"]
    airflow_side = {s.key: s for s in settings.REGISTRY if s.airflow}
    assert set(section["options"]) == set(airflow_side) and airflow_side
    for key, option in section["options"].items():
        assert option["default"] == airflow_side[key].default_text()
        assert option["type"] == airflow_side[key].kind
        assert set(option) == {"description", "version_added", "type", "example", "default"}


def _reads_outside_settings(path: Path, root: Path = ROOT) -> list[str]:
    """The ONCEFLOW_ names a module spells out in code (not in its docstrings), and the names
    it builds (f"ONCEFLOW_{...}")."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef |
                                ast.AsyncFunctionDef)
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docstrings and NAME.fullmatch(node.value.strip()):
            found.append((node.lineno, node.value.strip()))
        elif isinstance(node, ast.JoinedStr) and len(node.values) > 1 \
                and isinstance(node.values[0], ast.Constant) \
                and re.fullmatch(r"ONCEFLOW_[A-Z0-9_]*", str(node.values[0].value)):
            found.append((node.lineno, ast.unparse(node)))
    return [f"{path.relative_to(root)}:{line} {name}" for line, name in found]


def test_no_library_module_but_settings_reads_an_onceflow_variable(tmp_path):
    offenders = []
    for folder in LIBRARY:
        for path in folder.rglob("*.py"):
            if path == OWN or "dev" in path.relative_to(folder).parts[:1]:
                continue
            offenders += _reads_outside_settings(path)
    assert not offenders, f"read them through onceflow.core.settings: {offenders}"
    # the check finds a read when there is one
    sample = tmp_path / "sample.py"
    sample.write_text('"""ONCEFLOW_HOME"""\nimport os\n'
                      'PORT = os.environ.get("ONCEFLOW_SPARK_CONNECT_PORT")\n'
                      'HOME = os.environ[f"ONCEFLOW_{KEY}"]\n')
    assert _reads_outside_settings(sample, tmp_path) == [
        "sample.py:3 ONCEFLOW_SPARK_CONNECT_PORT", "sample.py:4 f'ONCEFLOW_{KEY}'"]


def test_the_variable_then_airflows_configuration_then_the_default(monkeypatch):
    import airflow.configuration  # noqa: F401 (this process has Airflow's configuration)

    for name in ("ONCEFLOW_ATTEMPT_LEASE_S", "AIRFLOW__ONCEFLOW__ATTEMPT_LEASE_S",
                 "ONCEFLOW_SHUFFLE_PARTITIONS", "AIRFLOW__ONCEFLOW__SHUFFLE_PARTITIONS"):
        monkeypatch.delenv(name, raising=False)
    assert settings.get("attempt_lease_s") == 60
    monkeypatch.setenv("AIRFLOW__ONCEFLOW__ATTEMPT_LEASE_S", "45")
    assert settings.get("attempt_lease_s") == 45
    monkeypatch.setenv("ONCEFLOW_ATTEMPT_LEASE_S", "7")
    assert settings.get("attempt_lease_s") == 7
    monkeypatch.setenv("ONCEFLOW_ATTEMPT_LEASE_S", " ")  # empty: unset
    assert settings.get("attempt_lease_s") == 45
    monkeypatch.setenv("AIRFLOW__ONCEFLOW__ATTEMPT_LEASE_S", "soon")
    with pytest.raises(ConfigError, match=re.escape(
            "[onceflow] attempt_lease_s (airflow.cfg or AIRFLOW__ONCEFLOW__ATTEMPT_LEASE_S)="
            "'soon' is invalid: give a positive whole number of seconds, or unset it for the "
            "default (60)")):
        settings.get("attempt_lease_s")
    # a setting that is not an Airflow option ignores Airflow's configuration
    monkeypatch.setenv("AIRFLOW__ONCEFLOW__SHUFFLE_PARTITIONS", "99")
    assert settings.get("shuffle_partitions") == 4


@pytest.mark.parametrize(("key", "value", "message"), [
    ("shuffle_partitions", "0", "ONCEFLOW_SHUFFLE_PARTITIONS='0' is invalid: give a whole "
                                "number of partitions, 1 or more, or unset it for the default (4)"),
    ("spark_connect_port", "15002x", "ONCEFLOW_SPARK_CONNECT_PORT='15002x' is invalid: give a "
                                     "port number from 1 to 65535"),
    ("pg_port", "70000", "ONCEFLOW_PG_PORT='70000' is invalid: give a port number"),
    ("begin_wait_s", "-1", "ONCEFLOW_BEGIN_WAIT_S='-1' is invalid: give a number of seconds, "
                           "0 or more, or unset it for the default (300)"),
    ("begin_wait_s", "nan", "ONCEFLOW_BEGIN_WAIT_S='nan' is invalid"),
    ("spark", "local", "ONCEFLOW_SPARK='local' is invalid: choose one of connect, submit"),
    ("jvm_reader", "of", "ONCEFLOW_JVM_READER='of' is not an on/off value"),
])
def test_a_bad_value_is_refused_naming_the_variable_the_value_and_what_it_takes(
        monkeypatch, key, value, message):
    monkeypatch.setenv(settings.env_name(key), value)
    with pytest.raises(ConfigError, match=re.escape(message)):
        settings.get(key)


def test_good_values_are_read_as_their_type(monkeypatch):
    for key, value, expected in [("shuffle_partitions", " 8 ", 8), ("begin_wait_s", "2.5", 2.5),
                                 ("jvm_reader", "OFF", False), ("spark", "submit", "submit"),
                                 ("driver_memory", "3g", "3g")]:
        monkeypatch.setenv(settings.env_name(key), value)
        assert settings.get(key) == expected


def test_a_process_without_airflow_reads_the_variable_and_the_default_only():
    """The CLI and the Spark side do not load Airflow to read a setting: an Airflow option set
    only in Airflow's configuration is not theirs."""
    code = ("import sys\n"
            "from onceflow.core import settings\n"
            "from onceflow.spark.conf import processing_conf\n"
            "print(settings.get('attempt_lease_s'), processing_conf()"
            "['spark.sql.shuffle.partitions'], 'airflow.configuration' in sys.modules)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONCEFLOW_ATTEMPT")}
    env["AIRFLOW__ONCEFLOW__ATTEMPT_LEASE_S"] = "45"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["60", "4", "False"]


@pytest.mark.timeout(180)
def test_airflows_config_view_lists_the_options_and_their_values(tmp_path):
    """`airflow config list --section onceflow`: every Airflow option with its default, and
    one given as AIRFLOW__ONCEFLOW__BEGIN_WAIT_S with that value."""
    env = {**os.environ, "AIRFLOW__ONCEFLOW__BEGIN_WAIT_S": "7"}
    done = subprocess.run(
        [str(Path(sys.executable).with_name("airflow")), "config", "list", "--section",
         "onceflow", "--show-values"], env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-2000:]
    shown = dict(re.findall(r"^(\w+) = (.*)$", done.stdout, re.M))
    expected = {s.key: s.default_text() for s in settings.REGISTRY if s.airflow}
    expected["begin_wait_s"] = "7"
    assert shown == expected, done.stdout


@pytest.mark.timeout(420)
def test_an_airflow_option_is_what_a_dag_run_uses(monkeypatch, conn, dsn, warm_spark,
                                                  airflow_db):
    """AIRFLOW__ONCEFLOW__ATTEMPT_LEASE_S and ..._RETRY_DELAY_SECONDS, without the
    ONCEFLOW_ variables: the DAG's retry delay and the lease its tasks report are theirs."""
    from onceflow.dev.demo import load_dag

    for name in ("ONCEFLOW_ATTEMPT_LEASE_S", "ONCEFLOW_RETRY_DELAY_SECONDS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AIRFLOW__ONCEFLOW__ATTEMPT_LEASE_S", "45")
    monkeypatch.setenv("AIRFLOW__ONCEFLOW__RETRY_DELAY_SECONDS", "3")
    tweets_pipeline(conn, events=600, batch_size=600)
    dag = load_dag(ROOT / "dags", "onceflow_tweets")
    assert dag.get_task("process").retry_delay == timedelta(seconds=3)
    dr = dag.test(logical_date=datetime.now(UTC).replace(microsecond=0))
    assert str(dr.state) == "success"
    assert table(conn, "SELECT txid, state, lease_s FROM transactions") == [
        (1, "committed", 45)]


def test_a_connections_libpq_extras_reach_the_connection(dsn, monkeypatch):
    """An Airflow connection's extras that are libpq parameters (sslmode, application_name)
    are in the DSN onceflow connects with, as the postgres provider's hook passes them; the
    provider's own extras (cursor) are not. sslmode=require on this server without TLS is
    refused: the setting is honoured, not dropped."""
    import json

    import psycopg2
    from psycopg2.extensions import parse_dsn

    from onceflow.core.connections import resolve_dsn, safe_dsn

    params = parse_dsn(dsn)

    def connection(**extra) -> None:
        monkeypatch.setenv("AIRFLOW_CONN_PG_EXTRAS", json.dumps({
            "conn_type": "postgres", "host": params.get("host", "127.0.0.1"),
            "port": int(params.get("port", 5432)), "login": params.get("user"),
            "schema": params["dbname"], "extra": extra}))

    connection(sslmode="disable", application_name="onceflow-extras", cursor="dictcursor")
    resolved = parse_dsn(resolve_dsn("pg_extras"))
    assert resolved["sslmode"] == "disable" and "cursor" not in resolved
    conn = psycopg2.connect(resolve_dsn("pg_extras"))
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT current_setting('application_name'), current_database()")
            assert cur.fetchone() == ("onceflow-extras", params["dbname"])
    finally:
        conn.close()
    with psycopg2.connect(dsn) as plain, plain.cursor() as cur:
        cur.execute("SHOW ssl")
        tls = cur.fetchone()[0] == "on"
    plain.close()
    # and back: the Airflow connection run.sh makes from ONCEFLOW_PG_DSN keeps them
    from onceflow.airflow.environment import airflow_connection_json

    monkeypatch.setenv("AIRFLOW_CONN_PG_EXTRAS", airflow_connection_json(
        f"{dsn} sslmode=disable application_name=round-trip"))
    back = parse_dsn(resolve_dsn("pg_extras"))
    assert back == {**params, "sslmode": "disable", "application_name": "round-trip"}
    # a misspelt libpq parameter is refused, naming it, not dropped
    connection(ssl_mode="require")
    with pytest.raises(ConfigError, match="extra 'ssl_mode' is neither a libpq"):
        resolve_dsn("pg_extras")
    connection(sslmode="require")
    assert parse_dsn(resolve_dsn("pg_extras"))["sslmode"] == "require"
    connection(sslmode="require", sslpassword="key-secret")
    assert "key-secret" in resolve_dsn("pg_extras")
    assert "key-secret" not in safe_dsn(resolve_dsn("pg_extras"))  # what messages show
    if not tls:  # this machine's server, and the suite's private one, have no TLS
        with pytest.raises(psycopg2.OperationalError, match="SSL"):
            psycopg2.connect(resolve_dsn("pg_extras"))
