"""Where a begin's time goes, recorded per attempt and logged: waiting for locks, indexing
new source data, planning. A begin that waits for a lock the test holds records the wait."""

from __future__ import annotations

import threading
import time

import psycopg2
from test_landing import land

from helpers import table
from onceflow.core.begin import begin
from onceflow.core.registration import register
from onceflow.core.registry import get_pipeline
from onceflow.ops.status import pipeline_status
from onceflow.sources.landing import LandingFolder
from tweets_example.data import generate

HOLD_S = 1.0


def _begin_while_held(conn, dsn: str, pipeline, run_id: str, lock_sql: str, params
                      ) -> float:
    """Take the lock ``lock_sql`` selects in another connection, start a begin, free the
    lock after HOLD_S; the begin's wall time."""
    holder = psycopg2.connect(dsn)
    try:
        with holder.cursor() as cur:
            cur.execute(lock_sql, params)
            assert cur.rowcount >= 1  # the lock is held: the begin must wait for it
        done: dict = {}

        def run() -> None:
            started = time.monotonic()
            try:
                done["batch"] = begin(conn, pipeline, run_id)
            finally:
                done["wall"] = time.monotonic() - started

        thread = threading.Thread(target=run)
        thread.start()
        # the begin's session waits for the lock (PostgreSQL says so): from now, HOLD_S more
        deadline = time.monotonic() + 60
        with holder.cursor() as cur:
            while True:
                cur.execute("SELECT count(*) FROM pg_locks WHERE pid = %s AND NOT granted",
                            (conn.get_backend_pid(),))
                if cur.fetchone()[0]:
                    break
                assert time.monotonic() < deadline and thread.is_alive(), done
                time.sleep(0.01)
        time.sleep(HOLD_S)
        assert thread.is_alive() and "wall" not in done  # still waiting
        holder.commit()
        thread.join(60)
        assert "batch" in done
        return done["wall"]
    finally:
        holder.close()


def _split(conn, txid: int, attempt: int = 1) -> tuple[float, float, float]:
    return table(conn, """SELECT begin_lock_s, begin_index_s, begin_plan_s
                          FROM transaction_attempts
                          WHERE pipeline = 'tweets' AND txid = %s AND attempt = %s""",
                 (txid, attempt))[0]


def test_a_begin_records_its_wait_for_the_coordinator_lock(conn, dsn, caplog):
    pipeline = get_pipeline("tweets", batch_size=100)
    register(conn, pipeline, create_source=True)
    pipeline.source.append(conn, generate(300, seed=3))
    caplog.set_level("INFO", logger="onceflow.core.begin")
    wall = _begin_while_held(conn, dsn, pipeline, "run-1",
                             "SELECT 1 FROM pipelines WHERE name = %s FOR UPDATE", ("tweets",))
    lock, index, plan = _split(conn, 1)
    assert HOLD_S <= lock <= wall
    assert index == 0.0  # a PostgreSQL log has nothing to index
    assert 0.0 < plan < HOLD_S and lock + index + plan <= wall
    line = next(r.getMessage() for r in caplog.records
                if r.getMessage().startswith("BEGIN pipeline=tweets txid=1 attempt=1"))
    assert line.endswith(f"lock_wait={lock:.3f}s index=0.000s plan={plan:.3f}s")
    # a new attempt of the txid (the run's retry) records its own begin
    begin(conn, pipeline, "run-1")
    lock2, index2, plan2 = _split(conn, 1, attempt=2)
    assert 0.0 <= lock2 < HOLD_S and index2 == 0.0 and plan2 > 0.0
    with conn.cursor() as cur:
        status = pipeline_status(cur, pipeline.source, "tweets", 10)
    conn.commit()
    assert status.transactions[0].begin_s == (lock2, index2, plan2)


def test_a_landing_folder_begin_splits_indexing_from_its_wait_for_the_partitions(
        conn, dsn, tmp_path):
    folder = tmp_path / "landing"
    folder.mkdir()
    pipeline = get_pipeline("tweets", batch_size=20_000, source=LandingFolder(
        topic="split_tweets", path=str(folder), partitions=2, chunk_bytes=65536))
    register(conn, pipeline, create_source=True)
    payloads = list(generate(20_000, seed=4))
    for i in range(8):
        land(folder, f"part-{i}.jsonl", payloads[i * 2500:(i + 1) * 2500], age_s=60 - i)
    # the begin holds the coordinator row, then waits for the partition rows the test holds
    wall = _begin_while_held(
        conn, dsn, pipeline, "run-1",
        "SELECT 1 FROM source_partitions WHERE topic = %s FOR UPDATE", ("split_tweets",))
    lock, index, plan = _split(conn, 1)
    assert HOLD_S <= lock <= wall
    assert 0.0 < index < HOLD_S  # reading 8 files' lines: not the wait
    assert lock + index + plan <= wall
    assert table(conn, "SELECT records FROM transactions WHERE pipeline = 'tweets'") \
        == [(20_000,)]
