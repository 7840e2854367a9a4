"""open_provider: a provider from (name, config) as a pipeline declares them, checked up front.

Every refusal is a ConfigError naming the setting, the value and the fix.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import psycopg2
from psycopg2.extensions import parse_dsn

from onceflow.core.connections import resolve_dsn, safe_dsn
from onceflow.core.errors import ConfigError, Unreachable
from onceflow.core.pipeline import Pipeline
from onceflow.core.stateful import stateful_bolts
from onceflow.kvstate.base import Provider, log
from onceflow.kvstate.memory import MemoryProvider
from onceflow.kvstate.postgres import PostgresProvider

PROVIDERS = ("memory", "postgres", "redis")
REDIS_DEFAULTS: dict[str, Any] = {
    "host": "127.0.0.1",
    "port": 6379,
    "timeout": 2000,  # milliseconds, as Storm's jedisPoolConfig
    "database": 0,
    "password": None,
    "key_serializer": "json",
    "value_serializer": "json",
    "require_persistence": False,
    "key_prefix": "onceflow:",
}
SETTINGS = {"memory": (), "postgres": ("dsn", "conn_id"), "redis": tuple(REDIS_DEFAULTS)}
KEY_SERIALIZERS = ("json", "string")
VALUE_SERIALIZERS = ("json",)


def _check(ok: bool, name: str, value: Any, fix: str) -> None:
    if not ok:
        raise ConfigError(f"state.provider_config.{name}={value!r} is invalid: {fix}")


def _as_mapping(config: Mapping | str | None) -> Mapping:
    if config is None or config == "":
        return {}
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError as error:
            raise ConfigError(f"state.provider_config={config!r:.200} is invalid: give a JSON "
                              f"object ({error})") from error
    if not isinstance(config, Mapping):
        raise ConfigError(f"state.provider_config={config!r:.200} is invalid: give a JSON object "
                          "(a mapping of setting to value)")
    return config


def open_provider(provider: str | None, config: Mapping | str | None = None, *,
                  coordinator_dsn: str) -> Provider:
    """The state provider ``provider`` ("memory", "postgres" (default) or "redis") with its
    ``config`` (a mapping or a JSON object), connected and checked."""
    provider = provider or "postgres"
    if provider not in PROVIDERS:
        raise ConfigError(f"state.provider={provider!r} is invalid: choose one of "
                          f"{', '.join(PROVIDERS)}")
    config = _as_mapping(config)
    unknown = sorted(set(config) - set(SETTINGS[provider]))
    if unknown:
        known = ", ".join(SETTINGS[provider]) or "none"
        raise ConfigError(
            f"state.provider_config has unknown setting(s) {', '.join(unknown)} "
            f"({', '.join(f'{k}={config[k]!r}' for k in unknown)}) for state.provider="
            f"{provider!r}: remove them; {provider} knows: {known}")
    if provider == "memory":

        log.info("kv state: in-memory provider (not durable: a process exit loses the state)")
        return MemoryProvider(coordinator_dsn)
    if provider == "postgres":
        return _open_postgres(config, coordinator_dsn)
    return _open_redis({**REDIS_DEFAULTS, **config})


# -- postgres -----------------------------------------------------------------------------------
def _open_postgres(config: Mapping, coordinator_dsn: str) -> Provider:
    dsn, conn_id = config.get("dsn"), config.get("conn_id")
    _check(not (dsn and conn_id), "conn_id", conn_id, "give dsn or conn_id, not both")
    _check(dsn is None or (isinstance(dsn, str) and dsn.strip()), "dsn", dsn,
           "give a libpq DSN, e.g. postgresql://user@host:5432/states")
    _check(conn_id is None or (isinstance(conn_id, str) and conn_id.strip()), "conn_id",
           conn_id, "give the id of an Airflow connection of type postgres")
    if conn_id:
        dsn = _connection_dsn(conn_id)
    target = dsn or coordinator_dsn
    setting = "conn_id" if conn_id else "dsn"
    try:
        atomic = _same_database(target, coordinator_dsn)
        provider = PostgresProvider(target, atomic_with_coordinator=atomic)
    except (psycopg2.Error, Unreachable) as error:
        raise ConfigError(
            f"state.provider_config.{setting}={conn_id or safe_dsn(target)!r} is unreachable "
            f"({str(error).strip()}): check the host, port, database name and credentials, and "
            "that PostgreSQL runs there") from error
    log.info("kv state: postgres provider in database %s (%s the coordinator's transaction)",
             parse_dsn(target).get("dbname"), "atomic with" if atomic else "outside")
    return provider


def _same_database(dsn: str, other: str) -> bool:
    def where(d: str) -> tuple:
        p = parse_dsn(d)
        return (p.get("host", "localhost"), str(p.get("port", "5432")), p.get("dbname"))

    return where(dsn) == where(other)


def _connection_dsn(conn_id: str) -> str:
    """The DSN of an Airflow connection (onceflow.core.connections)."""
    return resolve_dsn(conn_id, setting="state.provider_config.conn_id")


# -- redis --------------------------------------------------------------------------------------
def _open_redis(config: dict) -> Provider:
    try:
        import redis  # an optional dependency: the `redis` extra
    except ImportError as missing:
        raise ConfigError("state_provider='redis' needs the redis client: "
                          "pip install 'onceflow[redis]'") from missing
    # imported here: redis is the optional `redis` extra
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from onceflow.kvstate.redis_store import RedisProvider  # imports redis: the extra's

    host, port = config["host"], config["port"]
    _check(isinstance(host, str) and bool(host), "host", host, "give a host name or address")
    _check(type(port) is int and 0 < port < 65536, "port", port, "give a TCP port, 1-65535")
    timeout = config["timeout"]
    _check(type(timeout) in (int, float) and timeout > 0, "timeout", timeout,
           "give a positive number of milliseconds, e.g. 2000")
    database = config["database"]
    _check(type(database) is int and database >= 0, "database", database,
           "give a Redis database number, 0 or more")
    _check(config["password"] is None or isinstance(config["password"], str), "password",
           "<hidden>", "give a string, or null for no password")
    _check(config["key_serializer"] in KEY_SERIALIZERS, "key_serializer",
           config["key_serializer"],
           "choose json or string (state is stored as JSON text; pickle and other "
           "serializers are refused: loading them can run code)")
    _check(config["value_serializer"] in VALUE_SERIALIZERS, "value_serializer",
           config["value_serializer"],
           "use json (values must be JSON-safe; pickle and other serializers are refused: "
           "loading them can run code)")
    _check(type(config["require_persistence"]) is bool, "require_persistence",
           config["require_persistence"], "give true or false")
    prefix = config["key_prefix"]
    _check(isinstance(prefix, str) and "{" not in prefix and "}" not in prefix, "key_prefix",
           prefix, "give a string without braces (they make Redis hash tags), e.g. 'onceflow:'")

    settings = dict(host=host, port=port, db=database, password=config["password"],
                    socket_timeout=timeout / 1000, socket_connect_timeout=timeout / 1000,
                    decode_responses=True)
    # The first contact does not retry: a wrong address fails at once, with the message below.
    client = redis.Redis(**settings, retry=Retry(NoBackoff(), 0))
    where = f"{host}:{port}"
    try:
        client.ping()
        persistence = _persistence(client)
    except redis.AuthenticationError as error:
        client.close()
        raise ConfigError(
            f"state.provider_config.password=<hidden> is invalid for Redis at {where} ({error}): "
            "give the password Redis expects (requirepass), or none if it has none") from error
    except redis.ResponseError as error:
        client.close()
        if "DB index" in str(error):
            raise ConfigError(f"state.provider_config.database={database!r} is invalid for Redis "
                              f"at {where} ({error}): give a number below its 'databases' "
                              "setting (16 by default)") from error
        raise ConfigError(f"state.provider_config.host={host!r} (port {port}): Redis refused "
                          f"the connection ({error}): check the password and ACLs") from error
    except (redis.ConnectionError, redis.TimeoutError) as error:
        client.close()
        raise ConfigError(
            f"state.provider_config.host:port={where!r} is unreachable ({error}): check that "
            f"redis-server runs at {where}, listens on that address (bind, protected-mode), that "
            f"no firewall is in between, and the timeout ({timeout} ms)") from error
    if persistence is None:
        message = (f"Redis at {where} does not let us check its persistence (CONFIG GET is "
                   "refused)")
    elif not persistence:
        message = (f"Redis at {where} persists nothing (appendonly no, save ''): a restart of "
                   "Redis loses every committed state")
    else:
        message = ""
    if message and config["require_persistence"]:
        client.close()
        raise ConfigError(
            f"state.provider_config.require_persistence=True is not met: {message}; turn on "
            "appendonly yes (with appendfsync everysec or always) or an RDB save schedule, or "
            "set require_persistence false to accept it")
    client.close()
    # Every Spark task opens the provider: say it once per process and server.
    if (where, database, prefix) not in _ANNOUNCED:
        _ANNOUNCED.add((where, database, prefix))
        if message:
            log.warning("kv state: %s; turn on appendonly yes", message)
        log.info("kv state: redis provider at %s db %d (persistence: %s), key prefix %r",
                 where, database, {None: "unknown", "": "none"}.get(persistence, persistence),
                 prefix)
    return RedisProvider(redis.Redis(**settings), key_prefix=prefix,
                         key_serializer=config["key_serializer"])


_ANNOUNCED: set[tuple] = set()


def _persistence(client) -> str | None:
    """What the server persists ("aof", "rdb", "aof+rdb"), "" for nothing, None if unknown."""
    # imported here: redis is the optional `redis` extra
    import redis

    try:
        aof = client.config_get("appendonly").get("appendonly") == "yes"
        rdb = bool(client.config_get("save").get("save", "").strip())
    except redis.ResponseError:
        return None
    return "+".join(kind for kind, on in (("aof", aof), ("rdb", rdb)) if on)


# A pipeline's provider: what processing and commit open (core.commit takes the opener, so
# the transaction protocol does not depend on the stores).
def open_state_provider(pipeline: Pipeline, coordinator_dsn: str) -> Provider:
    return open_provider(pipeline.state_provider, pipeline.state_provider_config,
                         coordinator_dsn=coordinator_dsn)


def check_state_config(pipeline: Pipeline, coordinator_dsn: str) -> None:
    """At start: a pipeline with stateful bolts must have a usable provider (ConfigError
    naming state.provider / state.provider_config otherwise)."""
    if stateful_bolts(pipeline):
        open_checked_provider(pipeline, coordinator_dsn).close()


def open_checked_provider(pipeline: Pipeline, coordinator_dsn: str):
    """The provider of a pipeline that has stateful bolts, its settings checked first."""
    if pipeline.groups != 1:
        raise ConfigError(
            f"pipeline.groups={pipeline.groups} is invalid for a pipeline with stateful bolts: "
            "each processing group would hold every key's shard, so two groups could change "
            "one key; use groups=1 (the bolt's shards run in parallel inside the group)")
    if (pipeline.state_provider or "postgres") == "memory":
        raise ConfigError(
            "state.provider='memory' is invalid for a pipeline: it keeps state inside one "
            "process, and Spark's Python workers and the Airflow tasks are separate "
            "processes; use postgres (default) or redis")
    return open_state_provider(pipeline, coordinator_dsn)
