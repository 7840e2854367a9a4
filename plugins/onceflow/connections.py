"""PostgreSQL DSNs from Airflow Connections (or the environment outside Airflow)."""

from __future__ import annotations

import os

from psycopg2.extensions import make_dsn

DEFAULT_CONN_ID = "onceflow_pg"


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


def _missing(conn_id: str, error: Exception) -> LookupError:
    env = "AIRFLOW_CONN_" + conn_id.upper()
    return LookupError(
        f"postgres_conn_id={conn_id!r} is not defined ({error}): create the Airflow connection, "
        f"e.g. export {env}='postgresql://postgres@127.0.0.1:5432/onceflow'"
    )


def airflow_dsn(conn_id: str = DEFAULT_CONN_ID) -> str:
    from airflow.sdk import BaseHook

    try:
        return dsn_from_connection(BaseHook.get_connection(conn_id))
    except Exception as error:  # the SDK raises its own not-found type
        if os.environ.get("ONCEFLOW_PG_DSN"):
            return os.environ["ONCEFLOW_PG_DSN"]
        raise _missing(conn_id, error) from error


async def airflow_dsn_async(conn_id: str = DEFAULT_CONN_ID) -> str:
    from airflow.sdk import BaseHook

    try:
        return dsn_from_connection(await BaseHook.aget_connection(conn_id))
    except Exception as error:
        if os.environ.get("ONCEFLOW_PG_DSN"):
            return os.environ["ONCEFLOW_PG_DSN"]
        raise _missing(conn_id, error) from error
