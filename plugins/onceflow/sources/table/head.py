"""A table source's head: a bound no late commit can fall under.

Writers commit out of order: a row with a smaller key can become visible after one with a
larger key, so ``max(key) + 1`` is not a safe head. onceflow relies on how PostgreSQL hands
out sequence values: ``nextval`` takes a lock on the sequence (RowExclusiveLock) that its
transaction holds until it ends, before it hands out the value, and values come in increasing
order (CACHE 1). So to choose a bound:

1. read the sequence's position ``P`` (every key handed out so far is below ``P``);
2. then list the transactions holding the sequence's lock (pg_locks, by virtual transaction
   id, which every transaction has from its start: xid or not);
3. ``P`` becomes the head once every one of them has ended: a key below ``P`` belongs to a
   transaction that had the lock before step 1, so it is in that list or already over, and
   when the list has drained every such row is committed (visible) or rolled back (never).

``choose_head`` (a begin's ``positions``) does this without blocking: it waits up to
``wait_s`` for the list to drain; if it does not, the candidate is kept
(``table_source_bounds``) and confirmed by a later call (the next begin or commit) once its
transactions ended, and the head stays where it was.

Worked example. Keys 1-100 are committed and an earlier look confirmed the head 101. Writer
A begins, draws 101 (``SELECT nextval``: no xid yet, nextval assigns one only when it writes
WAL, once every 32 values) and has not inserted yet; writer B inserts 102 and 103 and commits.
A begin now reads ``P = 104`` and finds A holding the sequence: ``[101, 104)`` may not be
planned, the head stays 101 (txid 1 reads ``[1, 101)``), the candidate 104 waits for A. A
inserts 101 and commits; the next begin (or commit) finds A gone and confirms 104: txid 2
reads ``[101, 104)``, 101 included. Had A rolled back, the same range reads 102 and 103. A
bound from ``pg_current_snapshot()`` (its xmin, the in-progress xids) would have counted 104
safe at once: A had no xid, so it was in no snapshot, and 101 would have been skipped.

Also refused here (ConfigError): keys at 2^40 and above (the acker's record ids hold offsets
below 2^40); a sequence set back below the head (setval, RESTART: keys already passed would be
handed out again); a topic that was bound to another table or column.
"""

from __future__ import annotations

import logging
import time

from psycopg2 import sql

from onceflow.core import timings
from onceflow.core.errors import ConfigError
from onceflow.core.source import Position
from onceflow.sources.table.check import CheckedTable

log = logging.getLogger(__name__)

MAX_OFFSET = 1 << 40  # spark_tasks/ids.py: record ids hold offsets below 2^40
_STUCK_S = 60.0  # a candidate waiting longer than this is logged with what holds it


def candidate(cur, table: CheckedTable) -> tuple[int, list[str]]:
    """(P, holders): the sequence's position (every key handed out is below it), then the
    transactions holding the sequence's lock, listed after it (the order matters)."""
    cur.execute(sql.SQL("SELECT last_value, is_called FROM {}").format(
        sql.SQL(table.sequence)))
    last, called = cur.fetchone()
    position = last + 1 if called else last
    return position, holders(cur, table.sequence, None)


def wait_for(cur, table: CheckedTable, waiting: list[str], wait_s: float) -> list[str]:
    """Wait up to ``wait_s`` for the writers in ``waiting`` to end (a begin's lock wait);
    those still running."""
    with timings.phase("lock_wait"):
        deadline = time.monotonic() + wait_s
        while waiting and time.monotonic() < deadline:
            time.sleep(0.02)
            waiting = holders(cur, table.sequence, waiting)
        return waiting


def lowest(cur, table: CheckedTable) -> int:
    """A first head no key can still fall under: the sequence's START (it hands out nothing
    below), or a lower key already there (rows loaded before the sequence)."""
    cur.execute(sql.SQL("SELECT least({start}, min({key})) FROM {table}").format(
        start=sql.Literal(table.start), key=table.key, table=table.name))
    return max(0, cur.fetchone()[0])


