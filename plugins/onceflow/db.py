"""PostgreSQL access: connections and the migration runner.

Everything here is plain psycopg2 so it runs in the scheduler, the triggerer, spark-submit's
driver and the tests alike. Identifiers always go through ``psycopg2.sql``.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg2
import psycopg2.extensions
from psycopg2 import sql

log = logging.getLogger(__name__)

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/onceflow"
# A fixed key for pg_advisory_xact_lock so two `onceflow init` never migrate at once.
_MIGRATION_LOCK = 0x6F6E6365


def sql_dir() -> Path:
    """Where the numbered migrations live (the repository's sql/, or ONCEFLOW_SQL_DIR)."""
    override = os.environ.get("ONCEFLOW_SQL_DIR")
    return Path(override) if override else Path(__file__).resolve().parents[2] / "sql"


def dsn_from_env() -> str:
    return os.environ.get("ONCEFLOW_PG_DSN") or DEFAULT_DSN


def connect(dsn: str | None = None, *, application_name: str = "onceflow"):
    """A new connection; autocommit off, so every unit of work is one explicit transaction."""
    conn = psycopg2.connect(dsn or dsn_from_env(), application_name=application_name)
    conn.autocommit = False
    return conn


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
    admin = psycopg2.connect(with_database(dsn, "postgres"), application_name="onceflow-init")
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


def migrations() -> list[Path]:
    files = sorted(sql_dir().glob("[0-9][0-9][0-9]_*.sql"))
    if not files:
        raise FileNotFoundError(
            f"no migrations found in {sql_dir()}: set ONCEFLOW_SQL_DIR to the project's sql/ folder"
        )
    return files


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
        for path in migrations():
            text = path.read_text()
            checksum = hashlib.sha256(text.encode()).hexdigest()
            if path.name in done:
                if done[path.name] != checksum:
                    raise RuntimeError(
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
