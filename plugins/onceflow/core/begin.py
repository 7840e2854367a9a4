"""The coordinator's begin: which txid and attempt a run works on, and which records that
attempt reads.

PostgreSQL is the source of truth; begin runs under a lock on the pipeline's coordinator row,
so plans never overlap. The offset log (batch_ranges) is written before any processing.

What begin gives a run (first rule that applies):

1. ``txid=N`` asked for (a manual backfill): a new attempt of N; nothing to do if committed;
2. the run already has a txid (a Clear or a retry of begin): a new attempt of that txid;
3. the lowest txid to adopt (onceflow.core.txlog.adoptable): failed, superseded, or planned
   by an attempt that stopped reporting (its run died): a new attempt (automatic backfill);
4. else a new txid with a new batch, unless ``max_pending`` transactions are uncommitted
   (then MaxPendingReached and the run plans nothing), or, for a run that asks to skip an
   empty batch (``skip_empty``: a run the source watcher started), unless there is nothing
   to read (then NothingToPlan: no txid).

A run that committed its txid and goes on with the next batch (``carry_on``: a keep-up run,
onceflow.airflow.operators.transaction) skips rule 2 (its own txid is the committed one) and
plans a new batch only when the records it would read (and replays) reach the pipeline's
``batch_start_records``, or the ``start_records`` it gives (the run waited for the next batch
until its oldest record waited ``max_delay``, as the watcher's rule has it).

A new batch records when its oldest and newest records arrived in the source
(``transactions.first_arrival`` / ``last_arrival``, onceflow.core.freshness). Every begin
counts itself (``pipelines.begins``), so the source watcher knows its runs began.

A new attempt fences every older one: staging and commit check that their attempt is current.
In transactional mode a txid's batch never changes (unless retention took part of it, which
it may do only after the batch committed). In opaque mode a new attempt re-plans from where
txid - 1 ends; when that changes the batch, every later uncommitted txid is superseded, to be
adopted (rule 3) and re-planned from the new end in txid order, so nothing is skipped or read
twice. Worked example (seed 001): A = txid 1 reads 1-50, B = txid 2 reads 51-100, A fails;
A's new attempt reads 1-40, so B is superseded; B's next attempt reads 41-...

Each attempt records where its begin's time went (onceflow.core.timings): waiting for locks,
indexing new source data, planning; its BEGIN log line ends with the three.
"""

from __future__ import annotations

import logging

from onceflow.core import backflow, offsets, tables, timings, txlog
from onceflow.core.db import transaction
from onceflow.core.errors import MaxPendingReached, NothingToPlan, UnknownTransaction
from onceflow.core.lease import this_process
from onceflow.core.pipeline import Pipeline
from onceflow.core.planner import PartitionRange, align_to_units, plan_ranges
from onceflow.core.source import record_sightings
from onceflow.core.staging import delete_staging
from onceflow.core.txlog import Batch, TransactionAttempt, TxState

log = logging.getLogger(__name__)


