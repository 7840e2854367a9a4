"""`onceflow retention`: delete a topic's old records, never what a pipeline still needs.

What may go, per partition, below the offset asked for:

- by default only records **every** pipeline reading the topic has committed (below the lowest
  committed offset of them all); a pipeline that never committed there holds everything;
- with ``force``, unread records too: each pipeline that had not read them gets the skipped
  range recorded as a gap at once (``onceflow status`` shows it), and its out_of_range policy
  decides at its next batch, as for any other deleted range;
- never, even forced, a record an open (uncommitted) transaction planned to read: its batch
  must stay repeatable.

All of it in one PostgreSQL transaction that holds the pipelines' coordinator rows and the
partitions' rows, so no batch is planned or committed meanwhile. What a pipeline had committed
from the deleted records is summed first into retired_counts / retired_records when the
pipeline has a recount function (``Pipeline.recompute``), so ``verify --recount`` still
accounts for them; the default verify re-runs only batches whose records are still there.
``dry_run`` says all of this and changes nothing.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from onceflow.core import backflow, offsets, txlog
from onceflow.core.db import transaction
from onceflow.core.errors import ConfigError
from onceflow.core.planner import PartitionRange
from onceflow.core.source import Source

log = logging.getLogger(__name__)


@dataclass
class PartitionPlan:
    partition: int
    log_start: int
    asked: int  # the new log start asked for (capped at the head)
    allowed: int  # the new log start granted
    held_by: str  # what stops it at ``allowed`` ("" when nothing does)
    unread: dict[str, tuple[int, int]] = field(default_factory=dict)  # pipeline -> [from, to)

    @property
    def deletes(self) -> int:
        return max(0, self.allowed - self.log_start)


@dataclass
class RetentionPlan:
    topic: str
    before: int
    force: bool
    partitions: list[PartitionPlan] = field(default_factory=list)

    @property
    def deletes(self) -> int:
        return sum(p.deletes for p in self.partitions)

    def lines(self) -> list[str]:
        out = [f"retention of topic {self.topic} below offset {self.before}"
               + (" (forced: unread records too)" if self.force else "") + ":"]
        for p in self.partitions:
            text = (f"  p{p.partition}: log start {p.log_start} -> {p.allowed}: "
                    f"{p.deletes} records")
            if p.allowed < p.asked:
                text += f" (not to {p.asked}: {p.held_by})"
            out.append(text)
            for name, (lo, hi) in sorted(p.unread.items()):
                out.append(f"    pipeline {name} had not read [{lo},{hi}): recorded as a gap")
        return out


def plan(cur, source: Source, before: int, partition: int | None, force: bool) -> RetentionPlan:
    """What retention would delete (see the module docstring); reads under the locks."""
    if before < 0:
        raise ConfigError(f"--before={before} is invalid: give an offset >= 0")
    positions = source.positions(cur)
    if not positions:
        raise ConfigError(f"topic={source.topic!r} is unknown: no partitions")
    if partition is not None and partition not in positions:
        raise ConfigError(f"--partition={partition} is invalid: topic {source.topic!r} has "
                          f"partitions {', '.join(map(str, sorted(positions)))}")
    committed = offsets.committed_by_pipeline(cur, source.topic)
    open_starts = txlog.lowest_open_starts(cur, source.topic)
    result = RetentionPlan(source.topic, before, force)
    for p in sorted(positions):
        if partition is not None and p != partition:
            continue
        pos = positions[p]
        asked = min(before, pos.head)
        if asked <= pos.log_start:
            continue
        allowed, held_by = asked, ""
        if p in open_starts and open_starts[p] < allowed:
            allowed, held_by = max(open_starts[p], pos.log_start), (
                f"an open transaction planned offset {open_starts[p]} on")
        unread = {}
        for name, ends in committed.items():
            done = ends.get(p, pos.log_start)
            if done >= allowed:
                continue
            if force:
                unread[name] = (max(done, pos.log_start), allowed)
            else:
                allowed, held_by = max(done, pos.log_start), (
                    f"pipeline {name} has committed up to {done}; --force deletes unread "
                    "records")
        result.partitions.append(PartitionPlan(p, pos.log_start, asked, allowed, held_by,
                                               {n: r for n, r in unread.items() if r[0] < allowed}))
    return result


def apply(conn, source: Source, before: int, *, partition: int | None = None,
          force: bool = False, dry_run: bool = False, pipelines=None) -> RetentionPlan:
    """Plan and (unless ``dry_run``) delete. ``pipelines``: name -> Pipeline of the registered
    pipelines (their recount functions retire what they had committed)."""
    with transaction(conn) as cur:
        cur.execute("SELECT name FROM pipelines WHERE topic = %s ORDER BY name FOR UPDATE",
                    (source.topic,))
        names = [n for (n,) in cur.fetchall()]
        cur.execute("SELECT partition FROM source_partitions WHERE topic = %s FOR UPDATE",
                    (source.topic,))
        result = plan(cur, source, before, partition, force)
        if dry_run or not result.deletes:
            return result
        for name in names:
            last = txlog.last_committed(cur, name)
            for p in result.partitions:
                if name in p.unread:
                    lo, hi = p.unread[name]
                    offsets.record_gap(cur, name, source.topic, p.partition, lo, hi, last,
                                       "retention --force")
            pipeline = (pipelines or {}).get(name)
            if pipeline is not None:
                _retire(cur, pipeline, result)
            else:
                log.warning("retention: pipeline %s is not registered here; verify --recount "
                            "will not account for its deleted records", name)
        below = {p.partition: p.allowed for p in result.partitions if p.deletes}
        deleted = source.retain(cur, below)
    log.info("retention: deleted %d records of %s (%s)", deleted, source.topic,
             ", ".join(f"p{p}<{o}" for p, o in below.items()))
    return result


def _retire(cur, pipeline, result: RetentionPlan) -> int:
    """Sum what ``pipeline`` committed from the records about to go (recount pipelines)."""
    count = pipeline.recount()
    if count is None:
        return 0
    ends = offsets.committed(cur, pipeline.name)
    parked = {(p, o) for _, p, o in backflow.parked(cur, pipeline.name)}
    ranges = [PartitionRange(p.partition, p.log_start, min(p.allowed, ends.get(p.partition, 0)))
              for p in result.partitions]
    ranges = [r for r in ranges if r.size > 0]
    if not ranges:
        return 0
    # Records parked in the backflow queues or dead letters were not counted: they keep their
    # payload there, and a replay that completes later is kept for verify.
    payloads = [payload for p, o, payload in pipeline.source.payloads(cur.connection, ranges)
                if (p, o) not in parked]
    if not payloads:
        return 0
    counted = count(payloads, pipeline)
    max_states = getattr(counted, "max_states", frozenset())
    for state_name, counts in counted.counts.items():
        for key, value in Counter(counts).items():
            cur.execute(
                """INSERT INTO retired_counts (pipeline, state_name, key, value)
                   VALUES (%(p)s, %(s)s, %(k)s, %(v)s) ON CONFLICT (pipeline, state_name, key)
                   DO UPDATE SET value = CASE WHEN %(max)s
                       THEN GREATEST(retired_counts.value, EXCLUDED.value)
                       ELSE retired_counts.value + EXCLUDED.value END""",
                {"p": pipeline.name, "s": state_name, "k": key, "v": value,
                 "max": state_name in max_states},
            )
    cur.execute(
        """INSERT INTO retired_records (pipeline, records, rejected) VALUES (%s, %s, %s)
           ON CONFLICT (pipeline) DO UPDATE SET records = retired_records.records
           + EXCLUDED.records, rejected = retired_records.rejected + EXCLUDED.rejected""",
        (pipeline.name, counted.records, sum(counted.rejected.values())),
    )
    log.info("retention: %d records pipeline %s had committed are retired into retired_counts",
             counted.records, pipeline.name)
    return counted.records


def retired(cur, pipeline: str) -> tuple[list[tuple[str, str, int]], int, int]:
    """What retention retired for ``pipeline``: (state, key, value) rows, records, rejected."""
    cur.execute("SELECT state_name, key, value FROM retired_counts WHERE pipeline = %s",
                (pipeline,))
    rows = cur.fetchall()
    cur.execute("SELECT records, rejected FROM retired_records WHERE pipeline = %s", (pipeline,))
    records, rejected = cur.fetchone() or (0, 0)
    return rows, records, rejected
