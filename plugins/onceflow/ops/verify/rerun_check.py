"""The re-run (``verify``, the default): the pipeline's topology runs again in Spark over
what each committed txid read, in jobs of about a tenth of the records each, and the result is
compared (onceflow.ops.verify.compare; a range check: onceflow.ops.verify.range_check)."""

from __future__ import annotations

import bisect
import itertools
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from onceflow.core import backflow, rejects, state_tables, txlog
from onceflow.core.errors import ConfigError, SparkServerGone
from onceflow.core.pipeline import Pipeline
from onceflow.core.planner import PartitionRange
from onceflow.ops.verify.compare import (
    Failure,
    account_failures,
    compare_contributions,
    compare_rejects,
    compare_states,
    compare_typed,
)
from onceflow.ops.verify.range_check import check_range, resolve_range
from onceflow.ops.verify.report import Progress, VerifyReport
from onceflow.ops.verify.states import read_states
from onceflow.spark.ids import MAX_OFFSET, MAX_PARTITION, OFFSET_BITS

CHUNK_RECORDS = 500_000  # a re-run's Spark job reads at least this many records (or all)


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
    positions, failures (Failure), typed rows, how many records
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
    failures = [Failure(p, o, txid_of(p, o), error)
                for (p, o, _), error in out.failed.items()]
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
    failures: list[Failure] = []
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
        failures = [f for f in failures if f.txid not in lost]
        typed = {state: [(t, row) for t, row in rows if t not in lost]
                 for state, rows in typed.items()}
        for per in expected.values():
            for txid in lost & set(per):
                del per[txid]
    compare_contributions(conn, report, pipeline, recorded, expected,
                           sorted(t for t in set(committed) - lost if t >= since))
    if span:
        check_range(conn, report, pipeline, state_dsns, expected, typed, lost,
                     since, sums)
    else:
        committed_rows = read_states(conn, pipeline, state_dsns)
        compare_states(report, pipeline, committed_rows, expected, lost)
        compare_typed(report, pipeline, committed_rows, typed, lost)
    compare_rejects(report, rejected, re_rejected, intact)
    account_failures(report, failures, parked, later, lost, whole=not span)
    return report
