"""What every provider shares: the DELETED marker, JSON-safety, errors, the recovery loop."""

from __future__ import annotations

import logging
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from onceflow.core.errors import StaleBatch
from onceflow.core.opaque import sees_value
from onceflow.core.txlog import TransactionAttempt

log = logging.getLogger("onceflow.kvstate")

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")


class _Deleted:
    """The value of a change that deletes its key (distinct from JSON null, which is None)."""

    _instance: _Deleted | None = None

    def __new__(cls) -> _Deleted:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "DELETED"

    def __reduce__(self):  # stays a singleton when shipped to a Spark worker
        return (_Deleted, ())


DELETED = _Deleted()

Change = tuple[str, str, Any]  # (namespace, key, JSON-safe value or DELETED)
Committed = Callable[[TransactionAttempt], "bool | None"]


class NotPrepared(RuntimeError):
    """commit() of an attempt that has no prepared changes and was never committed."""


class RecoveryNeeded(RuntimeError):
    """commit(T) found prepared attempts of a txid below T: run recover() first."""


class StateBehind(RuntimeError):
    """A batch T would read state that txid T - 1 has not committed yet."""


__all__ = ["DELETED", "Change", "Committed", "NotPrepared", "Provider", "RecoveryNeeded",
           "RecoveryReport", "StaleBatch", "StateBehind", "check_json", "check_name"]


def check_name(what: str, name: str) -> str:
    """Pipeline and bolt names become parts of Redis keys: keep them unambiguous."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{what}={name!r} is invalid: use 1-100 letters, digits, '_', '.', '-'")
    return name


def _json_safe(value: Any) -> bool:
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:
        return True
    if kind is float:
        return math.isfinite(value)
    if kind is list:
        return all(_json_safe(item) for item in value)
    if kind is dict:
        return all(type(k) is str and _json_safe(v) for k, v in value.items())
    return False


def check_json(key: str, value: Any) -> None:
    """Refuse a value that would not come back from JSON as itself (tuples, sets, NaN, bytes,
    non-string dict keys, objects): state must read back exactly what was put."""
    if not _json_safe(value):
        raise TypeError(
            f"state value for key {key!r} is not JSON-safe ({type(value).__name__}: {value!r:.80}):"
            " use None, bool, int, finite float, str, list or dict with str keys"
        )


@dataclass
class RecoveryReport:
    """What recover() did with the prepared attempts it found."""

    pipeline: str
    bolt: str
    committed: list[TransactionAttempt] = field(default_factory=list)
    rolled_back: list[TransactionAttempt] = field(default_factory=list)
    kept: list[TransactionAttempt] = field(default_factory=list)  # still in flight

    def __str__(self) -> str:
        def names(tas: list[TransactionAttempt]) -> str:
            return ", ".join(f"{ta.txid}/{ta.attempt}" for ta in tas) or "none"

        return (f"kv state {self.pipeline}/{self.bolt} recovered: committed {names(self.committed)}"
                f"; rolled back {names(self.rolled_back)}; kept {names(self.kept)}")


class Provider(ABC):
    """The interface; subclasses implement the storage. See the package docstring for rules."""

    name = "?"
    atomic_with_coordinator = False  # commit(cur=...) joins the coordinator's transaction

    @abstractmethod
    def read(self, pipeline: str, bolt: str, namespace: str, keys: Iterable[str], *,
             txid: int) -> dict[str, Any]:
        """Implemented by each provider."""

    @abstractmethod
    def scan(self, pipeline: str, bolt: str, namespace: str, *, txid: int
             ) -> Iterator[tuple[str, Any]]:
        """Implemented by each provider."""

    @abstractmethod
    def prepare(self, pipeline: str, bolt: str, ta: TransactionAttempt,
                changes: Iterable[Change], *, part: int = 0) -> int:
        """Implemented by each provider."""

    @abstractmethod
    def commit(self, pipeline: str, bolt: str, ta: TransactionAttempt, *, cur=None) -> int:
        """Implemented by each provider."""

    @abstractmethod
    def rollback(self, pipeline: str, bolt: str, txid: int, attempt: int | None = None) -> int:
        """Implemented by each provider."""

    @abstractmethod
    def prepared(self, pipeline: str, bolt: str) -> list[TransactionAttempt]:
        """Implemented by each provider."""

    @abstractmethod
    def last_committed(self, pipeline: str, bolt: str) -> TransactionAttempt | None:
        """The attempt this store committed last for the state (None: none yet)."""

    def close(self) -> None:  # noqa: B027 (a provider without connections keeps it)
        """Release connections (nothing for the memory provider)."""

    def __enter__(self) -> Provider:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def recover(self, pipeline: str, bolt: str, committed: Committed) -> RecoveryReport:
        """Finish what the last transactions left prepared (seed 002's recovery, by txid).

        For each prepared attempt, lowest txid first, ``committed(ta)`` decides:
        True  -> the coordinator committed exactly this attempt: commit it here too;
        False -> it can never commit (failed, superseded, fenced): roll it back;
        None  -> it is still the current attempt of an open transaction: keep it.
        """
        report = RecoveryReport(pipeline, bolt)
        for ta in sorted(self.prepared(pipeline, bolt)):
            verdict = committed(ta)
            if verdict is True:
                self.commit(pipeline, bolt, ta)
                report.committed.append(ta)
            elif verdict is False:
                self.rollback(pipeline, bolt, ta.txid, ta.attempt)
                report.rolled_back.append(ta)
            else:
                report.kept.append(ta)
        if report.committed or report.rolled_back or report.kept:
            log.info("%s", report)
        else:
            log.debug("kv state %s/%s: nothing prepared, nothing to recover", pipeline, bolt)
        return report

    def _refuse_cur(self, cur) -> None:
        if cur is not None:
            raise ValueError(
                f"the {self.name} state provider is not in the coordinator's database: call "
                "commit() without cur, before the coordinator's commit (the txid rule makes the "
                "replay exact)"
            )


def dedupe(changes: Iterable[Change]) -> dict[tuple[str, str], Any]:
    """The change set as {(namespace, key): value}; a later change of a key wins."""
    out: dict[tuple[str, str], Any] = {}
    for namespace, key, value in changes:
        if type(namespace) is not str or type(key) is not str:
            raise TypeError(f"state namespace and key must be str, got {namespace!r}, {key!r}")
        if value is not DELETED:
            check_json(key, value)
        out[namespace, key] = value
    return out


def as_of(stored_txid: int, txid: int, where: str) -> bool:
    """Whether a key stored at ``stored_txid`` is read from its value (True) or its prev (False)
    by a batch ``txid``: the opaque rule (onceflow.core.opaque); a key written by a later txid
    cannot say what it was before ``txid`` (StaleBatch)."""
    return sees_value(stored_txid, txid, where)
