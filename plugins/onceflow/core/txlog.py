"""The transaction log: the only module that writes ``transactions``,
``transaction_attempts``, ``transaction_runs`` and ``batch_ranges``. Others only read them
(status, repair, the view, alerts, keep-up, freshness, offsets, the landing folder's repair).

Two logs behind one small interface, as Spark's OffsetSeqLog and CommitLog:

- the **offset log** (``batch_ranges``): what txid N reads, written by begin before any
  processing;
- the **commit log** (``transactions.state = committed``): txid N is done, written last by the
  commit, in the same PostgreSQL transaction as its state updates and offsets.

A transaction is in one ``TxState``; its current attempt (``transactions.attempt``) is the only
one that may stage or commit: every write checks it (``fence``). Each attempt's story is a row
of ``transaction_attempts`` with an ``Outcome`` once it ends.

Recovery rules (what the next begin does with what a crash left):

    planned, its attempt reported within its lease   -> in flight: leave it alone
    planned, no report for its lease_s               -> abandoned: adopt with a new attempt
    failed or superseded                             -> adopt with a new attempt, lowest first
    committed                                        -> done; a run asking for it is a no-op
    any state, but its commit left its marks         -> never adopted (a record changed by
      (committed_at, an attempt that committed)         hand: `onceflow repair` restores it)

A planned transaction's lease (``heartbeat_at``, ``lease_s``, ``holder``) is renewed by
whatever holds it (onceflow.core.lease): a running task every lease / 4 with the pipeline's
attempt lease, a run between two of its tasks once with the longer hand-over lease. ``release``
ends a silent holder's attempt at once (``onceflow release``).

A run that already holds a txid (a retry, a Clear) re-attempts that txid, and a new attempt
fences every older one. Only the lowest uncommitted txid may commit (``last_committed + 1``).
"""

from __future__ import annotations

import dataclasses
import enum
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import psycopg2.extras
from psycopg2 import sql

from onceflow.core.errors import Fenced, NotInitialised, UnknownTransaction
from onceflow.core.planner import PartitionRange


class TxState(enum.StrEnum):
    PLANNED = "planned"  # begun; processing and commit pending
    COMMITTED = "committed"  # in the commit log
    FAILED = "failed"  # an attempt failed after its last retry: the next run adopts it
    SUPERSEDED = "superseded"  # an earlier txid was re-planned (opaque): planned again later


class Outcome(enum.StrEnum):
    COMMITTED = "committed"
    FAILED = "failed"
    SUPERSEDED = "superseded"
    FENCED = "fenced"  # a newer attempt of the same txid started
    ABANDONED = "abandoned"  # its tasks stopped reporting (the run died): adopted by another


ADOPTABLE = (TxState.FAILED, TxState.SUPERSEDED)


@dataclass(frozen=True, order=True)
class TransactionAttempt:
    txid: int
    attempt: int

    def __str__(self) -> str:
        return f"txid {self.txid} attempt {self.attempt}"


@dataclass(frozen=True)
class Coordinator:
    """A pipeline's coordinator row, read under its lock."""

    next_txid: int
    last_committed: int
    instance_id: uuid.UUID
    topic: str
    reset_after_txid: int


@dataclass(frozen=True)
class Batch:
    pipeline: str
    attempt: TransactionAttempt
    ranges: tuple[tuple[PartitionRange, int], ...]  # (range, group)
    groups: int
    state: TxState = TxState.PLANNED
    replayed: int = 0  # backflow items the batch holds besides its source ranges

    @property
    def committed(self) -> bool:
        return self.state is TxState.COMMITTED

    @property
    def records(self) -> int:
        return sum(r.size for r, _ in self.ranges)

    def ranges_of(self, group: int) -> list[PartitionRange]:
        return [r for r, g in self.ranges if g == group]


