"""Backflow: failed records are replayed, a bounded number of times, then kept as dead letters.

After the parallel data backflow method (reference seed 004): three queues, **eden** (the
source log), **from** and **to** (``backflow_items.queue`` 0 or 1; ``backflow_pointers.to_queue``
says which is which). A record is only ever unread or done: there is no pending state to track.

- Planning (coordinator.begin, under the coordinator lock) takes up to ``replay_cap`` items of
  the to-queue first, marking them ``claimed_txid``, then fills the batch from eden. A claimed
  item belongs to that txid's batch: it is never planned twice, a re-attempt of the txid reads it
  again, and a superseded txid gives its claims back.
- The commit of a txid (one PostgreSQL transaction with the state updates) settles its batch:
  claimed items that completed are deleted; failed ones move to the from-queue with one more
  failure and its error; records failing for the first time (from eden) join the from-queue;
  a record with more than ``max_replays`` failed replays goes to ``dead_letters`` instead,
  with every error it had. Offsets advance regardless: a poison record never stalls a partition.
- When the to-queue is empty (so no in-flight txid holds a claim on it) and the from-queue is
  not, the two swap by flipping the pointer: no copying. Checked at every begin and commit.

Every change happens inside a transaction that holds the coordinator row's lock, so planning,
commits and swaps are serialized and a crash between any two statements leaves nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from psycopg2 import sql

from onceflow.core.pipeline import Pipeline
from onceflow.core.txlog import TransactionAttempt

log = logging.getLogger(__name__)


def ensure_pointers(cur, pipeline: str) -> None:
    cur.execute("INSERT INTO backflow_pointers (pipeline) VALUES (%s) ON CONFLICT DO NOTHING",
                (pipeline,))


def maybe_swap(cur, pipeline: str) -> bool:
    """Swap from and to if to is empty, nothing is claimed and from holds something."""
    cur.execute(
        """UPDATE backflow_pointers p
           SET to_queue = 1 - p.to_queue, swaps = p.swaps + 1, swapped_at = now()
           WHERE p.pipeline = %(pipeline)s
             AND NOT EXISTS (SELECT 1 FROM backflow_items b WHERE b.pipeline = p.pipeline
                             AND (b.queue = p.to_queue OR b.claimed_txid IS NOT NULL))
             AND EXISTS (SELECT 1 FROM backflow_items b WHERE b.pipeline = p.pipeline
                         AND b.queue = 1 - p.to_queue)
           RETURNING to_queue, swaps,
                     (SELECT count(*) FROM backflow_items b WHERE b.pipeline = p.pipeline)""",
        {"pipeline": pipeline},
    )
    row = cur.fetchone()
    if row:
        to_queue, swaps, items = row
        log.info("SWAP pipeline=%s: queue %d is now the to-queue (%d items to replay), queue %d "
                 "the from-queue; swap #%d", pipeline, to_queue, items, 1 - to_queue, swaps)
    return row is not None


def claim(cur, pipeline: str, txid: int, cap: int, groups: int) -> int:
    """Give ``txid``'s batch up to ``cap`` unclaimed to-queue items (oldest first), spread
    over its processing groups. Returns how many."""
    if cap <= 0:
        return 0
    cur.execute(
        """WITH picked AS (
               SELECT b.partition, b."offset",
                      row_number() OVER (ORDER BY b.queued_at, b.partition, b."offset") AS n
               FROM backflow_items b JOIN backflow_pointers p USING (pipeline)
               WHERE b.pipeline = %(pipeline)s AND b.queue = p.to_queue
                 AND b.claimed_txid IS NULL
               ORDER BY b.queued_at, b.partition, b."offset" LIMIT %(cap)s)
           UPDATE backflow_items b SET claimed_txid = %(txid)s,
                  claimed_grp = (picked.n - 1) %% %(groups)s
           FROM picked
           WHERE b.pipeline = %(pipeline)s AND b.partition = picked.partition
             AND b."offset" = picked."offset" """,
        {"pipeline": pipeline, "txid": txid, "cap": cap, "groups": groups},
    )
    return cur.rowcount


def claimed(cur, pipeline: str, txid: int, group: int) -> list[tuple[int, int, str, int]]:
    """(partition, offset, payload, failures) of the items ``txid`` claimed for ``group``."""
    cur.execute(
        """SELECT partition, "offset", payload, failures FROM backflow_items
           WHERE pipeline = %s AND claimed_txid = %s AND claimed_grp = %s
           ORDER BY partition, "offset" """,
        (pipeline, txid, group),
    )
    return cur.fetchall()


def committed_replays(cur, pipeline: str, first: int = 1, last: int | None = None,
                      *, payloads: bool = True) -> list[tuple]:
    """(txid, partition, offset, replays, payload) of every record a committed txid replayed
    (after the last reset; of txids ``first..last`` only), in txid order; without
    ``payloads``, (txid, partition, offset)."""
    cur.execute(
        sql.SQL("""SELECT r.txid, r.partition, r."offset" {} FROM batch_replays r
           JOIN pipelines p ON p.name = r.pipeline
           WHERE r.pipeline = %s AND r.txid > p.reset_after_txid AND r.txid >= %s
             AND (%s::bigint IS NULL OR r.txid <= %s)
           ORDER BY r.txid, r.partition, r."offset" """).format(
            sql.SQL(", r.replays, r.payload" if payloads else "")),
        (pipeline, first, last, last),
    )
    return cur.fetchall()


def replayed_retired(cur, pipeline: str) -> list[str]:
    """Payloads of records replayed successfully after retention deleted their source row."""
    cur.execute("SELECT payload FROM replayed_retired WHERE pipeline = %s", (pipeline,))
    return [p for (p,) in cur.fetchall()]


def parked(cur, pipeline: str) -> list[tuple[str, int, int]]:
    """("queued" | "dead", partition, offset) of every record waiting in a backflow queue or
    given up on: not counted (yet)."""
    cur.execute(
        """SELECT 'queued', partition, "offset" FROM backflow_items WHERE pipeline = %(p)s
           UNION ALL
           SELECT 'dead', partition, "offset" FROM dead_letters WHERE pipeline = %(p)s""",
        {"p": pipeline},
    )
    return cur.fetchall()


def release_claims(cur, pipeline: str, txids: list[int]) -> int:
    """Superseded txids give their items back to the to-queue."""
    if not txids:
        return 0
    cur.execute(
        """UPDATE backflow_items SET claimed_txid = NULL, claimed_grp = NULL
           WHERE pipeline = %s AND claimed_txid = ANY(%s)""",
        (pipeline, txids),
    )
    if cur.rowcount:
        log.info("RELEASE pipeline=%s: %d replay item(s) of superseded txid(s) %s are free again",
                 pipeline, cur.rowcount, ", ".join(map(str, txids)))
    return cur.rowcount


@dataclass(frozen=True)
class Settled:
    replayed_ok: int = 0  # claimed items that completed this time
    queued: int = 0  # failed records now in the from-queue
    dead: int = 0  # records given up on

    @property
    def failed(self) -> int:
        return self.queued + self.dead


def settle(cur, pipeline: Pipeline, ta: TransactionAttempt, replayed: int) -> Settled:
    """The commit's share of the backflow, inside the commit transaction (see the module
    docstring). Reads this attempt's staged failures; ``replayed``: the backflow items its
    batch claimed."""
    keys = {"pipeline": pipeline.name, "txid": ta.txid, "attempt": ta.attempt,
            "max": pipeline.max_replays}
    # What the batch replayed, kept with the commit (verify re-runs committed batches).
    cur.execute(
        """INSERT INTO batch_replays (pipeline, txid, partition, "offset", replays, payload)
           SELECT pipeline, %(txid)s, partition, "offset", failures, payload FROM backflow_items
           WHERE pipeline = %(pipeline)s AND claimed_txid = %(txid)s
           ON CONFLICT DO NOTHING""",
        keys,
    )
    # This attempt's failed roots, as a subquery the statements below share.
    failed = sql.SQL("""SELECT partition, "offset", replayed, payload, error FROM staged_failures
                WHERE pipeline = %(pipeline)s AND txid = %(txid)s AND attempt = %(attempt)s""")
    # Claimed items that failed again, past max_replays: dead letters.
    cur.execute(
        sql.SQL("""INSERT INTO dead_letters (pipeline, partition, "offset", payload, failures,
                                      errors, txid)
            SELECT b.pipeline, b.partition, b."offset", b.payload, b.failures + 1,
                   b.errors || f.error, %(txid)s
            FROM backflow_items b JOIN ({failed}) f
              ON f.replayed AND f.partition = b.partition AND f."offset" = b."offset"
            WHERE b.pipeline = %(pipeline)s AND b.claimed_txid = %(txid)s
              AND b.failures + 1 > %(max)s
            ON CONFLICT (pipeline, partition, "offset") DO NOTHING""").format(failed=failed),
        keys,
    )
    dead = cur.rowcount
    # Claimed items that failed again, still replayable: to the from-queue.
    cur.execute(
        sql.SQL("""UPDATE backflow_items b
            SET queue = 1 - p.to_queue, failures = b.failures + 1, errors = b.errors || f.error,
                last_txid = %(txid)s, claimed_txid = NULL, claimed_grp = NULL, queued_at = now()
            FROM ({failed}) f, backflow_pointers p
            WHERE f.replayed AND f.partition = b.partition AND f."offset" = b."offset"
              AND p.pipeline = b.pipeline AND b.pipeline = %(pipeline)s
              AND b.claimed_txid = %(txid)s AND b.failures + 1 <= %(max)s""").format(failed=failed),
        keys,
    )
    queued = cur.rowcount
    # What is still claimed completed (or was just dead-lettered): consumed. A completed
    # record whose source row retention deleted meanwhile is kept for verify.
    log_starts = {p: pos.log_start for p, pos in pipeline.source.positions(cur).items()}
    cur.execute(
        """WITH consumed AS (
               DELETE FROM backflow_items b WHERE b.pipeline = %(pipeline)s
                 AND b.claimed_txid = %(txid)s
               RETURNING b.partition, b."offset", b.payload),
           ok AS (
               SELECT c.* FROM consumed c WHERE NOT EXISTS (
                   SELECT 1 FROM dead_letters d WHERE d.pipeline = %(pipeline)s
                     AND d.partition = c.partition AND d."offset" = c."offset"))
           INSERT INTO replayed_retired (pipeline, partition, "offset", payload, txid)
           SELECT %(pipeline)s, ok.partition, ok."offset", ok.payload, %(txid)s FROM ok
           JOIN unnest(%(parts)s::int[], %(starts)s::bigint[]) AS s(partition, log_start)
             ON s.partition = ok.partition
           WHERE ok."offset" < s.log_start
           ON CONFLICT DO NOTHING""",
        {**keys, "parts": list(log_starts), "starts": list(log_starts.values())},
    )
    cur.execute("SELECT count(*) FROM staged_failures WHERE pipeline = %(pipeline)s AND "
                "txid = %(txid)s AND attempt = %(attempt)s AND replayed", keys)
    claimed_failed = cur.fetchone()[0]
    replayed_ok = replayed - claimed_failed
    # Records that failed for the first time (read from eden).
    if pipeline.max_replays >= 1:
        cur.execute(
            sql.SQL("""INSERT INTO backflow_items (pipeline, partition, "offset", queue, payload,
                                            failures, errors, first_txid, last_txid)
                SELECT %(pipeline)s, f.partition, f."offset", 1 - p.to_queue, f.payload, 1,
                       ARRAY[f.error], %(txid)s, %(txid)s
                FROM ({failed}) f JOIN backflow_pointers p ON p.pipeline = %(pipeline)s
                WHERE NOT f.replayed
                ON CONFLICT (pipeline, partition, "offset") DO NOTHING""").format(failed=failed),
            keys,
        )
        queued += cur.rowcount
    else:
        cur.execute(
            sql.SQL("""INSERT INTO dead_letters (pipeline, partition, "offset", payload, failures,
                                          errors, txid)
                SELECT %(pipeline)s, f.partition, f."offset", f.payload, 1, ARRAY[f.error],
                       %(txid)s
                FROM ({failed}) f WHERE NOT f.replayed
                ON CONFLICT (pipeline, partition, "offset") DO NOTHING""").format(failed=failed),
            keys,
        )
        dead += cur.rowcount
    maybe_swap(cur, pipeline.name)
    settled = Settled(replayed_ok, queued, dead)
    if settled.failed or settled.replayed_ok:
        log.info("BACKFLOW pipeline=%s %s: %d replayed record(s) completed, %d failed record(s) "
                 "queued for replay, %d given up (dead letters, max_replays=%d)", pipeline.name,
                 ta, settled.replayed_ok, settled.queued, settled.dead, pipeline.max_replays)
    return settled


@dataclass(frozen=True)
class QueueSizes:
    to_queue: int
    swaps: int
    to_items: int
    to_claimed: int
    from_items: int
    dead_letters: int

    def line(self) -> str:
        return (f"backflow: to-queue={self.to_queue} ({self.to_items} items, {self.to_claimed} "
                f"claimed by in-flight txids) from-queue={1 - self.to_queue} "
                f"({self.from_items} items) swaps={self.swaps} "
                f"dead_letters={self.dead_letters}")


def queue_sizes(cur, pipeline: str) -> QueueSizes:
    cur.execute(
        """SELECT p.to_queue, p.swaps,
                  count(b.*) FILTER (WHERE b.queue = p.to_queue),
                  count(b.*) FILTER (WHERE b.queue = p.to_queue AND b.claimed_txid IS NOT NULL),
                  count(b.*) FILTER (WHERE b.queue <> p.to_queue),
                  (SELECT count(*) FROM dead_letters d WHERE d.pipeline = p.pipeline)
           FROM backflow_pointers p
           LEFT JOIN backflow_items b ON b.pipeline = p.pipeline
           WHERE p.pipeline = %s GROUP BY p.pipeline, p.to_queue, p.swaps""",
        (pipeline,),
    )
    row = cur.fetchone()
    return QueueSizes(*row) if row else QueueSizes(1, 0, 0, 0, 0, 0)


def dead_letter_summary(cur, pipeline: str, newest: int = 5, everything: bool = False
                        ) -> dict:
    """How many dead letters, how many per last error (the whole text: a replay of one
    reason, ``replay_dead_letters(last_error=...)``, takes exactly the letters counted), the
    newest few (or ``everything``)."""
    cur.execute("SELECT count(*) FROM dead_letters WHERE pipeline = %s", (pipeline,))
    total = cur.fetchone()[0]
    cur.execute(
        """SELECT errors[array_upper(errors, 1)] AS reason, count(*) FROM dead_letters
           WHERE pipeline = %s GROUP BY reason ORDER BY count(*) DESC, reason LIMIT 10""",
        (pipeline,),
    )
    by_reason = cur.fetchall()
    cur.execute(
        """SELECT partition, "offset", failures, errors[array_upper(errors, 1)], txid, dead_at
           FROM dead_letters WHERE pipeline = %s ORDER BY dead_at DESC, partition, "offset"
           LIMIT %s""",
        (pipeline, None if everything else newest),
    )
    rows = [dict(zip(("partition", "offset", "failures", "last_error", "txid", "dead_at"), r,
                     strict=True)) for r in cur.fetchall()]
    return {"total": total, "by_reason": by_reason,
            "newest": [] if everything else rows, "all": rows if everything else []}


def replay_dead_letters(cur, pipeline: str, *, positions: list[tuple[int, int]] | None = None,
                        error_contains: str | None = None, last_error: str | None = None
                        ) -> int:
    """Put chosen dead letters back in the from-queue with their failure count reset (their
    errors kept). ``positions`` (partition, offset), ``error_contains`` (a substring of any
    error) and ``last_error`` (the whole last error, as ``dead_letter_summary`` groups them)
    choose, each that is given must match; none: all. Call under the coordinator lock.
    Returns how many."""
    cur.execute(
        """WITH chosen AS (
               DELETE FROM dead_letters d WHERE d.pipeline = %(pipeline)s
                 AND (%(any_pos)s OR (d.partition, d."offset") IN
                      (SELECT * FROM unnest(%(parts)s::int[], %(offsets)s::bigint[])))
                 AND (%(pattern)s::text IS NULL OR EXISTS (
                      SELECT 1 FROM unnest(d.errors) e WHERE strpos(e, %(pattern)s) > 0))
                 AND (%(last)s::text IS NULL OR d.errors[array_upper(d.errors, 1)] = %(last)s)
               RETURNING d.*)
           INSERT INTO backflow_items (pipeline, partition, "offset", queue, payload, failures,
                                       errors, first_txid, last_txid)
           SELECT c.pipeline, c.partition, c."offset", 1 - p.to_queue, c.payload, 0,
                  c.errors || 'put back from the dead letters by a user'::text, c.txid, c.txid
           FROM chosen c JOIN backflow_pointers p USING (pipeline)
           ON CONFLICT (pipeline, partition, "offset") DO NOTHING""",
        {"pipeline": pipeline, "any_pos": positions is None,
         "parts": [p for p, _ in positions or []], "offsets": [o for _, o in positions or []],
         "pattern": error_contains, "last": last_error},
    )
    moved = cur.rowcount
    maybe_swap(cur, pipeline)
    return moved
