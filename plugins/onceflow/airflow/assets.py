"""Airflow Assets for onceflow's state tables: downstream DAGs schedule on committed data.

Each state table of a pipeline is an Asset (``onceflow/<pipeline>/<table>``), an outlet of
the task that commits (``commit_outlets``): Airflow's lineage lists that task as producing
the table. An event goes to each table only when the task committed a txid, saying what that
commit applied to that table: ``{"txid": 17, "rows": 1021, "ranges": [...]}`` (``rows``: the
table's own rows). A failed attempt or a fenced one ends the task failed or skipped (no
event); a run that committed nothing (a no-op re-run of a committed txid) drops the outlets
before it succeeds (``no_events``), so Airflow records no event for it.

    from onceflow.airflow.assets import state_asset

    with DAG("revenue_report", schedule=[state_asset("orders", "revenue_per_merchant")]):
        ...
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from airflow.sdk import Asset, AssetAlias, AssetWatcher

from onceflow.airflow.triggers import SourceWatchTrigger
from onceflow.core.connections import DEFAULT_CONN_ID


def state_asset(pipeline: str, table: str) -> Asset:
    """The Asset of one state table of ``pipeline``."""
    return Asset(name=f"onceflow/{pipeline}/{table}", uri=f"onceflow://{pipeline}/{table}",
                 group="onceflow")


def source_asset(pipeline, refs: Iterable[str] = (),
                 postgres_conn_id: str = DEFAULT_CONN_ID, *, dag_id: str | None = None,
                 max_runs: int | None = None) -> Asset:
    """The Asset of ``pipeline``'s source (``onceflow-source://<pipeline>``), watched by a
    SourceWatchTrigger in the triggerer: what its transaction DAG is scheduled on when it
    keeps up (``keep_up=True``, docs/keep-up.md). The trigger's arguments are the pipeline's
    settings: a changed declaration makes Airflow replace the trigger."""
    trigger = SourceWatchTrigger(
        pipeline=pipeline.name, pipeline_refs=list(refs), postgres_conn_id=postgres_conn_id,
        watch_interval=float(pipeline.watch_interval), min_records=pipeline.batch_start_records,
        max_delay_s=pipeline.max_delay_s, max_pending=pipeline.max_pending,
        batch_size=pipeline.batch_size, dag_id=dag_id or f"onceflow_{pipeline.name}",
        max_runs=max_runs)
    return Asset(name=f"onceflow-source/{pipeline.name}",
                 uri=f"onceflow-source://{pipeline.name}", group="onceflow",
                 watchers=[AssetWatcher(name=f"onceflow_{pipeline.name}_source",
                                        trigger=trigger)])


def pipeline_alias(pipeline: str) -> AssetAlias:
    """An alias of the pipeline's state tables (the commit task's outlet before its tables
    were: kept for DAGs that name it)."""
    return AssetAlias(name=f"onceflow/{pipeline}", group="onceflow")


def commit_outlets(pipeline) -> list[Asset]:
    """The outlets of the task that commits ``pipeline``'s transactions: its state tables.
    Declared, they also make Airflow create the Assets when it parses the DAG (the first
    commits of runs in flight would otherwise create them at once, and all but one fail on
    Airflow's unique index after committing)."""
    return [state_asset(pipeline.name, spec.table) for spec in pipeline.states]


def emit(context, pipeline, *, txid: int, table_rows: Mapping[str, int],
         ranges: list[str] | tuple[str, ...]) -> None:
    """The event of each state table for a committed txid: its own rows applied. A task
    that committed txids before (a keep-up run carries on) gives one event of them all:
    ``txid`` the newest, ``txids`` each, ``rows`` and ``ranges`` theirs together."""
    for spec in pipeline.states:
        event = context["outlet_events"][state_asset(pipeline.name, spec.table)]
        before = dict(event.extra or {})
        extra = {"txid": txid, "rows": int(table_rows.get(spec.table, 0)),
                 "ranges": list(ranges)}
        if "txid" in before:
            extra.update(txids=[*before.get("txids", [before["txid"]]), txid],
                         rows=int(before.get("rows", 0)) + extra["rows"],
                         ranges=[*before.get("ranges", ()), *ranges])
        event.extra = extra


def no_events(task) -> None:
    """This try of ``task`` (the running copy Airflow made of it) committed nothing: Airflow
    records an event for every outlet of a task that succeeds, so it has none."""
    task.outlets = []
