"""Real faults, for the fault tests and the long fault run (tests/fault_run.py).

A ``FaultRun`` drives a pipeline's transactions (begin, process, commit, called directly with
one Spark session) in a random but seeded order, and on the way:

- kills with SIGKILL a process that is staging a group (inside its PostgreSQL transaction),
  one inside the commit transaction (at a random step) and one after its COMMIT (before the
  staging is deleted, or after commit() returned);
- restarts PostgreSQL in immediate mode (a crash: unlogged staging is emptied) between the
  staging and the commit of a batch;
- starts a second run of a txid that is in flight (a duplicate trigger): the first attempt
  becomes a zombie, and the harness later makes it stage and commit, which must be refused;
- lets a run die silently (its lease runs out): the next begin adopts the txid;
- marks an attempt failed after a fault, as Airflow's failure callback does after the last
  retry, so that a later run adopts it.

Killed processes are agents, ``python -m onceflow_testing.faults stage|commit ...``, which do one
write and pause at the chosen point until they are killed: besides the coordinator's commit
steps, inside a state's own transaction in another database and after its COMMIT, and
before and after a key-value store's commit (``commit_steps``). A fault counts (``happened``)
only once confirmed: the agent said where it paused and died of the SIGKILL there, the server
came back with a new start time, the newer attempt exists, the zombie was fenced. An agent
that neither pauses nor ends within its deadline is killed and reported with its stderr
(AgentError). After the faults, ``drain`` runs
transactions without faults until every record is committed, rejected or dead. The caller
then compares the state with an oracle of its own (from what it produced, not from
onceflow's tables).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psycopg2

from onceflow.core import staging, txlog
from onceflow.core.begin import begin, mark_failed
from onceflow.core.commit import commit
from onceflow.core.db import connect
from onceflow.core.errors import Fenced, MaxPendingReached, StagingIncomplete
from onceflow.core.pipeline import Pipeline
from onceflow.core.registry import get_pipeline
from onceflow.core.staging import stage_group
from onceflow.core.txlog import TransactionAttempt, TxState
from onceflow.kvstate import open_state_provider

log = logging.getLogger(__name__)

COMMIT_STEPS = ("locked", "contributions", "rejects", "backflow", "offsets", "commit_record")
# After the commit's COMMIT: before its staging is deleted (onceflow.core.commit), and after
# commit() returned.
AFTER_COMMIT = {"committed": "commit:committed", "after": "after commit"}
PAUSED = "PAUSED"
# How an agent that ends without pausing says why (a line on its stdout); anything else that
# ends it is an error of the harness or of onceflow, reported with the agent's stderr.
ENDED = "ENDED"


def commit_steps(pipeline: Pipeline) -> tuple[str, ...]:
    """Where an agent can pause inside ``pipeline``'s commit, in order: the coordinator's
    steps and, for a state in another database, inside its own transaction
    (``external_open:NAME``, its rows written, not committed) and after its COMMIT
    (``external:NAME``, the coordinator's not yet); with stateful bolts, before the key-value
    store's commit (``kv_recovered``) and after it (``kv_state``)."""
    steps = ["locked"]
    for spec in pipeline.external_states():
        steps += [f"external_open:{spec.name}", f"external:{spec.name}"]
    if pipeline.build_topology().stateful():
        steps += ["kv_recovered", "kv_state"]
    return (*steps, *COMMIT_STEPS[1:])


# -- the agent: one write, paused until killed ----------------------------------------------------
def _pause(where: str) -> None:
    print(f"{PAUSED} {where}", flush=True)
    time.sleep(3600)


def _pause_inside_external_and_kv(on_step: Callable[[str], None]) -> None:
    """Steps the commit does not announce itself: inside a state's own transaction in another
    database (after its rows are written, before that transaction's COMMIT) and right before
    the key-value store's commit. The agent wraps the functions the commit calls there."""
    from onceflow.core import commit as commit_module
    from onceflow.core import state_tables, stateful, tables

    current: list[str] = []
    apply_external = commit_module._apply_external

    def external(cur, pipeline, spec, *args, **kwargs):
        current[:] = [spec.name]
        try:
            return apply_external(cur, pipeline, spec, *args, **kwargs)
        finally:
            current.clear()

    def written(apply):
        def wrapper(*args, **kwargs):
            rows = apply(*args, **kwargs)
            if current:  # an external state's transaction, still open
                on_step(f"external_open:{current[0]}")
            return rows
        return wrapper

    commit_states = stateful.commit_states

    def kv_commit(*args, **kwargs):
        on_step("kv_recovered")
        return commit_states(*args, **kwargs)

    commit_module._apply_external = external
    state_tables.apply_csv = written(state_tables.apply_csv)
    tables.apply_csv = written(tables.apply_csv)
    stateful.commit_states = kv_commit


def agent_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m onceflow_testing.faults")
    parser.add_argument("action", choices=("stage", "commit"))
    parser.add_argument("--pipeline", required=True)
    parser.add_argument("--settings", default="{}", help="pipeline settings (JSON)")
    parser.add_argument("--txid", type=int, required=True)
    parser.add_argument("--attempt", type=int, required=True)
    parser.add_argument("--group", type=int, default=0)
    parser.add_argument("--staging", help="folder with deltas.csv, rejects.csv, failures.csv "
                                          "and meta.json")
    parser.add_argument("--pause-at", help="a commit step (commit_steps()), 'committed' (after "
                                           "COMMIT, before the staging is deleted) or 'after' "
                                           "(after commit() returned)")
    args = parser.parse_args(argv)
    # on stderr, which the harness shows when the agent hangs or fails
    print(f"fault agent pid {os.getpid()}: {args.action} {args.pipeline} txid {args.txid} "
          f"attempt {args.attempt}, pause at {args.pause_at or 'staging'}", file=sys.stderr,
          flush=True)
    pipeline = get_pipeline(args.pipeline, **json.loads(args.settings))
    ta = TransactionAttempt(args.txid, args.attempt)
    dsn = os.environ["ONCEFLOW_PG_DSN"]
    conn = connect(dsn, application_name="onceflow-fault-agent")
    try:
        if args.action == "stage":
            folder = Path(args.staging)
            meta = json.loads((folder / "meta.json").read_text())
            with open(folder / "deltas.csv", "rb") as d, open(folder / "rejects.csv", "rb") as r, \
                    open(folder / "failures.csv", "rb") as f:
                stage_group(conn, pipeline.name, ta, args.group, deltas_csv=d, rejects_csv=r,
                            failures_csv=f, before_commit=lambda: _pause("staging"), **meta)
            print(f"{ENDED} staged", flush=True)
            return 0

        def on_step(name: str) -> None:
            if name == args.pause_at:
                _pause(f"commit:{name}")

        _pause_inside_external_and_kv(on_step)
        result = commit(conn, pipeline, ta, on_step=on_step, coordinator_dsn=dsn,
                        open_state=open_state_provider)
    except Fenced as error:
        print(f"{ENDED} fenced: {error}", flush=True)
        return 3
    except StagingIncomplete as error:
        print(f"{ENDED} staging incomplete: {error}", flush=True)
        return 3
    print(f"COMMIT {result.status}", flush=True)
    if args.pause_at == "after" and result.status == "committed":
        _pause("after commit")
    print(f"{ENDED} commit {result.status}", flush=True)
    return 0


class AgentError(AssertionError):
    """An agent hung past its deadline, or ended in an error: the harness cannot go on."""


@dataclass
class Kill:
    """What became of an agent: where it paused (``""``: it ended first, ``ended`` says
    why), its PID and exit status (``-SIGKILL`` when the harness killed it), its output."""

    argv: list[str]
    pid: int
    where: str = ""
    returncode: int | None = None
    ended: str = ""
    stdout: str = ""
    stderr: str = ""

    @property
    def killed(self) -> bool:
        """Paused, then died of the harness's SIGKILL."""
        return bool(self.where) and self.returncode == -signal.SIGKILL

    def describe(self) -> str:
        return (f"agent pid {self.pid} ({' '.join(self.argv[:1] + self.argv[-2:])}): "
                + (f"paused at {self.where!r}, " if self.where else
                   f"did not pause ({self.ended or 'no reason given'}), ")
                + f"exit status {self.returncode}\n--- its stderr ---\n{self.stderr[-3000:]}")


class Agent:
    """A running agent (``python -m onceflow_testing.faults ...``). Its stdout and stderr are
    read by threads of their own, so a wait has a deadline even when the agent prints
    nothing, and its stderr is there to show when it hangs or fails."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.argv = list(argv)
        self.proc = subprocess.Popen([sys.executable, "-m", "onceflow_testing.faults", *argv],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(self.proc.stdout, True),
                                          daemon=True),
                         threading.Thread(target=self._read, args=(self.proc.stderr, False),
                                          daemon=True)]
        for reader in self._readers:
            reader.start()
        self.kill_result = Kill(self.argv, self.proc.pid)

    def _read(self, stream, is_stdout: bool) -> None:
        for line in stream:
            (self.out if is_stdout else self.err).append(line)
            if is_stdout:
                self.lines.put(line)
        if is_stdout:
            self.lines.put(None)

    def _result(self) -> Kill:
        for reader in self._readers:
            reader.join(timeout=10)
        result = self.kill_result
        result.returncode = self.proc.returncode
        result.stdout, result.stderr = "".join(self.out), "".join(self.err)
        return result

    def wait_paused(self, timeout: float = 120) -> Kill:
        """Until the agent pauses (``where`` set) or ends (``ended`` set). Raises AgentError,
        with the agent's stderr, when it does neither within ``timeout`` seconds (the agent
        is killed first) or ends in an error."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.proc.kill()
                self.proc.wait(timeout=30)
                raise AgentError(f"the agent neither paused nor ended within {timeout:.0f}s: "
                                 f"{self._result().describe()}") from None
            if line is None:  # it ended
                self.proc.wait(timeout=30)
                result = self._result()
                ended = [x for x in result.stdout.splitlines() if x.startswith(ENDED)]
                if not ended or result.returncode not in (0, 3):
                    raise AgentError(f"the agent failed: {result.describe()}")
                result.ended = ended[-1][len(ENDED):].strip()
                return result
            if line.startswith(PAUSED):
                self.kill_result.where = line[len(PAUSED):].strip()
                return self.kill_result

    def kill(self) -> Kill:
        """SIGKILL the paused agent, by its PID, and wait until it is gone."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        return self._result()

    def stop(self) -> None:
        """Whatever became of it: not left running."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def run_and_kill(argv: list[str], env: dict[str, str], timeout: float = 120) -> Kill:
    """Start an agent, wait until it pauses, SIGKILL it (by its PID) and wait for its end.
    ``Kill.killed`` says whether it died by the signal while paused, ``Kill.where`` where
    it paused (``""`` when it ended first, e.g. fenced: ``Kill.ended`` says why). Raises
    AgentError (with its stderr) when it hangs past ``timeout`` or ends in an error."""
    agent = Agent(argv, env)
    try:
        result = agent.wait_paused(timeout)
        return agent.kill() if result.where else result
    finally:
        agent.stop()


