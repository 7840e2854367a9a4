"""Finding PostgreSQL, and the private throwaway cluster used when none answers."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

import psycopg2
import pytest

from onceflow.dev.localpg import ensure_postgres, start_private, stop_private


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_onceflow_pg_dsn_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("ONCEFLOW_PG_DSN", "postgresql://someone@db.invalid:1/x")
    assert ensure_postgres(tmp_path) == ("postgresql://someone@db.invalid:1/x", "ONCEFLOW_PG_DSN")


@pytest.mark.timeout(120)
def test_private_cluster_starts_answers_and_stops():
    # A folder the postgres user can enter even when the tests run as root.
    data_dir = Path(tempfile.mkdtemp(prefix="onceflow-pg-")) / "data"
    os.chmod(data_dir.parent, 0o755)
    port = _free_port()
    try:
        dsn = start_private(data_dir, port)
        assert f":{port}/" in dsn
        conn = psycopg2.connect(dsn.replace("/onceflow", "/postgres"))
        with conn.cursor() as cur:
            cur.execute("SELECT current_setting('port')::int")
            assert cur.fetchone()[0] == port
        conn.close()
        assert start_private(data_dir, port) == dsn  # already running: reused as is
    finally:
        stop_private(data_dir)
        shutil.rmtree(data_dir.parent, ignore_errors=True)
    with pytest.raises(psycopg2.OperationalError):
        psycopg2.connect(dsn.replace("/onceflow", "/postgres"), connect_timeout=2)
