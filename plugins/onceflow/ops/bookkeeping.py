"""A pipeline's bookkeeping checked against itself: the invariants the commit, begin, retention
and verify rely on. Read only; `onceflow repair` fixes what can be fixed safely
(onceflow.ops.repair), `onceflow status` and `onceflow backfill` say what is wrong.

- **Commit records.** The commit writes a transaction's ``state = 'committed'``, its attempt's
  outcome ``committed`` and ``committed_at`` in the one PostgreSQL transaction that applies its
  state and advances its offsets, and deletes its staging there too. So a transaction whose
  state is not committed while its attempt's outcome or ``committed_at`` says it was had its
  commit record reverted by hand (its batch is in the state: running it again would count it
  again); one whose state is committed with neither was marked by hand, and its batch was never
  applied.
- **Partition offsets.** ``partition_offsets`` holds, per partition, the end of the range of
  the last committed txid that read it (after the last reset), with that txid and the
  coordinator's instance: the commit writes exactly that. Retention deletes what every
  pipeline has committed by these rows and ``verify --recount`` reads up to them.
- **Committed ranges** tile each partition: a committed txid's range starts where the
  partition's previous committed range ended, or where a recorded gap (offset_gaps) ends;
  verify maps every record to the one committed txid that read it.
- **The coordinator row** (``status`` and ``backfill`` only; repair has its own check):
  ``last_committed_txid`` is the highest txid below which every txid committed (by its state,
  or by its marks where its record was reverted), and ``next_txid`` is above every txid.

Each check is one statement, so a commit landing meanwhile is seen whole or not at all, and
reads the open transactions and each partition's newest ranges only (indexes of migration
013); the tiling of committed ranges is a pass over them all, which `repair` makes and
`status` leaves out. This module reads ``transactions``, ``transaction_attempts``,
``batch_ranges`` and ``partition_offsets`` together for that; it writes nothing (repair's
fixes go through onceflow.core.txlog and onceflow.core.offsets).

A transaction counts as committed here when its commit left its marks (an attempt whose
outcome is committed, or ``committed_at``), not by its state column alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

# Whether transaction t's commit left its marks: its time stamp, or an attempt whose outcome
# is committed (both written by the commit, with the state, in one PostgreSQL transaction).
_DONE = """(t.committed_at IS NOT NULL OR EXISTS (
    SELECT 1 FROM transaction_attempts a WHERE a.pipeline = t.pipeline AND a.txid = t.txid
      AND a.outcome = 'committed'))"""

# The transactions whose state may disagree with their marks: the uncommitted ones (index
# transactions_open) and the ones without a time stamp (index transactions_unstamped), with
# the attempt that committed, if one did. A healthy pipeline's committed history is in
# neither index, so this reads the open transactions only.
_ODD_ROW = f"""
    SELECT t.txid, t.state, t.attempt,
           (SELECT max(a.attempt) FROM transaction_attempts a WHERE a.pipeline = t.pipeline
              AND a.txid = t.txid AND a.outcome = 'committed') AS committed_attempt,
           {_DONE} AS done, t.committed_at IS NULL AS unstamped,
           (SELECT max(a.ended_at) FROM transaction_attempts a WHERE a.pipeline = t.pipeline
              AND a.txid = t.txid AND a.outcome = 'committed') AS committed_end
    FROM transactions t WHERE t.pipeline = %(p)s"""
_ODD = f"""{_ODD_ROW} AND t.state <> 'committed'
    UNION
    {_ODD_ROW} AND t.committed_at IS NULL"""

# The highest txid whose commit left its marks (from the newest down: it is near the top).
_LAST_DONE = f"""
    SELECT coalesce((SELECT t.txid FROM transactions t WHERE t.pipeline = %(p)s AND {_DONE}
                     ORDER BY t.txid DESC LIMIT 1), 0)"""

# Per partition a range was ever planned for, the range of the last txid whose commit left
# its marks (after the last reset): what partition_offsets must hold. The partitions by a
# skip scan, each one's range from the newest txid down (index batch_ranges_partition_txid).
_EXPECTED_OFFSETS = f"""
    WITH RECURSIVE parts AS (
        SELECT min(partition) AS partition FROM batch_ranges WHERE pipeline = %(p)s
        UNION ALL
        SELECT (SELECT min(br.partition) FROM batch_ranges br
                WHERE br.pipeline = %(p)s AND br.partition > parts.partition)
        FROM parts WHERE parts.partition IS NOT NULL),
    expected AS (
        SELECT parts.partition, r.end_offset, r.txid, r.topic FROM parts
        CROSS JOIN LATERAL (
            SELECT br.end_offset, br.txid, br.topic FROM batch_ranges br
            JOIN transactions t ON t.pipeline = br.pipeline AND t.txid = br.txid
            WHERE br.pipeline = %(p)s AND br.partition = parts.partition
              AND br.txid > (SELECT reset_after_txid FROM pipelines WHERE name = %(p)s)
              AND {_DONE}
            ORDER BY br.txid DESC LIMIT 1) r),
    stored AS (SELECT partition, "offset", txid, instance_id::text AS instance
               FROM partition_offsets WHERE pipeline = %(p)s)
    SELECT coalesce(e.partition, s.partition), e.end_offset, e.txid, e.topic,
           s."offset", s.txid, s.instance,
           (SELECT instance_id::text FROM pipelines WHERE name = %(p)s)
    FROM expected e FULL JOIN stored s ON s.partition = e.partition"""

# Committed ranges that do not start where the partition's previous one ended, and no recorded
# gap covers the difference (a pass over every committed range: repair only).
_RANGE_BREAKS = f"""
    WITH ranges AS (
        SELECT br.partition, br.txid, br.start_offset, br.end_offset,
               lag(br.txid) OVER w AS prev_txid, lag(br.end_offset) OVER w AS prev_end
        FROM batch_ranges br
        JOIN transactions t ON t.pipeline = br.pipeline AND t.txid = br.txid
        JOIN pipelines p ON p.name = br.pipeline
        WHERE br.pipeline = %(p)s AND br.txid > p.reset_after_txid AND {_DONE}
        WINDOW w AS (PARTITION BY br.partition ORDER BY br.txid))
    SELECT r.partition, r.prev_txid, r.prev_end, r.txid, r.start_offset FROM ranges r
    WHERE r.prev_end IS NOT NULL AND r.start_offset <> r.prev_end
      AND NOT (r.start_offset > r.prev_end AND EXISTS (
          SELECT 1 FROM offset_gaps g WHERE g.pipeline = %(p)s AND g.partition = r.partition
            AND g.from_offset <= r.prev_end AND g.to_offset >= r.start_offset))
    ORDER BY r.partition, r.txid"""


@dataclass(frozen=True)
class Problem:
    kind: str  # "commit-record", "offsets", "ranges" or "coordinator"
    what: str  # what is wrong
    fix: str | None  # what `onceflow repair --yes` does about it; None: no safe fix
    advice: str = ""  # what to do when there is no safe fix

    def line(self) -> str:
        then = f"repair --yes: {self.fix}" if self.fix else f"no safe fix: {self.advice}"
        return f"{self.what} ({then})"


@dataclass(frozen=True)
class Reverted:
    """A commit record reverted by hand: the txid committed (``attempt``) but its state says
    ``state``."""

    txid: int
    state: str
    attempt: int | None  # the attempt that committed; None: only committed_at says so
    # committed_at is gone too: when the committing attempt ended (the commit's own record of
    # its time; None: not recorded, the restored record takes the time of the repair)
    unstamped: bool = False
    ended_at: datetime | None = None

    def stamp(self) -> str:
        """Where a restored commit record's committed_at comes from."""
        if not self.unstamped:
            return "its committed_at is kept"
        if self.ended_at is not None:
            return (f"committed_at from its committing attempt's end "
                    f"({self.ended_at.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC)")
        return "committed_at now (no record of when it committed is left)"


