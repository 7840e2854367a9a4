"""Root and tuple ids: the acker's 64-bit ids, computed where the data is.

A root id keeps the origin of its record readable without a join back to the source:
``replayed << 62 | partition << 40 | offset`` (offsets below 2^40, partitions below 2^22).
Tuple ids are hashes of (root, bolt, stream, parent, position, attempt): xxhash64 in the JVM
(onceflow.spark.runner, .frame), BLAKE2b in Python bolts (``blake64``); both keep the XOR property.
"""

from __future__ import annotations

import hashlib

OFFSET_BITS, PARTITION_BITS = 40, 22
MAX_OFFSET, MAX_PARTITION = (1 << OFFSET_BITS) - 1, (1 << PARTITION_BITS) - 1


def root_id(partition, offset, replayed):
    """The root id of a source record as a column expression."""
    # imported here: pyspark loads only where Spark is used
    from pyspark.sql import functions as F

    return (F.shiftleft(F.col(replayed).cast("long"), 62)
            .bitwiseOR(F.shiftleft(F.col(partition).cast("long"), OFFSET_BITS))
            .bitwiseOR(F.col(offset)))


def origin(root: str = "_root") -> tuple:
    """(partition, offset) column expressions of a root id."""
    # imported here: pyspark loads only where Spark is used
    from pyspark.sql import functions as F

    partition = F.shiftright(F.col(root), OFFSET_BITS).bitwiseAND(F.lit(MAX_PARTITION))
    return (partition.cast("int").alias("partition"),
            F.col(root).bitwiseAND(F.lit(MAX_OFFSET)).alias("offset"))


def blake64(*parts) -> int:
    """A tuple id in a Python bolt."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)