@dataclass(frozen=True)
class Blocker:
    """The transaction a commit waits for (txid = last committed + 1)."""

    txid: int
    state: TxState | None  # None: not planned yet
    attempt: int | None = None
    run_id: str | None = None
    reason: str | None = None
    silent_s: float | None = None  # seconds since its attempt last reported
    lease_s: int | None = None
    holder: str | None = None  # the host and pid that reported last
    permanent: bool = False  # its attempt failed so that retrying cannot help (see reason)

    @property
    def abandoned(self) -> bool:
        return (self.state is TxState.PLANNED and self.silent_s is not None
                and self.lease_s is not None and self.silent_s > self.lease_s)

    @property
    def hopeless(self) -> bool:
        """It cannot commit without someone starting a run for it."""
        return self.state in ADOPTABLE or self.abandoned

    def describe(self) -> str:
        if self.state is None:
            return f"txid {self.txid} is not planned yet (trigger a run)"
        text = f"txid {self.txid} is {self.state}"
        if self.abandoned:
            text += (f" but its run {self.run_id} has not reported for {self.silent_s:.0f}s "
                     f"(lease {self.lease_s}s): it is abandoned")
        elif self.run_id:  # a planned one's holder: the process its commit waits on
            held = self.holder and self.state is TxState.PLANNED
            text += f" (run {self.run_id}" + (f", {self.holder}" if held else "") + ")"
        if self.reason:
            text += f": {self.reason}"
        return text


_ROW_LOCKS = {"": sql.SQL(""), "share": sql.SQL("FOR SHARE"), "update": sql.SQL("FOR UPDATE")}


# -- the coordinator row --------------------------------------------------------------------------
def lock_pipeline(cur, name: str) -> Coordinator:
    """The coordinator row of ``name``, locked until the transaction ends."""
    cur.execute(
        """SELECT next_txid, last_committed_txid, instance_id, topic, reset_after_txid
           FROM pipelines WHERE name = %s FOR UPDATE""",
        (name,),
    )
    row = cur.fetchone()
    if row is None:
        raise NotInitialised(f"pipeline {name!r} is not initialised: run `onceflow init` "
                             "(or trigger its DAG: begin registers it)")
    return Coordinator(row[0], row[1], uuid.UUID(str(row[2])), row[3], row[4])


def last_committed(cur, name: str) -> int:
    cur.execute("SELECT last_committed_txid FROM pipelines WHERE name = %s", (name,))
    row = cur.fetchone()
    return row[0] if row else 0


# -- fencing --------------------------------------------------------------------------------------
def fence(cur, pipeline: str, ta: TransactionAttempt, *, lock: str = "") -> TxState:
    """The state of ``ta``'s transaction; raises Fenced unless ``ta`` is its current attempt.

    ``lock``: "" (none), "share" (staging: excludes a concurrent commit) or "update" (commit).
    """
    cur.execute(
        sql.SQL("SELECT attempt, state FROM transactions WHERE pipeline = %s AND txid = %s {}")
        .format(_ROW_LOCKS[lock]),
        (pipeline, ta.txid),
    )
    row = cur.fetchone()
    if row is None:
        raise UnknownTransaction(f"pipeline {pipeline!r} has no txid {ta.txid}")
    attempt, state = row
    if attempt != ta.attempt:
        raise Fenced(f"{ta} of {pipeline} is fenced: attempt {attempt} is current")
    return TxState(state)


def heartbeat(cur, pipeline: str, ta: TransactionAttempt, *, lease_s: int | None = None,
              holder: str | None = None) -> bool:
    """The attempt's holder is alive, and stays so for ``lease_s`` more seconds (None: the
    lease it has). False when ``ta`` is no longer current (fenced, failed or committed)."""
    cur.execute(
        """UPDATE transactions SET heartbeat_at = now(), lease_s = coalesce(%s, lease_s),
                  holder = coalesce(%s, holder)
           WHERE pipeline = %s AND txid = %s AND attempt = %s AND state = 'planned'""",
        (lease_s, holder, pipeline, ta.txid, ta.attempt),
    )
    return cur.rowcount == 1


@dataclass(frozen=True)
class Release:
    """What ``release`` found: whether it ended the attempt, and the transaction as it was."""

    released: bool
    state: TxState
    attempt: int
    run_id: str | None
    holder: str | None
    silent_s: float


