"""The coordinator's database as an Airflow hook: a Postgres connection (``onceflow_pg`` by
default) through the postgres provider's hook, so Airflow's connection lookup finds it
wherever the team keeps connections (the metadata database, a secrets backend, an
``AIRFLOW_CONN_*`` variable)."""

from __future__ import annotations

from airflow.providers.postgres.hooks.postgres import PostgresHook

from onceflow.core.connections import (
    DEFAULT_CONN_ID,
    dsn_from_connection,
    fallback_dsn,
    resolve_dsn,
)


class OnceflowHook(PostgresHook):
    """The postgres provider's hook on onceflow's coordinator connection, with the libpq DSN
    onceflow's own code (psycopg2, COPY) connects with."""

    default_conn_name = DEFAULT_CONN_ID
    hook_name = "onceflow coordinator (PostgreSQL)"

    def dsn(self) -> str:
        return resolve_dsn(self.get_conn_id())

    @classmethod
    async def adsn(cls, conn_id: str = DEFAULT_CONN_ID) -> str:
        """dsn() for the triggerer's event loop."""
        try:
            return dsn_from_connection(await cls.aget_connection(conn_id))
        except Exception as error:  # the SDK raises its own not-found type
            return fallback_dsn(conn_id, "postgres_conn_id", error)
