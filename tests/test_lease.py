"""An attempt's lease (onceflow.core.lease) on real PostgreSQL: a holder that reports keeps its
txid however long it works; a holder killed mid-work loses it within the short lease (not the
ten minutes it took before); `onceflow status` names the txid, its holder and the command that
frees it; `onceflow release` refuses a holder that reports and frees a silent one, fenced."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from helpers import table, tweets_pipeline
from onceflow.cli import main
from onceflow.core import txlog
from onceflow.core.begin import begin
from onceflow.core.commit import commit
from onceflow.core.errors import ConfigError, Fenced
from onceflow.core.pipeline import DEFAULT_ATTEMPT_LEASE_S
from onceflow.core.txlog import TransactionAttempt

LEASE_S = 4  # the tests' attempt lease (ONCEFLOW_ATTEMPT_LEASE_S): a report every second

# A run's task that begins txid 1 and works on it for ever, reporting its lease, until killed.
HOLDER = """
import sys, time
from onceflow.core.begin import begin
from onceflow.core.db import connect, dsn_from_env
from onceflow.core.lease import AttemptLease
from onceflow.core.registry import get_pipeline

pipeline = get_pipeline("tweets", batch_size=300)
conn = connect(dsn_from_env())
ta = begin(conn, pipeline, "doomed-run").attempt
with AttemptLease(dsn_from_env(), pipeline.name, ta, pipeline.attempt_heartbeat_s,
                  lease_s=pipeline.lease_s):
    print("HOLDING", ta.txid, ta.attempt, flush=True)
    time.sleep(600)
