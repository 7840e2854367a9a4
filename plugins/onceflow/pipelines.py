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

PIPELINES: dict[str, Pipeline] = {p.name: p for p in (TWEETS,)}
