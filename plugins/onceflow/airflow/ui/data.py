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

from onceflow.core.connections import DEFAULT_CONN_ID, dsn_from_connection, resolve_dsn

log = logging.getLogger(__name__)

APPLICATION_NAME = "onceflow-ui"
TIMELINE = 50  # transactions on a pipeline's page
DEAD_LETTERS = 20  # newest dead letters listed


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
    try:
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
    from onceflow.core.db import connection

    with connection(server_dsn(), application_name=APPLICATION_NAME) as conn:
        conn.set_session(readonly=readonly)
        try:
            with conn.cursor() as cur:
                cur.execute("SET LOCAL statement_timeout = %s", (statement_timeout_ms,))
                yield cur
            conn.commit()
        except BaseException:
            conn.rollback()
            raise


def registered() -> dict[str, Any]:
    """The registered pipelines by name (entry points, ONCEFLOW_PIPELINES)."""
    from onceflow.core.registry import pipelines

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
    from onceflow.core import txlog
    from onceflow.core.errors import NotInitialised
    from onceflow.ops.status import activity, pipeline_status, progress

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
                                     dead_letters, all_dead)
            open_rows = txlog.history(cur, pipeline.name, 10_000, open_only=True)
            done = progress(cur, pipeline.name)
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
                               f"last reported {silent}, lease {row.lease_s}s",
                         fix="-", stuck=False)
        entry["waits_for"] = (status.last_committed + 1
                              if row.txid > status.last_committed + 1 else None)
        open_txs.append(entry)
    transactions = [_tx(r) for r in status.transactions]
    waits = [t["commit_wait_s"] or 0.0 for t in transactions]
    view.update(
        initialised=True,
        topic=status.topic,
        last_committed=status.last_committed,
        next_txid=status.next_txid,
        transactions=transactions,
        max_wait_s=max(waits, default=0.0),
        open=open_txs,
        stuck=[dataclasses.asdict(s) for s in status.stuck],
        backfillable=[t["txid"] for t in open_txs
                      if t["state"] in ("failed", "superseded", "abandoned")],
        partitions=[dataclasses.asdict(p) for p in status.partitions],
        gaps=_jsonable(status.gaps),
        backflow=status.backflow,
        **behind(status),
        dead_letters=_jsonable({**status.dead_letters,
                                "by_reason": [{"reason": r, "count": c}
                                              for r, c in status.dead_letters["by_reason"]]}),
    )
    return view


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
            "last_committed", "next_txid", "lag", "backflow_waiting", "behind", "backflow")
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
    from onceflow.core import txlog
    from onceflow.core.backflow import replay_dead_letters as replay
    from onceflow.core.db import connection

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
    from onceflow.core.db import connection
    from onceflow.ops.backfill import open_transactions as find

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
    from airflow.models.dag import DagModel

    model = DagModel.get_current(dag_id)
    return None if model is None else bool(model.is_paused)
