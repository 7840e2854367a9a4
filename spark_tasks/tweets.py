"""The demo pipeline's Spark side: tweets -> (url, domain) -> counts per URL and per domain.

Everything runs as DataFrame expressions in the JVM. Its pure-Python twin,
onceflow.examples.tweets, recomputes the same result independently for `onceflow verify`.
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from onceflow.examples.tweets import (
    DEFAULT_MAX_BYTES,
    ERR_BAD_URL,
    ERR_MALFORMED,
    ERR_NO_URL,
    ERR_OVERSIZED,
    URL_HOST,
)
from spark_tasks.processing import BatchOutput

_SCHEMA = "url string, _corrupt_record string"
_JSON_OPTIONS = {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": "_corrupt_record"}


def parse(records: DataFrame, max_bytes: int = DEFAULT_MAX_BYTES) -> DataFrame:
    """partition, offset, url, domain, error (null for a usable tweet)."""
    doc = F.from_json("payload", _SCHEMA, _JSON_OPTIONS)
    parsed = records.select("partition", "offset", "payload", doc.alias("j")).select(
        "partition",
        "offset",
        F.col("j.url").alias("url"),
        F.lower(F.regexp_extract("j.url", URL_HOST, 1)).alias("domain"),
        F.col("j._corrupt_record").alias("corrupt"),
        (F.octet_length("payload") > max_bytes).alias("oversized"),
    )
    error = (
        F.when(F.col("oversized"), F.lit(ERR_OVERSIZED))
        .when(F.col("corrupt").isNotNull(), F.lit(ERR_MALFORMED))
        .when(F.col("url").isNull(), F.lit(ERR_NO_URL))
        .when(F.col("domain") == "", F.lit(ERR_BAD_URL))
    )
    return parsed.withColumn("error", error).drop("corrupt", "oversized")


def transform(records: DataFrame, pipeline) -> BatchOutput:
    parsed = parse(records, pipeline.max_record_bytes)
    good = parsed.where(F.col("error").isNull())
    pairs = F.explode(F.array(
        F.struct(F.lit("url_counts").alias("state_name"), F.col("url").alias("key")),
        F.struct(F.lit("domain_counts").alias("state_name"), F.col("domain").alias("key")),
    ))
    deltas = (
        good.select(pairs.alias("t"))
        .groupBy("t.state_name", "t.key")
        .agg(F.count(F.lit(1)).alias("delta"))
    )
    rejects = parsed.where(F.col("error").isNotNull()).select("partition", "offset", "error")
    return BatchOutput(deltas=deltas, rejects=rejects)
