"""onceflow: exactly-once batch transactions on Airflow, Spark and PostgreSQL.

What a pipeline author needs, in one place::

    from onceflow import FileSegments, KafkaSource, Pipeline, PostgresLog, StateSpec, Topology

The folders are the architecture: ``core`` (the transaction protocol: pipeline declaration
and registry, transaction log, begin, staging, commit, offsets, backflow, the opaque rule),
``sources`` (the Source interface and its implementations), ``kvstate`` (key-value state of
stateful bolts), ``airflow`` (DAGs, operators, trigger), ``ops`` (the CLI: status, verify,
backfill, retention, repair), ``dev`` (local PostgreSQL and Spark, demo and test helpers).
``spark`` (the Spark side: topology, runner, acker, processing; its folder is the
checkout's spark_tasks/).
"""

from onceflow.core.errors import ConfigError
from onceflow.core.pipeline import Pipeline, StateSpec
from onceflow.core.tables import Count, Last, Max, Min, Sum
from onceflow.core.topology import ANCHORS, SPOUT, StatefulBolt, Topology
from onceflow.sources.kafka import KafkaSource
from onceflow.sources.landing import LandingFolder
from onceflow.sources.pglog import PostgresLog
from onceflow.sources.segments import FileSegments
from onceflow.sources.table import TableSource

__version__ = "0.2.0"
__all__ = ["ANCHORS", "SPOUT", "ConfigError", "Count", "FileSegments", "KafkaSource",
           "LandingFolder", "Last", "Max", "Min", "Pipeline", "PostgresLog", "StateSpec",
           "StatefulBolt", "Sum", "TableSource", "Topology", "__version__"]
