"""`onceflow verify`: recompute the expected state from the source, independently of Spark,
and compare it with what was committed.

Scope: every record below the committed offsets. Each must be exactly one of: counted in every
state table (exactly once), kept in rejected_records, waiting in a backflow queue for its
replay, or given up on in dead_letters; so committed state + rejects + queued + dead letters
== the source. A record the recomputation says always fails (poison) must be queued or dead.
A replay that completed after retention deleted its source row is recomputed from
replayed_retired. Records retention deleted after they were
committed are accounted for by what retention summed before deleting them (retired_counts);
ranges an out_of_range policy skipped (offset_gaps) were never read and are left out. After a
force_from_start reset records are read (and counted) again, which verify does not model.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

from onceflow.pipeline import Pipeline, load_callable
from onceflow.source import iter_payloads_below
from onceflow.state import read_state


@dataclass
class VerifyReport:
    pipeline: str
    records: int = 0
    rejected_expected: int = 0
    rejected_committed: int = 0
    queued: int = 0
    dead: int = 0
    keys: dict[str, int] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def line(self) -> str:
        states = ", ".join(f"{name} {n} keys" for name, n in self.keys.items())
        verdict = "OK" if self.ok else f"FAILED ({len(self.mismatches)} mismatches)"
        return (f"verify {self.pipeline}: {verdict}: {self.records + self.queued + self.dead} "
                f"source records = {self.records} committed ({states}; "
                f"{self.rejected_committed} rejected, expected {self.rejected_expected}) + "
                f"{self.queued} queued for replay + {self.dead} dead letters")


def _diff(name: str, expected: dict, actual: dict, limit: int = 5) -> list[str]:
    out = []
    for key in sorted(set(expected) | set(actual)):
        want, got = expected.get(key, 0), actual.get(key, 0)
        if want != got:
            out.append(f"{name}[{key!r}]: committed {got}, recomputed {want}")
    if len(out) > limit:
        out = out[:limit] + [f"{name}: ... and {len(out) - limit} more"]
    return out


def _read_states(conn, pipeline: Pipeline, state_dsns: Mapping[str, str] | None
                 ) -> dict[str, dict[str, int]]:
    from onceflow.coordinator import external_dsn
    from onceflow.db import connect

    states = {}
    for spec in pipeline.states:
        other = connect(external_dsn(spec, state_dsns)) if spec.conn_id else None
        try:
            with (other or conn).cursor() as cur:
                states[spec.name] = read_state(cur, spec)
        finally:
            if other is not None:
                other.close()
    return states


def _add_retired(conn, pipeline: str, counts: dict, max_states=frozenset()
                 ) -> tuple[int, int]:
    """Add what retention deleted after this pipeline had committed it (retention.py); a
    state in ``max_states`` (a presence per key, like first-seen) merges by max."""
    with conn.cursor() as cur:
        cur.execute("SELECT state_name, key, value FROM retired_counts WHERE pipeline = %s",
                    (pipeline,))
        for state_name, key, value in cur.fetchall():
            state = counts.setdefault(state_name, {})
            merge = max if state_name in max_states else int.__add__
            state[key] = merge(state.get(key, 0), value)
        cur.execute("SELECT records, rejected FROM retired_records WHERE pipeline = %s",
                    (pipeline,))
        row = cur.fetchone() or (0, 0)
    conn.commit()
    return row


def _parked(cur, pipeline: str, ends: dict[int, int]) -> tuple[int, int, list[str]]:
    """How many records wait in the backflow queues and the dead letters, and any of them
    that lies beyond what was committed as read (which would be counted twice)."""
    cur.execute(
        """SELECT 'queued', partition, "offset" FROM backflow_items WHERE pipeline = %(p)s
           UNION ALL
           SELECT 'dead', partition, "offset" FROM dead_letters WHERE pipeline = %(p)s""",
        {"p": pipeline},
    )
    rows = cur.fetchall()
    stray = [f"{kind} record p{p}:{o} lies beyond the committed offset {ends.get(p, 0)}"
             for kind, p, o in rows if o >= ends.get(p, 0)]
    return (sum(1 for r in rows if r[0] == "queued"), sum(1 for r in rows if r[0] == "dead"),
            stray[:5])


def verify(conn, pipeline: Pipeline, state_dsns: Mapping[str, str] | None = None
           ) -> VerifyReport:
    """``state_dsns``: the database of each state kept outside the coordinator's."""
    report = VerifyReport(pipeline.name)
    with conn.cursor() as cur:
        cur.execute(
            'SELECT partition, "offset" FROM partition_offsets WHERE pipeline = %s',
            (pipeline.name,),
        )
        ends = dict(cur.fetchall())
        cur.execute("SELECT count(*) FROM rejected_records WHERE pipeline = %s", (pipeline.name,))
        report.rejected_committed = cur.fetchone()[0]
        report.queued, report.dead, stray = _parked(cur, pipeline.name, ends)
        report.mismatches += stray
        cur.execute("SELECT payload FROM replayed_retired WHERE pipeline = %s",
                    (pipeline.name,))
        replayed_retired = [p for (p,) in cur.fetchall()]
    committed = _read_states(conn, pipeline, state_dsns)
    conn.commit()
    recompute = load_callable(pipeline.recompute)
    if not ends:
        payloads = []
    elif pipeline.source == "files":
        from onceflow.segments import iter_segment_payloads

        with conn.cursor() as cur:
            cur.execute("SELECT partition, from_offset, to_offset FROM offset_gaps "
                        "WHERE pipeline = %s", (pipeline.name,))
            skipped = cur.fetchall()
            cur.execute("""SELECT partition, "offset" FROM backflow_items WHERE pipeline = %s
                           UNION ALL
                           SELECT partition, "offset" FROM dead_letters WHERE pipeline = %s""",
                        (pipeline.name, pipeline.name))
            parked = frozenset(cur.fetchall())
        payloads = iter_segment_payloads(conn, pipeline.topic, ends, skipped, parked)
    else:
        payloads = iter_payloads_below(conn, pipeline.topic, ends, pipeline.name)
    expected = recompute(itertools.chain(payloads, replayed_retired), pipeline)
    failing = sum(getattr(expected, "failing", {}).values())
    if failing:
        report.mismatches.append(
            f"{failing} record(s) fail every try ({dict(expected.failing)}) but are neither "
            "queued for replay nor dead letters: they were counted, or lost")
    retired_records, retired_rejected = _add_retired(
        conn, pipeline.name, expected.counts, getattr(expected, "max_states", frozenset()))
    report.records = expected.records + retired_records
    report.rejected_expected = sum(expected.rejected.values()) + retired_rejected
    for spec in pipeline.states:
        report.keys[spec.name] = len(committed[spec.name])
        report.mismatches += _diff(spec.name, dict(expected.counts.get(spec.source_name, {})),
                                   committed[spec.name])
    if report.rejected_expected != report.rejected_committed:
        report.mismatches.append(
            f"rejected records: committed {report.rejected_committed}, "
            f"recomputed {report.rejected_expected}"
        )
    return report
