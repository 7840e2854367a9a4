"""Replaying dead letters after a person approves: the DAG
``onceflow_<name>_replay_dead_letters`` (Airflow DAG file helpers; human-in-the-loop).

A pipeline opts in with ``Pipeline(..., dead_letter_approval=True)``; ``transaction_dags()``
then gives it this DAG (or call ``replay_dead_letters_dag(PIPELINE)`` in a DAG file). Trigger
it with what to replay: ``records`` (a list of ``"PARTITION:OFFSET"``), ``error_contains`` (a
text any of a letter's errors contains), ``last_error`` (a letter's whole last error: one
reason of the onceflow view's list), several of them (each letter must match each), or
``all``. The onceflow view's buttons trigger it so for such a pipeline: it never replays
its dead letters itself. Then:

1. **preview** reads the chosen dead letters and says what would go back to the backflow
   queue: how many, how many per reason (the last error), the newest ten. Nothing chosen is
   refused; nothing matching ends the run (skipped, nothing to approve);
2. **approve** (Airflow's ``ApprovalOperator``, standard provider) shows that as a required
   action in Airflow's UI (or the HITL REST API): *Approve* or *Reject*. Rejected, or
   unanswered within ``response_timeout`` (the default answer is *Reject*), the replay is
   skipped and nothing changes;
3. **replay**, after an approval, puts back exactly the letters that were shown
   (``onceflow.core.backflow.replay_dead_letters`` under the pipeline's coordinator lock,
   ``onceflow.core.txlog.lock_pipeline``, as the CLI and the onceflow view do): a letter that
   left the dead letters meanwhile, or died again after the preview, is not touched (it was
   not what the approver saw). Its log names who approved; the next transactions replay them.

The shown letters travel from preview to replay as an XCom (partition, offset, when it died:
some 50 bytes each).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

from airflow.providers.standard.operators.hitl import ApprovalOperator
from airflow.sdk import DAG, BaseOperator, Param

from onceflow.airflow.alerts import pipeline_with_refs
from onceflow.airflow.compat import AirflowFailException, AirflowSkipException
from onceflow.airflow.operators import airflow_outcomes, load_pipeline, run_note
from onceflow.core import txlog
from onceflow.core.backflow import replay_dead_letters
from onceflow.core.connections import DEFAULT_CONN_ID, resolve_dsn
from onceflow.core.db import connection, transaction
from onceflow.core.pipeline import Pipeline

NEWEST = 10  # dead letters listed one by one in the request
REASON_CHARS = 200  # a reason longer than this is shown cut (at a word), never grouped so

_CHOSEN = """
    SELECT partition, "offset", failures, errors[array_upper(errors, 1)], txid, dead_at
    FROM dead_letters d WHERE d.pipeline = %(pipeline)s
      AND (%(any_pos)s OR (d.partition, d."offset") IN
           (SELECT * FROM unnest(%(parts)s::int[], %(offsets)s::bigint[])))
      AND (%(pattern)s::text IS NULL OR EXISTS (
           SELECT 1 FROM unnest(d.errors) e WHERE strpos(e, %(pattern)s) > 0))
      AND (%(last)s::text IS NULL OR d.errors[array_upper(d.errors, 1)] = %(last)s)
    ORDER BY dead_at DESC, partition, "offset"
