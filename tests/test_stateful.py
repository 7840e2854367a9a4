"""Stateful bolts in transactions on real PostgreSQL, Redis and Spark: the first-seen bolt
emits each URL exactly once over many transactions with failures, the hooks run in order, an
error between the store's commit and the coordinator's is exact on replay, and bad settings
fail at start naming the fix."""

from __future__ import annotations

import json
import os
import random
import sys

import pytest
from pyspark import cloudpickle
from redis_server import RedisServer

from helpers import assert_exact, produce, table
from onceflow.core.begin import begin, mark_failed
from onceflow.core.commit import commit
from onceflow.core.errors import ConfigError
from onceflow.core.registration import register
from onceflow.core.registry import get_pipeline
from onceflow.core.topology import StatefulBolt
from onceflow.kvstate import check_state_config, open_state_provider
from onceflow.ops.verify import recount as verify
from onceflow.spark.processing import process_batch
from tweets_example.data import generate

# The hook-recording topology below is shipped to Spark's workers by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Crash(RuntimeError):
    """An error raised at a step of the commit, in this process (a SIGKILL at the same steps:
    tests/test_faults_outside.py)."""


def first_seen_pipeline(conn, events: int, **overrides):
    pipeline = get_pipeline("tweets_first_seen", **overrides)
    register(conn, pipeline, create_source=True)
    payloads = list(generate(events, seed=11, malformed_share=0.03, poison_share=0.002,
                             flaky_share=0.01))
    produce(conn, pipeline.topic, payloads)
    return pipeline, payloads


@pytest.fixture
def redis_settings(tmp_path):
    """The provider settings (JSON) of a redis-server of this test's own (tests/redis_server.py),
    started on first use: no test depends on a Redis the machine may or may not run."""
    servers: list[RedisServer] = []

    def settings() -> str:
        if not servers:
            servers.append(RedisServer(tmp_path / "redis", persistent=False).start())
        return json.dumps({"host": "127.0.0.1", "port": servers[0].port,
                           "key_prefix": "onceflow-test:"})

    yield settings
    for server in servers:
        server.stop()


def exactly_once(conn, pipeline, payloads: list[str]):
    """The committed state against the test's own count of the records read (helpers.
    assert_exact: the URL and domain counts), each URL counted emitted once as first seen,
    and onceflow's verify agreeing."""
    exact = assert_exact(conn, pipeline, payloads, read_all=False)
    counted = {url for (url,) in table(conn, "SELECT key FROM fs_url_counts WHERE value <> 0")}
    assert dict(table(conn, "SELECT key, value FROM first_seen_urls")) == \
        dict.fromkeys(counted, 1), "a URL emitted twice, or not at all"
    report = verify(conn, pipeline)
    # verify's recount: the records read = those committed + queued for replay + dead
    assert report.ok and report.records + report.queued + report.dead == exact.read, \
        (report.line(), exact)
    return exact


