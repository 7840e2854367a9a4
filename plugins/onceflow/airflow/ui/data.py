"""What the onceflow view shows and what its actions do, from onceflow's own functions.

Everything here runs inside Airflow's server processes (the api-server; the scheduler for
notes), never in a task: the coordinator's DSN comes from the Airflow connection
``onceflow_pg`` as the server sees it (environment, secrets backends, the metadata database),
then ``ONCEFLOW_PG_DSN``. Reads run in read-only transactions; the actions take the
pipeline's coordinator lock like the CLI does.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from onceflow.core import freshness, txlog
from onceflow.core.backflow import replay_dead_letters as replay
from onceflow.core.connections import DEFAULT_CONN_ID, dsn_from_connection, resolve_dsn
from onceflow.core.db import connection
from onceflow.core.errors import NotInitialised
from onceflow.core.registry import pipelines
from onceflow.ops.backfill import open_transactions as find
from onceflow.ops.status import activity, lease_text, pipeline_status, progress

log = logging.getLogger(__name__)

APPLICATION_NAME = "onceflow-ui"
TIMELINE = 50  # transactions on a pipeline's page
DEAD_LETTERS = 20  # newest dead letters listed
PAGE_MAX = 500  # transactions on one page of the timeline at most
SERIES = 200  # committed transactions in the charts
SERIES_MAX = 5000


def dag_id_of(pipeline: str) -> str:
    """The DAG of a pipeline (``transaction_dags()`` names them so)."""
    return f"onceflow_{pipeline}"


def approval_dag_id(pipeline: str) -> str:
    """The DAG that replays a pipeline's dead letters after a person approves
    (``onceflow.airflow.approval.replay_dag_id``)."""
    return f"onceflow_{pipeline}_replay_dead_letters"


def server_dsn(conn_id: str = DEFAULT_CONN_ID, *, session=None) -> str:
    """The coordinator's DSN in an Airflow server process: the connection from Airflow's
    secrets backends as the server has them (a custom backend, ``AIRFLOW_CONN_*``, the
    metadata database: the Task SDK's lookup only works inside tasks), else onceflow's own
    resolution (``ONCEFLOW_PG_DSN``) with its message when nothing is found.

    ``session``: read the metadata database with this SQLAlchemy session (a listener must
    not open the thread's scoped session: it would commit and close its caller's)."""
    try:  # the server's secrets backends; without Airflow, onceflow's own lookup below
        from airflow.configuration import ensure_secrets_loaded
        from airflow.models.connection import Connection
        from airflow.secrets.metastore import MetastoreBackend
        from sqlalchemy import select
    except ImportError:
        return resolve_dsn(conn_id)
    for backend in ensure_secrets_loaded():
        try:
            if isinstance(backend, MetastoreBackend) and session is not None:
                found = session.scalar(select(Connection).where(Connection.conn_id == conn_id)
                                       .limit(1))
            else:
                found = backend.get_connection(conn_id)
        except Exception as error:  # a backend that cannot answer: the next one
            log.warning("connection %s: %s failed: %s", conn_id, type(backend).__name__, error)
            continue
        if found is not None:
            return dsn_from_connection(found)
    return resolve_dsn(conn_id)


@contextmanager
def cursor(*, readonly: bool = True, statement_timeout_ms: int = 15_000):
    """A cursor on the coordinator's database in one transaction (committed at the end, rolled
    back on an error); ``readonly``: a read-only transaction."""

    with connection(server_dsn(), application_name=APPLICATION_NAME) as conn:
        conn.set_session(readonly=readonly)
        try:
            with conn.cursor() as cur:
                cur.execute("SET LOCAL statement_timeout = %s", (statement_timeout_ms,))
                # short indexed reads, asked for every few seconds: compiling them (JIT)
                # costs more than running them
                cur.execute("SET LOCAL jit = off")
                yield cur
            conn.commit()
        except BaseException:
            conn.rollback()
            raise


def registered() -> dict[str, Any]:
    """The registered pipelines by name (entry points, ONCEFLOW_PIPELINES)."""

    return dict(sorted(pipelines().items()))


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat(timespec="seconds")
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if hasattr(value, "value") and isinstance(value.value, str):  # enums
        return value.value
    return value


def _tx(row) -> dict[str, Any]:
    out = {f.name: getattr(row, f.name) for f in dataclasses.fields(row)}
    out["state"] = "abandoned" if row.abandoned else str(row.state)
    return _jsonable(out)


def pipeline_view(pipeline, *, timeline: int = TIMELINE, dead_letters: int = DEAD_LETTERS,
                  all_dead: bool = False) -> dict[str, Any]:
    """One pipeline as the view shows it (JSON-able): the commit timeline, open transactions
    with what holds each (``onceflow.ops.status.Stuck``), partitions and lag, gaps, backflow
    queues, dead letters by reason. ``initialised`` is False (and ``error`` says why) when its
    first begin has not run yet."""

    view: dict[str, Any] = {"pipeline": pipeline.name, "dag_id": dag_id_of(pipeline.name),
                            "dead_letter_approval": bool(pipeline.dead_letter_approval),
                            "approval_dag_id": approval_dag_id(pipeline.name)
                            if pipeline.dead_letter_approval else None,
                            "description": pipeline.description,
                            "source": pipeline.source.describe(), "initialised": False,
                            "error": None}
    try:
        with cursor() as cur:
            status = pipeline_status(cur, pipeline.source, pipeline.name, timeline,
                                     dead_letters, all_dead,
                                     approval=bool(pipeline.dead_letter_approval),
                                     lease_s=pipeline.lease_s, watch_interval=pipeline.
                                     watch_interval if pipeline.keep_up else None)
            open_rows = txlog.history(cur, pipeline.name, 10_000, open_only=True)
            done = progress(cur, pipeline.name)
            fresh = freshness.by_txid(cur, pipeline.name,
                                      [r.txid for r in status.transactions])
    except NotInitialised as error:
        view["error"] = str(error)
        return view
    stuck = {s.txid: s for s in status.stuck}
    open_txs = []
    for row in open_rows:
        entry = _tx(row)
        s = stuck.get(row.txid)
        if s is not None:
            entry.update(holds=s.holds, fix=s.fix, stuck=s.stuck and s.fix != "-")
        else:  # the next to commit, still working
            silent = f"{row.silent_s:.0f}s ago" if row.silent_s is not None else "-"
            entry.update(holds=f"{activity(row, done.get(row.txid), status.last_committed)}; "
                               f"last reported {silent}, {lease_text(row, pipeline.lease_s)}",
                         fix="-", stuck=False)
        entry["waits_for"] = (status.last_committed + 1
                              if row.txid > status.last_committed + 1 else None)
        open_txs.append(entry)
    transactions = [_tx(r) for r in status.transactions]
    for entry in transactions:  # how long its newest and oldest records waited for the commit
        entry["fresh_newest_s"], entry["fresh_oldest_s"] = fresh.get(entry["txid"],
                                                                     (None, None))
    waits = [t["commit_wait_s"] or 0.0 for t in transactions]
    view.update(
        initialised=True,
        topic=status.topic,
        last_committed=status.last_committed,
        next_txid=status.next_txid,
        counts=status.counts,  # what a txid's planned count counts (Kafka: offsets)
        transactions=transactions,
        max_wait_s=max(waits, default=0.0),
        open=open_txs,
        stuck=[dataclasses.asdict(s) for s in status.stuck],
        backfillable=[t["txid"] for t in open_txs
                      if t["state"] in ("failed", "superseded", "abandoned")],
        partitions=[dataclasses.asdict(p) for p in status.partitions],
        # arrival to commit (p50, p95, max over the last transactions' records) and the lag
        # now in records and seconds (onceflow.core.freshness.Freshness)
        freshness=status.freshness,
        keep_up=bool(pipeline.keep_up),
        watcher=status.watcher or None,  # a keep-up pipeline's (onceflow.core.keepup)
        gaps=_jsonable(status.gaps),
        backflow=status.backflow,
        **behind(status),
        dead_letters=_jsonable({**status.dead_letters,
                                "by_reason": [{"reason": r, "count": c}
                                              for r, c in status.dead_letters["by_reason"]]}),
    )
    return view


def airflow_paths(pipeline, dag_id: str, run_id: str | None, groups: int) -> dict[str, Any]:
    """Airflow UI paths (relative to its base URL) of a transaction run and of its tasks'
    logs: begin, each mapped process task and commit, or the one task of a ``single`` DAG."""
    if not run_id:
        return {"run": None, "logs": []}
    run = f"dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}"
    if getattr(pipeline, "dag_shape", "phases") == "single":
        tasks = [("transaction", None)]
    else:
        tasks = [("begin", None), *(("process", i) for i in range(max(groups, 1))),
                 ("commit", None)]
    logs = [{"task": task if index is None else f"{task}[{index}]",
             "path": f"{run}/tasks/{task}" + ("" if index is None else f"/mapped/{index}")}
            for task, index in tasks]
    return {"run": run, "logs": logs}


def timeline(pipeline, *, before: int | None = None, after: int | None = None,
             min_txid: int | None = None, max_txid: int | None = None,
             states: Iterable[str] = (), limit: int = TIMELINE) -> dict[str, Any]:
    """A page of the commit timeline, newest first (``txlog.history_page``: ``before`` or
    ``after`` a txid, within ``min_txid``..``max_txid``, in ``states``), each transaction
    with its attempts (which run made each, how it ended) and the Airflow paths of its run
    and of its tasks' logs. ``older`` / ``newer``: whether more match past either end."""
    states = tuple(states)
    window = {"min_txid": min_txid, "max_txid": max_txid, "states": states}
    dag_id = dag_id_of(pipeline.name)
    with cursor() as cur:
        cur.execute("SELECT 1 FROM pipelines WHERE name = %s", (pipeline.name,))
        if cur.fetchone() is None:
            raise NotInitialised(f"pipeline {pipeline.name!r} is not initialised: run "
                                 "`onceflow init`")
        rows = txlog.history_page(cur, pipeline.name, limit, before=before, after=after,
                                  **window)
        older = newer = False
        if rows:
            older = bool(txlog.history_page(cur, pipeline.name, 1, before=rows[0].txid,
                                            **window))
            newer = bool(txlog.history_page(cur, pipeline.name, 1, after=rows[-1].txid,
                                            **window))
        attempts = _attempts(cur, pipeline.name, [r.txid for r in rows])
        groups = _groups(cur, pipeline.name, [r.txid for r in rows])
    out = []
    for row in reversed(rows):
        entry = _tx(row)
        entry.update(airflow_paths(pipeline, dag_id, row.run_id, groups.get(row.txid, 1)))
        entry["attempts"] = [
            {**a, **airflow_paths(pipeline, dag_id, a["run_id"], groups.get(row.txid, 1))}
            for a in attempts.get(row.txid, [])]
        out.append(entry)
    return {"pipeline": pipeline.name, "dag_id": dag_id, "transactions": out,
            "older": older, "newer": newer, "limit": limit, "before": before,
            "after": after, **{k: list(v) if k == "states" else v for k, v in window.items()}}


