"""The benchmarks under bench/ stay runnable: each runs here in a tiny size (the figures mean
nothing at this size; the full runs are documented in README), every system's result checked
against its ground truth by the benchmark itself."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bench(script: str, args: list[str], tmp_path: Path, dsn: str) -> str:
    env = {**os.environ, "ONCEFLOW_HOME": str(tmp_path),
           "ONCEFLOW_SPARK_CONNECT_PORT": str(_free_port()),
           "ONCEFLOW_PG_DSN": dsn}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_the_peer_comparison_runs_every_system_and_checks_it(tmp_path, dsn, monkeypatch,
                                                            spark_connect_server):
    # the run's warm Spark Connect server (a user's running server: --spark-connect)
    out = _bench("compare.py", ["--events", "20000", "--batches", "2", "--acker-events", "4000",
                                "--acker-rounds", "1", "--folder", str(tmp_path / "bench"),
                                "--server-warm-up", "1",
                                "--spark-connect", f"sc://127.0.0.1:{spark_connect_server}"],
                 tmp_path, dsn)
    rows = {line[:36].strip(): line.split()[-1] for line in out.splitlines()
            if line.startswith(("raw Spark", "Structured", "onceflow "))}
    assert set(rows) == {"raw Spark batch", "Structured Streaming",
                         "Structured Streaming, JSON source",
                         "onceflow library (local session)", "onceflow library (Spark Connect)",
                         "onceflow through Airflow, one task",
                         "onceflow through Airflow, 3 tasks"}, out
    assert set(rows.values()) == {"OK"}, out
    # every system's CPU seconds, measured (the column before the check)
    cpu = {line[:36].strip(): line.split()[-2] for line in out.splitlines()
           if line.startswith(("raw Spark", "Structured", "onceflow "))}
    assert all(float(v) > 0 for v in cpu.values()), out
    # the systems but Airflow's ran twice, interleaved (the faster round counts)
    assert "round 2 of 2: onceflow library (local session)" in out, out
    assert "round 2 of 2: onceflow library (Spark Connect)" in out, out
    # the Spark Connect server ran the workload once before its systems' clocks, checked
    assert "Spark Connect server warm-up round 1 of 1: " in out, out
    assert "warm-up round 1 of 1: " in out.split("round 1 of 2: onceflow library (Spark")[0]
    assert [line.split()[-1] for line in out.splitlines()
            if "server warm-up round" in line] == ["OK"], out
    assert "load average" in out and "acker (tweets topology" in out
