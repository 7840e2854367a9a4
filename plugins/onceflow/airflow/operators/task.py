"""What the operators' tasks share: the pipeline's loading, its settings as a run gives them,
the run note, onceflow's errors as Airflow outcomes, and the failure and retry callbacks."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from onceflow.airflow.compat import AirflowFailException, AirflowSkipException
from onceflow.core import settings
from onceflow.core.begin import mark_failed
from onceflow.core.connections import DEFAULT_CONN_ID, resolve_dsn
from onceflow.core.db import connection
from onceflow.core.errors import (
    BlockedByEarlierTxid,
    ConfigError,
    Fenced,
    MaxPendingReached,
    NothingToPlan,
    OnceflowError,
    Permanent,
    StagingIncomplete,
    is_permanent,
)
from onceflow.core.lease import AttemptLease, report
from onceflow.core.pipeline import check
from onceflow.core.registry import get_pipeline
from onceflow.core.txlog import TransactionAttempt

# How long a commit task waits for txid - 1 in the task before it defers: most turns come
# within it, and a deferral costs the triggerer a hand-over each way.
WAIT_IN_TASK_S = 30.0


@contextmanager
def airflow_outcomes():
    """onceflow's errors as Airflow outcomes (see the module docstring)."""

    try:
        yield
    except Fenced as fenced:
        raise AirflowSkipException(f"superseded, nothing to do: {fenced}") from fenced
    except (MaxPendingReached, NothingToPlan) as nothing:
        raise AirflowSkipException(str(nothing)) from nothing
    except (Permanent, BlockedByEarlierTxid, StagingIncomplete) as error:
        raise AirflowFailException(f"{type(error).__name__}: {error}") from error


def run_note(context, make) -> None:
    """Run notes (onceflow.airflow.ui.notes): say what this task's run did, ``make(notes)``
    giving the note. Never fails the task."""
    if not context or "ti" not in context:
        return
    try:
        from onceflow.airflow.ui import notes  # the UI's modules load only for a note

        notes.push(context, make(notes))
    except Exception as error:
        logging.getLogger(__name__).warning("no run note: %s", error)


@contextmanager
def noting_skips(context, pipeline: str, ta=None):
    """A task skipped because its attempt was fenced says so in the run's note."""
    try:
        yield
    except AirflowSkipException as skip:
        why = str(skip).removeprefix("superseded, nothing to do: ")
        run_note(context, lambda notes: notes.superseded(pipeline, why, *(
            (ta.txid, ta.attempt) if ta is not None else ())))
        raise


def started_by_watcher(context) -> bool:
    """Whether this task's run was started by an Asset event (a keep-up pipeline's source
    watcher, onceflow.airflow.triggers.source_watch), not by a person, a backfill or a schedule."""
    run = (context or {}).get("dag_run")
    kind = getattr(run, "run_type", None)
    # the Task SDK's DagRunType is an Enum whose str() is "DagRunType.ASSET_TRIGGERED"
    return str(getattr(kind, "value", kind) or "") == "asset_triggered"


def load_pipeline(name: str, refs: Iterable[str] = (), **settings: Any):
    """The pipeline ``name`` (registry lookup), with trigger-form settings applied."""

    overrides = {k: int(v) for k, v in settings.items() if v not in (None, "")}
    return get_pipeline(name, tuple(refs), **overrides)


def attempt_of(batch: Mapping[str, Any] | list):
    """The attempt of begin's result: one group's entry, or the list of all of them."""

    if isinstance(batch, list):
        batch = batch[0]
    return TransactionAttempt(int(batch["txid"]), int(batch["attempt"]))


def _batch_of(context) -> Mapping[str, Any] | None:
    batch = getattr(context.get("task"), "batch", None)
    if not isinstance(batch, Mapping | list):
        batch = context["ti"].xcom_pull(task_ids="begin")
    if isinstance(batch, list):
        batch = batch[0] if batch else None
    return batch


