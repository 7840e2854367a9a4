"""Read planned offset ranges of the file-segment source: Spark's own Parquet reader, in
parallel in the JVM, on exactly the segments the index names, filtered to the ranges."""

from __future__ import annotations

from collections.abc import Iterable
from functools import reduce

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from onceflow.db import connection, transaction
from onceflow.planner import PartitionRange
from onceflow.segments import segments_for

RECORD_SCHEMA = "partition int, offset long, payload string"


def read_segment_ranges(spark: SparkSession, dsn: str, topic: str,
                        ranges: Iterable[PartitionRange]) -> DataFrame:
    """The records of ``ranges``: columns partition, offset, payload."""
    ranges = [r for r in ranges if r.size > 0]
    with connection(dsn, application_name="onceflow-segments") as conn, \
            transaction(conn) as cur:
        paths = segments_for(cur, topic, [(r.partition, r.start, r.end) for r in ranges])
    if not paths:
        return spark.createDataFrame([], RECORD_SCHEMA)
    wanted = reduce(lambda a, b: a | b, [
        (F.col("partition") == r.partition) & (F.col("offset") >= r.start)
        & (F.col("offset") < r.end)
        for r in ranges
    ])
    return spark.read.parquet(*paths).where(wanted).select("partition", "offset", "payload")
