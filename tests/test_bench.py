"""The benchmarks stay runnable by a user: every script in bench/ answers --help where nothing
of onceflow's checkout imports (onceflow.dev, the tests' helpers), and runs at a tiny size there
(the figures mean nothing at these sizes; the full runs are in bench/RESULTS.md), every
system's result checked against its ground truth by the benchmark itself."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg2
from psycopg2 import sql

from onceflow.core import db

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if "__main__" in p.read_text())
# What a user of the wheel lacks: the checkout's helpers and the tests' own modules. A finder
# ahead of every other refuses them in the benchmarks' processes (and those they start).
BLOCKER = """import sys


class _CheckoutOnly:
    def find_spec(self, name, path=None, target=None):
        if name == "onceflow.dev" or name.startswith(("onceflow.dev.", "onceflow_testing")) \\
                or name in ("helpers", "conftest", "dag_runner"):
            raise ModuleNotFoundError(f"No module named {name!r} (not in onceflow's wheel)",
                                      name=name)
        return None


sys.meta_path.insert(0, _CheckoutOnly())
"""


def _installed_env(folder: Path, *, examples: bool = True, **extra: str) -> dict[str, str]:
    """The environment of a user who installed onceflow (and, with ``examples``, its two
    examples): the checkout's own modules refused, neither tests/ nor bench/ on the path."""
    (folder / "sitecustomize.py").write_text(BLOCKER)
    path = [str(folder)]
    if examples:  # as `pip install ./examples/tweets ./examples/orders` has them
        path += [str(p.parent) for p in sorted((ROOT / "examples").glob("*/pyproject.toml"))]
        path.append(str(Path(sys.prefix) / "examples"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "PYTHONPATH": os.pathsep.join(path), **extra}


def test_the_scripts_use_nothing_of_the_checkout_and_the_readme_lists_each():
    readme = (BENCH / "README.md").read_text()
    for path in sorted(BENCH.glob("*.py")):
        text = path.read_text()
        assert "onceflow.dev" not in text and "onceflow_testing" not in text, path.name
        assert "sys.path" not in text, f"{path.name} edits sys.path"
        assert not re.search(r"^\s*(from|import) (helpers|conftest)\b", text, re.M), path.name
    assert len(SCRIPTS) >= 13, SCRIPTS
    listed = set(re.findall(r"^\| `([a-z_]+\.py)` \|", readme, re.M))
    assert set(SCRIPTS) <= listed, set(SCRIPTS) - listed


def test_every_script_answers_help_where_only_the_package_is_installed(tmp_path):
    env = _installed_env(tmp_path)
    running = {name: subprocess.Popen([sys.executable, str(BENCH / name), "--help"],
                                      cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
               for name in SCRIPTS}
    for name, proc in running.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and out.startswith(f"usage: {name}"), (name, err[-2000:])
        assert "Traceback" not in err, (name, err[-2000:])
    # the finder does refuse what the wheel lacks
    refused = subprocess.run([sys.executable, "-c", "import onceflow.dev"], cwd=tmp_path,
                             env=env, capture_output=True, text=True)
    assert refused.returncode == 1 and "not in onceflow's wheel" in refused.stderr


def test_a_script_without_the_examples_says_how_to_install_them(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH / "bench_transactions.py"), "--help"],
                          cwd=tmp_path, env=_installed_env(tmp_path, examples=False),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "pip install ./examples/tweets ./examples/orders" in done.stderr, done.stderr
    assert "bash run.sh bench" in done.stderr and "Traceback" not in done.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bench_databases(server_dsn: str, prefix: str) -> set[str]:
    conn = psycopg2.connect(db.with_database(server_dsn, "postgres"))
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT datname FROM pg_database WHERE starts_with(datname, %s)",
                        (prefix,))
            return {name for (name,) in cur.fetchall()}
    finally:
        conn.close()


