"""Find a PostgreSQL to use, or start a private throwaway one.

Order: ``ONCEFLOW_PG_DSN`` if set; else a server answering on 127.0.0.1:5432 (user postgres);
else a private cluster under the project folder (``.pgdata/``, port 54329 by default), made
with the system's initdb / pg_ctl, run as the ``postgres`` user when invoked as root (both
refuse to run as root).
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psycopg2

from onceflow.core import settings
from onceflow.core.db import DEFAULT_DSN, with_database
from onceflow.core.errors import ConfigError

PRIVATE_PORT = settings.get("pg_port")


def _answers(dsn: str) -> bool:
    try:
        psycopg2.connect(with_database(dsn, "postgres"), connect_timeout=3).close()
        return True
    except psycopg2.OperationalError:
        return False


def _pg_bin(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)
    if candidates:
        return candidates[0]
    raise ConfigError(
        f"no PostgreSQL is reachable and {name} is not installed: install PostgreSQL "
        "(Debian/Ubuntu: apt-get install postgresql) or set ONCEFLOW_PG_DSN to a server"
    )


def _as_postgres(cmd: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return cmd
    return ["runuser", "-u", "postgres", "--", *cmd]


def _say(msg: str) -> None:
    print(f"onceflow: {msg}", file=sys.stderr)


def start_private(data_dir: Path, port: int = PRIVATE_PORT) -> str:
    """Start (initialising first if needed) a private cluster in ``data_dir``. Returns its DSN."""
    dsn = f"postgresql://postgres@127.0.0.1:{port}/onceflow"
    if _answers(dsn):
        return dsn
    data_dir.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        shutil.chown(data_dir, "postgres", "postgres")
    if not (data_dir / "PG_VERSION").exists():
        _say(f"initialising a private PostgreSQL cluster in {data_dir}")
        subprocess.run(
            _as_postgres([_pg_bin("initdb"), "-D", str(data_dir), "-U", "postgres",
                          "--auth=trust", "--no-sync"]),
            check=True, stdout=subprocess.DEVNULL,
        )
    _say(f"starting the private PostgreSQL on 127.0.0.1:{port} (data in {data_dir})")
    subprocess.run(
        _as_postgres([
            _pg_bin("pg_ctl"), "-D", str(data_dir), "-l", str(data_dir / "server.log"), "-w",
            "-o", f"-p {port} -k {data_dir} -c listen_addresses=127.0.0.1", "start",
        ]),
        check=True, stdout=subprocess.DEVNULL,
    )
    return dsn


def running_private(data_dir: Path) -> bool:
    """Whether the private cluster in ``data_dir`` runs (its postmaster's pid file is there)."""
    return (data_dir / "postmaster.pid").exists()


def stop_private(data_dir: Path) -> None:
    if running_private(data_dir):
        subprocess.run(_as_postgres([_pg_bin("pg_ctl"), "-D", str(data_dir), "-m", "fast",
                                     "stop"]), check=False)


def private_data_dir(project_dir: Path) -> Path:
    """``.pgdata`` in the project, unless we are root and the ``postgres`` user cannot reach
    the project folder (e.g. under /root or a 0700 temporary folder): then a folder under
    /var/tmp named after the project's path."""
    data_dir = project_dir / ".pgdata"
    if os.geteuid() != 0:
        return data_dir
    reachable = subprocess.run(["runuser", "-u", "postgres", "--", "test", "-x", str(project_dir)],
                               check=False).returncode == 0
    if reachable:
        return data_dir
    tag = hashlib.sha256(str(project_dir.resolve()).encode()).hexdigest()[:12]
    return Path("/var/tmp") / f"onceflow-pgdata-{tag}"


def ensure_postgres(project_dir: Path) -> tuple[str, str]:
    """(DSN, how it was found)."""
    if settings.get("pg_dsn"):
        return settings.get("pg_dsn"), settings.env_name("pg_dsn")
    if _answers(DEFAULT_DSN):
        return DEFAULT_DSN, "the PostgreSQL server on 127.0.0.1:5432"
    data_dir = private_data_dir(project_dir)
    return start_private(data_dir), f"a private PostgreSQL cluster in {data_dir}"


def crash_restart(data_dir: Path) -> None:
    """Restart a private cluster in immediate mode: PostgreSQL stops as in a crash (no
    checkpoint) and recovers at start, emptying unlogged tables (the fault tests)."""
    subprocess.run(_as_postgres([_pg_bin("pg_ctl"), "-D", str(data_dir), "-m", "immediate",
                                 "-w", "restart"]),
                   check=True, stdout=subprocess.DEVNULL)

