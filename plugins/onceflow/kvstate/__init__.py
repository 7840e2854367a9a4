"""Key-value state of stateful bolts, checkpointed with the transaction (seed 002, made
exactly-once by the txid).

A state is (pipeline, bolt); a namespace is one of its shards; keys are str, values JSON-safe.
During batch ``txid`` a bolt sees a KeyValueState: the state as committed by txids below
``txid``, plus its own puts and deletes. At the end of processing the changes are
**prepared** (durable, per attempt, invisible to reads); the commit phase **commits** exactly
that attempt; a failed or superseded attempt is **rolled back**; **recover** finishes what a
crash left (below). Providers: ``memory`` (tests; not durable), ``postgres`` (default; the
coordinator's database or another one) and ``redis``.

Why a txid per key. Only a PostgreSQL state in the coordinator's own database can commit in
the coordinator's transaction (``commit(..., cur=cur)``). Any other store (Redis, another
database) commits before the coordinator does, and a crash in between leaves the store one
transaction ahead. So every key keeps ``(txid, value, prev_value)`` as in Storm's opaque
state, with "no value" distinct from JSON null for both. Committing attempt ``a`` of ``T``:

    stored txid <  T  ->  prev_value = value; value = new; txid = T
    stored txid == T  ->  value = new (prev_value stays: an earlier attempt of T wrote here)
    stored txid == T, key not in this attempt's changes -> value = prev_value
                          (an earlier attempt of T changed it; the replay does not)

and a batch T reads ``value`` when the stored txid < T, ``prev_value`` when it is T. A stored
txid above T means the batch is older than the state: refused (StaleBatch), as is any prepare
or commit of a txid below the last one committed.

Worked example: "a" is (1, 5, -) after txid 1. Attempt 1 of txid 2 puts a=6, b=1 and commits to
Redis; the coordinator crashes before its commit. Attempt 2 of txid 2 reads a=5 (prev), b absent
(prev), puts a=7 only. Its commit gives a = (2, 7, 5) and b removed (it had no value before 2).
Txid 3 reads a=7, b absent: exactly as if attempt 1 never ran.

Crash cases, each exact:
- after the store's commit, before the coordinator's: the replay (a new attempt, any change
  set) recomputes from prev_value and puts back what it does not change;
- after the coordinator's commit, before the store's: the attempt is still prepared;
  ``recover(committed)`` commits it (committed(ta) is True), rolls back attempts that can never
  commit (False) and keeps those still in flight (None);
- a second commit of the committed attempt is a logged no-op (the store records its last
  committed attempt).

Ordered commit is assumed (the coordinator commits T only after T - 1), and a batch reads
state only once T - 1 is committed in the store: KeyValueState refuses otherwise (StateBehind),
which also catches a recover() that did not run. So every txid commits every stateful bolt,
with an empty prepare when the bolt changed nothing. commit(T) refuses while attempts of lower
txids are still prepared (RecoveryNeeded: run recover() first), and drops deleted keys and
replay bookkeeping of txids below T, which no replay can need any more.

Prepare is per (attempt, part): several processing tasks of one attempt each prepare their own
part (their own namespaces); a retried task replaces its part; commit applies all parts.

The layouts are in the docstrings of onceflow.kvstate.postgres and onceflow.kvstate.redis_store.
No pickle: keys and values are JSON text in every store.
"""

from onceflow.kvstate.base import (
    DELETED,
    Change,
    NotPrepared,
    Provider,
    RecoveryNeeded,
    RecoveryReport,
    StaleBatch,
    StateBehind,
    check_json,
)
from onceflow.kvstate.config import (
    PROVIDERS,
    REDIS_DEFAULTS,
    check_state_config,
    open_checked_provider,
    open_provider,
    open_state_provider,
)
from onceflow.kvstate.view import KeyValueState

__all__ = ["DELETED", "PROVIDERS", "REDIS_DEFAULTS", "Change", "KeyValueState", "NotPrepared",
           "Provider", "RecoveryNeeded", "RecoveryReport", "StaleBatch", "StateBehind",
           "check_json", "check_state_config", "open_checked_provider", "open_provider",
           "open_state_provider"]
