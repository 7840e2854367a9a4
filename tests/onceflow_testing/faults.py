"""Real faults, for the fault tests and the long fault run (bench/fault_run.py).

A ``FaultRun`` drives a pipeline's transactions (begin, process, commit, called directly with
one Spark session) in a random but seeded order, and on the way:

- kills with SIGKILL a process that is staging a group (inside its PostgreSQL transaction),
  one inside the commit transaction (at a random step) and one right after its COMMIT;
- restarts PostgreSQL in immediate mode (a crash: unlogged staging is emptied) between the
  staging and the commit of a batch;
- starts a second run of a txid that is in flight (a duplicate trigger): the first attempt
  becomes a zombie, and the harness later makes it stage and commit, which must be refused;
- lets a run die silently (its lease runs out): the next begin adopts the txid;
- marks an attempt failed after a fault, as Airflow's failure callback does after the last
  retry, so that a later run adopts it.

Killed processes are agents, ``python -m onceflow_testing.faults stage|commit ...``, which do one
write and pause at the chosen point until they are killed. After the faults, ``drain`` runs
transactions without faults until every record is committed, rejected or dead. The caller
then compares the state with an oracle of its own (from what it produced, not from
onceflow's tables).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psycopg2

from onceflow.core import txlog
from onceflow.core.begin import begin, mark_failed
from onceflow.core.commit import commit
from onceflow.core.db import connect
from onceflow.core.errors import Fenced, MaxPendingReached, StagingIncomplete
from onceflow.core.pipeline import Pipeline
from onceflow.core.registry import get_pipeline
from onceflow.core.staging import stage_group
from onceflow.core.txlog import TransactionAttempt

log = logging.getLogger(__name__)

COMMIT_STEPS = ("locked", "rejects", "backflow", "offsets", "staging", "commit_record")
PAUSED = "PAUSED"


# -- the agent: one write, paused until killed ----------------------------------------------------
def _pause(where: str) -> None:
    print(f"{PAUSED} {where}", flush=True)
    time.sleep(3600)


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
    parser.add_argument("--pause-at", help="a commit step, or 'after' (after COMMIT)")
    args = parser.parse_args(argv)
    pipeline = get_pipeline(args.pipeline, **json.loads(args.settings))
    ta = TransactionAttempt(args.txid, args.attempt)
    dsn = os.environ["ONCEFLOW_PG_DSN"]
    conn = connect(dsn, application_name="onceflow-fault-agent")
    if args.action == "stage":
        folder = Path(args.staging)
        meta = json.loads((folder / "meta.json").read_text())
        with open(folder / "deltas.csv", "rb") as d, open(folder / "rejects.csv", "rb") as r, \
                open(folder / "failures.csv", "rb") as f:
            stage_group(conn, pipeline.name, ta, args.group, deltas_csv=d, rejects_csv=r,
                        failures_csv=f, before_commit=lambda: _pause("staging"), **meta)
        return 0

    def on_step(name: str) -> None:
        if name == args.pause_at:
            _pause(f"commit:{name}")

    result = commit(conn, pipeline, ta, on_step=on_step, coordinator_dsn=dsn)
    print(f"COMMIT {result.status}", flush=True)
    if args.pause_at == "after":
        _pause("after commit")
    return 0


def run_and_kill(argv: list[str], env: dict[str, str], timeout: float = 120) -> str:
    """Start an agent, wait until it pauses, SIGKILL it. Returns where it paused ("" if it
    ended first, e.g. fenced)."""
    proc = subprocess.Popen([sys.executable, "-m", "onceflow_testing.faults", *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    try:
        for line in proc.stdout:
            if line.startswith(PAUSED):
                os.kill(proc.pid, signal.SIGKILL)
                return line.split(" ", 1)[1].strip()
            if time.monotonic() > deadline:
                break
        return ""
    finally:
        proc.kill()
        proc.wait(timeout=30)


# -- the harness ----------------------------------------------------------------------------------
@dataclass
class InFlight:
    attempt: TransactionAttempt
    groups: int
    processed: bool = False


@dataclass
class FaultRun:
    """See the module docstring. ``settings``: the pipeline's overrides (the agents load the
    pipeline by name with them); ``restart_postgres``: crash-restart the server (None: no
    such faults); ``rate``: how often a fault is drawn at each point."""

    pipeline: Pipeline
    dsn: str
    spark: object
    seed: int
    settings: dict = field(default_factory=dict)
    restart_postgres: Callable[[], None] | None = None
    rate: float = 0.15
    faults: Counter = field(default_factory=Counter)
    steps: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.conn = connect(self.dsn)
        self.env = {**os.environ, "ONCEFLOW_PG_DSN": self.dsn}
        self.in_flight: list[InFlight] = []
        self.zombies: list[InFlight] = []
        self.runs = 0

    # plumbing
    def _reconnect(self) -> None:
        try:
            self.conn.close()
        except psycopg2.Error:
            pass
        self.conn = connect(self.dsn)

    def _fault(self, kind: str) -> bool:
        if self.rng.random() < self.rate:
            self.faults[kind] += 1
            return True
        return False

    def _agent(self, action: str, ta: TransactionAttempt, *extra: str) -> list[str]:
        return [action, "--pipeline", self.pipeline.name, "--settings",
                json.dumps(self.settings), "--txid", str(ta.txid), "--attempt",
                str(ta.attempt), *extra]

    def _fail(self, item: InFlight, why: str) -> None:
        """The task failed after its last retry: Airflow's callback marks the attempt."""
        mark_failed(self.conn, self.pipeline.name, item.attempt, why)

    def _last_committed(self) -> int:
        with self.conn.cursor() as cur:
            last = txlog.last_committed(cur, self.pipeline.name)
        self.conn.commit()
        return last

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
            self.zombies.append(item)
            item = InFlight(again.attempt, again.groups)
        if self._fault("run_died_silently"):
            with self.conn.cursor() as cur:  # its run is gone: nothing reports any more
                cur.execute("""UPDATE transactions SET heartbeat_at = now() - interval '1 day'
                               WHERE pipeline = %s AND txid = %s""",
                            (self.pipeline.name, item.attempt.txid))
            self.conn.commit()
            return
        self.in_flight.append(item)

    def _process(self, item: InFlight) -> None:
        from spark_tasks.processing import process_batch

        for group in range(item.groups):
            if self._fault("fenced_while_processing"):
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
                    self.faults["zombie_fenced_at_staging"] += 1
                    return
                raise AssertionError(f"{item.attempt} staged after a newer attempt began")
            if self._fault("kill_inside_staging"):
                def staged_by_agent(conn, pipeline, ta, group, **kw):
                    with tempfile.TemporaryDirectory() as folder:
                        for name in ("deltas", "rejects", "failures"):
                            Path(folder, f"{name}.csv").write_bytes(kw.pop(f"{name}_csv").read())
                        Path(folder, "meta.json").write_text(json.dumps(
                            {"records": kw["records"], "replayed": kw["replayed"],
                             "stateful": list(kw["stateful"])}))
                        run_and_kill(self._agent("stage", ta, "--group", str(group),
                                                 "--staging", folder), self.env)
                    raise KilledAgent("killed inside staging")
                try:
                    process_batch(self.spark, self.dsn, self.pipeline, item.attempt, group,
                                  stage=staged_by_agent)
                except KilledAgent:
                    pass  # Airflow retries the task: processed again below
            process_batch(self.spark, self.dsn, self.pipeline, item.attempt, group)
        item.processed = True

    def _commit(self, item: InFlight) -> bool:
        """True when the txid is committed (or was before)."""
        if self.restart_postgres is not None and self._fault("postgres_crash_before_commit"):
            self.restart_postgres()
            self._reconnect()
        if self._fault("kill_inside_commit"):
            step = self.rng.choice(COMMIT_STEPS)
            run_and_kill(self._agent("commit", item.attempt, "--pause-at", step), self.env)
        if self._fault("kill_after_commit"):
            run_and_kill(self._agent("commit", item.attempt, "--pause-at", "after"), self.env)
        result = commit(self.conn, self.pipeline, item.attempt, coordinator_dsn=self.dsn)
        return result.status in ("committed", "already_committed")

    def _zombie(self) -> None:
        """A stale attempt wakes up: it may neither stage nor commit."""
        item = self.zombies.pop(self.rng.randrange(len(self.zombies)))
        try:
            if self.rng.random() < 0.5:
                self._process(item)
            else:
                commit(self.conn, self.pipeline, item.attempt, coordinator_dsn=self.dsn)
        except Fenced:
            self.faults["zombie_fenced"] += 1
            return
        try:  # _process counts a zombie fenced at its staging itself and returns
            with self.conn.cursor() as cur:
                state = txlog.fence(cur, self.pipeline.name, item.attempt)
        except Fenced:
            self.conn.rollback()
            return
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
                    self._fail(item, "process failed after its last retry (injected)")
                    return
                self._process(item)
            if not self._commit(item):
                self.in_flight.append(item)  # waiting for its turn: later
        except Fenced:
            self.zombies.append(item)
        except StagingIncomplete:
            self.faults["staging_found_incomplete"] += 1  # the commit failed the attempt

    def run(self, transactions: int, max_steps: int = 2000) -> None:
        """Faults until ``transactions`` txids committed."""
        while self._last_committed() < transactions:
            assert self.steps < max_steps, f"no progress after {self.steps} steps " \
                                           f"(seed {self.seed})"
            self.step()

    def drain(self, max_runs: int = 200) -> None:
        """Transactions without faults until nothing is left to read or replay: first the
        runs still in flight fail (as after their last retry), then new runs adopt them and
        read what is left."""
        from spark_tasks.processing import process_batch

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