def release(cur, pipeline: str, txid: int, *, fresh_s: int, force: bool, reason: str
            ) -> Release:
    """End the current attempt of planned ``txid`` as abandoned and mark the transaction
    failed, so the next run adopts it at once, unless its holder reported within ``fresh_s``
    seconds (a task of it is running) and not ``force``. The check and the write are one
    statement, fenced by the attempt read: a report or a commit in between wins."""
    cur.execute(
        """SELECT state, attempt, run_id, holder, EXTRACT(EPOCH FROM now() - heartbeat_at)
           FROM transactions WHERE pipeline = %s AND txid = %s""",
        (pipeline, txid),
    )
    row = cur.fetchone()
    if row is None:
        raise UnknownTransaction(f"pipeline {pipeline!r} has no txid {txid}")
    state, attempt, run_id, holder, silent = row
    found = Release(False, TxState(state), attempt, run_id, holder, float(silent or 0))
    if found.state is not TxState.PLANNED:
        return found
    cur.execute(
        """UPDATE transactions SET state = 'failed'
           WHERE pipeline = %s AND txid = %s AND attempt = %s AND state = 'planned'
             AND (%s OR heartbeat_at < now() - make_interval(secs => %s))""",
        (pipeline, txid, attempt, force, fresh_s),
    )
    if cur.rowcount != 1:
        return found
    end_attempt(cur, pipeline, TransactionAttempt(txid, attempt), Outcome.ABANDONED, reason)
    announce_turn(cur, pipeline)
    return dataclasses.replace(found, released=True)


# -- runs -----------------------------------------------------------------------------------------
def run_txid(cur, pipeline: str, run_id: str) -> int | None:
    cur.execute("SELECT txid FROM transaction_runs WHERE pipeline = %s AND run_id = %s",
                (pipeline, run_id))
    row = cur.fetchone()
    return row[0] if row else None


def map_run(cur, pipeline: str, run_id: str, txid: int) -> None:
    cur.execute(
        """INSERT INTO transaction_runs (pipeline, run_id, txid) VALUES (%s, %s, %s)
           ON CONFLICT (pipeline, run_id) DO UPDATE SET txid = EXCLUDED.txid""",
        (pipeline, run_id, txid),
    )


def begin_waiter_name(pipeline: str) -> str:
    """The application_name of the connection a run waiting in its begin for a place
    listens on (PostgreSQL keeps 63 bytes of it)."""
    return f"onceflow-begin-wait {pipeline}"[:63]


def begin_waiters(cur, pipeline: str) -> int:
    """How many runs wait in their begin for a place among ``pipeline``'s max_pending."""
    cur.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                (begin_waiter_name(pipeline),))
    return int(cur.fetchone()[0])


# -- reading --------------------------------------------------------------------------------------
def uncommitted(cur, pipeline: str) -> list[int]:
    cur.execute(
        """SELECT coalesce(array_agg(txid ORDER BY txid), '{}') FROM transactions
           WHERE pipeline = %s AND state <> 'committed'""",
        (pipeline,),
    )
    return list(cur.fetchone()[0])


def adoptable(cur, pipeline: str) -> tuple[int, str] | None:
    """The lowest txid the next run should adopt, and why: failed, superseded, or planned by
    an attempt silent for longer than its lease (its run died). Never one whose commit left
    its marks (committed_at, an attempt that committed): its commit record was changed by
    hand, its batch is in the state, and `onceflow repair` restores the record."""
    cur.execute(
        """SELECT txid, state, run_id, holder, EXTRACT(EPOCH FROM now() - heartbeat_at),
                  lease_s FROM transactions t
           WHERE pipeline = %s AND (state IN ('failed', 'superseded')
                 OR (state = 'planned' AND heartbeat_at < now() - make_interval(secs => lease_s)))
             AND committed_at IS NULL AND NOT EXISTS (
                 SELECT 1 FROM transaction_attempts a WHERE a.pipeline = t.pipeline
                   AND a.txid = t.txid AND a.outcome = 'committed')
           ORDER BY txid LIMIT 1""",
        (pipeline,),
    )
    row = cur.fetchone()
    if row is None:
        return None
    txid, state, run_id, holder, silent, lease = row
    if state != "planned":
        return txid, f"adopting the lowest {state} txid"
    return txid, (f"adopting an abandoned txid: its run {run_id} ({holder or 'holder unknown'}) "
                  f"has not reported for {float(silent):.0f}s, past its {lease}s lease")


def load_batch(cur, pipeline: str, txid: int) -> Batch:
    cur.execute(
        """SELECT attempt, groups, state, replayed FROM transactions
           WHERE pipeline = %s AND txid = %s""",
        (pipeline, txid),
    )
    row = cur.fetchone()
    if row is None:
        raise UnknownTransaction(f"pipeline {pipeline!r} has no txid {txid}")
    attempt, groups, state, replayed = row
    return Batch(pipeline, TransactionAttempt(txid, attempt), tuple(read_ranges(cur, pipeline,
                                                                                txid)),
                 groups, TxState(state), replayed)


