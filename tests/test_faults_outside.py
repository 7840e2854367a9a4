"""Kills inside commits that write outside the coordinator's database (onceflow_testing.faults'
agents): a state table kept in a second database, and a stateful bolt's key-value state in
Redis. After recovery every row's and key's txid, value and previous value must equal the
pure opaque reference (onceflow.core.opaque) fed with what each attempt read, by the test's
own reading of the payloads it produced.

(Apart from tests/test_faults.py, whose private PostgreSQL cluster keeps that file on one
pytest-xdist worker: these need none, and can run on the other.)
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import redis

from helpers import assert_exact, classify_tweet, table, tweets_events
from onceflow.core import db, opaque
from onceflow.core.begin import begin, mark_failed
from onceflow.core.commit import commit
from onceflow.core.registration import register
from onceflow.core.registry import clear_cache, get_pipeline
from onceflow.kvstate import open_state_provider
from onceflow_testing.faults import Agent, run_and_kill

SEED = int(os.environ.get("ONCEFLOW_FAULT_SEED", "20261123"))
TESTS = Path(__file__).parent


@pytest.fixture
def fault_pipelines(monkeypatch, dsn):
    """tests/fault_pipelines.py reachable here and in the agents; the agents' environment."""
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("ONCEFLOW_PIPELINES", "fault_pipelines:PIPELINES")
    clear_cache()
    yield {**os.environ, "ONCEFLOW_PG_DSN": dsn}
    clear_cache()


def deltas(payloads: list[str], start: int, end: int, what: str) -> dict[str, int]:
    """Per URL or domain, how often the records [start, end) of the one partition hold it,
    by the test's own reading of the payloads."""
    out: dict[str, int] = {}
    for payload in payloads[start:end]:
        tweet = classify_tweet(payload)
        if tweet.kind == "good":
            key = getattr(tweet, what)
            out[key] = out.get(key, 0) + 1
    return out


def one_range(batch) -> tuple[int, int]:
    (r, _), = batch.ranges
    assert r.partition == 0
    return r.start, r.end


def state_rows(conn, table_name: str) -> dict:
    """An opaque count table as the reference keeps it: {key: Versioned(txid, value, prev)}.
    A key a replay put back to "nothing before its txid" stays as a 0 row in SQL: left out."""
    rows = table(conn, f"SELECT key, txid, value, prev_value FROM {table_name}")  # noqa: S608
    return {key: opaque.Versioned(txid, value, prev) for key, txid, value, prev in rows
            if value != 0 or prev != 0}


def model_rows(model: dict) -> dict:
    return {k: opaque.Versioned(v.txid, v.value, 0 if v.prev is opaque.ABSENT else v.prev)
            for k, v in model.items()}


def killed_at(env, pipeline: str, settings: dict, batch, step: str):
    kill = run_and_kill(["commit", "--pipeline", pipeline, "--settings", json.dumps(settings),
                         "--txid", str(batch.attempt.txid), "--attempt",
                         str(batch.attempt.attempt), "--pause-at", step], env)
    assert kill.killed and kill.where == f"commit:{step}", kill.describe()
    return kill


