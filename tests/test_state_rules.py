"""The opaque and transactional update rules, on real PostgreSQL tables."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg2 import sql

from helpers import table_stats
from onceflow.core.db import transaction
from onceflow.core.pipeline import StateSpec
from onceflow.core.state_tables import StaleBatch, apply_deltas, ensure_table

OPAQUE = StateSpec("opaque_counts", "opaque")
TRANSACTIONAL = StateSpec("tx_counts", "transactional")


def rows(conn, spec):
    cols = ["key", "txid", "value"] + (["prev_value"] if spec.kind == "opaque" else [])
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT {} FROM {} ORDER BY key").format(
            sql.SQL(", ").join(map(sql.Identifier, cols)), sql.Identifier(spec.table)))
        return cur.fetchall()


# (batches applied in order as (txid, {key: delta}), expected rows (key, txid, value, prev))
OPAQUE_CASES = [
    # first write: prev_value is the value before this txid, 0
    ([(1, {"a": 3})], [("a", 1, 3, 0)]),
    # a new txid: prev_value takes the old value
    ([(1, {"a": 3}), (2, {"a": 4})], [("a", 2, 7, 3)]),
    # a replay of the same txid with the same delta changes nothing
    ([(1, {"a": 3}), (2, {"a": 4}), (2, {"a": 4})], [("a", 2, 7, 3)]),
    # a replay with a different delta: value = prev_value + new delta
    ([(1, {"a": 3}), (2, {"a": 4}), (2, {"a": 10})], [("a", 2, 13, 3)]),
    # a replay that no longer has a key puts it back to prev_value: its first try is undone
    ([(1, {"a": 3, "b": 1}), (2, {"a": 1, "b": 1}), (2, {"a": 5})],
     [("a", 2, 8, 3), ("b", 2, 1, 1)]),
    # ... and a key only the first try had ends at 0
    ([(1, {"a": 3}), (2, {"a": 1, "n": 4}), (2, {"a": 1})], [("a", 2, 4, 3), ("n", 2, 0, 0)]),
    # keys of other txids are never touched by a replay
    ([(1, {"a": 3, "b": 1}), (2, {"a": 1}), (2, {"a": 2})], [("a", 2, 5, 3), ("b", 1, 1, 0)]),
    # a key first seen on a replay of txid 2 is a first write at txid 2
    ([(1, {"a": 3}), (2, {"a": 1}), (2, {"a": 1, "c": 9})], [("a", 2, 4, 3), ("c", 2, 9, 0)]),
    # the seed's example: count 5 at txid 3, batch of 3 at txid 4, replayed as 2 -> 7
    ([(3, {"k": 5}), (4, {"k": 3}), (4, {"k": 2})], [("k", 4, 7, 5)]),
]


def apply_in_order(conn, spec, batches):
    """Each (txid, deltas) batch in its own PostgreSQL transaction, as commits do."""
    with transaction(conn) as cur:
        ensure_table(cur, spec)
    for txid, deltas in batches:
        with transaction(conn) as cur:
            apply_deltas(cur, spec, txid, deltas)
    return rows(conn, spec)


@pytest.mark.parametrize("batches, expected", OPAQUE_CASES)
def test_opaque_rule(conn, batches, expected):
    assert apply_in_order(conn, OPAQUE, batches) == expected


def test_opaque_refuses_an_older_batch(conn):
    with transaction(conn) as cur:
        ensure_table(cur, OPAQUE)
        apply_deltas(cur, OPAQUE, 5, {"a": 1})
    with pytest.raises(StaleBatch, match="newer than 4"):
        with transaction(conn) as cur:
            apply_deltas(cur, OPAQUE, 4, {"a": 1, "b": 2})
    # the refused batch left nothing behind, not even its new key
    assert rows(conn, OPAQUE) == [("a", 5, 1, 0)]


TRANSACTIONAL_CASES = [
    ([(1, {"a": 3})], [("a", 1, 3)]),
    ([(1, {"a": 3}), (2, {"a": 4})], [("a", 2, 7)]),
    # the same txid again is skipped: its batch never changes in transactional mode
    ([(1, {"a": 3}), (2, {"a": 4}), (2, {"a": 4})], [("a", 2, 7)]),
    ([(1, {"a": 3}), (1, {"b": 2})], [("a", 1, 3), ("b", 1, 2)]),
]


@pytest.mark.parametrize("batches, expected", TRANSACTIONAL_CASES)
def test_transactional_rule(conn, batches, expected):
    assert apply_in_order(conn, TRANSACTIONAL, batches) == expected


_deltas = st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), st.integers(-3, 9), max_size=4)


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=st.lists(st.lists(_deltas, min_size=1, max_size=3), min_size=1, max_size=5),
       stale=st.booleans())
def test_state_tables_follow_the_opaque_reference(conn, plan, stale):
    """The SQL upsert against onceflow.core.opaque: every attempt of a txid is written (a
    state outside the coordinator, which cannot tell a crashed attempt from a committed one),
    replays put back what they no longer write, and a batch older than the state is refused
    by both."""
    from onceflow.core import opaque

    spec = StateSpec(f"prop_{abs(hash(str(plan))) % 10**9}", "opaque")
    with transaction(conn) as cur:
        ensure_table(cur, spec)
    reference: dict[str, opaque.Versioned] = {}
    for txid, attempts in enumerate(plan, start=1):
        for deltas in attempts:
            with transaction(conn) as cur:
                apply_deltas(cur, spec, txid, deltas)
            opaque.apply_batch(reference, txid, deltas, revert_absent=True)
    if stale and any(v.txid > 1 for v in reference.values()):
        with pytest.raises(StaleBatch):
            opaque.apply_batch(dict(reference), 1, {"a": 1, "b": 1, "c": 1, "d": 1})
        with pytest.raises(StaleBatch), transaction(conn) as cur:
            apply_deltas(cur, spec, 1, {"a": 1, "b": 1, "c": 1, "d": 1})
    got = {key: (value, prev, txid) for key, txid, value, prev in rows(conn, spec)}

    def as_row(v: opaque.Versioned):
        return (v.value, 0 if v.prev is opaque.ABSENT else v.prev, v.txid)

    want = {k: as_row(v) for k, v in reference.items()}
    # a key the reference dropped (it did not exist before its txid) stays as a 0 row in SQL
    assert {k: r for k, r in got.items() if k in want or r[0] != 0} == want


def _stage(conn, txid: int, state: str, deltas: dict[str, int], attempt: int = 1) -> dict:
    """One group's rows for ``state`` in the staging, as processing leaves them; the apply's
    parameters."""
    params = {"pipeline": "counted", "txid": txid, "attempt": attempt, "state": state}
    with transaction(conn) as cur:
        cur.executemany("""INSERT INTO staged_deltas
                               (pipeline, txid, attempt, grp, state_name, key, delta)
                           VALUES (%(pipeline)s, %(txid)s, %(attempt)s, 0, %(state)s, %(key)s,
                                   %(delta)s)""",
                        [{**params, "key": k, "delta": d} for k, d in deltas.items()])
        cur.execute("""INSERT INTO staged_contributions
                           (pipeline, txid, attempt, grp, state_name, keys, total, digest)
                       VALUES (%(pipeline)s, %(txid)s, %(attempt)s, 0, %(state)s, %(keys)s,
                               0, 0)""",
                    {**params, "keys": len(deltas)})
    return params


def _scans(conn, table: str) -> tuple[int, int]:
    """(sequential scans, index scans) PostgreSQL counted on ``table`` so far."""
    stats = table_stats(conn, table)
    return stats["seq_scan"], stats["idx_scan"]


@pytest.mark.parametrize("spec", [OPAQUE, TRANSACTIONAL], ids=["opaque", "transactional"])
def test_a_batch_of_known_size_is_merged_from_the_staging_joined_by_its_size(conn, spec):
    """The commit's apply of a one-group batch: the group's recorded key count stands for
    the batch, so the MERGE reads the staging itself. A batch under a tenth of the state's
    rows probes the key index; a larger one scans the state once (a hash join), which
    PostgreSQL's own scan counters show. Both give the rule's rows, and an opaque key held
    at a newer txid is still refused."""
    from onceflow.core.state_tables import apply_source, staged_keys, staged_source

    seed = {f"k{i:04d}": 1 for i in range(1000)}
    apply_in_order(conn, spec, [(1, seed)])

    def apply(txid, deltas):
        params = _stage(conn, txid, spec.source_name, deltas)
        before = _scans(conn, spec.table)
        with transaction(conn) as cur:
            keys = staged_keys(cur, params)
            assert keys == len(deltas)
            written = apply_source(cur, spec, txid, staged_source(1), params, keys=keys)
            cur.execute("SHOW enable_nestloop")
            assert cur.fetchone()[0] == "on"  # the plan's setting ends with the statement
        after = _scans(conn, spec.table)
        return written, (after[0] - before[0], after[1] - before[1])

    small = {"k0001": 2, "k0002": 3, "new1": 4}
    written, (seq, idx) = apply(2, small)
    assert written == 3 and seq == 0 and idx >= 3, (seq, idx)
    large = {f"k{i:04d}": 1 for i in range(0, 1000, 2)} | {f"n{i}": 5 for i in range(100)}
    written, (seq, idx) = apply(3, large)
    assert written == len(large) and seq == 1, (seq, idx)
    # more keys than the state holds: mostly new keys, copied first (any plan gives the rule)
    more = {f"m{i:04d}": 7 for i in range(2000)} | {"k0005": 1}
    written, _ = apply(4, more)
    assert written == len(more)
    got = {key: value for key, _, value, *_ in rows(conn, spec)}
    assert got["k0002"] == 1 + 3 + 1 and got["k0001"] == 1 + 2 and got["new1"] == 4
    assert got["k0003"] == 1 and got["n7"] == 5 and got["m0042"] == 7 and got["k0005"] == 2
    assert len(got) == 1000 + 1 + 100 + 2000
    if spec.kind == "opaque":  # k0000 is at txid 3 now: a batch of txid 2 is older
        params = _stage(conn, 2, spec.source_name, {"k0000": 1, "k0999": 1}, attempt=2)
        with pytest.raises(StaleBatch), transaction(conn) as cur:
            apply_source(cur, spec, 2, staged_source(1), params, keys=staged_keys(cur, params))
