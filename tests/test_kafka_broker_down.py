"""A Kafka broker down while a pipeline's DAG runs: the task fails naming the broker,
Airflow retries it, and once the broker is back the batch commits exactly once (against an
oracle over what the test produced); a broker restarted empty under a planned batch (memory
storage: data loss) is refused and nothing is committed. The library-path cases (begin and
process against a paused broker, a broker that lost data) are in tests/test_kafka_source.py.

The faults of the process task happen in a ``pre_execute`` hook of the DAG's tasks: just
before the process task's work, on the try the test chooses, so no timing decides whether
the fault came before the read."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from test_kafka_source import (  # noqa: F401 (the fixtures)
    TOPIC,
    assert_exact,
    broker,
    cli,
    committed_offsets,
    ends,
    views,
)
from test_outside_pipeline import payloads

from helpers import table


def begin_tries(airflow_home: str, dag_id: str) -> list[tuple[str, int]]:
    """(state, try_number) of the begin task instances, from Airflow's metadata database."""
    db = sqlite3.connect(f"file:{Path(airflow_home) / 'airflow.db'}?mode=ro", uri=True,
                         timeout=5)
    try:
        return db.execute("SELECT state, try_number FROM task_instance WHERE dag_id = ? "
                          "AND task_id = 'begin'", (dag_id,)).fetchall()
    except sqlite3.OperationalError:  # locked by a writer: asked again
        return []
    finally:
        db.close()


def task_logs(airflow_home: str, dag_id: str, capfd) -> str:
    """What the DAG run printed and its tasks' log files said."""
    out, err = capfd.readouterr()
    logs = Path(airflow_home) / "logs" / f"dag_id={dag_id}"
    files = [p for p in logs.rglob("*") if p.is_file()] if logs.exists() else []
    return out + err + "".join(p.read_text(errors="replace") for p in files)


def before_process(act):
    """A pre_execute hook for the DAG's tasks: ``act(try_number)`` just before the process
    task's execute."""

    def hook(context) -> None:
        ti = context["ti"]
        if ti.task_id == "process":
            act(ti.try_number)

    return hook


def test_a_broker_down_during_begin_fails_the_try_and_airflow_retries(
        views, broker, dsn, conn, airflow_db, warm_spark, capfd):  # noqa: F811
    """The broker is paused (SIGSTOP) before the run: begin's first try fails naming it; the
    test resumes the broker only once Airflow has the try failed (up for retry), and the
    retry plans and the run commits every record once."""
    from onceflow.airflow import transaction_dag

    assert cli("init", "--pipeline", "kafka_views").returncode == 0
    produced = broker.produce(TOPIC, payloads(120, seed=31), partitions=3)
    dag = transaction_dag(views)
    seen: list[list[tuple[str, int]]] = []
    resumed = threading.Event()

    def resume_after_the_failed_try() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            tries = begin_tries(airflow_db, dag.dag_id)
            if any(state == "up_for_retry" for state, _ in tries):
                seen.append(tries)
                break
            time.sleep(0.2)
        os.kill(broker.proc.pid, signal.SIGCONT)
        resumed.set()

    os.kill(broker.proc.pid, signal.SIGSTOP)
    watcher = threading.Thread(target=resume_after_the_failed_try, daemon=True)
    watcher.start()
    try:
        dr = dag.test(logical_date=datetime.now(UTC).replace(microsecond=0))
    finally:
        watcher.join(250)
        if not resumed.is_set():
            os.kill(broker.proc.pid, signal.SIGCONT)
    assert seen, "begin's first try never failed while the broker was paused"
    said = task_logs(airflow_db, dag.dag_id, capfd)
    assert f"Kafka broker {broker.bootstrap} (connection 'kafka_default') did not answer" \
        in said
    assert str(dr.state) == "success"
    tries = {ti.task_id: ti.try_number for ti in dr.get_task_instances()}
    assert tries["begin"] == 2 and tries["commit"] == 1
    assert table(conn, "SELECT txid, attempt, outcome FROM transaction_attempts "
                       "WHERE pipeline = 'kafka_views'") == [(1, 1, "committed")]
    assert_exact(conn, produced)
    assert committed_offsets(conn) == ends(produced)


