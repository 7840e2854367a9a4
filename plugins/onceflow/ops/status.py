"""`onceflow status`: a pipeline's transactions in commit order, what holds up the open ones and
the command that frees each, partition offsets and lag, gaps, backflow queues, dead letters.

``pipeline_status`` gathers it as data (``--json`` prints it as is); ``render`` writes it in
lines of at most 100 columns.
"""

from __future__ import annotations

import dataclasses
import json
import re
import textwrap
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from onceflow.core import backflow, freshness, keepup, offsets, txlog
from onceflow.core.errors import NotInitialised
from onceflow.core.txlog import TxRow, TxState
from onceflow.ops import bookkeeping
from onceflow.sources.landing.files import REPAIR_HINT

WIDTH = 100


@dataclass
class Stuck:
    txid: int
    state: str
    holds: str  # what holds it
    fix: str  # the one command (or action) that frees it
    stuck: bool = True  # False: in flight, its holder reporting (listed to name the holder)
    permanent: bool = False  # failed so that retrying cannot help: the reason says the fix


@dataclass
class PartitionLine:
    partition: int
    log_start: int
    head: int
    committed: int | None  # partition_offsets
    lag: int
    # where partition_offsets differs from the commit log: the commit log's offset ("none":
    # no committed range reads the partition)
    commit_log: str | None = None


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
    problems: list[str] = field(default_factory=list)  # damaged bookkeeping: onceflow repair
    source: list[dict[str, str]] = field(default_factory=list)  # what the source holds up
    source_heading: str = "the source needs something"  # what its notices are, in its words
    counts: str = "records"  # what a txid's planned count counts (Source.planned_counts)
    # arrival to commit over the last transactions, and the lag now (onceflow.core.freshness)
    freshness: dict[str, Any] = field(default_factory=dict)
    # a keep-up pipeline's source watcher (onceflow.core.keepup.watcher_state); {}: none
    watcher: dict[str, Any] = field(default_factory=dict)
    stalled: list[str] = field(default_factory=list)  # what stalls it (see ``stalls``)

    def as_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), default=str, indent=2)


@dataclass(frozen=True)
class Progress:
    """How far a planned transaction's current attempt is."""

    groups: int
    staged: int  # groups whose processing staged its result
    started_at: datetime | None  # when the attempt began
    commit_wait_s: float | None  # since its commit was asked for; None: not yet


def progress(cur, pipeline: str) -> dict[int, Progress]:
    """The progress of every planned transaction of ``pipeline``, by txid."""
    cur.execute(
        """SELECT t.txid, t.groups,
                  (SELECT count(*) FROM staged_groups g WHERE g.pipeline = t.pipeline
                     AND g.txid = t.txid AND g.attempt = t.attempt),
                  a.started_at, EXTRACT(EPOCH FROM now() - t.commit_requested_at)
           FROM transactions t LEFT JOIN transaction_attempts a
             ON a.pipeline = t.pipeline AND a.txid = t.txid AND a.attempt = t.attempt
           WHERE t.pipeline = %s AND t.state = 'planned'""",
        (pipeline,),
    )
    return {txid: Progress(groups, staged, started,
                           float(waited) if waited is not None else None)
            for txid, groups, staged, started, waited in cur.fetchall()}


def activity(row: TxRow, done: Progress | None, last_committed: int) -> str:
    """What a planned transaction is doing: processing (how many groups staged), or
    processed and committing, or processed and waiting for the txid before it to commit
    (for how long)."""
    run = f"run {row.run_id or '-'}, attempt {row.attempt}"
    if done is None:
        return f"in flight ({run})"
    if done.commit_wait_s is None:
        since = (f" since {done.started_at.astimezone(UTC):%H:%M:%S} UTC"
                 if done.started_at is not None else "")
        if done.staged < done.groups:
            return (f"processing{since}: {done.staged} of {done.groups} group(s) staged "
                    f"({run})")
        return (f"processed ({done.groups} of {done.groups} group(s) staged), its commit not "
                f"started yet ({run})")
    if row.txid > last_committed + 1:
        return (f"processed; its commit waits for txid {last_committed + 1} to commit: "
                f"waiting {done.commit_wait_s:.1f}s so far ({run})")
    return f"processed; committing, asked {done.commit_wait_s:.1f}s ago ({run})"


def release_command(pipeline: str, txid: int) -> str:
    return f"onceflow release --pipeline {pipeline} --txid {txid}"


