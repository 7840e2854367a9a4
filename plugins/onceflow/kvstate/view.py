"""KeyValueState: what a stateful bolt sees during one batch (Storm's KeyValueState)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from onceflow.core.txlog import TransactionAttempt
from onceflow.kvstate.base import DELETED, Change, Provider, StateBehind, check_json

_ABSENT = object()  # cached: the key has no committed value
_UNKNOWN = object()  # not cached yet
NOT_PENDING = object()  # this batch did not change the key


class KeyValueState:
    """One namespace (shard) of a bolt's state during batch ``txid``.

    Reads see the state committed by txids below ``txid`` (never the prepared changes of
    anyone), overlaid with this batch's own puts and deletes. ``prefetch`` keys are read in
    one round trip; any other key is read on first use (one round trip each). Changes reach
    the store only through prepare(), and count only once their attempt commits.

    A value must be JSON-safe and is checked at put(). To change a value, put() it again:
    mutating an object that get() returned changes nothing stored.

    It refuses to start (StateBehind) unless the store committed txid - 1 or later: a batch
    that read older state would be wrong, whatever the commit does afterwards. So every txid
    must commit every stateful bolt (an empty prepare when it changed nothing), and recover()
    must run before the next batch reads.
    """

    def __init__(self, provider: Provider, pipeline: str, bolt: str, namespace: str, txid: int,
                 prefetch: Iterable[str] = ()):
        self.provider, self.pipeline, self.bolt = provider, pipeline, bolt
        self.namespace, self.txid = namespace, txid
        last = provider.last_committed(pipeline, bolt)
        if last is not None and last.txid < txid - 1:
            prepared = provider.prepared(pipeline, bolt)
            raise StateBehind(
                f"kv state {pipeline}/{bolt}: txid {txid} cannot read state: the store's last "
                f"commit is {last}, txid {txid - 1} is not committed there"
                + (f"; prepared attempts {prepared} wait: run recover()" if prepared else "")
                + ". A batch reads state only after the previous txid committed")
        keys = list(prefetch)
        self._committed: dict[str, Any] = dict.fromkeys(keys, _ABSENT)
        if keys:
            self._committed.update(provider.read(pipeline, bolt, namespace, keys, txid=txid))
        self._pending: dict[str, Any] = {}

    def get(self, key: str, default: Any = None) -> Any:
        value = self._pending.get(key, _UNKNOWN)
        if value is _UNKNOWN:
            value = self._committed.get(key, _UNKNOWN)
            if value is _UNKNOWN:
                found = self.provider.read(self.pipeline, self.bolt, self.namespace, [key],
                                           txid=self.txid)
                value = self._committed[key] = found.get(key, _ABSENT)
        return default if value is _ABSENT or value is DELETED else value

    def put(self, key: str, value: Any) -> None:
        if type(key) is not str:
            raise TypeError(f"state key {key!r} is not a str")
        check_json(key, value)
        self._pending[key] = value

    def delete(self, key: str) -> None:
        if type(key) is not str:
            raise TypeError(f"state key {key!r} is not a str")
        self._pending[key] = DELETED

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        """(key, value) pairs: the committed ones this batch did not touch, then its puts."""
        for key, value in self.provider.scan(self.pipeline, self.bolt, self.namespace,
                                             txid=self.txid):
            if key not in self._pending:
                yield key, value
        for key, value in self._pending.items():
            if value is not DELETED:
                yield key, value

    def pending_value(self, key: str) -> Any:
        """This batch's own change of ``key`` (a value or DELETED), or NOT_PENDING: with
        restore(), a caller can take back the changes of one tuple that failed."""
        return self._pending.get(key, NOT_PENDING)

    def restore(self, key: str, pending: Any) -> None:
        """Put ``key``'s own change back to what pending_value() returned."""
        if pending is NOT_PENDING:
            self._pending.pop(key, None)
        else:
            self._pending[key] = pending

    def changes(self) -> list[Change]:
        """This batch's changes, (namespace, key, value or DELETED): what prepare() takes."""
        return [(self.namespace, key, value) for key, value in self._pending.items()]

    def prepare(self, attempt: int, *, part: int = 0) -> int:
        """Prepare this batch's changes as ``attempt`` of its txid (see Provider.prepare)."""
        return self.provider.prepare(self.pipeline, self.bolt,
                                     TransactionAttempt(self.txid, attempt), self.changes(),
                                     part=part)
