"""A Kafka broker down while a pipeline's DAG runs: the task fails naming the broker,
Airflow retries it, and once the broker is back the batch commits exactly once (against an
oracle over what the test produced). The library-path cases (begin and process against a
paused broker, a broker that lost data) are in tests/test_kafka_source.py."""

from __future__ import annotations

import os
import signal
import sqlite3
import threading
import time
from datetime import UTC, datetime
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
    out, err = capfd.readouterr()
    logs = Path(airflow_db) / "logs" / f"dag_id={dag.dag_id}"
    said = out + err + "".join(p.read_text(errors="replace") for p in logs.rglob("*")
                               if p.is_file()) if logs.exists() else out + err
    assert f"Kafka broker {broker.bootstrap} (connection 'kafka_default') did not answer" \
        in said
    assert str(dr.state) == "success"
    tries = {ti.task_id: ti.try_number for ti in dr.get_task_instances()}
    assert tries["begin"] == 2 and tries["commit"] == 1
    assert table(conn, "SELECT txid, attempt, outcome FROM transaction_attempts "
                       "WHERE pipeline = 'kafka_views'") == [(1, 1, "committed")]
    assert_exact(conn, produced)
    assert committed_offsets(conn) == ends(produced)
