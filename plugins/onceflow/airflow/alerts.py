"""Commit lag alerts: a pipeline whose committed state falls behind says so, to a person.

A pipeline declares the lag it tolerates and whom to tell::

    PAGE_VIEWS = Pipeline(..., commit_lag_alert=timedelta(minutes=30),
                          commit_lag_notifier="my_company.alerts:PAGER")

``commit_lag_notifier`` is an Airflow notifier (a ``BaseNotifier`` instance, e.g. Slack's or
SMTP's) or a function ``(context) -> None``, or its ``"module:attribute"`` reference; the
context carries ``commit_lag`` (``CommitLag.as_dict()``: ``message``, ``seconds``, ``what``,
``fix``, ...), so a notifier's template can say ``{{ commit_lag.message }}``.

**What commit lag is** (``measure``): how long the oldest work that is not committed has
waited. Work is an open transaction (planned, failed, superseded or abandoned: since it was
planned) or records of the source no commit has covered yet (since they arrived, as the
pipeline's freshness measures it, onceflow.core.freshness: the PostgreSQL log's
``produced_at``, a segment's index time, a landed file's modification time, a table's
``time_column`` or when its head was first seen; unknown: since the last commit or the
pipeline's registration). Nothing waiting: 0. So a pipeline that commits regularly has a
lag of about its schedule; one blocked behind a failed txid, or that nobody triggers, grows
without bound.

**Where it is checked**: the DAG ``onceflow_<name>_commit_lag`` (``commit_lag_dag``;
``transaction_dags()`` gives every pipeline that declares ``commit_lag_alert`` one), a single
``check_commit_lag`` task every ``check_every`` (a quarter of the alert, from 1 to 15 minutes).
Over the alert, the task calls the notifier once per stall (a later check of the same stall
does not call it again) and fails with the message: the failed run is the alert in Airflow's
UI, and the DAG's own ``on_failure_callback`` fires too.

Decided: a monitoring DAG, not Airflow's ``DeadlineAlert`` on the transaction DAG. A
DeadlineAlert times one DAG run from its own queue time or logical date; commit lag belongs to
the pipeline across runs. A run that failed and whose txid the next run committed keeps its
deadline (Airflow prunes deadlines only when a run succeeds) and would page for nothing; a
pipeline nobody triggers has no run and so no deadline; and only the scheduler evaluates
deadlines (``dag.test()`` creates the row and never fires it), so it could not be tested here.
A per-run limit is still one argument away: ``transaction_dag(P, deadline=DeadlineAlert(...))``.
"""

from __future__ import annotations

import copy
import logging
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import DAG, BaseNotifier, BaseOperator

from onceflow.airflow.compat import AirflowFailException
from onceflow.airflow.operators import airflow_outcomes, load_pipeline, run_note
from onceflow.core import offsets, txlog
from onceflow.core.connections import DEFAULT_CONN_ID, resolve_dsn
from onceflow.core.db import connection, transaction
from onceflow.core.errors import ConfigError
from onceflow.core.pipeline import Pipeline, resolve
from onceflow.core.registry import reference_of

log = logging.getLogger(__name__)

MIN_CHECK_EVERY = timedelta(minutes=1)
MAX_CHECK_EVERY = timedelta(minutes=15)
TASK_ID = "check_commit_lag"


def monitor_dag_id(name: str) -> str:
    return f"onceflow_{name}_commit_lag"


def default_check_every(alert: timedelta) -> timedelta:
    """A quarter of the alert's lag, from 1 to 15 minutes."""
    return min(max(alert / 4, MIN_CHECK_EVERY), MAX_CHECK_EVERY)


def pipeline_with_refs(pipeline: Pipeline | str, refs: Iterable[str] = ()
                       ) -> tuple[Pipeline, tuple[str, ...]]:
    """The pipeline (a Pipeline or a registered name) and the references its tasks pass on,
    as ``transaction_dag`` resolves them."""

    refs = tuple(refs)
    if isinstance(pipeline, str):
        return load_pipeline(pipeline, refs), refs
    pipeline.validate()
    ref = reference_of(pipeline)
    if ref is None:
        raise ConfigError(
            f"pipeline {pipeline.name!r} has no reference other processes can load: declare it "
            "at the top level of an importable module (not the DAG file), or register it "
            "(entry point onceflow.pipelines / ONCEFLOW_PIPELINES)")
    return pipeline, refs if ref in refs else (*refs, ref)


