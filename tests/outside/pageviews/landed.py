"""The same page views, landed as JSON-lines files in a folder instead of a PostgreSQL log:
what a team with a shared file system (NFS, a mounted volume) declares. The folder is where
the deployment mounts it, the same path on every Airflow worker and Spark executor
(PAGEVIEWS_LANDING, else /srv/pageviews/landing)."""

import dataclasses
import os

from onceflow import LandingFolder, StateSpec
from pageviews.pipelines import PAGE_VIEWS

PAGE_VIEWS_LANDED = dataclasses.replace(
    PAGE_VIEWS,
    name="page_views_landed",
    description="Page views per country and per page, from files landed in a shared folder.",
    source=LandingFolder(topic="page_views_landed", partitions=2,
                         path=os.environ.get("PAGEVIEWS_LANDING", "/srv/pageviews/landing")),
    # tables of its own, fed by the same sinks: a table belongs to one pipeline
    states=(StateSpec("landed_views_per_country", source="views_per_country"),
            StateSpec("landed_views_per_page", kind="transactional", source="views_per_page")),
)