# -- the harness ----------------------------------------------------------------------------------
@dataclass
class InFlight:
    attempt: TransactionAttempt
    groups: int
    processed: bool = False


# Every kind of fault the harness draws, in the order of its table.
KINDS = ("duplicate_trigger", "run_died_silently", "fenced_while_processing",
         "kill_inside_staging", "process_failed", "postgres_crash_before_commit",
         "kill_inside_commit", "kill_after_commit", "zombie_woke")


@dataclass
class FaultRun:
    """See the module docstring. ``settings``: the pipeline's overrides (the agents load the
    pipeline by name with them); ``restart_postgres``: crash-restart the server (None: no
    such faults); ``rate``: how often a fault is drawn at each point.

    A fault is counted in ``attempted`` when drawn and in ``happened`` only once it is
    confirmed: an agent reported the step it paused at and died of the SIGKILL there; the
    server came back with a new start time; a duplicate begin made a newer attempt; a zombie
    was fenced. ``missed`` says why a drawn fault did not happen (the agent's own word)."""

    pipeline: Pipeline
    dsn: str
    spark: object
    seed: int
    settings: dict = field(default_factory=dict)
    restart_postgres: Callable[[], None] | None = None
    rate: float = 0.15
    agent_timeout: float = 180
    attempted: Counter = field(default_factory=Counter)
    happened: Counter = field(default_factory=Counter)
    outcomes: Counter = field(default_factory=Counter)  # what the faults led to
    missed: list[str] = field(default_factory=list)
    steps: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.conn = connect(self.dsn)
        self.env = {**os.environ, "ONCEFLOW_PG_DSN": self.dsn}
        self.in_flight: list[InFlight] = []
        self.zombies: list[InFlight] = []
        self.runs = 0
        self.commit_steps = commit_steps(self.pipeline)

    def table(self) -> str:
        """Per kind: attempted / happened (a table for a report)."""
        kinds = [*KINDS, *sorted(set(self.attempted) - set(KINDS))]
        width = max(map(len, kinds))
        lines = [f"{'fault':<{width}}  attempted  happened"]
        lines += [f"{kind:<{width}}  {self.attempted[kind]:>9}  {self.happened[kind]:>8}"
                  for kind in kinds]
        return "\n".join(lines)

    # plumbing
    def _reconnect(self) -> None:
        try:
            self.conn.close()
        except psycopg2.Error:
            pass
        self.conn = connect(self.dsn)

    def _fault(self, kind: str) -> bool:
        if self.rng.random() < self.rate:
            self.attempted[kind] += 1
            return True
        return False

    def _confirm(self, kind: str, happened: bool, why: str = "") -> bool:
        if happened:
            self.happened[kind] += 1
        else:
            self.missed.append(f"{kind}: {why}")
            log.warning("fault %s did not happen: %s", kind, why)
        return happened

    def _kill(self, kind: str, argv: list[str], where: str) -> Kill:
        kill = run_and_kill(argv, self.env, timeout=self.agent_timeout)
        self._confirm(kind, kill.killed and kill.where == where,
                      f"wanted a kill at {where!r}; {kill.describe()}")
        return kill

    def _agent(self, action: str, ta: TransactionAttempt, *extra: str) -> list[str]:
        return [action, "--pipeline", self.pipeline.name, "--settings",
                json.dumps(self.settings), "--txid", str(ta.txid), "--attempt",
                str(ta.attempt), *extra]

    def _fail(self, item: InFlight, why: str) -> bool:
        """The task failed after its last retry: Airflow's callback marks the attempt."""
        return mark_failed(self.conn, self.pipeline.name, item.attempt, why)

    def _last_committed(self) -> int:
        with self.conn.cursor() as cur:
            last = txlog.last_committed(cur, self.pipeline.name)
        self.conn.commit()
        return last

    def _commit_reaches_its_steps(self, item: InFlight) -> bool:
        """Whether a commit of ``item`` now would go past its checks: its turn, its staging
        whole and the attempt still the current, planned one (read-only)."""
        with self.conn.cursor() as cur:
            try:
                state = txlog.fence(cur, self.pipeline.name, item.attempt)
            except Fenced:
                state = None
            turn = txlog.last_committed(cur, self.pipeline.name) == item.attempt.txid - 1
            proof = staging.proof(cur, self.pipeline.name, item.attempt, item.groups)
        self.conn.commit()
        return (state is TxState.PLANNED and turn and not proof.missing_groups
                and proof.whole)

    def _server_started(self) -> object:
        with self.conn.cursor() as cur:
            cur.execute("SELECT pg_postmaster_start_time()")
            started = cur.fetchone()[0]
        self.conn.commit()
        return started

    # actions
    def _begin(self) -> None:
        self.runs += 1
        try:
            batch = begin(self.conn, self.pipeline, f"run-{self.seed}-{self.runs}")
        except MaxPendingReached:
            return
        if batch.committed:
            return
        # a run with this txid may still be in flight: that attempt is a zombie now
        for item in [i for i in self.in_flight if i.attempt.txid == batch.attempt.txid]:
            self.in_flight.remove(item)
            self.zombies.append(item)
        item = InFlight(batch.attempt, batch.groups)
        if self._fault("duplicate_trigger"):
            again = begin(self.conn, self.pipeline, f"dup-{self.seed}-{self.runs}",
                          txid=batch.attempt.txid)
            self._confirm("duplicate_trigger", again.attempt.txid == item.attempt.txid
                          and again.attempt.attempt > item.attempt.attempt,
                          f"a second begin of {item.attempt} gave {again.attempt}")
            self.zombies.append(item)
            item = InFlight(again.attempt, again.groups)
        if self._fault("run_died_silently"):
            with self.conn.cursor() as cur:  # its run is gone: nothing reports any more
                cur.execute("""UPDATE transactions SET heartbeat_at = now() - interval '1 day'
                               WHERE pipeline = %s AND txid = %s AND attempt = %s
                                 AND state = 'planned'""",
                            (self.pipeline.name, item.attempt.txid, item.attempt.attempt))
                died = cur.rowcount == 1
            self.conn.commit()
            self._confirm("run_died_silently", died, f"{item.attempt} is not planned")
            return
        self.in_flight.append(item)

    def _process(self, item: InFlight, faults: bool = True) -> None:
        from onceflow.spark.processing import process_batch

        for group in range(item.groups):
            if faults and self._fault("fenced_while_processing"):
                def staged_after_a_new_attempt(conn, pipeline, ta, group, **kw):
                    # a duplicate run begins while this attempt computes: its staging is
                    # refused by the staging fence itself
                    newer = begin(self.conn, self.pipeline, f"late-dup-{self.seed}-{self.runs}",
                                  txid=ta.txid)
                    self.in_flight.append(InFlight(newer.attempt, newer.groups))
                    return stage_group(conn, pipeline, ta, group, **kw)
                try:
                    process_batch(self.spark, self.dsn, self.pipeline, item.attempt, group,
                                  stage=staged_after_a_new_attempt)
                except Fenced:
                    self._confirm("fenced_while_processing", True)
                    self.outcomes["zombie_fenced_at_staging"] += 1
                    return
                raise AssertionError(f"{item.attempt} staged after a newer attempt began")
            if faults and self._fault("kill_inside_staging"):
                def staged_by_agent(conn, pipeline, ta, group, **kw):
                    with tempfile.TemporaryDirectory() as folder:
                        for name in ("deltas", "rejects", "failures"):
                            Path(folder, f"{name}.csv").write_bytes(kw.pop(f"{name}_csv").read())
                        Path(folder, "meta.json").write_text(json.dumps(
                            {"records": kw["records"], "replayed": kw["replayed"],
                             "stateful": list(kw["stateful"])}))
                        self._kill("kill_inside_staging",
                                   self._agent("stage", ta, "--group", str(group),
                                               "--staging", folder), "staging")
                    raise KilledAgent("killed inside staging")
                try:
                    process_batch(self.spark, self.dsn, self.pipeline, item.attempt, group,
                                  stage=staged_by_agent)
                except KilledAgent:
                    pass  # Airflow retries the task: processed again below
            process_batch(self.spark, self.dsn, self.pipeline, item.attempt, group)
        item.processed = True

    def _commit(self, item: InFlight) -> bool:
        """True when the txid is committed (or was before). Faults are drawn only when the
        commit can reach them: it is the txid's turn and its staging is whole (else the
        commit, or an agent's, stops before its first step). A crash empties the staging, so
        no kill follows it."""
        reachable = self._commit_reaches_its_steps(item)
        if reachable and self.restart_postgres is not None and \
                self._fault("postgres_crash_before_commit"):
            before = self._server_started()
            self.restart_postgres()
            self._reconnect()
            after = self._server_started()
            self._confirm("postgres_crash_before_commit", after != before,
                          f"the server's start time is still {before}")
        elif reachable:
            if self._fault("kill_inside_commit"):
                step = self.rng.choice(self.commit_steps)
                kill = self._kill("kill_inside_commit",
                                  self._agent("commit", item.attempt, "--pause-at", step),
                                  f"commit:{step}")
                if kill.killed:
                    self.outcomes[f"killed at commit:{step}"] += 1
            if self._fault("kill_after_commit"):
                at = self.rng.choice(sorted(AFTER_COMMIT))
                self._kill("kill_after_commit",
                           self._agent("commit", item.attempt, "--pause-at", at),
                           AFTER_COMMIT[at])
        result = commit(self.conn, self.pipeline, item.attempt, coordinator_dsn=self.dsn)
        return result.status in ("committed", "already_committed")

    def _zombie(self) -> None:
        """A stale attempt wakes up: it may neither stage nor commit."""
        item = self.zombies.pop(self.rng.randrange(len(self.zombies)))
        self.attempted["zombie_woke"] += 1
        try:
            if self.rng.random() < 0.5:
                self._process(item, faults=False)
            else:
                commit(self.conn, self.pipeline, item.attempt, coordinator_dsn=self.dsn)
        except Fenced:
            self._confirm("zombie_woke", True)
            return
        with self.conn.cursor() as cur:
            state = txlog.fence(cur, self.pipeline.name, item.attempt)
        self.conn.commit()
        raise AssertionError(f"zombie {item.attempt} was not fenced (state {state})")

    def step(self) -> None:
        self.steps += 1
        if self.zombies and self.rng.random() < 0.2:
            self._zombie()
            return
        if len(self.in_flight) < 3 and self.rng.random() < 0.5:
            self._begin()
            return
        if not self.in_flight:
            self._begin()
            return
        item = self.in_flight.pop(self.rng.randrange(len(self.in_flight)))
        try:
            if not item.processed:
                if self._fault("process_failed"):
                    self._confirm("process_failed", self._fail(
                        item, "process failed after its last retry (injected)"),
                        f"{item.attempt} could not be marked failed")
                    return
                self._process(item)
            if not self._commit(item):
                self.in_flight.append(item)  # waiting for its turn: later
        except Fenced:
            self.zombies.append(item)
        except StagingIncomplete:
            self.outcomes["staging_found_incomplete"] += 1  # the commit failed the attempt

    def run(self, transactions: int, max_steps: int = 2000, cover: tuple[str, ...] = ()
            ) -> None:
        """Faults until ``transactions`` txids committed and every kind in ``cover``
        happened at least once."""
        if self.restart_postgres is None:
            cover = tuple(k for k in cover if k != "postgres_crash_before_commit")
        while self._last_committed() < transactions or any(not self.happened[k] for k in cover):
            assert self.steps < max_steps, (
                f"after {self.steps} steps (seed {self.seed}): "
                f"{self._last_committed()} of {transactions} txids committed, never happened: "
                f"{[k for k in cover if not self.happened[k]]}")
            self.step()

    def drain(self, max_runs: int = 200) -> None:
        """Transactions without faults until nothing is left to read or replay: first the
        runs still in flight fail (as after their last retry), then new runs adopt them and
        read what is left."""
        from onceflow.spark.processing import process_batch

        self.rate = 0.0
        for item in self.in_flight:  # their runs give up: the drain's runs adopt them
            self._fail(item, "the fault run ended")
        self.in_flight.clear()
        for n in range(max_runs):
            batch = begin(self.conn, self.pipeline, f"drain-{self.seed}-{n}")
            if batch.committed:
                continue
            for group in range(batch.groups):
                process_batch(self.spark, self.dsn, self.pipeline, batch.attempt, group)
            result = commit(self.conn, self.pipeline, batch.attempt, coordinator_dsn=self.dsn)
            if result.status == "waiting":
                continue
            with self.conn.cursor() as cur:
                cur.execute("SELECT count(*) FROM backflow_items WHERE pipeline = %s",
                            (self.pipeline.name,))
                queued = cur.fetchone()[0]
                open_txids = txlog.uncommitted(cur, self.pipeline.name)
            self.conn.commit()
            if batch.records == 0 and batch.replayed == 0 and not queued and not open_txids:
                return
        raise AssertionError(f"not drained after {max_runs} runs (seed {self.seed})")

    def close(self) -> None:
        self.conn.close()


class KilledAgent(RuntimeError):
    pass


if __name__ == "__main__":
    sys.exit(agent_main())