@pytest.mark.timeout(400)
def test_kills_inside_a_state_commit_in_another_database_end_exact(
        spark, dsn, conn, second_dsn, fault_pipelines, monkeypatch):
    """The state domain_counts lives in a second database, written in its own transaction
    before the coordinator's. Agents are killed inside that transaction (nothing written)
    and between its COMMIT and the coordinator's (the second database ahead); the txid is
    then re-planned smaller (opaque) and a later one retried as it was. Every row's txid,
    value and prev_value, in both databases, equals the opaque reference
    (onceflow.core.opaque) fed with what each attempt read."""
    from onceflow.dev.localenv import airflow_connection_json
    from onceflow.spark.processing import process_batch

    monkeypatch.setenv("AIRFLOW_CONN_STATE2", airflow_connection_json(second_dsn))
    env = {**fault_pipelines, "AIRFLOW_CONN_STATE2": airflow_connection_json(second_dsn)}
    payloads = tweets_events(900, seed=SEED % 1000, poison_share=0, flaky_share=0)
    name = "tweets_external"
    pipeline = get_pipeline(name, batch_size=300)
    register(conn, pipeline, {"domain_counts": second_dsn}, create_source=True)
    pipeline.source.append(conn, payloads)
    second = db.connect(second_dsn)
    local: dict = {}  # external_url_counts, in the coordinator: committed attempts only
    external: dict = {}  # domain_counts: every attempt that passed its own COMMIT

    def check() -> None:
        assert state_rows(conn, "external_url_counts") == model_rows(local)
        assert state_rows(second, "domain_counts") == model_rows(external)

    def committed(batch, start, end) -> None:
        opaque.apply_batch(local, batch.attempt.txid, deltas(payloads, start, end, "url"))
        opaque.apply_batch(external, batch.attempt.txid,
                           deltas(payloads, start, end, "domain"), revert_absent=True)

    first = begin(conn, pipeline, "run-1")
    assert one_range(first) == (0, 300)
    process_batch(spark, dsn, pipeline, first.attempt)
    assert commit(conn, pipeline, first.attempt).status == "committed"
    committed(first, 0, 300)
    check()

    batch = begin(conn, pipeline, "run-2")
    assert one_range(batch) == (300, 600)
    process_batch(spark, dsn, pipeline, batch.attempt)
    killed_at(env, name, {"batch_size": 300}, batch, "external_open:domain_counts")
    check()  # its transaction in the second database died with it
    killed_at(env, name, {"batch_size": 300}, batch, "external:domain_counts")
    opaque.apply_batch(external, 2, deltas(payloads, 300, 600, "domain"), revert_absent=True)
    check()  # the second database is ahead: txid 2 there, txid 1 in the coordinator
    assert table(second, "SELECT count(*) FROM domain_counts WHERE txid = 2") != [(0,)]

    assert mark_failed(conn, name, batch.attempt, "killed twice")
    smaller = get_pipeline(name, batch_size=120)
    replay = begin(conn, smaller, "run-3")  # adopts txid 2, re-planned from txid 1's end
    assert replay.attempt.txid == 2 and one_range(replay) == (300, 420)
    process_batch(spark, dsn, smaller, replay.attempt)
    assert commit(conn, smaller, replay.attempt).status == "committed"
    committed(replay, 300, 420)  # what attempt 1 wrote and attempt 2 did not is put back
    check()

    bigger = get_pipeline(name, batch_size=1000)
    last = begin(conn, bigger, "run-4")
    assert one_range(last) == (420, 900)
    process_batch(spark, dsn, bigger, last.attempt)
    killed_at(env, name, {"batch_size": 1000}, last, "external:domain_counts")
    assert commit(conn, bigger, last.attempt).status == "committed"  # the task's retry
    committed(last, 420, 900)
    check()
    assert_exact(conn, pipeline, payloads, read_all=True, drained=True,
                 state_conns={"domain_counts": second})
    second.close()


def redis_records(client, prefix: str, pipeline: str, bolt: str) -> dict:
    """Every key of a bolt's state as Redis keeps it (onceflow.kvstate.redis_store's record
    "<txid>|<len v>|<len p>|<v><p>"), read raw: {key: Versioned(txid, value, prev)}."""
    out = {}
    for name in client.scan_iter(match=f"{prefix}{{{pipeline}/{bolt}}}:r:*"):
        for field, record in client.hgetall(name).items():
            txid, value_len, prev_len, texts = record.split("|", 3)
            value_len, prev_len = int(value_len), int(prev_len)
            value = json.loads(texts[:value_len]) if value_len >= 0 else opaque.ABSENT
            prev = json.loads(texts[len(texts) - prev_len:]) if prev_len >= 0 else opaque.ABSENT
            key = json.loads(field)  # keys are kept as JSON text
            assert key not in out, f"{key} in two namespaces"
            out[key] = opaque.Versioned(int(txid), value, prev)
    return out


