"""The Spark settings onceflow gives every session that processes batches: a local session,
the Spark Connect session processing tasks share, the local Connect server, spark-submit.
No pyspark import: the Airflow operators read this too.

- ``spark.sql.shuffle.partitions``: the setting ONCEFLOW_SHUFFLE_PARTITIONS (default 4);
  Spark's 200 give a batch's aggregation many tiny tasks that a few cores only queue.
- ``spark.sql.adaptive.enabled`` false: with several batches in flight on one Spark, adaptive
  execution runs a batch's final stage as a job of its own, queued behind every batch
  submitted meanwhile, so the batches ended together; without it the earliest batch ends
  first and its commit goes while later ones process (docs/design.md).
- ``spark.python.sql.dataFrameDebugging.enabled`` false: on, PySpark records the Python call
  site of every DataFrame and Column function, several calls into the JVM each, which a
  batch's planning pays for every expression (docs/design.md). A Spark Connect
  client follows its server's setting (the local server onceflow starts has it off).
"""

from __future__ import annotations

from onceflow.core import settings

# Settings a Spark application takes when it starts, which a Spark Connect session cannot change
# (its server's are the ones that hold).
STATIC = frozenset({"spark.python.sql.dataFrameDebugging.enabled"})


def processing_conf(static: bool = True) -> dict[str, str]:
    """The settings of a processing session (read when called); ``static=False``: without
    STATIC, for a session of a running Spark Connect server."""
    conf = {
        "spark.sql.shuffle.partitions": str(settings.get("shuffle_partitions")),
        "spark.sql.adaptive.enabled": "false",
        "spark.python.sql.dataFrameDebugging.enabled": "false",
    }
    return conf if static else {k: v for k, v in conf.items() if k not in STATIC}
