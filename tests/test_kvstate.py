"""Key-value state of stateful bolts (onceflow.kvstate) on every provider: real PostgreSQL (the
coordinator's database and another one), real Redis (the service, or a private one), memory.

The crash tests play the coordinator by hand: "the coordinator commits" means the test's model
takes that attempt's changes; a crash is simply the step that does not happen.
"""

from __future__ import annotations

import logging
import os
import random
import uuid

import psycopg2
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg2 import sql
from redis_server import RedisServer, free_port

from onceflow.core import db
from onceflow.core.errors import ConfigError
from onceflow.core.txlog import TransactionAttempt
from onceflow.dev.localenv import airflow_connection_json
from onceflow.kvstate import (
    DELETED,
    KeyValueState,
    NotPrepared,
    RecoveryNeeded,
    StaleBatch,
    StateBehind,
    open_provider,
)

P, B = "tweets", "counter"
PROVIDERS = ["memory", "postgres", "postgres_other_db", "redis"]


def ta(txid: int, attempt: int = 1) -> TransactionAttempt:
    return TransactionAttempt(txid, attempt)


@pytest.fixture(scope="module")
def redis_service(tmp_path_factory):
    """A private Redis on a free port, keeping nothing on disk: the machine's own server (if
    any) is never written to."""
    server = RedisServer(tmp_path_factory.mktemp("redis"), persistent=False).start()
    yield "127.0.0.1", server.port
    server.stop()


@pytest.fixture
def redis_config(redis_service):
    """Settings for the service with a key prefix of this test's own; its keys go afterwards."""
    host, port = redis_service
    prefix = f"onceflow-test-{uuid.uuid4().hex[:12]}:"
    yield {"host": host, "port": port, "key_prefix": prefix}
    client = redis.Redis(host=host, port=port)
    keys = list(client.scan_iter(match=prefix + "*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture(scope="module")
def kv_databases(template_db):
    """(coordinator, other): a migrated coordinator database and an empty one, for this module.

    The provider tests share them and empty the kv_state tables first (cheaper than a new
    database per test); the tests that need more use the per-test ``dsn`` fixture.
    """
    server = os.environ["ONCEFLOW_PG_DSN"]
    names = [f"onceflow_kv_{os.getpid()}", f"onceflow_kv_other_{os.getpid()}"]
    admin = psycopg2.connect(db.with_database(server, "postgres"))
    admin.autocommit = True
    with admin.cursor() as cur:
        for name, template in zip(names, [template_db, None], strict=True):
            cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))
            cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)) if not template
                        else sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                            sql.Identifier(name), sql.Identifier(template)))
    yield tuple(db.with_database(server, name) for name in names)
    with admin.cursor() as cur:
        for name in names:
            cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))
    admin.close()


def empty_kv_tables(dsn: str) -> None:
    with db.connection(dsn) as conn, db.transaction(conn) as cur:
        cur.execute("SELECT to_regclass('kv_state_bolts') IS NOT NULL")
        if cur.fetchone()[0]:
            cur.execute("TRUNCATE kv_state, kv_state_prepared, kv_state_attempts, kv_state_bolts")


@pytest.fixture(params=PROVIDERS)
def opener(request):
    """A function opening a new provider of this kind on the same store (a worker restart)."""
    kind = request.param
    opened = []
    if kind == "memory":
        args = ("memory", None, f"memory-{uuid.uuid4().hex}")
    elif kind == "postgres":
        coordinator, _ = request.getfixturevalue("kv_databases")
        empty_kv_tables(coordinator)
        args = ("postgres", None, coordinator)
    elif kind == "postgres_other_db":
        coordinator, other = request.getfixturevalue("kv_databases")
        empty_kv_tables(other)
        args = ("postgres", {"dsn": other}, coordinator)
    else:
        args = ("redis", request.getfixturevalue("redis_config"), "unused")

    def open_again():
        provider = open_provider(args[0], args[1], coordinator_dsn=args[2])
        opened.append(provider)
        return provider

    open_again.kind = kind
    yield open_again
    for provider in opened:
        provider.close()