def _attempts(cur, pipeline: str, txids: list[int]) -> dict[int, list[dict[str, Any]]]:
    cur.execute(
        """SELECT txid, attempt, run_id, outcome, reason, started_at, ended_at
           FROM transaction_attempts WHERE pipeline = %s AND txid = ANY(%s)
           ORDER BY txid, attempt""", (pipeline, txids))
    out: dict[int, list[dict[str, Any]]] = {}
    for txid, attempt, run_id, outcome, reason, started, ended in cur.fetchall():
        out.setdefault(txid, []).append(_jsonable({
            "attempt": attempt, "run_id": run_id, "outcome": outcome, "reason": reason,
            "started_at": started, "ended_at": ended}))
    # A run asked for a txid already committed: begin maps it to the txid and makes no
    # attempt, so it is listed after them as a no-op.
    cur.execute(
        """SELECT r.txid, r.run_id FROM transaction_runs r
           WHERE r.pipeline = %s AND r.txid = ANY(%s) AND NOT EXISTS (
               SELECT 1 FROM transaction_attempts a WHERE a.pipeline = r.pipeline
                 AND a.txid = r.txid AND a.run_id = r.run_id)
           ORDER BY r.txid, r.run_id""", (pipeline, txids))
    for txid, run_id in cur.fetchall():
        out.setdefault(txid, []).append({
            "attempt": None, "run_id": run_id, "outcome": "no-op",
            "reason": "the txid was committed already: nothing to do",
            "started_at": None, "ended_at": None})
    return out


