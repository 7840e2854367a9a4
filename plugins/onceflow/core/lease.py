"""An attempt's lease: while a task of the attempt runs, it says so every few seconds.

An attempt whose tasks stop reporting for ``attempt_lease_s`` (a killed worker, a lost run)
is abandoned: the next run adopts its txid with a new attempt, which fences this one
(onceflow.core.txlog). A task that learns it was fenced meanwhile stops writing by itself:
every write checks the fence.
"""

from __future__ import annotations

import logging
import threading

from onceflow.core import txlog
from onceflow.core.db import connect, transaction
from onceflow.core.txlog import TransactionAttempt

log = logging.getLogger(__name__)


class AttemptLease:
    """A daemon thread that reports ``ta`` alive every ``every_s`` seconds, on a connection
    of its own, from ``__enter__`` until ``__exit__``."""

    def __init__(self, dsn: str, pipeline: str, ta: TransactionAttempt, every_s: float):
        self.dsn, self.pipeline, self.ta, self.every_s = dsn, pipeline, ta, every_s
        self.current = True  # False once a report found the attempt fenced or ended
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{ta}", daemon=True)

    def report(self) -> bool:
        try:
            conn = connect(self.dsn, application_name="onceflow-lease")
        except Exception as error:  # a report missed is not a failure of the task
            log.warning("lease of %s: could not report (%s)", self.ta, error)
            return True
        try:
            with transaction(conn) as cur:
                self.current = txlog.heartbeat(cur, self.pipeline, self.ta)
        except Exception as error:
            log.warning("lease of %s: could not report (%s)", self.ta, error)
        finally:
            conn.close()
        return self.current

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            if not self.report():
                log.warning("lease of %s: the attempt is no longer current (fenced or ended)",
                            self.ta)
                return

    def __enter__(self) -> AttemptLease:
        self.report()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