def read_ranges(cur, pipeline: str, txid: int) -> list[tuple[PartitionRange, int]]:
    cur.execute(
        """SELECT partition, start_offset, end_offset, grp FROM batch_ranges
           WHERE pipeline = %s AND txid = %s ORDER BY partition""",
        (pipeline, txid),
    )
    return [(PartitionRange(p, s, e), g) for p, s, e, g in cur.fetchall()]


def blocker(cur, pipeline: str, txid: int) -> Blocker:
    cur.execute(
        """SELECT t.state, t.attempt, t.run_id, a.reason,
                  EXTRACT(EPOCH FROM now() - t.heartbeat_at), t.lease_s, t.holder,
                  coalesce(a.permanent, false)
           FROM transactions t LEFT JOIN transaction_attempts a
             ON a.pipeline = t.pipeline AND a.txid = t.txid AND a.attempt = t.attempt
           WHERE t.pipeline = %s AND t.txid = %s""",
        (pipeline, txid),
    )
    row = cur.fetchone()
    if row is None:
        return Blocker(txid, None)
    state, attempt, run_id, reason, silent, lease, holder, permanent = row
    return Blocker(txid, TxState(state), attempt, run_id, reason,
                   float(silent) if silent is not None else None, lease, holder,
                   permanent and state == TxState.FAILED)


@dataclass(frozen=True)
class TxRow:
    """One transaction as ``status`` and ``backfill`` show it."""

    txid: int
    attempt: int
    state: TxState
    run_id: str | None
    records: int
    replayed: int
    failed: int | None
    rows_applied: int | None
    committed_at: datetime | None
    commit_wait_s: float | None
    reason: str | None
    ranges: str | None
    silent_s: float | None
    lease_s: int | None
    holder: str | None = None
    permanent: bool = False  # failed so that retrying cannot help until the cause is fixed
    # the current attempt's begin: lock wait, index, plan seconds (None: not recorded)
    begin_s: tuple[float, float, float] | None = None

    @property
    def abandoned(self) -> bool:
        return (self.state is TxState.PLANNED and self.silent_s is not None
                and self.lease_s is not None and self.silent_s > self.lease_s)

    @property
    def adoptable_in_s(self) -> float | None:
        """Seconds until the next run may adopt this planned txid (0: now)."""
        if self.state is not TxState.PLANNED or self.silent_s is None or self.lease_s is None:
            return None
        return max(0.0, self.lease_s - self.silent_s)


_HISTORY = """
    SELECT t.txid, t.attempt, t.state, t.run_id, t.records, t.replayed, t.failed,
           t.rows_applied, t.committed_at, t.commit_wait_s,
           (SELECT a.reason FROM transaction_attempts a WHERE a.pipeline = t.pipeline
            AND a.txid = t.txid AND a.attempt = t.attempt),
           (SELECT string_agg(format('p%%s:[%%s,%%s)', partition, start_offset, end_offset),
                              ' ' ORDER BY partition)
            FROM batch_ranges b WHERE b.pipeline = t.pipeline AND b.txid = t.txid),
           EXTRACT(EPOCH FROM now() - t.heartbeat_at), t.lease_s, t.holder,
           t.state = 'failed' AND coalesce((SELECT a.permanent FROM transaction_attempts a
               WHERE a.pipeline = t.pipeline AND a.txid = t.txid AND a.attempt = t.attempt),
               false),
           (SELECT ARRAY[a.begin_lock_s, a.begin_index_s, a.begin_plan_s]
            FROM transaction_attempts a WHERE a.pipeline = t.pipeline AND a.txid = t.txid
              AND a.attempt = t.attempt AND a.begin_plan_s IS NOT NULL)
    FROM transactions t WHERE t.pipeline = %(pipeline)s {where}
    ORDER BY t.txid {order} LIMIT %(limit)s"""

# The states a history page filters on: a planned transaction whose attempt stopped reporting
# for longer than its lease is "abandoned" (TxRow.abandoned), as the view and status say.
PAGE_STATES = ("planned", "committed", "failed", "superseded", "abandoned")
_SHOWN_STATE = """CASE WHEN t.state = 'planned' AND t.heartbeat_at
                       < now() - make_interval(secs => t.lease_s)
                  THEN 'abandoned' ELSE t.state END"""