@dataclass(frozen=True)
class Unapplied:
    """A transaction marked committed by hand: no commit left its marks."""

    txid: int
    attempt: int
    fixable: bool  # nothing committed after it and no offset moved by it: it can run again


@dataclass
class Bookkeeping:
    reverted: list[Reverted] = field(default_factory=list)
    # committed, by its state and its attempt, but committed_at is gone (set to NULL by hand)
    unstamped: list[Reverted] = field(default_factory=list)
    unapplied: list[Unapplied] = field(default_factory=list)
    # partition -> (offset, txid, topic) the commit log implies
    expected: dict[int, tuple[int, int, str]] = field(default_factory=dict)
    # partition -> (offset, txid, instance) partition_offsets holds
    stored: dict[int, tuple[int, int, str]] = field(default_factory=dict)
    instance: str = ""
    problems: list[Problem] = field(default_factory=list)

    @property
    def wrong_offsets(self) -> dict[int, tuple[tuple | None, tuple | None]]:
        """partition -> (what partition_offsets holds, what the commit log implies) where
        they differ (None: no row, or no committed range)."""
        out = {}
        for p in sorted(set(self.expected) | set(self.stored)):
            have, want = self.stored.get(p), self.expected.get(p)
            if want is not None:
                want_row = (want[0], want[1], self.instance)
                if have != want_row:
                    out[p] = (have, want_row)
            else:
                out[p] = (have, None)
        return out