def _groups(cur, pipeline: str, txids: list[int]) -> dict[int, int]:
    cur.execute("SELECT txid, groups FROM transactions WHERE pipeline = %s AND txid = ANY(%s)",
                (pipeline, txids))
    return dict(cur.fetchall())


def txid_of_run(pipeline: str, run_id: str) -> int | None:
    """The txid an Airflow run of the pipeline's DAG works on (any of its attempts)."""
    with cursor() as cur:
        cur.execute("SELECT txid FROM transaction_runs WHERE pipeline = %s AND run_id = %s",
                    (pipeline, run_id))
        row = cur.fetchone()
    return row[0] if row else None


# Per committed transaction, for the charts (one row per txid, in txid order; commits are in
# txid order, so the txids committed by a moment are a prefix of them):
# - records: the source records of its batch (as the timeline, status and run notes count
#   them), replayed: the backflow records it replayed, apart;
# - records_per_s: its records over its own window, from its planning to its commit (a txid
#   committed right after another in parallel, or after an idle gap, is timed alike);
# - commit_s: from its commit's request to the commit, commit_wait_s of it waiting for
#   earlier txids; duration_s: from its planning to its commit;
# - lag: the records of the source past the committed offsets when it was planned: the
#   backlog begin left past its batch, plus the records of the txids planned and not committed
#   then (its own among them);
# - freshness_s: from the arrival of the batch's oldest record in the source to the commit,
#   where the source records arrivals (a PostgreSQL log: its records' produced_at).
_SERIES = """
    WITH w AS (
        SELECT t.txid, t.records, t.replayed, t.planned_at, t.commit_requested_at,
               t.committed_at, t.commit_wait_s, t.backlog
        FROM transactions t
        WHERE t.pipeline = %(p)s AND t.state = 'committed'
          AND t.txid >= coalesce(%(lo)s, 0) AND t.txid <= coalesce(%(hi)s, %(top)s)
        ORDER BY t.txid DESC LIMIT %(last)s)
    SELECT w.txid, w.planned_at, w.committed_at, w.records, w.replayed,
           EXTRACT(EPOCH FROM w.committed_at - w.commit_requested_at), w.commit_wait_s,
           EXTRACT(EPOCH FROM w.committed_at - w.planned_at),
           (w.backlog + inflight.records)::bigint,
           EXTRACT(EPOCH FROM w.committed_at - oldest.at)
    FROM w
    LEFT JOIN LATERAL (
        SELECT coalesce(sum(u.records), 0) AS records FROM transactions u
        WHERE u.pipeline = %(p)s AND u.txid <= w.txid
          AND u.txid > coalesce((SELECT c.txid FROM transactions c
                                 WHERE c.pipeline = %(p)s AND c.txid < w.txid
                                   AND c.state = 'committed' AND c.committed_at <= w.planned_at
                                 ORDER BY c.txid DESC LIMIT 1), 0)) inflight ON true
    LEFT JOIN LATERAL (
        SELECT min(l.produced_at) AS at
        FROM batch_ranges b JOIN source_log l
          ON l.topic = b.topic AND l.partition = b.partition AND l."offset" = b.start_offset
        WHERE %(arrivals)s AND b.pipeline = %(p)s AND b.txid = w.txid
          AND b.end_offset > b.start_offset) oldest ON true
    ORDER BY w.txid"""


