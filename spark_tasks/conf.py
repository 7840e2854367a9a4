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
- ``spark.python.sql.dataFrameDebugging.enabled`` false: with it on, PySpark records the Python
  call site of every DataFrame and Column function it is given (for the "== DataFrame =="
  context of a runtime error), which in a local or spark-submit session is about six round
  trips to the JVM per function: planning one batch of the benchmark topology took 4,100
  round trips, 0.9 CPU s in Python and about 0.45 in the JVM's py4j threads (off: 1,600,
  0.34 and 0.25), against SQL work of 2-3 CPU s. ONCEFLOW_DATAFRAME_DEBUGGING=true turns it
  back on while writing a bolt. A Spark Connect session cannot change it: a Connect client
  follows its server's setting (the local server onceflow starts, and docker-compose.yml's,
  have it off).
"""

from __future__ import annotations

import os

ON, OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """An on/off environment variable (1/true/yes/on, 0/false/no/off; unset or empty: the
    default). Any other value is a ConfigError naming it: a typo must not silently leave a
    setting as it was."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in ON or value in OFF:
        return value in ON
    from onceflow.core.errors import ConfigError

    raise ConfigError(f"{name}={os.environ[name]!r} is not an on/off value: set it to one of "
                      f"{', '.join(ON)} or {', '.join(OFF)}, or unset it")


# Settings a Spark application takes when it starts, which a Spark Connect session cannot change
# (its server's are the ones that hold).
STATIC = frozenset({"spark.python.sql.dataFrameDebugging.enabled"})


def processing_conf(static: bool = True) -> dict[str, str]:
    """The settings of a processing session (read from the environment when called);
    ``static=False``: without STATIC, for a session of a running Spark Connect server."""
    def flag(name: str) -> str:
        return "true" if env_flag(name, False) else "false"

    conf = {
        "spark.sql.shuffle.partitions": os.environ.get("ONCEFLOW_SHUFFLE_PARTITIONS", "4"),
        "spark.sql.adaptive.enabled": flag("ONCEFLOW_SPARK_ADAPTIVE"),
        "spark.python.sql.dataFrameDebugging.enabled": flag("ONCEFLOW_DATAFRAME_DEBUGGING"),
    }
    return conf if static else {k: v for k, v in conf.items() if k not in STATIC}