def begin(conn, pipeline: Pipeline, run_id: str, *, txid: int | None = None,
          lease_s: int | None = None, skip_empty: bool = False,
          carry_on: bool = False, start_records: int | None = None) -> Batch:
    """Give ``run_id`` its transaction attempt and batch (the rules in the module docstring).
    ``lease_s``: the attempt's first lease (default the pipeline's; a run that goes on in
    another task gives its hand-over lease, onceflow.core.lease). ``skip_empty``: plan no
    new transaction without records to read (NothingToPlan). ``carry_on``: the run committed
    its txid and asks for the next batch, planned only if a full start of one waits
    (``start_records``, default the pipeline's ``batch_start_records``)."""
    lease = (lease_s or pipeline.lease_s, this_process())
    with timings.begin_split() as split, pipeline.source.planning(), \
            transaction(conn) as cur:
        with timings.phase("lock_wait"):
            coordinator = txlog.lock_pipeline(cur, pipeline.name)
        cur.execute("UPDATE pipelines SET begins = begins + 1 WHERE name = %s",
                    (pipeline.name,))
        # A table left of other types than its declaration is refused now, not at the
        # commit; the staging follows the declaration (a measure's type widened): an
        # attempt staged before with the old columns fails the commit's proof and is
        # processed again.
        typed = pipeline.typed_states()
        tables.check_types(cur, [(s.shape(), s.opaque) for s in typed if s.conn_id is None])
        for change in tables.follow_declaration(cur, pipeline.name, [s.shape() for s in typed]):
            log.warning("STAGING pipeline=%s: made again for the declaration: %s",
                        pipeline.name, change)
        target, why = txid, "requested"
        if target is None and not carry_on:
            target, why = txlog.run_txid(cur, pipeline.name, run_id), "the run's own txid"
        if target is None:
            target, why = txlog.adoptable(cur, pipeline.name) or (None, "")
        if target is None:
            batch = _begin_new(cur, pipeline, run_id, coordinator, lease, split,
                               skip_empty or carry_on,
                               (pipeline.batch_start_records if start_records is None
                                else start_records) if carry_on else 0)
        elif not 1 <= target < coordinator.next_txid:
            raise UnknownTransaction(
                f"txid={target} does not exist in pipeline {pipeline.name!r} (txids 1.."
                f"{coordinator.next_txid - 1}): omit txid to plan a new transaction")
        else:
            batch = _reattempt(cur, pipeline, run_id, target, coordinator, why, lease, split)
    if batch is None:  # committed: the begin is counted, what it saw is recorded
        log.info("BEGIN pipeline=%s run=%s: nothing new to read; no transaction planned",
                 pipeline.name, run_id)
        raise NothingToPlan(f"nothing new to read in {pipeline.source.describe()}: the "
                            f"pipeline is caught up (last txid {coordinator.next_txid - 1})")
    return batch


def _plan(cur, pipeline: Pipeline, coordinator: txlog.Coordinator, groups: int, txid: int,
          before_txid: int | None, old: list[tuple[PartitionRange, int]] = (), *,
          size: int) -> tuple[list[tuple[PartitionRange, int]], int]:
    """Plan txid's batch; ``old`` is its previous plan (a re-plan): where the new plan starts
    later than the old one did, the records between were skipped (gone) and are recorded.
    Returns the ranges and the backlog: the records of the source past the batch's end (held
    back ones too), which the view's lag over time is made of."""
    def resolve(positions):
        return offsets.resolve_starts(cur, pipeline, coordinator, positions, before_txid)

    def enough(positions) -> bool:
        """The batch can be planned full, from starts the source's head does not decide."""
        starts = resolve(positions)
        if pipeline.out_of_range == "latest" and starts.gaps:
            return False
        if starts.chosen_by_policy and pipeline.start_policy != "earliest":
            return False
        cap = pipeline.max_per_partition or size
        return sum(min(cap, max(0, starts.heads[p] - start))
                   for p, start in starts.offsets.items()) >= size

    positions = pipeline.source.positions_until(cur, enough)
    if pipeline.source.arrival_by_sight:  # the arrival of records past the last head seen
        record_sightings(cur, pipeline.topic, {p: pos.head for p, pos in positions.items()})
    starts = resolve(positions)
    gapped = {p for p, _, _ in starts.gaps}
    for r, _ in old:
        new_start = starts.offsets.get(r.partition)
        if new_start is not None and r.start < new_start and r.partition not in gapped:
            starts.gaps.append((r.partition, r.start, new_start))
    offsets.record_gaps(cur, pipeline, txid, starts)
    heads = dict(starts.heads)
    for partition, held in pipeline.source.held_back(cur, starts.offsets).items():
        if held < starts.heads.get(partition, held):
            log.warning("BEGIN pipeline=%s txid=%d: partition %d is read up to offset %d "
                        "only, not its head %d: the source refuses what follows for now "
                        "(`onceflow status` says why)", pipeline.name, txid, partition, held,
                        starts.heads[partition])
            starts.heads[partition] = held
    ranges = plan_ranges(starts.offsets, starts.heads, size, groups,
                         max_per_partition=pipeline.max_per_partition, keep=starts.keep())
    units = pipeline.source.whole_units(cur, [(r.partition, r.end) for r, _ in ranges
                                              if r.size and r.end < starts.heads[r.partition]])
    if units:  # a partition that had no records in the previous batch must not wait again
        previous = {r.partition for r, _ in txlog.read_ranges(cur, pipeline.name, txid - 1)
                    if r.size} if txid > 1 else set(units)
        ranges = align_to_units(ranges, units, starts.heads, size,
                                max_per_partition=pipeline.max_per_partition,
                                keep=starts.keep(),
                                protected=frozenset(p for p in units if p not in previous))
    ends = dict(starts.offsets)
    for r, _ in ranges:
        ends[r.partition] = max(ends.get(r.partition, r.end), r.end)
    backlog = sum(max(0, head - ends[p]) for p, head in heads.items() if p in ends)
    return ranges, backlog


