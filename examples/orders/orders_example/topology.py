"""The orders topology: one DataFrame bolt (JSON parsing and checks in the JVM) and sinks.

    records --parse--> revenue ----> merchant_day_revenue (sum, count, max)
                   \\--> large ------> large_orders (append)
                   \\--> last_order -> merchant_last_order (upsert)
                   \\--> rejects ----> rejected records
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from onceflow import ANCHORS, SPOUT, Topology
from orders_example.data import ERR_MALFORMED, ERR_REFUND, LARGE

ORDER = "order_id long, merchant string, amount decimal(12,2), ordered_at timestamp"


def parse(records: DataFrame) -> DataFrame:
    """The anchors, the order's columns, its UTC day and why it is unusable (null: usable)."""
    o = F.from_json("payload", ORDER).alias("o")
    d = records.select(*ANCHORS, o).select(*ANCHORS, "o.*")
    # the day in UTC whatever the Spark session's time zone
    day = F.date_from_unix_date(F.floor(F.unix_seconds("ordered_at") / 86400).cast("int"))
    incomplete = F.col("order_id").isNull() | F.col("merchant").isNull() \
        | F.col("amount").isNull() | F.col("ordered_at").isNull()
    error = F.when(incomplete, F.lit(ERR_MALFORMED)).when(F.col("amount") <= 0,
                                                           F.lit(ERR_REFUND))
    return d.withColumn("day", day).withColumn("error", error)


def _bolt(records: DataFrame) -> dict[str, DataFrame]:
    d = parse(records)
    ok = d.where(F.col("error").isNull())
    return {
        "revenue": ok.select(*ANCHORS, "merchant", "day", "amount"),
        "large": ok.where(F.col("amount") >= F.lit(str(LARGE)).cast("decimal(12,2)")).select(
            *ANCHORS, "order_id", "merchant", "amount", "ordered_at"),
        "last_order": ok.select(*ANCHORS, "merchant", "order_id", "ordered_at"),
        "rejects": d.where(F.col("error").isNotNull()).select(*ANCHORS, "error"),
    }


def topology(pipeline=None) -> Topology:
    return (
        Topology("orders")
        .bolt("parse", input=SPOUT, fn=_bolt, outputs={
            "revenue": "merchant string, day date, amount decimal(12,2)",
            "large": "order_id long, merchant string, amount decimal(12,2), "
                     "ordered_at timestamp",
            "last_order": "merchant string, order_id long, ordered_at timestamp",
            "rejects": "error string",
        })
        .sink("revenue", "revenue")
        .sink("large", "large")
        .sink("last_order", "last_order")
        .reject("rejects")
    )
