"""Reading every state table for verify, each in the database holding it."""

from __future__ import annotations

from collections.abc import Mapping

from onceflow.core import state_tables, tables
from onceflow.core.db import connect
from onceflow.core.pipeline import Pipeline
from onceflow.core.registration import external_dsn


def read_states(conn, pipeline: Pipeline, state_dsns: Mapping[str, str] | None,
                 reader=state_tables.read_rows) -> dict[str, dict]:
    """Every state table: ``reader(cur, spec)`` for a count state, its rows for a typed one."""
    return each_state(conn, pipeline, state_dsns, lambda cur, spec: (
        tables.read_table(cur, spec.shape(), spec.opaque) if spec.typed else reader(cur, spec)))


def each_state(conn, pipeline: Pipeline, state_dsns: Mapping[str, str] | None, read,
                specs=None) -> dict:
    """``read(cur, spec)`` of every state (of ``specs``), each in the database holding it."""
    states = {}
    for spec in pipeline.states if specs is None else specs:
        other = connect(external_dsn(spec, state_dsns)) if spec.conn_id else None
        try:
            with (other or conn).cursor() as cur:
                states[spec.name] = read(cur, spec)
            (other or conn).commit()
        finally:
            if other is not None:
                other.close()
    return states
