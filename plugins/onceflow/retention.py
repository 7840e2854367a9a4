"""Retention of the PostgreSQL source log: delete the records below an offset.

Like a Kafka log, the source does not wait for its readers: a pipeline that had not read the
deleted records finds its offsets out of range (see onceflow/offsets.py). What a pipeline HAD
committed from them is summed into retired_counts / retired_records first, in the same
PostgreSQL transaction and under its coordinator row's lock, so `onceflow verify` can still
account for every committed record.
"""

from __future__ import annotations

import logging
from collections import Counter

from onceflow.db import transaction
from onceflow.pipeline import ConfigError, get_pipeline, load_callable

log = logging.getLogger(__name__)


def _retire(cur, name: str, topic: str, moves: list[tuple[int, int, int]]) -> int:
    """Sum what pipeline ``name`` committed from the records about to go."""
    try:
        pipeline = get_pipeline(name)
    except ConfigError:
        log.warning("retention: pipeline %s is not registered here; verify will not account "
                    "for its deleted records", name)
        return 0
    cur.execute('SELECT partition, "offset" FROM partition_offsets WHERE pipeline = %s',
                (name,))
    committed = dict(cur.fetchall())
    payloads: list[str] = []
    for partition, old_start, new_start in moves:
        upto = min(new_start, committed.get(partition, 0))
        if upto <= old_start:
            continue
        # Records parked in the backflow queues or dead letters were not counted: they keep
        # their payload there, and a replay that completes later is kept for verify.
        cur.execute(
            """SELECT l.payload FROM source_log l WHERE l.topic = %s AND l.partition = %s
               AND l."offset" >= %s AND l."offset" < %s
               AND NOT EXISTS (SELECT 1 FROM backflow_items b WHERE b.pipeline = %s
                               AND b.partition = l.partition AND b."offset" = l."offset")
               AND NOT EXISTS (SELECT 1 FROM dead_letters d WHERE d.pipeline = %s
                               AND d.partition = l.partition AND d."offset" = l."offset")""",
            (topic, partition, old_start, upto, name, name),
        )
        payloads += [p for (p,) in cur.fetchall()]
    if not payloads:
        return 0
    result = load_callable(pipeline.recompute)(payloads, pipeline)
    max_states = getattr(result, "max_states", frozenset())
    for state_name, counts in result.counts.items():
        for key, value in Counter(counts).items():
            cur.execute(
                """INSERT INTO retired_counts (pipeline, state_name, key, value)
                   VALUES (%(p)s, %(s)s, %(k)s, %(v)s) ON CONFLICT (pipeline, state_name, key)
                   DO UPDATE SET value = CASE WHEN %(max)s
                       THEN GREATEST(retired_counts.value, EXCLUDED.value)
                       ELSE retired_counts.value + EXCLUDED.value END""",
                {"p": name, "s": state_name, "k": key, "v": value,
                 "max": state_name in max_states},
            )
    cur.execute(
        """INSERT INTO retired_records (pipeline, records, rejected) VALUES (%s, %s, %s)
           ON CONFLICT (pipeline) DO UPDATE SET records = retired_records.records
           + EXCLUDED.records, rejected = retired_records.rejected + EXCLUDED.rejected""",
        (name, result.records, sum(result.rejected.values())),
    )
    return result.records


def delete_before(conn, topic: str, before: int, partition: int | None = None) -> int:
    """Delete the records of ``topic`` below offset ``before`` (one partition, or all) and move
    the log start there. Returns how many records were deleted."""
    with transaction(conn) as cur:
        cur.execute("SELECT EXISTS (SELECT 1 FROM source_segments WHERE topic = %s)", (topic,))
        if cur.fetchone()[0]:
            raise ConfigError(f"topic={topic!r} is a file-segment topic: retention applies to "
                              "the PostgreSQL log only (file segments are not deleted yet)")
        cur.execute("SELECT name FROM pipelines WHERE topic = %s ORDER BY name FOR UPDATE",
                    (topic,))
        names = [n for (n,) in cur.fetchall()]
        cur.execute(
            """SELECT partition, log_start_offset, LEAST(next_offset, %(before)s)
               FROM source_partitions
               WHERE topic = %(topic)s AND log_start_offset < %(before)s
                 AND (%(partition)s::int IS NULL OR partition = %(partition)s)
               ORDER BY partition FOR UPDATE""",
            {"topic": topic, "before": before, "partition": partition},
        )
        moves = [(p, old, new) for p, old, new in cur.fetchall() if new > old]
        for name in names:
            retired = _retire(cur, name, topic, moves)
            if retired:
                log.info("retention: %d records pipeline %s had committed are retired into "
                         "retired_counts", retired, name)
        deleted = 0
        for p, _, new_start in moves:
            cur.execute(
                """DELETE FROM source_log WHERE topic = %s AND partition = %s
                   AND "offset" < %s""",
                (topic, p, new_start),
            )
            deleted += cur.rowcount
            cur.execute(
                """UPDATE source_partitions SET log_start_offset = %s
                   WHERE topic = %s AND partition = %s""",
                (new_start, topic, p),
            )
    log.info("retention: deleted %d records of %s below offset %d", deleted, topic, before)
    return deleted
