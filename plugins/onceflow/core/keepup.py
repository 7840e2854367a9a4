"""Keeping up: when a pipeline's next run should start, from a cheap look at its coordinator
and its source. The source watcher (onceflow.airflow.triggers.source_watch, in the triggerer) looks
every ``watch_interval`` seconds and fires an event per run to start; docs/keep-up.md is the
user's side.

**A look** (``look``) is one statement on the coordinator (how many begins ran, the open
transactions, whether one is ready for adoption, the backflow's unclaimed replays, and per
partition where the next batch starts: the committed offset or the end of an open plan,
whichever is further) and the source's heads (``Source.heads``: the catalog's row per
partition; a landing folder adds a listing of its folder, a table source its sequence). Only
when records wait is the oldest one's arrival looked up (``Source.arrivals``, by its
position). No Spark, no file is read, nothing is indexed.

**The decision** (``Watch.decide``), Storm's coordinator with onceflow's begin:

- records no transaction planned start a run once ``min_records`` of them wait, or once the
  oldest has waited ``max_delay``; with a backlog, one run per look until ``max_pending``
  transactions are open, so a backlog drains in full batches with ``max_pending`` in flight;
- a transaction waiting for adoption (failed, superseded, abandoned by a dead run) starts a
  run, a failed one after a back-off (15 s, doubling with each attempt, at most 10 min); a
  permanent failure waits for a person (``onceflow status`` says what to fix);
- a partition whose start the start policy still has to decide (``latest``, ``timestamp:``)
  starts one run, which records it;
- replays waiting in the backflow start a run as records do;
- caught up: nothing.

**Standby runs.** A keep-up DAG lets ``WAITING_RUNS`` times ``max_pending`` runs more than
``max_pending`` be active (``max_runs``): they wait in their begin for a place and plan the
moment a transaction commits (woken by its announcement), so a commit is followed by a plan
at once, not after the watcher's next look, the scheduler's next loop and a task's start.
The watcher keeps them there while records wait: it counts the DAG's active runs (``Runs``,
from the triggerer) and asks for one more while fewer than ``max_runs`` are active and the
records that no run will read start a batch. Airflow makes one run of the events that wait
for the scheduler, and none while the DAG has ``max_active_runs`` active, so the watcher has
one event outstanding at a time, settled when the DAG's runs grew, and asks for the next
as soon as it is (no spacing). It also looks at once when a transaction of the pipeline
commits. Runs are made no faster than one per scheduler loop, so a run of the one-task DAG
that committed carries on with the next batch while ``min_records`` wait (or, while records
keep arriving, waits for them by this rule) and no run waits in its begin
(onceflow.airflow.operators.transaction.TransactionOperator): the watcher counts it, between
its commit and its next begin, as a run still to plan.

Without the run count (a trigger run outside a triggerer), an event is *outstanding* until a
begin ran after it (``pipelines.begins`` grew), or for four times the usual wait from an
event to its begin (10 to 60 s): Airflow turns the events that arrive before the scheduler
created their run into one run, so an event may start no run of its own. Two events are
``SPACING_S`` apart at least, which leaves the scheduler a loop between them. The records
the outstanding events' runs will read (a batch each) are not counted again, so a trickle
starts one run at a time and never a run that finds nothing (a begin that does anyway,
because a manual run took the records, ends without a txid: onceflow.core.begin's ``skip_empty``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from onceflow.core import offsets
from onceflow.core.pipeline import Pipeline
from onceflow.core.source import forget_sightings, record_sightings

# How long an event stays outstanding: four times the usual wait from an event to its begin,
# within these bounds, so that a slow start on a loaded machine is not taken for a lost event.
MIN_TTL_S, MAX_TTL_S = 10.0, 60.0
# Two events are this far apart at least: the scheduler makes one run of the events it finds
# at once, and it looks for them about every second.
SPACING_S = 2.0
# Runs waiting in their begin per place in flight, in a keep-up DAG: a run that committed
# stays active until its task ended and the scheduler saw it, and a new one takes a scheduler
# loop and a task's start before it waits, so a wave of commits can use them all.
WAITING_RUNS = 2
# A failed transaction is adopted after this back-off, doubled for each attempt it had.
RETRY_BACKOFF_S = 15
MAX_BACKOFF_S = 600

_LOOK = """
SELECT now(), p.begins,
       (SELECT count(*) FROM transactions t
        WHERE t.pipeline = p.name AND t.state <> 'committed'),
       EXISTS (SELECT 1 FROM transactions t
               LEFT JOIN transaction_attempts a
                 ON a.pipeline = t.pipeline AND a.txid = t.txid AND a.attempt = t.attempt
               WHERE t.pipeline = p.name AND t.state <> 'committed' AND t.committed_at IS NULL
                 AND (t.state = 'superseded'
                      OR (t.state = 'planned'
                          AND t.heartbeat_at < now() - make_interval(secs => t.lease_s))
                      OR (t.state = 'failed' AND NOT coalesce(a.permanent, false)
                          AND coalesce(a.ended_at, t.heartbeat_at) < now() - make_interval(
                              secs => least(%(max_backoff)s,
                                            %(backoff)s * 2 ^ least(t.attempt - 1, 10)))))),
       (SELECT count(*) FROM backflow_items b
        WHERE b.pipeline = p.name AND b.claimed_txid IS NULL),
       (SELECT EXTRACT(EPOCH FROM now() - min(b.queued_at)) FROM backflow_items b
        WHERE b.pipeline = p.name AND b.claimed_txid IS NULL),
       (SELECT coalesce(json_object_agg(r.partition, r.resume), '{}') FROM (
            SELECT x.partition, max(x.resume) AS resume FROM (
                SELECT po.partition, po."offset" AS resume FROM partition_offsets po
                WHERE po.pipeline = p.name
                UNION ALL
                SELECT br.partition, br.end_offset FROM transactions t
                JOIN batch_ranges br ON br.pipeline = t.pipeline AND br.txid = t.txid
                WHERE t.pipeline = p.name AND t.state IN ('planned', 'failed')
                  AND t.txid > p.reset_after_txid) x
            GROUP BY x.partition) r)
