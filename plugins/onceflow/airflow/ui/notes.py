"""Run notes: every DAG run of a transaction DAG says its txid and outcome in its note, which
the Airflow UI shows in the run list and on the run's page.

Airflow 3's tasks cannot set their run's note (the Task SDK and the execution API have no
call for it), so it takes two halves:

1. the tasks (``onceflow.airflow.operators``) say what their run did as an XCom of key
   ``onceflow_note``: begin when it gives the run its txid (or finds it committed, or plans
   nothing), process when its attempt was fenced, commit with the outcome;
2. this module's listener (the plugin registers it) runs where Airflow ends a DAG run: the
   scheduler, ``dag.test()``, the API when a user sets a run's state. It takes the run's
   newest onceflow note and, when the run failed after begin, what onceflow's transaction
   log says about its txid (the reason the failed attempt recorded, or the newer attempt
   that fenced it), and writes the run's note. A note a user wrote is kept, below.

Notes look like (``fresh``: how long its newest and oldest records waited from their arrival
in the source to the commit)::

    txid 17 · committed · 20,000 records · fresh 2.1-6.4s · 3 dead letters
    txid 12 already committed (no-op)
    txid 18 failed: process: RuntimeError('...')
    superseded: txid 9 attempt 1 is fenced: attempt 2 is current
"""

from __future__ import annotations

import logging
import re
from typing import Any

import psycopg2
from airflow.listeners import hookimpl
from airflow.models.dagrun import DagRun, DagRunNote
from airflow.models.xcom import XComModel
from airflow.utils.session import create_session
from sqlalchemy import select
from sqlalchemy.orm import object_session

from onceflow.airflow.ui.data import server_dsn
from onceflow.core import txlog

log = logging.getLogger(__name__)

NOTE_KEY = "onceflow_note"
MAX_NOTE = 1000  # Airflow's dag_run_note.content
SEP = " · "
# A first line this module wrote (kept apart from what a user adds below it).
_OURS = re.compile(r"^(txid \d+|superseded|no transaction|failed before)")


# -- what the tasks say ---------------------------------------------------------------------------
def _note(kind: str, text: str, pipeline: str, txid: int | None = None,
          attempt: int | None = None, *, final: bool = True) -> dict[str, Any]:
    return {"kind": kind, "text": text, "pipeline": pipeline, "txid": txid,
            "attempt": attempt, "final": final}


def planned(pipeline: str, txid: int, attempt: int, records: int) -> dict[str, Any]:
    """begin gave the run its attempt (the outcome comes later)."""
    again = f"{SEP}attempt {attempt}" if attempt > 1 else ""
    return _note("planned", f"txid {txid}{again}{SEP}planned{SEP}{records:,} records",
                 pipeline, txid, attempt, final=False)


def no_op(pipeline: str, txid: int) -> dict[str, Any]:
    return _note("no-op", f"txid {txid} already committed (no-op)", pipeline, txid)


def committed(pipeline: str, txid: int, attempt: int, *, records: int, failed: int = 0,
              dead: int = 0, waited_s: float = 0.0, earlier_try: bool = False,
              fresh_s: tuple[float, float] | list[float] | None = None,
              earlier: list[int] | tuple[int, ...] = ()) -> dict[str, Any]:
    """The run committed its txid (``earlier_try``: on an earlier try of its commit task,
    whose counts this try does not know). ``fresh_s``: how long its newest and its oldest
    record waited from their arrival in the source to this commit (onceflow.core.freshness).
    ``earlier``: the txids the run committed before this one (a keep-up run carries on)."""
    parts = [f"txid {txid}", "committed", f"{records:,} record{'s' if records != 1 else ''}"]
    if fresh_s:
        newest, oldest = fresh_s
        parts.append(f"fresh {newest:.1f}s" if round(oldest, 1) == round(newest, 1)
                     else f"fresh {newest:.1f}-{oldest:.1f}s")
    queued = failed - dead
    if queued > 0:
        parts.append(f"{queued:,} queued for replay")
    if dead:
        parts.append(f"{dead:,} dead letter{'s' if dead != 1 else ''}")
    if attempt > 1:
        parts.append(f"attempt {attempt}")
    if waited_s >= 1:
        parts.append(f"waited {waited_s:.0f}s for txid {txid - 1}")
    if earlier_try:
        parts.append("on an earlier try of the commit task")
    if earlier:
        parts.append(f"after txid{'s' if len(earlier) > 1 else ''} "
                     f"{', '.join(map(str, earlier))} in this run")
    return _note("committed", SEP.join(parts), pipeline, txid, attempt)


def superseded(pipeline: str, why: str, txid: int | None = None,
               attempt: int | None = None) -> dict[str, Any]:
    return _note("superseded", f"superseded: {why}", pipeline, txid, attempt)


def nothing_planned(pipeline: str, why: str) -> dict[str, Any]:
    """No transaction for this run (max_pending reached)."""
    return _note("skipped", f"no transaction: {why}", pipeline)


def no_txid(pipeline: str, error: BaseException) -> dict[str, Any]:
    """begin failed: the run has no txid (yet; a retry may give it one)."""
    return _note("error", f"failed before a txid was given: {_error_text(error)}", pipeline,
                 final=False)


def _error_text(error: BaseException | str) -> str:
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return " ".join(str(text).split())[:600]