def _bench(script: str, args: list[str], tmp_path: Path, dsn: str) -> str:
    """Run a benchmark as a user of the package would; the databases it made on the server
    are dropped afterwards (named apart from any other run's on the server:
    ONCEFLOW_BENCH_DB)."""
    server = db.with_database(dsn, "postgres")
    prefix = f"onceflow_bench_t{uuid.uuid4().hex[:8]}"
    before = _bench_databases(server, prefix)
    env = _installed_env(tmp_path, ONCEFLOW_HOME=str(tmp_path), ONCEFLOW_BENCH_DB=prefix,
                         ONCEFLOW_SPARK_CONNECT_PORT=str(_free_port()), ONCEFLOW_PG_DSN=dsn)
    try:
        done = subprocess.run([sys.executable, str(BENCH / script), *args],
                              cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=900)
    finally:
        admin = psycopg2.connect(server)
        admin.autocommit = True
        with admin.cursor() as cur:
            for name in sorted(_bench_databases(server, prefix) - before):
                cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    sql.Identifier(name)))
        admin.close()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_the_peer_comparison_runs_every_system_and_checks_it(tmp_path, dsn, monkeypatch,
                                                            spark_connect_server):
    # one source, the JSON lines folder, which every system reads (every source is run by the
    # small bench command in bench/RESULTS.md); the run's warm Spark Connect server (a
    # user's running server: --spark-connect)
    out = _bench("compare.py", ["--events", "20000", "--batches", "2", "--acker-events", "4000",
                                "--acker-rounds", "1", "--folder", str(tmp_path / "bench"),
                                "--server-warm-up", "1", "--sources", "landing-json",
                                "--spark-connect", f"sc://127.0.0.1:{spark_connect_server}"],
                 tmp_path, dsn)
    rows, source = {}, None
    for line in out.splitlines():
        if line.startswith("source "):
            source = line.split()[1].rstrip(":")
        elif source and line.startswith(("raw Spark", "Structured", "onceflow ")):
            # name, then wall s ... CPU s, load, check
            rows[source, line[:36].strip()] = line.split()[-3:]
    ss = "Structured Streaming"
    ours = {"onceflow library (Spark Connect)", "onceflow through Airflow, one task"}
    assert set(rows) == {("landing-json", name) for name in {
        ss, "Structured Streaming, JSON source", "raw Spark batch",
        "onceflow library (local session)", "onceflow through Airflow, 3 tasks", *ours}}, out
    assert {check for _, _, check in rows.values()} == {"OK"}, out
    # every system's CPU seconds, measured
    assert all(float(cpu) > 0 for cpu, _, _ in rows.values()), out
    # and from /proc, by the processes each system started: Structured Streaming's JVM in
    # the bench's process tree, onceflow's Spark Connect server, PostgreSQL's backends of
    # each system's database, Airflow's task processes
    by_process = {line.split(" [")[0].strip(): line.split("(/proc): ")[1]
                  for line in out.splitlines() if "CPU s by process (/proc): " in line}
    assert "Spark JVM" in by_process[ss], out
    # (a lower bound sampled every 0.2 s: an Airflow task's own connections can end between
    # two samples, so the Airflow row may miss its backends)
    for name in (ss, "onceflow library (Spark Connect)"):
        assert "PostgreSQL backends" in by_process[name], out
    assert "task runs" in by_process["onceflow through Airflow, one task"], out
    # the opening table of bench/RESULTS.md: per source, CPU per million events of SS and
    # onceflow (library and Airflow), wall for both, the raw limit
    table = [line for line in out.splitlines() if line.startswith("| landing-json |")]
    assert len(table) == 1, out
    cells = [c.strip() for c in table[0].strip("|").split("|")]
    assert all(float(c) > 0 for c in cells[1:7]), table
    assert float(cells[7].split()[0]) > 0, table
    # the Airflow path's overhead, from the transactions' and Airflow's own timestamps
    assert "overhead: trigger to first txid planned " in out, out
    # Structured Streaming's JVM start, apart, and the ratios with and without it
    jvm = [line for line in out.splitlines()
           if line.startswith("Structured Streaming's JVM and session start: ")]
    assert jvm and float(jvm[-1].split(": ")[1].split("s")[0]) > 0, out
    assert "vs SS+JVM" in out, out
    # one timed round per system by default: no untimed round of the same workload before it
    assert "round 2 of" not in out, out
    # the Spark Connect server ran the workload once (asked for here) before the sources, checked
    assert "Spark Connect server warm-up round 1 of 1: " in out, out
    assert out.index("warm-up round 1 of 1: ") < out.index("source landing-json: ")
    assert [line.split()[-1] for line in out.splitlines()
            if "server warm-up round" in line] == ["OK"], out
    assert "load average before" in out and "load average after" in out, out
    assert "acker (tweets topology" in out, out


# Each script once at a tiny size, where only the package and its examples are installed: the
# asserts inside each benchmark (rows read, counts against the generated data) are its check.
def test_the_watchers_look_on_a_history(tmp_path, dsn):
    out = _bench("bench_keepup_look.py", ["--txids", "20", "--files", "10", "--seconds", "1"],
                 tmp_path, dsn)
    assert out.count("looks/s; per look") >= 2 and "load average" in out, out


def test_the_key_value_state_per_provider(tmp_path, dsn):
    from redis_server import RedisServer

    redis = RedisServer(tmp_path / "redis", persistent=False).start()
    try:
        out = _bench("bench_kvstate.py", ["--keys", "500", "--changes", "50", "--lazy", "10",
                                          "--rounds", "1", "--redis-port", str(redis.port)],
                     tmp_path, dsn)
    finally:
        redis.stop()
    assert [line for line in out.splitlines() if line in ("memory", "postgres", "redis")] == \
        ["memory", "postgres", "redis"], out


def test_the_scaling_parts(tmp_path, dsn):
    # the in-flight part is the events part at 1 to 3 batches in flight: the events part runs
    # here with 2
    out = _bench("bench_scaling.py", [
        "--parts", "events,keys,history", "--sizes", "2000", "--batch-size", "1000",
        "--in-flight", "2", "--keys", "200", "--key-rounds", "1", "--history", "4",
        "--history-records", "10", "--folder", str(tmp_path / "scaling")], tmp_path, dsn)
    for part in ("events (load average", "2 in flight", "keys, round 1", "begin ms",
                 "commit ms"):
        assert part in out, (part, out)
    assert "WRONG" not in out, out