"""


def replay_dag_id(name: str) -> str:
    return f"onceflow_{name}_replay_dead_letters"


def _cell(text: Any) -> str:
    """Text for one cell of a Markdown table."""
    return " ".join(str(text if text is not None else "-").split()).replace("|", "\\|")


def shorten(text: str, width: int = REASON_CHARS) -> str:
    """``text`` at most ``width`` characters long, cut at a word with an ellipsis."""
    if len(text) <= width:
        return text
    cut = text[:width - 1]
    if " " in cut and not text[width - 1].isspace():
        cut = cut.rsplit(" ", 1)[0]
    return cut.rstrip() + "…"


def parse_choice(params: dict[str, Any]
                 ) -> tuple[list[tuple[int, int]] | None, str | None, str | None, str]:
    """The trigger form's choice: (positions or None, error text or None, whole last error
    or None, in words). Refuses nothing chosen and ``all`` with a narrower choice, with the
    fix."""
    records = params.get("records") or []
    error_contains = params.get("error_contains") or None
    last_error = params.get("last_error") or None
    everything = bool(params.get("all"))
    if isinstance(records, str):
        records = [r for r in records.replace(",", " ").split() if r]
    positions = []
    for item in records:
        partition, _, offset = str(item).strip().partition(":")
        if not (partition.isdigit() and offset.isdigit()):
            raise AirflowFailException(
                f"records: {item!r} is not PARTITION:OFFSET, e.g. 2:1041 (the onceflow view and "
                "`onceflow status` list the dead letters)")
        positions.append((int(partition), int(offset)))
    if everything and (positions or error_contains or last_error):
        raise AirflowFailException("all replays every dead letter: leave records, "
                                   "error_contains and last_error empty, or set all to false")
    if not (everything or positions or error_contains or last_error):
        raise AirflowFailException("nothing chosen: give records (PARTITION:OFFSET, ...), "
                                   "error_contains (a text of their errors), last_error (their "
                                   "whole last error), or all")
    words = []
    if positions:
        words.append("record(s) " + ", ".join(f"p{p}:{o}" for p, o in positions))
    if error_contains:
        words.append(f"dead letters whose errors contain {error_contains!r}")
    if last_error:
        words.append(f"dead letters whose last error is {shorten(last_error)!r}")
    return (positions or None, error_contains, last_error,
            " and ".join(words) if words else "every dead letter")


def preview_text(pipeline: str, choice: str, rows: list[tuple], max_replays: int
                 ) -> tuple[str, str, list[list[Any]]]:
    """(subject, Markdown body, reasons) of the approval request for ``rows`` (partition,
    offset, failures, last error, txid, dead_at; newest first)."""
    reasons = Counter(str(r[3] or "-") for r in rows)
    by_reason = [[reason, count] for reason, count in
                 sorted(reasons.items(), key=lambda rc: (-rc[1], rc[0]))]
    n = len(rows)
    letters = f"{n:,} dead letter{'s' if n != 1 else ''}"
    subject = f"Replay {letters} of {pipeline}?"
    lines = [
        f"**{letters} of `{pipeline}`** ({choice}) go back to the backflow queue if you "
        f"approve: the next transactions replay them first, and a record that fails "
        f"{max_replays + 1} more time(s) is a dead letter again. Rejecting changes nothing.",
        "",
        "| last error | dead letters |",
        "| --- | ---: |",
        *[f"| {_cell(shorten(reason))} | {count:,} |" for reason, count in by_reason],
        "",
        f"Newest {min(n, NEWEST)} of {n:,}:" if n > NEWEST else "The dead letters:",
        "",
        "| record | failures | txid | dead at | last error |",
        "| --- | ---: | ---: | --- | --- |",
        *[f"| p{p}:{o} | {failures} | {txid} | {dead_at:%Y-%m-%d %H:%M:%S} | "
          f"{_cell(shorten(str(error or '-')))} |"
          for p, o, failures, error, txid, dead_at in rows[:NEWEST]],
    ]
    return subject, "\n".join(lines), by_reason


def approver_refused(approvers: Sequence[str], asked_by: str | None, answered_by: str
                     ) -> str | None:
    """Why ``answered_by``'s approval does not count (None: it does): with ``approvers``
    (Pipeline.approvers), only one of them, and not the person who asked."""
    if not approvers:
        return None
    if answered_by not in approvers:
        return (f"{answered_by!r} approved, but only {', '.join(map(repr, approvers))} may "
                "approve replays of this pipeline (its approvers): ask for the approval again")
    if asked_by is not None and answered_by == asked_by:
        others = [a for a in approvers if a != asked_by]
        return (f"{answered_by!r} asked for this replay and approved it: someone else must "
                f"approve ({', '.join(map(repr, others)) or 'no other approver is declared'}"
                "): ask for the approval again")
    return None


class _DeadLetterTask:
    pipeline: str
    pipeline_refs: tuple[str, ...]
    postgres_conn_id: str

    def _setup(self, pipeline: str, pipeline_refs: Iterable[str], postgres_conn_id: str):
        self.pipeline = pipeline
        self.pipeline_refs = tuple(pipeline_refs)
        self.postgres_conn_id = postgres_conn_id

    def _load(self):
        return load_pipeline(self.pipeline, self.pipeline_refs)


def _note(context, pipeline: str, text: str) -> None:
    run_note(context, lambda notes: {"kind": "dead-letters", "text": text,
                                     "pipeline": pipeline, "txid": None, "attempt": None,
                                     "final": True})


class DeadLetterPreviewOperator(_DeadLetterTask, BaseOperator):
    """What a replay of the chosen dead letters would put back (the run's params ``records``,
    ``error_contains``, ``all``): the approval request's subject and body, and the letters
    shown (for the replay). Nothing chosen fails; nothing matching skips the run's rest.

    :param pipeline: the registered pipeline's name.
    :param pipeline_refs: where the pipeline is declared, besides the registry.
    :param postgres_conn_id: the coordinator's PostgreSQL connection.
    """

    def __init__(self, *, pipeline: str, pipeline_refs: Iterable[str] = (),
                 postgres_conn_id: str = DEFAULT_CONN_ID, **kwargs):
        super().__init__(**kwargs)
        self._setup(pipeline, pipeline_refs, postgres_conn_id)

    def execute(self, context) -> dict[str, Any]:
        positions, error_contains, last_error, choice = parse_choice(dict(context["params"]))
        with airflow_outcomes():
            pipeline = self._load()
            with connection(resolve_dsn(self.postgres_conn_id),
                            application_name="onceflow-replay") as conn, \
                    transaction(conn) as cur:
                cur.execute(_CHOSEN, {
                    "pipeline": pipeline.name, "any_pos": positions is None,
                    "parts": [p for p, _ in positions or []],
                    "offsets": [o for _, o in positions or []], "pattern": error_contains,
                    "last": last_error})
                rows = cur.fetchall()
        if not rows:
            text = f"no dead letter of {pipeline.name} matches ({choice}): nothing to replay"
            _note(context, pipeline.name, text)
            raise AirflowSkipException(text)
        subject, body, by_reason = preview_text(pipeline.name, choice, rows,
                                                pipeline.max_replays)
        if pipeline.approvers:
            asked_by = getattr(context.get("dag_run"), "triggering_user_name", None)
            body += ("\n\nOnly " + ", ".join(f"`{a}`" for a in pipeline.approvers)
                     + " may approve" + (f", not `{asked_by}`, who asked" if asked_by else "")
                     + ": another answer replays nothing.")
        self.log.info("%s\n%s", subject, body)
        _note(context, pipeline.name, f"{len(rows):,} dead letter(s) of {pipeline.name} shown "
                                      "for approval: replayed only if approved")
        return {
            "pipeline": pipeline.name, "choice": choice, "count": len(rows),
            "by_reason": by_reason, "subject": subject, "body": body,
            "newest": [{"partition": p, "offset": o, "failures": f, "last_error": e,
                        "txid": t, "dead_at": d.isoformat()}
                       for p, o, f, e, t, d in rows[:NEWEST]],
            # the letters shown, each as it was (a letter that died again is another one)
            "shown": [[p, o, d.isoformat()] for p, o, _, _, _, d in rows],
        }


class ReplayApprovedDeadLettersOperator(_DeadLetterTask, BaseOperator):
    """Put back the dead letters ``preview`` showed, once ``approve`` approved (Airflow skips
    this task on a rejection): under the pipeline's coordinator lock, only those still dead
    letters exactly as shown.

    :param pipeline: the registered pipeline's name.
    :param pipeline_refs: where the pipeline is declared, besides the registry.
    :param postgres_conn_id: the coordinator's PostgreSQL connection.
    :param preview_task_id: the task that showed the letters.
    :param approval_task_id: the approval task.
    """

    def __init__(self, *, pipeline: str, pipeline_refs: Iterable[str] = (),
                 postgres_conn_id: str = DEFAULT_CONN_ID, preview_task_id: str = "preview",
                 approval_task_id: str = "approve", **kwargs):
        super().__init__(**kwargs)
        self._setup(pipeline, pipeline_refs, postgres_conn_id)
        self.preview_task_id = preview_task_id
        self.approval_task_id = approval_task_id

    def execute(self, context) -> dict[str, Any]:
        ti = context["ti"]
        shown = ti.xcom_pull(task_ids=self.preview_task_id) or {}
        answer = ti.xcom_pull(task_ids=self.approval_task_id) or {}
        if "Approve" not in (answer.get("chosen_options") or []):
            raise AirflowSkipException(f"not approved ({answer.get('chosen_options')}): "
                                       "nothing replayed")
        who = (answer.get("responded_by_user") or {}).get("name") or "?"
        letters = shown.get("shown") or []
        with airflow_outcomes():
            pipeline = self._load()
        asked_by = getattr(context.get("dag_run"), "triggering_user_name", None)
        refused = approver_refused(pipeline.approvers, asked_by, who)
        if refused:
            self.log.warning("REPLAY pipeline=%s: refused, nothing replayed: %s",
                             pipeline.name, refused)
            _note(context, pipeline.name, f"not replayed: {refused}")
            raise AirflowFailException(refused)
        with airflow_outcomes():
            with connection(resolve_dsn(self.postgres_conn_id),
                            application_name="onceflow-replay") as conn, \
                    transaction(conn) as cur:
                cur.execute("SET LOCAL lock_timeout = '60s'")  # a commit holds it briefly
                txlog.lock_pipeline(cur, pipeline.name)
                cur.execute(
                    """SELECT d.partition, d."offset" FROM dead_letters d
                       WHERE d.pipeline = %s AND (d.partition, d."offset", d.dead_at) IN (
                           SELECT * FROM unnest(%s::int[], %s::bigint[], %s::timestamptz[]))""",
                    (pipeline.name, [p for p, _, _ in letters], [o for _, o, _ in letters],
                     [d for _, _, d in letters]))
                still = [(p, o) for p, o in cur.fetchall()]
                moved = replay_dead_letters(cur, pipeline.name, positions=still) if still else 0
        gone = len(letters) - moved
        self.log.warning("REPLAY pipeline=%s: %d dead letter(s) put back, approved by %s "
                         "(%s)%s", pipeline.name, moved, who, shown.get("choice"),
                         f"; {gone} shown no longer dead letters as shown, left alone"
                         if gone else "")
        _note(context, pipeline.name,
              f"{moved:,} dead letter(s) of {pipeline.name} replayed, approved by {who}"
              + (f" ({gone:,} shown were no longer dead letters)" if gone else ""))
        return {"pipeline": pipeline.name, "replayed": moved, "shown": len(letters),
                "gone": gone, "approved_by": who}


DOC = """
### onceflow: replay dead letters of {name}, after approval