def test_a_broker_down_during_process_fails_the_try_and_airflow_retries(
        views, broker, dsn, conn, airflow_db, warm_spark, capfd, monkeypatch):  # noqa: F811
    """The broker is paused (SIGSTOP) just before the process task's first try: its reader
    fails naming the broker; Airflow retries the task, the broker resumed just before the
    retry, which reads the planned records and the run commits each of them once."""
    from onceflow.airflow import transaction_dag

    monkeypatch.setenv("ONCEFLOW_RETRY_DELAY_SECONDS", "1")
    assert cli("init", "--pipeline", "kafka_views").returncode == 0
    produced = broker.produce(TOPIC, payloads(120, seed=37), partitions=3)
    tries: list[int] = []

    def paused_for_the_first_try(try_number: int) -> None:
        tries.append(try_number)
        os.kill(broker.proc.pid, signal.SIGSTOP if try_number == 1 else signal.SIGCONT)

    dag = transaction_dag(views, default_args={
        "pre_execute": before_process(paused_for_the_first_try)})
    try:
        dr = dag.test(logical_date=datetime.now(UTC).replace(microsecond=0))
    finally:
        os.kill(broker.proc.pid, signal.SIGCONT)
    said = task_logs(airflow_db, dag.dag_id, capfd)
    assert tries == [1, 2], "the process task did not fail once and retry"
    assert f"Kafka broker {broker.bootstrap} (connection 'kafka_default') did not answer a " \
           "list-offsets request for partition" in said
    assert str(dr.state) == "success"
    assert {ti.task_id: ti.try_number for ti in dr.get_task_instances()} == \
        {"begin": 1, "process": 2, "commit": 1}
    assert table(conn, "SELECT txid, attempt, outcome FROM transaction_attempts "
                       "WHERE pipeline = 'kafka_views'") == [(1, 1, "committed")]
    assert_exact(conn, produced)
    assert committed_offsets(conn) == ends(produced)


def test_a_broker_restarted_empty_mid_batch_is_refused_through_the_dag(
        views, broker, dsn, conn, airflow_db, warm_spark, capfd, monkeypatch):  # noqa: F811
    """A first run commits 150 records. Just before the second run's process task, the
    broker is killed and started again empty (memory storage), the topic re-created with 10
    records per partition: below the planned range and the committed offsets. The process
    task fails saying the broker lost records, the run fails, nothing more is committed, and
    `onceflow status` names the loss and the fix."""
    from onceflow.airflow import transaction_dag

    monkeypatch.setenv("ONCEFLOW_RETRY_DELAY_SECONDS", "1")
    assert cli("init", "--pipeline", "kafka_views").returncode == 0
    produced = broker.produce(TOPIC, payloads(300, seed=41), partitions=3)
    armed, restarted, tries = [False], [], []

    def restarted_empty(try_number: int) -> None:
        if armed[0]:
            tries.append(try_number)
        if armed[0] and not restarted:
            broker.kill()
            broker.start()  # the same port, nothing kept
            broker.create_topic(TOPIC, 3)
            broker.produce(TOPIC, payloads(30, seed=42), partitions=3)
            restarted.append(try_number)

    dag = transaction_dag(views, default_args={"pre_execute": before_process(restarted_empty)})
    base = datetime.now(UTC).replace(microsecond=0)
    assert str(dag.test(logical_date=base).state) == "success"
    assert committed_offsets(conn) == {0: 50, 1: 50, 2: 50}
    armed[0] = True
    dr = dag.test(logical_date=base + timedelta(seconds=1))
    said = " ".join(task_logs(airflow_db, dag.dag_id, capfd).split())
    assert restarted == [1]
    # the reader's KafkaDataLost, found in Spark's error, fails the task at once: no retry
    # could read what the broker no longer holds
    assert tries == [1]
    assert str(dr.state) == "failed"
    states = {ti.task_id: str(ti.state) for ti in dr.get_task_instances()}
    assert states["process"] == "failed" and states["commit"] == "upstream_failed"
    assert re.search(r"partition \d ends at offset 10, below the planned end \d+ of \[50, "
                     r"\d+\): the broker lost records of a planned batch", said)
    assert committed_offsets(conn) == {0: 50, 1: 50, 2: 50}
    assert table(conn, "SELECT txid, state FROM transactions WHERE pipeline = 'kafka_views' "
                       "ORDER BY txid") == [(1, "committed"), (2, "failed")]
    [(permanent, reason)] = table(conn, "SELECT permanent, reason FROM transaction_attempts "
                                        "WHERE pipeline = 'kafka_views' AND txid = 2")
    assert permanent and reason.startswith("process failed in run ") \
        and "KafkaDataLost: Kafka topic 'page_views' partition " in reason, reason
    assert_exact(conn, [r for r in produced if r[1] < 50])  # the first run's records only
    status = cli("status", "--pipeline", "kafka_views")
    assert status.returncode == 1, status.stdout + status.stderr  # stalled until someone acts
    shown = " ".join(status.stdout.split())
    assert "Kafka topic 'page_views' on 'kafka_default': the broker lost committed records " \
           "(partition 0 ends at 10, below the committed offset 50" in shown
    assert "onceflow reset --pipeline kafka_views --force-from-start" in shown
    assert "p0: log_start=0 head=10 committed=50 lag=-40" in status.stdout