def mark_transaction_failed(context) -> None:
    """on_failure_callback of process and commit (after their last retry): mark the attempt's
    transaction failed so the next run adopts it. Fenced: a zombie attempt marks nothing."""

    task = context["task"]
    batch = _batch_of(context)
    if not batch:
        return
    error = context.get("exception")
    cause = getattr(error, "__cause__", None)  # onceflow's error an Airflow outcome carries
    what = f"{type(cause).__name__}: {cause}" if isinstance(cause, OnceflowError) \
        else repr(error)
    reason = f"{task.task_id} failed in run {context['run_id']}: {what}"
    dsn = resolve_dsn(getattr(task, "postgres_conn_id", DEFAULT_CONN_ID))
    with connection(dsn) as conn:
        mark_failed(conn, batch["pipeline"], attempt_of(batch), reason,
                    permanent=is_permanent(error))


def lease_for_retry(context) -> None:
    """on_retry_callback of process, commit and transaction: the attempt waits for the retry
    with the hand-over lease (at least the retry's delay and a lease), so the next run does
    not adopt its txid meanwhile. Fenced: an attempt no longer current is left alone."""

    task = context["task"]
    batch = _batch_of(context)
    if not batch:
        return
    pipeline = load_pipeline(batch["pipeline"], getattr(task, "pipeline_refs", ()))
    delay = getattr(task, "retry_delay", None)
    wait = int(delay.total_seconds()) if isinstance(delay, timedelta) else 0
    report(resolve_dsn(getattr(task, "postgres_conn_id", DEFAULT_CONN_ID)), pipeline.name,
           attempt_of(batch), max(pipeline.handoff_lease_s, wait + pipeline.lease_s))


def seconds_setting(name: str, value: Any, setting: str) -> float:
    """A number of seconds >= 0: ``value``, else onceflow's setting ``setting``
    (onceflow.core.settings); a ConfigError naming where a bad one came from."""

    if value is None:
        return float(settings.get(setting))
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    check(seconds >= 0, name, value, "give a number of seconds, 0 or more")
    return seconds


def plan_setting(name: str, value: Any, where: str) -> int | None:
    """A plan setting of a run (batch_size, groups, txid): a whole number, 1 or more, or
    None (empty: the pipeline's own, the next txid). Anything else is refused with a
    ConfigError naming the setting and where it came from: a run never goes on with another
    value than the one it was given."""

    if value is None or value == "":
        return None
    number = None
    if isinstance(value, int | str) and not isinstance(value, bool):
        try:
            number = int(value)
        except ValueError:
            pass
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    if number is None or number < 1:
        empty = "the next txid" if name == "txid" else "the pipeline's own"
        raise ConfigError(f"{name}={value!r} ({where}) is invalid: give a whole number, 1 or "
                          f"more, or leave it empty for {empty}; nothing was planned")
    return number


class PipelineTask:
    """What the three operators share: which pipeline, found how, in which database."""

    pipeline: str
    pipeline_refs: tuple[str, ...]
    postgres_conn_id: str

    def _which(self, pipeline: str, pipeline_refs: Iterable[str], postgres_conn_id: str) -> None:
        self.pipeline = pipeline
        self.pipeline_refs = tuple(pipeline_refs)
        self.postgres_conn_id = postgres_conn_id

    def _pipeline(self, **settings):
        return load_pipeline(self.pipeline, self.pipeline_refs, **settings)

    def _dsn(self) -> str:
        return resolve_dsn(self.postgres_conn_id)

    @contextmanager
    def _holding(self, pipeline, dsn: str, ta, *, handoff: bool):
        """This task holds ``ta`` while the block runs: a thread reports its lease every
        lease / 4 (onceflow.core.lease). ``handoff``: the run goes on in another task after
        a block that ends well, so the attempt is left with the hand-over lease. Inside a
        block that holds it already, that lease goes on."""

        held = getattr(self, "_lease", None)
        if held is not None:
            yield held
            return
        lease = AttemptLease(dsn, pipeline.name, ta, pipeline.attempt_heartbeat_s,
                             lease_s=pipeline.lease_s,
                             handoff_s=pipeline.handoff_lease_s if handoff else None)
        self._lease = lease
        try:
            with lease:
                yield lease
        finally:
            self._lease = None
