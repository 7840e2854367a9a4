"""The transaction coordinator's begin side: which txid and attempt a DAG run works on, and
which records that attempt reads.

PostgreSQL is the source of truth; begin runs under a lock on the pipeline's coordinator row,
so plans never overlap. The offset log (batch_ranges) is written before any processing.

What begin gives a run (first rule that applies):

1. conf ``{"txid": N}``: a new attempt of N (manual backfill); nothing to do if N is committed;
2. the run already has a txid (a Clear or a retry of begin): a new attempt of that txid;
3. the lowest failed or superseded txid: adopted with a new attempt (automatic backfill);
4. else a new txid with a new batch, unless ``max_pending`` transactions are uncommitted
   (then MaxPendingReached and the run plans nothing).

A new attempt fences every older one: staging and commit check that their attempt is current.
In transactional mode a txid's batch never changes. In opaque mode a new attempt re-plans from
where txid - 1 ends; when that changes the batch, every later uncommitted txid is superseded,
to be adopted (rule 3) and re-planned from the new end in txid order, so nothing is skipped or
read twice. Worked example (seed 001): A = txid 1 reads 1-50, B = txid 2 reads 51-100, A fails;
A's new attempt reads 1-40, so B is superseded; B's next attempt reads 41-...
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

import psycopg2.extras

from onceflow import backflow
from onceflow import state as state_tables
from onceflow.db import connection, transaction
from onceflow.offsets import OffsetOutOfRange, record_gaps, resolve_starts
from onceflow.pipeline import ConfigError, Pipeline
from onceflow.planner import PartitionRange, plan_ranges
from onceflow.source import ensure_topic, partition_heads
from onceflow.txn import Fenced, TransactionAttempt, current_attempt, delete_staging

__all__ = ["Batch", "Fenced", "MaxPendingReached", "NotInitialised", "OffsetOutOfRange",
           "TransactionAttempt",
           "begin", "current_attempt", "end_attempt", "load_batch", "lock_pipeline",
           "mark_failed", "register", "reset_offsets"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Batch:
    pipeline: str
    attempt: TransactionAttempt
    ranges: tuple[tuple[PartitionRange, int], ...]  # (range, group)
    groups: int
    committed: bool = False  # the txid is committed already: process and commit do nothing
    replayed: int = 0  # backflow items the batch holds besides its source ranges

    @property
    def records(self) -> int:
        return sum(r.size for r, _ in self.ranges)


class NotInitialised(LookupError):
    pass


class MaxPendingReached(RuntimeError):
    """``max_pending`` transactions are planned and uncommitted: no new txid is planned."""


def register(conn, pipeline: Pipeline, state_dsns: Mapping[str, str] | None = None, *,
             create_topic: bool = False) -> uuid.UUID:
    """Create the pipeline's coordinator row, state tables and source partitions (idempotent).

    A stored topic that differs from the configured one is refused: a silent switch would mix
    two topics' offsets. ``state_dsns`` gives the database of each state kept outside the
    coordinator's (StateSpec.conn_id). An unknown topic is refused unless ``create_topic``
    (then it is made with ``pipeline.partitions`` partitions).
    """
    pipeline.validate()
    if pipeline.source == "files":
        root = pipeline.segments_root()
        if create_topic:
            root.mkdir(parents=True, exist_ok=True)
        elif not root.is_dir():
            raise ConfigError(
                f"pipeline.source_path={str(root)!r} does not exist: create it, or point "
                "source_path (or ONCEFLOW_SEGMENTS_DIR) at the segments folder"
            )
    if create_topic:
        ensure_topic(conn, pipeline.topic, pipeline.partitions)
    with transaction(conn) as cur:
        if not partition_heads(cur, pipeline.topic):
            raise ConfigError(
                f"pipeline.topic={pipeline.topic!r} is unknown: the source has no partitions "
                "for it. Check the name, or create the topic (`onceflow init` creates the "
                "topics of the registered pipelines)"
            )
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
        cur.execute("UPDATE pipelines SET mode = %s WHERE name = %s",
                    (pipeline.mode, pipeline.name))
        backflow.ensure_pointers(cur, pipeline.name)
        for spec in pipeline.states:
            if spec.conn_id is None:
                state_tables.ensure_table(cur, spec)
    for spec in pipeline.external_states():
        with connection(external_dsn(spec, state_dsns)) as external, \
                transaction(external) as cur:
            state_tables.ensure_table(cur, spec)
    return uuid.UUID(str(instance_id))


def external_dsn(spec, state_dsns: Mapping[str, str] | None) -> str:
    if not state_dsns or spec.name not in state_dsns:
        raise ConfigError(
            f"state[{spec.name}].conn_id={spec.conn_id!r} has no database given: define that "
            "Airflow connection (or pass its DSN in state_dsns)"
        )
    return state_dsns[spec.name]


def lock_pipeline(cur, name: str) -> tuple:
    """(next_txid, last_committed_txid, instance_id, topic) under the coordinator row's lock."""
    cur.execute(
        """SELECT next_txid, last_committed_txid, instance_id, topic
           FROM pipelines WHERE name = %s FOR UPDATE""",
        (name,),
    )
    row = cur.fetchone()
    if row is None:
        raise NotInitialised(f"pipeline {name!r} is not initialised: run `onceflow init` first")
    return row


