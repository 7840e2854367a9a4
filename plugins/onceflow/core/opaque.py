"""The opaque rule, once: the pure reference every store implements or is tested against.

Every stored key keeps ``(txid, value, prev)`` (Storm's OpaqueValue). A batch of txid T sees:

    stored txid <  T  ->  value     (the state after every earlier txid)
    stored txid == T  ->  prev      (an earlier attempt of T wrote here: its work is discarded)
    stored txid >  T  ->  refused   (StaleBatch: the batch is older than the state)

and writes ``(T, new, what it saw)``. A replay of T that no longer writes a key an earlier
attempt of T wrote puts it back (``value = prev``): that attempt's work is gone there too.

Counts: ``new = seen + delta``. Key-value state (stateful bolts): ``new`` is the value put
(``ABSENT`` for a delete). The *transactional* variant (a txid's batch never changes) needs no
prev: a stored txid equal to T means "already applied", and the key is left alone.

Worked example: url "a" holds (txid 6, value 10, prev 7). Txid 7 adds 2 -> (7, 12, 10). Txid 7
is replayed with a different batch that adds 5 -> (7, 15, 10): the first try's 2 is gone.

The stores: state tables (SQL, onceflow.core.state_tables), the key-value providers (memory,
PostgreSQL, Redis Lua; onceflow.kvstate). One property test drives each of them and this
module with the same random batches, replays and failed attempts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from onceflow.core.errors import StaleBatch


class _Absent:
    def __repr__(self) -> str:
        return "ABSENT"


ABSENT: Any = _Absent()  # no value (a key that does not exist, or was deleted)


@dataclass(frozen=True)
class Versioned:
    txid: int
    value: Any
    prev: Any = ABSENT


def sees_value(stored_txid: int, txid: int, where: str = "key") -> bool:
    """True when a batch of ``txid`` reads the stored value, False when it reads prev."""
    if stored_txid > txid:
        raise StaleBatch(
            f"{where} was written by txid {stored_txid}: a batch of txid {txid} is older than "
            "the state and cannot be applied (only the lowest uncommitted txid may)")
    return stored_txid < txid


def seen(stored: Versioned | None, txid: int, where: str = "key") -> Any:
    """What a batch of ``txid`` reads (ABSENT when nothing)."""
    if stored is None:
        return ABSENT
    return stored.value if sees_value(stored.txid, txid, where) else stored.prev


def write(stored: Versioned | None, txid: int, new: Any, where: str = "key") -> Versioned:
    """The key after a batch of ``txid`` wrote ``new``."""
    return Versioned(txid, new, seen(stored, txid, where))


def add(stored: Versioned | None, txid: int, delta: int, where: str = "key") -> Versioned:
    """A count after a batch of ``txid`` added ``delta`` (absent counts as 0)."""
    before = seen(stored, txid, where)
    return write(stored, txid, (0 if before is ABSENT else before) + delta, where)


def put_back(stored: Versioned | None, txid: int) -> Versioned | None:
    """A replay of ``txid`` that does not write this key: an earlier attempt's write is undone
    (None: the key did not exist before ``txid``)."""
    if stored is None or stored.txid != txid:
        return stored
    return None if stored.prev is ABSENT else Versioned(txid, stored.prev, stored.prev)


def add_transactional(stored: Versioned | None, txid: int, delta: int) -> Versioned:
    """The transactional map: a txid already applied is skipped; older state is refused."""
    if stored is not None and stored.txid > txid:
        raise StaleBatch(f"key written by txid {stored.txid}: txid {txid} is older")
    if stored is not None and stored.txid == txid:
        return stored
    return Versioned(txid, (0 if stored is None else stored.value) + delta)


def apply_batch(table: dict[Any, Versioned], txid: int, deltas: dict[Any, int], *,
                kind: str = "opaque", revert_absent: bool = False) -> None:
    """A whole batch on an in-memory table: what every state table store must match."""
    if kind == "transactional":
        for key, delta in deltas.items():
            table[key] = add_transactional(table.get(key), txid, delta)
        return
    if revert_absent:
        for key in [k for k, v in table.items() if v.txid == txid and k not in deltas]:
            back = put_back(table[key], txid)
            if back is None:
                del table[key]
            else:
                table[key] = back
    for key, delta in deltas.items():
        table[key] = add(table.get(key), txid, delta, f"key {key!r}")
