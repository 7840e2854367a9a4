"""The benchmarks stay runnable by a user: every script in bench/ answers --help where nothing
of onceflow's checkout imports (onceflow.dev, the tests' helpers), and runs at a tiny size there
(the figures mean nothing at these sizes; the full runs are in bench/RESULTS.md), every
system's result checked against its ground truth by the benchmark itself. matrix.py, which
builds a virtualenv per cell, answers --help only."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
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


# The two that start a whole Airflow (minutes on a loaded machine) come first in this file:
# tests are handed out in collection order (conftest.py), the longest first. Their processing
# runs on the run's warm Spark Connect server (--spark-connect), as a user's would.
def test_a_kept_up_pipeline_drains_a_backlog_through_airflow(tmp_path, dsn,
                                                             spark_connect_server):
    # the smallest sizes the pipeline takes (freshness_pipelines.sizing): two batches
    out = _bench("bench_keepup_drain.py", [
        "--records", "5000", "--batch-size", "2500", "--min-records", "1000",
        "--folder", str(tmp_path / "drain"), "--timeout", "300",
        "--spark-connect", f"sc://127.0.0.1:{spark_connect_server}"], tmp_path, dsn)
    result = json.loads(out.splitlines()[-1])
    assert result["ok"] and result["records"] == 5000, out
    assert result["transactions"] == 2 and result["in_flight_drain"] > 0, out
    assert "transactions in" in out and "counts exact" in out, out


def test_freshness_through_airflow_beside_structured_streaming(tmp_path, dsn,
                                                               spark_connect_server):
    # one rate, a few hundred records (one batch, after max_delay), a short idle watch
    out = _bench("bench_freshness.py", [
        "--rate", "100", "--seconds", "2", "--warm-up", "0", "--idle", "3", "--trigger", "1",
        "--max-delay", "1", "--folder", str(tmp_path / "freshness"),
        "--spark-connect", f"sc://127.0.0.1:{spark_connect_server}"], tmp_path, dsn)
    # the report's table: per system, rate, made/s, batches, ..., check (its counts against
    # a recount of what was produced, every record's freshness measured)
    table = out[out.index("\nsystem "):].splitlines()
    rows = {line[:36].strip(): line[36:].split() for line in table
            if line.startswith(("onceflow keep-up ", "Structured Streaming, trigger 1 s "))}
    assert set(rows) == {"onceflow keep-up", "Structured Streaming, trigger 1 s"}, out
    for cells in rows.values():
        assert cells[0] == "100" and int(cells[2]) >= 1 and cells[-1] == "OK", out
    assert re.search(r"^idle 3s \(fresh_100, watcher running: True\): .*runs started 0, "
                     r"transactions planned 0;", out, re.M), out


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
    # each has a tiny run below, but matrix.py (a virtualenv per cell)
    tiny = set(re.findall(r'_bench\("([a-z_]+\.py)"', Path(__file__).read_text()))
    assert set(SCRIPTS) - tiny == {"matrix.py"}, set(SCRIPTS) - tiny


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


def _running_in(folder: Path) -> dict[int, str]:
    """The processes working in ``folder`` or below it (their current directory): what a
    benchmark run there started, Airflow's components and Spark's servers among them."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = Path(os.readlink(entry / "cwd"))
            if cwd == folder or folder in cwd.parents:
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(
                    b"\0", b" ").decode(errors="replace")[:200]
        except OSError:  # gone, or a zombie
            continue
    return found


