"""The Spark settings onceflow gives every session that processes batches: a local session,
the Spark Connect session processing tasks share, the local Connect server, spark-submit.
No pyspark import: the Airflow operators read this too.

- ``spark.sql.shuffle.partitions``: Spark's 200 doubled a 10M-row aggregation on 2 cores;
  ONCEFLOW_SHUFFLE_PARTITIONS, default 4.
- ``spark.sql.adaptive.enabled`` false: with several batches in flight on one Spark, adaptive
  execution runs a batch's final stage as a job of its own, submitted when its shuffle is
  written, so Spark's FIFO scheduler queues it behind every batch submitted meanwhile: the
  batches in flight then ran in lockstep and ended together (measured: three 1M-event batches
  ended within 0.1 s of each other, then commits, then the next wave, with Spark idle in
  between). Without it a batch is one job and the earliest submitted finishes first, so
  commits follow one another while later batches process. ONCEFLOW_SPARK_ADAPTIVE=true turns
  it back on (a bolt that joins skewed data may want it).
"""

from __future__ import annotations

import os


def processing_conf() -> dict[str, str]:
    """The SQL settings of a processing session (read from the environment when called)."""
    adaptive = os.environ.get("ONCEFLOW_SPARK_ADAPTIVE", "false").strip().lower()
    return {
        "spark.sql.shuffle.partitions": os.environ.get("ONCEFLOW_SHUFFLE_PARTITIONS", "4"),
        "spark.sql.adaptive.enabled": "true" if adaptive in ("1", "true", "yes") else "false",
    }