def _rows(cur) -> list[TxRow]:
    rows = [TxRow(*row[:2], TxState(row[2]), *row[3:12],
                  float(row[12]) if row[12] is not None else None, row[13], row[14],
                  row[15], tuple(row[16]) if row[16] is not None else None)
            for row in cur.fetchall()]
    return sorted(rows, key=lambda r: r.txid)


def history(cur, pipeline: str, limit: int = 50, *, open_only: bool = False) -> list[TxRow]:
    """The last ``limit`` transactions in txid (= commit) order; ``open_only``: uncommitted."""
    where = "AND t.state <> 'committed'" if open_only else ""
    cur.execute(_HISTORY.format(where=where, order="DESC"),
                {"pipeline": pipeline, "limit": limit})
    return _rows(cur)


def history_page(cur, pipeline: str, limit: int, *, before: int | None = None,
                 after: int | None = None, min_txid: int | None = None,
                 max_txid: int | None = None, states: Sequence[str] = ()) -> list[TxRow]:
    """Up to ``limit`` transactions in txid order, within ``min_txid``..``max_txid`` and in
    ``states`` (PAGE_STATES; none: every state): the highest txids below ``before``, or with
    ``after``, the lowest above it (the page just newer)."""
    where, params = [], {"pipeline": pipeline, "limit": limit, "before": before,
                         "after": after, "lo": min_txid, "hi": max_txid,
                         "states": list(states)}
    for key, condition in (("before", "t.txid < %(before)s"), ("after", "t.txid > %(after)s"),
                           ("lo", "t.txid >= %(lo)s"), ("hi", "t.txid <= %(hi)s")):
        if params[key] is not None:
            where.append(f"AND {condition}")
    if states:
        where.append(f"AND {_SHOWN_STATE} = ANY(%(states)s)")
    cur.execute(_HISTORY.format(where=" ".join(where), order="ASC" if after is not None
                                else "DESC"), params)
    return _rows(cur)


# -- writing --------------------------------------------------------------------------------------
def insert(cur, pipeline: str, txid: int, run_id: str, *, groups: int, records: int,
           replayed: int, lease_s: int, holder: str | None = None,
           backlog: int | None = None) -> TransactionAttempt:
    """A new transaction (attempt 1) and its run mapping. Its planned_at is the moment of
    this write under the coordinator's lock (clock_timestamp()), not the start of the
    PostgreSQL transaction (now()), which may precede a wait for that lock; committed_at
    likewise (mark_committed). So no transaction seems planned before the commit that freed
    its place. ``backlog``: the source's records past the batch's end when it was planned."""
    cur.execute(
        """INSERT INTO transactions (pipeline, txid, attempt, run_id, groups, records, replayed,
                                     heartbeat_at, lease_s, holder, planned_at, backlog)
           VALUES (%s, %s, 1, %s, %s, %s, %s, now(), %s, %s, clock_timestamp(), %s)""",
        (pipeline, txid, run_id, groups, records, replayed, lease_s, holder, backlog),
    )
    cur.execute(
        "INSERT INTO transaction_attempts (pipeline, txid, attempt, run_id) VALUES (%s, %s, 1, %s)",
        (pipeline, txid, run_id),
    )
    map_run(cur, pipeline, run_id, txid)
    cur.execute("UPDATE pipelines SET next_txid = %s WHERE name = %s", (txid + 1, pipeline))
    return TransactionAttempt(txid, 1)


def store_ranges(cur, pipeline: str, txid: int, topic: str,
                 ranges: Sequence[tuple[PartitionRange, int]], *,
                 backlog: int | None = None) -> None:
    """The offset log's entry for ``txid`` (replacing a re-planned one); ``backlog``: the
    source's records past its end now (kept as it was when None)."""
    cur.execute("DELETE FROM batch_ranges WHERE pipeline = %s AND txid = %s", (pipeline, txid))
    psycopg2.extras.execute_values(
        cur,
        """INSERT INTO batch_ranges
           (pipeline, txid, topic, partition, grp, start_offset, end_offset) VALUES %s""",
        [(pipeline, txid, topic, r.partition, g, r.start, r.end) for r, g in ranges],
    )
    cur.execute(
        """UPDATE transactions SET records = %s, backlog = coalesce(%s, backlog)
           WHERE pipeline = %s AND txid = %s""",
        (sum(r.size for r, _ in ranges), backlog, pipeline, txid),
    )