def load_batch(cur, pipeline: str, txid: int) -> Batch:
    cur.execute(
        """SELECT attempt, groups, state, replayed FROM transactions
           WHERE pipeline = %s AND txid = %s""",
        (pipeline, txid),
    )
    row = cur.fetchone()
    if row is None:
        raise LookupError(f"pipeline {pipeline!r} has no txid {txid}")
    attempt, groups, txn_state, replayed = row
    cur.execute(
        """SELECT partition, start_offset, end_offset, grp FROM batch_ranges
           WHERE pipeline = %s AND txid = %s ORDER BY partition""",
        (pipeline, txid),
    )
    ranges = tuple((PartitionRange(p, s, e), g) for p, s, e, g in cur.fetchall())
    return Batch(pipeline, TransactionAttempt(txid, attempt), ranges, groups,
                 committed=txn_state == "committed", replayed=replayed)


def _plan(cur, pipeline: Pipeline, topic: str, groups: int, txid: int,
          before_txid: int | None, old: list[tuple[PartitionRange, int]] = (), *,
          size: int) -> list[tuple[PartitionRange, int]]:
    """Plan txid's batch; ``old`` is its previous plan (a re-plan): where the new plan starts
    later than the old one did, the records between were skipped (gone) and are recorded."""
    starts = resolve_starts(cur, pipeline, topic, before_txid)
    gapped = {p for p, _, _ in starts.gaps}
    for r, _ in old:
        new_start = starts.offsets.get(r.partition)
        if new_start is not None and r.start < new_start and r.partition not in gapped:
            starts.gaps.append((r.partition, r.start, new_start))
    record_gaps(cur, pipeline, topic, txid, starts)
    return plan_ranges(starts.offsets, starts.heads, size, groups,
                       max_per_partition=pipeline.max_per_partition,
                       keep=starts.keep())


def _store_ranges(cur, pipeline: str, txid: int, topic: str,
                  ranges: list[tuple[PartitionRange, int]]) -> None:
    cur.execute("DELETE FROM batch_ranges WHERE pipeline = %s AND txid = %s", (pipeline, txid))
    psycopg2.extras.execute_values(
        cur,
        """INSERT INTO batch_ranges
           (pipeline, txid, topic, partition, grp, start_offset, end_offset) VALUES %s""",
        [(pipeline, txid, topic, r.partition, g, r.start, r.end) for r, g in ranges],
    )


def _map_run(cur, pipeline: str, run_id: str, txid: int) -> None:
    cur.execute(
        """INSERT INTO transaction_runs (pipeline, run_id, txid) VALUES (%s, %s, %s)
           ON CONFLICT (pipeline, run_id) DO UPDATE SET txid = EXCLUDED.txid""",
        (pipeline, run_id, txid),
    )


def _describe(ranges) -> str:
    return " ".join(f"p{r.partition}:[{r.start},{r.end})" for r, _ in ranges) or "(nothing new)"


def begin(conn, pipeline: Pipeline, run_id: str, *, txid: int | None = None) -> Batch:
    """Give ``run_id`` its transaction attempt and batch (the rules in the module docstring)."""
    with transaction(conn) as cur:
        next_txid, _, _, topic = lock_pipeline(cur, pipeline.name)
        target, why = txid, "requested"
        if target is None:
            cur.execute("SELECT txid FROM transaction_runs WHERE pipeline = %s AND run_id = %s",
                        (pipeline.name, run_id))
            row = cur.fetchone()
            target, why = (row[0], "the run's own txid") if row else (None, "")
        if target is None:
            cur.execute(
                """SELECT min(txid) FROM transactions
                   WHERE pipeline = %s AND state IN ('failed', 'superseded')""",
                (pipeline.name,),
            )
            target, why = cur.fetchone()[0], "adopting the lowest failed or superseded txid"
        if target is None:
            return _begin_new(cur, pipeline, run_id, next_txid, topic)
        if not 1 <= target < next_txid:
            raise LookupError(
                f"txid={target} does not exist in pipeline {pipeline.name!r} (txids 1.."
                f"{next_txid - 1}): omit txid to plan a new transaction"
            )
        return _reattempt(cur, pipeline, run_id, target, topic, why)


