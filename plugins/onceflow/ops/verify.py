"""`onceflow verify`: is the committed state exactly what the committed batches imply?

**Re-run** (the default; needs no code from the user): the pipeline's own topology runs again,
in Spark, over everything each committed txid read (its planned ranges and the backflow items
it replayed, with the replay count they had), and the result is compared with:

- every state table, key by key: ``value`` (the sum over txids), ``prev_value`` (the value
  before the key's last txid) and ``txid`` (its last txid);
- the rejected records (the same positions);
- the failed records: each is waiting in a backflow queue, is a dead letter, or was replayed
  by a later committed txid; and every parked record is a failure of the re-run.

Batches whose records retention deleted cannot run again: then the check is partial (for a
key last written by a batch that re-ran, ``value - prev_value`` equals that batch's delta, and
no re-run batch after it touched the key), and the report says how many txids it covered.
States fed by stateful bolts depend on key-value state and are left to ``--recount``.

**Recount** (``--recount``): the pipeline's independent recount function
(``Pipeline.recompute``) over every record below the committed offsets: committed state +
rejects + queued + dead letters == the source. Records retention deleted after they were
committed are accounted for by what retention summed before deleting them (retired_counts);
ranges a policy skipped (offset_gaps) were never read and are left out.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from onceflow.core import backflow, offsets, rejects, tables, txlog
from onceflow.core import state_tables as state_tables
from onceflow.core.db import connect
from onceflow.core.errors import ConfigError
from onceflow.core.pipeline import Pipeline
from onceflow.core.planner import PartitionRange
from onceflow.core.registration import external_dsn
from onceflow.ops import retention

Progress = Callable[[str], None]


@dataclass
class VerifyReport:
    pipeline: str
    mode: str  # "re-run" | "recount"
    txids: int = 0  # committed txids
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

    @property
    def ok(self) -> bool:
        return not self.found and not self.mismatches

    def add(self, found: list[str], limit: int = 5) -> None:
        """Keep ``found`` (mismatches of one kind): the first ``limit`` to print, then how
        many more; every one counts in the summary."""
        self.found += len(found)
        self.mismatches += (found if len(found) <= limit
                            else found[:limit] + [f"... and {len(found) - limit} more"])

    @property
    def partial(self) -> bool:
        return self.txids_checked < self.txids

    def line(self) -> str:
        verdict = "OK" if self.ok else f"FAILED ({self.found} mismatches)"
        states = ", ".join(f"{name} {n} keys" for name, n in self.keys.items()) or "no state"
        if self.mode == "recount":
            return (f"verify {self.pipeline} (recount): {verdict}: "
                    f"{self.records + self.queued + self.dead} source records = "
                    f"{self.records} committed ({states}; {self.rejected_committed} rejected, "
                    f"expected {self.rejected_expected}) + {self.queued} queued for replay + "
                    f"{self.dead} dead letters")
        cover = (f"{self.txids_checked} of {self.txids} committed txids re-run (the others' "
                 "records are gone: partial check)" if self.partial
                 else f"{self.txids} committed txids re-run")
        skipped = (f"; not checked (stateful bolts): {', '.join(self.skipped_states)}"
                   if self.skipped_states else "")
        return (f"verify {self.pipeline} (re-run): {verdict}: {cover}, {self.records} records "
                f"+ {self.replays} replays; {states}; {self.rejected_committed} rejected "
                f"(expected {self.rejected_expected}); {self.failed} failed: {self.queued} "
                f"queued, {self.dead} dead letters, the rest replayed later{skipped}")


def _read_states(conn, pipeline: Pipeline, state_dsns: Mapping[str, str] | None,
                 reader=state_tables.read_rows) -> dict[str, dict]:
    states = {}
    for spec in pipeline.states:
        other = connect(external_dsn(spec, state_dsns)) if spec.conn_id else None
        try:
            with (other or conn).cursor() as cur:
                states[spec.name] = (tables.read_table(cur, spec.shape(), spec.opaque)
                                     if spec.typed else reader(cur, spec))
            (other or conn).commit()
        finally:
            if other is not None:
                other.close()
    return states


# -- re-run ---------------------------------------------------------------------------------------
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


def _run(pipeline: Pipeline, topology, source, txid_of):
    """Run the topology over ``source``; map each output to its txid with
    ``txid_of(partition, offset)``. Returns (deltas {(state, key): {txid: delta}}, rejected
    positions, failures [(partition, offset, txid, error)])."""
    from spark_tasks.ids import MAX_OFFSET, MAX_PARTITION, OFFSET_BITS
    from spark_tasks.runner import run_topology

    out = run_topology(topology, source, attempt=1, acker=pipeline.acker,
                       tuple_timeout_ms=pipeline.tuple_timeout_ms,
                       max_record_bytes=pipeline.source.max_record_bytes,
                       max_key_bytes=pipeline.max_key_bytes, by_root=True,
                       shapes={s.source_name: s.shape() for s in pipeline.typed_states()}
                       ).collect()

    def txid_of_root(root: int) -> int:
        return txid_of((root >> OFFSET_BITS) & MAX_PARTITION, root & MAX_OFFSET)

    deltas: dict[tuple[str, str], dict[int, int]] = {}
    for (state, key, root), delta in out.deltas.items():
        txid = txid_of_root(root)
        per = deltas.setdefault((state, key), {})
        per[txid] = per.get(txid, 0) + delta
    typed = {state: [(txid_of_root(row.pop("root")), row) for row in rows.to_pylist()]
             for state, rows in out.tables.items()}
    failures = [(p, o, txid_of(p, o), error) for (p, o, _), error in out.failed.items()]
    return deltas, set(out.rejected), failures, typed


def _range_lookup(intact: list[tuple[int, PartitionRange]]):
    """txid_of(partition, offset) for the committed ranges (they tile each partition)."""
    import bisect

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
          state_dsns: Mapping[str, str] | None = None, progress: Progress | None = None
          ) -> VerifyReport:
    from spark_tasks.records import batch_records, replayed_records

    say = progress or (lambda _: None)
    report = VerifyReport(pipeline.name, "re-run")
    with conn.cursor() as cur:
        ranges = txlog.committed_ranges(cur, pipeline.name)
        txids = txlog.committed_txids(cur, pipeline.name)
        replays = backflow.committed_replays(cur, pipeline.name)
        positions = pipeline.source.positions(cur)
        parked = {(p, o): kind for kind, p, o in backflow.parked(cur, pipeline.name)}
        rejected = rejects.positions(cur, pipeline.name)
    conn.commit()
    committed = _read_states(conn, pipeline, state_dsns)
    lost = {t for t, r in ranges
            if r.partition not in positions or r.start < positions[r.partition].log_start}
    report.txids, report.txids_checked = len(txids), len(set(txids) - lost)
    from spark_tasks.session import ship_code

    ship_code(pipeline.ref, pipeline.topology)
    topology, skipped = pipeline.build_topology().without_stateful()
    report.skipped_states = sorted(s.name for s in pipeline.states if s.source_name in skipped)
    intact = [(t, r) for t, r in ranges if t not in lost]
    say(f"re-running {report.txids_checked} committed txids ({sum(r.size for _, r in intact)} "
        f"records, {len(replays)} replays)")
    expected: dict[tuple[str, str], dict[int, int]] = {}
    re_rejected: set[tuple[int, int]] = set()
    failures: list[tuple[int, int, int, str]] = []
    typed: dict[str, list[tuple[int, dict]]] = {}
    jobs = []
    if intact:
        source = batch_records(spark, dsn, pipeline.source, [r for _, r in intact])
        jobs.append((source, _range_lookup(intact)))
        report.records = sum(r.size for _, r in intact)
    for i, rows in enumerate(_rounds([r for r in replays if r[0] not in lost])):
        source = replayed_records(spark, pipeline.source,
                                  [(p, o, payload, n) for _, p, o, n, payload in rows])
        mapping = {(p, o): t for t, p, o, _, _ in rows}
        jobs.append((source, lambda p, o, m=mapping: m[(p, o)]))
        report.replays += len(rows)
        say(f"replay round {i + 1}: {len(rows)} records")
    for source, txid_of in jobs:
        deltas, rej, failed, typed_rows = _run(pipeline, topology, source, txid_of)
        for state, rows in typed_rows.items():
            typed.setdefault(state, []).extend(rows)
        for key, per in deltas.items():
            into = expected.setdefault(key, {})
            for txid, delta in per.items():
                into[txid] = into.get(txid, 0) + delta
        re_rejected |= rej
        failures += failed
    _compare_states(report, pipeline, committed, expected, lost)
    _compare_typed(report, pipeline, committed, typed, lost)
    _compare_rejects(report, rejected, re_rejected, intact)
    _account_failures(report, failures, parked, replays, lost)
    return report


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
                      lost: set[int]) -> None:
    replayed_after = {}
    for txid, p, o, _, _ in replays:
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
    if not lost:
        out += [f"record p{p}:{o} is {kind} but the re-run never fails it"
                for (p, o), kind in sorted(parked.items()) if (p, o) not in failing]
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
