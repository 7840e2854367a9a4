"""The pipelines this installation knows, by name."""

from __future__ import annotations

from onceflow.pipeline import Pipeline, StateSpec

TWEETS = Pipeline(
    name="tweets",
    topic="tweets",
    topology="spark_tasks.tweets:topology",
    recompute="onceflow.examples.tweets:recompute",
    states=(StateSpec("url_counts"), StateSpec("domain_counts")),
)

# The same pipeline on the file-segment source (bulk data): its own topic and state tables.
TWEETS_FILES = Pipeline(
    name="tweets_files",
    topic="tweets_files",
    topology="spark_tasks.tweets:topology",
    recompute="onceflow.examples.tweets:recompute",
    states=(StateSpec("files_url_counts", source="url_counts"),
            StateSpec("files_domain_counts", source="domain_counts")),
    source="files",
)

# The demo pipeline with a stateful bolt (first-seen URLs), on the same topic as TWEETS with
# offsets and state tables of its own. A stateful pipeline processes one txid after another.
TWEETS_FIRST_SEEN = Pipeline(
    name="tweets_first_seen",
    topic="tweets",
    topology="spark_tasks.tweets:topology_first_seen",
    recompute="onceflow.examples.tweets:recompute",
    states=(StateSpec("fs_url_counts", source="url_counts"),
            StateSpec("fs_domain_counts", source="domain_counts"),
            StateSpec("first_seen_urls", source="new_urls")),
)

PIPELINES: dict[str, Pipeline] = {p.name: p for p in (TWEETS, TWEETS_FILES, TWEETS_FIRST_SEEN)}