def _describe(ranges) -> str:
    return " ".join(f"p{r.partition}:[{r.start},{r.end})" for r, _ in ranges) or "(nothing new)"


def _arrivals(cur, pipeline: Pipeline, txid: int, ranges) -> None:
    """Record when the batch's oldest and newest records arrived (each range's first and
    last record: a few lookups)."""
    points = [pt for r, _ in ranges if r.size for pt in ((r.partition, r.start),
                                                          (r.partition, r.end - 1))]
    found = pipeline.source.arrivals(cur, points).values() if points else ()
    txlog.store_arrivals(cur, pipeline.name, txid, min(found, default=None),
                         max(found, default=None))


def _begin_new(cur, pipeline: Pipeline, run_id: str, coordinator: txlog.Coordinator,
               lease: tuple[int, str], split: timings.Split,
               skip_empty: bool = False, least: int = 0) -> Batch | None:
    """A new txid, unless nothing (``skip_empty``) or fewer than ``least`` records (replays
    counted) would be read."""
    pending = txlog.uncommitted(cur, pipeline.name)
    if len(pending) >= pipeline.max_pending:
        raise MaxPendingReached(
            f"max_pending={pipeline.max_pending} reached for {pipeline.name}: txids "
            f"{', '.join(map(str, pending))} are uncommitted; no new transaction is planned "
            "until one commits")
    txid = coordinator.next_txid
    if least:  # what a plan too small to take would have claimed and recorded is undone
        cur.execute("SAVEPOINT onceflow_least")
    # Backflow first: the to-queue (swapped in if it ran dry), up to replay_cap, then eden.
    backflow.maybe_swap(cur, pipeline.name)
    replayed = backflow.claim(cur, pipeline.name, txid, pipeline.replays_per_batch,
                              pipeline.groups)
    ranges, backlog = _plan(cur, pipeline, coordinator, pipeline.groups, txid, None,
                            size=pipeline.batch_size - replayed)
    if skip_empty and not replayed and not ranges:  # (an empty range keeps a decided start)
        return None
    if replayed + sum(r.size for r, _ in ranges) < least:
        cur.execute("ROLLBACK TO SAVEPOINT onceflow_least")
        return None
    ta = txlog.insert(cur, pipeline.name, txid, run_id, groups=pipeline.groups,
                      records=sum(r.size for r, _ in ranges), replayed=replayed,
                      lease_s=lease[0], holder=lease[1], backlog=backlog)
    txlog.store_ranges(cur, pipeline.name, txid, pipeline.topic, ranges)
    _arrivals(cur, pipeline, txid, ranges)
    batch = Batch(pipeline.name, ta, tuple(ranges), pipeline.groups, replayed=replayed)
    figures = split.figures()
    txlog.record_begin(cur, pipeline.name, ta, figures)
    log.info("BEGIN pipeline=%s txid=%d attempt=1 run=%s records=%d replayed=%d ranges=%s %s",
             pipeline.name, txid, run_id, batch.records, replayed, _describe(ranges),
             timings.describe(figures))
    return batch


