"""`onceflow status`: a pipeline's transactions in commit order, what holds up the open ones and
the command that frees each, partition offsets and lag, gaps, backflow queues, dead letters.

``pipeline_status`` gathers it as data (``--json`` prints it as is); ``render`` writes it in
lines of at most 100 columns.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
from dataclasses import dataclass, field
from typing import Any

from onceflow.core import backflow, offsets, txlog
from onceflow.core.txlog import TxRow, TxState

WIDTH = 100


@dataclass
class Stuck:
    txid: int
    state: str
    holds: str  # what holds it
    fix: str  # the one command (or action) that frees it


@dataclass
class PartitionLine:
    partition: int
    log_start: int
    head: int
    committed: int | None
    lag: int


@dataclass
class PipelineStatus:
    pipeline: str
    topic: str
    last_committed: int
    next_txid: int
    transactions: list[TxRow] = field(default_factory=list)
    stuck: list[Stuck] = field(default_factory=list)
    partitions: list[PartitionLine] = field(default_factory=list)
    gaps: list[dict[str, Any]] = field(default_factory=list)
    backflow: dict[str, Any] = field(default_factory=dict)
    dead_letters: dict[str, Any] = field(default_factory=dict)
    source: list[dict[str, str]] = field(default_factory=list)  # what the source holds up

    def as_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), default=str, indent=2)


def _stuck(pipeline: str, rows: list[TxRow], last_committed: int) -> list[Stuck]:
    from onceflow.sources.landing import REPAIR_HINT

    backfill = f"onceflow backfill --pipeline {pipeline}"
    out = []
    for row in rows:
        if row.state is TxState.COMMITTED:
            continue
        if row.state in txlog.ADOPTABLE:
            # A batch refused because a landed file changed fails again until repair.
            fix = (f"onceflow repair --pipeline {pipeline} (a landed file changed)"
                   if REPAIR_HINT in (row.reason or "") else
                   f"the next run adopts it; now: {backfill}")
            out.append(Stuck(row.txid, str(row.state),
                             f"attempt {row.attempt} {row.state}: {row.reason or '-'}", fix))
        elif row.abandoned:
            out.append(Stuck(row.txid, "abandoned",
                             f"run {row.run_id} silent {row.silent_s:.0f}s (lease "
                             f"{row.lease_s}s): its run died",
                             f"the next run adopts it; now: {backfill}"))
        elif row.txid > last_committed + 1:
            out.append(Stuck(row.txid, str(row.state),
                             f"waits for txid {last_committed + 1} to commit", "-"))
    return out


def pipeline_status(cur, source, pipeline: str, limit: int = 20, dead_letters: int = 5,
                    all_dead: bool = False) -> PipelineStatus:
    """``source``: the pipeline's Source (positions and lag)."""
    coordinator = _coordinator(cur, pipeline)
    rows = txlog.history(cur, pipeline, limit)
    open_rows = txlog.history(cur, pipeline, 10_000, open_only=True)
    status = PipelineStatus(pipeline, coordinator[0], coordinator[1], coordinator[2], rows,
                            _stuck(pipeline, open_rows, coordinator[1]))
    committed = offsets.committed(cur, pipeline)
    for partition, position in sorted(source.positions(cur).items()):
        done = committed.get(partition)
        status.partitions.append(PartitionLine(
            partition, position.log_start, position.head, done,
            position.head - (done if done is not None else position.log_start)))
    status.gaps = [dict(zip(("partition", "from", "to", "txid", "policy", "at"), g,
                            strict=True)) for g in offsets.gaps(cur, pipeline)]
    status.backflow = dataclasses.asdict(backflow.queue_sizes(cur, pipeline))
    status.dead_letters = backflow.dead_letter_summary(cur, pipeline, dead_letters, all_dead)
    notices = getattr(source, "notices", None)  # (a landing folder's changed files)
    if notices is not None:
        status.source = [{"what": what, "fix": fix} for what, fix in notices(cur, pipeline)]
    return status