def _bench(script: str, args: list[str], tmp_path: Path, dsn: str, **extra: str) -> str:
    """Run a benchmark as a user of the package would (``extra``: more of its environment);
    the databases it made on the server are dropped afterwards (named apart from any other
    run's on the server: ONCEFLOW_BENCH_DB), and it leaves no process behind (none working in
    ``tmp_path`` that was not before). Its temporary files go under ``tmp_path`` (TMPDIR)."""
    server = db.with_database(dsn, "postgres")
    prefix = f"onceflow_bench_t{uuid.uuid4().hex[:8]}"
    before, running = _bench_databases(server, prefix), set(_running_in(tmp_path))
    env = _installed_env(tmp_path, ONCEFLOW_HOME=str(tmp_path), ONCEFLOW_BENCH_DB=prefix,
                         ONCEFLOW_SPARK_CONNECT_PORT=str(_free_port()), ONCEFLOW_PG_DSN=dsn,
                         TMPDIR=str(tmp_path), **extra)
    proc = subprocess.Popen([sys.executable, str(BENCH / script), *args], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        # SIGINT, so that its finally blocks stop what it started (Airflow, Spark)
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        err += f"\n{script} ran over 900 s"
    finally:
        admin = psycopg2.connect(server)
        admin.autocommit = True
        with admin.cursor() as cur:
            for name in sorted(_bench_databases(server, prefix) - before):
                cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    sql.Identifier(name)))
        admin.close()
    def started() -> dict[int, str]:  # (not the test's own, e.g. a Redis server)
        return {pid: line for pid, line in _running_in(tmp_path).items() if pid not in running}

    left, deadline = started(), time.monotonic() + 15
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = started()
    for pid in left:  # reported below, but not left running
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert not left, f"{script} left processes running: {left}"
    return out