def lease_text(row: TxRow, lease_s: int | None = None) -> str:
    """The attempt's lease as one value, ``lease_s`` (the pipeline's attempt lease); a run
    between two tasks holds the longer hand-over lease, said as such."""
    if lease_s is None or row.lease_s is None or row.lease_s <= lease_s:
        return f"lease {row.lease_s if lease_s is None else lease_s}s"
    return f"lease {lease_s}s, {row.lease_s}s between two tasks (hand-over)"


def _held(row: TxRow, *, run: bool = True, lease_s: int | None = None) -> str:
    """Who holds planned ``row`` and for how long more: the run (unless ``run`` is False,
    where the text before already names it), the process that reported last, the time
    since, and when the next run may adopt it."""
    who = (f"attempt {row.attempt} held by run {row.run_id or '-'} "
           f"({row.holder or 'holder unknown'})" if run
           else f"held by {row.holder or 'a holder not known'}")
    text = f"{who}, last report {row.silent_s:.0f}s ago, {lease_text(row, lease_s)}: "
    if row.abandoned:
        return text + "its holder is gone; the next run adopts it"
    return text + f"adoptable in {row.adoptable_in_s:.0f}s if it stays silent"


def _stuck(pipeline: str, rows: list[TxRow], last_committed: int,
           done: dict[int, Progress] | None = None, lease_s: int | None = None) -> list[Stuck]:
    """Every open transaction: what holds it, and what frees it now. A planned one says what
    it is doing, names its holder and the command that frees it (refused while a task of it
    reports)."""

    backfill = f"onceflow backfill --pipeline {pipeline}"
    out = []
    first_permanent = None
    for row in rows:
        if row.state is TxState.COMMITTED:
            continue
        # A batch refused because a landed file changed or is gone fails again until repair.
        refused = REPAIR_HINT in (row.reason or "")
        if row.state in txlog.ADOPTABLE and row.permanent and not refused:
            out.append(Stuck(row.txid, str(row.state),
                             f"attempt {row.attempt} {row.state}: {brief(row.reason)}",
                             "retrying cannot help until its cause is fixed: do what the "
                             f"reason says (a declaration, a state table, a setting), then: "
                             f"{backfill}", permanent=True))
            first_permanent = first_permanent or row.txid
        elif first_permanent is not None and (row.state in txlog.ADOPTABLE or row.abandoned):
            out.append(Stuck(row.txid, "abandoned" if row.abandoned else str(row.state),
                             f"commits after txid {first_permanent}, which needs a fix",
                             f"once txid {first_permanent} is fixed, {backfill} re-runs both "
                             "in txid order"))
        elif row.state in txlog.ADOPTABLE:
            fix = (f"onceflow repair --pipeline {pipeline} (a landed file changed or was "
                   "removed)" if refused else
                   f"the next run adopts it; now: {backfill}")
            out.append(Stuck(row.txid, str(row.state),
                             f"attempt {row.attempt} {row.state}: {brief(row.reason)}", fix,
                             permanent=row.permanent))
        elif row.abandoned:
            out.append(Stuck(row.txid, "abandoned", _held(row, lease_s=lease_s),
                             f"the next run adopts it; now: {backfill}"))
        elif row.silent_s is not None:
            doing = activity(row, (done or {}).get(row.txid), last_committed)
            out.append(Stuck(row.txid, str(row.state),
                             f"{doing}; {_held(row, run=False, lease_s=lease_s)}",
                             "if its run is dead, free it now: "
                             + release_command(pipeline, row.txid), stuck=False))
        elif row.txid > last_committed + 1:
            out.append(Stuck(row.txid, str(row.state),
                             activity(row, (done or {}).get(row.txid), last_committed), "-"))
    return out


