"""`onceflow verify`: is the committed state exactly what the committed batches imply?

**Re-run** (the default; needs no code from the user): the pipeline's own topology runs again,
in Spark, over everything each committed txid read (its planned ranges and the backflow items
it replayed, with the replay count they had), and the result is compared with:

- every state table, key by key: ``value`` (the sum over txids), ``prev_value`` (the value
  before the key's last txid) and ``txid`` (its last txid);
- the rejected records (the same positions);
- the failed records: each is waiting in a backflow queue, is a dead letter, or was replayed
  by a later committed txid (a parked record the re-run no longer fails is a note).

A try of a record that its commit failed (a later committed txid replayed it, or it is parked)
is compared as failed, whatever the re-run does with it: once its cause is fixed (a type
widened) and it is replayed, the record counts once, where it committed. A txid whose records
cannot be read again (a landed chunk edited in place) is reported with the reason in one line
(its Spark job is split in halves until it is alone) and the others are still checked.

Batches whose records retention deleted cannot run again: then the check is partial (for a
key last written by a batch that re-ran, ``value - prev_value`` equals that batch's delta, and
no re-run batch after it touched the key), and the report says how many txids it covered.
States fed by stateful bolts depend on key-value state and are left to ``--recount``.
Each txid's commit recorded what it added to each count state (batch_contributions: keys,
sum of deltas, digest); the re-run's are compared with them too.

**Range** (``txids=(A, B)``; the CLI's ``--txids A..B`` and ``--last N``): only txids A..B
run again (their ranges and replays, nothing else is read), and:

- each one's contribution to each count state equals what its commit recorded (so the
  commit applied exactly what its batch implies, whatever came later);
- each key a re-run txid writes holds that txid or a later one; each key last written by a
  txid of the range is written by its re-run and (opaque) holds value - prev_value = its
  delta; a typed state likewise (an opaque one: previous values combined with the batch; an
  append table: its rows of A..B as a multiset);
- rejects of A..B, and where each record A..B fails went;
- then, without reading any record, every count state's table against every recorded
  contribution (sum(value) and sum(key_weight(key) * value) in SQL, one pass): a change no
  commit made, anywhere. When the range's own checks are clean, that mismatch is reported as
  outside the range (the range's batches do not explain it).

State is cumulative: a range check does not prove the values before A (a key's prev_value
is taken as it is), nor what txids outside A..B added (their recorded contributions are
trusted; a check of their range proves them).

**Recount** (``--recount``): the pipeline's independent recount function
(``Pipeline.recompute``) over every record below the committed offsets: committed state +
rejects + queued + dead letters == the source. Records retention deleted after they were
committed are accounted for by what retention summed before deleting them (retired_counts);
ranges a policy skipped (offset_gaps) were never read and are left out.
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from onceflow.core import backflow, offsets, rejects, tables, txlog
from onceflow.core import state_tables as state_tables
from onceflow.core.db import connect
from onceflow.core.errors import ConfigError, SparkServerGone
from onceflow.core.pipeline import Pipeline
from onceflow.core.planner import PartitionRange
from onceflow.core.registration import external_dsn
from onceflow.ops import retention
from onceflow.spark.ids import MAX_OFFSET, MAX_PARTITION, OFFSET_BITS

Progress = Callable[[str], None]


@dataclass
class VerifyReport:
    pipeline: str
    mode: str  # "re-run" | "recount"
    txids: int = 0  # committed txids (of the range)
    txids_checked: int = 0  # re-run (the others lost records to retention)
    records: int = 0
    replays: int = 0
    rejected_expected: int = 0
    rejected_committed: int = 0
    failed: int = 0
    queued: int = 0
    dead: int = 0
    keys: dict[str, int] = field(default_factory=dict)
    skipped_states: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)  # what is printed: 5 a kind, "N more"
    found: int = 0  # mismatches found, the ones "N more" stands for included
    span: tuple[int, int] | None = None  # a range check: the txids re-run, first..last
    committed: tuple[int, int] = (0, 0)  # the committed txids after the last reset
    contributions: int = 0  # committed txids whose recorded contributions were compared
    totals: str = ""  # a range check: the state tables against every recorded contribution
    outside: int = 0  # mismatches (of ``found``) that the range's batches do not explain
    unreadable: dict[int, str] = field(default_factory=dict)  # txid: why it could not re-run
    failed_before: int = 0  # re-run records their commit failed (compared as failed)
    notes: list[str] = field(default_factory=list)  # printed, but no mismatch

    @property
    def ok(self) -> bool:
        return not self.found and not self.mismatches and not self.unreadable

    def add(self, found: list[str], limit: int = 5, *, outside: bool = False) -> None:
        """Keep ``found`` (mismatches of one kind): the first ``limit`` to print, then how
        many more; every one counts in the summary. ``outside``: not in what the range's
        batches added."""
        self.found += len(found)
        self.outside += len(found) if outside else 0
        self.mismatches += (found if len(found) <= limit
                            else found[:limit] + [f"... and {len(found) - limit} more"])

    @property
    def partial(self) -> bool:
        return self.txids_checked < self.txids

    def _verdict(self) -> str:
        if self.ok:
            return "OK"
        if not self.found and not self.mismatches:
            return f"INCOMPLETE ({self._unread()})"
        if self.unreadable:
            return f"FAILED ({_count(self.found, 'mismatch')}; {self._unread()})"
        if self.span is None:
            return f"FAILED ({self.found} mismatches)"
        inside, txids = self.found - self.outside, f"txids {self.span[0]}..{self.span[1]}"
        if not inside:
            return (f"{txids} OK, FAILED outside them ({_count(self.outside, 'mismatch')} in "
                    "the state tables that no re-run batch explains)")
        return (f"FAILED ({_count(inside, 'mismatch')} in {txids}"
                + (f", {self.outside} the range does not explain)" if self.outside else ")"))

    def _unread(self) -> str:
        return f"{_count(len(self.unreadable), 'txid')} could not be re-read"

    def line(self) -> str:
        verdict = self._verdict()
        states = ", ".join(f"{name} {n} keys" for name, n in self.keys.items()) or "no state"
        if self.mode == "recount":
            return (f"verify {self.pipeline} (recount): {verdict}: "
                    f"{self.records + self.queued + self.dead} source records = "
                    f"{self.records} committed ({states}; {self.rejected_committed} rejected, "
                    f"expected {self.rejected_expected}) + {self.queued} queued for replay + "
                    f"{self.dead} dead letters")
        what = "committed txids re-run"
        if self.span is not None:
            what = (f"committed txids re-run of {self.committed[0]}..{self.committed[1]}")
            states = ", ".join(f"{name} {n} keys read" for name, n in self.keys.items())
        gone = self.txids - self.txids_checked - len(self.unreadable)
        why = ", ".join(filter(None, [
            f"{gone} lost their records to retention" if gone else "",
            f"{len(self.unreadable)} could not be re-read" if self.unreadable else ""]))
        cover = (f"{self.txids_checked} of {self.txids} {what} ({why}: partial check)"
                 if self.partial else f"{self.txids} {what}")
        skipped = (f"; not checked (stateful bolts): {', '.join(self.skipped_states)}"
                   if self.skipped_states else "")
        head = "re-run" if self.span is None else f"re-run of txids {self.span[0]}..{self.span[1]}"
        tail = ""
        if self.contributions:
            tail += (f"; recorded contributions of {self.contributions} txids compared")
        if self.totals:
            tail += f"; state totals: {self.totals}"
        if self.failed_before:
            tail += (f"; {self.failed_before} tries of records their commit failed and a "
                     "later txid replayed, compared as failed")
        return (f"verify {self.pipeline} ({head}): {verdict}: {cover}, {self.records} records "
                f"+ {self.replays} replays; {states}; {self.rejected_committed} rejected "
                f"(expected {self.rejected_expected}); {self.failed} failed: {self.queued} "
                f"queued, {self.dead} dead letters, the rest replayed later{skipped}{tail}")


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "es" if what.endswith("h") else "s")


def _read_states(conn, pipeline: Pipeline, state_dsns: Mapping[str, str] | None,
                 reader=state_tables.read_rows) -> dict[str, dict]:
    """Every state table: ``reader(cur, spec)`` for a count state, its rows for a typed one."""
    return _each_state(conn, pipeline, state_dsns, lambda cur, spec: (
        tables.read_table(cur, spec.shape(), spec.opaque) if spec.typed else reader(cur, spec)))


def _each_state(conn, pipeline: Pipeline, state_dsns: Mapping[str, str] | None, read,
                specs=None) -> dict:
    """``read(cur, spec)`` of every state (of ``specs``), each in the database holding it."""
    states = {}
    for spec in pipeline.states if specs is None else specs:
        other = connect(external_dsn(spec, state_dsns)) if spec.conn_id else None
        try:
            with (other or conn).cursor() as cur:
                states[spec.name] = read(cur, spec)
            (other or conn).commit()
        finally:
            if other is not None:
                other.close()
    return states


# -- re-run ---------------------------------------------------------------------------------------
CHUNK_RECORDS = 500_000  # a re-run's Spark job reads at least this many records (or all)


def resolve_range(cur, pipeline: str, *, txids: tuple[int, int] | None = None,
                  last: int | None = None) -> tuple[int, int] | None:
    """The txids a range check re-runs: ``txids`` (first, last) as given, or the newest
    ``last`` committed ones (all of them when there are fewer); None for every committed
    txid. Raises ConfigError naming the flag, the value and the fix."""
    if txids is None and last is None:
        return None
    if txids is not None and last is not None:
        raise ConfigError(f"--txids {txids[0]}..{txids[1]} and --last {last} both given: give "
                          "one (--txids A..B re-runs txids A to B, --last N the newest N)")
    given = f"--last {last}" if txids is None else f"--txids {txids[0]}..{txids[1]}"
    first_c, last_c = txlog.committed_span(cur, pipeline)
    if last_c < first_c:
        raise ConfigError(f"{given}: pipeline {pipeline!r} has no committed txid"
                          + (" since its last `onceflow reset`" if first_c > 1 else " yet")
                          + ": nothing to verify until a transaction commits")
    if txids is None:
        return max(first_c, last_c - last + 1), last_c
    a, b = txids
    if a > b:
        raise ConfigError(f"{given}: the range ends before it starts: give A..B with A <= B "
                          f"(--txids {b}..{a})")
    if b > last_c:
        raise ConfigError(f"{given}: txid {b} is beyond the last committed txid {last_c} of "
                          f"pipeline {pipeline!r}: give --txids {min(a, last_c)}..{last_c}, "
                          "or --last N for the newest N")
    if a < first_c:
        raise ConfigError(f"{given}: txids up to {first_c - 1} of pipeline {pipeline!r} were "
                          "committed before its last `onceflow reset` and are not re-run: "
                          f"start at {first_c} (--txids {first_c}..{b})")
    return a, b


def _rounds(replays: list[tuple]) -> list[list[tuple]]:
    """Replays split so that a record appears at most once per round (a record replayed by
    several txids would otherwise share one root id in one Spark job)."""
    seen: Counter = Counter()
    rounds: list[list[tuple]] = []
    for row in replays:
        n = seen[(row[1], row[2])]
        seen[(row[1], row[2])] += 1
        while len(rounds) <= n:
            rounds.append([])
        rounds[n].append(row)
    return rounds


def _chunks(intact: list[tuple[int, PartitionRange]], least: int
            ) -> list[list[tuple[int, PartitionRange]]]:
    """The committed ranges in txid order, cut at txid boundaries into about ten parts of at
    least ``least`` records: a Spark job each, so progress is told as they end."""
    total = sum(r.size for _, r in intact)
    target = max(least, -(-total // 10))
    out: list[list[tuple[int, PartitionRange]]] = [[]]
    size = 0
    for _, group in itertools.groupby(intact, key=lambda item: item[0]):
        if size >= target:
            out.append([])
            size = 0
        group = list(group)
        out[-1] += group
        size += sum(r.size for _, r in group)
    return [chunk for chunk in out if chunk]


MAX_UNREADABLE = 10  # txids told apart; past it, a failing job's txids are reported whole


@dataclass
class _Job:
    """One Spark job of a re-run: ``items`` (txid first) are what it reads; ``again`` makes
    the same job over some of them."""

    source: Callable
    txid_of: Callable[[int, int], int]
    label: str
    size: int  # records of the source it reads
    items: list[tuple]
    again: Callable[[list[tuple]], _Job]


def one_line(error: BaseException) -> str:
    """A Spark job's failure in one line: the innermost cause a JVM or Python traceback
    names (a refusal of onceflow's reader names the file, the chunk and the fix), without
    its frames."""
    text = str(error)
    causes = re.findall(r"(?m)^\s*(?:Caused by: )?(?:[\w$]+\.)*([A-Z][\w$]*"
                        r"(?:Exception|Error|Changed|Shortfall)): (\S[^\n]*)$", text)
    ours = [c for c in causes if "onceflow" in c[1] or c[0] in ("SourceChanged",
                                                                  "SourceShortfall")]
    name, message = (ours or causes or [(type(error).__name__, text.strip() or "-")])[-1]
    message = " ".join(message.split("JVM stacktrace:")[0].split())
    return f"{name}: {message}"[:400]


def _run(pipeline: Pipeline, topology, source, txid_of, failed_before=None):
    """Run the topology over ``source``; map each output to its txid with
    ``txid_of(partition, offset)``. Returns (deltas {(state, key): {txid: delta}}, rejected
    positions, failures [(partition, offset, txid, error)], typed rows, how many records
    were left out). ``failed_before(partition, offset, txid)``: that try of the record
    failed in its commit (it was replayed later, or is parked), so its outputs are left out
    (a cause fixed since, e.g. a type widened, lets the re-run use it)."""
    # imported here: pyspark loads with it: only where Spark is used
    from onceflow.spark.runner import run_topology

    out = run_topology(topology, source, attempt=1, acker=pipeline.acker,
                       tuple_timeout_ms=pipeline.tuple_timeout_ms,
                       max_record_bytes=pipeline.source.max_record_bytes,
                       max_key_bytes=pipeline.max_key_bytes, by_root=True,
                       shapes={s.source_name: s.shape() for s in pipeline.typed_states()}
                       ).collect()

    left_out: set[tuple[int, int, int]] = set()

    def txid_of_root(root: int) -> int | None:
        """The root's txid, or None when its commit failed that try."""
        p, o = (root >> OFFSET_BITS) & MAX_PARTITION, root & MAX_OFFSET
        txid = txid_of(p, o)
        if failed_before is not None and failed_before(p, o, txid):
            left_out.add((p, o, txid))
            return None
        return txid

    deltas: dict[tuple[str, str], dict[int, int]] = {}
    for (state, key, root), delta in out.deltas.items():
        txid = txid_of_root(root)
        if txid is None:
            continue
        per = deltas.setdefault((state, key), {})
        per[txid] = per.get(txid, 0) + delta
    typed = {}
    for state, rows in out.tables.items():
        typed[state] = [(txid, row) for row in rows.to_pylist()
                        if (txid := txid_of_root(row.pop("root"))) is not None]
    failures = [(p, o, txid_of(p, o), error) for (p, o, _), error in out.failed.items()]
    return deltas, set(out.rejected), failures, typed, len(left_out)


def _range_lookup(intact: list[tuple[int, PartitionRange]]):
    """txid_of(partition, offset) for the committed ranges (they tile each partition)."""

    starts: dict[int, list[tuple[int, int, int]]] = {}
    for txid, r in intact:
        starts.setdefault(r.partition, []).append((r.start, r.end, txid))
    for spans in starts.values():
        spans.sort()
    keys = {p: [s for s, _, _ in spans] for p, spans in starts.items()}

    def txid_of(partition: int, offset: int) -> int:
        spans = starts[partition]
        start, end, txid = spans[bisect.bisect_right(keys[partition], offset) - 1]
        assert start <= offset < end, (partition, offset)
        return txid

    return txid_of


def rerun(conn, dsn: str, pipeline: Pipeline, spark, *,
          state_dsns: Mapping[str, str] | None = None, progress: Progress | None = None,
          txids: tuple[int, int] | None = None, chunk_records: int = CHUNK_RECORDS
          ) -> VerifyReport:
    """Re-run every committed txid, or with ``txids`` (first, last) those only (see the
    module docstring for what each proves); ``progress`` is told as each Spark job ends."""
    # imported here: pyspark loads with it: only where Spark is used
    from onceflow.spark.records import batch_records, replayed_records
    from onceflow.spark.session import ship_code

    say = progress or (lambda _: None)
    report = VerifyReport(pipeline.name, "re-run")
    with conn.cursor() as cur:
        report.committed = txlog.committed_span(cur, pipeline.name)
        span = resolve_range(cur, pipeline.name, txids=txids)
        first, last = span or report.committed
        report.span = span
        ranges = txlog.committed_ranges(cur, pipeline.name, first, last)
        committed = txlog.committed_txids(cur, pipeline.name, first, last)
        replays = backflow.committed_replays(cur, pipeline.name, first, last)
        # where a failed record of the range went: replayed by any later txid
        later = (backflow.committed_replays(cur, pipeline.name, first, payloads=False)
                 if span else replays)
        positions = pipeline.source.positions(cur)
        parked = {(p, o): kind for kind, p, o in backflow.parked(cur, pipeline.name)}
        rejected = rejects.positions(cur, pipeline.name, first, last)
        recorded = state_tables.contributions(cur, pipeline.name, first, last)
        since, sums = state_tables.contribution_sums(cur, pipeline.name)
    conn.commit()
    lost = {t for t, r in ranges
            if r.partition not in positions or r.start < positions[r.partition].log_start}
    report.txids, report.txids_checked = len(committed), len(set(committed) - lost)
    ship_code(pipeline.ref, pipeline.topology)
    topology, skipped = pipeline.build_topology().without_stateful()
    report.skipped_states = sorted(s.name for s in pipeline.states if s.source_name in skipped)
    intact = [(t, r) for t, r in ranges if t not in lost]
    replays = [r for r in replays if r[0] not in lost]
    total = sum(r.size for _, r in intact)
    what = f"txids {first}..{last}" if span else f"{report.txids_checked} committed txids"
    say(f"re-running {what}: {report.txids_checked} batches, {total} records, "
        f"{len(replays)} replays")
    expected: dict[tuple[str, str], dict[int, int]] = {}
    re_rejected: set[tuple[int, int]] = set()
    failures: list[tuple[int, int, int, str]] = []
    typed: dict[str, list[tuple[int, dict]]] = {}
    # A try of a record failed in its commit when a later committed txid replayed it, or
    # when it waits in a queue or as a dead letter: its outputs are compared as failed
    # (counted once, where it committed), whatever the code does with it now.
    tries: dict[tuple[int, int], int] = {}
    for t, p, o, *_ in later:
        tries[(p, o)] = max(t, tries.get((p, o), t))

    def failed_before(p: int, o: int, txid: int) -> bool:
        return (p, o) in parked or tries.get((p, o), 0) > txid

    def range_job(chunk: list[tuple[int, PartitionRange]]) -> _Job:
        return _Job(lambda: batch_records(spark, dsn, pipeline.source, [r for _, r in chunk]),
                    _range_lookup(chunk), f"txids {chunk[0][0]}..{chunk[-1][0]}",
                    sum(r.size for _, r in chunk), chunk, range_job)

    def replay_job(rows: list[tuple], label: str) -> _Job:
        mapping = {(p, o): t for t, p, o, _, _ in rows}
        return _Job(lambda: replayed_records(
            spark, pipeline.source, [(p, o, payload, n) for _, p, o, n, payload in rows]),
            lambda p, o: mapping[(p, o)], label, 0, rows,
            lambda part: replay_job(part, label))

    jobs = [range_job(chunk) for chunk in _chunks(intact, chunk_records)]
    for i, rows in enumerate(_rounds(replays)):
        jobs.append(replay_job(rows, f"replay round {i + 1}"))
        report.replays += len(rows)
    done = 0
    while jobs:
        job = jobs.pop(0)
        try:
            deltas, rej, failed, typed_rows, left_out = _run(
                pipeline, topology, job.source(), job.txid_of, failed_before)
        except (SparkServerGone, ConfigError):
            raise  # no txid is at fault: nothing could be checked
        except Exception as error:  # noqa: BLE001 (Spark's and the JVM's errors vary)
            why = one_line(error)
            txids = sorted({item[0] for item in job.items})
            if len(txids) == 1 or len(report.unreadable) >= MAX_UNREADABLE:
                for txid in txids:
                    report.unreadable[txid] = why
                say(f"{job.label}: could not be re-read ({why})")
                continue
            say(f"{job.label} could not be read ({why}): re-running them apart")
            # halves, until each txid that fails is alone: a few jobs more for one bad txid
            half = set(txids[:len(txids) // 2])
            jobs[:0] = [job.again([item for item in job.items if item[0] in half]),
                        job.again([item for item in job.items if item[0] not in half])]
            continue
        report.failed_before += left_out
        for state, rows in typed_rows.items():
            typed.setdefault(state, []).extend(rows)
        for key, per in deltas.items():
            into = expected.setdefault(key, {})
            for txid, delta in per.items():
                into[txid] = into.get(txid, 0) + delta
        re_rejected |= rej
        failures += failed
        done += job.size
        report.records += job.size
        say(f"{job.label} re-run: {done} of {total} records"
            + (f" ({100 * done // total}%)" if total else ""))
    if report.unreadable:  # checked as records retention deleted are: partially
        lost |= set(report.unreadable)
        report.txids_checked = len(set(committed) - lost)
        intact = [(t, r) for t, r in intact if t not in lost]
        failures = [f for f in failures if f[2] not in lost]
        typed = {state: [(t, row) for t, row in rows if t not in lost]
                 for state, rows in typed.items()}
        for per in expected.values():
            for txid in lost & set(per):
                del per[txid]
    _compare_contributions(conn, report, pipeline, recorded, expected,
                           sorted(t for t in set(committed) - lost if t >= since))
    if span:
        _check_range(conn, report, pipeline, state_dsns, expected, typed, lost,
                     since, sums)
    else:
        committed_rows = _read_states(conn, pipeline, state_dsns)
        _compare_states(report, pipeline, committed_rows, expected, lost)
        _compare_typed(report, pipeline, committed_rows, typed, lost)
    _compare_rejects(report, rejected, re_rejected, intact)
    _account_failures(report, failures, parked, later, lost, whole=not span)
    return report


def _count_specs(pipeline: Pipeline, report: VerifyReport) -> list:
    return [spec for spec in pipeline.states
            if not spec.typed and spec.name not in report.skipped_states]


def _compare_contributions(conn, report: VerifyReport, pipeline: Pipeline, recorded: dict,
                           expected: dict, txids: list[int]) -> None:
    """What each re-run txid adds to each count state against what its commit recorded
    adding (batch_contributions): its keys, the sum of its deltas and their digest."""
    sinks = sorted({spec.source_name for spec in _count_specs(pipeline, report)})
    if not txids or not sinks:
        return
    wanted = set(txids)
    by: dict[tuple[int, str], dict[str, int]] = {}
    for (sink, key), per in expected.items():
        if sink in sinks:
            for txid, delta in per.items():
                if txid in wanted:
                    by.setdefault((txid, sink), {})[key] = delta
    with conn.cursor() as cur:
        weight = state_tables.key_weights(cur, sorted({k for per in by.values() for k in per}))
    conn.commit()
    out = []
    for txid in txids:
        for sink in sinks:
            per_key = by.get((txid, sink), {})
            want = (len(per_key), sum(per_key.values()),
                    sum(weight[k] * d for k, d in per_key.items()))
            got = recorded.get((txid, sink), (0, 0, 0))
            if got != want:
                same = (" (the same keys and total: spread over the keys differently)"
                        if got[:2] == want[:2] else "")
                out.append(f"txid {txid}: its commit recorded adding {got[1]} over {got[0]} "
                           f"keys to {sink}, the re-run adds {want[1]} over {want[0]}{same}")
    report.contributions = len(txids)
    report.add(out)


def _check_range(conn, report: VerifyReport, pipeline: Pipeline,
                 state_dsns: Mapping[str, str] | None, expected: dict, typed: dict,
                 lost: set[int], since: int, sums: dict) -> None:
    """A range check's state comparisons: the keys the range's batches wrote or last
    wrote, then every count state's table against every recorded contribution."""
    first, last = report.span
    count_specs = _count_specs(pipeline, report)
    keys_of: dict[str, list[str]] = {}
    for (sink, key) in expected:
        keys_of.setdefault(sink, []).append(key)

    def read(cur, spec):
        if spec.typed:
            shape = spec.shape()
            return tables.read_table(cur, shape, spec.opaque, since=first,
                                     until=last if shape.append else None)
        return state_tables.read_rows_where(cur, spec, first, last,
                                            keys_of.get(spec.source_name, []))

    checked = [s for s in pipeline.states if s.name not in report.skipped_states]
    rows = _each_state(conn, pipeline, state_dsns, read, checked)
    for spec in count_specs:
        report.keys[spec.name] = len(rows[spec.name])
        report.add(_range_keys(spec, rows[spec.name], expected, first, last, lost))
    for spec in pipeline.typed_states():
        if spec.name in rows:
            report.keys[spec.name] = len(rows[spec.name])
            report.add(_range_typed(spec, rows[spec.name], typed, first, last, lost))
    inside = report.found > 0  # the range's own mismatches (contributions, keys)
    counts = [spec for spec in pipeline.states if not spec.typed]
    if not counts:
        return
    if since > 1:
        report.totals = (f"not checked (txids before {since} were committed before onceflow "
                         "recorded what each adds)")
        return
    totals = _each_state(conn, pipeline, state_dsns, state_tables.totals, counts)
    out = []
    for spec in counts:
        keys, total, digest = totals[spec.name]
        want_total, want_digest = sums.get(spec.source_name, (0, 0))
        if (total, digest) == (want_total, want_digest):
            continue
        how = (f"{spec.name}: its values add up to {total} over {keys} keys, the commits of "
               f"txids 1..{report.committed[1]} recorded adding {want_total}"
               + (" (the same sum: spread over the keys differently)"
                  if total == want_total else ""))
        out.append(how + (": a change no commit made, perhaps the mismatches above" if inside
                          else f": a change no commit made, in keys a check of txids "
                               f"{first}..{last} cannot locate (last written outside them, "
                               "or their previous value changed too): run verify without "
                               "--txids/--last to find them"))
    report.totals = (f"{len(counts) - len(out)} of {len(counts)} tables add up to the "
                     "recorded contributions" if out else
                     f"every table adds up to what txids 1..{report.committed[1]} recorded")
    report.add(out, outside=not inside)


def _range_keys(spec, rows: dict, expected: dict, first: int, last: int,
                lost: set[int]) -> list[str]:
    """A count state's keys in a range check: each key a re-run txid writes holds that
    txid or a later one; each key last written in the range is written by that txid's
    re-run and (opaque) holds value - prev_value = its delta."""
    want = {key: per for (sink, key), per in expected.items() if sink == spec.source_name}
    out = []
    for key in sorted(set(rows) | set(want)):
        per = want.get(key, {})
        stored = rows.get(key)
        if per and (stored is None or stored[2] < max(per)):
            where = "is missing" if stored is None else f"holds txid {stored[2]}"
            out.append(f"{spec.name}[{key!r}]: txid {max(per)} writes it (re-run) but the "
                       f"table {where}")
            continue
        if stored is None:
            continue
        value, prev, txid = stored
        if not first <= txid <= last or txid in lost:
            continue
        if txid not in per:
            if spec.kind != "opaque" or value != prev:  # value == prev: a replay put it back
                out.append(f"{spec.name}[{key!r}]: the table holds txid {txid}, whose re-run "
                           "does not write it")
        elif spec.kind == "opaque" and value - prev != per[txid]:
            out.append(f"{spec.name}[{key!r}]: txid {txid} added {value - prev} (value "
                       f"{value}, prev_value {prev}), re-run {per[txid]}")
    return out


def _range_typed(spec, got_rows: list[dict], typed: dict, first: int, last: int,
                 lost: set[int]) -> list[str]:
    """A typed state in a range check: an append table's rows of the range's txids as a
    multiset; a keyed one's keys as _range_keys does, an opaque one's measures as its
    previous values combined with the txid's batch."""
    shape = spec.shape()
    rows = [(t, r) for t, r in typed.get(spec.source_name, []) if first <= t <= last]
    if shape.append:
        names = [c for c, _ in shape.columns]
        want = Counter(tuple(r[c] for c in names) + (t,) for t, r in rows if t not in lost)
        got = Counter(tuple(r[c] for c in names) + (r["txid"],) for r in got_rows
                      if r["txid"] not in lost)
        return [f"{spec.name}: row {row} committed {got[row]} time(s), re-run {want[row]}"
                for row in sorted(set(want) | set(got), key=repr) if want[row] != got[row]]
    key_of = [c for c, _ in shape.key]
    per_key: dict[tuple, dict[int, list[dict]]] = {}
    for txid, row in rows:
        per_key.setdefault(tuple(row[c] for c in key_of), {}).setdefault(txid, []).append(row)
    got = {tuple(r[c] for c in key_of): r for r in got_rows}
    out = []
    for key in sorted(set(per_key) | set(got), key=repr):
        per, stored = per_key.get(key, {}), got.get(key)
        if per and (stored is None or stored["txid"] < max(per)):
            where = "is missing" if stored is None else f"holds txid {stored['txid']}"
            out.append(f"{spec.name}[{key}]: txid {max(per)} writes it (re-run) but the "
                       f"table {where}")
            continue
        if stored is None or not first <= stored["txid"] <= last or stored["txid"] in lost:
            continue
        txid = stored["txid"]
        if txid not in per:
            out.append(f"{spec.name}[{key}]: the table holds txid {txid}, whose re-run does "
                       "not write it")
            continue
        if not spec.opaque:
            continue
        batch = sorted(per[txid], key=lambda r: r.get(tables.ORDER) or 0)
        diff = {}
        for name, measure in shape.measures:
            want = _fold(measure, [stored[f"prev_{name}"],
                                   _fold(measure, [r[name] for r in batch])])
            if want != stored[name]:
                diff[name] = (stored[name], want)
        if diff:
            out.append(f"{spec.name}[{key}]: txid {txid}: (committed, previous value combined "
                       f"with the re-run) {diff}")
    return out


def _compare_states(report: VerifyReport, pipeline: Pipeline, committed: dict,
                    expected: dict, lost: set[int]) -> None:
    for spec in pipeline.states:
        report.keys[spec.name] = len(committed[spec.name])
        if spec.name in report.skipped_states or spec.typed:
            continue
        rows = committed[spec.name]
        want = {key: per for (state, key), per in expected.items() if state == spec.source_name}
        out = []
        for key in sorted(set(rows) | set(want)):
            per = want.get(key, {})
            value, prev, txid = rows.get(key, (0, 0, 0))
            last = max(per) if per else 0
            if not lost:
                total = sum(per.values())
                expect = (total, total - per.get(last, 0), last)
                got = (value, prev if spec.kind == "opaque" else expect[1], txid)
                if not per and value == 0:
                    continue  # a key put back to 0 by a replay: nothing counted
                if got != expect:
                    out.append(f"{spec.name}[{key!r}]: (value, prev, txid) committed {got}, "
                               f"re-run {expect}")
            elif txid not in lost:
                if last > txid:
                    out.append(f"{spec.name}[{key!r}]: committed at txid {txid}, but txid {last} "
                               "also changes it")
                elif spec.kind == "opaque" and txid and value - prev != per.get(txid, 0):
                    out.append(f"{spec.name}[{key!r}]: txid {txid} added {value - prev}, "
                               f"re-run {per.get(txid, 0)}")
        report.add(out)


def _fold(measure, values: list):
    """One measure over the rows of one txid, or over txids in order."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    if measure.agg in ("sum", "count"):
        return sum(values)
    if measure.agg == "min":
        return min(values)
    if measure.agg == "max":
        return max(values)
    return values[-1]  # last: the caller orders them


def expected_typed(shape, rows: list[tuple[int, dict]]) -> dict[tuple, dict]:
    """Per key, what a typed state must hold after the txids that wrote ``rows`` (re-run
    rows by txid): each measure, its value before the key's last txid, and that txid."""
    by_key: dict[tuple, dict[int, list[dict]]] = {}
    for txid, row in rows:
        key = tuple(row[c] for c, _ in shape.key)
        by_key.setdefault(key, {}).setdefault(txid, []).append(row)
    out = {}
    for key, per in by_key.items():
        txids = sorted(per)

        def over(name, measure, chosen, per=per):
            steps = []
            for txid in chosen:
                batch = sorted(per[txid], key=lambda r: r.get(tables.ORDER) or 0)
                steps.append(_fold(measure, [r[name] for r in batch]))
            return _fold(measure, steps)

        values = {name: over(name, m, txids) for name, m in shape.measures}
        prev = {name: over(name, m, txids[:-1]) for name, m in shape.measures}
        out[key] = {"values": values, "prev": prev, "txid": txids[-1],
                    "prev_txid": txids[-2] if len(txids) > 1 else None}
    return out


def _compare_typed(report: VerifyReport, pipeline: Pipeline, committed: dict,
                   typed: dict[str, list], lost: set[int]) -> None:
    for spec in pipeline.typed_states():
        shape = spec.shape()
        if spec.name in report.skipped_states:
            continue
        rows = typed.get(spec.source_name, [])
        got_rows = committed[spec.name]
        out = []
        if shape.append:
            names = [c for c, _ in shape.columns]
            want = Counter(tuple(r[c] for c in names) + (t,) for t, r in rows if t not in lost)
            got = Counter(tuple(r[c] for c in names) + (r["txid"],) for r in got_rows
                          if r["txid"] not in lost)
            out += [f"{spec.name}: row {row} committed {got[row]} time(s), re-run "
                    f"{want[row]}" for row in sorted(set(want) | set(got), key=repr)
                    if want[row] != got[row]]
            report.add(out)
            continue
        if lost:  # a key's values sum batches that cannot run again: not checked
            report.skipped_states.append(spec.name)
            continue
        want = expected_typed(shape, rows)
        got = {tuple(r[c] for c, _ in shape.key): r for r in got_rows}
        for key in sorted(set(want) | set(got), key=repr):
            w, g = want.get(key), got.get(key)
            if w is None or g is None:
                why = ("committed, but no re-run batch writes it" if w is None
                       else "written by the re-run, missing from the table")
                out.append(f"{spec.name}[{key}]: {why}")
                continue
            expect = {**w["values"], "txid": w["txid"]}
            have = {name: g[name] for name in w["values"]} | {"txid": g["txid"]}
            if spec.opaque:
                expect |= {f"prev_{n}": v for n, v in w["prev"].items()}
                expect["prev_txid"] = w["prev_txid"]
                have |= {f"prev_{n}": g[f"prev_{n}"] for n in w["prev"]}
                have["prev_txid"] = g["prev_txid"]
            if expect != have:
                diff = {k: (have[k], expect[k]) for k in expect if have[k] != expect[k]}
                out.append(f"{spec.name}[{key}]: (committed, re-run) {diff}")
        report.add(out)


def _compare_rejects(report: VerifyReport, rejected: dict, re_rejected: set,
                     intact: list[tuple[int, PartitionRange]]) -> None:
    def inside(pos) -> bool:
        return any(r.partition == pos[0] and r.start <= pos[1] < r.end for _, r in intact)

    recorded = {pos for pos in rejected if inside(pos)}
    report.rejected_committed, report.rejected_expected = len(recorded), len(re_rejected)
    out = [f"record p{p}:{o} is rejected ({rejected[(p, o)]}) but the re-run uses it"
           for p, o in sorted(recorded - re_rejected)]
    out += [f"record p{p}:{o} is rejected by the re-run but was not kept as rejected"
            for p, o in sorted(re_rejected - recorded)]
    report.add(out)


def _account_failures(report: VerifyReport, failures: list, parked: dict, replays: list,
                      lost: set[int], whole: bool = True) -> None:
    """Each record the re-run fails is queued, dead, or replayed by a later committed txid
    (``replays``: (txid, partition, offset, ...)); with ``whole`` (every committed txid
    re-run), each queued or dead record is one the re-run fails."""
    replayed_after = {}
    for txid, p, o, *_ in replays:
        replayed_after.setdefault((p, o), []).append(txid)
    out = []
    failing = set()
    for p, o, txid, error in failures:
        failing.add((p, o))
        later = [t for t in replayed_after.get((p, o), []) if t > txid]
        if (p, o) not in parked and not later:
            out.append(f"record p{p}:{o} fails in txid {txid} ({error}) but is neither queued, "
                       "dead, nor replayed later: it was counted, or lost")
    report.failed = len(failing)
    report.queued = sum(1 for kind in parked.values() if kind == "queued")
    report.dead = sum(1 for kind in parked.values() if kind == "dead")
    if whole and not lost:  # its commits failed it: a cause fixed since, or a flaky one
        for (p, o), kind in sorted(parked.items()):
            if (p, o) in failing:
                continue
            report.notes.append(
                f"record p{p}:{o} is a dead letter the re-run does not fail: once its cause "
                "is fixed, `onceflow replay-dead-letters` puts it back" if kind == "dead" else
                f"record p{p}:{o} is queued for replay, and the re-run does not fail it: its "
                "replay counts it")
    report.add(out)


# -- recount --------------------------------------------------------------------------------------
def recount(conn, pipeline: Pipeline, state_dsns: Mapping[str, str] | None = None
            ) -> VerifyReport:
    """Compare with the pipeline's own recount (Pipeline.recompute); see the module
    docstring."""
    count = pipeline.recount()
    if count is None:
        raise ConfigError(f"pipeline {pipeline.name!r} declares no recompute function: run "
                          "verify without --recount (it re-runs the topology)")
    report = VerifyReport(pipeline.name, "recount")
    with conn.cursor() as cur:
        ends = offsets.committed(cur, pipeline.name)
        report.rejected_committed = rejects.count(cur, pipeline.name)
        parked = {(p, o): kind for kind, p, o in backflow.parked(cur, pipeline.name)}
        report.queued = sum(1 for k in parked.values() if k == "queued")
        report.dead = sum(1 for k in parked.values() if k == "dead")
        report.add([
            f"{kind} record p{p}:{o} lies beyond the committed offset {ends.get(p, 0)}"
            for (p, o), kind in parked.items() if o >= ends.get(p, 0)])
        skipped = [(p, lo, hi) for p, lo, hi, *_ in offsets.gaps(cur, pipeline.name)]
        starts = {p: pos.log_start for p, pos in pipeline.source.positions(cur).items()}
        replayed_retired = backflow.replayed_retired(cur, pipeline.name)
        retired, retired_records, retired_rejected = retention.retired(cur, pipeline.name)
    conn.commit()
    committed = _read_states(conn, pipeline, state_dsns, state_tables.read_state)
    ranges = [PartitionRange(p, starts.get(p, 0), end) for p, end in ends.items()
              if end > starts.get(p, 0)]

    def payloads():
        for p, o, payload in pipeline.source.payloads(conn, ranges):
            if (p, o) in parked or any(p == g and lo <= o < hi for g, lo, hi in skipped):
                continue
            yield payload

    expected = count(itertools.chain(payloads(), replayed_retired), pipeline)
    failing = sum(getattr(expected, "failing", {}).values())
    if failing:
        report.add([
            f"{failing} record(s) fail every try ({dict(expected.failing)}) but are neither "
            "queued for replay nor dead letters: they were counted, or lost"])
    max_states = getattr(expected, "max_states", frozenset())
    for state_name, key, value in retired:
        state = expected.counts.setdefault(state_name, Counter())
        merge = max if state_name in max_states else int.__add__
        state[key] = merge(state.get(key, 0), value)
    report.records = expected.records + retired_records
    report.rejected_expected = sum(expected.rejected.values()) + retired_rejected
    for spec in pipeline.states:
        report.keys[spec.name] = len(committed[spec.name])
        if spec.typed:
            report.add(_recount_typed(spec, committed[spec.name], expected, bool(retired)))
            continue
        want = dict(expected.counts.get(spec.source_name, {}))
        got = committed[spec.name]
        report.add([
            f"{spec.name}[{key!r}]: committed {got.get(key, 0)}, recounted {want.get(key, 0)}"
            for key in sorted(set(want) | set(got)) if want.get(key, 0) != got.get(key, 0)])
    if report.rejected_expected != report.rejected_committed:
        report.add([f"rejected records: committed {report.rejected_committed}, "
                    f"recounted {report.rejected_expected}"])
    return report


def _recount_typed(spec, rows: list[dict], expected, retired: bool) -> list[str]:
    """A typed state against the recount's rows for it (``expected.tables[sink]``: dicts of
    the key and measure columns, or an append table's columns), as multisets."""
    shape = spec.shape()
    names = ([c for c, _ in shape.columns] if shape.append
             else [c for c, _ in shape.key] + [n for n, _ in shape.measures])
    want_rows = getattr(expected, "tables", {}).get(spec.source_name)
    if want_rows is None:
        return [f"{spec.name}: the recount function gives no rows for it (return them in "
                f".tables[{spec.source_name!r}])"]
    if retired:
        return []  # retention summed nothing for typed states: their old rows are unknown
    want = Counter(tuple(r[n] for n in names) for r in want_rows)
    got = Counter(tuple(r[n] for n in names) for r in rows)
    return [f"{spec.name}: row {row} committed {got[row]} time(s), recounted {want[row]}"
            for row in sorted(set(want) | set(got), key=repr) if want[row] != got[row]]
