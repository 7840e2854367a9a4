"""The acker: the seed's worked example, and a property test against the truth for random
tuple trees with random failures and lost acks (reference Acker and the Spark aggregation)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from onceflow.spark.acker import ACK, FAIL, INIT, Acker, signed64, verdicts


def test_seed_worked_example():
    acker = Acker()
    acker.init(66, 8, 11)           # [66, 8, 11]: the spout emits tuple 8 from task 11
    assert acker.pending[66].value == 8 and acker.pending[66].task == 11
    acker.ack(66, 8 ^ 4 ^ 7)        # [66, 11]: bolt 1 acks 8, emitting 4 and 7
    assert 8 ^ 4 ^ 7 == 11 and acker.pending[66].value == 3
    acker.ack(66, 4)                # [66, 4]
    assert acker.pending[66].value == 7 and not acker.complete(66)
    acker.ack(66, 7)                # [66, 7]
    assert acker.pending[66].value == 0 and acker.complete(66)


def test_a_fail_is_never_complete_and_an_unseen_root_is_not_complete():
    acker = Acker()
    acker.init(1, 5, 0)
    acker.fail(1)
    acker.ack(1, 5)
    assert not acker.complete(1) and not acker.complete(2)


def tree_messages(seed: int, roots: int, fail_p: float, lose_p: float):
    """Random tuple trees. Returns (messages, truth): truth[root] is True when every tuple of
    the tree was processed and acked (none failed, no ack lost)."""
    rng = random.Random(seed)
    messages, truth = [], {}
    for root in range(1, roots + 1):
        ok = True
        first = [rng.getrandbits(64) for _ in range(rng.randint(1, 3))]
        init_val = 0
        for t in first:
            init_val ^= t
        messages.append((root, INIT, init_val))
        frontier = list(first)
        depth = 0
        while frontier:
            depth += 1
            nxt = []
            for tuple_id in frontier:
                roll = rng.random()
                if roll < fail_p:
                    messages.append((root, FAIL, None))
                    ok = False
                    continue
                if roll < fail_p + lose_p:
                    ok = False  # the bolt's ack never reaches the acker
                    continue
                children = ([rng.getrandbits(64) for _ in range(rng.randint(0, 3))]
                            if depth < 4 else [])
                ack_val = tuple_id
                for c in children:
                    ack_val ^= c
                messages.append((root, ACK, ack_val))
                nxt += children
            frontier = nxt
        truth[root] = ok
    rng.shuffle(messages)  # the acker sees messages in any order
    return messages, truth


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32), roots=st.integers(1, 30),
       fail_p=st.sampled_from([0.0, 0.02, 0.1]), lose_p=st.sampled_from([0.0, 0.02, 0.1]))
def test_the_reference_acker_verdict_equals_the_truth(seed, roots, fail_p, lose_p):
    messages, truth = tree_messages(seed, roots, fail_p, lose_p)
    acker = Acker()
    for root, kind, value in messages:
        if kind == INIT:
            acker.init(root, value, task=0)
        elif kind == ACK:
            acker.ack(root, value)
        else:
            acker.fail(root)
    assert {root: acker.complete(root) for root in truth} == truth


def test_the_spark_aggregation_agrees_with_the_truth(spark):
    messages, truth = [], {}
    for seed in range(40):  # 40 batches of random trees, roots numbered apart
        batch, batch_truth = tree_messages(seed, 25, 0.05, 0.05)
        messages += [(seed * 100 + r, k, None if v is None else signed64(v))
                     for r, k, v in batch]
        truth.update({seed * 100 + r: ok for r, ok in batch_truth.items()})
    df = spark.createDataFrame(messages, "root long, kind string, value long")
    got = {r["root"]: r["complete"] for r in verdicts(df).collect()}
    assert got == truth
    assert 0 < sum(truth.values()) < len(truth)  # both verdicts occur