def store_arrivals(cur, pipeline: str, txid: int, first, last) -> None:
    """When the oldest and the newest record of ``txid``'s batch arrived (None: unknown)."""
    cur.execute("""UPDATE transactions SET first_arrival = %s, last_arrival = %s
                   WHERE pipeline = %s AND txid = %s""", (first, last, pipeline, txid))


def record_begin(cur, pipeline: str, ta: TransactionAttempt,
                 figures: tuple[float, float, float]) -> None:
    """Where the begin of ``ta`` spent its time: (lock wait, index, plan) seconds."""
    cur.execute(
        """UPDATE transaction_attempts SET begin_lock_s = %s, begin_index_s = %s,
                  begin_plan_s = %s
           WHERE pipeline = %s AND txid = %s AND attempt = %s""",
        (*figures, pipeline, ta.txid, ta.attempt),
    )


def new_attempt(cur, pipeline: str, txid: int, run_id: str, *, lease_s: int,
                holder: str | None = None) -> tuple[TransactionAttempt, TxState]:
    """A new attempt of an uncommitted ``txid`` for ``run_id``, fencing the old one. Returns
    the new attempt and the state the transaction was in."""
    cur.execute(
        """SELECT attempt, state, (state = 'planned' AND heartbeat_at <
                                   now() - make_interval(secs => lease_s))
           FROM transactions WHERE pipeline = %s AND txid = %s FOR UPDATE""",
        (pipeline, txid),
    )
    old_attempt, old_state, abandoned = cur.fetchone()
    attempt = TransactionAttempt(txid, old_attempt + 1)
    end_attempt(cur, pipeline, TransactionAttempt(txid, old_attempt),
                Outcome.ABANDONED if abandoned else Outcome.FENCED,
                f"attempt {attempt.attempt} started by run {run_id}")
    cur.execute(
        """UPDATE transactions SET attempt = %s, state = 'planned', run_id = %s,
                  commit_requested_at = NULL, heartbeat_at = now(), lease_s = %s, holder = %s
           WHERE pipeline = %s AND txid = %s""",
        (attempt.attempt, run_id, lease_s, holder, pipeline, txid),
    )
    cur.execute(
        """INSERT INTO transaction_attempts (pipeline, txid, attempt, run_id)
           VALUES (%s, %s, %s, %s)""",
        (pipeline, txid, attempt.attempt, run_id),
    )
    map_run(cur, pipeline, run_id, txid)
    return attempt, TxState(old_state)


def count_replan(cur, pipeline: str, txid: int) -> None:
    cur.execute("UPDATE transactions SET replans = replans + 1 WHERE pipeline = %s AND txid = %s",
                (pipeline, txid))


def supersede_after(cur, pipeline: str, txid: int, reason: str) -> list[TransactionAttempt]:
    """Every uncommitted transaction above ``txid`` is superseded (to be planned again)."""
    cur.execute(
        """UPDATE transactions SET state = 'superseded'
           WHERE pipeline = %s AND txid > %s AND state <> 'committed'
           RETURNING txid, attempt""",
        (pipeline, txid),
    )
    superseded = sorted(TransactionAttempt(t, a) for t, a in cur.fetchall())
    for ta in superseded:
        end_attempt(cur, pipeline, ta, Outcome.SUPERSEDED, reason)
    return superseded


def end_attempt(cur, pipeline: str, ta: TransactionAttempt, outcome: Outcome, reason: str,
                permanent: bool = False) -> None:
    cur.execute(
        """UPDATE transaction_attempts SET outcome = %s, reason = %s, permanent = %s,
                  ended_at = now()
           WHERE pipeline = %s AND txid = %s AND attempt = %s AND outcome IS NULL""",
        (str(outcome), reason[:2000], permanent, pipeline, ta.txid, ta.attempt),
    )


# Commits waiting for their turn LISTEN here; every commit and every failed transaction
# notifies it (delivered when the writing transaction commits), so a waiter looks again at
# once instead of at its next poll. The payload is the pipeline's name.
TURN_CHANNEL = "onceflow_turns"


def announce_turn(cur, pipeline: str) -> None:
    """Tell the commits waiting on ``pipeline`` to look again (at this transaction's end)."""
    cur.execute("SELECT pg_notify(%s, %s)", (TURN_CHANNEL, pipeline))


