"""The catalog of the logs onceflow keeps itself (the PostgreSQL log and file segments): one
``source_partitions`` row per topic and partition with its head and its log start.

A producer hands out offsets under a lock on the partition rows and advances the heads in the
same PostgreSQL transaction that makes its records visible (rows, or indexed segment files),
so every offset below a head is readable: the head is the partition's high watermark, and the
planner never reads past it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from itertools import islice

from onceflow.core.db import transaction
from onceflow.core.errors import ConfigError
from onceflow.core.source import Position

log = logging.getLogger(__name__)


def ensure_topic(conn, topic: str, partitions: int, *, create: bool) -> None:
    """The topic exists (``create``: make ``partitions`` partitions; existing ones are kept,
    a topic never shrinks)."""
    with transaction(conn) as cur:
        if create:
            cur.execute(
                """INSERT INTO source_partitions (topic, partition)
                   SELECT %s, p FROM generate_series(0, %s - 1) AS p
                   ON CONFLICT DO NOTHING""",
                (topic, partitions),
            )
        cur.execute("SELECT count(*) FROM source_partitions WHERE topic = %s", (topic,))
        if not cur.fetchone()[0]:
            raise ConfigError(
                f"source topic={topic!r} is unknown: it has no partitions. Check the name, or "
                "create the topic (`onceflow init` creates the topics of registered pipelines)")


def topics(cur) -> list[str]:
    cur.execute("SELECT DISTINCT topic FROM source_partitions ORDER BY topic")
    return [t for (t,) in cur.fetchall()]


def positions(cur, topic: str) -> dict[int, Position]:
    cur.execute(
        "SELECT partition, log_start_offset, next_offset FROM source_partitions WHERE topic = %s",
        (topic,),
    )
    return {p: Position(start, head) for p, start, head in cur.fetchall()}


def at_points(cur, sql: str, topic: str, points: Iterable[tuple[int, int]]
              ) -> dict[tuple[int, int], object]:
    """``sql``'s (partition, offset, value) rows for ``points``, keyed by point; the statement
    joins ``unnest(%(partitions)s::int[], %(offsets)s::bigint[]) AS w (p, o)`` and names
    ``%(topic)s``. A point without a value is left out."""
    points = sorted(set(points))
    if not points:
        return {}
    cur.execute(sql, {"topic": topic, "partitions": [p for p, _ in points],
                      "offsets": [o for _, o in points]})
    return {(p, o): value for p, o, value in cur.fetchall() if value is not None}


def move_log_start(cur, topic: str, below: Mapping[int, int]) -> None:
    for partition, start in below.items():
        cur.execute(
            """UPDATE source_partitions SET log_start_offset = %s
               WHERE topic = %s AND partition = %s AND log_start_offset < %s""",
            (start, topic, partition, start),
        )


def produce_chunks(conn, topic: str, payloads: Iterable[str], chunk_size: int,
                   write: Callable[[object, dict[int, list[str]], dict[int, int]], None],
                   progress: Callable[[int], None] | None = None) -> int:
    """The producers' shared loop. Records go round-robin over the topic's partitions; each
    chunk is one PostgreSQL transaction holding the partition rows' locks, in which
    ``write(cur, records_by_partition, heads)`` stores the records from each head on; then
    the heads advance. A crash leaves whole chunks, never a hole below a head."""
    total = 0
    started = time.monotonic()
    it = iter(payloads)
    while True:
        chunk = list(islice(it, chunk_size))
        if not chunk:
            return total
        with transaction(conn) as cur:
            cur.execute(
                """SELECT partition, next_offset FROM source_partitions
                   WHERE topic = %s ORDER BY partition FOR UPDATE""",
                (topic,),
            )
            heads = dict(cur.fetchall())
            if not heads:
                raise ConfigError(f"topic {topic!r} has no partitions: run `onceflow init` first")
            parts = sorted(heads)
            by_partition = {p: chunk[(i - total) % len(parts)::len(parts)]
                            for i, p in enumerate(parts)}
            write(cur, by_partition, heads)
            cur.executemany(
                "UPDATE source_partitions SET next_offset = %s WHERE topic = %s AND partition = %s",
                [(heads[p] + len(records), topic, p) for p, records in by_partition.items()],
            )
        total += len(chunk)
        log.info("produced %d records to %s (%d so far, %.0f/s)", len(chunk), topic, total,
                 total / max(time.monotonic() - started, 1e-6))
        if progress is not None:
            progress(total)