@pytest.fixture
def store(opener):
    return opener()


def commit_batch(store, txid: int, changes, attempt: int = 1) -> int:
    store.prepare(P, B, ta(txid, attempt), changes)
    return store.commit(P, B, ta(txid, attempt))


def state(store, txid: int, namespace: str = "s0") -> dict:
    """The whole namespace as a batch ``txid`` sees it."""
    return dict(store.scan(P, B, namespace, txid=txid))


def puts(namespace: str = "s0", **values) -> list:
    return [(namespace, key, value) for key, value in values.items()]


# -- prepare / commit / rollback -----------------------------------------------------------------

def test_prepare_commit_rollback(store):
    store.prepare(P, B, ta(1), puts(a=1, b=2))
    assert store.prepared(P, B) == [ta(1)]
    assert state(store, 2) == {}  # prepared changes are invisible until commit
    assert store.commit(P, B, ta(1)) == 2
    assert store.prepared(P, B) == []
    assert state(store, 2) == {"a": 1, "b": 2}

    store.prepare(P, B, ta(2, 1), puts(a=10))
    store.prepare(P, B, ta(2, 2), puts(a=20, c=3))
    assert store.prepared(P, B) == [ta(2, 1), ta(2, 2)]
    assert store.rollback(P, B, 2, 1) == 1
    assert store.prepared(P, B) == [ta(2, 2)]
    with pytest.raises(NotPrepared, match="txid 2 attempt 1 has nothing prepared"):
        store.commit(P, B, ta(2, 1))
    assert store.rollback(P, B, 2) == 2  # every attempt of txid 2
    assert store.prepared(P, B) == []
    assert state(store, 3) == {"a": 1, "b": 2}


def test_prepare_again_replaces_the_earlier_prepare_of_that_attempt(store):
    store.prepare(P, B, ta(1), puts(a=1, b=1))
    assert store.prepare(P, B, ta(1), puts(a=2)) == 1  # a retried task prepares again
    assert store.commit(P, B, ta(1)) == 1
    assert state(store, 2) == {"a": 2}


def test_an_empty_change_set_is_prepared_and_committed(store):
    commit_batch(store, 1, puts(a=1))
    store.prepare(P, B, ta(2), [])
    assert store.prepared(P, B) == [ta(2)]
    assert store.commit(P, B, ta(2)) == 0
    assert store.prepared(P, B) == []
    assert state(store, 3) == {"a": 1}


def test_parts_of_one_attempt_prepare_separately_and_commit_together(store):
    store.prepare(P, B, ta(1), puts("s0", a=1), part=0)
    store.prepare(P, B, ta(1), puts("s1", b=2), part=1)
    store.prepare(P, B, ta(1), puts("s0", a=5), part=0)  # part 0's task retried
    assert store.commit(P, B, ta(1)) == 2
    assert (state(store, 2, "s0"), state(store, 2, "s1")) == ({"a": 5}, {"b": 2})

    store.prepare(P, B, ta(2), puts("s0", a=6), part=0)
    with pytest.raises(ValueError, match="two parts|another part"):
        store.prepare(P, B, ta(2), puts("s0", a=7), part=1)
        store.commit(P, B, ta(2))
    assert state(store, 3, "s0") == {"a": 5}


# -- reads ---------------------------------------------------------------------------------------

def test_reads_see_the_state_as_of_before_their_txid(store):
    commit_batch(store, 1, puts(a=1, b=1))
    commit_batch(store, 2, [("s0", "a", 2), ("s0", "b", DELETED), ("s0", "c", 3)])
    assert store.read(P, B, "s0", ["a", "b", "c", "zz"], txid=2) == {"a": 1, "b": 1}
    assert state(store, 2) == {"a": 1, "b": 1}
    assert store.read(P, B, "s0", ["a", "b", "c", "zz"], txid=3) == {"a": 2, "c": 3}
    assert state(store, 3) == {"a": 2, "c": 3}
    assert state(store, 3, "other") == {}
    with pytest.raises(StaleBatch, match="written by txid 2"):
        store.read(P, B, "s0", ["a"], txid=1)


