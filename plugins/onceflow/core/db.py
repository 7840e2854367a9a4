"""PostgreSQL access: connections and the migration runner.

Everything here is plain psycopg2 so it runs in the scheduler, the triggerer, the Spark driver
and the tests alike. Identifiers always go through ``psycopg2.sql``. The numbered migrations
ship inside the package (``onceflow.migrations``, the repository's sql/ folder).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.resources import files

import psycopg2
import psycopg2.extensions
from psycopg2 import sql

from onceflow.core import settings
from onceflow.core.connections import DSN_ENV, safe_dsn
from onceflow.core.errors import ConfigError, Unreachable

log = logging.getLogger(__name__)

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/onceflow"
# A fixed key for pg_advisory_xact_lock so two `onceflow init` never migrate at once.
_MIGRATION_LOCK = 0x6F6E6365


def migration_files() -> list:
    """The numbered migrations, in order (package data of onceflow.migrations)."""
    found = sorted((p for p in files("onceflow.migrations").iterdir() if p.name[:3].isdigit()
                    and p.name.endswith(".sql")), key=lambda p: p.name)
    if not found:
        raise ConfigError("onceflow's migrations are missing from the installed package: "
                          "reinstall onceflow")
    return found


def dsn_from_env() -> str:
    return settings.get("pg_dsn") or DEFAULT_DSN


def connect(dsn: str | None = None, *, application_name: str = "onceflow"):
    """A new connection; autocommit off, so every unit of work is one explicit transaction.
    A server that does not answer raises Unreachable, naming the DSN (without its password),
    the setting it came from and how to start the local one."""
    dsn = dsn or dsn_from_env()
    try:
        conn = psycopg2.connect(dsn, application_name=application_name, connect_timeout=10)
    except psycopg2.OperationalError as error:
        raise unreachable(dsn, error) from error
    conn.autocommit = False
    return conn


def unreachable(dsn: str, error: Exception) -> Unreachable:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return Unreachable(
        f"PostgreSQL at {safe_dsn(dsn)} does not answer ({first}). It comes from {DSN_ENV} "
        f"(or the Airflow connection onceflow_pg in tasks). Point that at a running server, "
        "or start the local one: `bash run.sh onceflow pg`")


@contextmanager
def connection(dsn: str | None = None, *, application_name: str = "onceflow"):
    """A new connection (see connect), closed when the block ends."""
    conn = connect(dsn, application_name=application_name)
    try:
        yield conn
    finally:
        conn.close()


@contextmanager
def transaction(conn) -> Iterator[psycopg2.extensions.cursor]:
    """One PostgreSQL transaction: commit on success, roll back on any exception."""
    try:
        with conn.cursor() as cur:
            yield cur
        conn.commit()
    except BaseException:
        conn.rollback()
        raise


def database_name(dsn: str) -> str:
    return psycopg2.extensions.parse_dsn(dsn).get("dbname", "postgres")


def with_database(dsn: str, dbname: str) -> str:
    params = psycopg2.extensions.parse_dsn(dsn)
    params["dbname"] = dbname
    return psycopg2.extensions.make_dsn(**params)


def ensure_database(dsn: str) -> bool:
    """Create the DSN's database if it does not exist. Returns True when it was created."""
    name = database_name(dsn)
    try:
        admin = psycopg2.connect(with_database(dsn, "postgres"),
                                 application_name="onceflow-init", connect_timeout=10)
    except psycopg2.OperationalError as error:
        raise unreachable(dsn, error) from error
    admin.autocommit = True  # CREATE DATABASE cannot run inside a transaction block
    try:
        with admin.cursor() as cur:
            cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
            if cur.fetchone():
                return False
            try:
                cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            except psycopg2.errors.DuplicateDatabase:
                return False  # created concurrently by someone else: fine
            log.info("created database %s", name)
            return True
    finally:
        admin.close()


def migrate(conn) -> list[str]:
    """Apply every migration not yet recorded, each in its own transaction. Returns the new ones.

    A migration that ran is recorded with its checksum; a changed file that already ran is
    refused rather than silently skipped.
    """
    applied: list[str] = []
    with transaction(conn) as cur:
        cur.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        cur.execute(
            """CREATE TABLE IF NOT EXISTS onceflow_migrations (
                   version    text PRIMARY KEY,
                   checksum   text NOT NULL,
                   applied_at timestamptz NOT NULL DEFAULT now())"""
        )
        cur.execute("SELECT version, checksum FROM onceflow_migrations")
        done = dict(cur.fetchall())
        for path in migration_files():
            text = path.read_text()
            checksum = hashlib.sha256(text.encode()).hexdigest()
            if path.name in done:
                if done[path.name] != checksum:
                    raise ConfigError(
                        f"migration {path.name} changed after it was applied; add a new numbered "
                        "migration instead of editing an applied one"
                    )
                continue
            cur.execute(text)
            cur.execute(
                "INSERT INTO onceflow_migrations (version, checksum) VALUES (%s, %s)",
                (path.name, checksum),
            )
            applied.append(path.name)
            log.info("applied migration %s", path.name)
    return applied


def schema_version(cur) -> str | None:
    """The newest migration applied, or None before `onceflow init`."""
    cur.execute("SELECT to_regclass('onceflow_migrations') IS NOT NULL")
    if not cur.fetchone()[0]:
        return None
    cur.execute("SELECT max(version) FROM onceflow_migrations")
    return cur.fetchone()[0]


def up_to_date(conn) -> bool:
    """Every shipped migration is applied (cheap: one query; a migration numbered below the
    newest applied one, e.g. from a merge, counts too)."""
    with transaction(conn) as cur:
        cur.execute("SELECT to_regclass('onceflow_migrations') IS NOT NULL")
        if not cur.fetchone()[0]:
            return False
        cur.execute("SELECT array_agg(version) FROM onceflow_migrations")
        applied = set(cur.fetchone()[0] or ())
    return {path.name for path in migration_files()} <= applied
