"""Transaction DAGs: begin >> process (mapped over groups) >> commit, one DAG per pipeline; or,
for a pipeline declared with ``dag_shape="single"``, one task that runs the three.

A DAG file is one call (wiring only; nothing heavy at import)::

    from onceflow.airflow import transaction_dag
    from my_company.pipelines import PAGE_VIEWS

    dag = transaction_dag(PAGE_VIEWS, schedule="@hourly")

or a DAG for every registered pipeline: ``globals().update(transaction_dags())``. Building
a DAG imports no topology module (no Spark in the scheduler's parse): the declaration check
that needs the topology (Pipeline.build_topology) runs where Spark does, in begin and
process, and in `onceflow pipelines` and `onceflow init`. Airflow's
safe-mode parsing only opens DAG files whose text contains "airflow" and "dag": a file that
only calls these says both words in its docstring.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import DAG, Param, get_parsing_context

from onceflow.airflow.alerts import commit_lag_dag, monitor_dag_id
from onceflow.airflow.approval import replay_dag_id, replay_dead_letters_dag
from onceflow.airflow.assets import commit_outlets, source_asset
from onceflow.airflow.operators import (
    WAIT_IN_TASK_S,
    BeginBatchOperator,
    CommitBatchOperator,
    ProcessBatchOperator,
    TransactionOperator,
    lease_for_retry,
    load_pipeline,
    mark_transaction_failed,
    seconds_setting,
)
from onceflow.core import keepup
from onceflow.core.connections import DEFAULT_CONN_ID
from onceflow.core.errors import ConfigError
from onceflow.core.pipeline import DAG_SHAPES, Pipeline, check
from onceflow.core.registry import (
    installed_entry_points,
    invalid_pipelines,
    pipelines,
    reference_of,
)

# Runs a transaction DAG lets start past its pipeline's max_pending, by DAG shape: each waits
# in its begin for a place and plans the moment a transaction commits. A one-task DAG lets two,
# because the scheduler's hop to the next run often outlasts the time between two commits; a
# three-task DAG waits for the scheduler between its tasks anyway, so a second waiting run
# would only hold a worker slot and a PostgreSQL connection.
STANDBY_RUNS = {"single": 2, "phases": 1}
# The entry point group of the DAGs installed packages ship (shipped_dags).
SHIPPED_DAGS = "onceflow.dags"
# The schema of a trigger-form number that must be 1 or more. Not a top-level "minimum":
# Airflow's trigger form gives that to its number field, which on leaving the field turns
# 0 into 1 without a word (a run of one record); inside allOf the form leaves the value
# alone and the same validation (the form's POST, the REST API, dag.test) refuses 0 with
# "Invalid input for param batch_size: 0 is less than the minimum of 1".
AT_LEAST_ONE = {"allOf": [{"minimum": 1}]}

DOC = """
### onceflow: {name}, exactly once

{description}

One DAG run is one attempt of one transaction:

