"""A pipeline's place in the coordinator's database: its coordinator row, its state tables,
its source; and the one way to start its offsets again (force_from_start).

``ensure_registered`` is idempotent and cheap when nothing is missing, so the first begin of
a new pipeline registers it without anyone running `onceflow init` (which does the same and
also applies migrations).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping

from onceflow.core import backflow, db, offsets, tables, txlog
from onceflow.core import state_tables as state_tables
from onceflow.core.connections import resolve_dsn
from onceflow.core.db import connection, transaction
from onceflow.core.errors import ConfigError
from onceflow.core.pipeline import Pipeline

log = logging.getLogger(__name__)


def register(conn, pipeline: Pipeline, state_dsns: Mapping[str, str] | None = None, *,
             create_source: bool = False) -> uuid.UUID:
    """Create the pipeline's coordinator row, state tables and backflow queues (idempotent).

    A stored topic that differs from the configured one is refused: a silent switch would mix
    two sources' offsets. ``state_dsns`` gives the database of each state kept outside the
    coordinator's (StateSpec.conn_id). A source that does not exist is refused unless
    ``create_source`` (then it is made, e.g. a topic with its partitions).
    """
    pipeline.validate()
    pipeline.source.ensure(conn, create=create_source)
    with transaction(conn) as cur:
        cur.execute(
            """INSERT INTO pipelines (name, instance_id, topic, mode) VALUES (%s, %s, %s, %s)
               ON CONFLICT (name) DO NOTHING""",
            (pipeline.name, str(uuid.uuid4()), pipeline.topic, pipeline.mode),
        )
        cur.execute("SELECT instance_id, topic FROM pipelines WHERE name = %s", (pipeline.name,))
        instance_id, topic = cur.fetchone()
        if topic != pipeline.topic:
            raise ConfigError(
                f"pipeline[{pipeline.name}].source topic={pipeline.topic!r} but the pipeline is "
                f"stored with topic {topic!r}: configure topic {topic!r}, or give the new "
                "source a new pipeline name")
        cur.execute("UPDATE pipelines SET mode = %s WHERE name = %s AND mode <> %s",
                    (pipeline.mode, pipeline.name, pipeline.mode))
        backflow.ensure_pointers(cur, pipeline.name)
        for spec in pipeline.states:
            if spec.typed:
                tables.ensure_staging(cur, pipeline.name, spec.shape())
                if spec.conn_id is None:
                    tables.ensure_table(cur, spec.shape(), spec.opaque, with_txid_index=False)
            elif spec.conn_id is None:
                state_tables.ensure_table(cur, spec)
    for spec in pipeline.external_states():
        with connection(external_dsn(spec, state_dsns)) as external, \
                transaction(external) as cur:
            if spec.typed:
                tables.ensure_table(cur, spec.shape(), spec.opaque, with_txid_index=True)
            else:
                state_tables.ensure_table(cur, spec)
    return uuid.UUID(str(instance_id))


def is_registered(cur, pipeline: Pipeline) -> bool:
    """Registered with this topic, and every table the coordinator holds for it exists (a
    state added to the declaration since is made by registering again)."""
    cur.execute("SELECT topic FROM pipelines WHERE name = %s", (pipeline.name,))
    row = cur.fetchone()
    if row is None or row[0] != pipeline.topic:
        return False
    names = [spec.name for spec in pipeline.states if spec.conn_id is None]
    names += [f'{tables.STAGING_SCHEMA}."{pipeline.name}.{spec.name}"'
              for spec in pipeline.typed_states()]
    cur.execute("SELECT bool_and(to_regclass(n) IS NOT NULL) FROM unnest(%s::text[]) n",
                (names,))
    return bool(cur.fetchone()[0])


def external_dsn(spec, state_dsns: Mapping[str, str] | None) -> str:
    if state_dsns and spec.name in state_dsns:
        return state_dsns[spec.name]

    return resolve_dsn(spec.conn_id, setting=f"state[{spec.name}].conn_id")


def external_dsns(pipeline: Pipeline) -> dict[str, str]:
    """The database of every state kept outside the coordinator's, from its connection."""
    return {spec.name: external_dsn(spec, None) for spec in pipeline.external_states()}


def reset_offsets(conn, pipeline: Pipeline) -> uuid.UUID:
    """force_from_start: forget the pipeline's offsets, so every partition starts again by
    ``pipeline.start_policy``, under a new instance id. Refused while a transaction is open
    (its batch would overlap the new plan). The state tables are left as they are: records
    read again are counted again, which is what asking for a reset means. Logged loudly."""
    with transaction(conn) as cur:
        coordinator = txlog.lock_pipeline(cur, pipeline.name)
        open_txids = txlog.uncommitted(cur, pipeline.name)
        if open_txids:
            raise ConfigError(
                f"force_from_start for {pipeline.name!r} refused: txids "
                f"{', '.join(map(str, open_txids))} are not committed; commit or backfill them "
                "first")
        instance = uuid.uuid4()
        cur.execute(
            """UPDATE pipelines SET instance_id = %s, reset_after_txid = %s WHERE name = %s""",
            (str(instance), coordinator.next_txid - 1, pipeline.name),
        )
        offsets.forget(cur, pipeline.name)
    log.warning("RESET pipeline=%s: offsets forgotten after txid %d; partitions start again "
                "by start_policy=%s; instance %s -> %s", pipeline.name,
                coordinator.next_txid - 1, pipeline.start_policy, coordinator.instance_id,
                instance)
    return instance


def ensure_ready(conn, pipeline: Pipeline) -> None:
    """The schema is up to date and the pipeline registered (cheap when both hold), so the
    first begin of a new pipeline needs no `onceflow init`. Its source must exist."""

    if not db.up_to_date(conn):
        applied = db.migrate(conn)
        if applied:
            log.info("applied onceflow migrations %s", ", ".join(applied))
    with transaction(conn) as cur:
        ready = is_registered(cur, pipeline)
    if not ready:
        instance = register(conn, pipeline, external_dsns(pipeline))
        log.info("registered pipeline %s (instance %s)", pipeline.name, instance)
