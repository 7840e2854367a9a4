"""PostgreSQL DSNs from Airflow Connections or the environment, never from code.

One resolution everywhere (Airflow tasks, the triggerer, the Spark driver, the CLI):

1. ``AIRFLOW_CONN_<ID>`` in the environment (Airflow's JSON or URI form): works without
   Airflow running, which is how the Spark driver and the CLI see the same connections;
2. Airflow's own connection lookup (secrets backends, the metadata database), where Airflow
   is importable and configured;
3. for the coordinator's connection only (``onceflow_pg``): ``ONCEFLOW_PG_DSN``.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from urllib.parse import unquote, urlsplit

import psycopg2
from psycopg2.extensions import make_dsn, parse_dsn

from onceflow.core.errors import ConfigError

DEFAULT_CONN_ID = "onceflow_pg"
DSN_ENV = "ONCEFLOW_PG_DSN"


def dsn_from_connection(conn) -> str:
    """A libpq DSN from an Airflow Connection (host, port, login, password, schema=database)."""
    params = {
        "host": conn.host or "127.0.0.1",
        "port": conn.port or 5432,
        "user": conn.login or None,
        "password": conn.password or None,
        "dbname": conn.schema or "onceflow",
    }
    return make_dsn(**{k: v for k, v in params.items() if v is not None})


def safe_dsn(dsn: str) -> str:
    """The DSN without its password, for messages and logs."""
    try:
        params = parse_dsn(dsn)
    except psycopg2.Error:
        return "<unparseable DSN>"
    if "password" in params:
        params["password"] = "***"
    return make_dsn(**params)


def env_name(conn_id: str) -> str:
    return "AIRFLOW_CONN_" + conn_id.upper()


def _from_env(conn_id: str) -> str | None:
    env = env_name(conn_id)
    raw = os.environ.get(env, "").strip()
    if not raw:
        return None
    if raw.startswith("{"):
        try:
            fields = json.loads(raw)
        except ValueError as error:
            raise ConfigError(f"{env} is not valid JSON ({error}): give the connection as "
                              "Airflow's JSON form or a URI") from error
        return dsn_from_connection(SimpleNamespace(
            host=fields.get("host"), port=fields.get("port"), login=fields.get("login"),
            password=fields.get("password"), schema=fields.get("schema")))
    uri = urlsplit(raw)
    return dsn_from_connection(SimpleNamespace(
        host=uri.hostname, port=uri.port, login=unquote(uri.username or "") or None,
        password=unquote(uri.password or "") or None, schema=uri.path.lstrip("/") or None))


def _missing(conn_id: str, setting: str, error: Exception | None) -> ConfigError:
    why = f" ({error})" if error else ""
    return ConfigError(
        f"{setting}={conn_id!r}: no such connection{why}. Create the Airflow connection, "
        f"e.g. export {env_name(conn_id)}='postgresql://user@host:5432/database'"
        + (f", or set {DSN_ENV}" if conn_id == DEFAULT_CONN_ID else ""))


def resolve_dsn(conn_id: str = DEFAULT_CONN_ID, *, setting: str = "postgres_conn_id") -> str:
    """The DSN of connection ``conn_id`` (see the module docstring for the order)."""
    dsn = _from_env(conn_id)
    if dsn:
        return dsn
    error = None
    try:
        from airflow.sdk import BaseHook

        return dsn_from_connection(BaseHook.get_connection(conn_id))
    except ImportError:
        pass
    except Exception as exc:  # the SDK raises its own not-found type
        error = exc
    if conn_id == DEFAULT_CONN_ID and os.environ.get(DSN_ENV):
        return os.environ[DSN_ENV]
    raise _missing(conn_id, setting, error)


async def resolve_dsn_async(conn_id: str = DEFAULT_CONN_ID) -> str:
    """resolve_dsn for the triggerer's event loop."""
    dsn = _from_env(conn_id)
    if dsn:
        return dsn
    from airflow.sdk import BaseHook

    try:
        return dsn_from_connection(await BaseHook.aget_connection(conn_id))
    except Exception as error:
        if conn_id == DEFAULT_CONN_ID and os.environ.get(DSN_ENV):
            return os.environ[DSN_ENV]
        raise _missing(conn_id, "postgres_conn_id", error) from error
