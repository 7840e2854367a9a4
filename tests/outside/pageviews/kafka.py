"""The page views pipeline reading a Kafka topic (tests/test_kafka_source.py): the same
topology as the PostgreSQL log's, its connection the Airflow connection kafka_default."""

from onceflow import KafkaSource, Pipeline, StateSpec

KAFKA_VIEWS = Pipeline(
    name="kafka_views",
    description="Page views per country and per page, from Kafka.",
    source=KafkaSource(topic="page_views", timeout_s=3),
    topology="pageviews.topology:build",
    states=(StateSpec("views_per_country"), StateSpec("views_per_page", kind="transactional")),
    batch_size=150,
    max_pending=2,
    max_replays=1,
    retries=1,
)


def keyed(records):
    """Each record counted under its Kafka key and its decoded n (tests/test_kafka_source)."""
    from pyspark.sql import functions as F

    from onceflow import ANCHORS

    return records.select(*ANCHORS, F.lit("keys").alias("_stream"), F.concat(
        F.col("kafka_key"), F.lit(":n="), F.col("n").cast("string")).alias("key"))


def build_keyed(pipeline=None):
    from onceflow import SPOUT, Topology

    return (Topology("keyed").bolt("keyed", input=SPOUT, fn=keyed,
                                   outputs={"keys": "key string"})
            .count("keys", "by_key"))


EVENTS = Pipeline(
    name="events",
    source=KafkaSource(topic="events", json_schema="n int", timeout_s=3, read_chunk=10),
    topology="pageviews.kafka:build_keyed",
    states=(StateSpec("by_key"),),
    batch_size=30,
    max_pending=3,
)


# Kept up by the source watcher (tests/test_kafka_keepup.py): a run once 60 records wait or
# the oldest waited 2 s, the source looked at twice a second.
KAFKA_KEEPUP = Pipeline(
    name="kafka_keepup",
    description="Page views per country and per page, from Kafka, kept up by the watcher.",
    source=KafkaSource(topic="keepup_views", timeout_s=3),
    topology="pageviews.topology:build",
    states=(StateSpec("views_per_country"), StateSpec("views_per_page", kind="transactional")),
    batch_size=150,
    max_pending=1,
    max_replays=0,  # a failed record is a dead letter at once: no replay runs
    keep_up=True,
    min_records=60,
    max_delay=2.0,
    watch_interval=0.5,
)