def series(pipeline, *, last: int = SERIES, min_txid: int | None = None,
           max_txid: int | None = None) -> dict[str, Any]:
    """The last ``last`` committed transactions (within ``min_txid``..``max_txid``) as the
    charts plot them (see _SERIES for each figure). ``freshness``: what freshness_s measures
    for this pipeline's source, or None where its records' arrivals are not recorded (then
    freshness_s is null: a placeholder series)."""
    arrivals = getattr(pipeline.source, "kind", None) == "postgres-log"
    with cursor() as cur:
        cur.execute(_SERIES, {"p": pipeline.name, "lo": min_txid, "hi": max_txid,
                              "top": 2 ** 63 - 1, "last": last, "arrivals": arrivals})
        rows = cur.fetchall()
    points = []
    for (txid, planned, committed, records, replayed, commit_s, wait_s, duration_s,
         lag, freshness_s) in rows:
        points.append(_jsonable({
            "txid": txid, "planned_at": planned, "committed_at": committed,
            "records": records, "replayed": replayed,
            "records_per_s": round(records / float(duration_s), 1) if duration_s else None,
            "commit_s": _secs(commit_s), "commit_wait_s": _secs(wait_s),
            "duration_s": _secs(duration_s), "lag": lag, "freshness_s": _secs(freshness_s)}))
    return {"pipeline": pipeline.name, "points": points, "rate": RATE,
            "freshness": "from the arrival of the batch's oldest record in the source to "
                         "the commit" if arrivals else None}