FROM pipelines p WHERE p.name = %(pipeline)s
"""


def max_runs(pipeline: Pipeline) -> int:
    """The active runs a keep-up DAG allows (its ``max_active_runs``): ``max_pending`` in
    flight and WAITING_RUNS times as many waiting in their begin for a place (see the module
    docstring)."""
    return (1 + WAITING_RUNS) * pipeline.max_pending


@dataclass(frozen=True)
class Runs:
    """The DAG's runs, as Airflow counts them: ``active`` (queued or running), ``total``."""

    active: int
    total: int


@dataclass(frozen=True)
class Look:
    """What a look saw (see the module docstring)."""

    now: datetime  # the database's clock
    begins: int
    open: int  # transactions not committed
    adopt: bool  # one is ready for the next run to adopt
    unread: int  # records no transaction planned (files not indexed yet: estimated)
    oldest_wait_s: float | None  # how long the oldest of them has waited (None: unknown)
    replays: int  # failed records waiting in the backflow, not claimed
    replay_wait_s: float | None
    undecided: bool  # a partition's start is still for the start policy to decide
    heads: dict[int, int] = field(default_factory=dict)


def look(cur, pipeline: Pipeline, seen: dict[int, int] | None = None) -> Look | None:
    """A look at ``pipeline`` (None: it is not initialised: no begin ran yet). ``seen``: the
    heads of the previous look; for a source that keeps no arrival time, new heads are
    recorded as sightings (the arrival of their records)."""
    cur.execute(_LOOK, {"pipeline": pipeline.name, "backoff": RETRY_BACKOFF_S,
                        "max_backoff": MAX_BACKOFF_S})
    row = cur.fetchone()
    if row is None:
        return None
    now, begins, open_, adopt, replays, replay_wait, resume = row
    resume = {int(p): int(o) for p, o in resume.items()}
    source = pipeline.source
    positions = source.heads(cur)
    heads = {p: pos.head for p, pos in positions.items()}
    if source.arrival_by_sight and heads != (seen or {}):
        record_sightings(cur, pipeline.topic, heads)
    starts, undecided = {}, False
    for partition, position in positions.items():
        start = resume.get(partition)
        if start is None and pipeline.start_policy == "earliest":
            start = position.log_start
        if start is None or start < position.log_start:
            undecided = True  # the start policy or out_of_range decides: a begin records it
            continue
        starts[partition] = start
    held = source.held_back(cur, starts) if starts else {}
    unread, points = 0, []
    for partition, start in starts.items():
        head = min(heads[partition], held.get(partition, heads[partition]))
        if head > start:
            unread += head - start
            points.append((partition, start))
    arrived = list(source.arrivals(cur, points).values()) if points else []
    more, oldest_unindexed = source.unindexed(cur)
    unread += more
    if oldest_unindexed is not None:
        arrived.append(oldest_unindexed)
    oldest = min(arrived, default=None)
    return Look(now, int(begins), int(open_), bool(adopt), unread,
                max(0.0, (now - oldest).total_seconds()) if oldest is not None else None,
                int(replays), float(replay_wait) if replay_wait is not None else None,
                undecided, heads)