def _coordinator(cur, pipeline: str) -> tuple[str, int, int]:
    cur.execute("SELECT topic, last_committed_txid, next_txid FROM pipelines WHERE name = %s",
                (pipeline,))
    row = cur.fetchone()
    if row is None:
        from onceflow.core.errors import NotInitialised

        raise NotInitialised(f"pipeline {pipeline!r} is not initialised: run `onceflow init`")
    return row


def _fit(text: str) -> str:
    return text if len(text) <= WIDTH else text[:WIDTH - 1] + "…"


def _tx_line(row: TxRow) -> str:
    when = row.committed_at.strftime("%m-%d %H:%M:%S") if row.committed_at else "-"
    state = "abandoned" if row.abandoned else str(row.state)
    wait = f"{row.commit_wait_s:.1f}s" if row.commit_wait_s is not None else "-"
    failed = row.failed if row.failed is not None else "-"
    rows = row.rows_applied if row.rows_applied is not None else "-"
    return (f"{row.txid:>6} {row.attempt:>3} {state:<10} {when:<14} {wait:>7} "
            f"{row.records:>9} {row.replayed:>6} {failed!s:>6} {rows!s:>8}  {row.run_id or '-'}")


def render(status: PipelineStatus) -> list[str]:
    out = [f"pipeline {status.pipeline}: topic {status.topic}, last committed txid "
           f"{status.last_committed}, next txid {status.next_txid}"]
    out.append("transactions (commit order):")
    out.append(f"{'txid':>6} {'att':>3} {'state':<10} {'committed':<14} {'waited':>7} "
               f"{'records':>9} {'replay':>6} {'failed':>6} {'rows':>8}  run")
    out += [_tx_line(r) for r in status.transactions] or ["  (none yet)"]
    if status.stuck:
        out.append("open transactions that need something:")
        for s in status.stuck:
            out.append(f"  txid {s.txid} ({s.state}): {s.holds}")
            if s.fix != "-":
                out.append(f"    -> {s.fix}")
    if status.source:
        out.append("source files that need something:")
        for notice in status.source:  # wrapped, not cut: the path and command matter
            out += textwrap.wrap(notice["what"], WIDTH, initial_indent="  ",
                                 subsequent_indent="    ", break_on_hyphens=False)
            if notice["fix"] != "-":
                out += textwrap.wrap(notice["fix"], WIDTH, initial_indent="    -> ",
                                     subsequent_indent="       ", break_on_hyphens=False)
    out.append("partitions:")
    for p in status.partitions:
        committed = p.committed if p.committed is not None else "-"
        out.append(f"  p{p.partition}: log_start={p.log_start} head={p.head} "
                   f"committed={committed} lag={p.lag}")
    out.append("gaps (records gone before they were read):" + ("" if status.gaps else " none"))
    for g in status.gaps:
        out.append(f"  p{g['partition']}: [{g['from']},{g['to']}) "
                   f"{g['to'] - g['from']} records, txid {g['txid']}, {g['policy']}")
    b = status.backflow
    out.append(f"backflow: to-queue {b['to_queue']} holds {b['to_items']} ({b['to_claimed']} "
               f"claimed), from-queue holds {b['from_items']}, swaps {b['swaps']}")
    d = status.dead_letters
    out.append(f"dead letters: {d['total']}")
    for reason, count in d["by_reason"]:
        out.append(f"  {count:>6} x {reason}")
    shown = d["all"] or d["newest"]
    if shown:
        out.append("  " + ("all:" if d["all"] else f"newest {len(shown)} (--all for every one):"))
    for item in shown:
        out.append(f"    p{item['partition']}:{item['offset']} failures={item['failures']} "
                   f"txid={item['txid']} {item['last_error']}")
    return [_fit(line) for line in out]