def commit_marks(cur, pipeline: str
                 ) -> tuple[list[Reverted], list[Unapplied], list[Reverted]]:
    """Transactions whose state disagrees with the marks their commit left (or did not), and
    committed ones whose committed_at is gone. One statement: a commit landing meanwhile is
    seen whole or not at all."""
    cur.execute(f"""WITH odd AS ({_ODD}),
                    last AS ({_LAST_DONE}),
                    moved AS (SELECT coalesce(max(txid), 0) AS txid FROM partition_offsets
                              WHERE pipeline = %(p)s)
                    SELECT o.txid, o.state, o.attempt, o.committed_attempt, o.done,
                           o.txid > greatest((SELECT * FROM last), moved.txid),
                           o.unstamped, o.committed_end
                    FROM odd o, moved
                    WHERE (o.state = 'committed') <> o.done
                       OR (o.state = 'committed' AND o.unstamped) ORDER BY o.txid""",
                {"p": pipeline})
    reverted, unapplied, unstamped = [], [], []
    for txid, state, attempt, committed_attempt, done, last, no_time, end in cur.fetchall():
        if state == "committed" and done:
            unstamped.append(Reverted(txid, state, committed_attempt, True, end))
        elif done:
            reverted.append(Reverted(txid, state, committed_attempt, no_time, end))
        else:
            unapplied.append(Unapplied(txid, attempt, last))
    return reverted, unapplied, unstamped


def partition_offsets(cur, pipeline: str) -> tuple[dict, dict, str]:
    """(expected, stored, the coordinator's instance): per partition, what the commit log
    implies (offset, txid, topic) and what partition_offsets holds (offset, txid, instance),
    read in one statement."""
    cur.execute(_EXPECTED_OFFSETS, {"p": pipeline})
    rows = cur.fetchall()
    expected, stored = {}, {}
    for p, end, txid, topic, offset, stored_txid, stored_instance, _ in rows:
        if end is not None:
            expected[p] = (end, txid, topic)
        if offset is not None:
            stored[p] = (offset, stored_txid, stored_instance)
    return expected, stored, (rows[0][7] or "") if rows else ""


