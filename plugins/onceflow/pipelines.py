"""The pipelines this installation knows, by name."""

from __future__ import annotations

from onceflow.pipeline import Pipeline, StateSpec

TWEETS = Pipeline(
    name="tweets",
    topic="tweets",
    transform="spark_tasks.tweets:transform",
    recompute="onceflow.examples.tweets:recompute",
    states=(StateSpec("url_counts"), StateSpec("domain_counts")),
)

# The same pipeline on the file-segment source (bulk data): its own topic and state tables.
TWEETS_FILES = Pipeline(
    name="tweets_files",
    topic="tweets_files",
    transform="spark_tasks.tweets:transform",
    recompute="onceflow.examples.tweets:recompute",
    states=(StateSpec("files_url_counts", source="url_counts"),
            StateSpec("files_domain_counts", source="domain_counts")),
    source="files",
)

PIPELINES: dict[str, Pipeline] = {p.name: p for p in (TWEETS, TWEETS_FILES)}
