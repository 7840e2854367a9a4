"""Partition offsets: where each partition's next batch starts, the committed-offset record,
and the ranges skipped (the PartitionManager's decisions, without its traps).

This module alone reads and writes ``partition_offsets`` and ``offset_gaps``.

For each partition of the source (partitions added since the last plan included):

- resume point = the end of the last planned, not superseded range (after the last reset),
  else the committed offset;
- no resume point (a new pipeline, a new partition, after a reset): the start policy decides
  (earliest = the log start, latest = the head, timestamp:T = the first record produced at or
  after T), and that start is kept in the plan even when nothing is there yet;
- a resume point below the log start (retention deleted records nobody read): the
  out_of_range policy decides (earliest = jump to the log start, latest = jump to the head,
  fail = refuse, naming the partition and the fix). A jump's skipped range is recorded in
  offset_gaps once and logged once; the plan moves on, so the committed offset never sticks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from onceflow.core import txlog
from onceflow.core.errors import OffsetOutOfRange
from onceflow.core.pipeline import Pipeline, start_timestamp
from onceflow.core.source import Position

log = logging.getLogger(__name__)


@dataclass
class Starts:
    offsets: dict[int, int] = field(default_factory=dict)
    heads: dict[int, int] = field(default_factory=dict)
    chosen_by_policy: set[int] = field(default_factory=set)
    gaps: list[tuple[int, int, int]] = field(default_factory=list)  # (partition, from, to)

    def keep(self) -> frozenset[int]:
        """Partitions whose start was decided now (policy or jump): the plan stores them even
        when empty, so the decision is committed and never taken again later, differently."""
        return frozenset(self.chosen_by_policy | {p for p, _, _ in self.gaps})


def committed(cur, pipeline: str) -> dict[int, int]:
    """Per partition, the committed offset (every record below it is done)."""
    cur.execute('SELECT partition, "offset" FROM partition_offsets WHERE pipeline = %s',
                (pipeline,))
    return dict(cur.fetchall())


def committed_by_pipeline(cur, topic: str, source: str | None = None
                          ) -> dict[str, dict[int, int]]:
    """Every pipeline reading ``topic`` -> its committed offsets (empty: it read nothing).
    ``source`` (Source.identity): only the pipelines of that source's topic, and those not
    registered since sources were stored (they may be of it)."""
    cur.execute(
        """SELECT p.name, po.partition, po."offset" FROM pipelines p
           LEFT JOIN partition_offsets po ON po.pipeline = p.name
           WHERE p.topic = %s AND (%s::text IS NULL OR p.source IS NULL OR p.source = %s)
           ORDER BY p.name""",
        (topic, source, source),
    )
    out: dict[str, dict[int, int]] = {}
    for name, partition, offset in cur.fetchall():
        out.setdefault(name, {})
        if partition is not None:
            out[name][partition] = offset
    return out


def _policy_start(cur, pipeline: Pipeline, partition: int, position: Position) -> int:
    if pipeline.start_policy == "earliest":
        return position.log_start
    if pipeline.start_policy == "latest":
        return position.head
    first = pipeline.source.first_at(cur, partition, start_timestamp(pipeline.start_policy),
                                     position)
    return max(position.log_start, min(first, position.head))


def resolve_starts(cur, pipeline: Pipeline, coordinator: txlog.Coordinator,
                   positions: dict[int, Position], before_txid: int | None = None) -> Starts:
    """Starts for a batch of txid ``before_txid`` (a new txid when None)."""
    done = committed(cur, pipeline.name)
    planned = txlog.planned_ends(cur, pipeline.name, coordinator.reset_after_txid, before_txid)
    starts = Starts()
    for partition in sorted(positions):
        position = positions[partition]
        starts.heads[partition] = position.head
        known = [x for x in (done.get(partition), planned.get(partition)) if x is not None]
        if not known:
            starts.offsets[partition] = _policy_start(cur, pipeline, partition, position)
            starts.chosen_by_policy.add(partition)
            continue
        resume = max(known)
        if resume >= position.log_start:
            starts.offsets[partition] = resume
            continue
        if pipeline.out_of_range == "fail":
            raise OffsetOutOfRange(
                f"pipeline {pipeline.name!r}, topic {pipeline.topic!r}, partition {partition}: "
                f"offset {resume} is out of range (the log starts at {position.log_start}; "
                f"retention deleted [{resume}, {position.log_start})). Set "
                f"pipeline.out_of_range to 'earliest' (skip to {position.log_start}) or "
                f"'latest' (skip to {position.head}) to go on"
            )
        jump = position.log_start if pipeline.out_of_range == "earliest" else position.head
        starts.offsets[partition] = jump
        starts.gaps.append((partition, resume, jump))
    return starts


def record_gap(cur, pipeline: str, topic: str, partition: int, start: int, end: int,
               txid: int, policy: str) -> bool:
    """Keep a skipped range once (and log it once); a later, longer skip from the same offset
    (a forced retention, then an out_of_range jump past it) extends it. Returns whether the
    gap is new or longer."""
    cur.execute(
        """INSERT INTO offset_gaps AS g
               (pipeline, topic, partition, from_offset, to_offset, txid, policy)
           VALUES (%s, %s, %s, %s, %s, %s, %s)
           ON CONFLICT (pipeline, partition, from_offset) DO UPDATE
           SET to_offset = EXCLUDED.to_offset, txid = EXCLUDED.txid,
               policy = g.policy || ', then ' || EXCLUDED.policy
           WHERE g.to_offset < EXCLUDED.to_offset""",
        (pipeline, topic, partition, start, end, txid, policy),
    )
    if cur.rowcount:
        log.warning(
            "GAP pipeline=%s topic=%s partition=%d: offsets [%d, %d) are gone before they "
            "were read (%s); skipped at txid %d", pipeline, topic, partition, start, end,
            policy, txid,
        )
    return bool(cur.rowcount)


def record_gaps(cur, pipeline: Pipeline, txid: int, starts: Starts) -> None:
    for partition, start, end in starts.gaps:
        record_gap(cur, pipeline.name, pipeline.topic, partition, start, end, txid,
                   f"out_of_range={pipeline.out_of_range}")


def gaps(cur, pipeline: str) -> list[tuple]:
    """(partition, from, to, txid, policy, at) of every skipped range."""
    cur.execute(
        """SELECT partition, from_offset, to_offset, txid, policy, at FROM offset_gaps
           WHERE pipeline = %s ORDER BY partition, from_offset""",
        (pipeline,),
    )
    return cur.fetchall()


def advance(cur, pipeline: str, instance_id, txid: int) -> None:
    """The commit's step: every partition of txid's batch is committed up to its range end."""
    cur.execute(
        """INSERT INTO partition_offsets
               (pipeline, instance_id, topic, partition, "offset", txid)
           SELECT pipeline, %(instance)s, topic, partition, end_offset, txid
           FROM batch_ranges WHERE pipeline = %(pipeline)s AND txid = %(txid)s
           ON CONFLICT (pipeline, partition) DO UPDATE
           SET "offset" = EXCLUDED."offset", txid = EXCLUDED.txid, topic = EXCLUDED.topic,
               instance_id = EXCLUDED.instance_id, updated_at = now()""",
        {"pipeline": pipeline, "txid": txid, "instance": str(instance_id)},
    )


def restore(cur, pipeline: str, instance_id, rows: dict[int, tuple[int, int, str]],
            drop: list[int]) -> None:
    """`onceflow repair`: write the committed offsets the commit log implies (``rows``:
    partition -> (offset, txid, topic)) and delete the rows of ``drop`` (partitions no
    committed range reads)."""
    for partition, (offset, txid, topic) in sorted(rows.items()):
        cur.execute(
            """INSERT INTO partition_offsets
                   (pipeline, instance_id, topic, partition, "offset", txid)
               VALUES (%s, %s, %s, %s, %s, %s)
               ON CONFLICT (pipeline, partition) DO UPDATE
               SET "offset" = EXCLUDED."offset", txid = EXCLUDED.txid, topic = EXCLUDED.topic,
                   instance_id = EXCLUDED.instance_id, updated_at = now()""",
            (pipeline, str(instance_id), topic, partition, offset, txid),
        )
    if drop:
        cur.execute("DELETE FROM partition_offsets WHERE pipeline = %s AND partition = ANY(%s)",
                    (pipeline, drop))


def forget(cur, pipeline: str) -> None:
    """force_from_start: the committed offsets are gone; partitions start by policy."""
    cur.execute("DELETE FROM partition_offsets WHERE pipeline = %s", (pipeline,))