def choose_head(cur, tcur, table: CheckedTable, topic: str, key: str, wait_s: float
                ) -> Position:
    """A begin's (or a commit's) look: the head, confirmed or kept as a candidate in
    ``table_source_bounds`` (on ``cur``, the coordinator's database) for the writers it
    waits for (on ``tcur``, the table's)."""
    position, waiting = candidate(tcur, table)
    waiting = wait_for(tcur, table, waiting, wait_s)
    first = lowest(tcur, table)
    cur.execute(
        """INSERT INTO table_source_bounds (topic, relation, key_column, head)
           VALUES (%s, %s, %s, %s) ON CONFLICT (topic) DO NOTHING""",
        (topic, table.label, key, first))
    cur.execute(
        """SELECT relation, key_column, head, pending_head, pending_on,
                  now() - pending_since
           FROM table_source_bounds WHERE topic = %s FOR UPDATE""", (topic,))
    relation, bound_key, head, pending, pending_on, age = cur.fetchone()
    if (relation, bound_key) != (table.label, key):
        raise ConfigError(
            f"source topic={topic!r} reads {table.label}.{key} but the topic "
            f"is bound to {relation}.{bound_key}: offsets of one table mean nothing in "
            "another. Give the source a new topic (and the pipeline a new name)")
    if pending is not None and not holders(tcur, table.sequence, pending_on):
        head, pending, pending_on = max(head, pending), None, None
    if position < head:
        raise ConfigError(
            f"sequence {table.sequence} feeding {table.label}.{key} is at "
            f"{position}, below {head}, where onceflow has read up to: it was set "
            "back (setval, RESTART) and would hand out keys already passed. Set it "
            f"forward: SELECT setval('{table.sequence}', {head})")
    if position > MAX_OFFSET:
        raise ConfigError(
            f"{table.label}.{key} reached {position}: offsets (keys) must stay "
            f"below 2^40 = {MAX_OFFSET} (the acker's record ids hold 40 bits of offset)")
    fresh = False
    if not waiting:
        head, pending, pending_on = position, None, None
    elif pending is None:
        pending, pending_on, fresh = position, waiting, True
    elif age is not None and age.total_seconds() > _STUCK_S:
        log.warning("TABLE topic=%s: the head is held at %d for %.0fs by %s",
                    topic, head, age.total_seconds(),
                    describe_holders(tcur, table.sequence, pending_on))
    cur.execute(
        """UPDATE table_source_bounds
           SET head = %(head)s, pending_head = %(pending)s, pending_on = %(on)s,
               updated_at = now(),
               pending_since = CASE WHEN %(pending)s::bigint IS NULL THEN NULL
                                    WHEN %(fresh)s THEN now() ELSE pending_since END
           WHERE topic = %(topic)s""",
        {"head": head, "pending": pending, "on": pending_on, "fresh": fresh,
         "topic": topic})
    # The log start: no key lies below it (keys below the head are final). Not the lowest
    # key: keys of rolled-back inserts leave holes, which are no gap.
    return Position(min(first, head), head)


def look_head(cur, tcur, table: CheckedTable, topic: str) -> Position:
    """The head as a begin would find it, without waiting and without writing: the
    sequence's position, unless a begin keeps a candidate for writers still running
    (then the head confirmed last)."""
    position, waiting = candidate(tcur, table)
    first = lowest(tcur, table)
    cur.execute("SELECT head, pending_head, pending_on FROM table_source_bounds "
                "WHERE topic = %s", (topic,))
    row = cur.fetchone()
    confirmed, pending, pending_on = row if row else (first, None, None)
    head = confirmed
    if waiting and pending is not None:
        # a begin keeps a candidate until the writers it waits for have ended
        if not holders(tcur, table.sequence, pending_on):
            head = max(head, pending)
    else:
        # no writer, or none a begin knows of yet: a begin plans what is final of
        # this and keeps the rest as its candidate (a begin with writers that do not
        # end plans nothing once, then waits for them here)
        head = max(head, position)
    return Position(min(first, head), head)


def holders(cur, sequence: str, among: list[str] | None) -> list[str]:
    """Virtual transaction ids of the transactions holding ``sequence``'s lock (a prepared
    transaction too: its locks stay with it), other than this one; ``among``: only those of
    this list (still running). Readers of the sequence (AccessShareLock: another look at the
    head) draw no keys and are left out; nextval and setval take RowExclusiveLock."""
    if among is not None and not among:
        return []
    cur.execute(
        """SELECT DISTINCT virtualtransaction FROM pg_locks
           WHERE locktype = 'relation' AND relation = %s::regclass AND granted
             AND mode <> 'AccessShareLock'
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
             AND pid IS DISTINCT FROM pg_backend_pid()
             AND (%s::text[] IS NULL OR virtualtransaction = ANY(%s::text[]))
           ORDER BY 1""", (sequence, among, among))
    return [v for (v,) in cur.fetchall()]


def describe_holders(cur, sequence: str, among: list[str]) -> str:
    cur.execute(
        """SELECT string_agg(format('pid %%s (%%s, %%s since %%s)', coalesce(a.pid::text,
                  'prepared'), coalesce(a.application_name, ''), coalesce(a.state, ''),
                  a.xact_start), '; ')
           FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
           WHERE l.locktype = 'relation' AND l.relation = %s::regclass AND l.granted
             AND l.virtualtransaction = ANY(%s::text[])""", (sequence, among))
    return cur.fetchone()[0] or "transactions that have ended since"