1. **begin** gives the run its transaction attempt (the txid from the trigger form: a
   backfill; the run's own txid: a Clear; the lowest failed or abandoned txid; or a new one)
   and stores the offsets it reads. Past `max_pending` open transactions it waits for one to
   commit (the DAG lets one run more start), and is skipped if none does within
   {begin_wait:g} s;
2. **process** runs the topology on Spark over exactly those offsets and stages the result;
3. **commit** waits for txid - 1 (in the task up to {wait_in_task:g} s, then deferred: no
   worker slot held), then applies the states, the offsets and the commit record in one
   PostgreSQL transaction. Its log has one `COMMIT ... txid=N attempt=A prev_txid=N-1 rows=R
   waited=Ws` line.

Source: {source}. States: {states}.
"""

SINGLE_DOC = """
### onceflow: {name}, exactly once

{description}

One DAG run is one attempt of one transaction, in one task, **transaction**, whose log says
each phase: BEGIN (the txid and the offsets it reads; past `max_pending` open transactions it
waits for one to commit, and is skipped if none does within {begin_wait:g} s), PROCESSED
(the topology on Spark Connect over exactly those offsets, staged), and COMMIT (in txid
order: it waits for txid - 1, in the task up to {wait_in_task:g} s, then deferred; then the
states, the offsets and the commit record in one PostgreSQL transaction: `COMMIT ... txid=N
attempt=A prev_txid=N-1 rows=R waited=Ws`). A retry starts again at begin with a new attempt
of the same txid.

Source: {source}. States: {states}.
"""


KEEP_UP_DOC = """
Runs start by themselves (`keep_up`): a watcher in the triggerer looks at the source every
{interval:g}s and starts a run once {min_records:,} records wait or the oldest has waited
{max_delay:g}s, up to {max_pending} in flight (twice as many more wait in their begin for
a place); a run it started that finds nothing to read ends without a txid. Trigger and
backfills work as well. See docs/keep-up.md.
"""


def transaction_dag(pipeline: Pipeline | str, *, dag_id: str | None = None,
                    pipeline_refs: Iterable[str] = (), schedule: Any = None,
                    start_date: datetime | None = None, tags: Iterable[str] = (),
                    default_args: Mapping[str, Any] | None = None,
                    description: str | None = None, doc_md: str | None = None,
                    max_active_runs: int | None = None, spark_conn_id: str = "spark_default",
                    postgres_conn_id: str = DEFAULT_CONN_ID, shape: str | None = None,
                    **dag_kwargs: Any) -> DAG:
    """The transaction DAG of ``pipeline`` (a Pipeline, or the name of a registered one).

    ``shape``: "phases" (begin >> process >> commit) or "single" (one ``transaction`` task,
    onceflow.airflow.operators.TransactionOperator); default: the pipeline's ``dag_shape``.

    ``dag_id`` defaults to ``onceflow_<name>``; the trigger form's batch_size and groups
    default to the pipeline's own; retries come from the pipeline (``retries``) unless
    ``default_args`` says otherwise; ``max_active_runs`` defaults to its ``max_pending`` +
    ``STANDBY_RUNS[shape]`` (2 for "single", 1 for "phases"): the runs past ``max_pending``
    wait in their begin and one plans the moment a transaction commits
    (``BeginBatchOperator``'s ``wait_for_slot``).

    A pipeline declared with ``keep_up=True`` is scheduled on its source
    (onceflow.airflow.triggers.source_watch: a watcher in the triggerer starts runs when
    records wait),
    ``max_active_runs`` defaulting to three times its ``max_pending`` (the runs past it wait in
    their begin: onceflow.core.keepup.max_runs); ``schedule`` is then refused.
    """
    refs = tuple(pipeline_refs)
    if isinstance(pipeline, str):
        pipeline = load_pipeline(pipeline, refs)
    else:

        pipeline.validate()
        ref = reference_of(pipeline)
        if ref is None:
            raise ConfigError(
                f"pipeline {pipeline.name!r} has no reference other processes can load: "
                "declare it at the top level of an importable module (not the DAG file), or "
                "register it (entry point onceflow.pipelines / ONCEFLOW_PIPELINES)")
        refs = (*refs, ref) if ref not in refs else refs
    args = {
        # a task's last failure marks its attempt failed: the next run adopts the txid
        "on_failure_callback": mark_transaction_failed,
        # a retry's delay is a wait between two tasks: the attempt keeps its txid meanwhile
        "on_retry_callback": lease_for_retry,
        "retries": pipeline.retries,
        "retry_delay": timedelta(
            seconds=seconds_setting("retry_delay", None, "retry_delay_seconds")),
        **(default_args or {}),
    }
    shape = shape or pipeline.dag_shape
    check(shape in DAG_SHAPES, "shape", shape, f"choose one of {', '.join(DAG_SHAPES)}")
    runs = max_active_runs or pipeline.max_pending + STANDBY_RUNS[shape]
    if pipeline.keep_up:
        check(schedule is None, "schedule", schedule,
              f"pipeline {pipeline.name!r} keeps up (keep_up=True): its runs start when its "
              "source has records. Leave schedule out, or declare keep_up=False")
        runs = max_active_runs or keepup.max_runs(pipeline)
        schedule = [source_asset(pipeline, refs, postgres_conn_id,
                                 dag_id=dag_id or f"onceflow_{pipeline.name}", max_runs=runs)]
    with DAG(
        dag_id=dag_id or f"onceflow_{pipeline.name}",
        description=description or pipeline.description or f"onceflow pipeline {pipeline.name}",
        doc_md=doc_md or (SINGLE_DOC if shape == "single" else DOC).format(
            name=pipeline.name, description=pipeline.description,
            begin_wait=seconds_setting("begin_wait", None, "begin_wait_s"),
            wait_in_task=WAIT_IN_TASK_S,
            source=pipeline.source.describe(),
            states=", ".join(f"`{s.table}`" for s in pipeline.states)) + (
            KEEP_UP_DOC.format(interval=pipeline.watch_interval,
                               min_records=pipeline.batch_start_records,
                               max_delay=pipeline.max_delay_s, max_pending=pipeline.max_pending)
            if pipeline.keep_up and not doc_md else ""),
        start_date=start_date or datetime(2026, 1, 1),
        schedule=schedule,
        catchup=False,
        max_active_runs=runs,
        render_template_as_native_obj=True,
        tags=["onceflow", "exactly-once", *tags],
        default_args=args,
        params={
            "batch_size": Param(pipeline.batch_size, type="integer", **AT_LEAST_ONE,
                                description="Records per new transaction, across all "
                                            "partitions: 1 or more."),
            "groups": Param(pipeline.groups, type="integer", **AT_LEAST_ONE,
                            description="Parallel Spark tasks per new transaction: 1 or "
                                        "more."),
            "txid": Param(None, type=["null", "integer"], **AT_LEAST_ONE,
                          description="Re-attempt this txid (backfill): 1 or more. Empty: "
                                      "the next one."),
        },
        **dag_kwargs,
    ) as dag:
        common = {"pipeline": pipeline.name, "pipeline_refs": refs,
                  "postgres_conn_id": postgres_conn_id}
        # The committing task produces the state tables: their Assets are its outlets (an
        # event for each only when it committed a txid: onceflow.airflow.assets).
        emits = {"outlets": commit_outlets(pipeline)}
        # batch_size, groups and txid: the trigger form's params, read by begin itself
        if shape == "single":
            TransactionOperator(task_id="transaction", conn_id=spark_conn_id, **emits,
                                **common)
        else:
            begin = BeginBatchOperator(task_id="begin", **common)
            # one process task per processing group of the batch
            process = ProcessBatchOperator.partial(
                task_id="process", conn_id=spark_conn_id, **common).expand(batch=begin.output)
            commit = CommitBatchOperator(task_id="commit", batch=begin.output, **emits,
                                         **common)
            begin >> process >> commit
    # The DAG belongs to the file that called this (the UI shows that file's code).
    dag.fileloc = sys._getframe(1).f_globals.get("__file__", dag.fileloc)
    return dag


def transaction_dags(refs: Iterable[str] = (), **kwargs: Any) -> dict[str, DAG]:
    """A transaction DAG for every registered pipeline, by DAG id, and the DAGs its options
    ask for (``companion_dags``). In a task's process only that task's DAG is built
    (Airflow's parsing context names it): a task pays for one."""

    wanted = get_parsing_context().dag_id
    out = {}
    refused = [bad.message() for bad in invalid_pipelines(tuple(refs)).values()
               if not wanted or wanted == f"onceflow_{bad.name}"]
    for name, pipeline in sorted(pipelines(tuple(refs)).items()):
        if not wanted or wanted == f"onceflow_{name}":
            try:
                dag = transaction_dag(name, pipeline_refs=refs, **kwargs)
            except ConfigError as error:
                refused.append(str(error))
                continue
            out[dag.dag_id] = dag
        out.update(companion_dags(
            pipeline, refs, wanted=wanted,
            postgres_conn_id=kwargs.get("postgres_conn_id", DEFAULT_CONN_ID)))
    if refused:  # every one named at once; like any import error, the file's DAGs wait
        raise ConfigError(f"{len(refused)} pipeline(s) cannot have a DAG until their "
                          "declaration is fixed: " + "; ".join(refused))
    for dag in out.values():
        dag.fileloc = sys._getframe(1).f_globals.get("__file__", dag.fileloc)
    return out


def companion_dags(pipeline: Pipeline, refs: Iterable[str] = (), *, wanted: str | None = None,
                   postgres_conn_id: str = DEFAULT_CONN_ID) -> dict[str, DAG]:
    """The DAGs a pipeline's options ask for besides its transaction DAG, by DAG id:
    ``onceflow_<name>_commit_lag`` when it declares ``commit_lag_alert``
    (onceflow.airflow.alerts) and ``onceflow_<name>_replay_dead_letters`` when it declares
    ``dead_letter_approval`` (onceflow.airflow.approval). ``wanted``: only that DAG id."""
    out = {}
    refs = tuple(refs)
    if pipeline.commit_lag_alert is not None:

        if not wanted or wanted == monitor_dag_id(pipeline.name):
            dag = commit_lag_dag(pipeline.name, pipeline_refs=refs,
                                 postgres_conn_id=postgres_conn_id)
            out[dag.dag_id] = dag
    if pipeline.dead_letter_approval:

        if not wanted or wanted == replay_dag_id(pipeline.name):
            dag = replay_dead_letters_dag(pipeline.name, pipeline_refs=refs,
                                          postgres_conn_id=postgres_conn_id)
            out[dag.dag_id] = dag
    for dag in out.values():
        dag.fileloc = sys._getframe(1).f_globals.get("__file__", dag.fileloc)
    return out


def shipped_dags(built: Mapping[str, DAG] | None = None) -> dict[str, DAG]:
    """The DAGs installed packages ship to Airflow: entry points in the group
    ``onceflow.dags`` (a DAG, or a list of them), e.g. a pipeline's downstream reports.
    ``built``: the DAGs the file built before; in a task's process whose DAG is among them
    no entry point is loaded (a transaction DAG's task does not import the reports)."""

    wanted = get_parsing_context().dag_id
    if wanted and wanted in (built or {}):
        return {}
    out = {}
    for ep in installed_entry_points(SHIPPED_DAGS):
        value = ep.load()
        for dag in value if isinstance(value, list | tuple) else [value]:
            if not isinstance(dag, DAG):
                raise ConfigError(f"entry point {ep.name} = {ep.value!r} (group onceflow.dags) "
                                  f"is {type(dag).__name__}, not a DAG")
            if not wanted or wanted == dag.dag_id:
                out[dag.dag_id] = dag
    return out
