"""The in-process provider: plain dicts, for tests and single-process runs. NOT durable: a
process exit loses everything. Providers opened with the same coordinator DSN in one process
share one store, as if it were a database; values are kept as JSON text, so no caller can
change committed state by mutating an object it put."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from onceflow.core.txlog import TransactionAttempt
from onceflow.kvstate.base import (
    DELETED,
    Change,
    NotPrepared,
    Provider,
    RecoveryNeeded,
    StaleBatch,
    as_of,
    check_name,
    dedupe,
    log,
)

_ABSENT = None  # in a stored record: no value (JSON null is the text "null")


@dataclass
class _Record:
    txid: int
    value: str | None  # JSON text after txid, None: absent
    prev: str | None  # JSON text before txid, None: absent


@dataclass
class _Bolt:
    records: dict[tuple[str, str], _Record] = field(default_factory=dict)
    touched: dict[int, set[tuple[str, str]]] = field(default_factory=dict)  # txid -> keys
    # (txid, attempt) -> part -> {(namespace, key): JSON text, or None for a delete}
    prepared: dict[tuple[int, int], dict[int, dict[tuple[str, str], str | None]]] = field(
        default_factory=dict)
    committed: tuple[int, int] = (0, 0)  # the last (txid, attempt) committed here


_STORES: dict[str, dict[tuple[str, str], _Bolt]] = {}
_LOCK = threading.RLock()


class MemoryProvider(Provider):
    name = "memory"

    def __init__(self, store_id: str):
        with _LOCK:
            self._bolts = _STORES.setdefault(store_id, {})

    def _bolt(self, pipeline: str, bolt: str) -> _Bolt:
        key = (check_name("pipeline", pipeline), check_name("bolt", bolt))
        return self._bolts.setdefault(key, _Bolt())

    def read(self, pipeline: str, bolt: str, namespace: str, keys: Iterable[str], *,
             txid: int) -> dict[str, Any]:
        with _LOCK:
            records = self._bolt(pipeline, bolt).records
            found = {key: records[namespace, key] for key in keys if (namespace, key) in records}
            return _visible(found.items(), txid, namespace)

    def scan(self, pipeline: str, bolt: str, namespace: str, *, txid: int
             ) -> Iterator[tuple[str, Any]]:
        with _LOCK:
            records = self._bolt(pipeline, bolt).records
            found = [(k, r) for (ns, k), r in records.items() if ns == namespace]
        yield from sorted(_visible(found, txid, namespace).items())

    def prepare(self, pipeline: str, bolt: str, ta: TransactionAttempt,
                changes: Iterable[Change], *, part: int = 0) -> int:
        encoded = {nk: None if v is DELETED else json.dumps(v, allow_nan=False)
                   for nk, v in dedupe(changes).items()}
        with _LOCK:
            state = self._bolt(pipeline, bolt)
            ct, ca = state.committed
            if ct > ta.txid or (ct, ca) == (ta.txid, ta.attempt):
                raise StaleBatch(f"kv state {pipeline}/{bolt}: {ta} cannot prepare: txid {ct} "
                                 f"attempt {ca} is committed already")
            state.prepared.setdefault((ta.txid, ta.attempt), {})[part] = encoded
        log.debug("kv state %s/%s: prepared %s part %d: %d changes", pipeline, bolt, ta, part,
                  len(encoded))
        return len(encoded)

    def commit(self, pipeline: str, bolt: str, ta: TransactionAttempt, *, cur=None) -> int:
        self._refuse_cur(cur)
        started = time.monotonic()
        with _LOCK:
            state = self._bolt(pipeline, bolt)
            changes = _check_commit(state, pipeline, bolt, ta)
            if changes is None:
                state.prepared.pop((ta.txid, ta.attempt), None)
                return 0
            reverted = _revert_absent(state, ta.txid, changes)
            for nk, value in changes.items():
                _apply(state, ta.txid, nk, value)
            # Ordered commit: txid T commits only after T - 1 did, so no txid below T is
            # replayed again and its tombstones and touched keys may go.
            for old in [t for t in state.touched if t < ta.txid]:
                for nk in state.touched.pop(old):
                    record = state.records.get(nk)
                    if record and record.txid == old and record.value is _ABSENT:
                        del state.records[nk]
            del state.prepared[ta.txid, ta.attempt]
            state.committed = (ta.txid, ta.attempt)
        log.info("kv state %s/%s: committed %s: %d changes, %d keys of an earlier attempt put "
                 "back (%.3fs)", pipeline, bolt, ta, len(changes), reverted,
                 time.monotonic() - started)
        return len(changes)

    def rollback(self, pipeline: str, bolt: str, txid: int, attempt: int | None = None) -> int:
        with _LOCK:
            state = self._bolt(pipeline, bolt)
            dropped = 0
            for ta in [ta for ta in state.prepared
                       if ta[0] == txid and (attempt is None or ta[1] == attempt)]:
                dropped += sum(map(len, state.prepared.pop(ta).values()))
        log.info("kv state %s/%s: rolled back txid %d attempt %s: %d prepared changes dropped",
                 pipeline, bolt, txid, "all" if attempt is None else attempt, dropped)
        return dropped

    def prepared(self, pipeline: str, bolt: str) -> list[TransactionAttempt]:
        with _LOCK:
            return [TransactionAttempt(*ta) for ta in sorted(self._bolt(pipeline, bolt).prepared)]

    def last_committed(self, pipeline: str, bolt: str) -> TransactionAttempt | None:
        with _LOCK:
            committed = self._bolt(pipeline, bolt).committed
        return TransactionAttempt(*committed) if committed[0] else None


def _visible(found: Iterable[tuple[str, _Record]], txid: int, namespace: str) -> dict[str, Any]:
    out = {}
    for key, record in found:
        text = record.value if as_of(record.txid, txid, f"key {key!r} of {namespace!r}") \
            else record.prev
        if text is not _ABSENT:
            out[key] = json.loads(text)
    return out


def _check_commit(state: _Bolt, pipeline: str, bolt: str, ta: TransactionAttempt
                  ) -> dict[tuple[str, str], str | None] | None:
    """The attempt's merged change set, or None when committing it is a no-op."""
    where = f"kv state {pipeline}/{bolt}"
    parts = state.prepared.get((ta.txid, ta.attempt))
    if state.committed == (ta.txid, ta.attempt) or (state.committed[0] > ta.txid and not parts):
        log.info("%s: %s is committed already: nothing to do", where, ta)
        return None
    if parts is None:
        raise NotPrepared(f"{where}: {ta} has nothing prepared: prepare it (also with no "
                          "changes) before commit")
    if state.committed[0] > ta.txid:
        raise StaleBatch(f"{where}: {ta} is older than the committed txid {state.committed[0]}")
    lower = sorted(t for t in state.prepared if t[0] < ta.txid)
    if lower:
        raise RecoveryNeeded(f"{where}: cannot commit {ta}: attempts {lower} of lower txids are "
                             "still prepared; run recover() first")
    merged: dict[tuple[str, str], str | None] = {}
    for part in sorted(parts):
        for nk, value in parts[part].items():
            if nk in merged:
                raise ValueError(f"{where}: key {nk[1]!r} of namespace {nk[0]!r} is prepared by "
                                 f"two parts of {ta}: a namespace belongs to one part")
            merged[nk] = value
    return merged


def _revert_absent(state: _Bolt, txid: int, changes: dict) -> int:
    """Keys an earlier attempt of ``txid`` committed and this one does not change: back to
    their value before ``txid`` (a key that did not exist before is removed)."""
    reverted = 0
    for nk in state.touched.get(txid, set()) - changes.keys():
        record = state.records.get(nk)
        if record is None or record.txid != txid:
            continue
        if record.prev is _ABSENT:
            del state.records[nk]
        else:
            record.value = record.prev
        reverted += 1
    return reverted


def _apply(state: _Bolt, txid: int, nk: tuple[str, str], value: str | None) -> None:
    """The opaque rule for one key (the package docstring)."""
    record = state.records.get(nk)
    if record is None:
        record = state.records[nk] = _Record(txid, _ABSENT, _ABSENT)
    elif record.txid < txid:
        record.prev, record.txid = record.value, txid
    record.value = value
    if record.value is _ABSENT and record.prev is _ABSENT:
        del state.records[nk]  # absent before and after: nothing to remember
    else:
        state.touched.setdefault(txid, set()).add(nk)
