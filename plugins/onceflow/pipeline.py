"""A pipeline's declaration: its source topic, its state tables and its Spark-side topology.

Declarations are plain data, importable without Spark or Airflow running: the topology and
the independent recomputation are referenced by "module:function" and imported where used.
"""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

MODES = ("transactional", "opaque")
SOURCES = ("postgres", "files")
START_POLICIES = ("earliest", "latest")  # or "timestamp:<ISO 8601>"
OUT_OF_RANGE_POLICIES = ("earliest", "latest", "fail")
STATE_KINDS = ("opaque", "transactional")
_IDENT = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class ConfigError(ValueError):
    """Bad configuration: the message names the field, the value and the fix."""


def _check(ok: bool, field_name: str, value: Any, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{field_name}={value!r} is invalid: {fix}")


@dataclass(frozen=True)
class StateSpec:
    """One state table, updated by the commit with the batch's deltas for ``source_name``.

    ``conn_id``: the Airflow connection of another PostgreSQL database that holds this state
    (None: the coordinator's own database, atomic with the commit).
    """

    name: str
    kind: str = "opaque"
    source: str | None = None  # which count sink of the topology feeds it (default: name)
    conn_id: str | None = None

    @property
    def table(self) -> str:
        return self.name

    @property
    def source_name(self) -> str:
        return self.source or self.name

    def validate(self) -> None:
        _check(bool(_IDENT.match(self.name)), "state.name", self.name,
               "use lower-case letters, digits and _ (a PostgreSQL table name)")
        _check(self.kind in STATE_KINDS, f"state[{self.name}].kind", self.kind,
               f"choose one of {', '.join(STATE_KINDS)}")
        # Outside the coordinator's database a replay may meet a write of its own txid from a
        # batch that changed meanwhile (opaque re-plan, retention): only prev_value can undo it.
        _check(self.conn_id is None or self.kind == "opaque", f"state[{self.name}].kind",
               self.kind, "a state in another database (conn_id set) must be kind='opaque'")


@dataclass(frozen=True)
class Pipeline:
    name: str
    topic: str
    topology: str  # "module:function": (Pipeline) -> spark_tasks.topology.Topology
    recompute: str  # "module:function": (iterable of payloads, Pipeline) -> Recomputed
    states: tuple[StateSpec, ...] = field(default_factory=tuple)
    mode: str = "transactional"
    batch_size: int = 20_000  # records per transaction, across all partitions
    partitions: int = 4  # how many partitions `onceflow produce` writes
    groups: int = 1  # processing groups per batch (parallel Spark tasks)
    max_pending: int = 3  # planned and uncommitted transactions at most (Storm's max pending)
    max_per_partition: int | None = None  # records per partition per transaction (None: no cap)
    # Where a partition with no committed offset starts: earliest, latest or timestamp:<ISO>.
    start_policy: str = "earliest"
    # A resume point below the log start (retention deleted it): earliest, latest or fail.
    out_of_range: str = "earliest"
    max_record_bytes: int = 64 * 1024  # a larger payload is rejected as oversized
    source: str = "postgres"  # postgres: the source_log table; files: Parquet segments
    # Root folder of a files source (default: ONCEFLOW_SEGMENTS_DIR, else <project>/.run/segments)
    source_path: str | None = None
    # The acker: a record counts only if its whole tuple tree completed; failed records go to
    # the backflow queues. False: nothing is tracked (Storm's unreliable mode; benchmarks).
    acker: bool = True
    tuple_timeout_ms: int = 30_000  # a per-record bolt call taking longer fails its tuple
    max_replays: int = 3  # a record failing more often than 1 + max_replays goes to dead letters
    # Replayed records per transaction, read from the to-queue before the source (None: a
    # tenth of batch_size, at least 1). Below batch_size, so the source always moves on.
    replay_cap: int | None = None
    # Where stateful bolts keep their key-value state (onceflow.kvstate): postgres (default:
    # the coordinator's database, or config {"dsn": ...} / {"conn_id": ...}), redis (config:
    # host, port, timeout, database, password, key/value serializers, require_persistence),
    # memory (tests of one process only). Config: a JSON object (text), like Storm's
    # topology.state.provider.config.
    state_provider: str = "postgres"
    state_provider_config: str | None = None

    def validate(self) -> Pipeline:
        _check(bool(_IDENT.match(self.name)), "pipeline.name", self.name,
               "use lower-case letters, digits and _")
        _check(bool(self.topic), "pipeline.topic", self.topic, "name the source topic")
        _check(self.mode in MODES, "pipeline.mode", self.mode, f"choose one of {', '.join(MODES)}")
        _check(isinstance(self.batch_size, int) and self.batch_size > 0, "pipeline.batch_size",
               self.batch_size, "give a positive number of records per transaction")
        _check(isinstance(self.partitions, int) and self.partitions > 0, "pipeline.partitions",
               self.partitions, "give a positive number of source partitions")
        _check(isinstance(self.groups, int) and self.groups > 0, "pipeline.groups", self.groups,
               "give a positive number of processing groups")
        _check(isinstance(self.max_pending, int) and self.max_pending > 0,
               "pipeline.max_pending", self.max_pending,
               "give a positive number of transactions that may be in flight")
        _check(self.max_per_partition is None
               or (isinstance(self.max_per_partition, int) and self.max_per_partition > 0),
               "pipeline.max_per_partition", self.max_per_partition,
               "give a positive number of records, or None for no per-partition cap")
        _check(isinstance(self.max_record_bytes, int) and self.max_record_bytes > 0,
               "pipeline.max_record_bytes", self.max_record_bytes, "give a positive size")
        _check(self.start_policy in START_POLICIES or _is_timestamp_policy(self.start_policy),
               "pipeline.start_policy", self.start_policy,
               "choose earliest, latest or timestamp:<ISO 8601>, e.g. timestamp:2026-11-01T00:00Z")
        _check(self.out_of_range in OUT_OF_RANGE_POLICIES, "pipeline.out_of_range",
               self.out_of_range, f"choose one of {', '.join(OUT_OF_RANGE_POLICIES)}")
        _check(self.source in SOURCES, "pipeline.source", self.source,
               f"choose one of {', '.join(SOURCES)}")
        _check(isinstance(self.acker, bool), "pipeline.acker", self.acker, "give True or False")
        _check(isinstance(self.tuple_timeout_ms, int) and self.tuple_timeout_ms > 0,
               "pipeline.tuple_timeout_ms", self.tuple_timeout_ms,
               "give a positive number of milliseconds per record and bolt")
        _check(isinstance(self.max_replays, int) and self.max_replays >= 0,
               "pipeline.max_replays", self.max_replays,
               "give 0 or more replays before a record goes to the dead letters")
        _check(self.replay_cap is None or (isinstance(self.replay_cap, int)
                                           and 0 < self.replay_cap < self.batch_size),
               "pipeline.replay_cap", self.replay_cap,
               f"give a number of records from 1 to batch_size - 1 ({self.batch_size - 1}), "
               "or None for a tenth of batch_size")
        _check(len(self.states) > 0, "pipeline.states", self.states, "declare at least one state")
        for state in self.states:
            state.validate()
        return self

    def segments_root(self) -> Path:
        """Where a files source keeps its segments."""
        if self.source_path:
            return Path(self.source_path)
        from onceflow.localenv import project_dir

        return Path(os.environ.get("ONCEFLOW_SEGMENTS_DIR") or project_dir() / ".run" / "segments")

    @property
    def replays_per_batch(self) -> int:
        """How many replayed records a transaction takes at most (replay_cap)."""
        if self.replay_cap is not None:
            return self.replay_cap
        return max(1, self.batch_size // 10) if self.batch_size > 1 else 0

    def external_states(self) -> list[StateSpec]:
        return [spec for spec in self.states if spec.conn_id is not None]

    def state(self, name: str) -> StateSpec:
        for spec in self.states:
            if spec.name == name:
                return spec
        raise KeyError(name)


def _is_timestamp_policy(policy: object) -> bool:
    if not isinstance(policy, str) or not policy.startswith("timestamp:"):
        return False
    try:
        start_timestamp(policy)
    except ValueError:
        return False
    return True


def start_timestamp(policy: str) -> datetime:
    """The time of a "timestamp:<ISO 8601>" start policy (UTC when no zone is given)."""
    stamp = datetime.fromisoformat(policy.removeprefix("timestamp:").replace("Z", "+00:00"))
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)


def load_callable(ref: str):
    """Import "package.module:function"."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{ref!r} is not a 'module:function' reference")
    return getattr(importlib.import_module(module_name), attr)


def get_pipeline(name: str, **overrides: Any) -> Pipeline:
    """The registered pipeline ``name``, with optional field overrides (e.g. batch_size)."""
    from onceflow.pipelines import PIPELINES

    if name not in PIPELINES:
        raise ConfigError(
            f"pipeline={name!r} is not registered: known pipelines are {sorted(PIPELINES)} "
            "(add yours to onceflow/pipelines.py)"
        )
    base = PIPELINES[name]
    if overrides:
        unknown = set(overrides) - set(base.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"unknown pipeline setting(s) {sorted(unknown)} for {name!r}")
        base = type(base)(**{**base.__dict__, **overrides})
    return base.validate()
