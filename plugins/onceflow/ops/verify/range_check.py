"""A range check (``verify --txids A..B`` or ``--last N``): which txids it re-runs, and how
the keys those txids wrote, and every count state's totals, are compared (see
onceflow.ops.verify)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from onceflow.core import state_tables, tables, txlog
from onceflow.core.errors import ConfigError
from onceflow.core.pipeline import Pipeline
from onceflow.ops.verify.compare import count_state_specs, fold
from onceflow.ops.verify.report import VerifyReport
from onceflow.ops.verify.states import each_state


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


def check_range(conn, report: VerifyReport, pipeline: Pipeline,
                 state_dsns: Mapping[str, str] | None, expected: dict, typed: dict,
                 lost: set[int], since: int, sums: dict) -> None:
    """A range check's state comparisons: the keys the range's batches wrote or last
    wrote, then every count state's table against every recorded contribution."""
    first, last = report.span
    count_specs = count_state_specs(pipeline, report)
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
    rows = each_state(conn, pipeline, state_dsns, read, checked)
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
    totals = each_state(conn, pipeline, state_dsns, state_tables.totals, counts)
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
            want = fold(measure, [stored[f"prev_{name}"],
                                   fold(measure, [r[name] for r in batch])])
            if want != stored[name]:
                diff[name] = (stored[name], want)
        if diff:
            out.append(f"{spec.name}[{key}]: txid {txid}: (committed, previous value combined "
                       f"with the re-run) {diff}")
    return out