def _begin_new(cur, pipeline: Pipeline, run_id: str, txid: int, topic: str) -> Batch:
    cur.execute(
        """SELECT coalesce(array_agg(txid ORDER BY txid), '{}') FROM transactions
           WHERE pipeline = %s AND state <> 'committed'""",
        (pipeline.name,),
    )
    pending = cur.fetchone()[0]
    if len(pending) >= pipeline.max_pending:
        raise MaxPendingReached(
            f"max_pending={pipeline.max_pending} reached for {pipeline.name}: txids "
            f"{', '.join(map(str, pending))} are uncommitted; no new transaction is planned "
            "until one commits"
        )
    # Backflow first: the to-queue (swapped in if it ran dry), up to replay_cap, then eden.
    backflow.maybe_swap(cur, pipeline.name)
    replayed = backflow.claim(cur, pipeline.name, txid, pipeline.replays_per_batch,
                              pipeline.groups)
    ranges = _plan(cur, pipeline, topic, pipeline.groups, txid, None,
                   size=pipeline.batch_size - replayed)
    records = sum(r.size for r, _ in ranges)
    cur.execute(
        """INSERT INTO transactions (pipeline, txid, attempt, run_id, groups, records, replayed)
           VALUES (%s, %s, 1, %s, %s, %s, %s)""",
        (pipeline.name, txid, run_id, pipeline.groups, records, replayed),
    )
    cur.execute(
        "INSERT INTO transaction_attempts (pipeline, txid, attempt, run_id) VALUES (%s, %s, 1, %s)",
        (pipeline.name, txid, run_id),
    )
    _store_ranges(cur, pipeline.name, txid, topic, ranges)
    _map_run(cur, pipeline.name, run_id, txid)
    cur.execute("UPDATE pipelines SET next_txid = %s WHERE name = %s", (txid + 1, pipeline.name))
    log.info("BEGIN pipeline=%s txid=%d attempt=1 run=%s records=%d replayed=%d ranges=%s",
             pipeline.name, txid, run_id, records, replayed, _describe(ranges))
    return Batch(pipeline.name, TransactionAttempt(txid, 1), tuple(ranges), pipeline.groups,
                 replayed=replayed)


def _reattempt(cur, pipeline: Pipeline, run_id: str, txid: int, topic: str, why: str) -> Batch:
    cur.execute(
        """SELECT attempt, state, groups FROM transactions
           WHERE pipeline = %s AND txid = %s FOR UPDATE""",
        (pipeline.name, txid),
    )
    old_attempt, old_state, groups = cur.fetchone()
    _map_run(cur, pipeline.name, run_id, txid)
    if old_state == "committed":
        log.info("BEGIN pipeline=%s txid=%d is committed already (%s): run %s has nothing to do",
                 pipeline.name, txid, why, run_id)
        return load_batch(cur, pipeline.name, txid)
    attempt = old_attempt + 1
    end_attempt(cur, pipeline.name, TransactionAttempt(txid, old_attempt), "fenced",
                 f"attempt {attempt} started by run {run_id}")
    cur.execute(
        """UPDATE transactions SET attempt = %s, state = 'planned', run_id = %s,
                  commit_requested_at = NULL
           WHERE pipeline = %s AND txid = %s""",
        (attempt, run_id, pipeline.name, txid),
    )
    cur.execute(
        """INSERT INTO transaction_attempts (pipeline, txid, attempt, run_id)
           VALUES (%s, %s, %s, %s)""",
        (pipeline.name, txid, attempt, run_id),
    )
    delete_staging(cur, pipeline.name, txid)  # older attempts' staging can never commit
    # A transactional batch never changes, unless retention deleted part of it: then the
    # out_of_range policy re-plans it like an opaque one (and records the gap).
    replanned = ((pipeline.mode == "opaque" or _lost_to_retention(cur, pipeline.name, txid))
                 and _replan(cur, pipeline, txid, topic, groups))
    batch = load_batch(cur, pipeline.name, txid)
    log.info("BEGIN pipeline=%s txid=%d attempt=%d run=%s (%s, was %s%s) records=%d ranges=%s",
             pipeline.name, txid, attempt, run_id, why, old_state,
             ", re-planned" if replanned else "", batch.records, _describe(batch.ranges))
    return batch