def check(cur, pipeline: str, *, coordinator: bool = True, ranges: bool = True
          ) -> Bookkeeping:
    """Every invariant in the module docstring (``coordinator``: the coordinator row's too;
    ``ranges``: the tiling of committed ranges, a pass over them all)."""
    out = Bookkeeping()
    out.reverted, out.unapplied, out.unstamped = commit_marks(cur, pipeline)
    for r in out.reverted:
        how = (f"attempt {r.attempt} committed it" if r.attempt is not None
               else "its committed_at is set")
        if r.attempt is not None:
            out.problems.append(Problem(
                "commit-record", f"txid {r.txid} is {r.state} but {how}: its commit record "
                "was changed by hand, and running it again would count its batch twice",
                f"mark txid {r.txid} committed again (attempt {r.attempt}), {r.stamp()}"))
        else:
            out.problems.append(Problem(
                "commit-record", f"txid {r.txid} is {r.state} but {how}, and no attempt of "
                "it is recorded as committed", None,
                f"check with `onceflow verify --pipeline {pipeline}` whether its batch is in "
                "the state; do not re-run it until then"))
    for r in out.unstamped:
        out.problems.append(Problem(
            "commit-record", f"txid {r.txid} is committed (attempt {r.attempt}) but its "
            "committed_at is gone: its commit record was changed by hand",
            f"set its {r.stamp()}"))
    for u in out.unapplied:
        what = (f"txid {u.txid} is committed but no commit of it left its marks (no attempt "
                "committed, no committed_at): its commit record was set by hand and its "
                "batch was never applied")
        if u.fixable:
            out.problems.append(Problem("commit-record", what,
                                        f"mark txid {u.txid} failed, so that the next run "
                                        "(or `onceflow backfill`) processes and commits it"))
        else:
            out.problems.append(Problem(
                "commit-record", what, None,
                "later txids committed on top of it, so it cannot commit in its turn any more; "
                f"`onceflow verify --pipeline {pipeline}` shows what the state lacks"))
    out.expected, out.stored, out.instance = partition_offsets(cur, pipeline)
    wrong = out.wrong_offsets
    if wrong:
        out.problems.append(Problem(
            "offsets", f"partition_offsets disagrees with the commit log for {len(wrong)} "
            f"partition(s): {describe_offsets(wrong)}",
            "write the offsets the commit log implies (the end of each partition's last "
            "committed range)"))
    if ranges:
        cur.execute(_RANGE_BREAKS, {"p": pipeline})
        breaks = cur.fetchall()
        for partition, prev_txid, prev_end, txid, start in breaks[:5]:
            how = (f"re-reads [{start}, {prev_end})" if start < prev_end
                   else f"skips [{prev_end}, {start}) with no gap recorded")
            out.problems.append(Problem(
                "ranges", f"partition {partition}: txid {txid}'s committed range starts at "
                f"{start} but txid {prev_txid}'s ended at {prev_end}: it {how}", None,
                f"`onceflow verify --pipeline {pipeline}` shows what the state lacks or has "
                "twice"))
        if len(breaks) > 5:
            out.problems.append(Problem("ranges", f"... and {len(breaks) - 5} more committed "
                                        "ranges that do not follow their partition's last",
                                        None, "the same"))
    if coordinator:
        cur.execute(f"""WITH odd AS ({_ODD})
                        SELECT p.last_committed_txid, p.next_txid,
                               coalesce((SELECT min(txid) - 1 FROM odd
                                         WHERE NOT done AND state <> 'committed'),
                                        (SELECT max(txid) FROM transactions
                                         WHERE pipeline = %(p)s), 0),
                               (SELECT coalesce(max(txid), 0) FROM transactions
                                WHERE pipeline = %(p)s)
                        FROM pipelines p WHERE p.name = %(p)s""", {"p": pipeline})
        row = cur.fetchone()
        last_committed, next_txid, contiguous, highest = row if row else (0, 1, 0, 0)
        if row is not None and last_committed != contiguous:
            out.problems.append(Problem(
                "coordinator", f"last_committed_txid is {last_committed} but the commit log "
                f"says {contiguous}", f"set last_committed_txid to {contiguous}"))
        if row is not None and next_txid <= highest:
            out.problems.append(Problem(
                "coordinator", f"next_txid is {next_txid} but txid {highest} exists",
                f"set next_txid to {highest + 1}"))
    return out


def describe_offsets(wrong: dict, limit: int = 4) -> str:
    def show(row) -> str:
        return "none" if row is None else f"{row[0]} (txid {row[1]})"

    parts = []
    for p, (have, want) in list(wrong.items())[:limit]:
        if have is None:
            parts.append(f"p{p} has no row, the commit log says {show(want)}")
        elif want is None:
            parts.append(f"p{p} is at {show(have)} but no committed range after the last "
                         "reset reads it")
        elif have[:2] == want[:2]:
            parts.append(f"p{p} is at {show(have)} under instance {have[2]}, the "
                         f"coordinator's is {want[2]}")
        else:
            parts.append(f"p{p} is at {show(have)}, the commit log says {show(want)}")
    more = f"; and {len(wrong) - limit} more" if len(wrong) > limit else ""
    return "; ".join(parts) + more


def offsets_to_show(book: Bookkeeping) -> dict[int, int]:
    """Per partition, the committed offset the commit log implies (status shows it where
    partition_offsets lost or changed it)."""
    return {p: end for p, (end, _, _) in book.expected.items()}
