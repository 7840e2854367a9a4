"""PostgreSQL access: connections and the migration runner.

Everything here is plain psycopg2 so it runs in the scheduler, the triggerer, the Spark driver
and the tests alike. Identifiers always go through ``psycopg2.sql``. The numbered migrations
ship inside the package (``onceflow.migrations``, the repository's sql/ folder).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.resources import files

import psycopg2
import psycopg2.extensions
from psycopg2 import sql

from onceflow.core import settings
from onceflow.core.connections import DSN_ENV, safe_dsn
from onceflow.core.errors import ConfigError, Unavailable, Unreachable

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
    A server that refuses connections, is starting up or is in recovery (a restart) is tried
    again with a backoff for ``pg_connect_retry_s`` (each try logged), then Unavailable,
    which Airflow retries; one that answers with an error waiting cannot fix (a wrong
    password, a missing database) raises Unreachable at once. Both name the DSN (without its
    password) and where it came from."""
    dsn = dsn or dsn_from_env()
    conn = _connect(dsn, application_name)
    conn.autocommit = False
    return conn


# What libpq says while a server is restarting, shutting down or out of connection slots:
# trying again helps. Anything else (authentication, a missing database or role, a bad DSN,
# a host name that does not exist) does not.
_PASSING = ("connection refused", "the database system is starting up",
            "the database system is in recovery mode", "not yet accepting connections",
            "the database system is shutting down", "server closed the connection",
            "timeout expired", "too many clients", "no such file or directory",
            "temporary failure in name resolution", "could not receive data from server")
_FIRST_DELAY_S, _MAX_DELAY_S = 0.5, 5.0


def passing(error: Exception) -> bool:
    """Whether ``error`` (from connecting) is one that a restarting server gives."""
    text = str(error).lower()
    return any(phrase in text for phrase in _PASSING)


def _connect(dsn: str, application_name: str, *, dbname: str | None = None):
    """psycopg2.connect, tried again while the server is passing through a restart (see
    connect). ``dbname``: connect to that database of the DSN's server instead."""
    target = with_database(dsn, dbname) if dbname else dsn
    budget = float(settings.get("pg_connect_retry_s"))
    started, tries, delay = time.monotonic(), 0, _FIRST_DELAY_S
    while True:
        tries += 1
        try:
            conn = psycopg2.connect(target, application_name=application_name,
                                    connect_timeout=10)
        except psycopg2.OperationalError as error:
            if not passing(error):
                raise unreachable(dsn, error) from error
            elapsed = time.monotonic() - started
            if elapsed + delay > budget:
                raise unavailable(dsn, error, tries, elapsed) from error
            log.warning("PostgreSQL at %s does not answer yet (%s): try %d failed, trying "
                        "again in %.1fs (for up to %.0fs: %s)", safe_dsn(dsn), _first(error),
                        tries, delay, budget, settings.env_name("pg_connect_retry_s"))
            time.sleep(delay)
            delay = min(delay * 2, _MAX_DELAY_S)
            continue
        if tries > 1:
            log.warning("PostgreSQL at %s answered at try %d, after %.1fs", safe_dsn(dsn),
                        tries, time.monotonic() - started)
        return conn


def _first(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


_WHERE = (f"The DSN comes from {DSN_ENV} (the CLI, the Spark driver) or, in Airflow's tasks, "
          "the Airflow connection onceflow_pg")


def unreachable(dsn: str, error: Exception) -> Unreachable:
    return Unreachable(
        f"PostgreSQL at {safe_dsn(dsn)} does not answer ({_first(error)}). {_WHERE}: check "
        "its host, port, database, user and password, and that PostgreSQL runs there")


def unavailable(dsn: str, error: Exception, tries: int, elapsed: float) -> Unavailable:
    return Unavailable(
        f"PostgreSQL at {safe_dsn(dsn)} does not answer ({_first(error)}), {tries} tries in "
        f"{elapsed:.1f}s. {_WHERE}: check that PostgreSQL runs there and accepts connections "
        f"(a task fails to be retried by Airflow; {settings.env_name('pg_connect_retry_s')} "
        "sets how long a connection is tried)")


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
    admin = _connect(dsn, "onceflow-init", dbname="postgres")
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


def recreate_database(server_dsn: str, name: str, *, schema: bool = True) -> str:
    """The database ``name`` on the server of ``server_dsn``, dropped if it exists (its
    sessions ended) and created again, empty, with onceflow's schema when ``schema`` (every
    migration applied); its DSN. For a benchmark's or a test's own database, never a user's."""
    admin = _connect(server_dsn, "onceflow-recreate", dbname="postgres")
    admin.autocommit = True  # CREATE DATABASE cannot run inside a transaction block
    try:
        with admin.cursor() as cur:
            cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))
            cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    finally:
        admin.close()
    dsn = with_database(server_dsn, name)
    if schema:
        with connection(dsn) as conn:
            migrate(conn)
    return dsn


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
