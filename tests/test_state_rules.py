"""The opaque and transactional update rules, on real PostgreSQL tables."""

from __future__ import annotations

import pytest
from psycopg2 import sql

from onceflow.db import transaction
from onceflow.pipeline import StateSpec
from onceflow.state import StaleBatch, apply_deltas, ensure_table

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