@pytest.mark.parametrize("provider, transactions", [("postgres", 8), ("redis", 5)])
def test_first_seen_emits_each_url_once_over_transactions_with_failures(
        spark, dsn, conn, provider, transactions, redis_settings):
    # fixed by default, so that every run tests the same interleaving; another one with
    # ONCEFLOW_FAULT_SEED
    seed = int(os.environ.get("ONCEFLOW_FAULT_SEED", "20261123")) + transactions
    print(f"fault seed {seed}")
    rng = random.Random(seed)
    settings = {"state_provider": provider,
                "state_provider_config": redis_settings() if provider == "redis" else None}
    pipeline, payloads = first_seen_pipeline(conn, 250 * transactions, batch_size=250,
                                             **settings)
    committed = runs = 0
    while committed < transactions:
        # about 4 in 10 runs fail; the bound only stops a run that makes no progress at all
        runs += 1
        assert runs <= 8 * transactions, f"no progress after {runs} runs (seed {seed})"
        batch = begin(conn, pipeline, f"run-{runs}")
        fault = rng.choice(["none", "none", "process", "kv_state", "offsets", "fail"])
        process_batch(spark, dsn, pipeline, batch.attempt)
        if fault == "fail":  # the attempt dies after processing: prepared, never committed
            mark_failed(conn, pipeline.name, batch.attempt, "test: killed")
            continue
        step = {"process": "locked", "kv_state": "kv_state", "offsets": "offsets"}.get(fault)

        def on_step(name, step=step):
            if name == step:
                raise Crash(name)
        try:
            result = commit(conn, pipeline, batch.attempt, on_step=on_step, coordinator_dsn=dsn,
                   open_state=open_state_provider)
        except Crash:
            if rng.random() < 0.5:  # retried as is, or the run fails and is adopted later
                mark_failed(conn, pipeline.name, batch.attempt, "test: crashed in commit")
                continue
            result = commit(conn, pipeline, batch.attempt, coordinator_dsn=dsn,
                   open_state=open_state_provider)
        assert result.status == "committed"
        committed += 1
        exactly_once(conn, pipeline, payloads)
    exact = exactly_once(conn, pipeline, payloads)
    urls = table(conn, "SELECT count(*) FROM fs_url_counts")[0][0]
    assert table(conn, "SELECT count(*), sum(value) FROM first_seen_urls")[0] == (urls, urls)
    assert exact.read > 250 * transactions * 0.6 and exact.counted > 0


def test_verify_after_retention_expects_each_url_once(spark, dsn, conn):
    """Retention retires committed records whose URLs come again later: the first-seen state
    still holds 1 per URL, and verify merges the retired presence by max, not by sum."""
    from helpers import delete_before
    from onceflow.core.planner import PartitionRange
    from tweets_example.data import recount

    pipeline, _ = first_seen_pipeline(conn, 800, batch_size=400)
    for n in range(2):
        batch = begin(conn, pipeline, f"run-{n}")
        process_batch(spark, dsn, pipeline, batch.attempt)
        commit(conn, pipeline, batch.attempt, coordinator_dsn=dsn,
                   open_state=open_state_provider)
        if n == 0:
            delete_before(conn, pipeline.topic, 60)
    retired = {k for (k,) in table(conn, "SELECT key FROM retired_counts "
                                         "WHERE state_name = 'new_urls'")}
    ends = dict(table(conn, 'SELECT partition, "offset" FROM partition_offsets'))
    remaining = recount(p for _, _, p in pipeline.source.payloads(
        conn, [PartitionRange(part, 60, end) for part, end in ends.items()]))
    conn.commit()
    assert retired & set(remaining.counts["new_urls"])  # URLs seen on both sides
    report = verify(conn, pipeline)  # verify's own merge of the retired presence, the subject
    assert report.ok, report.mismatches
    assert table(conn, "SELECT max(value) FROM first_seen_urls") == [(1,)]


class RecordingBolt(StatefulBolt):
    """Counts words; every hook call is recorded (in the process that makes it)."""

    calls: list[str] = []

    def execute(self, values):
        key = values["key"]
        self.state.put(key, (self.state.get(key) or 0) + 1)
        return [{"key": key}]

    def pre_prepare(self, txid):
        RecordingBolt.calls.append(f"pre_prepare {txid}")

    def pre_commit(self, txid):
        RecordingBolt.calls.append(f"pre_commit {txid}")

    def pre_rollback(self):
        RecordingBolt.calls.append("pre_rollback")


def recording_topology(pipeline):
    from tweets_example.topology import topology

    return (topology(pipeline)
            .stateful_bolt("recorder", input="urls", key="key", bolt=RecordingBolt(),
                           outputs={"seen": "key string"})
            .count("seen", "new_urls"))  # first_seen_urls: the states need their sinks