def test_deletes_and_json_null_are_distinct(store):
    nested = {"x": [1, None, "é", 2.5, True], "y": {}}
    commit_batch(store, 1, puts(a=None, b=1, c=nested, d=""))
    commit_batch(store, 2, [("s0", "b", DELETED), ("s0", "a", None)])
    assert state(store, 2) == {"a": None, "b": 1, "c": nested, "d": ""}
    assert state(store, 3) == {"a": None, "c": nested, "d": ""}
    view = KeyValueState(store, P, B, "s0", 3, prefetch=["a", "b"])
    assert view.get("a", "default") is None  # a stored JSON null
    assert view.get("b", "default") == "default"  # deleted: no value
    assert view.get("c") == nested  # not prefetched: read on first use
    view.delete("a")
    view.put("b", None)
    assert dict(view) == {"b": None, "c": nested, "d": ""}
    commit_batch(store, 3, view.changes())
    assert state(store, 4) == {"b": None, "c": nested, "d": ""}


def test_key_value_state_overlays_its_batch_and_lists_changes(store):
    commit_batch(store, 1, puts(a=1, b=2, c=3))
    view = KeyValueState(store, P, B, "s0", 2, prefetch=["a", "b", "missing"])
    view.put("a", view.get("a") + 10)
    view.delete("c")
    view.put("new", [1, 2])
    assert view.get("missing", 0) == 0
    assert view.get("c", "gone") == "gone"
    assert sorted(view) == [("a", 11), ("b", 2), ("new", [1, 2])]
    assert view.changes() == [("s0", "a", 11), ("s0", "c", DELETED), ("s0", "new", [1, 2])]
    assert state(store, 2) == {"a": 1, "b": 2, "c": 3}  # nothing stored before prepare/commit
    assert view.prepare(1) == 3
    store.commit(P, B, ta(2))
    assert state(store, 3) == {"a": 11, "b": 2, "new": [1, 2]}


@pytest.mark.parametrize("value", [
    {1, 2},  # a set has no JSON form
    (1, 2),  # a tuple would come back as a list
    float("nan"),  # not JSON
    b"bytes",
    {1: "int key"},  # would come back with the key "1"
    [object()],
])
def test_put_refuses_values_that_are_not_json_safe(value):
    provider = open_provider("memory", None, coordinator_dsn=f"memory-{uuid.uuid4().hex}")
    view = KeyValueState(provider, P, B, "s0", 1)
    with pytest.raises(TypeError, match="state value for key 'k1' is not JSON-safe"):
        view.put("k1", value)
    assert view.changes() == []


# -- crashes and recovery ------------------------------------------------------------------------

def test_crash_after_store_commit_then_replays_with_other_changes(store):
    commit_batch(store, 1, puts(a=1, b=1, x=0))
    # Attempt 1 of txid 2 reaches the store; the coordinator crashes before its commit.
    commit_batch(store, 2, [("s0", "a", 2), ("s0", "b", DELETED), ("s0", "c", 3)], attempt=1)
    # Attempt 2 (another batch, opaque re-plan) still reads the state as of before txid 2.
    view = KeyValueState(store, P, B, "s0", 2, prefetch=["a", "b", "c"])
    assert (view.get("a"), view.get("b"), view.get("c")) == (1, 1, None)
    view.put("a", view.get("a") + 10)
    view.put("d", 4)
    view.prepare(2)
    store.commit(P, B, ta(2, 2))  # ... and crashes again before the coordinator's commit
    assert state(store, 3) == {"a": 11, "b": 1, "x": 0, "d": 4}
    assert state(store, 2) == {"a": 1, "b": 1, "x": 0}
    # Attempt 3 changes only b: a and d go back to before txid 2.
    commit_batch(store, 2, puts(b=5), attempt=3)  # the coordinator commits this one
    assert state(store, 3) == {"a": 1, "b": 5, "x": 0}
    commit_batch(store, 3, puts(a=7))
    assert state(store, 4) == {"a": 7, "b": 5, "x": 0}
    assert state(store, 3) == {"a": 1, "b": 5, "x": 0}


