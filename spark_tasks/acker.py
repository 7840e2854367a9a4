"""The acker: Storm's XOR tracking of tuple trees (reference seed 000), record by record.

Every source record is a root; every tuple gets a 64-bit id. Messages, per root:

- init (the spout emitted the root's first tuples): ``[root, xor of their ids, task]``;
- ack (a bolt finished an input): ``[root, input id XOR (xor of the ids it emitted)]``;
- fail (a bolt raised, or the tuple ran out of time): ``[root]``.

Each tuple id is XORed in twice (when emitted, when acked), so the running value is 0 exactly
when every tuple of the tree was acked; state per root is constant (value, failed, task),
whatever the tree's size. Worked example: root 66 emits tuple 8 from task 11 -> [66, 8, 11],
value 8; bolt 1 splits 8 into 4 and 7 -> [66, 8^4^7 = 11], value 3; bolt 2 acks 4 -> [66, 4],
value 7; bolt 3 acks 7 -> [66, 7], value 0: complete.

``Acker`` is the reference (pure Python); ``verdicts`` is the same as one Spark aggregation:
``group by root: bit_xor(value), bool_or(failed)``, so a batch's acking stays in the JVM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

# Message kinds (Storm's acker streams).
INIT, ACK, FAIL = "init", "ack", "fail"
_MASK = (1 << 64) - 1


@dataclass
class AckState:
    value: int = 0
    failed: bool = False
    task: int | None = None  # the task that emitted the root (where the verdict goes)
    initialised: bool = False


class Acker:
    def __init__(self) -> None:
        self.pending: dict[int, AckState] = {}

    def init(self, root: int, ack_val: int, task: int) -> None:
        state = self.pending.setdefault(root, AckState())
        state.value ^= ack_val & _MASK
        state.task, state.initialised = task, True

    def ack(self, root: int, ack_val: int) -> None:
        self.pending.setdefault(root, AckState()).value ^= ack_val & _MASK

    def fail(self, root: int) -> None:
        self.pending.setdefault(root, AckState()).failed = True

    def complete(self, root: int) -> bool:
        """The whole tree of ``root`` completed: initialised, XOR 0, nothing failed."""
        state = self.pending.get(root)
        return bool(state and state.initialised and state.value == 0 and not state.failed)


def signed64(value: int) -> int:
    """A 64-bit id as Spark's signed long (same bits)."""
    value &= _MASK
    return value - (1 << 64) if value >= 1 << 63 else value


def verdicts(messages: DataFrame, *, errors: bool = True, require_init: bool = True
             ) -> DataFrame:
    """messages: root (long), kind (init / ack / fail), value (long; null for fail), and
    optionally error (a fail's reason). Returns root, complete (bool), failed (bool), and with
    ``errors`` the first reason in sort order (null when nothing failed): one row per root.

    The aggregation keeps fixed-width state only (a long and two flags per root), so Spark
    runs it as a hash aggregation; the reasons, rare, are aggregated apart and joined on.
    ``require_init=False``: a root needs no init message (the topology runner combines the
    spout's init with the first bolt's ack when it computes both from one row)."""
    # imported here: pyspark loads only where Spark is used
    from pyspark.sql import functions as F

    state = messages.groupBy("root").agg(
        F.bit_xor(F.coalesce(F.col("value"), F.lit(0).cast("long"))).alias("xor"),
        F.bool_or(F.col("kind") == FAIL).alias("failed"),
        F.bool_or(F.col("kind") == INIT).alias("initialised"),
    ).select(
        "root",
        ((F.col("xor") == 0) & ~F.col("failed")
         & (F.col("initialised") if require_init else F.lit(True))).alias("complete"),
        "failed",
    )
    if not errors:
        return state
    if "error" not in messages.columns:
        return state.withColumn("error", F.lit(None).cast("string"))
    reasons = (messages.where(F.col("kind") == FAIL).groupBy("root")
               .agg(F.min("error").alias("error")))
    return state.join(reasons, "root", "left")
