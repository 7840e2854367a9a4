"""What a re-run found against what was committed: each txid's recorded contributions, the
state tables, the typed states, the rejects, and where each failed record went."""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from onceflow.core import state_tables, tables
from onceflow.core.pipeline import Pipeline
from onceflow.core.planner import PartitionRange
from onceflow.ops.verify.report import VerifyReport


class Failure(NamedTuple):
    """A record the re-run fails: where, in which txid's batch, and why."""

    partition: int
    offset: int
    txid: int
    error: str


def count_state_specs(pipeline: Pipeline, report: VerifyReport) -> list:
    return [spec for spec in pipeline.states
            if not spec.typed and spec.name not in report.skipped_states]


def compare_contributions(conn, report: VerifyReport, pipeline: Pipeline, recorded: dict,
                           expected: dict, txids: list[int]) -> None:
    """What each re-run txid adds to each count state against what its commit recorded
    adding (batch_contributions): its keys, the sum of its deltas and their digest."""
    sinks = sorted({spec.source_name for spec in count_state_specs(pipeline, report)})
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


def compare_states(report: VerifyReport, pipeline: Pipeline, committed: dict,
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


def fold(measure, values: list):
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
                steps.append(fold(measure, [r[name] for r in batch]))
            return fold(measure, steps)

        values = {name: over(name, m, txids) for name, m in shape.measures}
        prev = {name: over(name, m, txids[:-1]) for name, m in shape.measures}
        out[key] = {"values": values, "prev": prev, "txid": txids[-1],
                    "prev_txid": txids[-2] if len(txids) > 1 else None}
    return out


def compare_typed(report: VerifyReport, pipeline: Pipeline, committed: dict,
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


def compare_rejects(report: VerifyReport, rejected: dict, re_rejected: set,
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


def account_failures(report: VerifyReport, failures: list, parked: dict, replays: list,
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