def push(context, note: dict[str, Any]) -> None:
    """Say ``note`` as this task's ``onceflow_note`` XCom. Never fails the task."""
    try:
        context["ti"].xcom_push(key=NOTE_KEY, value=note)
    except Exception as error:  # a note is never worth a failed transaction
        log.warning("could not record the run note %r: %s", note.get("text"), error)


# -- what the listener writes ---------------------------------------------------------------------
def _run_notes(dag_run, session) -> list[dict[str, Any]]:
    rows = session.scalars(
        select(XComModel).where(XComModel.dag_run_id == dag_run.id,
                                XComModel.key == NOTE_KEY)
        .order_by(XComModel.timestamp, XComModel.task_id, XComModel.map_index)
    ).all()
    notes = []
    for row in rows:
        value = XComModel.deserialize_value(row)
        if isinstance(value, dict) and value.get("text"):
            notes.append(value)
    return notes


def _transaction_now(pipeline: str, txid: int, session=None):
    """What onceflow's transaction log says of ``txid`` now (its current attempt), or None
    when the coordinator cannot be asked quickly. ``session``: the caller's metadata-database
    session (for the connection onceflow_pg)."""

    try:
        conn = psycopg2.connect(server_dsn(session=session), connect_timeout=3,
                                application_name="onceflow-notes",
                                options="-c statement_timeout=5000")
    except Exception as error:
        log.warning("run note: onceflow's database does not answer: %s", error)
        return None
    try:
        with conn.cursor() as cur:
            return txlog.blocker(cur, pipeline, txid)
    except Exception as error:
        log.warning("run note: cannot read txid %s of %s: %s", txid, pipeline, error)
        return None
    finally:
        conn.close()


def note_text(dag_id: str, run_id: str, failed: bool, notes: list[dict[str, Any]],
              lookup=_transaction_now) -> str | None:
    """The note of a finished run from what its tasks said (oldest first) and, for a failed
    run after begin, onceflow's transaction log (``lookup(pipeline, txid)``). None: not a
    transaction DAG's run."""
    if not notes:
        if dag_id.startswith("onceflow_") and failed:
            return "failed before a txid was given (see the begin task's log)"
        return None
    last = notes[-1]
    if last.get("final") or not failed:
        return last["text"]
    txid, attempt, pipeline = last.get("txid"), last.get("attempt"), last.get("pipeline")
    if txid is None:
        return last["text"]
    now = lookup(pipeline, txid) if pipeline else None
    if now is None or now.state is None:
        return f"txid {txid} failed (see the task logs)"
    if attempt is not None and now.attempt is not None and now.attempt > attempt:
        return (f"superseded: txid {txid} attempt {attempt} is fenced: attempt {now.attempt} "
                f"is current (run {now.run_id or '-'}, {now.state})")
    if str(now.state) == "committed":
        return f"txid {txid} committed (by run {now.run_id or '-'})"
    if str(now.state) == "failed":
        reason = (now.reason or "see the task logs").replace(f" in run {run_id}", "")
        return f"txid {txid} failed: {_error_text(reason)}"
    return (f"txid {txid} failed: the run ended while the transaction is {now.state} (see "
            "the task logs; the next run adopts it once its lease runs out)")


def set_note(dag_run, text: str) -> None:
    """Write ``text`` as the run's note; a note a user wrote stays, below it."""

    current = dag_run.dag_run_note
    if current is None:
        dag_run.dag_run_note = DagRunNote(content=text[:MAX_NOTE])
        return
    if current.user_id is None or not current.content:  # ours, or a trigger's
        current.content = text[:MAX_NOTE]
        return
    lines = current.content.split("\n")
    if lines and _OURS.match(lines[0]):
        lines = lines[1:]
    kept = "\n".join(lines).strip()
    current.content = (text + ("\n\n" + kept if kept else ""))[:MAX_NOTE]


def _on_finished(dag_run, failed: bool) -> None:
    session = object_session(dag_run)
    if session is not None:  # the scheduler's (or the API's) session, committed by its caller
        _write(dag_run, session, failed)
        return
    # Detached: dag.test() closes the thread's session while its tasks run, and goes on with
    # the closed one. A session of our own, committed here.

    with create_session(scoped=False) as own:
        live = own.get(DagRun, dag_run.id)
        if live is not None:
            _write(live, own, failed)


def _write(dag_run, session, failed: bool) -> None:
    text = note_text(dag_run.dag_id, dag_run.run_id, failed, _run_notes(dag_run, session),
                     lookup=lambda pipeline, txid: _transaction_now(pipeline, txid, session))
    if text:
        set_note(dag_run, text)
        log.info("run note of %s %s: %s", dag_run.dag_id, dag_run.run_id, text)


@hookimpl
def on_dag_run_success(dag_run, msg: str):
    """A transaction DAG's run succeeded: its note says what it did."""
    try:
        _on_finished(dag_run, failed=False)
    except Exception:
        log.exception("could not write the run note of %s", getattr(dag_run, "run_id", "?"))


@hookimpl
def on_dag_run_failed(dag_run, msg: str):
    """A transaction DAG's run failed: its note says which txid and why."""
    try:
        _on_finished(dag_run, failed=True)
    except Exception:
        log.exception("could not write the run note of %s", getattr(dag_run, "run_id", "?"))