RATE = ("each txid's records (replays apart) over its own window, from its planning to its "
        "commit, waits for earlier txids included")


def _secs(value) -> float | None:
    return None if value is None else round(float(value), 3)


def behind(status) -> dict[str, int]:
    """What is not committed yet, as ``onceflow status`` counts it: ``lag``, the records of
    the source past the committed offsets; ``backflow_waiting``, the failed records waiting
    in the backflow queues for a replay (to-queue and from-queue; dead letters apart);
    ``behind``, both."""
    lag = sum(p.lag for p in status.partitions)
    waiting = status.backflow["to_items"] + status.backflow["from_items"]
    return {"lag": lag, "backflow_waiting": waiting, "behind": lag + waiting}


def summary(pipeline) -> dict[str, Any]:
    """The overview line of a pipeline (the index page)."""
    view = pipeline_view(pipeline, timeline=1, dead_letters=0)
    keep = ("pipeline", "dag_id", "description", "source", "initialised", "error", "topic",
            "last_committed", "next_txid", "lag", "backflow_waiting", "behind", "backflow",
            "freshness", "keep_up")
    out = {k: view[k] for k in keep if k in view}
    if view["initialised"]:
        out.update(open=len(view["open"]), stuck=sum(1 for t in view["open"] if t["stuck"]),
                   dead_letters=view["dead_letters"]["total"],
                   last=view["transactions"][-1] if view["transactions"] else None)
    return out


# -- actions --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Choice:
    """Which dead letters: ``positions`` (partition, offset), ``error_contains`` (a text of
    any of their errors) and/or ``last_error`` (their whole last error: one reason the view
    lists); none: every one (``everything`` must say so)."""

    positions: tuple[tuple[int, int], ...] | None = None
    error_contains: str | None = None
    everything: bool = False
    last_error: str | None = None

    def describe(self) -> str:
        if self.everything:
            return "every dead letter"
        parts = []
        if self.positions is not None:
            parts.append("record(s) " + ", ".join(f"p{p}:{o}" for p, o in self.positions))
        if self.error_contains is not None:
            parts.append(f"dead letters whose errors contain {self.error_contains!r}")
        if self.last_error is not None:
            parts.append(f"dead letters whose last error is {self.last_error!r}")
        return " and ".join(parts)

    def conf(self) -> dict[str, Any]:
        """The same choice as the conf of a run of the approval DAG (its params)."""
        return {"records": [f"{p}:{o}" for p, o in self.positions or ()],
                "error_contains": self.error_contains, "last_error": self.last_error,
                "all": self.everything}