@pytest.mark.timeout(400)
def test_kills_inside_a_key_value_commit_end_exact(spark, dsn, conn, fault_pipelines,
                                                   tmp_path):
    """A stateful bolt counts URLs in Redis (a private redis-server, AOF on every write).
    Agents are killed before Redis's commit and after it (Redis ahead of the coordinator);
    while one is paused there Redis itself is SIGKILLed and restarted; the txid is re-planned
    smaller, and a later one retried as it was. Every key's txid, value and previous value
    in Redis, and every row of the coordinator's tables, equals the opaque reference fed
    with what each attempt read."""
    import fault_pipelines as module
    from pyspark.cloudpickle import register_pickle_by_value
    from redis_server import RedisServer, answers

    from onceflow.spark.processing import process_batch

    register_pickle_by_value(module)  # its bolt runs in Spark's Python workers
    server = RedisServer(tmp_path / "redis", persistent=True).start()
    client = redis.Redis(host="127.0.0.1", port=server.port, decode_responses=True)
    prefix = "faults:"
    config = json.dumps({"host": "127.0.0.1", "port": server.port, "key_prefix": prefix})
    payloads = tweets_events(900, seed=SEED % 1000, poison_share=0, flaky_share=0)
    name = "tweets_tally"

    def settings(size: int) -> dict:
        return {"batch_size": size, "state_provider_config": config}

    pipeline = get_pipeline(name, **settings(300))
    register(conn, pipeline, create_source=True)
    pipeline.source.append(conn, payloads)
    kv: dict = {}  # Redis: every attempt whose Redis commit ran
    counts: dict = {}  # tally_fs_url_counts, in the coordinator

    def check() -> None:
        assert redis_records(client, prefix, name, "tally") == kv
        assert state_rows(conn, "tally_fs_url_counts") == model_rows(counts)

    def redis_committed(batch, start, end) -> None:
        opaque.apply_batch(kv, batch.attempt.txid, deltas(payloads, start, end, "url"),
                           revert_absent=True)

    def committed(batch, start, end) -> None:
        redis_committed(batch, start, end)
        opaque.apply_batch(counts, batch.attempt.txid, deltas(payloads, start, end, "url"))

    try:
        first = begin(conn, pipeline, "run-1")
        assert one_range(first) == (0, 300)
        process_batch(spark, dsn, pipeline, first.attempt)
        assert commit(conn, pipeline, first.attempt, coordinator_dsn=dsn,
                      open_state=open_state_provider).status == "committed"
        committed(first, 0, 300)
        check()

        batch = begin(conn, pipeline, "run-2")
        assert one_range(batch) == (300, 600)
        process_batch(spark, dsn, pipeline, batch.attempt)
        killed_at(fault_pipelines, name, settings(300), batch, "kv_recovered")
        check()  # Redis untouched
        agent = Agent(["commit", "--pipeline", name, "--settings",
                       json.dumps(settings(300)), "--txid", "2", "--attempt", "1",
                       "--pause-at", "kv_state"], fault_pipelines)
        try:
            assert agent.wait_paused().where == "commit:kv_state"
            old_pid = server.process.pid
            server.kill()  # Redis crashes with the attempt committed in it...
            assert server.process.returncode == -signal.SIGKILL
            server.start()  # ...and comes back from its append-only file
            assert server.process.pid != old_pid and answers("127.0.0.1", server.port)
            assert agent.kill().killed
        finally:
            agent.stop()
        redis_committed(batch, 300, 600)
        check()  # Redis ahead of the coordinator, as kept on disk

        assert mark_failed(conn, name, batch.attempt, "killed twice")
        smaller = get_pipeline(name, **settings(120))
        replay = begin(conn, smaller, "run-3")
        assert replay.attempt.txid == 2 and one_range(replay) == (300, 420)
        process_batch(spark, dsn, smaller, replay.attempt)  # reads the values before txid 2
        assert commit(conn, smaller, replay.attempt, coordinator_dsn=dsn,
                      open_state=open_state_provider).status == "committed"
        committed(replay, 300, 420)
        check()

        bigger = get_pipeline(name, **settings(1000))
        last = begin(conn, bigger, "run-4")
        assert one_range(last) == (420, 900)
        process_batch(spark, dsn, bigger, last.attempt)
        killed_at(fault_pipelines, name, settings(1000), last, "kv_state")
        assert commit(conn, bigger, last.attempt, coordinator_dsn=dsn,
                      open_state=open_state_provider).status == "committed"
        committed(last, 420, 900)
        check()
        everything = deltas(payloads, 0, 900, "url")
        assert {k: v.value for k, v in kv.items()} == everything  # (the model's own sum)
        assert dict(table(conn, "SELECT key, value FROM tally_first_seen_urls")) == dict.fromkeys(
            everything, 1)
        assert_exact(conn, pipeline, payloads, read_all=True, drained=True)
    finally:
        client.close()
        server.stop()
