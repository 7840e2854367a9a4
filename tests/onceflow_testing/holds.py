"""Faults from outside the code under test, for tests that run real DAGs.

A test holds a lock in a PostgreSQL transaction of its own (``Hold``) that a task's statement
needs: the task waits there, which the test sees in pg_stat_activity (a backend whose
``pg_blocking_pids`` is the hold's). Then the test

- lets it go on (``release``): the task was surely in flight meanwhile, no timing window;
- cancels the waiting statement (``cancel``): the task's try fails with QueryCanceled, as
  with any database error, and Airflow retries it;
- kills the task's process (``kill_child``): a process the test started, by PID, after
  checking its ancestry and command line.

``hold_staging`` holds a processing group's staging at its last statement: an uncommitted row
of the test with the key of the group's ``staged_groups`` row makes that INSERT wait (the rows
before it are written, not committed). Nothing else waits for it: other groups, attempts and
txids have other keys, and readers do not see an uncommitted row.

``airflow_writes_held`` takes Airflow's metadata database for writing: a task that finished
its work waits there before Airflow records it (a commit done in PostgreSQL, not yet in
Airflow), where the test kills its process.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psutil
import psycopg2

APPLICATION = "onceflow-test-hold"


@dataclass(frozen=True)
class Waiter:
    """A backend waiting for the hold: its pid, application_name and statement."""

    pid: int
    application: str
    query: str


class Hold:
    """``statement`` run in a transaction of the test's own, left open until ``release``."""

    def __init__(self, dsn: str, statement: str, params: tuple = (), what: str = ""):
        self.what = what or statement
        self.conn = psycopg2.connect(dsn, application_name=APPLICATION)
        self.pid = self.conn.get_backend_pid()
        # pg_stat_activity is a snapshot per transaction: looks go through a connection of
        # their own, one look per statement
        self._looks = psycopg2.connect(dsn, application_name=APPLICATION)
        self._looks.autocommit = True
        with self.conn.cursor() as cur:
            cur.execute(statement, params)
        self.cancelled: list[Waiter] = []

    def waiters(self) -> list[Waiter]:
        with self._looks.cursor() as cur:
            cur.execute("""SELECT pid, application_name, query FROM pg_stat_activity
                           WHERE %s = ANY(pg_blocking_pids(pid)) ORDER BY pid""", (self.pid,))
            return [Waiter(*row) for row in cur.fetchall()]

    def wait_for_waiter(self, timeout: float = 240, alive=None) -> Waiter:
        """The first backend that waits for the hold. ``alive``: a process whose end means
        nothing will come (its output is in the assertion)."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.waiters()
            if found:
                return found[0]
            if alive is not None and alive.poll() is not None:
                raise AssertionError(f"nothing waited for {self.what}: the process ended "
                                     f"({alive.returncode})")
            assert time.monotonic() < deadline, f"nothing waited for {self.what}"
            time.sleep(0.2)

    def cancel(self, waiter: Waiter, timeout: float = 60) -> None:
        """Cancel ``waiter``'s statement (it waits for this hold: nothing else is touched),
        and wait until it no longer waits."""
        with self._looks.cursor() as cur:
            cur.execute("SELECT pg_cancel_backend(%s)", (waiter.pid,))
            assert cur.fetchone()[0], f"backend {waiter.pid} was not cancelled"
        deadline = time.monotonic() + timeout
        while any(w.pid == waiter.pid for w in self.waiters()):
            assert time.monotonic() < deadline, f"backend {waiter.pid} still waits"
            time.sleep(0.1)
        self.cancelled.append(waiter)

    def cancel_in_background(self, times: int = 1, timeout: float = 240) -> Canceller:
        """A thread that cancels the first ``times`` statements that wait for the hold
        (for a DAG run in this process: dag.test() runs in the test's own thread)."""
        return Canceller(self, times, timeout)

    def release(self) -> None:
        if not self.conn.closed:
            self.conn.rollback()
            self.conn.close()
        if not self._looks.closed:
            self._looks.close()

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Canceller(threading.Thread):
    def __init__(self, hold: Hold, times: int, timeout: float):
        super().__init__(name="onceflow-test-canceller", daemon=True)
        self.hold, self.times, self.timeout = hold, times, timeout
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            for _ in range(self.times):
                self.hold.cancel(self.hold.wait_for_waiter(self.timeout))
        except BaseException as error:  # reported by finish(), in the test's thread
            self.error = error

    def finish(self, timeout: float = 60) -> list[Waiter]:
        self.join(timeout)
        assert not self.is_alive(), "the canceller is still waiting"
        if self.error is not None:
            raise self.error
        return self.hold.cancelled


def hold_staging(dsn: str, pipeline: str, txid: int, attempt: int, group: int = 0) -> Hold:
    """Hold the staging of (``txid``, ``attempt``, ``group``) at its last statement (see the
    module docstring)."""
    return Hold(dsn, """INSERT INTO staged_groups (pipeline, txid, attempt, grp, records,
                                                   rejected, delta_rows)
                        VALUES (%s, %s, %s, %s, 0, 0, 0)""", (pipeline, txid, attempt, group),
                what=f"the staging of txid {txid} attempt {attempt} group {group}")


def is_descendant(pid: int) -> bool:
    """Whether ``pid`` is a process this test process started (directly or not)."""
    try:
        return any(parent.pid == os.getpid() for parent in psutil.Process(pid).parents())
    except psutil.NoSuchProcess:
        return False


def kill_child(proc: subprocess.Popen, pid: int, marker: str) -> int:
    """SIGKILL ``pid`` (``proc`` or one of its descendants, whose command line holds
    ``marker``): refused for any other process. Waits until it is gone; returns ``proc``'s
    exit status when ``pid`` is ``proc`` (-SIGKILL), else 0."""
    process = psutil.Process(pid)
    assert is_descendant(pid) and (pid == proc.pid or any(
        p.pid == proc.pid for p in process.parents())), f"pid {pid} is not this test's"
    assert marker in " ".join(process.cmdline()), (pid, process.cmdline())
    process.send_signal(signal.SIGKILL)
    if pid == proc.pid:
        return proc.wait(timeout=60)
    process.wait(timeout=60)
    return 0


@contextmanager
def airflow_writes_held(timeout: float = 30) -> Iterator[sqlite3.Connection]:
    """Airflow's metadata database (the suite's SQLite file) taken for writing by the test
    (BEGIN IMMEDIATE: readers go on), until the block ends: a dag.test() that reports to
    Airflow meanwhile (a task's XCom, its state) waits there, for SQLite's busy timeout, then
    fails. Yields the connection, which reads the database as it is."""
    from airflow import settings  # Airflow is loaded only by the tests that run it

    url = settings.SQL_ALCHEMY_CONN
    assert url.startswith("sqlite:///"), f"Airflow's metadata database is not SQLite: {url}"
    held = sqlite3.connect(url.removeprefix("sqlite:///"), timeout=timeout,
                           isolation_level=None)
    try:
        held.execute("BEGIN IMMEDIATE")
        yield held
    finally:
        held.execute("ROLLBACK")
        held.close()
