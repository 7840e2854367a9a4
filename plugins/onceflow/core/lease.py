"""An attempt's lease: whatever holds a planned txid says so, or the next run adopts it.

While a task of the attempt runs, a daemon thread (``AttemptLease``) reports every lease / 4
on a connection of its own, so a long Spark batch keeps its txid however long it takes. A task
that dies (a killed worker, a lost machine) stops reporting, and once ``lease_s`` passed the
next run adopts its txid with a new attempt, which fences this one (onceflow.core.txlog): with
the default lease of 60 s that is about a minute after the death. A task that learns it was
fenced meanwhile stops writing by itself: every write checks the fence.

Between two tasks of a run nothing of it runs (the next task waits in Airflow's queue, a retry
waits its delay, a deferred commit waits in the triggerer): the task that ends hands the
attempt over with the longer hand-over lease (Pipeline.handoff_lease_s), which the next task's
first report shortens again. A run that dies there is mostly seen by Airflow, whose failure
callback marks the txid failed at once; else `onceflow release` frees it.

Each report records the reporting process (``holder``: host and pid): `onceflow status`
names it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

from onceflow.core import txlog
from onceflow.core.db import connect, transaction
from onceflow.core.txlog import TransactionAttempt

log = logging.getLogger(__name__)


def this_process() -> str:
    """The holder this process reports as."""
    return f"{socket.gethostname()} pid {os.getpid()}"


def report(dsn: str, pipeline: str, ta: TransactionAttempt, lease_s: int | None = None
           ) -> bool | None:
    """One report of ``ta``'s lease from this process (``lease_s``: the lease from now on;
    None keeps it). True: reported; False: ``ta`` is no longer current (fenced, failed or
    committed); None: the database did not answer (a report missed is not a failure)."""
    try:
        conn = connect(dsn, application_name="onceflow-lease")
    except Exception as error:
        log.warning("lease of %s: could not report (%s)", ta, error)
        return None
    try:
        with transaction(conn) as cur:
            return txlog.heartbeat(cur, pipeline, ta, lease_s=lease_s, holder=this_process())
    except Exception as error:
        log.warning("lease of %s: could not report (%s)", ta, error)
        return None
    finally:
        conn.close()


class AttemptLease:
    """A daemon thread that reports ``ta`` alive every ``every_s`` seconds, from
    ``__enter__`` until ``__exit__`` or ``hand_over``. ``lease_s``: the lease each report
    gives (None: the one the transaction has). ``handoff_s``: the lease left when the block
    ends without an exception (the run goes on in another task); None leaves the last one."""

    def __init__(self, dsn: str, pipeline: str, ta: TransactionAttempt, every_s: float, *,
                 lease_s: int | None = None, handoff_s: int | None = None):
        self.dsn, self.pipeline, self.ta, self.every_s = dsn, pipeline, ta, every_s
        self.lease_s, self.handoff_s = lease_s, handoff_s
        self.current = True  # False once a report found the attempt fenced or ended
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{ta}", daemon=True)

    def report(self, lease_s: int | None = None) -> bool:
        reported = report(self.dsn, self.pipeline, self.ta, lease_s or self.lease_s)
        if reported is not None:
            self.current = reported
        return self.current

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            if not self.report():
                log.warning("lease of %s: the attempt is no longer current (fenced, failed "
                            "or committed)", self.ta)
                return

    def hand_over(self, lease_s: int | None = None) -> None:
        """Stop reporting and leave the attempt with ``lease_s`` (default ``handoff_s``):
        the run goes on in another task (a deferred commit's trigger, a retry). The thread
        stops first, so no later report of its own shortens the lease again."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=10)
        if self.current and (lease_s or self.handoff_s):
            self.report(lease_s or self.handoff_s)

    def __enter__(self) -> AttemptLease:
        self.report()
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and self.handoff_s:
            self.hand_over()
        self._stop.set()
        self._thread.join(timeout=10)
