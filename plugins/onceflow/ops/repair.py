"""`onceflow repair`: find what a crash (or a hand in the database) left inconsistent, say what
would fix it, and fix it when asked (``--yes``). Everything is also fixed by the normal path
(the next run adopts abandoned and failed txids; commits clean their staging): repair is for
doing it now, and for the coordinator row, which nothing else rewrites.

Checks, under the coordinator row's lock, in one PostgreSQL transaction:

- the coordinator row is missing (removed by hand): made again from the transaction log
  (next txid after the highest one, last committed = the highest txid below which every
  txid committed, the instance id of the committed offsets);
- ``last_committed_txid`` or ``next_txid`` disagree with the transaction log (tampering):
  set from it;
- planned transactions whose run stopped reporting (abandoned): marked failed, so that
  `onceflow backfill` (or the next run) re-runs them;
- staging left by attempts that can never commit (committed, failed, superseded or fenced):
  deleted;
- backflow claims held by transactions that are not planned any more: released;
- the bookkeeping the commit, begin, retention and verify rely on (onceflow.ops.bookkeeping),
  checked first: a commit record changed by hand (a committed transaction whose state was
  set back: marked committed again, its later attempts fenced; one marked committed whose
  commit never ran: marked failed, when nothing committed after it), partition offsets that
  differ from the end of each partition's last committed range (written again), committed
  ranges that do not tile their partition (said, not fixed). Where there is no safe fix the
  report says what to do, and the command exits 1.

A landing-folder pipeline's landed files that changed after they were indexed are found
too (onceflow.sources.landing_repair: what changed, which records it holds, who read them),
in a transaction of their own that holds every pipeline of the topic. ``--yes`` does not
touch them: each needs its own choice, ``--accept-changed FILE`` (index it again as it is
now, when no pipeline planned its changed part) or ``--skip-changed FILE`` (skip its unread
records, recorded as gaps). Without one, the report says both and the command exits 1.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field

from onceflow.core import backflow, offsets, staging, txlog
from onceflow.core.db import transaction
from onceflow.core.errors import ConfigError
from onceflow.core.pipeline import Pipeline
from onceflow.ops import bookkeeping
from onceflow.sources.landing import LandingFolder
from onceflow.sources.landing.files import SET_ASIDE_FIX

log = logging.getLogger(__name__)


@dataclass
class Finding:
    problem: str
    action: str
    fixable: bool = True  # False: repair has no safe fix; ``action`` says what to do


@dataclass
class LandedFinding:
    problem: str
    done: str | None  # what was done (None: nothing chosen)
    choices: list[str] = field(default_factory=list)


@dataclass
class RepairReport:
    pipeline: str
    applied: bool
    findings: list[Finding] = field(default_factory=list)
    landed: list[LandedFinding] = field(default_factory=list)
    set_aside: list[str] = field(default_factory=list)  # landed files that hold no record

    @property
    def unresolved(self) -> int:
        """Changed landed files left as they are (no --accept-changed / --skip-changed)."""
        return sum(1 for f in self.landed if f.done is None)

    @property
    def ok(self) -> bool:
        """Nothing is left wrong: nothing found, or everything found was fixed."""
        return all(f.fixable for f in self.findings) and (self.applied or not self.findings)

    def lines(self) -> list[str]:
        aside = [f"repair {self.pipeline}: landed files set aside at indexing (nothing to "
                 f"repair: they hold no record; {SET_ASIDE_FIX}):"] + \
            [f"  - {what}" for what in self.set_aside] if self.set_aside else []
        if not self.findings and not self.landed:
            return [f"repair {self.pipeline}: nothing to repair", *aside]
        out = []
        if self.findings:
            head = "repaired" if self.applied else "would repair (pass --yes to do it)"
            out.append(f"repair {self.pipeline}: {head}:")
            for f in self.findings:
                verb = ("did" if self.applied else "will") if f.fixable else "no safe fix"
                out += [f"  - {f.problem}", f"    {verb}: {f.action}"]
        if self.landed:
            out.append(f"repair {self.pipeline}: landed files that changed after they were "
                       "indexed:")
            for f in self.landed:
                out.append(f"  - {f.problem}")
                if f.done is not None:
                    out.append(f"    did: {f.done}")
                else:
                    out.append("    nothing done; choose one (each is one PostgreSQL "
                               "transaction):")
                    out += [f"      {choice}" for choice in f.choices]
        return out + aside


def _contiguous_committed(cur, pipeline: str) -> int:
    cur.execute(
        """SELECT coalesce(min(txid) - 1, (SELECT coalesce(max(txid), 0) FROM transactions
                                           WHERE pipeline = %(p)s))
           FROM transactions WHERE pipeline = %(p)s AND state <> 'committed'""",
        {"p": pipeline},
    )
    return cur.fetchone()[0]


def repair(conn, pipeline: Pipeline, *, apply: bool = False, accept_changed=(),
           skip_changed=()) -> RepairReport:
    """``accept_changed`` / ``skip_changed``: changed landed files (paths, or names) to accept
    as they are now or to skip (see onceflow.sources.landing_repair)."""

    if (accept_changed or skip_changed) and not isinstance(pipeline.source, LandingFolder):
        raise ConfigError(f"--accept-changed / --skip-changed are for a landing folder's "
                          f"files: pipeline {pipeline.name!r} reads "
                          f"{pipeline.source.describe()}")
    report = RepairReport(pipeline.name, apply)
    name = pipeline.name
    with transaction(conn) as cur:
        _check_bookkeeping(cur, name, report)
        cur.execute("SELECT coalesce(max(txid), 0) FROM transactions WHERE pipeline = %s",
                    (name,))
        highest = cur.fetchone()[0]
        contiguous = _contiguous_committed(cur, name)
        cur.execute("SELECT next_txid, last_committed_txid FROM pipelines WHERE name = %s "
                    "FOR UPDATE", (name,))
        row = cur.fetchone()
        if row is None:
            cur.execute("""SELECT instance_id FROM partition_offsets WHERE pipeline = %s
                           ORDER BY updated_at DESC LIMIT 1""", (name,))
            found = cur.fetchone()
            instance = str(found[0]) if found else str(uuid.uuid4())
            report.findings.append(Finding(
                "the coordinator row is missing",
                f"make it again: next txid {highest + 1}, last committed {contiguous}, "
                f"instance {instance}"))
            if apply:
                cur.execute(
                    """INSERT INTO pipelines (name, instance_id, topic, mode, next_txid,
                                              last_committed_txid)
                       VALUES (%s, %s, %s, %s, %s, %s)""",
                    (name, instance, pipeline.topic, pipeline.mode, highest + 1, contiguous))
                backflow.ensure_pointers(cur, name)
        else:
            next_txid, last = row
            if next_txid <= highest:
                report.findings.append(Finding(
                    f"next_txid is {next_txid} but txid {highest} exists",
                    f"set next_txid to {highest + 1}"))
                if apply:
                    cur.execute("UPDATE pipelines SET next_txid = %s WHERE name = %s",
                                (highest + 1, name))
            if last != contiguous:
                report.findings.append(Finding(
                    f"last_committed_txid is {last} but the transaction log says {contiguous}",
                    f"set last_committed_txid to {contiguous}"))
                if apply:
                    cur.execute("UPDATE pipelines SET last_committed_txid = %s WHERE name = %s",
                                (contiguous, name))
        for tx in txlog.history(cur, name, 10_000, open_only=True):
            if tx.abandoned:
                report.findings.append(Finding(
                    f"txid {tx.txid} attempt {tx.attempt} is planned but its run {tx.run_id} "
                    f"has not reported for {tx.silent_s:.0f}s (lease {tx.lease_s}s)",
                    f"mark it failed: `onceflow backfill --pipeline {name}` or the next run "
                    "re-runs it"))
                if apply:
                    txlog.mark_failed(cur, name, txlog.TransactionAttempt(tx.txid, tx.attempt),
                                      "abandoned: marked failed by onceflow repair")
        cur.execute(
            """SELECT DISTINCT g.txid, g.attempt FROM staged_groups g
               LEFT JOIN transactions t ON t.pipeline = g.pipeline AND t.txid = g.txid
               WHERE g.pipeline = %s AND (t.txid IS NULL OR t.state <> 'planned'
                                          OR t.attempt <> g.attempt)
               ORDER BY 1, 2""",
            (name,),
        )
        for txid, attempt in cur.fetchall():
            report.findings.append(Finding(
                f"staging of txid {txid} attempt {attempt} can never commit",
                "delete it"))
            if apply:
                staging.delete_staging(cur, name, txid, attempt=attempt)
        cur.execute(
            """SELECT DISTINCT b.claimed_txid FROM backflow_items b
               LEFT JOIN transactions t ON t.pipeline = b.pipeline AND t.txid = b.claimed_txid
               WHERE b.pipeline = %s AND b.claimed_txid IS NOT NULL
                 AND (t.txid IS NULL OR t.state IN ('committed', 'superseded'))""",
            (name,),
        )
        stale = [t for (t,) in cur.fetchall()]
        if stale:
            report.findings.append(Finding(
                f"backflow items are claimed by txids {stale}, which will never read them",
                "release the claims (the items are replayed by a later txid)"))
            if apply:
                backflow.release_claims(cur, name, stale)
        if not apply:
            conn.rollback()
    for f in report.findings:
        log.warning("REPAIR pipeline=%s %s: %s -> %s", name,
                    "done" if apply else "found", f.problem, f.action)
    if isinstance(pipeline.source, LandingFolder):
        _landed(conn, pipeline, report, list(accept_changed), list(skip_changed))
    return report


def _check_bookkeeping(cur, name: str, report: RepairReport) -> None:
    """Commit records against the marks their commits left, partition offsets against the
    commit log, the tiling of committed ranges (onceflow.ops.bookkeeping), under the
    coordinator row's lock. The safe fixes are made here on a dry run too: repair rolls its
    transaction back then, and the checks after this one see the pipeline as it will be."""
    cur.execute("SELECT 1 FROM pipelines WHERE name = %s FOR UPDATE", (name,))
    if cur.fetchone() is None:
        return  # made again by the coordinator check; the next repair checks the rest
    book = bookkeeping.check(cur, name, coordinator=False)
    report.findings += [Finding(p.what, p.fix or p.advice, p.fix is not None)
                        for p in book.problems]
    why = "its commit record was restored by onceflow repair"
    for r in book.reverted:
        if r.attempt is not None:
            txlog.restore_committed(cur, name, txlog.TransactionAttempt(r.txid, r.attempt),
                                    f"attempt {r.attempt} committed; {why}")
            txlog.stamp_committed(cur, name, r.txid, r.ended_at)  # a restored record is whole
    for r in book.unstamped:
        txlog.stamp_committed(cur, name, r.txid, r.ended_at)
    for u in book.unapplied:
        if u.fixable:
            txlog.unmark_committed(cur, name, txlog.TransactionAttempt(u.txid, u.attempt),
                                   "marked committed by hand, never applied: marked failed "
                                   "by onceflow repair")
    # the offsets follow from the commits' marks, which the fixes above do not change
    wrong = book.wrong_offsets
    if wrong:
        offsets.restore(cur, name, book.instance,
                        {p: book.expected[p] for p, (_, want) in wrong.items() if want},
                        [p for p, (_, want) in wrong.items() if want is None])


def _landed(conn, pipeline: Pipeline, report: RepairReport, accept: list[str],
            skip: list[str]) -> None:
    """The landing folder's changed files (see the module docstring)."""
    from onceflow.sources import landing_repair  # pyarrow at its top: not for the CLI's start

    source = pipeline.source
    with transaction(conn) as cur:
        # What retention holds, in its order: every pipeline of the topic, then its partitions.
        cur.execute("SELECT name FROM pipelines WHERE topic = %s ORDER BY name FOR UPDATE",
                    (source.topic,))
        cur.execute("SELECT partition FROM source_partitions WHERE topic = %s "
                    "ORDER BY partition FOR UPDATE", (source.topic,))
        found = landing_repair.inspect(cur, source)
        report.set_aside = landing_repair.set_aside(cur, source)
        chosen = {}
        for names, how in ((accept, "accept"), (skip, "skip")):
            for wanted in names:
                change = landing_repair._pick(found, wanted)
                if chosen.get(change.path, how) != how:
                    raise ConfigError(f"{change.path}: choose --accept-changed or "
                                      "--skip-changed, not both")
                chosen[change.path] = how
        for change in found:
            how = chosen.get(change.path)
            finding = LandedFinding(change.describe(), None, change.choices())
            if how == "accept":
                records = landing_repair.accept(cur, source, change)
                finding.done = (f"accepted as it is now: indexed again, {records} record(s) "
                                "at new offsets")
            elif how == "skip":
                records = landing_repair.skip(cur, source, change)
                finding.done = (f"skipped: {records} record(s) no pipeline committed, "
                                "recorded as gaps; the file is not followed any more")
            report.landed.append(finding)
        if not chosen:
            conn.rollback()  # a look at the folder changes nothing in a report