Trigger with **records** (`PARTITION:OFFSET`, ...), **error_contains**, **last_error** (a
whole last error), or **all**: the onceflow view's Replay buttons trigger it so.
`preview` shows what would go back to the backflow queue (per reason, the newest);
`approve` waits for a person (Airflow's *Required actions*); `replay` puts back exactly the
letters shown, only after *Approve*. *Reject* (or no answer within {timeout}) changes nothing.
"""


def replay_dead_letters_dag(pipeline: Pipeline | str, *, dag_id: str | None = None,
                            pipeline_refs: Iterable[str] = (),
                            response_timeout: timedelta | None = timedelta(days=1),
                            approvers: Sequence[dict[str, str]] | None = None,
                            notifiers: Any = None, start_date: datetime | None = None,
                            tags: Iterable[str] = (), postgres_conn_id: str = DEFAULT_CONN_ID,
                            **dag_kwargs: Any) -> DAG:
    """The DAG ``onceflow_<name>_replay_dead_letters``: preview >> approve >> replay.

    :param response_timeout: how long the request waits; then it counts as rejected.
    :param approvers: who may answer (``[{"id": ..., "name": ...}]``, Airflow's HITL users);
        None: anyone who may act on the DAG.
    :param notifiers: Airflow notifiers told when the request is made (e.g. a chat message
        with the link to the required action).
    """

    pipeline, refs = pipeline_with_refs(pipeline, pipeline_refs)
    common = {"pipeline": pipeline.name, "pipeline_refs": refs,
              "postgres_conn_id": postgres_conn_id}
    with DAG(
        dag_id=dag_id or replay_dag_id(pipeline.name),
        description=f"onceflow: replay dead letters of {pipeline.name} after approval",
        doc_md=DOC.format(name=pipeline.name, timeout=response_timeout or "ever"),
        schedule=None,
        start_date=start_date or datetime(2026, 1, 1),
        catchup=False,
        max_active_runs=1,
        tags=["onceflow", "dead-letters", *tags],
        default_args={"retries": 1, "retry_delay": timedelta(seconds=30)},
        params={
            "records": Param([], type="array", items={"type": "string",
                                                      "pattern": "^[0-9]+:[0-9]+$"},
                             description="Dead letters to replay as PARTITION:OFFSET (the "
                                         "onceflow view and `onceflow status` list them)."),
            "error_contains": Param(None, type=["null", "string"], minLength=1,
                                    description="Replay the dead letters whose errors contain "
                                                "this text (with records: both must match)."),
            "last_error": Param(None, type=["null", "string"], minLength=1,
                                description="Replay the dead letters whose last error is "
                                            "exactly this text (one reason of the onceflow "
                                            "view's list)."),
            "all": Param(False, type="boolean",
                         description="Replay every dead letter of the pipeline."),
        },
        **dag_kwargs,
    ) as dag:
        preview = DeadLetterPreviewOperator(task_id="preview", **common)
        approve = ApprovalOperator(
            task_id="approve",
            subject="{{ ti.xcom_pull(task_ids='preview')['subject'] }}",
            body="{{ ti.xcom_pull(task_ids='preview')['body'] }}",
            defaults=ApprovalOperator.REJECT,
            response_timeout=response_timeout,
            assigned_users=list(approvers) if approvers else None,
            notifiers=notifiers,
        )
        replay = ReplayApprovedDeadLettersOperator(task_id="replay", **common)
        preview >> approve >> replay
    dag.fileloc = sys._getframe(1).f_globals.get("__file__", dag.fileloc)
    return dag
