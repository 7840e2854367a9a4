"""Airflow Assets for onceflow's state tables: downstream DAGs schedule on committed data.

Each state table of a pipeline is an Asset (``onceflow/<pipeline>/<table>``). The commit task
has the pipeline's AssetAlias as its outlet and attaches an event to each state's Asset only
when it committed a txid: a failed attempt, a fenced one or a no-op re-run emits nothing. The
event's extra says what was committed: ``{"txid": 17, "rows": 1021, "ranges": [...]}``.

    from onceflow.airflow.assets import state_asset

    with DAG("revenue_report", schedule=[state_asset("orders", "revenue_per_merchant")]):
        ...
"""

from __future__ import annotations

from airflow.sdk import Asset, AssetAlias


def state_asset(pipeline: str, table: str) -> Asset:
    """The Asset of one state table of ``pipeline``."""
    return Asset(name=f"onceflow/{pipeline}/{table}", uri=f"onceflow://{pipeline}/{table}",
                 group="onceflow")


def pipeline_alias(pipeline: str) -> AssetAlias:
    """The commit task's outlet: the events of the tables a commit changed."""
    return AssetAlias(name=f"onceflow/{pipeline}", group="onceflow")


def emit(context, pipeline, *, txid: int, rows: int, ranges: list[str]) -> None:
    """One event per state table for a committed txid."""
    events = context["outlet_events"][pipeline_alias(pipeline.name)]
    for spec in pipeline.states:
        events.add(state_asset(pipeline.name, spec.table),
                   extra={"txid": txid, "rows": rows, "ranges": ranges})
