"""The declaration: plain data, no Spark."""

from onceflow import Pipeline, PostgresLog, StateSpec

PAGE_VIEWS = Pipeline(
    name="page_views",
    description="Page views per country and per page.",
    source=PostgresLog(topic="page_views", partitions=3),
    topology="pageviews.topology:build",
    states=(StateSpec("views_per_country"), StateSpec("views_per_page", kind="transactional")),
    batch_size=400,
    max_pending=2,
    max_replays=1,
    retries=1,
)
