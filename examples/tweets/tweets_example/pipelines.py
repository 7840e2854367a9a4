"""The tweets example's pipelines, registered like any user's: by the entry point
``tweets = "tweets_example.pipelines:PIPELINES"`` in the group ``onceflow.pipelines`` (see
examples/tweets/pyproject.toml). Plain declarations: importing this loads no Spark.
"""

from __future__ import annotations

from onceflow import FileSegments, KafkaSource, Pipeline, PostgresLog, StateSpec

TWEETS = Pipeline(
    name="tweets",
    description="Exactly-once URL and domain counts from the tweets topic.",
    source=PostgresLog(topic="tweets", partitions=4),
    topology="tweets_example.topology:topology",
    recompute="tweets_example.data:recount",
    states=(StateSpec("url_counts"), StateSpec("domain_counts")),
)

# The same pipeline on file segments (bulk data): its own topic and state tables.
TWEETS_FILES = Pipeline(
    name="tweets_files",
    description="Exactly-once URL and domain counts from tweets in Parquet segment files.",
    source=FileSegments(topic="tweets_files", partitions=4),
    topology="tweets_example.topology:topology",
    recompute="tweets_example.data:recount",
    states=(StateSpec("files_url_counts", source="url_counts"),
            StateSpec("files_domain_counts", source="domain_counts")),
)

# The pipeline with a stateful bolt (first-seen URLs), on the same topic as TWEETS with
# offsets and state tables of its own. A stateful pipeline processes one txid after another.
TWEETS_FIRST_SEEN = Pipeline(
    name="tweets_first_seen",
    description="URL counts and first-seen URLs (a stateful bolt) from the tweets topic.",
    source=PostgresLog(topic="tweets", partitions=4),
    topology="tweets_example.topology:topology_first_seen",
    recompute="tweets_example.data:recount",
    states=(StateSpec("fs_url_counts", source="url_counts"),
            StateSpec("fs_domain_counts", source="domain_counts"),
            StateSpec("first_seen_urls", source="new_urls")),
)

PIPELINES = (TWEETS, TWEETS_FILES, TWEETS_FIRST_SEEN)

# The same pipeline on the Kafka topic tweets_kafka (the Airflow connection kafka_default;
# a topic name of its own: the coordinator keys offsets by topic name), its committed
# offsets also written to the consumer group onceflow-tweets_kafka for Kafka's lag tools.
# Not in PIPELINES: registering it needs the broker, so `tweets-demo --source kafka` adds it
# (ONCEFLOW_PIPELINES=tweets_example.pipelines:TWEETS_KAFKA).
TWEETS_KAFKA = Pipeline(
    name="tweets_kafka",
    description="Exactly-once URL and domain counts from the Kafka topic tweets_kafka.",
    source=KafkaSource(topic="tweets_kafka", commit_to_kafka=True),
    topology="tweets_example.topology:topology",
    recompute="tweets_example.data:recount",
    states=(StateSpec("kafka_url_counts", source="url_counts"),
            StateSpec("kafka_domain_counts", source="domain_counts")),
)
KAFKA_REF = "tweets_example.pipelines:TWEETS_KAFKA"
KAFKA_PARTITIONS = 4