def prune_sightings(cur, pipeline: Pipeline) -> None:
    """Forget the sightings every pipeline on the topic has committed past."""
    if not pipeline.source.arrival_by_sight:
        return
    by_pipeline = offsets.committed_by_pipeline(cur, pipeline.topic)
    if not by_pipeline or any(not done for done in by_pipeline.values()):
        return
    parts = set.intersection(*(set(done) for done in by_pipeline.values()))
    forget_sightings(cur, pipeline.topic,
                     {p: min(done[p] for done in by_pipeline.values()) for p in parts})


@dataclass
class Watch:
    """The watcher's memory between looks: the events still outstanding (see the module
    docstring). ``clock``: monotonic seconds (a test gives its own)."""

    pipeline: Pipeline
    clock: Any = time.monotonic
    spacing_s: float = SPACING_S
    outstanding: deque = field(default_factory=deque)  # when each was fired
    begins: int | None = None
    fired: int = 0
    last_fired: float | None = None
    start_wait_s: float | None = None  # the usual wait from an event to its begin
    unread_since: float | None = None  # since when records wait (their arrival unknown)
    max_runs: int | None = None  # the DAG's max_active_runs (default: keepup.max_runs)
    runs: Runs | None = None  # the DAG's runs at the last look, when the triggerer told

    @property
    def ttl_s(self) -> float:
        if self.start_wait_s is None:
            return MAX_TTL_S
        return min(MAX_TTL_S, max(MIN_TTL_S, 4 * self.start_wait_s))

    def _settle(self, seen: Look | None, runs: Runs | None) -> None:
        now = self.clock()
        if runs is not None and self.runs is not None:
            for _ in range(min(len(self.outstanding), max(0, runs.total - self.runs.total))):
                self._started(now)  # Airflow created a run: the event was taken
        if runs is not None:
            self.runs = runs
        if seen is None:
            self.begins = 0  # not initialised: no begin ran yet
        else:
            if self.begins is not None and runs is None:
                for _ in range(min(len(self.outstanding), max(0, seen.begins - self.begins))):
                    self._started(now)  # a begin ran: its run started
            self.begins = seen.begins
            if seen.unread <= 0:
                self.unread_since = None
            elif self.unread_since is None:
                self.unread_since = now
        while self.outstanding and now - self.outstanding[0] > self.ttl_s:
            self.outstanding.popleft()

    def _started(self, now: float) -> None:
        waited = now - self.outstanding.popleft()
        self.start_wait_s = waited if self.start_wait_s is None \
            else 0.7 * self.start_wait_s + 0.3 * waited

    def decide(self, seen: Look | None, runs: Runs | None = None) -> str | None:
        """Why a run should start now (the event's reason), or None. Each reason given is an
        event the caller fires. ``runs``: the DAG's runs now (None: not known)."""
        self._settle(seen, runs)
        now = self.clock()
        # (with the run count an event is outstanding until its run was made: no spacing)
        if runs is None and self.last_fired is not None \
                and now - self.last_fired < self.spacing_s:
            return None
        why = self._why(seen) if runs is None else self._why_with_runs(seen, runs)
        if why is not None:
            self.outstanding.append(now)
            self.last_fired = now
            self.fired += 1
        return why

    def _why(self, seen: Look | None) -> str | None:
        p = self.pipeline
        waiting = len(self.outstanding)
        if seen is None:  # not initialised: a first run registers it
            return None if waiting else "initialise"
        if seen.adopt and not waiting:
            return "adopt"
        if seen.open + waiting >= p.max_pending:
            return None
        return self._wanted(seen, waiting)

    def _why_with_runs(self, seen: Look | None, runs: Runs) -> str | None:
        """``_why`` when the DAG's runs are known: up to ``max_runs`` active, the runs that
        planned nothing yet each counted as reading a batch (see the module docstring)."""
        p = self.pipeline
        if self.outstanding:  # Airflow would fold a second event into the first's run
            return None
        if seen is None:
            return None if runs.active else "initialise"
        if runs.active >= (self.max_runs or max_runs(p)):
            return None
        unplanned = max(0, runs.active - seen.open)  # runs still to plan (or to adopt)
        if seen.adopt and not unplanned:
            return "adopt"
        return self._wanted(seen, unplanned)

    def _wanted(self, seen: Look, pending: int) -> str | None:
        """Whether what ``seen`` shows wants a run, ``pending`` runs being on their way (each
        reads up to a batch, so their records are not counted again)."""
        p = self.pipeline
        if seen.undecided and not pending:
            return "start"
        unread = seen.unread - pending * p.batch_size
        if unread >= p.batch_start_records:
            return "backlog" if unread >= p.batch_size else "records"
        waited = seen.oldest_wait_s
        if waited is None and self.unread_since is not None:  # arrival unknown: since seen
            waited = self.clock() - self.unread_since
        if unread > 0 and waited is not None and waited >= p.max_delay_s:
            return "delay"
        if seen.replays and not pending and seen.unread <= 0 and (
                seen.replays >= p.batch_start_records
                or (seen.replay_wait_s or 0.0) >= p.max_delay_s):
            return "replays"
        return None


