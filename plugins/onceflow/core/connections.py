"""PostgreSQL DSNs from Airflow Connections or the environment, never from code.

One resolution everywhere (Airflow tasks, the triggerer, the Spark driver, the CLI):
Airflow's own connection lookup, the one the postgres provider's hook inherits (the
metadata database, secrets backends, ``AIRFLOW_CONN_<ID>`` variables); for the coordinator's
connection only (``onceflow_pg``), ``ONCEFLOW_PG_DSN`` where Airflow has no such connection.
In Airflow, onceflow.airflow.hooks.OnceflowHook is the coordinator's hook.
"""

from __future__ import annotations

import psycopg2
from psycopg2.extensions import make_dsn, parse_dsn

from onceflow.core import settings
from onceflow.core.errors import ConfigError

DEFAULT_CONN_ID = "onceflow_pg"
DSN_ENV = settings.env_name("pg_dsn")


# The connection extras that are libpq's own parameters: the postgres provider's hook hands
# its extras to libpq as well (sslmode=require must not become a connection without TLS).
# Its other extras (iam, cursor, ...) are the provider's and mean nothing to libpq.
LIBPQ_EXTRAS = frozenset({
    "sslmode", "sslcert", "sslkey", "sslrootcert", "sslcrl", "sslcrldir", "sslpassword",
    "sslcompression", "sslsni", "sslcertmode", "ssl_min_protocol_version",
    "ssl_max_protocol_version", "channel_binding", "gssencmode", "krbsrvname", "gsslib",
    "requirepeer", "require_auth", "passfile", "service", "hostaddr", "application_name",
    "connect_timeout", "client_encoding", "options", "keepalives", "keepalives_idle",
    "keepalives_interval", "keepalives_count", "tcp_user_timeout", "target_session_attrs",
    "load_balance_hosts",
})


def dsn_from_connection(conn) -> str:
    """A libpq DSN from an Airflow Connection (host, port, login, password, schema=database,
    and the extras that are libpq parameters: sslmode, sslrootcert, ...)."""
    params = {
        "host": conn.host or "127.0.0.1",
        "port": conn.port or 5432,
        "user": conn.login or None,
        "password": conn.password or None,
        "dbname": conn.schema or "onceflow",
    }
    extras = getattr(conn, "extra_dejson", None) or {}
    unknown = sorted(k for k in extras if k not in LIBPQ_EXTRAS)
    if unknown and (provider := _provider_extras()) is not None:
        # a misspelt ssl_mode must not pass as a connection without TLS
        wrong = [k for k in unknown if k not in provider]
        if wrong:
            raise ConfigError(
                f"Airflow connection {getattr(conn, 'conn_id', None)!r}: extra {wrong[0]!r} "
                "is neither a libpq connection parameter nor an option of the postgres "
                "provider: correct its name (e.g. sslmode, sslrootcert, application_name) "
                "or remove it")
    params.update({k: str(v) for k, v in extras.items() if k in LIBPQ_EXTRAS and v is not None})
    return make_dsn(**{k: v for k, v in params.items() if v is not None})


def _provider_extras() -> frozenset[str] | None:
    """The extras the postgres provider's hook keeps for itself (cursor, iam, ...), None
    where this provider does not say."""
    try:
        from airflow.providers.postgres.hooks.postgres import PostgresHook  # odd extras only
    except ImportError:
        return None
    found = getattr(PostgresHook, "ignored_extra_options", None)
    return frozenset(found) if found is not None else None


def safe_dsn(dsn: str) -> str:
    """The DSN without its password, for messages and logs."""
    try:
        params = parse_dsn(dsn)
    except psycopg2.Error:
        return "<unparseable DSN>"
    for secret in ("password", "sslpassword"):
        if secret in params:
            params[secret] = "***"
    return make_dsn(**params)


def env_name(conn_id: str) -> str:
    return "AIRFLOW_CONN_" + conn_id.upper()


def airflow_connection(conn_id: str):
    """The Airflow connection ``conn_id``, found the way Airflow finds it."""
    # imported here: Airflow loads (with its configuration) only when a connection is named;
    # the Task SDK's hook, not the postgres provider's, which a task would import for it
    from airflow.sdk import BaseHook

    return BaseHook.get_connection(conn_id)


def _missing(conn_id: str, setting: str, error: Exception | None) -> ConfigError:
    why = f" ({error})" if error else ""
    return ConfigError(
        f"{setting}={conn_id!r}: no such connection{why}. Create the Airflow connection, "
        f"e.g. export {env_name(conn_id)}='postgresql://user@host:5432/database'"
        + (f", or set {DSN_ENV}" if conn_id == DEFAULT_CONN_ID else ""))


def resolve_dsn(conn_id: str = DEFAULT_CONN_ID, *, setting: str = "postgres_conn_id") -> str:
    """The DSN of connection ``conn_id`` (see the module docstring for the order)."""
    error, found = None, None
    try:
        found = airflow_connection(conn_id)
    except ImportError:
        pass
    except Exception as exc:  # the SDK raises its own not-found type
        error = exc
    if found is not None:  # (a bad extra is the user's to hear of, not a missing connection)
        return dsn_from_connection(found)
    return fallback_dsn(conn_id, setting, error)


def fallback_dsn(conn_id: str, setting: str, error: Exception | None) -> str:
    """ONCEFLOW_PG_DSN for the coordinator's connection where Airflow has none; else the
    ConfigError that says how to create the connection."""
    dsn = settings.get("pg_dsn") if conn_id == DEFAULT_CONN_ID else None
    if dsn:
        return dsn
    raise _missing(conn_id, setting, error)
