"""A pipeline's place in the coordinator's database: its coordinator row, its state tables
(each registered to it alone: state_table_owners), its source; and the one way to start its
offsets again (force_from_start).

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
from onceflow.core.errors import ConfigError, SharedTable
from onceflow.core.pipeline import Pipeline, StateSpec, one_owner, table_place

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
    # a table another pipeline holds is refused before anything of this one is made
    check_tables(conn, pipeline, state_dsns)
    pipeline.source.ensure(conn, create=create_source)
    with transaction(conn) as cur:
        cur.execute(
            """INSERT INTO pipelines (name, instance_id, topic, mode) VALUES (%s, %s, %s, %s)
               ON CONFLICT (name) DO NOTHING""",
            (pipeline.name, str(uuid.uuid4()), pipeline.topic, pipeline.mode),
        )
        claim_tables(cur, pipeline)
        cur.execute("SELECT instance_id, topic FROM pipelines WHERE name = %s", (pipeline.name,))
        instance_id, topic = cur.fetchone()
        if topic != pipeline.topic:
            raise ConfigError(
                f"pipeline[{pipeline.name}].source topic={pipeline.topic!r} but the pipeline is "
                f"stored with topic {topic!r}: configure topic {topic!r}, or give the new "
                "source a new pipeline name")
        cur.execute("UPDATE pipelines SET mode = %s WHERE name = %s AND mode <> %s",
                    (pipeline.mode, pipeline.name, pipeline.mode))
        cur.execute("UPDATE pipelines SET source = %s WHERE name = %s "
                    "AND source IS DISTINCT FROM %s",
                    (pipeline.source.identity, pipeline.name, pipeline.source.identity))
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


# state_table_owners.database of a table in the coordinator's own database
COORDINATOR = ""


def _places(pipeline: Pipeline) -> tuple[list[str], list[str]]:
    """Each of the pipeline's tables as (databases, table names), state_table_owners' key."""
    return ([spec.conn_id or COORDINATOR for spec in pipeline.states],
            [spec.table for spec in pipeline.states])


def _held_by_others(cur, pipeline: Pipeline) -> list[tuple[StateSpec, str, object]]:
    """The pipeline's tables another pipeline holds: (state, that pipeline, since when)."""
    databases, names = _places(pipeline)
    cur.execute("""SELECT o.database, o.table_name, o.pipeline, o.claimed_at
                   FROM state_table_owners o
                   JOIN unnest(%s::text[], %s::text[]) AS t (database, table_name)
                     USING (database, table_name)
                   WHERE o.pipeline <> %s""", (databases, names, pipeline.name))
    by_place = {(spec.conn_id or COORDINATOR, spec.table): spec for spec in pipeline.states}
    return [(by_place[(database, name)], owner, since)
            for database, name, owner, since in cur.fetchall()]


def _refusal(pipeline: Pipeline, held: list) -> SharedTable:
    problems = [
        f"pipeline {pipeline.name!r} declares table {spec.table!r} (state[{spec.name}], "
        f"{table_place(spec)}), which pipeline {owner!r} registered there on "
        f"{since.isoformat(' ', 'seconds')} and holds (the database remembers it, whether "
        f"{owner!r} is loaded here or not): "
        f"{one_owner(spec.table, spec.source_name, pipeline.name)}. If pipeline {owner!r} "
        f"is gone for good and its rows in {spec.table!r} are not wanted, drop the table "
        f"instead: a dropped table's registration is released"
        for spec, owner, since in held]
    return SharedTable("; ".join(problems))


def _exists(cur, spec: StateSpec, state_dsns: Mapping[str, str] | None) -> bool:
    if spec.conn_id is None:
        cur.execute("SELECT to_regclass(%s) IS NOT NULL", (spec.table,))
        return bool(cur.fetchone()[0])
    with connection(external_dsn(spec, state_dsns)) as external, \
            transaction(external) as ext:
        ext.execute("SELECT to_regclass(%s) IS NOT NULL", (spec.table,))
        return bool(ext.fetchone()[0])


def check_tables(conn, pipeline: Pipeline, state_dsns: Mapping[str, str] | None = None
                 ) -> None:
    """Refuse (SharedTable, naming both pipelines, the table and the fix) a table of the
    pipeline's that another pipeline registered in this coordinator's database. Another
    pipeline's claim on a table that no longer exists (dropped) is released, logged."""
    with transaction(conn) as cur:
        held = _held_by_others(cur, pipeline)
        dropped = [h for h in held if not _exists(cur, h[0], state_dsns)]
        kept = [h for h in held if h not in dropped]
        if kept:
            raise _refusal(pipeline, kept)
        for spec, owner, _ in dropped:
            cur.execute("""DELETE FROM state_table_owners
                           WHERE database = %s AND table_name = %s AND pipeline = %s""",
                        (spec.conn_id or COORDINATOR, spec.table, owner))
            log.warning("table %s (%s) was registered to pipeline %s but no longer exists: "
                        "released for pipeline %s", spec.table, table_place(spec), owner,
                        pipeline.name)


def claim_tables(cur, pipeline: Pipeline) -> None:
    """Register the pipeline's tables to it, in the registration's transaction; one another
    pipeline holds (claimed meanwhile) is refused and the transaction rolls back. A
    concurrent claim of the same table waits on its key, then sees who won."""
    databases, names = _places(pipeline)
    cur.execute("""INSERT INTO state_table_owners (database, table_name, pipeline)
                   SELECT database, table_name, %s
                   FROM unnest(%s::text[], %s::text[]) AS t (database, table_name)
                   ON CONFLICT (database, table_name) DO NOTHING""",
                (pipeline.name, databases, names))
    held = _held_by_others(cur, pipeline)
    if held:
        raise _refusal(pipeline, held)


def is_registered(cur, pipeline: Pipeline) -> bool:
    """Registered with this topic, its tables registered to it, and every table the
    coordinator holds for it exists (a state added to the declaration since is made by
    registering again)."""
    cur.execute("SELECT topic FROM pipelines WHERE name = %s", (pipeline.name,))
    row = cur.fetchone()
    if row is None or row[0] != pipeline.topic:
        return False
    databases, names = _places(pipeline)
    cur.execute("""SELECT count(*) FROM state_table_owners o
                   JOIN unnest(%s::text[], %s::text[]) AS t (database, table_name)
                     USING (database, table_name)
                   WHERE o.pipeline = %s""", (databases, names, pipeline.name))
    if cur.fetchone()[0] != len(names):
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