def pipeline_status(cur, source, pipeline: str, limit: int = 20, dead_letters: int = 5,
                    all_dead: bool = False, approval: bool = False,
                    lease_s: int | None = None, watch_interval: float | None = None
                    ) -> PipelineStatus:
    """``source``: the pipeline's Source (positions and lag); ``approval``: the pipeline
    replays dead letters only after a person approves (``dead_letter_approval``);
    ``lease_s``: its attempt lease (Pipeline.lease_s), the one value leases are said in;
    ``watch_interval``: a keep-up pipeline's (its watcher is shown)."""
    coordinator = _coordinator(cur, pipeline)
    rows = txlog.history(cur, pipeline, limit)
    open_rows = txlog.history(cur, pipeline, 10_000, open_only=True)
    status = PipelineStatus(pipeline, coordinator[0], coordinator[1], coordinator[2], rows,
                            _stuck(pipeline, open_rows, coordinator[1],
                                   progress(cur, pipeline), lease_s))
    status.counts = source.planned_counts
    committed = offsets.committed(cur, pipeline)
    positions = source.positions(cur)
    for partition, position in sorted(positions.items()):
        done = committed.get(partition)
        status.partitions.append(PartitionLine(
            partition, position.log_start, position.head, done, _lag(position, done)))
    _bookkeeping(cur, status)
    # the freshness line's lag counts from the offsets the partition lines count from
    counted = {line.partition: line.head - line.lag for line in status.partitions}
    status.freshness = freshness.measure(cur, pipeline, source, positions,
                                         committed=counted).as_dict()
    if watch_interval is not None:
        watcher = keepup.watcher_state(cur, pipeline, watch_interval)
        status.watcher = {**watcher, "line": keepup.watcher_line(watcher)}
    status.gaps = [dict(zip(("partition", "from", "to", "txid", "policy", "at"), g,
                            strict=True)) for g in offsets.gaps(cur, pipeline)]
    status.backflow = dataclasses.asdict(backflow.queue_sizes(cur, pipeline))
    status.dead_letters = backflow.dead_letter_summary(cur, pipeline, dead_letters, all_dead)
    # A dead letter failed every replay: replaying it helps only once its cause is fixed.
    status.dead_letters["fix"] = (
        "-" if not status.dead_letters["total"] else
        # approvals: the CLI refuses these without --force (it would skip the approver)
        f"once their cause is fixed (a bolt, a declared type): ask for an approval: trigger "
        f"the DAG onceflow_{pipeline}_replay_dead_letters with records, error_contains, "
        f"last_error or all (the onceflow view's buttons do); a person approves it in "
        f"Airflow's Required actions" if approval else
        f"once their cause is fixed (a bolt, a declared type): onceflow replay-dead-letters "
        f"--pipeline {pipeline} --error-contains TEXT (or --record P:O)")
    notices = getattr(source, "notices", None)  # (a landing folder's changed files)
    if notices is not None:
        status.source = [{"what": what, "fix": fix} for what, fix in notices(cur, pipeline)]
        status.source_heading = getattr(source, "notices_heading", status.source_heading)
    status.stalled = stalls(status)
    return status


def stalls(status: PipelineStatus) -> list[str]:
    """What stalls the pipeline until someone acts (`onceflow status` exits 1 when there is
    any): an open txid listed with an action that frees it and no holder reporting (failed,
    superseded, abandoned by its run, or behind one that needs a fix), a source file that
    needs `onceflow repair`, damaged bookkeeping. Transactions in flight, their holders
    reporting, and dead letters stall nothing."""
    out = [f"txid {s.txid} {s.state}" for s in status.stuck if s.stuck and s.fix != "-"]
    out += [f"a source file: {notice['what']}" for notice in status.source]
    if status.problems:
        out.append(f"damaged bookkeeping ({len(status.problems)} problem(s))")
    return out


# A JVM's stack frames and the lines around them, in a stored reason (real line breaks, or
# escaped ones where the reason holds an exception's repr).
_FRAME = re.compile(r"^(at |\.\.\. \d+ more|JVM stacktrace:|Driver stacktrace:)")


def brief(reason: str | None, width: int = 400) -> str:
    """A stored failure ``reason`` in one line: a Spark or JVM error's first line and its
    innermost cause, without the stack frames."""
    if not reason:
        return "-"
    text = reason.replace("\\n", "\n").replace("\\t", "\t")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) < 2:
        return reason
    head = [line for line in lines if not _FRAME.match(line)
            and not line.startswith("Caused by:")]
    causes = [line.removeprefix("Caused by:").strip() for line in lines
              if line.startswith("Caused by:")]
    out = head[0] if head else lines[0]
    if causes and causes[-1] not in out:
        out += f" (cause: {causes[-1]})"
    return out if len(out) <= width else out[:width - 1] + "…"


def _lag(position, done: int | None) -> int:
    """A partition's records past ``done``, its committed offset (None: none yet): those a
    retention deleted first are not there to read."""
    return position.head - max(done if done is not None else position.log_start,
                               position.log_start)


