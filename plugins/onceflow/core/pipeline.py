"""A pipeline's declaration: where its records come from, what its topology does with them,
which state tables hold the result, and how its transactions run.

A declaration is plain data, importable without Spark or Airflow: the topology (and the
optional recount for verify) may be given as a ``"module:function"`` reference, imported only
where it is used, so the begin and commit tasks never load pyspark. Users declare pipelines in
their own package and register them (onceflow.core.registry).

    from onceflow import Pipeline, PostgresLog, StateSpec

    PAGE_VIEWS = Pipeline(
        name="page_views",
        source=PostgresLog(topic="page_views", partitions=4),
        topology="my_company.pipelines.page_views:topology",
        states=(StateSpec("views_per_country"),),
        batch_size=50_000,
    )
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from onceflow.core import settings, tables
from onceflow.core.errors import ConfigError, DeclarationError, SharedTable
from onceflow.core.source import RECORD_KEYS, Source
from onceflow.core.topology import Topology, TopologyError

MODES = ("transactional", "opaque")
START_POLICIES = ("earliest", "latest")  # or "timestamp:<ISO 8601>"
OUT_OF_RANGE_POLICIES = ("earliest", "latest", "fail")
STATE_KINDS = ("opaque", "transactional", "append")
DAG_SHAPES = ("phases", "single")
# An attempt's lease (Pipeline.attempt_lease_s, else the setting attempt_lease_s): a dead
# task's txid is adopted about a minute after its last report; HANDOFF_LEASES leases cover the
# wait between two tasks of a run.
DEFAULT_ATTEMPT_LEASE_S = settings.SETTINGS["attempt_lease_s"].default
HANDOFF_LEASES = 10
_IDENT = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def check(ok: bool, field_name: str, value: Any, fix: str) -> None:
    """Refuse a setting: ConfigError naming the field, the value and the fix."""
    if not ok:
        raise ConfigError(f"{field_name}={value!r} is invalid: {fix}")


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class StateSpec:
    """One table the commit writes, fed by the topology's sink ``source`` (default: name).

    A count state (the default): ``key text, value bigint`` (the sum of the stream's
    ``delta``, 1 per tuple when absent). A typed state: ``key`` (column -> PostgreSQL type,
    composite keys allowed) and ``measures`` (column -> Sum / Count / Min / Max / Last of a
    stream column); ``StateSpec.upsert`` (latest row per key) and ``StateSpec.append`` (a fact
    table with a txid column) build the other table kinds (onceflow.core.tables).

    ``kind``: opaque (each value keeps its previous one: a replay of a changed batch is
    exact) or transactional (a key at the batch's txid is skipped), or append.
    ``conn_id``: the Airflow connection of another PostgreSQL database that holds this table
    (None: the coordinator's own database, atomic with the commit).
    """

    name: str
    kind: str = "opaque"
    source: str | None = None  # which sink of the topology feeds it (default: name)
    conn_id: str | None = None
    key: Any = None  # typed state: {column: type}
    measures: Any = None  # typed state: {column: Measure}
    columns: Any = None  # append table: {column: type}
    order_by: str | None = None  # which stream column orders Last measures within a batch

    def __post_init__(self) -> None:
        # mappings kept as tuples of pairs: a declaration stays hashable and immutable
        for name in ("key", "measures", "columns"):
            value = getattr(self, name)
            if isinstance(value, dict):
                pairs = tuple((k, tables.normal_type(v) if isinstance(v, str) else v)
                              for k, v in value.items())
                object.__setattr__(self, name, pairs)

    @classmethod
    def upsert(cls, name: str, *, key: dict, columns: dict, order_by: str | None = None,
               **kw: Any) -> StateSpec:
        """A dimension table: per key, the batch's last row (by ``order_by``, a stream
        column; else by the record's position); a later txid replaces it."""
        return cls(name, key=key, measures={c: tables.Last(c, t) for c, t in columns.items()},
                   order_by=order_by, **kw)

    @classmethod
    def append(cls, name: str, *, columns: dict, **kw: Any) -> StateSpec:
        """A fact table: every row of the batch once, with its txid (a replayed txid
        replaces its own rows)."""
        return cls(name, kind="append", columns=columns, **kw)

    @property
    def table(self) -> str:
        return self.name

    @property
    def source_name(self) -> str:
        return self.source or self.name

    @property
    def typed(self) -> bool:
        return self.kind == "append" or self.key is not None or self.measures is not None

    @property
    def opaque(self) -> bool:
        return self.kind == "opaque"

    def shape(self) -> tables.Shape:
        return tables.Shape(self.name, self.kind == "append", tuple(self.key or ()),
                            tuple(self.measures or ()), tuple(self.columns or ()),
                            self.order_by)

    def validate(self) -> None:
        check(bool(_IDENT.match(str(self.name))), "state.name", self.name,
              "use lower-case letters, digits and _ (a PostgreSQL table name)")
        check(self.kind in STATE_KINDS, f"state[{self.name}].kind", self.kind,
              f"choose one of {', '.join(STATE_KINDS)}")
        for name in ("key", "measures", "columns"):
            value = getattr(self, name)
            check(value is None or isinstance(value, tuple), f"state[{self.name}].{name}",
                  value, "give a dict, e.g. {'merchant': 'text'}")
        if self.typed:
            tables.validate_shape(self.name, self.kind, dict(self.key or ()),
                                  dict(self.measures or ()), dict(self.columns or ()),
                                  self.order_by, _IDENT)
        # Outside the coordinator's database a replay may meet a write of its own txid from a
        # batch that changed meanwhile (opaque re-plan, retention): only the previous values
        # (or, for an append table, replacing the txid's rows) can undo it.
        check(self.conn_id is None or self.kind in ("opaque", "append"),
              f"state[{self.name}].kind", self.kind,
              "a state in another database (conn_id set) must be kind='opaque' (or an "
              "append table)")


@dataclass(frozen=True)
class Pipeline:
    name: str
    source: Source
    # (Pipeline) -> onceflow.Topology, or its "module:function" reference (imported lazily).
    topology: str | Callable
    states: tuple[StateSpec, ...] = ()
    mode: str = "transactional"
    batch_size: int = 20_000  # records per transaction, across all partitions
    groups: int = 1  # processing groups per batch (parallel Spark tasks)
    max_pending: int = 3  # planned and uncommitted transactions at most (Storm's max pending)
    max_per_partition: int | None = None  # records per partition per transaction (None: no cap)
    # Where a partition with no committed offset starts: earliest, latest or timestamp:<ISO>.
    start_policy: str = "earliest"
    # A resume point below the log start (retention deleted it): earliest, latest or fail.
    out_of_range: str = "earliest"
    # The acker: a record counts only if its whole tuple tree completed; failed records go to
    # the backflow queues. False: nothing is tracked (Storm's unreliable mode).
    acker: bool = True
    tuple_timeout_ms: int = 30_000  # a per-record bolt call taking longer fails its tuple
    max_replays: int = 3  # a record failing more often than 1 + max_replays goes to dead letters
    # Replayed records per transaction, read from the to-queue before the source (None: a
    # tenth of batch_size, at least 1). Below batch_size, so the source always moves on.
    replay_cap: int | None = None
    # Where stateful bolts keep their key-value state (onceflow.kvstate): postgres (default:
    # the coordinator's database, or config {"dsn": ...} / {"conn_id": ...}), redis (config:
    # host, port, timeout, database, password, key/value serializers, require_persistence),
    # memory (tests of one process only). Config: a JSON object (text).
    state_provider: str = "postgres"
    state_provider_config: str | None = None
    # A state key longer than this (UTF-8 bytes) fails its record: a btree index entry must fit
    # in a third of a PostgreSQL page, with the row's other columns.
    max_key_bytes: int = 2000
    # Optional independent recount for verify and retention: (payloads, pipeline) -> Recount
    # (counts per state and key, rejected, failing). Without it verify re-runs the topology.
    recompute: str | Callable | None = None
    retries: int = 2  # Airflow task retries (process, commit)
    # An attempt whose running task has not reported for this long is taken as dead: the next
    # run adopts its txid (onceflow.core.lease). A task reports every lease / 4 while it runs,
    # a long Spark batch included. Between two tasks of a run (Airflow's queue, a retry's
    # delay, a deferred commit) nothing of it runs: the lease is then HANDOFF_LEASES times
    # longer. None: the setting ONCEFLOW_ATTEMPT_LEASE_S (docs/configuration.md).
    attempt_lease_s: int | None = None
    commit_timeout_s: int = 3600  # how long a commit waits for its turn at most
    description: str = ""
    # Commit lag alert (onceflow.airflow.alerts): when the oldest work not committed has waited
    # longer than this, the DAG onceflow_<name>_commit_lag fails and calls the notifier.
    commit_lag_alert: timedelta | None = None
    # Whom it tells: an Airflow notifier (BaseNotifier), a function (context) -> None, its
    # "module:attribute" reference, or a tuple of those. Needs commit_lag_alert.
    commit_lag_notifier: Any = None
    # Replaying dead letters waits for a person's approval in the DAG
    # onceflow_<name>_replay_dead_letters (onceflow.airflow.approval).
    dead_letter_approval: bool = False
    # Who may approve those replays (Airflow user names); set, the person who asked for a
    # replay may not approve it: someone else of them must. Empty: anyone who may act on
    # the approval DAG, the one who asked too.
    approvers: tuple[str, ...] = ()
    # The transaction DAG's shape (onceflow.airflow.dags): "phases", a task per phase (begin >>
    # process >> commit), or "single", one task runs the three: one task process per run and
    # no scheduling hop between phases; processes on a Spark Connect server.
    dag_shape: str = "phases"
    # Keeping up (docs/keep-up.md): the transaction DAG is scheduled on its source. A watcher
    # in Airflow's triggerer looks at the source every ``watch_interval`` seconds and starts a
    # run when records wait that no transaction planned: at once for ``min_records`` of them
    # (None: batch_size, a full batch), else once the oldest has waited ``max_delay`` (a
    # timedelta, or seconds); with a backlog, up to max_pending runs at a time until it is
    # drained; with nothing to read, none. Manual runs and backfills work beside it.
    keep_up: bool = False
    min_records: int | None = None
    max_delay: timedelta | float = timedelta(seconds=10)
    watch_interval: float = 2.0
    # Where this declaration was loaded from ("module:attr"): travels with every task.
    ref: str | None = field(default=None, compare=False)

    @property
    def topic(self) -> str:
        return self.source.topic

    def with_settings(self, **overrides: Any) -> Pipeline:
        """This pipeline with some fields changed (e.g. batch_size from a trigger form)."""
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ConfigError(f"unknown pipeline setting(s) {unknown} for {self.name!r}: "
                              f"known are {sorted(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **overrides).validate()

    def validate(self) -> Pipeline:
        check(isinstance(self.name, str) and bool(_IDENT.match(self.name)), "pipeline.name",
              self.name, "use lower-case letters, digits and _")
        check(isinstance(self.source, Source), f"pipeline[{self.name}].source", self.source,
              "give a source object, e.g. onceflow.PostgresLog(topic='events')")
        self.source.validate()
        check(isinstance(self.topology, str | Callable), f"pipeline[{self.name}].topology",
              self.topology, "give a function (pipeline) -> Topology, or its 'module:function'")
        check(self.mode in MODES, "pipeline.mode", self.mode, f"choose one of {', '.join(MODES)}")
        check(_positive(self.batch_size), "pipeline.batch_size", self.batch_size,
              "give a positive number of records per transaction")
        check(_positive(self.groups), "pipeline.groups", self.groups,
              "give a positive number of processing groups")
        check(_positive(self.max_pending), "pipeline.max_pending", self.max_pending,
              "give a positive number of transactions that may be in flight")
        check(self.max_per_partition is None or _positive(self.max_per_partition),
              "pipeline.max_per_partition", self.max_per_partition,
              "give a positive number of records, or None for no per-partition cap")
        check(self.start_policy in START_POLICIES or _is_timestamp_policy(self.start_policy),
              "pipeline.start_policy", self.start_policy,
              "choose earliest, latest or timestamp:<ISO 8601>, e.g. timestamp:2026-11-01T00:00Z")
        check(self.out_of_range in OUT_OF_RANGE_POLICIES, "pipeline.out_of_range",
              self.out_of_range, f"choose one of {', '.join(OUT_OF_RANGE_POLICIES)}")
        check(isinstance(self.acker, bool), "pipeline.acker", self.acker, "give True or False")
        check(_positive(self.tuple_timeout_ms), "pipeline.tuple_timeout_ms",
              self.tuple_timeout_ms, "give a positive number of milliseconds per record and bolt")
        check(isinstance(self.max_replays, int) and self.max_replays >= 0,
              "pipeline.max_replays", self.max_replays,
              "give 0 or more replays before a record goes to the dead letters")
        check(self.replay_cap is None or (_positive(self.replay_cap)
                                          and self.replay_cap < self.batch_size),
              "pipeline.replay_cap", self.replay_cap,
              f"give a number of records from 1 to batch_size - 1 ({self.batch_size - 1}), "
              "or None for a tenth of batch_size")
        check(_positive(self.max_key_bytes) and self.max_key_bytes <= 2600,
              "pipeline.max_key_bytes", self.max_key_bytes,
              "give 1 to 2600 bytes (a btree entry must fit in a third of a page)")
        check(isinstance(self.retries, int) and self.retries >= 0, "pipeline.retries",
              self.retries, "give 0 or more task retries")
        check(self.attempt_lease_s is None or _positive(self.attempt_lease_s),
              "pipeline.attempt_lease_s", self.attempt_lease_s,
              "give a positive number of seconds, or None for ONCEFLOW_ATTEMPT_LEASE_S "
              f"(default {DEFAULT_ATTEMPT_LEASE_S})")
        self.lease_s  # noqa: B018 (a bad ONCEFLOW_ATTEMPT_LEASE_S is refused here too)
        check(_positive(self.commit_timeout_s), "pipeline.commit_timeout_s",
              self.commit_timeout_s, "give a positive number of seconds")
        check(self.commit_lag_alert is None or (isinstance(self.commit_lag_alert, timedelta)
                                                and self.commit_lag_alert > timedelta(0)),
              "pipeline.commit_lag_alert", self.commit_lag_alert,
              "give a positive timedelta, e.g. timedelta(minutes=30), or None for no alert")
        check(self.commit_lag_notifier is None or self.commit_lag_alert is not None,
              "pipeline.commit_lag_notifier", self.commit_lag_notifier,
              "set commit_lag_alert too: the notifier is called past that lag")
        notifiers = self.commit_lag_notifier
        check(all((isinstance(n, str) and ":" in n) or (callable(n) and not isinstance(n, str))
                  for n in (notifiers if isinstance(notifiers, tuple) else
                            () if notifiers is None else (notifiers,))),
              "pipeline.commit_lag_notifier", notifiers,
              "give an Airflow notifier, a function (context) -> None, its 'module:attribute' "
              "reference, or a tuple of those")
        check(isinstance(self.dead_letter_approval, bool), "pipeline.dead_letter_approval",
              self.dead_letter_approval, "give True or False")
        check(isinstance(self.approvers, tuple)
              and all(isinstance(a, str) and a.strip() == a and a for a in self.approvers)
              and len(set(self.approvers)) == len(self.approvers), "pipeline.approvers",
              self.approvers, "give a tuple of distinct Airflow user names, e.g. "
              "('alice', 'bob'), or () for anyone who may act on the approval DAG")
        check(not self.approvers or self.dead_letter_approval, "pipeline.approvers",
              self.approvers, "approvers answer the approval of replays: set "
              "dead_letter_approval=True too, or leave approvers empty")
        check(self.dag_shape in DAG_SHAPES, "pipeline.dag_shape", self.dag_shape,
              f"choose one of {', '.join(DAG_SHAPES)}")
        check(isinstance(self.keep_up, bool), "pipeline.keep_up", self.keep_up,
              "give True (runs start when the source has records) or False")
        check(self.min_records is None or (_positive(self.min_records)
                                           and self.min_records <= self.batch_size),
              "pipeline.min_records", self.min_records,
              f"give a number of records from 1 to batch_size ({self.batch_size}), or None "
              "for batch_size")
        check(_seconds(self.max_delay) is not None and _seconds(self.max_delay) > 0,
              "pipeline.max_delay", self.max_delay,
              "give a positive timedelta, e.g. timedelta(seconds=10), or a number of seconds")
        check(_seconds(self.watch_interval) is not None and 0.1 <= self.watch_interval <= 600,
              "pipeline.watch_interval", self.watch_interval,
              "give a number of seconds from 0.1 to 600 between two looks at the source")
        check(isinstance(self.states, tuple) and len(self.states) > 0, "pipeline.states",
              self.states, "declare at least one state, as a tuple of StateSpec")
        names = [s.name for s in self.states]
        check(len(set(names)) == len(names), "pipeline.states", names,
              "give each state table its own name")
        for state in self.states:
            check(isinstance(state, StateSpec), "pipeline.states", state, "use StateSpec(...)")
            state.validate()
        fed = [s.source_name for s in self.typed_states()]
        check(len(set(fed)) == len(fed), "pipeline.states", fed,
              "feed each typed state from a sink of its own (source=...)")
        for state in self.typed_states():
            check(tables.staging_name_ok(self.name, state.name), f"state[{state.name}].name",
                  state.name, f"'{self.name}.{state.name}' names its staging table and must "
                  "fit in 63 bytes: shorten the state's or the pipeline's name")
        return self

    def typed_states(self) -> list[StateSpec]:
        return [spec for spec in self.states if spec.typed]

    @property
    def replays_per_batch(self) -> int:
        """How many replayed records a transaction takes at most (replay_cap)."""
        if self.replay_cap is not None:
            return self.replay_cap
        return max(1, self.batch_size // 10) if self.batch_size > 1 else 0

    @property
    def batch_start_records(self) -> int:
        """How many waiting records start a batch at once (keep_up): min_records, else
        batch_size."""
        return self.min_records if self.min_records is not None else self.batch_size

    @property
    def max_delay_s(self) -> float:
        """max_delay in seconds."""
        return _seconds(self.max_delay) or 0.0

    @property
    def lease_s(self) -> int:
        """The attempt lease in seconds: ``attempt_lease_s``, else the setting
        attempt_lease_s (onceflow.core.settings, read when asked)."""
        if self.attempt_lease_s is not None:
            return self.attempt_lease_s
        return settings.get("attempt_lease_s")

    @property
    def handoff_lease_s(self) -> int:
        """The lease while the attempt waits between two tasks of its run."""
        return self.lease_s * HANDOFF_LEASES

    @property
    def attempt_heartbeat_s(self) -> float:
        return max(1.0, self.lease_s / 4)

    def external_states(self) -> list[StateSpec]:
        return [spec for spec in self.states if spec.conn_id is not None]

    def state(self, name: str) -> StateSpec:
        for spec in self.states:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def build_topology(self):
        """The pipeline's Topology, checked against the declaration (sources, states): the
        declaration check, run by `onceflow pipelines`, `onceflow init`, the DAG's build and
        every processing. Needs no Spark session and no data, but imports the topology's
        module (pyspark may come with it). Raises a DeclarationError (a ConfigError) naming
        the pipeline, the stream or bolt, the field and the fix."""

        build = resolve(self.topology, f"pipeline[{self.name}].topology")
        try:
            topology = build(self)
        except (ConfigError, TopologyError) as error:  # e.g. a stream's DDL without a type
            raise DeclarationError(f"pipeline {self.name!r}: {error}") from error
        except Exception as error:  # the user's function failed: where, not a traceback
            raise ConfigError(
                f"pipeline[{self.name}].topology={self.topology!r} raised "
                f"{type(error).__name__}: {error} ({_where(error)}): fix the function that "
                "builds the topology") from error
        check(isinstance(topology, Topology), f"pipeline[{self.name}].topology", self.topology,
              f"the function returned {type(topology).__name__}; return a onceflow.Topology")
        topology.spout_columns = f"{RECORD_KEYS}, {self.source.record_ddl}"
        try:
            return topology.validate({s.source_name: s.shape() for s in self.typed_states()},
                                     {s.source_name for s in self.states})
        except TopologyError as error:
            raise DeclarationError(f"pipeline {self.name!r}: {error}") from None

    def recount(self):
        """The optional independent recount function, or None."""
        if self.recompute is None:
            return None
        return resolve(self.recompute, f"pipeline[{self.name}].recompute")


def table_place(spec: StateSpec) -> str:
    """Where a state's table lives, in words: the coordinator's database, or another."""
    if spec.conn_id is None:
        return "in the coordinator's database"
    return f"in the database of connection {spec.conn_id!r}"


def one_owner(table: str, sink: str, owner: str) -> str:
    """Why a table belongs to one pipeline, that onceflow offers no shared table, and the
    fix: the state of pipeline ``owner`` renamed, still fed by its sink ``sink``."""
    return (f"a table belongs to one pipeline: each pipeline's txids are its own, so the "
            f"replay rule of one would overwrite the other's keys and delete its rows. "
            f"onceflow does not share a table between pipelines, not even on purpose (its "
            f"rows carry no pipeline). Rename the state in one of them: its name is the "
            f"table, and source={sink!r} keeps the sink that feeds it, e.g. "
            f"name='{owner}_{table}', source={sink!r} in pipeline {owner!r}")


def check_shared_tables(pipelines: Any) -> None:
    """Refuse two pipelines that declare one table (the same state name in the same
    database): SharedTable naming the table, both pipelines and the fix."""
    declared: dict[tuple[str | None, str], list[tuple[Pipeline, StateSpec]]] = {}
    for pipeline in sorted(pipelines, key=lambda p: p.name):
        for spec in pipeline.states:
            declared.setdefault((spec.conn_id, spec.table), []).append((pipeline, spec))
    problems = []
    for (_, table), users in declared.items():
        if len(users) < 2:
            continue
        named = " and ".join(
            f"{p.name!r} (state[{s.name}]{f', from {p.ref}' if p.ref else ''})"
            for p, s in users)
        problems.append(f"table {table!r} ({table_place(users[0][1])}) is declared by "
                        f"pipelines {named}: "
                        f"{one_owner(table, users[-1][1].source_name, users[-1][0].name)}")
    if problems:
        raise SharedTable("; ".join(problems))


def _seconds(value: Any) -> float | None:
    """A timedelta or a number of seconds as seconds (None: neither)."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


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


def _where(error: BaseException) -> str:
    """Where ``error`` was raised: the innermost frame, "at file:line"."""
    frame = traceback.extract_tb(error.__traceback__)[-1]
    return f"at {frame.filename}:{frame.lineno}"


def resolve(ref: str | Callable, what: str) -> Callable:
    """A callable, or the object a "package.module:attribute" reference names."""
    if not isinstance(ref, str):
        return ref
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{what}={ref!r} is not a 'package.module:attribute' reference")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"{what}={ref!r}: module {module_name!r} cannot be imported "
                          f"({error}); install the package that holds it, or put its folder "
                          "on PYTHONPATH") from error
    except Exception as error:  # the module itself failed (a declaration): where, not a trace
        raise ConfigError(f"{what}={ref!r}: importing module {module_name!r} raised "
                          f"{type(error).__name__}: {error} ({_where(error)}): fix the "
                          "module") from error
    target = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as error:
            raise ConfigError(f"{what}={ref!r}: {module_name} has no attribute {attr!r}"
                              ) from error
    return target
