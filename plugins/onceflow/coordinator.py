"""The transaction coordinator: begin (plan a batch) and commit (apply it, strictly in order).

PostgreSQL is the source of truth. Both phases lock the pipeline's coordinator row, so plans
never overlap and commits happen one at a time in txid order. The offset log (batch_ranges) is
written by begin before any processing; the commit log (transactions.state = 'committed') is
the last write of the commit, in the same PostgreSQL transaction as the state it applied.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import psycopg2.extras

from onceflow import state as state_tables
from onceflow.db import transaction
from onceflow.pipeline import ConfigError, Pipeline
from onceflow.planner import PartitionRange, plan_ranges
from onceflow.source import ensure_topic, partition_heads
from onceflow.txn import Fenced, TransactionAttempt, current_attempt, delete_staging

__all__ = ["Batch", "CommitResult", "Fenced", "MissingStaging", "NotInitialised",
           "TransactionAttempt", "begin", "commit", "load_batch", "register"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Batch:
    pipeline: str
    attempt: TransactionAttempt
    ranges: tuple[tuple[PartitionRange, int], ...]  # (range, group)
    groups: int
    reused: bool = False  # the run already had this txid (a retry of begin)

    @property
    def records(self) -> int:
        return sum(r.size for r, _ in self.ranges)


@dataclass(frozen=True)
class CommitResult:
    status: str  # "committed" | "already_committed" | "waiting"
    attempt: TransactionAttempt
    rows_applied: int = 0
    waited_s: float = 0.0
    blocking_txid: int | None = None
    blocking_state: str | None = None
    blocking_run_id: str | None = None


class NotInitialised(LookupError):
    pass


class MissingStaging(RuntimeError):
    """Commit was asked for while some processing group of the attempt has not staged."""


def register(conn, pipeline: Pipeline) -> uuid.UUID:
    """Create the pipeline's coordinator row, state tables and source partitions (idempotent).

    A stored topic that differs from the configured one is refused: a silent switch would mix
    two topics' offsets.
    """
    pipeline.validate()
    ensure_topic(conn, pipeline.topic, pipeline.partitions)
    with transaction(conn) as cur:
        cur.execute(
            """INSERT INTO pipelines (name, instance_id, topic, mode) VALUES (%s, %s, %s, %s)
               ON CONFLICT (name) DO NOTHING""",
            (pipeline.name, str(uuid.uuid4()), pipeline.topic, pipeline.mode),
        )
        cur.execute("SELECT instance_id, topic FROM pipelines WHERE name = %s", (pipeline.name,))
        instance_id, topic = cur.fetchone()
        if topic != pipeline.topic:
            raise ConfigError(
                f"pipeline.topic={pipeline.topic!r} but pipeline {pipeline.name!r} is stored with "
                f"topic {topic!r}: configure topic {topic!r}, or give the new topic a new "
                "pipeline name"
            )
        for spec in pipeline.states:
            state_tables.ensure_table(cur, spec)
    return uuid.UUID(str(instance_id))


def _lock_pipeline(cur, name: str) -> tuple:
    cur.execute(
        """SELECT next_txid, last_committed_txid, instance_id, topic
           FROM pipelines WHERE name = %s FOR UPDATE""",
        (name,),
    )
    row = cur.fetchone()
    if row is None:
        raise NotInitialised(f"pipeline {name!r} is not initialised: run `onceflow init` first")
    return row


def load_batch(cur, pipeline: str, txid: int, *, reused: bool = False) -> Batch:
    cur.execute(
        "SELECT attempt, groups FROM transactions WHERE pipeline = %s AND txid = %s",
        (pipeline, txid),
    )
    row = cur.fetchone()
    if row is None:
        raise LookupError(f"pipeline {pipeline!r} has no txid {txid}")
    attempt, groups = row
    cur.execute(
        """SELECT partition, start_offset, end_offset, grp FROM batch_ranges
           WHERE pipeline = %s AND txid = %s ORDER BY partition""",
        (pipeline, txid),
    )
    ranges = tuple((PartitionRange(p, s, e), g) for p, s, e, g in cur.fetchall())
    return Batch(pipeline, TransactionAttempt(txid, attempt), ranges, groups, reused)


def _plan_starts(cur, pipeline: str, topic: str) -> dict[int, int]:
    """Per partition: where the next batch starts.

    The end of the last planned range (batches in flight are not re-read), else the committed
    offset, else the start of the log.
    """
    cur.execute(
        """SELECT sp.partition,
                  GREATEST(sp.log_start_offset, po."offset",
                           (SELECT max(br.end_offset) FROM batch_ranges br
                            WHERE br.pipeline = %(pipeline)s AND br.partition = sp.partition))
           FROM source_partitions sp
           LEFT JOIN partition_offsets po
                  ON po.pipeline = %(pipeline)s AND po.partition = sp.partition
           WHERE sp.topic = %(topic)s""",
        {"pipeline": pipeline, "topic": topic},
    )
    return dict(cur.fetchall())


def begin(conn, pipeline: Pipeline, run_id: str) -> Batch:
    """Give ``run_id`` its transaction: the txid it already has, or a new txid and batch.

    The batch's ranges are stored before this returns, so processing (and any replay of it)
    reads exactly the planned records.
    """
    with transaction(conn) as cur:
        next_txid, _, _, topic = _lock_pipeline(cur, pipeline.name)
        cur.execute(
            "SELECT txid FROM transaction_runs WHERE pipeline = %s AND run_id = %s",
            (pipeline.name, run_id),
        )
        row = cur.fetchone()
        if row is not None:
            batch = load_batch(cur, pipeline.name, row[0], reused=True)
            log.info("run %s already attempts %s of %s: reusing its batch", run_id,
                     batch.attempt, pipeline.name)
            return batch

        txid = next_txid
        starts = _plan_starts(cur, pipeline.name, topic)
        heads = {p: head for p, (_, head) in partition_heads(cur, topic).items()}
        ranges = plan_ranges(starts, heads, pipeline.batch_size, pipeline.groups)
        records = sum(r.size for r, _ in ranges)
        cur.execute(
            """INSERT INTO transactions (pipeline, txid, attempt, run_id, groups, records)
               VALUES (%s, %s, 1, %s, %s, %s)""",
            (pipeline.name, txid, run_id, pipeline.groups, records),
        )
        psycopg2.extras.execute_values(
            cur,
            """INSERT INTO batch_ranges
               (pipeline, txid, topic, partition, grp, start_offset, end_offset) VALUES %s""",
            [(pipeline.name, txid, topic, r.partition, g, r.start, r.end) for r, g in ranges],
        )
        cur.execute(
            "INSERT INTO transaction_runs (pipeline, run_id, txid) VALUES (%s, %s, %s)",
            (pipeline.name, run_id, txid),
        )
        cur.execute("UPDATE pipelines SET next_txid = %s WHERE name = %s",
                    (txid + 1, pipeline.name))
    batch = Batch(pipeline.name, TransactionAttempt(txid, 1), tuple(ranges), pipeline.groups)
    log.info(
        "BEGIN pipeline=%s txid=%d attempt=1 run=%s records=%d ranges=%s",
        pipeline.name, txid, run_id, records,
        " ".join(f"p{r.partition}:[{r.start},{r.end})" for r, _ in ranges) or "(nothing new)",
    )
    return batch


Step = Callable[[str], None]


def _no_step(_: str) -> None:
    pass


def commit(conn, pipeline: Pipeline, ta: TransactionAttempt, *, on_step: Step = _no_step
           ) -> CommitResult:
    """Commit ``ta`` if it is its turn; else return status "waiting" and change nothing.

    ONE PostgreSQL transaction under the coordinator row's lock: fence, apply every state's
    staged deltas (set-based upserts), keep the rejected records, advance the partition
    offsets, drop the staging, and last write the commit record. A crash anywhere before the
    final COMMIT leaves nothing; a committed txid committed again is a logged no-op.
    ``on_step(name)`` is called after each statement group (fault injection in tests).
    """
    with transaction(conn) as cur:
        cur.execute(
            """UPDATE transactions SET commit_requested_at = now()
               WHERE pipeline = %s AND txid = %s AND attempt = %s
                 AND commit_requested_at IS NULL""",
            (pipeline.name, ta.txid, ta.attempt),
        )
    with transaction(conn) as cur:
        _, last_committed, instance_id, _ = _lock_pipeline(cur, pipeline.name)
        txn_state = current_attempt(cur, pipeline.name, ta, lock="update")
        if txn_state == "committed":
            log.info("COMMIT pipeline=%s %s: already committed, nothing to do", pipeline.name, ta)
            return CommitResult("already_committed", ta)
        if txn_state != "planned":
            raise Fenced(f"{ta} of {pipeline.name} is {txn_state}: it may not commit")
        if last_committed != ta.txid - 1:
            cur.execute(
                "SELECT state, run_id FROM transactions WHERE pipeline = %s AND txid = %s",
                (pipeline.name, last_committed + 1),
            )
            blocking_state, blocking_run = cur.fetchone() or (None, None)
            return CommitResult("waiting", ta, blocking_txid=last_committed + 1,
                                blocking_state=blocking_state, blocking_run_id=blocking_run)
        keys = {"pipeline": pipeline.name, "txid": ta.txid, "attempt": ta.attempt}
        cur.execute(
            """SELECT t.groups, array_agg(g.grp ORDER BY g.grp) FILTER (WHERE g.grp IS NOT NULL)
               FROM transactions t
               LEFT JOIN staged_groups g ON g.pipeline = t.pipeline AND g.txid = t.txid
                                         AND g.attempt = %(attempt)s
               WHERE t.pipeline = %(pipeline)s AND t.txid = %(txid)s GROUP BY t.groups""",
            keys,
        )
        groups, staged = cur.fetchone()
        missing = sorted(set(range(groups)) - set(staged or []))
        if missing:
            raise MissingStaging(
                f"{ta} of {pipeline.name}: processing group(s) {missing} have not staged; "
                "run (or retry) their process task before commit"
            )
        on_step("locked")
        rows = 0
        for spec in pipeline.states:
            rows += state_tables.apply_source(
                cur, spec, ta.txid, state_tables.staged_source(), {**keys, "state": spec.name}
            )
            on_step(f"state:{spec.name}")
        cur.execute(
            """INSERT INTO rejected_records (pipeline, topic, partition, "offset", error, txid)
               SELECT pipeline, topic, partition, "offset", error, txid FROM staged_rejects
               WHERE pipeline = %(pipeline)s AND txid = %(txid)s AND attempt = %(attempt)s
               ON CONFLICT DO NOTHING""",
            keys,
        )
        on_step("rejects")
        cur.execute(
            """INSERT INTO partition_offsets
                   (pipeline, instance_id, topic, partition, "offset", txid)
               SELECT pipeline, %(instance)s, topic, partition, end_offset, txid
               FROM batch_ranges WHERE pipeline = %(pipeline)s AND txid = %(txid)s
               ON CONFLICT (pipeline, partition) DO UPDATE
               SET "offset" = EXCLUDED."offset", txid = EXCLUDED.txid, topic = EXCLUDED.topic,
                   instance_id = EXCLUDED.instance_id, updated_at = now()""",
            {**keys, "instance": str(instance_id)},
        )
        on_step("offsets")
        delete_staging(cur, pipeline.name, ta.txid)
        on_step("staging")
        cur.execute(
            """UPDATE transactions
               SET state = 'committed', committed_at = now(), rows_applied = %(rows)s,
                   commit_wait_s = EXTRACT(EPOCH FROM now() - commit_requested_at)
               WHERE pipeline = %(pipeline)s AND txid = %(txid)s
               RETURNING commit_wait_s""",
            {**keys, "rows": rows},
        )
        waited = cur.fetchone()[0] or 0.0
        cur.execute("UPDATE pipelines SET last_committed_txid = %s WHERE name = %s",
                    (ta.txid, pipeline.name))
        on_step("commit_record")
    log.info(
        "COMMIT pipeline=%s txid=%d attempt=%d prev_txid=%d rows=%d waited=%.2fs",
        pipeline.name, ta.txid, ta.attempt, ta.txid - 1, rows, waited,
    )
    return CommitResult("committed", ta, rows_applied=rows, waited_s=waited)