def _bookkeeping(cur, status: PipelineStatus) -> None:
    """Damaged bookkeeping (onceflow.ops.bookkeeping; the tiling of committed ranges is left to
    `onceflow repair`): its problems, and each partition's lag from the commit log's offset
    where partition_offsets lost or changed it."""
    book = bookkeeping.check(cur, status.pipeline, ranges=False)
    status.problems = [p.line() for p in book.problems]
    reverted = {r.txid for r in book.reverted}  # committed: nothing to adopt or backfill
    status.stuck = [s for s in status.stuck if s.txid not in reverted]
    wrong = book.wrong_offsets
    for line in status.partitions:
        if line.partition in wrong:
            _, want = wrong[line.partition]
            line.commit_log = str(want[0]) if want else "none"
            line.lag = line.head - max(want[0] if want else line.log_start, line.log_start)


def _coordinator(cur, pipeline: str) -> tuple[str, int, int]:
    cur.execute("SELECT topic, last_committed_txid, next_txid FROM pipelines WHERE name = %s",
                (pipeline,))
    row = cur.fetchone()
    if row is None:
        raise NotInitialised(f"pipeline {pipeline!r} is not initialised: `onceflow init "
                             f"--pipeline {pipeline}` sets it up or says what keeps it from "
                             "being set up")
    return row


def _wrapped(text: str, indent: str) -> list[str]:
    """``text`` in lines of at most WIDTH columns (a command is never cut)."""

    return textwrap.wrap(text, WIDTH, subsequent_indent=indent, break_long_words=False,
                         break_on_hyphens=False)


def _fit(text: str) -> str:
    return text if len(text) <= WIDTH else text[:WIDTH - 1] + "…"


def _wrapped(text: str, indent: str) -> list[str]:
    """``text`` in lines of WIDTH, words (commands' arguments) never cut."""
    return textwrap.wrap(text, WIDTH, subsequent_indent=indent, break_long_words=False,
                         break_on_hyphens=False)


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
               f"{status.counts:>9} {'replay':>6} {'failed':>6} {'rows':>8}  run")
    out += [_tx_line(r) for r in status.transactions] or ["  (none yet)"]
    if status.stuck:
        out.append("open transactions, what holds them and what frees them:")
        for s in status.stuck:
            out += _wrapped(f"  txid {s.txid} ({s.state}): {s.holds}", "    ")
            if s.fix != "-":
                out += _wrapped(f"    -> {s.fix}", "       ")
    if status.source:
        out.append(f"{status.source_heading}:")
        for notice in status.source:  # wrapped, not cut: the path and command matter
            out += textwrap.wrap(notice["what"], WIDTH, initial_indent="  ",
                                 subsequent_indent="    ", break_on_hyphens=False)
            if notice["fix"] != "-":
                out += textwrap.wrap(notice["fix"], WIDTH, initial_indent="    -> ",
                                     subsequent_indent="       ", break_on_hyphens=False)
    if status.freshness:
        out += _wrapped(freshness.Freshness(**status.freshness).line(), "  ")
    if status.watcher:
        out += _wrapped(status.watcher["line"], "  ")
    out.append("partitions:")
    for p in status.partitions:
        committed = p.committed if p.committed is not None else "-"
        if p.commit_log is not None:
            committed = f"{committed} (commit log: {p.commit_log})"
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
    if d.get("fix", "-") != "-":
        out += _wrapped(f"  -> {d['fix']}", "     ")
    shown = d["all"] or d["newest"]
    if shown:
        out.append("  " + ("all:" if d["all"] else f"newest {len(shown)} (--all for every one):"))
    for item in shown:
        out.append(f"    p{item['partition']}:{item['offset']} failures={item['failures']} "
                   f"txid={item['txid']} {item['last_error']}")
    out += _render_problems(status)
    if status.stalled:  # what the exit status 1 means
        out += _wrapped("STALLED until someone acts (each is listed above): "
                        + "; ".join(status.stalled), "  ")
    return [_fit(line) for line in out]


def _render_problems(status: PipelineStatus) -> list[str]:
    """Damaged bookkeeping, wrapped (never cut: each problem says what to do)."""

    if not status.problems:
        return []
    out = [f"PROBLEMS: the bookkeeping is damaged (onceflow repair --pipeline "
           f"{status.pipeline} says what it fixes):"]
    for problem in status.problems:
        out += textwrap.wrap(problem, WIDTH, initial_indent="  - ", subsequent_indent="    ")
    return out