def mark_failed(cur, pipeline: str, ta: TransactionAttempt, reason: str,
                permanent: bool = False) -> bool:
    """Mark ``ta``'s transaction failed, so the next run adopts it. ``permanent``: its error
    was one retrying cannot help (onceflow.core.errors.Permanent): the cause must be fixed
    before the txid is run again. Fenced: only the current, uncommitted attempt can be
    marked. Returns whether it was."""
    cur.execute(
        """UPDATE transactions SET state = 'failed'
           WHERE pipeline = %s AND txid = %s AND attempt = %s AND state = 'planned'""",
        (pipeline, ta.txid, ta.attempt),
    )
    marked = cur.rowcount == 1
    if marked:
        end_attempt(cur, pipeline, ta, Outcome.FAILED, reason, permanent)
        announce_turn(cur, pipeline)  # a commit waiting on it can fail at once, naming it
    return marked


def restore_committed(cur, pipeline: str, ta: TransactionAttempt, reason: str) -> bool:
    """`onceflow repair`: ``ta`` committed (its outcome says so) but the transaction's state
    was changed by hand: make ``ta`` its committed attempt again, and end every later attempt
    (fenced: it may neither stage nor commit). Returns whether the row changed."""
    cur.execute(
        """UPDATE transactions SET state = 'committed', attempt = %s
           WHERE pipeline = %s AND txid = %s AND state <> 'committed'""",
        (ta.attempt, pipeline, ta.txid),
    )
    changed = cur.rowcount == 1
    if changed:
        cur.execute(
            """UPDATE transaction_attempts SET outcome = 'fenced', reason = %s, ended_at = now()
               WHERE pipeline = %s AND txid = %s AND attempt > %s AND outcome IS NULL""",
            (reason[:2000], pipeline, ta.txid, ta.attempt),
        )
    return changed


def stamp_committed(cur, pipeline: str, txid: int, at) -> bool:
    """`onceflow repair`: give committed ``txid`` whose committed_at was set to NULL by hand
    its time again: ``at`` (the commit's own record of it), else now. Freshness, status and
    the view read it. Returns whether the row changed."""
    cur.execute(
        """UPDATE transactions SET committed_at = coalesce(%s, now())
           WHERE pipeline = %s AND txid = %s AND state = 'committed' AND committed_at IS NULL""",
        (at, pipeline, txid),
    )
    return cur.rowcount == 1


def unmark_committed(cur, pipeline: str, ta: TransactionAttempt, reason: str) -> bool:
    """`onceflow repair`: a transaction marked committed by hand, whose commit never ran (no
    outcome, no committed_at): failed, so the next run adopts it. Returns whether it was."""
    cur.execute(
        """UPDATE transactions SET state = 'failed'
           WHERE pipeline = %s AND txid = %s AND attempt = %s AND state = 'committed'
             AND committed_at IS NULL""",
        (pipeline, ta.txid, ta.attempt),
    )
    marked = cur.rowcount == 1
    if marked:
        end_attempt(cur, pipeline, ta, Outcome.FAILED, reason)
    return marked


def request_commit(cur, pipeline: str, ta: TransactionAttempt) -> None:
    """The commit of ``ta`` was asked for: its wait is measured from here."""
    cur.execute(
        """UPDATE transactions SET commit_requested_at = now(), heartbeat_at = now()
           WHERE pipeline = %s AND txid = %s AND attempt = %s
             AND commit_requested_at IS NULL""",
        (pipeline, ta.txid, ta.attempt),
    )


def mark_committed(cur, pipeline: str, ta: TransactionAttempt, *, rows: int, failed: int
                   ) -> float:
    """The commit log's entry: last write of the commit transaction. Returns the wait (s)."""
    cur.execute(
        """UPDATE transactions
           SET state = 'committed', committed_at = clock_timestamp(), rows_applied = %(rows)s,
               commit_wait_s = EXTRACT(EPOCH FROM now() - commit_requested_at),
               failed = %(failed)s
           WHERE pipeline = %(pipeline)s AND txid = %(txid)s
           RETURNING commit_wait_s""",
        {"pipeline": pipeline, "txid": ta.txid, "rows": rows, "failed": failed},
    )
    waited = cur.fetchone()[0] or 0.0
    end_attempt(cur, pipeline, ta, Outcome.COMMITTED, "")
    cur.execute("UPDATE pipelines SET last_committed_txid = %s WHERE name = %s",
                (ta.txid, pipeline))
    announce_turn(cur, pipeline)
    return float(waited)