# The watcher writes what it did at most this often (and at each event), so that a look stays
# one read; status calls it gone after STALE_LOOKS looks missed (STALE_MIN_S at least).
RECORD_EVERY_S = 5.0
STALE_LOOKS, STALE_MIN_S = 5, 20.0


def record_watch(cur, pipeline: Pipeline, holder: str, seen: Look | None, runs: Runs | None,
                 max_runs_: int, event: str | None = None) -> None:
    """Record the watcher's last look (and ``event``: the reason of the event it fired) for
    ``watcher_state``. The database's clock times it."""
    waiting = max(0, runs.active - seen.open) if runs is not None and seen is not None else None
    cur.execute("""
        INSERT INTO source_watchers AS w (pipeline, holder, watch_interval, looked_at,
                                          event_at, event_reason, runs_active, runs_waiting,
                                          max_runs)
        VALUES (%(p)s, %(holder)s, %(interval)s, now(),
                CASE WHEN %(event)s::text IS NOT NULL THEN now() END, %(event)s, %(active)s,
                %(waiting)s, %(max_runs)s)
        ON CONFLICT (pipeline) DO UPDATE SET
            holder = EXCLUDED.holder, watch_interval = EXCLUDED.watch_interval,
            looked_at = EXCLUDED.looked_at,
            event_at = coalesce(EXCLUDED.event_at, w.event_at),
            event_reason = coalesce(EXCLUDED.event_reason, w.event_reason),
            runs_active = EXCLUDED.runs_active, runs_waiting = EXCLUDED.runs_waiting,
            max_runs = EXCLUDED.max_runs""",
                {"p": pipeline.name, "holder": holder, "interval": pipeline.watch_interval,
                 "event": event, "active": runs.active if runs is not None else None,
                 "waiting": waiting, "max_runs": max_runs_})


def watcher_state(cur, pipeline: str, watch_interval: float) -> dict[str, Any]:
    """What status and the view say of a keep-up pipeline's watcher: ``looked_s_ago``,
    ``holder`` (the triggerer's host and pid), ``event_s_ago`` and ``event_reason``, the
    DAG's ``runs_active`` of ``max_runs`` and ``runs_waiting`` (active runs that planned
    nothing yet: waiting for a place, or to start), ``running`` (whether a triggerer runs
    it: it looked within STALE_LOOKS looks), and ``fix`` when none does."""
    cur.execute("""SELECT holder, EXTRACT(EPOCH FROM now() - looked_at),
                          EXTRACT(EPOCH FROM now() - event_at), event_reason, runs_active,
                          runs_waiting, max_runs
                   FROM source_watchers WHERE pipeline = %s""", (pipeline,))
    row = cur.fetchone()
    stale_s = max(STALE_MIN_S, STALE_LOOKS * watch_interval)
    fix = ("start Airflow's triggerer (`airflow triggerer`, beside the scheduler; "
           "docs/operations.md#restarting-a-component): it runs the watcher, which starts "
           "the runs")
    if row is None:
        return {"running": False, "looked_s_ago": None, "holder": None, "event_s_ago": None,
                "event_reason": None, "runs_active": None, "runs_waiting": None,
                "max_runs": None, "fix": "no watcher has looked yet: " + fix}
    holder, looked, event, reason, active, waiting, most = row
    looked = round(float(looked), 1)
    running = looked <= stale_s
    return {"running": running, "looked_s_ago": looked, "holder": holder,
            "event_s_ago": round(float(event), 1) if event is not None else None,
            "event_reason": reason, "runs_active": active, "runs_waiting": waiting,
            "max_runs": most,
            "fix": "-" if running else f"no triggerer runs the watcher (its last look was "
                                       f"{looked:.0f}s ago, by {holder}): {fix}"}


def watcher_line(state: dict[str, Any]) -> str:
    """``watcher_state`` in one line of `onceflow status`."""
    if not state.get("running"):
        return f"watcher: NOT RUNNING: {state['fix']}"
    event = (f"last event {state['event_s_ago']:.0f}s ago ({state['event_reason']})"
             if state.get("event_s_ago") is not None else "no event yet")
    runs = (f"; runs {state['runs_active']} of {state['max_runs']} active, "
            f"{state['runs_waiting']} not planned yet (waiting for a place or to start)"
            if state.get("runs_active") is not None else "")
    return (f"watcher: last look {state['looked_s_ago']:.0f}s ago in the triggerer "
            f"({state['holder']}), {event}{runs}")
