"""Pipelines for the kill tests of commits that write outside the coordinator's database
(tests/test_faults.py), reachable by the fault agents as ``fault_pipelines:PIPELINES``
(ONCEFLOW_PIPELINES, with this folder on PYTHONPATH). One partition each, so that a batch is
a slice of the produced list and the test's model knows what every attempt read.

- ``tweets_external``: the tweets pipeline with its domain counts in a second database
  (the Airflow connection ``state2``);
- ``tweets_tally``: the first-seen pipeline whose stateful bolt counts every URL in a
  key-value state (Redis in the tests): each batch changes the values it touches, so what
  the store keeps as a key's previous value matters.
"""

from __future__ import annotations

import dataclasses

from onceflow import PostgresLog, StateSpec
from onceflow.core.topology import StatefulBolt
from tweets_example.pipelines import TWEETS, TWEETS_FIRST_SEEN

ONE_PARTITION = PostgresLog(topic="tweets", partitions=1)


class UrlTally(StatefulBolt):
    """Per URL, how often it was seen (the key-value state); emits a URL the first time."""

    def execute(self, values: dict) -> list[dict]:
        url = values["key"]
        before = self.state.get(url)
        self.state.put(url, (before or 0) + 1)
        return [] if before else [{"key": url}]


def tally_topology(pipeline=None):
    from tweets_example.topology import topology

    return (topology(pipeline)
            .stateful_bolt("tally", input="urls", key="key", bolt=UrlTally(),
                           outputs={"new_urls": "key string"})
            .count("new_urls", "new_urls"))


# Tables of their own (external_*, tally_*): two pipelines never share one, and these are
# loaded with the examples' TWEETS and TWEETS_FIRST_SEEN.
TWEETS_EXTERNAL = dataclasses.replace(
    TWEETS, name="tweets_external", source=ONE_PARTITION, mode="opaque",
    states=(StateSpec("external_url_counts", source="url_counts"),
            StateSpec("domain_counts", conn_id="state2")))

TWEETS_TALLY = dataclasses.replace(
    TWEETS_FIRST_SEEN, name="tweets_tally", source=ONE_PARTITION, mode="opaque",
    topology="fault_pipelines:tally_topology", state_provider="redis",
    states=tuple(dataclasses.replace(s, name=f"tally_{s.name}", source=s.source_name)
                 for s in TWEETS_FIRST_SEEN.states))

PIPELINES = (TWEETS_EXTERNAL, TWEETS_TALLY)