def replay_dead_letters(pipeline: str, choice: Choice, *, apply: bool) -> int:
    """Put the chosen dead letters back in the backflow from-queue, as ``onceflow
    replay-dead-letters`` does (``onceflow.core.backflow.replay_dead_letters`` under the
    pipeline's coordinator lock). ``apply=False``: the same in a transaction rolled back, to
    say how many it would move. Returns how many (would) move."""

    with connection(server_dsn(), application_name=APPLICATION_NAME) as conn:
        try:
            with conn.cursor() as cur:
                cur.execute("SET LOCAL lock_timeout = '10s'")  # a commit holds it briefly
                txlog.lock_pipeline(cur, pipeline)
                moved = replay(cur, pipeline,
                               positions=list(choice.positions) if choice.positions is not None
                               else None,
                               error_contains=choice.error_contains,
                               last_error=choice.last_error)
            if apply:
                conn.commit()
                log.warning("REPLAY pipeline=%s: %d dead letter(s) put back (%s)", pipeline,
                            moved, choice.describe())
            else:
                conn.rollback()
        except BaseException:
            conn.rollback()
            raise
    return moved


def open_transactions(pipeline: str) -> list[dict[str, Any]]:
    """Failed, superseded and abandoned transactions, lowest txid first
    (``onceflow.ops.backfill.open_transactions``)."""

    with connection(server_dsn(), application_name=APPLICATION_NAME) as conn:
        return [_tx(r) for r in find(conn, pipeline)]


def backfill_run_id(txid: int) -> str:
    """Run ids like ``onceflow backfill --via airflow`` gives its runs."""
    return f"onceflow_backfill__txid_{txid}__{datetime.now(UTC):%Y%m%dT%H%M%S%f}"


def trigger_backfill(pipeline: str, txids: Iterable[int], user_name: str | None
                     ) -> list[dict[str, Any]]:
    """One queued DAG run per txid with conf ``{"txid": N}`` (what the trigger form and
    ``onceflow backfill`` do), in txid order, through Airflow's own trigger (the metadata
    database of this server). Each run starts with a note saying what it is for."""
    # imported here: Airflow's own modules: the UI plugin is loaded while Airflow starts
    from airflow.api.common.trigger_dag import trigger_dag
    from airflow.utils.types import DagRunTriggeredByType

    dag_id = dag_id_of(pipeline)
    made = []
    for txid in sorted(set(txids)):
        run = trigger_dag(
            dag_id, triggered_by=DagRunTriggeredByType.UI, triggering_user_name=user_name,
            run_id=backfill_run_id(txid), conf={"txid": txid},
            note=f"txid {txid} · backfill queued by {user_name or 'a user'} (onceflow view)")
        made.append({"txid": txid, "run_id": run.run_id if run else None})
    return made


def trigger_approval(pipeline: str, choice: Choice, user_name: str | None) -> str:
    """A queued run of the pipeline's approval DAG with ``choice`` as its conf (what its
    trigger form takes), through Airflow's own trigger. Returns its run id."""
    # imported here: Airflow's own modules: the UI plugin is loaded while Airflow starts
    from airflow.api.common.trigger_dag import trigger_dag
    from airflow.utils.types import DagRunTriggeredByType

    run = trigger_dag(
        approval_dag_id(pipeline), triggered_by=DagRunTriggeredByType.UI,
        triggering_user_name=user_name,
        run_id=f"onceflow_replay_request__{datetime.now(UTC):%Y%m%dT%H%M%S%f}",
        conf=choice.conf(),
        note=f"replay of dead letters asked for by {user_name or 'a user'} (onceflow view): "
             f"{choice.describe()}"[:1000])
    return run.run_id


def dag_paused(dag_id: str) -> bool | None:
    """Whether the DAG is paused (its queued runs wait); None when Airflow does not know it."""
    # imported here: Airflow's own modules: the UI plugin is loaded while Airflow starts
    from airflow.models.dag import DagModel

    model = DagModel.get_current(dag_id)
    return None if model is None else bool(model.is_paused)