def test_crash_after_coordinator_commit_then_recover(opener):
    store = opener()
    commit_batch(store, 1, puts(a=1, b=1))
    store.prepare(P, B, ta(2, 1), puts(a=2))  # superseded attempt, never committed
    store.prepare(P, B, ta(2, 2), [("s0", "a", 3), ("s0", "b", DELETED)])
    # The coordinator commits txid 2 attempt 2; the worker dies before the store's commit.
    store.close()
    store = opener()
    assert state(store, 3) == {"a": 1, "b": 1}  # not committed here yet
    report = store.recover(P, B, lambda t: t == ta(2, 2))
    assert (report.committed, report.rolled_back, report.kept) == ([ta(2, 2)], [ta(2, 1)], [])
    assert state(store, 3) == {"a": 3}
    assert store.prepared(P, B) == []
    assert store.commit(P, B, ta(2, 2)) == 0  # the commit phase's own try: a no-op now
    assert state(store, 3) == {"a": 3}

    store.prepare(P, B, ta(3), puts(a=4))  # in flight: neither committed nor dead
    report = store.recover(P, B, lambda t: None)
    assert (report.committed, report.rolled_back, report.kept) == ([], [], [ta(3)])
    assert store.prepared(P, B) == [ta(3)]
    assert store.commit(P, B, ta(3)) == 1
    assert state(store, 4) == {"a": 4}


def test_commit_twice_is_a_no_op(store):
    commit_batch(store, 1, puts(a=1))
    assert store.commit(P, B, ta(1)) == 0
    commit_batch(store, 2, puts(a=2, b=1))
    assert store.commit(P, B, ta(2)) == 0
    assert store.commit(P, B, ta(1)) == 0  # an older committed txid: nothing happens
    assert state(store, 3) == {"a": 2, "b": 1}
    with pytest.raises(StaleBatch, match="cannot prepare"):
        store.prepare(P, B, ta(2), puts(a=99))  # the committed attempt, prepared again
    with pytest.raises(StaleBatch, match="cannot prepare"):
        store.prepare(P, B, ta(1, 2), puts(a=99))
    assert state(store, 3) == {"a": 2, "b": 1}


def test_commit_refuses_while_a_lower_txid_is_prepared(store):
    commit_batch(store, 1, puts(a=1))
    store.prepare(P, B, ta(2), puts(a=2))
    store.prepare(P, B, ta(3), puts(a=3))
    with pytest.raises(RecoveryNeeded, match="run recover"):
        store.commit(P, B, ta(3))
    assert state(store, 4) == {"a": 1}
    store.recover(P, B, lambda t: True if t.txid == 2 else None)
    assert store.commit(P, B, ta(3)) == 1
    assert state(store, 4) == {"a": 3}


