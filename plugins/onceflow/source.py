"""The source log in PostgreSQL: topics split into partitions, records addressed by offset.

The producer hands out offsets under a lock on the partition's row and commits records and the
new ``next_offset`` together, so every offset below a partition's ``next_offset`` is visible:
that is the partition's high watermark, and the planner never reads past it.
"""

from __future__ import annotations

import csv
import io
import logging
from collections.abc import Callable, Iterable, Iterator
from itertools import islice

from onceflow.db import transaction

log = logging.getLogger(__name__)


def ensure_topic(conn, topic: str, partitions: int) -> None:
    """Create ``partitions`` partitions for ``topic`` (existing ones are kept; never shrinks)."""
    if partitions <= 0:
        raise ValueError(f"partitions={partitions!r}: give a positive number of partitions")
    with transaction(conn) as cur:
        cur.execute(
            """INSERT INTO source_partitions (topic, partition)
               SELECT %s, p FROM generate_series(0, %s - 1) AS p
               ON CONFLICT DO NOTHING""",
            (topic, partitions),
        )


def partition_heads(cur, topic: str) -> dict[int, tuple[int, int]]:
    """partition -> (log_start_offset, next_offset) for every partition of ``topic``."""
    cur.execute(
        "SELECT partition, log_start_offset, next_offset FROM source_partitions WHERE topic = %s",
        (topic,),
    )
    return {p: (start, head) for p, start, head in cur.fetchall()}


def produce_chunks(conn, topic: str, payloads: Iterable[str], chunk_size: int,
                   write: Callable[[object, dict[int, list[str]], dict[int, int]], None]) -> int:
    """The producers' shared loop. Records go round-robin over the topic's partitions; each
    chunk is one PostgreSQL transaction holding the partition rows' locks, in which
    ``write(cur, records_by_partition, heads)`` stores the records from each head on; then
    the heads advance. A crash leaves whole chunks, never a hole below a head."""
    total = 0
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
                raise LookupError(f"topic {topic!r} has no partitions: run `onceflow init` first")
            parts = sorted(heads)
            by_partition = {p: chunk[(i - total) % len(parts)::len(parts)]
                            for i, p in enumerate(parts)}
            write(cur, by_partition, heads)
            cur.executemany(
                "UPDATE source_partitions SET next_offset = %s WHERE topic = %s AND partition = %s",
                [(heads[p] + len(records), topic, p) for p, records in by_partition.items()],
            )
        total += len(chunk)
        log.info("produced %d records to %s (%d so far)", len(chunk), topic, total)


def produce(conn, topic: str, payloads: Iterable[str], *, chunk_size: int = 100_000) -> int:
    """Append ``payloads`` to the PostgreSQL log (COPY per chunk). Returns how many."""

    def write(cur, by_partition: dict[int, list[str]], heads: dict[int, int]) -> None:
        buf = io.StringIO()
        writer = csv.writer(buf)
        for partition, records in by_partition.items():
            base = heads[partition]
            writer.writerows((topic, partition, base + i, r) for i, r in enumerate(records))
        buf.seek(0)
        cur.copy_expert(
            'COPY source_log (topic, partition, "offset", payload) FROM STDIN (FORMAT csv)', buf
        )

    return produce_chunks(conn, topic, payloads, chunk_size, write)


def iter_payloads_below(conn, topic: str, ends: dict[int, int], skipped_by: str | None = None,
                        fetch: int = 50_000) -> Iterator[str]:
    """Every payload of ``topic`` with offset below ``ends[partition]`` (a named cursor
    streams), leaving out the ranges pipeline ``skipped_by`` skipped by policy (offset_gaps)
    and the records it parked in its backflow queues or dead letters."""
    with conn.cursor(name="onceflow_scan") as cur:
        cur.itersize = fetch
        cur.execute(
            """SELECT l.payload
               FROM source_log l
               JOIN unnest(%s::int[], %s::bigint[]) AS e(partition, end_offset)
                 ON e.partition = l.partition
               WHERE l.topic = %s AND l."offset" < e.end_offset
                 AND NOT EXISTS (SELECT 1 FROM offset_gaps g
                                 WHERE g.pipeline = %s AND g.partition = l.partition
                                   AND l."offset" >= g.from_offset
                                   AND l."offset" < g.to_offset)
                 AND NOT EXISTS (SELECT 1 FROM backflow_items b WHERE b.pipeline = %s
                                 AND b.partition = l.partition AND b."offset" = l."offset")
                 AND NOT EXISTS (SELECT 1 FROM dead_letters d WHERE d.pipeline = %s
                                 AND d.partition = l.partition AND d."offset" = l."offset")""",
            (list(ends), list(ends.values()), topic, skipped_by, skipped_by, skipped_by),
        )
        for (payload,) in cur:
            yield payload
    conn.commit()