# -- the offset log's queries ---------------------------------------------------------------------
def planned_ends(cur, pipeline: str, reset_after_txid: int, before_txid: int | None
                 ) -> dict[int, int]:
    """Per partition, the end of the last planned (not superseded) range after the last
    reset, of txids below ``before_txid`` (all when None).

    Every begin asks, so the cost must not grow with the committed history: the partitions
    are walked on the (pipeline, partition, end_offset) index (a loose index scan), and per
    partition the ranges from the highest end down until one qualifies (the first, but for
    the few txids in flight past ``before_txid`` or ranges before a reset)."""
    cur.execute(
        """WITH RECURSIVE parts (p) AS (
               SELECT min(partition) FROM batch_ranges WHERE pipeline = %(pipeline)s
               UNION ALL
               SELECT (SELECT min(partition) FROM batch_ranges
                       WHERE pipeline = %(pipeline)s AND partition > parts.p)
               FROM parts WHERE parts.p IS NOT NULL)
           SELECT parts.p, last.end_offset FROM parts
           CROSS JOIN LATERAL (
               SELECT br.end_offset FROM batch_ranges br
               JOIN transactions t ON t.pipeline = br.pipeline AND t.txid = br.txid
               WHERE br.pipeline = %(pipeline)s AND br.partition = parts.p
                 AND t.state <> 'superseded' AND br.txid > %(reset)s
                 AND (%(before)s::bigint IS NULL OR br.txid < %(before)s)
               ORDER BY br.end_offset DESC LIMIT 1) AS last
           WHERE parts.p IS NOT NULL""",
        {"pipeline": pipeline, "reset": reset_after_txid, "before": before_txid},
    )
    return dict(cur.fetchall())


def lowest_open_starts(cur, topic: str) -> dict[int, int]:
    """Per partition of ``topic``, the lowest offset any uncommitted transaction of any
    pipeline has planned: retention may not delete from there on."""
    cur.execute(
        """SELECT br.partition, min(br.start_offset) FROM batch_ranges br
           JOIN transactions t ON t.pipeline = br.pipeline AND t.txid = br.txid
           WHERE br.topic = %s AND t.state <> 'committed' AND br.end_offset > br.start_offset
           GROUP BY br.partition""",
        (topic,),
    )
    return dict(cur.fetchall())


def committed_ranges(cur, pipeline: str, first: int = 1, last: int | None = None
                     ) -> list[tuple[int, PartitionRange]]:
    """(txid, range) of every committed transaction after the last reset (of txids
    ``first..last`` only: an index range scan), in txid order."""
    cur.execute(
        """SELECT br.txid, br.partition, br.start_offset, br.end_offset FROM batch_ranges br
           JOIN transactions t ON t.pipeline = br.pipeline AND t.txid = br.txid
           JOIN pipelines p ON p.name = br.pipeline
           WHERE br.pipeline = %s AND t.state = 'committed' AND br.txid > p.reset_after_txid
             AND br.end_offset > br.start_offset AND br.txid >= %s
             AND (%s::bigint IS NULL OR br.txid <= %s)
           ORDER BY br.txid, br.partition""",
        (pipeline, first, last, last),
    )
    return [(txid, PartitionRange(p, s, e)) for txid, p, s, e in cur.fetchall()]


def committed_txids(cur, pipeline: str, first: int = 1, last: int | None = None
                    ) -> list[int]:
    """Every committed txid after the last reset (of ``first..last`` only), in order."""
    cur.execute(
        """SELECT t.txid FROM transactions t JOIN pipelines p ON p.name = t.pipeline
           WHERE t.pipeline = %s AND t.state = 'committed' AND t.txid > p.reset_after_txid
             AND t.txid >= %s AND (%s::bigint IS NULL OR t.txid <= %s)
           ORDER BY t.txid""",
        (pipeline, first, last, last),
    )
    return [t for (t,) in cur.fetchall()]


def committed_span(cur, pipeline: str) -> tuple[int, int]:
    """(first, last) committed txid after the last reset; first > last when there is none
    (commits go in txid order, so every txid between them is committed)."""
    cur.execute("SELECT reset_after_txid + 1, last_committed_txid FROM pipelines "
                "WHERE name = %s", (pipeline,))
    row = cur.fetchone()
    if row is None:
        raise NotInitialised(f"pipeline {pipeline!r} is not initialised: run `onceflow init` "
                             "(or trigger its DAG: begin registers it)")
    return row[0], row[1]
