"""The recount (``verify --recount``): the pipeline's own recount function over every record
below the committed offsets, against the committed state, the rejects and the parked records
(see onceflow.ops.verify)."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping

from onceflow.core import backflow, offsets, rejects, state_tables
from onceflow.core.errors import ConfigError
from onceflow.core.pipeline import Pipeline
from onceflow.core.planner import PartitionRange
from onceflow.ops import retention
from onceflow.ops.verify.report import VerifyReport
from onceflow.ops.verify.states import read_states


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
    committed = read_states(conn, pipeline, state_dsns, state_tables.read_state)
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