def test_hooks_are_called_in_order(spark, dsn, conn):
    from onceflow.kvstate import open_provider

    pipeline, _ = first_seen_pipeline(conn, 600, batch_size=200,
                                      topology=f"{__name__}:recording_topology")
    RecordingBolt.calls.clear()
    first = begin(conn, pipeline, "run-1")
    process_batch(spark, dsn, pipeline, first.attempt)
    commit(conn, pipeline, first.attempt, coordinator_dsn=dsn,
                   open_state=open_state_provider)
    second = begin(conn, pipeline, "run-2")
    process_batch(spark, dsn, pipeline, second.attempt)
    mark_failed(conn, pipeline.name, second.attempt, "test: killed")
    again = begin(conn, pipeline, "run-3")  # attempt 2: recovery rolls attempt 1 back
    process_batch(spark, dsn, pipeline, again.attempt)
    commit(conn, pipeline, again.attempt, coordinator_dsn=dsn,
                   open_state=open_state_provider)
    assert RecordingBolt.calls == ["pre_prepare 1", "pre_commit 1", "pre_prepare 2",
                                   "pre_rollback", "pre_prepare 2", "pre_commit 2"]
    # the counts in the state are those of the committed batches only
    with open_provider("postgres", None, coordinator_dsn=dsn) as provider:
        total = sum(v for ns in range(2) for _, v in provider.scan(
            pipeline.name, "recorder", f"shard-{ns}", txid=3))
        assert not provider.prepared(pipeline.name, "recorder")
    counted = table(conn, "SELECT sum(value) FROM fs_url_counts")[0][0]
    assert total == counted > 0


def test_an_error_after_the_store_commit_then_a_replay_is_exact(spark, dsn, conn,
                                                               redis_settings):
    """Redis commits first, the coordinator's commit fails before its COMMIT; the re-attempt reads
    the state as before the txid and its commit puts back what the first one changed."""
    pipeline, payloads = first_seen_pipeline(conn, 900, batch_size=300, state_provider="redis",
                                             state_provider_config=redis_settings(),
                                             mode="opaque")

    def crash(name):
        if name == "kv_state":
            raise Crash(name)
    b1 = begin(conn, pipeline, "run-1")
    process_batch(spark, dsn, pipeline, b1.attempt)
    with pytest.raises(Crash):
        commit(conn, pipeline, b1.attempt, on_step=crash, coordinator_dsn=dsn,
                   open_state=open_state_provider)
    assert table(conn, "SELECT last_committed_txid FROM pipelines WHERE name = %s",
                 (pipeline.name,)) == [(0,)]
    mark_failed(conn, pipeline.name, b1.attempt, "test: crashed")
    # the re-attempt reads a different batch (opaque re-plan with a smaller batch size)
    smaller = get_pipeline("tweets_first_seen", batch_size=200, state_provider="redis",
                           state_provider_config=redis_settings(), mode="opaque")
    b2 = begin(conn, smaller, "run-2")
    assert b2.attempt.attempt == 2
    process_batch(spark, dsn, smaller, b2.attempt)
    assert commit(conn, smaller, b2.attempt, coordinator_dsn=dsn,
                   open_state=open_state_provider).status == "committed"
    exactly_once(conn, smaller, payloads)
    b3 = begin(conn, smaller, "run-3")
    process_batch(spark, dsn, smaller, b3.attempt)
    commit(conn, smaller, b3.attempt, coordinator_dsn=dsn,
                   open_state=open_state_provider)
    exactly_once(conn, smaller, payloads)


@pytest.mark.parametrize("settings, message", [
    ({"state_provider": "mongo"}, "state.provider='mongo' is invalid"),
    ({"groups": 2}, "pipeline.groups=2 is invalid for a pipeline with stateful bolts"),
    ({"state_provider": "memory"}, "state.provider='memory' is invalid for a pipeline"),
    ({"state_provider": "redis",
      "state_provider_config": '{"host": "127.0.0.1", "port": 1}'}, "127.0.0.1:1"),
    ({"state_provider": "redis", "state_provider_config": '{"value_serializer": "pickle"}'},
     "value_serializer='pickle'"),
])
def test_bad_state_settings_fail_at_start(dsn, settings, message):
    pipeline = get_pipeline("tweets_first_seen", **settings)
    with pytest.raises(ConfigError, match=message):
        check_state_config(pipeline, dsn)
