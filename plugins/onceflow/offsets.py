"""Where each partition's next batch starts: the PartitionManager's decisions, without its traps.

For each partition of the topic (partitions added since the last plan included):

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

from onceflow.pipeline import Pipeline, start_timestamp

log = logging.getLogger(__name__)


class OffsetOutOfRange(RuntimeError):
    """A resume point was deleted by retention and the policy is "fail"."""


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


def _policy_start(cur, pipeline: Pipeline, topic: str, partition: int, log_start: int,
                  head: int) -> int:
    if pipeline.start_policy == "earliest":
        return log_start
    if pipeline.start_policy == "latest":
        return head
    cur.execute(
        """SELECT min("offset") FROM source_log
           WHERE topic = %s AND partition = %s AND produced_at >= %s""",
        (topic, partition, start_timestamp(pipeline.start_policy)),
    )
    first = cur.fetchone()[0]
    return max(log_start, first if first is not None else head)


def resolve_starts(cur, pipeline: Pipeline, topic: str, before_txid: int | None = None
                   ) -> Starts:
    """Starts for a batch of txid ``before_txid`` (a new txid when None)."""
    cur.execute(
        """SELECT sp.partition, sp.log_start_offset, sp.next_offset, po."offset",
                  (SELECT max(br.end_offset) FROM batch_ranges br
                   JOIN transactions t ON t.pipeline = br.pipeline AND t.txid = br.txid
                   WHERE br.pipeline = p.name AND br.partition = sp.partition
                     AND t.state <> 'superseded' AND br.txid > p.reset_after_txid
                     AND (%(before)s::bigint IS NULL OR br.txid < %(before)s))
           FROM pipelines p
           JOIN source_partitions sp ON sp.topic = %(topic)s
           LEFT JOIN partition_offsets po ON po.pipeline = p.name AND po.partition = sp.partition
           WHERE p.name = %(pipeline)s
           ORDER BY sp.partition""",
        {"pipeline": pipeline.name, "topic": topic, "before": before_txid},
    )
    starts = Starts()
    for partition, log_start, head, committed, planned in cur.fetchall():
        starts.heads[partition] = head
        known = [x for x in (committed, planned) if x is not None]
        if not known:
            starts.offsets[partition] = _policy_start(cur, pipeline, topic, partition,
                                                      log_start, head)
            starts.chosen_by_policy.add(partition)
            continue
        resume = max(known)
        if resume >= log_start:
            starts.offsets[partition] = resume
            continue
        if pipeline.out_of_range == "fail":
            raise OffsetOutOfRange(
                f"pipeline {pipeline.name!r}, topic {topic!r}, partition {partition}: offset "
                f"{resume} is out of range (the log starts at {log_start}; retention deleted "
                f"[{resume}, {log_start})). Set pipeline.out_of_range to 'earliest' (skip to "
                f"{log_start}) or 'latest' (skip to {head}) to go on"
            )
        jump = log_start if pipeline.out_of_range == "earliest" else head
        starts.offsets[partition] = jump
        starts.gaps.append((partition, resume, jump))
    return starts


def record_gaps(cur, pipeline: Pipeline, topic: str, txid: int, starts: Starts) -> None:
    """Keep each skipped range once (and log it once)."""
    for partition, start, end in starts.gaps:
        cur.execute(
            """INSERT INTO offset_gaps
                   (pipeline, topic, partition, from_offset, to_offset, txid, policy)
               VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING""",
            (pipeline.name, topic, partition, start, end, txid, pipeline.out_of_range),
        )
        if cur.rowcount:
            log.warning(
                "GAP pipeline=%s topic=%s partition=%d: offsets [%d, %d) are gone (retention); "
                "out_of_range=%s skips them in txid %d", pipeline.name, topic, partition, start,
                end, pipeline.out_of_range, txid,
            )
