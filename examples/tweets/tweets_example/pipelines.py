"""The tweets example's pipelines, registered like any user's: by the entry point
``tweets = "tweets_example.pipelines:PIPELINES"`` in the group ``onceflow.pipelines`` (see
examples/tweets/pyproject.toml). Plain declarations: importing this loads no Spark.
"""

from __future__ import annotations

from onceflow import FileSegments, Pipeline, PostgresLog, StateSpec

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
