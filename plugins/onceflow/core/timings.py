"""Where a begin's time goes: waiting for locks, indexing new source data, planning.

``begin_split()`` opens a split for the code it wraps; ``phase("lock_wait")`` and
``phase("index")`` add the time of what they wrap to it (nothing when no split is open, so
sources call them whoever calls them). A phase inside another counts once, for the inner one:
a landing folder's index that waits for its partitions' lock adds that wait to lock_wait and
the rest to index. Planning is the rest of the begin.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

PHASES = ("lock_wait", "index")


@dataclass
class Split:
    started: float = field(default_factory=time.monotonic)
    lock_wait_s: float = 0.0
    index_s: float = 0.0
    nested: list[float] = field(default_factory=list)  # time of inner phases, per open phase

    def figures(self) -> tuple[float, float, float]:
        """(lock wait, index, plan) seconds so far."""
        total = time.monotonic() - self.started
        return (self.lock_wait_s, self.index_s,
                max(0.0, total - self.lock_wait_s - self.index_s))



def describe(figures: tuple[float, float, float]) -> str:
    """The figures as a begin's log line ends."""
    lock, index, plan = figures
    return f"lock_wait={lock:.3f}s index={index:.3f}s plan={plan:.3f}s"


_current: ContextVar[Split | None] = ContextVar("onceflow_begin_split", default=None)


@contextmanager
def begin_split() -> Iterator[Split]:
    split = Split()
    token = _current.set(split)
    try:
        yield split
    finally:
        _current.reset(token)


@contextmanager
def phase(name: str) -> Iterator[None]:
    if name not in PHASES:
        raise ValueError(f"phase {name!r}: one of {PHASES}")
    split = _current.get()
    if split is None:
        yield
        return
    started = time.monotonic()
    split.nested.append(0.0)
    try:
        yield
    finally:
        elapsed = time.monotonic() - started
        inner = split.nested.pop()
        attr = f"{name}_s"
        setattr(split, attr, getattr(split, attr) + elapsed - inner)
        if split.nested:
            split.nested[-1] += elapsed
