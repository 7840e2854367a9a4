"""What a verify run found, and its one-line summary (VerifyReport)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

Progress = Callable[[str], None]


@dataclass
class VerifyReport:
    pipeline: str
    mode: str  # "re-run" | "recount"
    txids: int = 0  # committed txids (of the range)
    txids_checked: int = 0  # re-run (the others lost records to retention)
    records: int = 0
    replays: int = 0
    rejected_expected: int = 0
    rejected_committed: int = 0
    failed: int = 0
    queued: int = 0
    dead: int = 0
    keys: dict[str, int] = field(default_factory=dict)
    skipped_states: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)  # what is printed: 5 a kind, "N more"
    found: int = 0  # mismatches found, the ones "N more" stands for included
    span: tuple[int, int] | None = None  # a range check: the txids re-run, first..last
    committed: tuple[int, int] = (0, 0)  # the committed txids after the last reset
    contributions: int = 0  # committed txids whose recorded contributions were compared
    totals: str = ""  # a range check: the state tables against every recorded contribution
    outside: int = 0  # mismatches (of ``found``) that the range's batches do not explain
    unreadable: dict[int, str] = field(default_factory=dict)  # txid: why it could not re-run
    failed_before: int = 0  # re-run records their commit failed (compared as failed)
    notes: list[str] = field(default_factory=list)  # printed, but no mismatch

    @property
    def ok(self) -> bool:
        return not self.found and not self.mismatches and not self.unreadable

    def add(self, found: list[str], limit: int = 5, *, outside: bool = False) -> None:
        """Keep ``found`` (mismatches of one kind): the first ``limit`` to print, then how
        many more; every one counts in the summary. ``outside``: not in what the range's
        batches added."""
        self.found += len(found)
        self.outside += len(found) if outside else 0
        self.mismatches += (found if len(found) <= limit
                            else found[:limit] + [f"... and {len(found) - limit} more"])

    @property
    def partial(self) -> bool:
        return self.txids_checked < self.txids

    def _verdict(self) -> str:
        if self.ok:
            return "OK"
        if not self.found and not self.mismatches:
            return f"INCOMPLETE ({self._unread()})"
        if self.unreadable:
            return f"FAILED ({_count(self.found, 'mismatch')}; {self._unread()})"
        if self.span is None:
            return f"FAILED ({self.found} mismatches)"
        inside, txids = self.found - self.outside, f"txids {self.span[0]}..{self.span[1]}"
        if not inside:
            return (f"{txids} OK, FAILED outside them ({_count(self.outside, 'mismatch')} in "
                    "the state tables that no re-run batch explains)")
        return (f"FAILED ({_count(inside, 'mismatch')} in {txids}"
                + (f", {self.outside} the range does not explain)" if self.outside else ")"))

    def _unread(self) -> str:
        return f"{_count(len(self.unreadable), 'txid')} could not be re-read"

    def line(self) -> str:
        verdict = self._verdict()
        states = ", ".join(f"{name} {n} keys" for name, n in self.keys.items()) or "no state"
        if self.mode == "recount":
            return (f"verify {self.pipeline} (recount): {verdict}: "
                    f"{self.records + self.queued + self.dead} source records = "
                    f"{self.records} committed ({states}; {self.rejected_committed} rejected, "
                    f"expected {self.rejected_expected}) + {self.queued} queued for replay + "
                    f"{self.dead} dead letters")
        what = "committed txids re-run"
        if self.span is not None:
            what = (f"committed txids re-run of {self.committed[0]}..{self.committed[1]}")
            states = ", ".join(f"{name} {n} keys read" for name, n in self.keys.items())
        gone = self.txids - self.txids_checked - len(self.unreadable)
        why = ", ".join(filter(None, [
            f"{gone} lost their records to retention" if gone else "",
            f"{len(self.unreadable)} could not be re-read" if self.unreadable else ""]))
        cover = (f"{self.txids_checked} of {self.txids} {what} ({why}: partial check)"
                 if self.partial else f"{self.txids} {what}")
        skipped = (f"; not checked (stateful bolts): {', '.join(self.skipped_states)}"
                   if self.skipped_states else "")
        head = "re-run" if self.span is None else f"re-run of txids {self.span[0]}..{self.span[1]}"
        tail = ""
        if self.contributions:
            tail += (f"; recorded contributions of {self.contributions} txids compared")
        if self.totals:
            tail += f"; state totals: {self.totals}"
        if self.failed_before:
            tail += (f"; {self.failed_before} tries of records their commit failed and a "
                     "later txid replayed, compared as failed")
        return (f"verify {self.pipeline} ({head}): {verdict}: {cover}, {self.records} records "
                f"+ {self.replays} replays; {states}; {self.rejected_committed} rejected "
                f"(expected {self.rejected_expected}); {self.failed} failed: {self.queued} "
                f"queued, {self.dead} dead letters, the rest replayed later{skipped}{tail}")


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "es" if what.endswith("h") else "s")