def test_a_batch_reads_state_only_after_the_previous_txid_committed(store):
    commit_batch(store, 1, puts(a=1))
    store.prepare(P, B, ta(2), puts(a=2))  # the coordinator committed it; the store has not
    with pytest.raises(StateBehind, match=r"txid 2 is not committed there.*run recover\(\)"):
        KeyValueState(store, P, B, "s0", 3)
    store.recover(P, B, lambda t: True)
    assert KeyValueState(store, P, B, "s0", 3).get("a") == 2
    with pytest.raises(StateBehind, match="txid 3 is not committed there"):
        KeyValueState(store, P, B, "s0", 4)  # txid 3 still processing (max_pending > 1)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_crashes_end_exactly_where_the_coordinator_says(opener, seed):
    """Counters incremented by every batch, with crashes on either side of the coordinator's
    commit and repeated commits; after each txid the state equals a plain dict that took only
    the attempts the coordinator committed."""
    rng = random.Random(seed)
    store = opener()
    keys = [f"k{i}" for i in range(6)]
    model: dict[str, dict] = {"s0": {}, "s1": {}}

    def run_attempt(txid: int, attempt: int) -> dict:
        """Process one attempt: read-modify-write counters, delete some, prepare."""
        changes = {}
        for namespace in model:
            view = KeyValueState(store, P, B, namespace, txid, prefetch=keys[:3])
            for key in rng.sample(keys, 3):
                if rng.random() < 0.2:
                    view.delete(key)
                else:
                    view.put(key, view.get(key, 0) + rng.randint(1, 9))
            changes[namespace] = view.changes()
            store.prepare(P, B, ta(txid, attempt),
                          [c for cs in changes.values() for c in cs])
        return changes

    for txid in range(1, 9):
        attempt = 1
        while True:
            changes = run_attempt(txid, attempt)
            fate = rng.choice(["ok", "store_crash", "coordinator_crash", "double", "superseded"])
            if fate == "superseded":  # the attempt fails before commit; a new one begins
                store.recover(P, B, lambda t, a=attempt, x=txid: False if t == ta(x, a) else None)
                attempt += 1
                continue
            if fate == "store_crash":  # stored, but the coordinator never commits it
                store.commit(P, B, ta(txid, attempt))
                attempt += 1
                continue
            if fate == "coordinator_crash":  # committed by the coordinator, not by the store
                store.close()
                store = opener()
                store.recover(P, B, lambda t, a=attempt, x=txid: t == ta(x, a))
            else:
                store.commit(P, B, ta(txid, attempt))
                if fate == "double":
                    assert store.commit(P, B, ta(txid, attempt)) == 0
            for namespace, cs in changes.items():
                for _, key, value in cs:
                    if value is DELETED:
                        model[namespace].pop(key, None)
                    else:
                        model[namespace][key] = value
            break
        for namespace, expected in model.items():
            assert state(store, txid + 1, namespace) == expected, (txid, namespace)
    assert store.prepared(P, B) == []


# -- provider specifics --------------------------------------------------------------------------

def test_postgres_commit_joins_the_coordinators_transaction(dsn):
    store = open_provider("postgres", None, coordinator_dsn=dsn)
    assert store.atomic_with_coordinator
    store.prepare(P, B, ta(1), puts(a=1))
    with db.connection(dsn) as conn:
        with pytest.raises(RuntimeError, match="coordinator failed"):
            with db.transaction(conn) as cur:
                assert store.commit(P, B, ta(1), cur=cur) == 1
                raise RuntimeError("coordinator failed after the state's statements")
        assert state(store, 2) == {}  # rolled back with the coordinator's transaction
        assert store.prepared(P, B) == [ta(1)]
        with db.transaction(conn) as cur:
            store.commit(P, B, ta(1), cur=cur)
    assert state(store, 2) == {"a": 1}
    store.close()


def test_a_store_outside_the_coordinators_database_refuses_its_cursor(dsn, second_dsn,
                                                                       redis_config):
    other = open_provider("postgres", {"dsn": second_dsn}, coordinator_dsn=dsn)
    in_redis = open_provider("redis", redis_config, coordinator_dsn=dsn)
    assert not other.atomic_with_coordinator and not in_redis.atomic_with_coordinator
    with db.connection(dsn) as conn, db.transaction(conn) as cur:
        for provider in (other, in_redis):
            provider.prepare(P, B, ta(1), puts(a=1))
            with pytest.raises(ValueError, match="not in the coordinator's database"):
                provider.commit(P, B, ta(1), cur=cur)
            assert provider.prepared(P, B) == [ta(1)]
    other.close()
    in_redis.close()


