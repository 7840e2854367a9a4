"""What the spout reads: a batch's source records and its replayed backflow items, in the one
shape ``run_topology`` takes (partition, offset, the source's record columns, ``replays``,
``replayed``; ``_problem`` too when the source decodes its records).

A replayed item comes back from the backflow as its payload (the line as it was read); the
source makes its columns (Source.replay_columns: a decoding source's replays are decoded by the
same JsonRecords as its reads), so a replay sees exactly the columns the first try saw.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from onceflow.core.planner import PartitionRange
from onceflow.core.source import Source
from onceflow.core.topology import columns


def spout_columns(source: Source) -> list[str]:
    """The columns of ``source.read`` the spout takes, in order."""
    return columns(source.read_ddl)


def batch_records(spark: SparkSession, dsn: str, source: Source,
                  ranges: Iterable[PartitionRange]) -> DataFrame:
    """The records of ``ranges``, first tries (replays 0, replayed false)."""
    return source.read(spark, dsn, ranges).select(
        *spout_columns(source), F.lit(0).alias("replays"), F.lit(False).alias("replayed"))


def replayed_records(spark: SparkSession, source: Source,
                     rows: Sequence[tuple[int, int, str, int]]) -> DataFrame:
    """Backflow items ``(partition, offset, payload, replays)`` as records (replayed true)."""
    keys = {
        "partition": pa.array([r[0] for r in rows], pa.int32()),
        "offset": pa.array([r[1] for r in rows], pa.int64()),
    }
    tail = {"replays": pa.array([r[3] for r in rows], pa.int32()),
            "replayed": pa.array([True] * len(rows), pa.bool_())}
    body = source.replay_columns(rows) if rows else {}
    table = pa.table({**keys, **body, **tail})
    ddl = f"{source.read_ddl}, replays int, replayed boolean"
    return spark.createDataFrame(table, ddl) if rows else spark.createDataFrame([], ddl)