def test_the_peer_comparison_runs_the_opening_tables_systems_and_checks_them(
        tmp_path, dsn, monkeypatch, spark_connect_server):
    # one source, the JSON lines folder, which every system reads, and the systems of the
    # opening table's command in bench/RESULTS.md (the others, a local session, SS's JSON
    # source and the three-task DAG, only add minutes here); the run's warm Spark Connect
    # server (a user's running server: --spark-connect)
    out = _bench("compare.py", ["--events", "20000", "--batches", "2", "--acker-events", "4000",
                                "--acker-rounds", "1", "--folder", str(tmp_path / "bench"),
                                "--systems", "raw,streaming,connect,airflow",
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
    assert set(rows) == {("landing-json", name) for name in {ss, "raw Spark batch", *ours}}, out
    assert {check for _, _, check in rows.values()} == {"OK"}, out
    # every system's CPU seconds, measured
    assert all(float(cpu) > 0 for cpu, _, _ in rows.values()), out
    # and from /proc, by the processes each system started: Structured Streaming's JVM in
    # the bench's process tree, onceflow's Spark Connect server, PostgreSQL's backends of
    # each system's database, Airflow's task processes
    by_process = {line.split(" [")[0].strip(): line.split("(/proc): ")[1]
                  for line in out.splitlines() if "CPU s by process (/proc): " in line}
    assert "Spark JVM" in by_process[ss], out
    # (a lower bound sampled every 0.2 s: at this size a system's connections can end
    # between two samples, and a row then misses its backends; the Airflow rows' task
    # processes connect for less than that, the other systems hold theirs)
    assert any("PostgreSQL backends" in line for line in by_process.values()), out
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

    # bench_segment_batch.py reads what compare.py left in its folder: one batch of the two
    # files' events, each step, then one round of whole loops checked against the truth
    url = f"sc://127.0.0.1:{spark_connect_server}"
    out = _bench("bench_segment_batch.py", ["--folder", str(tmp_path / "bench"), "--events",
                                            "10000", "--repeat", "1", "--loop-rounds", "1",
                                            "--spark-connect", url], tmp_path, dsn)
    steps = [line.split() for line in out.splitlines()
             if line.startswith(("segments, ", "landing-json, json_schema "))]
    names = {" ".join(cells[:-3]) for cells in steps}
    for step in ("scan offsets", "+ from_json", "read + decode", "process_batch"):
        assert any(name.endswith(step) for name in names), (step, out)
    loops = [cells for cells in steps if cells[-1] in ("OK", "WRONG")]
    assert len(loops) == 3 and {cells[-1] for cells in loops} == {"OK"}, out


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


def test_whole_transactions_on_a_warm_session(tmp_path, dsn, spark_connect_server):
    out = _bench("bench_transactions.py", ["--events", "1000", "--batch-size", "500",
                                           "--verify"], tmp_path, dsn,
                 SPARK_REMOTE=f"sc://127.0.0.1:{spark_connect_server}")
    assert len(re.findall(r"^txid \d+: \d+ events, begin .* commit ", out, re.M)) >= 2, out
    assert re.search(r"^processing phase: .* events/s over \d+ transactions$", out, re.M), out
    # the committed state against a recount of the events produced
    assert "verify tweets (recount): OK: 1000 source records = " in out, out


def test_the_sources_then_the_segment_layouts(tmp_path, dsn, spark_connect_server):
    # bench_segment_layout.py rewrites the segments bench_sources.py --kinds files --import
    # left (two partitions of 500 records here) in each layout
    remote = {"SPARK_REMOTE": f"sc://127.0.0.1:{spark_connect_server}"}
    out = _bench("bench_sources.py", ["--kinds", "postgres,files", "--import", "--partitions",
                                      "2", "--events", "1000", "--batch-size", "1000"],
                 tmp_path, dsn, **remote)
    for kind in ("postgres", "files"):
        # (each batch's records read again by Spark and by payloads(), checked equal)
        assert f"[{kind}] batch of 1,000: " in out, out
        assert f"[{kind}] processing phase: 1,000 events in " in out, out
    out = _bench("bench_segment_layout.py", ["--start", "100", "--per-partition", "200",
                                             "--repeat", "1", "--layouts",
                                             "one,rg128,rg128+pages"], tmp_path, dsn, **remote)
    assert "2 segments, 500 rows each; ranges [100, 300) of every partition" in out, out
    layouts = [line.split(":")[0].strip() for line in out.splitlines()
               if "; Spark read " in line and "pyarrow read " in line]
    assert layouts == ["one", "rg128", "rg128+pages"], out


def test_the_landing_folders_readers(tmp_path, dsn):
    # a local session: the JVM reader's CPU seconds are its JVM's
    out = _bench("bench_landing_reader.py", ["--lines", "500", "--rounds", "1",
                                             "--chunk-bytes", "16384"], tmp_path, dsn)
    chunks = re.search(r": 0 MB, 500 lines, (\d+) chunks$", out, re.M)
    assert chunks and int(chunks[1]) > 1, out
    assert re.search(r"^Python reader: [\d.]+ CPU s per pass", out, re.M), out
    assert re.search(r"^JVM reader: [\d.]+ JVM CPU s, [\d.]+ s wall per pass", out, re.M), out


def test_the_ackers_cost(tmp_path, dsn, spark_connect_server):
    out = _bench("bench_acker.py", ["--events", "2000", "--batch-size", "1000", "--modes",
                                    "off,on"], tmp_path, dsn,
                 SPARK_REMOTE=f"sc://127.0.0.1:{spark_connect_server}")
    failing = re.search(r"^check: OK \(with the acker on, (\d+) events fail a first try\)$",
                        out, re.M)
    assert failing and int(failing[1]) > 0, out
    # without the acker no failure is routed; with it, each failing event's root
    for mode, roots in (("off", "0"), ("on ", failing[1])):
        assert re.search(rf"^acker {mode}: 2,000 events in .* \({roots} failed roots ", out,
                         re.M), out
    assert "the acker costs " in out, out


def test_real_data(tmp_path, dsn, spark_connect_server):
    out = _bench("real_data.py", ["--rows", "2000", "--keys", "200"], tmp_path, dsn,
                 SPARK_REMOTE=f"sc://127.0.0.1:{spark_connect_server}")
    for part in ("table: read 2000 rows with 4 task(s) in ", "landing: indexed 1 files",
                 "landing: read 2000 Parquet rows", "commit: 200 composite keys x 3 measures "
                 "(updates)", "commit: append table, 200 rows in "):
        assert part in out, (part, out)
    # every read counted and every commit's rows against the rows made
    assert "check: OK (every read and commit counted against the rows made)" in out, out