def _span(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 120:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 120:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


@dataclass(frozen=True)
class CommitLag:
    """How far a pipeline's committed state trails (see the module docstring)."""

    pipeline: str
    seconds: float  # 0: nothing waits
    waiting_since: datetime | None
    what: str  # the oldest work waiting, in words
    fix: str  # what frees it
    last_committed: int
    last_commit_at: datetime | None
    open_txids: tuple[int, ...]
    records_waiting: int  # records of the source no commit has covered yet

    def over(self, limit: timedelta) -> bool:
        return self.seconds > limit.total_seconds()

    def message(self, limit: timedelta | None = None) -> str:
        if self.waiting_since is None:
            return f"commit lag of {self.pipeline}: 0s ({self.what})"
        head = f"commit lag of {self.pipeline} is {_span(self.seconds)}"
        if limit is not None:
            head += f" (alert at {_span(limit.total_seconds())})"
        last = (f"last commit: txid {self.last_committed} at "
                f"{self.last_commit_at:%Y-%m-%d %H:%M:%S %Z}" if self.last_commit_at
                else "nothing committed yet")
        return f"{head}: {self.what}; {last}. {self.fix}"

    def as_dict(self, limit: timedelta | None = None) -> dict[str, Any]:
        return {"pipeline": self.pipeline, "seconds": round(self.seconds, 3),
                "waiting_since": self.waiting_since.isoformat() if self.waiting_since else None,
                "what": self.what, "fix": self.fix, "last_committed": self.last_committed,
                "last_commit_at": self.last_commit_at.isoformat() if self.last_commit_at
                else None,
                "open_txids": list(self.open_txids), "records_waiting": self.records_waiting,
                "alert_seconds": limit.total_seconds() if limit else None,
                "message": self.message(limit)}


def measure(cur, pipeline: Pipeline) -> CommitLag:
    """The commit lag of ``pipeline`` now (the database's clock), read in ``cur``'s
    transaction. A pipeline not initialised yet (no begin ran) has nothing waiting."""

    name = pipeline.name
    cur.execute("SELECT now(), last_committed_txid, created_at FROM pipelines WHERE name = %s",
                (name,))
    row = cur.fetchone()
    if row is None:
        return CommitLag(name, 0.0, None, "not initialised: no transaction ran yet", "", 0,
                         None, (), 0)
    now, last_committed, created_at = row
    cur.execute("SELECT committed_at FROM transactions WHERE pipeline = %s AND txid = %s",
                (name, last_committed))
    found = cur.fetchone()
    last_commit_at = found[0] if found else None
    open_rows = txlog.history(cur, name, 10_000, open_only=True)
    cur.execute("SELECT txid, planned_at FROM transactions WHERE pipeline = %s "
                "AND state <> 'committed' ORDER BY planned_at, txid LIMIT 1", (name,))
    oldest_open = cur.fetchone()

    committed = offsets.committed(cur, name)
    waiting, points = 0, []
    for partition, position in sorted(pipeline.source.positions(cur).items()):
        done = max(committed.get(partition, position.log_start), position.log_start)
        if position.head > done:
            waiting += position.head - done
            points.append((partition, done))
    # when the oldest record not committed arrived (onceflow.core.freshness: the source's
    # own record of it, or when its head was first seen)
    arrivals = list(pipeline.source.arrivals(cur, points).values()) if points else []
    dag_id = f"onceflow_{name}"
    times = []
    if oldest_open is not None:
        times.append(oldest_open[1])
    if waiting:
        known = [a for a in arrivals if a is not None]
        times.append(min(known) if known else (last_commit_at or created_at))
    if not times:
        return CommitLag(name, 0.0, None, "nothing waits", "", last_committed, last_commit_at,
                         (), 0)
    if open_rows:  # what holds the commits up: the lowest open txid
        first = open_rows[0]
        if first.state in txlog.ADOPTABLE or first.abandoned:
            state = "abandoned" if first.abandoned else str(first.state)
            what = f"txid {first.txid} is {state}" + (f": {first.reason}" if first.reason else "")
            fix = (f"Backfill it: `onceflow backfill --pipeline {name}`, or trigger {dag_id} "
                   f'with {{"txid": {first.txid}}}.')
        else:
            what = (f"txid {first.txid} (attempt {first.attempt}, run {first.run_id}) is "
                    f"{first.state}, not committed")
            fix = f"See its run in {dag_id} and `onceflow status --pipeline {name}`."
        if waiting:
            what += f" ({waiting:,} record(s) of the source not committed)"
    else:
        what = (f"{waiting:,} record(s) of the source are not committed and no transaction "
                "plans them")
        fix = f"Trigger {dag_id} (is it paused, or without a schedule?)."
    since = min(times)
    return CommitLag(name, max(0.0, (now - since).total_seconds()), since, what, fix,
                     last_committed, last_commit_at, tuple(r.txid for r in open_rows), waiting)


def notifiers_of(pipeline: Pipeline) -> list:
    """The pipeline's commit lag notifiers: a BaseNotifier, a function (context) -> None, a
    "module:attribute" reference to one, or a tuple of those."""

    value = pipeline.commit_lag_notifier
    if value is None:
        return []
    items = value if isinstance(value, list | tuple) else [value]
    what = f"pipeline[{pipeline.name}].commit_lag_notifier"
    out = []
    for item in items:
        target = resolve(item, what)
        if not callable(target):
            raise ConfigError(f"{what}={item!r} is {type(target).__name__}: give an Airflow "
                              "notifier (BaseNotifier) or a function (context) -> None")
        out.append(target)
    return out


def notify(pipeline: Pipeline, context: dict, lag: CommitLag, limit: timedelta) -> int:
    """Call every notifier of ``pipeline`` with ``context`` (which gains ``commit_lag``).
    A notifier that raises is logged and the others still run. Returns how many succeeded."""

    context["commit_lag"] = lag.as_dict(limit)
    ok = 0
    for target in notifiers_of(pipeline):
        try:
            if isinstance(target, BaseNotifier):
                # rendering its templates is in place: a fresh copy each time
                copy.deepcopy(target)(context)
            else:
                target(context)
            ok += 1
        except Exception as error:
            log.error("commit lag notifier %r of %s failed: %r", target, pipeline.name, error)
    return ok


def _note(context, pipeline: str, text: str) -> None:
    """The run's note (onceflow.airflow.ui.notes) says what the check found."""

    run_note(context, lambda notes: {"kind": "commit-lag", "text": text, "pipeline": pipeline,
                                     "txid": None, "attempt": None, "final": True})


class CommitLagCheckOperator(BaseOperator):
    """Measure a pipeline's commit lag; over its ``commit_lag_alert``, call its notifiers
    (once per stall: a later check of the same stall does not call them again) and fail with
    the message. Under it, return the measure.

    :param pipeline: the registered pipeline's name.
    :param pipeline_refs: where the pipeline is declared, besides the registry.
    :param postgres_conn_id: the coordinator's PostgreSQL connection.
    :param alert: the lag that alerts (default: the pipeline's ``commit_lag_alert``).
    """

    ui_color = "#f6d5c5"

    def __init__(self, *, pipeline: str, pipeline_refs: Iterable[str] = (),
                 postgres_conn_id: str = DEFAULT_CONN_ID, alert: timedelta | None = None,
                 **kwargs):
        super().__init__(**kwargs)
        self.pipeline = pipeline
        self.pipeline_refs = tuple(pipeline_refs)
        self.postgres_conn_id = postgres_conn_id
        self.alert = alert

    def execute(self, context) -> dict[str, Any]:
        with airflow_outcomes():
            pipeline = load_pipeline(self.pipeline, self.pipeline_refs)
            limit = self.alert or pipeline.commit_lag_alert
            if limit is None:
                raise ConfigError(f"pipeline {pipeline.name!r} declares no commit_lag_alert: "
                                  "set it (e.g. timedelta(minutes=30)) or pass alert=")
            with connection(resolve_dsn(self.postgres_conn_id),
                            application_name="onceflow-commit-lag") as conn, \
                    transaction(conn) as cur:
                lag = measure(cur, pipeline)
        self.log.info("COMMIT LAG pipeline=%s lag=%.1fs alert=%.0fs waiting_since=%s: %s",
                      pipeline.name, lag.seconds, limit.total_seconds(),
                      lag.waiting_since.isoformat() if lag.waiting_since else "-", lag.what)
        if not lag.over(limit):
            _note(context, pipeline.name,
                  f"commit lag of {pipeline.name} is {_span(lag.seconds)} (alert at "
                  f"{_span(limit.total_seconds())}): no alert")
            return lag.as_dict(limit)
        _note(context, pipeline.name, lag.message(limit))
        stall = lag.waiting_since.isoformat()
        ti = context["ti"]
        told = ti.xcom_pull(task_ids=self.task_id, key="alerted", include_prior_dates=True)
        if stall in (told if isinstance(told, list) else [told]):
            self.log.info("notifiers were called for this stall already (waiting since %s)",
                          stall)
        elif notify(pipeline, context, lag, limit) or not notifiers_of(pipeline):
            ti.xcom_push(key="alerted", value=stall)
        raise AirflowFailException(lag.message(limit))


DOC = """
### onceflow: commit lag of {name}

Every {every}, `check_commit_lag` measures how long the oldest work that is not committed has
waited (an open transaction since it was planned, source records since they arrived). Over
**{alert}** the task fails with what waits and how to free it, and calls the pipeline's
notifier (once per stall). Its log has one `COMMIT LAG pipeline={name} lag=...` line per check.
"""


def commit_lag_dag(pipeline: Pipeline | str, *, dag_id: str | None = None,
                   pipeline_refs: Iterable[str] = (), check_every: timedelta | None = None,
                   alert: timedelta | None = None, start_date: datetime | None = None,
                   tags: Iterable[str] = (), postgres_conn_id: str = DEFAULT_CONN_ID,
                   **dag_kwargs: Any) -> DAG:
    """The monitoring DAG of ``pipeline``'s commit lag (``onceflow_<name>_commit_lag``):
    one check every ``check_every`` (default: a quarter of the alert, 1 to 15 minutes)."""
    pipeline, refs = pipeline_with_refs(pipeline, pipeline_refs)
    limit = alert or pipeline.commit_lag_alert
    if limit is None:
        raise ConfigError(f"pipeline {pipeline.name!r} declares no commit_lag_alert: set it "
                          "(e.g. commit_lag_alert=timedelta(minutes=30)) or pass alert=")
    every = check_every or default_check_every(limit)
    with DAG(
        dag_id=dag_id or monitor_dag_id(pipeline.name),
        description=f"onceflow: alert when {pipeline.name}'s commit lag passes "
                    f"{_span(limit.total_seconds())}",
        doc_md=DOC.format(name=pipeline.name, every=_span(every.total_seconds()),
                          alert=_span(limit.total_seconds())),
        schedule=every,
        start_date=start_date or datetime(2026, 1, 1),
        catchup=False,
        max_active_runs=1,
        tags=["onceflow", "commit-lag", *tags],
        default_args={"retries": 1, "retry_delay": timedelta(seconds=30)},
        **dag_kwargs,
    ) as dag:
        CommitLagCheckOperator(task_id=TASK_ID, pipeline=pipeline.name, pipeline_refs=refs,
                               postgres_conn_id=postgres_conn_id, alert=alert,
                               execution_timeout=timedelta(minutes=5))
    dag.fileloc = sys._getframe(1).f_globals.get("__file__", dag.fileloc)
    return dag
