"""Stateful bolts in the transaction: prepare at the end of processing, commit with the txid,
roll back what can never commit, and recovery before each batch and each commit (seed 002).

- Processing of txid T reads state only once T - 1 is committed (``wait_for_turn``): a batch
  must see the state of every txid before it, so a pipeline with stateful bolts processes its
  transactions one after another (a stateless pipeline's processing overlaps).
- Recovery (``recover``): for each prepared attempt, the coordinator says whether it committed
  (commit it: the store was behind), can never commit (failed, superseded, fenced: roll back,
  calling the bolt's ``pre_rollback``) or is in flight (keep).
- The commit phase commits every stateful bolt of the attempt (``commit_states``): inside the
  coordinator's transaction when the store is the coordinator's own database, else just
  before it; the store's txid per key (onceflow.kvstate) makes a crash between the two exact.
"""

from __future__ import annotations

import logging
import time

from onceflow.core import txlog
from onceflow.core.errors import ConfigError
from onceflow.core.pipeline import Pipeline
from onceflow.core.txlog import TransactionAttempt

log = logging.getLogger(__name__)


def stateful_bolts(pipeline: Pipeline, names: tuple[str, ...] | None = None) -> list:
    """The pipeline topology's stateful bolts (onceflow.core.topology.Bolt); ``names``: only
    these (what an attempt prepared), refusing a name the topology no longer has."""
    bolts = pipeline.build_topology().stateful()
    if names is None:
        return bolts
    by_name = {b.name: b for b in bolts}
    unknown = sorted(set(names) - set(by_name))
    if unknown:
        raise ConfigError(
            f"pipeline {pipeline.name!r}: stateful bolt(s) {unknown} prepared changes but the "
            "topology no longer has them; restore them, or backfill the txid so that it is "
            "processed again with the current topology")
    return [by_name[n] for n in names]


def committed_check(conn, pipeline: str, cur=None):
    """committed(ta) for recover(): True if ``ta`` committed, False if it never can, None
    while it is its transaction's current, uncommitted attempt. With ``cur``, asks inside
    that (open) transaction; else in short transactions of ``conn``."""
    def ask(c, ta: TransactionAttempt) -> bool | None:
        try:
            state = txlog.fence(c, pipeline, ta)
        except (txlog.Fenced, txlog.UnknownTransaction):
            return False
        if state is txlog.TxState.COMMITTED:
            return True
        return None if state is txlog.TxState.PLANNED else False

    def committed(ta: TransactionAttempt) -> bool | None:
        if cur is not None:
            return ask(cur, ta)
        with conn.cursor() as own:
            answer = ask(own, ta)
        conn.commit()
        return answer
    return committed


def recover(conn, provider, pipeline: Pipeline, bolts: list, cur=None) -> None:
    check = committed_check(conn, pipeline.name, cur)
    for bolt in bolts:
        prepared = provider.prepared(pipeline.name, bolt.name)
        if any(check(ta) is False for ta in prepared):
            bolt.fn.pre_rollback()
        report = provider.recover(pipeline.name, bolt.name, check)
        if report.committed or report.rolled_back:
            log.info("RECOVER pipeline=%s bolt=%s: %s", pipeline.name, bolt.name, report)


def wait_for_turn(conn, pipeline: str, txid: int, timeout_s: float = 3600.0,
                  poll_s: float = 1.0) -> None:
    """Block until txid - 1 is committed (a stateful batch reads the state after it)."""
    deadline = time.monotonic() + timeout_s
    logged = False
    while True:
        with conn.cursor() as cur:
            last = txlog.last_committed(cur, pipeline)
        conn.commit()
        if last >= txid - 1:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"txid {txid} of {pipeline}: its stateful bolts read the state after txid "
                f"{txid - 1}, which did not commit within {timeout_s:.0f}s (last committed: "
                f"{last}); retry once it has, or backfill it")
        if not logged:
            log.info("txid %d of %s waits for txid %d to commit before reading its state",
                     txid, pipeline, txid - 1)
            logged = True
        time.sleep(poll_s)


def prepare_states(provider, pipeline: Pipeline, bolts: list, ta: TransactionAttempt,
                   group: int, changes: dict[str, list]) -> int:
    """Prepare each stateful bolt's changes of this group (an empty prepare too: every txid
    commits every stateful bolt)."""
    total = 0
    for bolt in bolts:
        bolt.fn.pre_prepare(ta.txid)
        total += provider.prepare(pipeline.name, bolt.name, ta, changes.get(bolt.name, []),
                                  part=group)
    return total


def commit_states(cur, provider, pipeline: Pipeline, bolts: list, ta: TransactionAttempt
                  ) -> int:
    total = 0
    for bolt in bolts:
        bolt.fn.pre_commit(ta.txid)
        total += provider.commit(pipeline.name, bolt.name, ta,
                                 cur=cur if provider.atomic_with_coordinator else None)
    return total