def _reattempt(cur, pipeline: Pipeline, run_id: str, txid: int,
               coordinator: txlog.Coordinator, why: str, lease: tuple[int, str],
               split: timings.Split) -> Batch:
    current = txlog.load_batch(cur, pipeline.name, txid)
    if current.committed:
        txlog.map_run(cur, pipeline.name, run_id, txid)
        log.info("BEGIN pipeline=%s txid=%d is committed already (%s): run %s has nothing to do",
                 pipeline.name, txid, why, run_id)
        return current
    ta, old_state = txlog.new_attempt(cur, pipeline.name, txid, run_id, lease_s=lease[0],
                                      holder=lease[1])
    delete_staging(cur, pipeline.name, txid)  # older attempts' staging can never commit
    # A transactional batch never changes, unless retention deleted part of it: then the
    # out_of_range policy re-plans it like an opaque one (and records the gap).
    replanned = ((pipeline.mode == "opaque" or _lost_to_retention(cur, pipeline, current))
                 and _replan(cur, pipeline, txid, coordinator, current))
    batch = txlog.load_batch(cur, pipeline.name, txid)
    figures = split.figures()
    txlog.record_begin(cur, pipeline.name, ta, figures)
    log.info("BEGIN pipeline=%s txid=%d attempt=%d run=%s (%s, was %s%s) records=%d ranges=%s "
             "%s", pipeline.name, txid, ta.attempt, run_id, why, old_state,
             ", re-planned" if replanned else "", batch.records, _describe(batch.ranges),
             timings.describe(figures))
    return batch


def _lost_to_retention(cur, pipeline: Pipeline, batch: Batch) -> bool:
    positions = pipeline.source.positions(cur)
    return any(r.size and r.start < positions[r.partition].log_start
               for r, _ in batch.ranges if r.partition in positions)


def _replan(cur, pipeline: Pipeline, txid: int, coordinator: txlog.Coordinator,
            current: Batch) -> bool:
    """Plan ``txid`` again from where txid - 1 ends. Returns True if it changed; then every
    later uncommitted txid is superseded and its backflow claims released."""
    old = list(current.ranges)
    new, backlog = _plan(cur, pipeline, coordinator, current.groups, txid, txid, old,
                         size=pipeline.batch_size - current.replayed)
    if new == old:
        return False
    txlog.store_ranges(cur, pipeline.name, txid, pipeline.topic, new, backlog=backlog)
    _arrivals(cur, pipeline, txid, new)
    txlog.count_replan(cur, pipeline.name, txid)
    superseded = txlog.supersede_after(cur, pipeline.name, txid, f"txid {txid} was re-planned")
    for ta in superseded:
        delete_staging(cur, pipeline.name, ta.txid)
    backflow.release_claims(cur, pipeline.name, [ta.txid for ta in superseded])
    log.warning("REPLAN pipeline=%s txid=%d: %s -> %s; superseded txids %s", pipeline.name,
                txid, _describe(old), _describe(new),
                ", ".join(str(ta.txid) for ta in superseded) or "none")
    return True


def mark_failed(conn, pipeline: str, ta: TransactionAttempt, reason: str,
                permanent: bool = False) -> bool:
    """Mark ``ta``'s transaction failed, so the next run adopts it (``permanent``: once the
    cause is fixed, see txlog.mark_failed). Fenced: only the current, uncommitted attempt can
    be marked. Returns whether it was."""
    with transaction(conn) as cur:
        marked = txlog.mark_failed(cur, pipeline, ta, reason, permanent)
    if marked:
        log.warning("FAILED pipeline=%s %s: %s", pipeline, ta, reason)
    return marked


__all__ = ["Batch", "MaxPendingReached", "NothingToPlan", "TransactionAttempt", "TxState", "begin",
           "mark_failed"]