def test_postgres_state_by_airflow_connection_id(dsn, second_dsn, monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_KV_STATES", airflow_connection_json(second_dsn))
    store = open_provider("postgres", {"conn_id": "kv_states"}, coordinator_dsn=dsn)
    assert not store.atomic_with_coordinator
    commit_batch(store, 1, puts(a=1))
    with db.connection(second_dsn) as conn, db.transaction(conn) as cur:
        cur.execute("SELECT key, value FROM kv_state")
        assert cur.fetchall() == [("a", 1)]
    store.close()


def test_deleted_keys_are_dropped_once_no_replay_needs_them(dsn, redis_config):
    pg = open_provider("postgres", None, coordinator_dsn=dsn)
    rd = open_provider("redis", redis_config, coordinator_dsn=dsn)
    client = redis.Redis(host=redis_config["host"], port=redis_config["port"])
    records = f"{redis_config['key_prefix']}{{{P}/{B}}}:r:s0"

    def stored() -> tuple[int, int]:
        with db.connection(dsn) as conn, db.transaction(conn) as cur:
            cur.execute("SELECT count(*) FROM kv_state")
            return cur.fetchone()[0], client.hlen(records)

    for provider in (pg, rd):
        commit_batch(provider, 1, puts(a=1, b=1))
        commit_batch(provider, 2, [("s0", "b", DELETED), ("s0", "never", DELETED)])
    assert stored() == (2, 2)  # b keeps its value before txid 2 for a replay of txid 2
    for provider in (pg, rd):
        commit_batch(provider, 3, puts(a=2))
        assert state(provider, 4) == {"a": 2}
    assert stored() == (1, 1)  # txid 2 cannot replay once txid 3 committed
    client.close()
    pg.close()
    rd.close()


def test_redis_restart_between_batches_loses_nothing_committed(tmp_path):
    server = RedisServer(tmp_path / "redis", persistent=True).start()
    config = {"port": server.port, "require_persistence": True, "key_serializer": "string"}
    try:
        store = open_provider("redis", config, coordinator_dsn="unused")
        commit_batch(store, 1, puts(a=1, b={"n": [1, 2]}, c=None))
        store.prepare(P, B, ta(2), [("s0", "a", 2), ("s0", "c", DELETED)])
        store.close()
        server.kill()  # SIGKILL between batches: no shutdown save
        server.start()
        store = open_provider("redis", config, coordinator_dsn="unused")
        assert state(store, 2) == {"a": 1, "b": {"n": [1, 2]}, "c": None}
        assert store.prepared(P, B) == [ta(2)]
        store.recover(P, B, lambda t: t == ta(2))
        assert state(store, 3) == {"a": 2, "b": {"n": [1, 2]}}
        server.kill()
        server.start()
        store.close()
        store = open_provider("redis", config, coordinator_dsn="unused")
        assert state(store, 3) == {"a": 2, "b": {"n": [1, 2]}}
        assert state(store, 2) == {"a": 1, "b": {"n": [1, 2]}, "c": None}  # prev survived too
        store.close()
    finally:
        server.stop()


def test_redis_without_persistence_warns(redis_config, caplog):
    caplog.set_level(logging.WARNING, logger="onceflow.kvstate")
    for _ in range(3):  # as every Spark task of a batch opens it: said once per process
        open_provider("redis", redis_config, coordinator_dsn="unused").close()
    assert caplog.text.count("a restart of Redis loses every committed state") == 1


# -- configuration -------------------------------------------------------------------------------

# (provider, config, phrases the ConfigError must contain)
BAD_CONFIGS = [
    # an unknown provider names the choices
    ("mongo", None, ["state.provider='mongo' is invalid: choose one of memory, postgres, redis"]),
    # pickle is never a serializer, for values or keys
    ("redis", {"value_serializer": "pickle"},
     ["state.provider_config.value_serializer='pickle' is invalid", "use json"]),
    ("redis", {"key_serializer": "pickle"},
     ["state.provider_config.key_serializer='pickle' is invalid", "choose json or string"]),
    # unknown settings are named (Storm's nested jedisPoolConfig too)
    ("redis", {"colour": "red", "jedisPoolConfig": {}},
     ["unknown setting(s) colour, jedisPoolConfig", "colour='red'", "redis knows: host, port"]),
    ("memory", {"dsn": "x"}, ["unknown setting(s) dsn", "memory knows: none"]),
    # wrong types
    ("redis", {"port": "6379"}, ["state.provider_config.port='6379' is invalid", "1-65535"]),
    ("redis", {"timeout": 0}, ["state.provider_config.timeout=0 is invalid", "milliseconds"]),
    ("redis", {"key_prefix": "{x}"}, ["state.provider_config.key_prefix='{x}'", "braces"]),
    ("redis", '{"port": ', ["state.provider_config='{\"port\": ' is invalid: give a JSON object"]),
    ("postgres", {"dsn": "x", "conn_id": "y"}, ["give dsn or conn_id, not both"]),
]


@pytest.mark.parametrize("provider, config, phrases", BAD_CONFIGS)
def test_bad_configuration_names_setting_value_and_fix(provider, config, phrases):
    with pytest.raises(ConfigError) as error:
        open_provider(provider, config, coordinator_dsn="unused")
    for phrase in phrases:
        assert phrase in str(error.value)


def test_unreachable_redis_names_the_address_and_what_to_check():
    port = free_port()  # nothing listens there
    with pytest.raises(ConfigError) as error:
        open_provider("redis", {"port": port, "timeout": 500}, coordinator_dsn="unused")
    message = str(error.value)
    assert f"host:port='127.0.0.1:{port}' is unreachable" in message
    assert "check that redis-server runs at" in message


def test_unreachable_postgres_names_the_database_without_password(dsn):
    bad = db.with_database(dsn, "onceflow_nowhere").replace("dbname=", "password=s3cret dbname=")
    with pytest.raises(ConfigError) as error:
        open_provider("postgres", {"dsn": bad}, coordinator_dsn=dsn)
    message = str(error.value)
    assert "state.provider_config.dsn=" in message and "onceflow_nowhere" in message
    assert "is unreachable" in message and "s3cret" not in message


def test_require_persistence_refuses_a_redis_that_keeps_nothing(redis_config):
    with pytest.raises(ConfigError) as error:
        open_provider("redis", {**redis_config, "require_persistence": True},
                      coordinator_dsn="unused")
    message = str(error.value)
    assert "require_persistence=True is not met" in message
    assert "appendonly yes" in message


# -- one rule, one reference, every store -------------------------------------------------------
_KEYS = ["a", "b", "c", "d"]
_change = st.one_of(st.integers(-5, 5), st.just(DELETED), st.none())  # None: JSON null
# a txid's attempts, each a change set; every attempt commits in the store (the store is not
# the coordinator: a crash after its commit makes the next attempt of the same txid replay)
_txid = st.lists(st.dictionaries(st.sampled_from(_KEYS), _change, max_size=4),
                 min_size=1, max_size=3)


@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(plan=st.lists(_txid, min_size=1, max_size=5))
def test_every_store_follows_the_opaque_reference(opener, plan):
    """Replays of a txid with other changes, a new txid after a failed attempt: every store
    equals onceflow.core.opaque, the one pure reference."""
    from onceflow.core import opaque

    store = opener()
    bolt = f"prop-{uuid.uuid4().hex[:10]}"
    reference: dict[str, opaque.Versioned] = {}
    for txid, attempts in enumerate(plan, start=1):
        for attempt, changes in enumerate(attempts, start=1):
            store.prepare(P, bolt, ta(txid, attempt), [("s0", k, v) for k, v in changes.items()])
            store.commit(P, bolt, ta(txid, attempt))
            for key in [k for k, v in reference.items() if v.txid == txid and k not in changes]:
                back = opaque.put_back(reference[key], txid)
                if back is None or (back.value is opaque.ABSENT and back.prev is opaque.ABSENT):
                    reference.pop(key)
                else:
                    reference[key] = back
            for key, value in changes.items():
                new = opaque.ABSENT if value is DELETED else value
                reference[key] = opaque.write(reference.get(key), txid, new)
        after = len(plan) + 1
        expected = {k: v for k, v in ((k, opaque.seen(r, after)) for k, r in reference.items())
                    if v is not opaque.ABSENT}
        assert store.read(P, bolt, "s0", _KEYS, txid=after) == expected, (txid, attempts)