def _lost_to_retention(cur, pipeline: str, txid: int) -> bool:
    cur.execute(
        """SELECT EXISTS (SELECT 1 FROM batch_ranges b
                          JOIN source_partitions sp USING (topic, partition)
                          WHERE b.pipeline = %s AND b.txid = %s
                            AND b.start_offset < sp.log_start_offset)""",
        (pipeline, txid),
    )
    return cur.fetchone()[0]


def _replan(cur, pipeline: Pipeline, txid: int, topic: str, groups: int) -> bool:
    """Opaque mode: plan ``txid`` again from where txid - 1 ends. Returns True if it changed;
    then every later uncommitted txid is superseded."""
    old = list(load_batch(cur, pipeline.name, txid).ranges)
    cur.execute("SELECT replayed FROM transactions WHERE pipeline = %s AND txid = %s",
                (pipeline.name, txid))
    new = _plan(cur, pipeline, topic, groups, txid, txid, old,
                size=pipeline.batch_size - cur.fetchone()[0])
    if new == old:
        return False
    _store_ranges(cur, pipeline.name, txid, topic, new)
    cur.execute(
        """UPDATE transactions SET records = %s, replans = replans + 1
           WHERE pipeline = %s AND txid = %s""",
        (sum(r.size for r, _ in new), pipeline.name, txid),
    )
    cur.execute(
        """UPDATE transactions SET state = 'superseded'
           WHERE pipeline = %s AND txid > %s AND state <> 'committed'
           RETURNING txid, attempt""",
        (pipeline.name, txid),
    )
    superseded = sorted(cur.fetchall())
    for later, attempt in superseded:
        end_attempt(cur, pipeline.name, TransactionAttempt(later, attempt), "superseded",
                     f"txid {txid} was re-planned")
        delete_staging(cur, pipeline.name, later)
    backflow.release_claims(cur, pipeline.name, [later for later, _ in superseded])
    log.warning("REPLAN pipeline=%s txid=%d: %s -> %s; superseded txids %s", pipeline.name,
                txid, _describe(old), _describe(new),
                ", ".join(str(t) for t, _ in superseded) or "none")
    return True


def end_attempt(cur, pipeline: str, ta: TransactionAttempt, outcome: str, reason: str) -> None:
    cur.execute(
        """UPDATE transaction_attempts SET outcome = %s, reason = %s, ended_at = now()
           WHERE pipeline = %s AND txid = %s AND attempt = %s AND outcome IS NULL""",
        (outcome, reason, pipeline, ta.txid, ta.attempt),
    )


def mark_failed(conn, pipeline: str, ta: TransactionAttempt, reason: str) -> bool:
    """Mark ``ta``'s transaction failed, so the next run adopts it. Fenced: only the current,
    uncommitted attempt can be marked. Returns whether it was."""
    with transaction(conn) as cur:
        cur.execute(
            """UPDATE transactions SET state = 'failed'
               WHERE pipeline = %s AND txid = %s AND attempt = %s AND state = 'planned'""",
            (pipeline, ta.txid, ta.attempt),
        )
        marked = cur.rowcount == 1
        if marked:
            end_attempt(cur, pipeline, ta, "failed", reason[:2000])
    if marked:
        log.warning("FAILED pipeline=%s %s: %s", pipeline, ta, reason)
    return marked


def reset_offsets(conn, pipeline: Pipeline) -> uuid.UUID:
    """force_from_start: forget the pipeline's offsets, so every partition starts again by
    ``pipeline.start_policy``, under a new instance id. Refused while a transaction is open
    (its batch would overlap the new plan). The state tables are left as they are: records
    read again are counted again, which is what asking for a reset means. Logged loudly."""
    with transaction(conn) as cur:
        next_txid, _, old_instance, _ = lock_pipeline(cur, pipeline.name)
        cur.execute(
            """SELECT coalesce(array_agg(txid ORDER BY txid), '{}') FROM transactions
               WHERE pipeline = %s AND state <> 'committed'""",
            (pipeline.name,),
        )
        open_txids = cur.fetchone()[0]
        if open_txids:
            raise ConfigError(
                f"force_from_start for {pipeline.name!r} refused: txids "
                f"{', '.join(map(str, open_txids))} are not committed; commit or backfill them "
                "first"
            )
        instance = uuid.uuid4()
        cur.execute(
            """UPDATE pipelines SET instance_id = %s, reset_after_txid = %s WHERE name = %s""",
            (str(instance), next_txid - 1, pipeline.name),
        )
        cur.execute("DELETE FROM partition_offsets WHERE pipeline = %s", (pipeline.name,))
    log.warning("RESET pipeline=%s: offsets forgotten after txid %d; partitions start again "
                "by start_policy=%s; instance %s -> %s", pipeline.name, next_txid - 1,
                pipeline.start_policy, old_instance, instance)
    return instance
