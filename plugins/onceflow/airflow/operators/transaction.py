"""Airflow operators for the three phases of a transaction: begin, process, commit; and one
that runs all three in one task (TransactionOperator, a pipeline's ``dag_shape="single"``).

DAG files only wire these together (onceflow.airflow.dags); all logic lives in onceflow.core.
How onceflow's outcomes show in Airflow:

- a fenced attempt (a duplicate run, a zombie that woke up late) and a run past max_pending
  that no commit made room for within ``wait_for_slot`` end as **skipped**, with the reason
  in the log: nothing is wrong, another attempt carries on;
- a permanent error (a bad setting, an unknown txid or pipeline, an unreachable database)
  fails the task at once, without retries (``AirflowFailException``);
- anything else is retried, and after the last retry marks the transaction failed, so that
  the next run adopts it.

A task that holds a transaction attempt (process, commit, the one-task transaction) reports
its lease while it runs; between two tasks of a run (begin to process, process to commit, a
retry's delay, a deferred commit) the attempt has the longer hand-over lease
(onceflow.core.lease).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from airflow.providers.apache.spark.hooks.spark_connect import SparkConnectHook
from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk import BaseHook, BaseOperator

from onceflow.airflow.assets import emit, no_events
from onceflow.airflow.compat import AirflowFailException, AirflowSkipException
from onceflow.airflow.triggers import CommitTurnTrigger, TurnListener, look_for_turn
from onceflow.core import freshness, settings, txlog
from onceflow.core.begin import begin, mark_failed
from onceflow.core.commit import commit
from onceflow.core.connections import DEFAULT_CONN_ID, resolve_dsn
from onceflow.core.db import connection, transaction
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
from onceflow.core.registration import ensure_ready, external_dsns
from onceflow.core.registry import get_pipeline, reference_of
from onceflow.core.txlog import TransactionAttempt
from onceflow.kvstate import open_state_provider
from onceflow.sources.jvm import jvm_conf
from onceflow.spark.conf import processing_conf
from onceflow.spark.versions import check_pyspark_pair

# The spark-submit application: the installed onceflow.spark package's entry point file.
PROCESS_ENTRY_POINT = str(
    Path(importlib.util.find_spec("onceflow.spark").origin).parent / "process_batch.py"
)

# The most txids a keep-up run commits in turn (TransactionOperator): a run stays a bounded
# piece of work in Airflow's pages and logs; the watcher starts the next.
CARRY_ON_TXIDS = 10

# How long a commit task waits for txid - 1 in the task before it defers: most turns come
# within it, and a deferral costs the triggerer a hand-over each way.
WAIT_IN_TASK_S = 30.0

# onceflow's processing settings (onceflow.spark.conf); INFO logging only costs time.
SPARK_DEFAULTS = {
    **processing_conf(),
    "spark.ui.enabled": "false",
    "spark.log.level": "WARN",
}


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
        from onceflow.airflow.ui import notes

        notes.push(context, make(notes))
    except Exception as error:
        import logging

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


class _PipelineTask:
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


class _Begins(_PipelineTask):
    """The begin phase (BeginBatchOperator, TransactionOperator): needs ``batch_size``,
    ``groups``, ``txid``, ``wait_for_slot`` and ``poll_interval``. A plan setting left None
    is the run's param of that name (the trigger form of onceflow's DAGs), read directly:
    a ``{{ params.x }}`` template would cost a Jinja compile per field in every task."""

    batch_size: Any
    groups: Any
    txid: Any
    wait_for_slot: float
    poll_interval: float

    def _plan_settings(self, batch_size: Any, txid: Any, groups: Any,
                       wait_for_slot: float | None, poll_interval: float) -> None:
        self.batch_size = batch_size
        self.txid = txid
        self.groups = groups
        self.wait_for_slot = seconds_setting("wait_for_slot", wait_for_slot, "begin_wait_s")
        self.poll_interval = poll_interval

    def _begin(self, context) -> list[dict[str, Any]]:
        try:
            with airflow_outcomes():
                form = context.get("params") or {}
                setting = {name: plan_setting(name, form.get(name), "the run's param")
                           if getattr(self, name) is None else
                           plan_setting(name, getattr(self, name), "the task's argument")
                           for name in ("batch_size", "groups", "txid")}
                pipeline = self._pipeline(batch_size=setting["batch_size"],
                                          groups=setting["groups"])
                # the declaration, checked before a txid is planned (the DAG's parse does
                # not import the topology): a bad one fails the run naming it, no retry
                build_checked(pipeline)
                txid = setting["txid"]
                # a run the source watcher started plans no transaction of no records
                skip_empty = started_by_watcher(context)
                self._planning = pipeline  # the settings a carried-on batch keeps
                with connection(self._dsn()) as conn:
                    ensure_ready(conn, pipeline)
                    batch = self._begin_when_free(pipeline, lambda: begin(
                        conn, pipeline, context["run_id"], txid=txid,
                        lease_s=self._first_lease(pipeline), skip_empty=skip_empty))
        except AirflowSkipException as skip:  # max_pending, or nothing to read
            why = str(skip)
            run_note(context, lambda notes: notes.nothing_planned(self.pipeline, why))
            raise
        except Exception as error:
            cause = error.__cause__ or error
            run_note(context, lambda notes: notes.no_txid(self.pipeline, cause))
            raise
        return self._planned(context, pipeline, batch)

    def _planned(self, context, pipeline, batch) -> list[dict[str, Any]]:
        ta = batch.attempt
        run_note(context, lambda notes: notes.no_op(pipeline.name, ta.txid) if batch.committed
                 else notes.planned(pipeline.name, ta.txid, ta.attempt, batch.records))
        self.log.info("%s: %s reads %d records in %d range(s)%s", pipeline.name, batch.attempt,
                      batch.records, len(batch.ranges),
                      " (committed already: nothing to do)" if batch.committed else "")
        return [
            {"pipeline": pipeline.name, "txid": batch.attempt.txid,
             "attempt": batch.attempt.attempt, "group": group, "groups": batch.groups,
             "records": sum(r.size for r in batch.ranges_of(group)),
             "committed": batch.committed}
            for group in range(batch.groups)
        ]

    def _first_lease(self, pipeline) -> int | None:
        """The lease begin gives the attempt: the hand-over lease, as the run goes on in its
        process tasks (TransactionOperator goes on in the same task: the pipeline's)."""
        return pipeline.handoff_lease_s

    def _begin_when_free(self, pipeline, attempt):
        """``attempt()`` (begin); while it finds ``max_pending`` transactions open, wait for
        a commit (LISTEN on the announcements, a look every poll_interval) and try again,
        for up to ``wait_for_slot`` seconds; then MaxPendingReached goes up (a skip)."""

        until = time.monotonic() + self.wait_for_slot
        started, listener = time.monotonic(), None
        try:
            while True:
                try:
                    batch = attempt()
                except MaxPendingReached as full:
                    if time.monotonic() >= until:
                        raise
                    if listener is None:  # listening before the next look: no commit missed
                        self.log.info("%s; waiting up to %.0fs for one to commit",
                                      full, self.wait_for_slot)
                        # named, so that a run that carries on leaves the place to it
                        listener = TurnListener(self._dsn(),
                                                txlog.begin_waiter_name(pipeline.name))
                        continue
                    listener.wait(min(self.poll_interval, max(0.0, until - time.monotonic())))
                    continue
                if listener is not None:
                    self.log.info("%s: a place freed after %.2fs", pipeline.name,
                                  time.monotonic() - started)
                return batch
        finally:
            if listener is not None:
                listener.close()


class BeginBatchOperator(_Begins, BaseOperator):
    """Give this DAG run its transaction attempt and store the batch's offset ranges.

    :param pipeline: the registered pipeline's name.
    :param pipeline_refs: ``module:attribute`` references where the pipeline is declared,
        besides entry points and ``ONCEFLOW_PIPELINES``.
    :param postgres_conn_id: the coordinator's PostgreSQL connection.
    :param batch_size: records for a new transaction (default: the run's ``batch_size``
        param, else the pipeline's own).
    :param groups: processing groups for a new transaction (default: the run's ``groups``
        param, else the pipeline's own).
    :param txid: re-attempt this txid (a manual backfill); empty: the run's ``txid`` param,
        else the next one.
    :param wait_for_slot: seconds a run past the pipeline's ``max_pending`` waits here for a
        transaction to commit (woken by the commit's announcement) before it ends as skipped
        (0: at once). Default: the setting ONCEFLOW_BEGIN_WAIT_S (300).
    :param poll_interval: seconds between looks while waiting, besides the announcements.

    The first begin of a pipeline applies onceflow's migrations and registers it. Past the
    pipeline's ``max_pending`` the task waits for a free place (the DAG lets one run more
    than ``max_pending`` start, two in a one-task DAG: onceflow.airflow.dags.STANDBY_RUNS, so
    the next transaction is planned the moment one commits, not scheduler loops later); if
    none frees in ``wait_for_slot`` seconds the task (and run) ends as skipped: nothing
    planned. Returns one entry per processing group (the process task maps over them).
    """

    template_fields = ("batch_size", "txid", "groups")

    def __init__(self, *, pipeline: str, pipeline_refs: Iterable[str] = (),
                 postgres_conn_id: str = DEFAULT_CONN_ID, batch_size: Any = None,
                 txid: Any = None, groups: Any = None, wait_for_slot: float | None = None,
                 poll_interval: float = 2.0, **kwargs):
        super().__init__(**kwargs)
        self._which(pipeline, pipeline_refs, postgres_conn_id)
        self._plan_settings(batch_size, txid, groups, wait_for_slot, poll_interval)

    def execute(self, context) -> list[dict[str, Any]]:
        return self._begin(context)


# Held while the Spark client is imported in spark_client_loading's thread and while a
# topology is built: two threads importing pyspark at once can see a partly initialised
# pyspark.sql (ImportError "cannot import name ... partially initialized module").
SPARK_IMPORTS = threading.Lock()


def build_checked(pipeline) -> None:
    """Build ``pipeline``'s topology (its declaration checked), never beside the thread that
    imports the Spark client."""
    with SPARK_IMPORTS:
        pipeline.build_topology()


def _import_spark_layer() -> None:
    try:
        with SPARK_IMPORTS:
            for module in ("onceflow.spark.session", "onceflow.spark.localspark",
                           "onceflow.spark.processing"):
                importlib.import_module(module)
    except Exception:  # noqa: S110 (imported again where used, which then says what is wrong)
        pass


@contextmanager
def spark_client_loading():
    """Import the Spark client and onceflow's Spark layer in a thread while the block runs:
    a one-task transaction needs them right after its begin, which may wait for a place
    among max_pending, so the imports are off the path to its commit. The thread is joined
    before the task ends."""
    thread = threading.Thread(target=_import_spark_layer, name="onceflow-spark-import",
                              daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join()


def module_root(ref: str | None) -> str | None:
    """The folder from which ``ref``'s module is imported (for PYTHONPATH of a process that
    must import it too), or None when it cannot be told."""
    if not ref:
        return None
    module = sys.modules.get(ref.partition(":")[0])
    origin = getattr(module, "__file__", None)
    if not origin:
        return None
    depth = module.__name__.count(".") + (1 if origin.endswith("__init__.py") else 0)
    return str(Path(origin).resolve().parents[depth])


def spark_connect_url(conn_id: str) -> str | None:
    """The Spark Connect URL of connection ``conn_id`` when its type is ``spark_connect``;
    None for a ``spark`` connection (spark-submit to its master)."""

    conn = BaseHook.get_connection(conn_id)
    if conn.conn_type != "spark_connect":
        return None

    return SparkConnectHook(conn_id).get_connection_url().rstrip("/")


class _Processes(_PipelineTask):
    """The processing phase (ProcessBatchOperator, TransactionOperator)."""

    def _ready_to_process(self, pipeline, dsn: str, ta) -> bool:
        """The fence, checked before any Spark work: False when the txid is committed
        already (nothing to do); Fenced when ``ta`` is not its current attempt."""

        with airflow_outcomes():
            with connection(dsn) as conn, transaction(conn) as cur:
                state = txlog.fence(cur, pipeline.name, ta)
            if state is txlog.TxState.COMMITTED:
                self.log.info("%s of %s is committed already: nothing to process", ta,
                              pipeline.name)
                return False
            if state is not txlog.TxState.PLANNED:
                raise Fenced(f"{ta} of {pipeline.name} is {state}: not processed")
        return True

    def _process_here(self, url: str, pipeline, dsn: str, ta, group: int) -> None:
        # imported here: pyspark loads with it: only where Spark is used
        from onceflow.spark.localspark import revive
        from onceflow.spark.processing import process_batch
        from onceflow.spark.session import SHARED_SESSION_KEY, connect_session

        started = time.monotonic()
        # the local server onceflow started died (killed mid-batch, say): started again here
        with airflow_outcomes():
            revived = revive(url)
        if revived is not None:
            self.log.warning("the Spark Connect server onceflow started at %s was gone: "
                             "started it again (%s) in %.1fs", url, revived.line(),
                             time.monotonic() - started)
        with airflow_outcomes(), connect_session(url, f"onceflow-{pipeline.name}",
                                                   shared=SHARED_SESSION_KEY) as spark:
            self.log.info("processing %s of %s, group %d on %s (session in %.2fs)", ta,
                          pipeline.name, group, url, time.monotonic() - started)
            process_batch(spark, dsn, pipeline, ta, group)


class ProcessBatchOperator(_Processes, SparkSubmitOperator):
    """The processing phase of one (txid, attempt, group): on a warm Spark through Spark
    Connect, or by spark-submit, as the Spark connection says.

    :param pipeline: the registered pipeline's name.
    :param batch: one entry of begin's result (txid, attempt, group).
    :param pipeline_refs: where the pipeline is declared (passed on to the Spark driver).
    :param postgres_conn_id: the coordinator's PostgreSQL connection.

    ``conn_id`` is the Spark connection. Of type ``spark_connect`` (e.g.
    ``spark-connect://127.0.0.1:15002``): this task is a Spark Connect client and runs the
    processing phase here, with no JVM start. Of type ``spark``: ``spark-submit
    spark_tasks/process_batch.py`` to its master (``local[2]``, ``spark://host:7077``, yarn,
    k8s), other keyword arguments going to SparkSubmitOperator; the DSN reaches the driver
    through the environment (never the command line or the template fields) and the
    pipeline's reference and its module's folder go along. Either way the fence is checked
    first: a committed txid or a fenced attempt starts no Spark work.
    """

    template_fields = (*SparkSubmitOperator.template_fields, "batch")

    def __init__(self, *, pipeline: str, batch: Any, pipeline_refs: Iterable[str] = (),
                 postgres_conn_id: str = DEFAULT_CONN_ID, **kwargs):
        kwargs.setdefault("application", PROCESS_ENTRY_POINT)
        kwargs.setdefault("name", f"onceflow-{pipeline}")
        kwargs.setdefault("on_failure_callback", mark_transaction_failed)
        kwargs.setdefault("on_retry_callback", lease_for_retry)
        kwargs["conf"] = {**SPARK_DEFAULTS, **(kwargs.get("conf") or {})}
        venv_submit = Path(sys.executable).with_name("spark-submit")
        if venv_submit.exists():
            kwargs.setdefault("spark_binary", str(venv_submit))
        super().__init__(**kwargs)
        self._which(pipeline, pipeline_refs, postgres_conn_id)
        self.batch = batch  # one entry of begin's result

    def execute(self, context) -> None:
        ta = attempt_of(self.batch)
        group = int(self.batch.get("group", 0))
        with noting_skips(context, self.pipeline, ta):
            self._process(context, ta, group)

    def _process(self, context, ta, group: int) -> None:
        with airflow_outcomes():
            pipeline, dsn = self._pipeline(), self._dsn()
        with self._holding(pipeline, dsn, ta, handoff=True):
            self._process_held(context, pipeline, dsn, ta, group)

    def _process_held(self, context, pipeline, dsn: str, ta, group: int) -> None:
        if not self._ready_to_process(pipeline, dsn, ta):
            return
        url = spark_connect_url(self._conn_id)
        if url is not None:
            self._process_here(url, pipeline, dsn, ta, group)
            return
        with airflow_outcomes():  # a declaration error fails here, once, not in the driver
            check_pyspark_pair()
            build_checked(pipeline)

        ref = reference_of(pipeline)
        refs = [*self.pipeline_refs, *([ref] if ref and ref not in self.pipeline_refs else [])]
        self.application_args = [
            "--pipeline", pipeline.name, "--txid", str(ta.txid),
            "--attempt", str(ta.attempt), "--group", str(group),
            *[arg for r in refs for arg in ("--pipelines", r)],
        ]
        path = [p for p in (module_root(r) for r in refs) if p]
        self.env_vars = {
            **(self.env_vars or {}),
            settings.env_name("pg_dsn"): dsn,
            "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable),
            "PYSPARK_DRIVER_PYTHON": os.environ.get("PYSPARK_DRIVER_PYTHON", sys.executable),
            **({"PYTHONPATH": os.pathsep.join(
                [*path, *filter(None, [os.environ.get("PYTHONPATH")])])} if path else {}),
        }

        # onceflow's JVM reader travels with the application (added to the conf's jars)
        self.conf = jvm_conf(self.conf)
        self.log.info("processing %s of %s, group %d (spark-submit)", ta, pipeline.name, group)
        super().execute(context)


class _Commits(_PipelineTask):
    """The commit phase (CommitBatchOperator, TransactionOperator): needs ``batch`` (begin's
    result), ``poll_interval`` and ``wait_in_task``. A deferred commit resumes in
    ``execute_complete`` with the batch it deferred with."""

    batch: Any
    poll_interval: float
    wait_in_task: float

    def execute_complete(self, context, event: dict[str, Any] | None = None,
                         batch: Any = None, earlier: list | None = None) -> dict[str, Any]:
        if batch is not None:
            self.batch = batch
        # the txids this task committed before it deferred (a run that carried on): their
        # Asset events are recorded when the task ends, so they are given again
        self._earlier = [(int(t), dict(rows), list(ranges)) for t, rows, ranges in earlier or ()]
        if context and "outlet_events" in context:
            pipeline = self._pipeline()
            for txid, rows, ranges in self._earlier:
                emit(context, pipeline, txid=txid, table_rows=rows, ranges=ranges)
        return self._try_commit(float((event or {}).get("deadline", 0)) or time.time(), context)

    def _try_commit(self, deadline: float, context=None) -> dict[str, Any]:
        with noting_skips(context, self.pipeline, attempt_of(self.batch)):
            out = self._commit_turn(deadline, context)
        if getattr(self, "_may_carry_on", False) and out["status"] == "committed":
            # a run that may carry on plans first: its note is said once it ends
            self._unsaid = lambda notes: self._note(notes, out)
        else:
            run_note(context, lambda notes: self._note(notes, out))
        return out

    def _note(self, notes, out: dict[str, Any]) -> dict[str, Any]:
        batch = self.batch if isinstance(self.batch, list) else [self.batch]
        records = sum(int(b.get("records", 0)) for b in batch)
        if out["status"] != "already_committed":
            return notes.committed(self.pipeline, out["txid"], out["attempt"], records=records,
                                   failed=out["failed"], dead=out["dead"],
                                   waited_s=out["waited_s"], fresh_s=out.get("fresh_s"),
                                   earlier=[t for t, *_ in getattr(self, "_earlier", ())])
        if any(b.get("committed") for b in batch):  # begin found it committed
            return notes.no_op(self.pipeline, out["txid"])
        # this attempt committed it, on an earlier try of this task
        return notes.committed(self.pipeline, out["txid"], out["attempt"], records=records,
                               earlier_try=True)

    def _waited_here(self, dsn: str, pipeline: str, ta, deadline: float) -> bool:
        """Wait in the task for the turn (see the class docstring), up to ``wait_in_task``
        seconds. Returns whether it waited (then commit is tried again)."""

        if self.wait_in_task <= 0:
            return False
        until = min(deadline, time.time() + self.wait_in_task)
        started = time.monotonic()
        listener = TurnListener(dsn)
        try:
            while time.time() < until:
                last, hopeless = look_for_turn(dsn, pipeline, ta.txid, ta.attempt)
                if last >= ta.txid - 1 or hopeless:
                    break
                listener.wait(min(self.poll_interval, max(0.0, until - time.time())))
        finally:
            listener.close()
        self.log.info("%s waited %.2fs in the task for its turn", ta,
                      time.monotonic() - started)
        return True

    def _commit_turn(self, deadline: float, context=None) -> dict[str, Any]:
        ta = attempt_of(self.batch)
        with airflow_outcomes():
            pipeline = self._pipeline()
            dsn = self._dsn()
            with self._holding(pipeline, dsn, ta, handoff=False) as lease, \
                    connection(dsn) as conn:
                result = commit(conn, pipeline, ta, state_dsns=external_dsns(pipeline),
                                coordinator_dsn=dsn, open_state=open_state_provider)
                if result.status == "waiting" and not result.blocker.hopeless \
                        and self._waited_here(dsn, pipeline.name, ta, deadline):
                    result = commit(conn, pipeline, ta, state_dsns=external_dsns(pipeline),
                                    coordinator_dsn=dsn, open_state=open_state_provider)
                if result.status == "waiting" and not result.blocker.hopeless \
                        and time.time() < deadline:
                    # deferred: the triggerer holds the attempt from here on
                    lease.hand_over(pipeline.handoff_lease_s)
                fresh = None
                if result.status == "committed":  # for the run's note
                    with conn.cursor() as cur:
                        fresh = freshness.of_txid(cur, pipeline.name, ta.txid)
                    conn.rollback()
            if result.status == "waiting":
                blocker = result.blocker
                if blocker.hopeless:
                    # a permanent failure needs its fix before a re-run can help
                    first = ("Fix what its reason says (retrying cannot help until then), "
                             "then backfill" if blocker.permanent else "Backfill")
                    raise BlockedByEarlierTxid(
                        f"{ta} of {pipeline.name} cannot commit: {blocker.describe()}. "
                        f"{first} txid {blocker.txid}: trigger this DAG with "
                        f'{{"txid": {blocker.txid}}} or run `onceflow backfill --pipeline '
                        f"{pipeline.name}`; this txid is re-run after it")
                if time.time() >= deadline:
                    raise BlockedByEarlierTxid(
                        f"{ta} of {pipeline.name} waited for its turn until the commit timeout: "
                        f"{blocker.describe()}")
        if result.status == "waiting":
            self.log.info("%s waits for %s", ta, result.blocker.describe())
            self.defer(
                trigger=CommitTurnTrigger(pipeline.name, ta.txid, ta.attempt,
                                          self.postgres_conn_id, self.poll_interval, deadline,
                                          lease_s=pipeline.handoff_lease_s),
                method_name="execute_complete",
                kwargs={"batch": self.batch, **({"earlier": [
                    [t, rows, ranges] for t, rows, ranges in self._earlier]}
                    if getattr(self, "_earlier", ()) else {})},
            )
        if result.status == "committed":  # what a run that carries on gives again
            self._events = (ta.txid, dict(result.table_rows), list(result.ranges))
        if context and "outlet_events" in context:

            if result.status == "committed":
                emit(context, pipeline, txid=ta.txid, table_rows=result.table_rows,
                     ranges=result.ranges)
            elif not getattr(self, "_earlier", ()):
                no_events(self)  # committed before (an earlier try, another run): no event
        return {"txid": ta.txid, "attempt": ta.attempt, "status": result.status,
                "rows_applied": result.rows_applied, "waited_s": result.waited_s,
                "failed": result.failed, "dead": result.dead,
                "fresh_s": list(fresh) if fresh else None}


class CommitBatchOperator(_Commits, BaseOperator):
    """Commit the batch when its turn comes (txid - 1 committed), in one PostgreSQL transaction.

    :param pipeline: the registered pipeline's name.
    :param batch: begin's result.
    :param pipeline_refs: where the pipeline is declared, besides the registry.
    :param postgres_conn_id: the coordinator's PostgreSQL connection.
    :param commit_timeout: how long to wait for the turn (default: the pipeline's
        ``commit_timeout_s``).
    :param poll_interval: seconds between looks at the commit log while waiting.
    :param wait_in_task: seconds a commit waits for its turn in the task before it defers
        (0: defer at once).

    While an earlier txid is uncommitted and alive (processing or committing, reporting within
    its lease), the task first waits for its turn here, up to ``wait_in_task`` seconds, woken by
    the commit announcements: the earlier batch is usually seconds from its commit, and a
    deferral costs a trigger, a new task process and the scheduler's delays, seconds under load
    (docs/design.md). Past that it defers (no worker slot is held) to CommitTurnTrigger, which
    keeps this attempt's lease alive. A DAG lets ``max_pending`` + 1 runs in flight, so the
    waits hold a bounded few slots. When the earlier txid failed or its run died, it fails at
    once, naming the txid to backfill. Committing an already committed txid is a logged no-op; a
    fenced attempt ends as skipped.
    """

    template_fields = ("batch",)

    def __init__(self, *, pipeline: str, batch: Any, pipeline_refs: Iterable[str] = (),
                 postgres_conn_id: str = DEFAULT_CONN_ID,
                 commit_timeout: timedelta | None = None, poll_interval: float = 2.0,
                 wait_in_task: float = WAIT_IN_TASK_S, **kwargs):
        kwargs.setdefault("on_failure_callback", mark_transaction_failed)
        kwargs.setdefault("on_retry_callback", lease_for_retry)
        super().__init__(**kwargs)
        self._which(pipeline, pipeline_refs, postgres_conn_id)
        self.batch = batch
        self.commit_timeout = commit_timeout
        self.poll_interval = poll_interval
        self.wait_in_task = wait_in_task

    def execute(self, context) -> dict[str, Any]:
        timeout = (self.commit_timeout.total_seconds() if self.commit_timeout
                   else self._pipeline().commit_timeout_s)
        return self._try_commit(time.time() + timeout, context)


class TransactionOperator(_Begins, _Processes, _Commits, BaseOperator):
    """A whole transaction in one task: begin, process every group on a Spark Connect server,
    commit in txid order (a pipeline's ``dag_shape="single"``).

    :param pipeline: the registered pipeline's name.
    :param pipeline_refs: where the pipeline is declared, besides the registry.
    :param postgres_conn_id: the coordinator's PostgreSQL connection.
    :param conn_id: the Spark connection; of type ``spark_connect`` (a spark-submit per batch
        is the three-task DAG's).
    :param batch_size, groups, txid, wait_for_slot: as BeginBatchOperator's.
    :param commit_timeout, wait_in_task: as CommitBatchOperator's.
    :param poll_interval: seconds between looks while waiting for a place or the turn.

    The phases are the three operators' own, in order, with the same fences, outcomes, run notes
    and log lines (BEGIN, PROCESSED, COMMIT), so the transaction is as exactly once as in three
    tasks; what changes is what Airflow sees: one task per run. A run costs Airflow one task
    process instead of three and no scheduling hop between the phases (figures in
    bench/RESULTS.md). A retry starts again at begin, which gives the run
    a new attempt of its own txid (the old one is fenced). Groups are processed side by side on
    the one Spark session. Waiting for the turn to commit defers the task as the commit task
    does; it resumes at the commit, the batch carried in the deferral.

    A run the source watcher started (keep-up) **carries on**: once it committed, it begins
    the next batch in the same task while ``batch_start_records`` wait and fewer than
    ``max_pending`` are open (onceflow.core.begin's ``carry_on``), up to CARRY_ON_TXIDS txids
    a run. Airflow makes at most one run of a DAG per scheduler loop, and a run's task takes
    seconds to start; batches that commit faster than that would otherwise drain one or two
    at a time. Each txid is its own transaction as before (its BEGIN, PROCESSED and COMMIT
    lines, fences and lease); the run's note and its Asset events name every txid it
    committed, and a retry begins again at the run's newest txid. A run waiting in its begin
    for a place takes it first; a run still starting may find its batch taken and plan
    nothing (skipped, no empty transaction).
    """

    template_fields = ("batch_size", "txid", "groups")

    def __init__(self, *, pipeline: str, pipeline_refs: Iterable[str] = (),
                 postgres_conn_id: str = DEFAULT_CONN_ID, conn_id: str = "spark_default",
                 batch_size: Any = None, txid: Any = None, groups: Any = None,
                 wait_for_slot: float | None = None, commit_timeout: timedelta | None = None,
                 poll_interval: float = 2.0, wait_in_task: float = WAIT_IN_TASK_S, **kwargs):
        kwargs.setdefault("on_failure_callback", mark_transaction_failed)
        kwargs.setdefault("on_retry_callback", lease_for_retry)
        super().__init__(**kwargs)
        self._which(pipeline, pipeline_refs, postgres_conn_id)
        self._plan_settings(batch_size, txid, groups, wait_for_slot, poll_interval)
        self.conn_id = conn_id
        self.commit_timeout = commit_timeout
        self.wait_in_task = wait_in_task
        self.batch: list[dict[str, Any]] | None = None

    def execute(self, context) -> dict[str, Any]:
        self._earlier: list[tuple[int, dict[str, int], list[str]]] = []
        with spark_client_loading():
            self.batch = self._begin(context)
            with airflow_outcomes():
                pipeline, dsn = self._pipeline(), self._dsn()
            while True:
                ta = attempt_of(self.batch)
                self._may_carry_on = started_by_watcher(context) \
                    and len(self._earlier) + 1 < CARRY_ON_TXIDS
                with self._holding(pipeline, dsn, ta, handoff=False):
                    out = self._transact(context, pipeline, dsn, ta)
                following = self._carry_on(context, dsn) \
                    if self._may_carry_on and out["status"] == "committed" else None
                if following is None:
                    if self._may_carry_on and out["status"] == "committed":
                        run_note(context, self._unsaid)
                    return out
                self._earlier.append(self._events)
                self.batch = following

    def _carry_on(self, context, dsn: str) -> list[dict[str, Any]] | None:
        """The next batch of a keep-up run that just committed (see the class docstring), or
        None: a run waits in its begin (woken by the commit, it takes the place), fewer than
        ``batch_start_records`` wait (the watcher starts their run), or ``max_pending`` are
        open again."""
        pipeline = self._planning
        try:
            with connection(dsn) as conn:
                with conn.cursor() as cur:
                    waiting = txlog.begin_waiters(cur, pipeline.name)
                conn.rollback()
                if waiting:
                    raise NothingToPlan(f"{waiting} run(s) wait in their begin for the place")
                batch = begin(conn, pipeline, context["run_id"], carry_on=True)
        except (MaxPendingReached, NothingToPlan) as nothing:
            self.log.info("%s: the run ends after %d txid(s): %s", pipeline.name,
                          len(self._earlier) + 1, nothing)
            return None
        except Exception as error:  # noqa: BLE001 (its txid committed: the run succeeded)
            self.log.warning("%s: the run does not carry on after %d txid(s) (%s: %s); the "
                             "watcher starts the next", pipeline.name, len(self._earlier) + 1,
                             type(error).__name__, error)
            return None
        self.log.info("%s: the run carries on with %s (after %d committed)", pipeline.name,
                      batch.attempt, len(self._earlier) + 1)
        return self._planned(context, pipeline, batch)

    def _first_lease(self, pipeline) -> int | None:
        return None  # processing and commit follow in this task

    def _transact(self, context, pipeline, dsn: str, ta) -> dict[str, Any]:
        with noting_skips(context, self.pipeline, ta), airflow_outcomes():
            url = spark_connect_url(self.conn_id)
            if url is None:
                raise ConfigError(
                    f"connection {self.conn_id!r} is not of type spark_connect: a one-task "
                    f"transaction DAG processes on a Spark Connect server. Point it at one "
                    f"(spark-connect://host:15002), or declare pipeline {self.pipeline!r} "
                    "with dag_shape='phases' to spark-submit each batch")
            groups = [int(entry["group"]) for entry in self.batch]
            ready = groups if self._ready_to_process(pipeline, dsn, ta) else []
            if len(ready) == 1:
                self._process_here(url, pipeline, dsn, ta, ready[0])
            elif ready:

                with ThreadPoolExecutor(len(ready), thread_name_prefix="onceflow-group") as pool:
                    for done in [pool.submit(self._process_here, url, pipeline, dsn, ta, g)
                                 for g in ready]:
                        done.result()
        timeout = (self.commit_timeout.total_seconds() if self.commit_timeout
                   else pipeline.commit_timeout_s)
        return self._try_commit(time.time() + timeout, context)