"""


@pytest.fixture(autouse=True)
def short_lease(monkeypatch):
    monkeypatch.setenv("ONCEFLOW_ATTEMPT_LEASE_S", str(LEASE_S))


def status_text(capsys, code: int = 0) -> str:
    """``code``: 0 while every txid is in flight, 1 when one is stalled (abandoned)."""
    capsys.readouterr()
    assert main(["status", "--pipeline", "tweets"]) == code
    return " ".join(capsys.readouterr().out.split())  # lines wrap at 100 columns


def wait_until(conn, query: str, timeout: float = 60) -> float:
    """Seconds until ``query`` returns true (polled, not slept through)."""
    started = time.monotonic()
    while not table(conn, query)[0][0]:
        assert time.monotonic() - started < timeout, f"never true: {query}"
        time.sleep(0.1)
    return time.monotonic() - started


def test_the_lease_is_a_setting_with_a_short_default(monkeypatch, conn):
    pipeline = tweets_pipeline(conn)
    assert pipeline.lease_s == LEASE_S and pipeline.attempt_heartbeat_s == 1.0
    assert pipeline.with_settings(attempt_lease_s=30).lease_s == 30  # the declaration wins
    monkeypatch.delenv("ONCEFLOW_ATTEMPT_LEASE_S")
    assert pipeline.lease_s == DEFAULT_ATTEMPT_LEASE_S == 60
    assert pipeline.handoff_lease_s == 600
    monkeypatch.setenv("ONCEFLOW_ATTEMPT_LEASE_S", "soon")
    with pytest.raises(ConfigError, match="ONCEFLOW_ATTEMPT_LEASE_S='soon' is invalid: give a "
                                          "positive whole number of seconds"):
        pipeline.validate()


@pytest.mark.timeout(120)
def test_a_killed_holder_loses_its_txid_within_the_lease_a_live_one_keeps_it(conn, capsys):
    pipeline = tweets_pipeline(conn, events=900, batch_size=300)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        assert holder.stdout.readline().split() == ["HOLDING", "1", "1"]
        # a holder that works for longer than several leases keeps its txid: it reports
        wait_until(conn, f"""SELECT now() - planned_at > interval '{3 * LEASE_S} seconds'
                             FROM transactions WHERE txid = 1""")
        assert txlog_adoptable(conn) is None
        other = begin(conn, pipeline, "next-run")
        assert other.attempt == TransactionAttempt(2, 1)  # a new txid, not txid 1
        assert table(conn, "SELECT holder FROM transactions WHERE txid = 1") == [
            (f"{os.uname().nodename} pid {holder.pid}",)]
        said = status_text(capsys)
        assert re.search(r"txid 1 \(planned\): .*\(run doomed-run, attempt 1\); held by "
                         + re.escape(f"{os.uname().nodename} pid {holder.pid}, last report"),
                         " ".join(said.split())), said
        assert "-> if its run is dead, free it now: onceflow release --pipeline tweets " \
               "--txid 1" in said
        # the freeing command refuses a holder that reports
        assert main(["release", "--pipeline", "tweets", "--txid", "1"]) == 2
        refused = capsys.readouterr().err
        assert "txid 1 attempt 1 of tweets is held by run doomed-run" in refused
        assert "a task of it is running" in refused and "--force" in refused
        os.kill(holder.pid, signal.SIGKILL)  # the task dies in the middle of its work
        holder.wait()
        waited = wait_until(conn, """SELECT heartbeat_at < now() - make_interval(secs => lease_s)
                                     FROM transactions WHERE txid = 1""")
    finally:
        holder.kill()
        holder.wait()
    assert waited < 60, "adopted within about a minute, not the lease of ten minutes"
    assert "(abandoned)" in status_text(capsys, code=1)
    adopter = begin(conn, pipeline, "adopting-run")
    assert adopter.attempt == TransactionAttempt(1, 2)
    assert table(conn, """SELECT attempt, run_id, outcome FROM transaction_attempts
                          WHERE txid = 1 ORDER BY attempt""") == [
        (1, "doomed-run", "abandoned"), (2, "adopting-run", None)]
    with pytest.raises(Fenced):  # the dead holder's attempt can never commit
        commit(conn, pipeline, TransactionAttempt(1, 1))


def txlog_adoptable(conn):
    with conn.cursor() as cur:
        found = txlog.adoptable(cur, "tweets")
    conn.commit()
    return found


def test_release_refuses_a_reporting_holder_and_frees_a_silent_one(conn, capsys):
    pipeline = tweets_pipeline(conn, events=900, batch_size=300)
    # txid 1's run went on in another task (the hand-over lease, ten leases) and that task
    # never started: no report for longer than the lease
    waiting = begin(conn, pipeline, "queued-run", lease_s=pipeline.handoff_lease_s)
    with conn.cursor() as cur:
        cur.execute("UPDATE transactions SET heartbeat_at = now() - interval '30 seconds'")
    conn.commit()
    fresh = begin(conn, pipeline, "working-run")  # not adoptable yet: a new txid
    assert fresh.attempt == TransactionAttempt(2, 1)
    said = status_text(capsys)
    assert re.search(r"txid 1 \(planned\): .*\(run queued-run, attempt 1\); held by ",
                     " ".join(said.split())), said
    # one lease for every txid (the pipeline's, 4 s), the hand-over said as such
    assert re.search(r"last report 3\ds ago, lease 4s, 40s between two tasks \(hand-over\): "
                     r"adoptable in \d+s if it stays silent", " ".join(said.split())), said
    assert main(["release", "--pipeline", "tweets", "--txid", "2"]) == 2
    assert re.search(r"reported \ds ago, within the 4s lease", capsys.readouterr().err)
    assert main(["release", "--pipeline", "tweets", "--txid", "1"]) == 0
    assert "released txid 1 attempt 1 of tweets (run queued-run" in capsys.readouterr().out
    assert table(conn, "SELECT txid, state FROM transactions ORDER BY txid") == [
        (1, "failed"), (2, "planned")]
    assert main(["release", "--pipeline", "tweets", "--txid", "1"]) == 2
    assert "txid 1 of tweets is failed, not planned: nothing holds it (the next run adopts " \
           "it)" in capsys.readouterr().err
    assert begin(conn, pipeline, "adopting-run").attempt == TransactionAttempt(1, 2)
    with pytest.raises(Fenced):
        commit(conn, pipeline, waiting.attempt)
    # --force frees even a holder that reports; its writes are refused from then on
    assert main(["release", "--pipeline", "tweets", "--txid", "2", "--force"]) == 0
    with pytest.raises(Fenced):
        commit(conn, pipeline, fresh.attempt)
    assert table(conn, """SELECT txid, attempt, outcome, reason LIKE 'released by%%'
                          FROM transaction_attempts ORDER BY txid, attempt""") == [
        (1, 1, "abandoned", True), (1, 2, None, None), (2, 1, "abandoned", True)]
