"""onceflow installed as a package into the Airflow a team already runs: the wheel carries the
JVM reader's jar and none of the checkout's own helpers, and a user's package installed beside
it is all `onceflow pipelines` shows. The examples are registered by `run.sh demo` only.

The whole story, a fresh virtualenv (no system site-packages, no checkout on the path) with
the wheel and an outside package installed from a lock file, running that package's
pipeline through its Airflow DAG, a crash in its commit included, then on Spark Connect, in
each cell of the version matrix (``CELLS``: the oldest versions onceflow supports,
constraints-oldest.txt; constraints.txt's; and every other supported minor), takes minutes
per cell (pip installs Airflow and pyspark): it is marked ``fresh_venv`` and left out of the
default run. .ci/run runs the two ends, the oldest cell and the newest pyspark's (the default
run tests constraints.txt's versions, and the wheel's jar installed elsewhere above);
bench/matrix.py runs every cell:

    bash run.sh test tests/test_wheel.py -m fresh_venv -k "fresh_virtualenv and [oldest]" -n 0
    python bench/matrix.py     # every cell, one at a time
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path

import psutil
import psycopg2
import pytest
from test_outside_pipeline import oracle, payloads

from helpers import table
from onceflow.sources.jvm import sources_digest

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = ROOT / "tests" / "outside"
REF = "pageviews.pipelines:PAGE_VIEWS"
# the pyspark an isolated build compiles the JVM reader against (pyproject.toml)
BUILT_AGAINST = next(r.split("==")[1] for r in tomllib.loads(
    (ROOT / "pyproject.toml").read_text())["build-system"]["requires"] if r.startswith("pyspark"))


def source_tree(dest: Path) -> Path:
    """The checkout's files as git knows them (tracked or new, not ignored: no .venv, no
    build/ or egg-info of earlier builds, no built jar), copied to ``dest``: what a clean
    clone builds from, and two builds at once do not share a build folder."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def _wheel(source: Path, out: Path, isolated: bool = False) -> Path:
    """``pip wheel --no-deps`` of ``source`` with this environment's setuptools; ``isolated``:
    as a user builds it (``pip wheel .``), its build requirements installed for the build
    (onceflow's: the oldest supported pyspark, whose jars the JVM reader is compiled
    against)."""
    isolation = [] if isolated else ["--no-build-isolation"]
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation,
                           "--disable-pip-version-check", "-w", str(out), str(source)],
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    name = tomllib.loads((source / "pyproject.toml").read_text())["project"]["name"]
    return next(out.glob(f"{name.replace('-', '_')}-*.whl"))


# A folder where the wheels built from one source tree are kept for the other pytest runs of
# one CI run (.ci/run makes it and removes it): the build installs the oldest pyspark for
# its isolated environment, each time.
SHARED_WHEELS = "ONCEFLOW_TEST_WHEELS"


def _tree_digest(tree: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in tree.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(tree)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    """onceflow's wheel, built from a clean copy of the checkout, and the outside package's;
    taken from $ONCEFLOW_TEST_WHEELS where a run before built them from the same files."""
    tmp = tmp_path_factory.mktemp("wheels")
    source = source_tree(tmp / "onceflow")
    outside = shutil.copytree(OUTSIDE, tmp / "outside",
                              ignore=shutil.ignore_patterns("__pycache__"))
    shared = os.environ.get(SHARED_WHEELS)
    dist = Path(shared) / f"{_tree_digest(source)}-{_tree_digest(outside)}" if shared \
        else tmp / "dist"
    dist.mkdir(parents=True, exist_ok=True)
    with open(dist / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two runs at once: one builds, the other waits
        built = sorted(dist.glob("*.whl"))
        if len(built) == 2:
            onceflow, outside_wheel = sorted(built, key=lambda w: not w.name.startswith(
                "onceflow-"))
            print(f"onceflow's wheel from {dist}")
            return onceflow, outside_wheel
        started = time.monotonic()
        onceflow = _wheel(source, dist, isolated=True)
        built_s = time.monotonic() - started
        outside_wheel = _wheel(outside, dist)
    print(f"onceflow's wheel built in {built_s:.1f}s")
    return onceflow, outside_wheel


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without what registers the checkout's examples or its tests (the
    pytest plugin's PYTHONPATH, ONCEFLOW_PIPELINES) or points into the checkout."""
    drop = ("PYTHONPATH", "ONCEFLOW_PIPELINES", "ONCEFLOW_HOME", "VIRTUAL_ENV")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


def test_the_wheel_has_the_jar_and_none_of_the_checkouts_own(wheels):
    onceflow, _ = wheels
    with zipfile.ZipFile(onceflow) as archive:
        names = archive.namelist()
        with archive.open("onceflow/spark/jars/onceflow-spark.jar") as jar, \
                zipfile.ZipFile(jar) as inner:
            manifest = inner.read("META-INF/MANIFEST.MF").decode()
            classes = inner.namelist()
        entry_points = archive.read(next(n for n in names if n.endswith("entry_points.txt")))
    assert f"Onceflow-Spark-Version: {BUILT_AGAINST}" in manifest
    assert f"Onceflow-Sources-Digest: {sources_digest()}" in manifest
    assert "onceflow/spark/JsonLinesSource.class" in classes
    assert not [n for n in names if n.startswith("onceflow/dev/") or n.endswith(".java")]
    assert not [n for n in names if n.split("/")[0] in ("tests", "examples", "onceflow_testing",
                                                        "tweets_example", "orders_example")]
    for module in ("onceflow/spark/localspark.py", "onceflow/cli/__init__.py",
                   "onceflow/cli/operate.py",
                   "onceflow/migrations/001_core.sql", "onceflow/airflow/ui/templates/base.html",
                   "onceflow/airflow/ui/static/onceflow-view.js"):
        assert module in names
    # the React view's module as the checkout has it (nothing is built from it)
    with zipfile.ZipFile(onceflow) as archive:
        shipped = archive.read("onceflow/airflow/ui/static/onceflow-view.js")
    assert shipped == (ROOT / "plugins/onceflow/airflow/ui/static/onceflow-view.js").read_bytes()
    assert b"onceflow.pipelines" not in entry_points  # onceflow registers no pipeline itself


def test_installed_elsewhere_it_shows_only_the_users_pipeline(wheels, dsn, tmp_path):
    """The wheel and the outside package installed into a folder of their own (no
    dependencies: those of this environment serve), run from a directory that knows nothing
    of the checkout: migrations from the package, the user's pipeline by its entry point and
    no other, the jar from the package."""
    target, elsewhere = tmp_path / "site", tmp_path / "cwd"
    elsewhere.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--disable-pip-version-check", "--target", str(target), *map(str, wheels)],
                   check=True, capture_output=True)
    env = _clean_env(PYTHONPATH=str(target), ONCEFLOW_HOME=str(elsewhere))

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], cwd=elsewhere, env=env,
                              capture_output=True, text=True, timeout=300)

    probe = run("-c", "import onceflow, onceflow.core.db as db; print(onceflow.__file__); "
                      "print(len(db.migration_files()))").stdout.split()
    assert probe[0].startswith(str(target))
    assert int(probe[1]) == len(list((ROOT / "sql").glob("[0-9][0-9][0-9]_*.sql")))
    listed = run("-m", "onceflow.cli", "pipelines")
    assert listed.returncode == 0, listed.stderr
    assert [line.split(":")[0] for line in listed.stdout.splitlines()] == ["page_views"]
    assert f"from {REF})" in listed.stdout
    init = run("-m", "onceflow.cli", "init")
    assert init.returncode == 0, init.stderr
    assert "migrations applied: none (up to date)" in init.stdout
    assert "pipeline page_views ready" in init.stdout
    jar = run("-m", "onceflow.cli", "spark", "jar")
    assert jar.returncode == 0, jar.stderr
    assert jar.stdout.strip() == str(target / "onceflow" / "spark" / "jars" / "onceflow-spark.jar")


def test_run_sh_registers_the_examples_for_the_demo_only(tmp_path):
    """A user's package beside the checkout's environment: `run.sh onceflow` (and so `run.sh
    ui`, the same environment) lists it alone; `run.sh demo onceflow` adds the examples."""
    env = _clean_env(PYTHONPATH=str(OUTSIDE), ONCEFLOW_PIPELINES=REF)

    def names(*args: str) -> list[str]:
        done = subprocess.run(["bash", str(ROOT / "run.sh"), *args, "pipelines"], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        return sorted(line.split(":")[0] for line in done.stdout.splitlines())

    assert names("onceflow") == ["page_views"]
    assert names("demo", "onceflow") == ["orders", "orders_files", "page_views", "tweets",
                                         "tweets_files", "tweets_first_seen"]


# The two ends of the version ranges pyproject.toml declares: the newest versions (run.sh and
# the suite run them) and the oldest (Airflow 3.1.0, pyspark 4.0.0 and the libraries of their
# day).
LOCKS = {"newest": "constraints.txt", "oldest": "constraints-oldest.txt",
         "airflow3.2": "bench/constraints-airflow3.2.txt"}  # a matrix cell's
# The version matrix (bench/matrix.py runs each cell, one at a time): every supported
# pyspark minor and Airflow minor at least once, each cell a lock and what it changes in it
# (another Airflow or pyspark; pip resolves what these pins leave open, Airflow's own
# packages of that release).
CELLS = {
    "oldest": ("oldest", {}),  # Airflow 3.1.0, pyspark 4.0.0
    # Airflow 3.2.2 with the libraries of its day (the newest lock's, or none, break it)
    "airflow3.2-pyspark4.1": ("airflow3.2", {}),  # pyspark 4.1.4
    "newest": ("newest", {}),  # Airflow 3.3.2, pyspark 4.2.0
    # the newest lock's libraries meet pyspark 4.3.0's (grpcio 1.76, py4j below 0.10.9.10)
    "airflow3.3-pyspark4.3": ("newest", {"pyspark": "4.3.0"}),
}
# Airflow's distributions of one release, which an Airflow of another release replaces
AIRFLOW_OWN = ("apache-airflow", "apache-airflow-core", "apache-airflow-task-sdk")


def _lock_file(cell: str, tmp: Path) -> Path:
    """The cell's lock: the file itself, or a copy with the cell's pins in place of its own."""
    lock, changes = CELLS[cell]
    if not changes:
        return ROOT / LOCKS[lock]
    dropped = {*changes, *(AIRFLOW_OWN if "apache-airflow" in changes else ())}
    kept = [] if lock is None else [
        line for line in (ROOT / LOCKS[lock]).read_text().splitlines()
        if line.split("==")[0].lower() not in dropped]
    path = tmp / f"constraints-{cell}.txt"
    path.write_text("\n".join([*kept, *(f"{name}=={v}" for name, v in changes.items())]) + "\n")
    return path


def _locked(path: Path) -> dict[str, str]:
    pins = (line.split("==") for line in path.read_text().splitlines()
            if "==" in line and not line.startswith("#"))
    return {name.lower(): version for name, version in pins}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until(what: str, check, timeout: float, proc: subprocess.Popen | None = None,
                log: Path | None = None):
    """Poll ``check`` until it returns something true; fails when ``proc`` ends first."""
    deadline = time.monotonic() + timeout
    while not (found := check()):
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {what}:\n"
                                 + (log.read_text()[-4000:] if log else ""))
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout:.0f}s"
        time.sleep(0.3)
    return found


@pytest.mark.fresh_venv
@pytest.mark.timeout(3600)  # pip installs Airflow and pyspark, two Spark jobs run
@pytest.mark.parametrize("cell", list(CELLS))
def test_a_fresh_virtualenv_runs_a_users_pipeline_through_airflow(cell, wheels, dsn, conn,
                                                                    tmp_path):
    """docs/install.md's steps: Airflow into a new virtualenv without system site-packages,
    then the wheel (with it pyspark, the only distribution of the pyspark/ folder) and an
    outside package, from a lock file (the newest or the oldest versions onceflow supports,
    or a cell of the version matrix), changing no package Airflow installed; no checkout on
    any path.
    There: only the user's pipeline is
    registered, the checkout's commands say they are the checkout's. With an Airflow home of
    its own and the DAG file `onceflow dags` prints (docs/install.md), the
    pipeline's transaction runs through its Airflow DAG (spark-submit in local mode) and is
    killed in the middle of its commit: SIGKILL of the process running the commit task, while
    its PostgreSQL transaction has written one state table and waits for the other. Nothing of
    it shows; `onceflow release` frees the txid, the next DAG run adopts it and commits it
    once, exact against a count of the payloads. The packaged jar, compiled against the
    oldest supported Spark, reads JSON lines in a local Spark of the cell's version. A
    second transaction commits on the Spark Connect path (`onceflow spark start`, `airflow
    dags test`), exact as well, and the jar reads JSON lines on that server too."""
    from onceflow.dev.localenv import airflow_connection_json, spark_connection

    venv, elsewhere = tmp_path / "venv", tmp_path / "cwd"
    elsewhere.mkdir()
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    onceflow, outside = wheels
    lock = _lock_file(cell, tmp_path)
    pins = _locked(lock)

    def pip(*args: str) -> None:
        # --no-compile: what runs is compiled as it is imported, not all of Airflow and pyspark
        done = subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
             "--no-compile", "-c", str(lock), *args],
            capture_output=True, text=True, timeout=1500, cwd=elsewhere)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    def frozen() -> dict[str, str]:
        out = subprocess.run([str(python), "-m", "pip", "list", "--format", "json",
                              "--disable-pip-version-check"], capture_output=True, text=True,
                             check=True).stdout
        return {p["name"].lower(): p["version"] for p in json.loads(out)}

    # docs/install.md: Airflow first, as Airflow's docs install it (its constraints file; here
    # the lock), then onceflow's wheel and the user's package with the same constraints: no
    # package Airflow installed changes version. pyspark comes with onceflow, at the lock's
    # version; nothing brings pyspark-client.
    pip(f"apache-airflow=={pins['apache-airflow']}")
    airflow_alone = frozen()
    pip(str(onceflow), str(outside))
    with_onceflow = frozen()
    changed = {name: (version, with_onceflow.get(name))
               for name, version in airflow_alone.items() if with_onceflow.get(name) != version}
    assert not changed, changed
    assert with_onceflow["pyspark"] == pins["pyspark"] and "pyspark-client" not in with_onceflow
    installed_s = time.monotonic() - started

    home = tmp_path / "af"
    (home / "dags").mkdir(parents=True)
    env = {k: v for k, v in _clean_env().items() if not k.startswith("AIRFLOW")}
    env.update(
        PATH=os.pathsep.join([str(venv / "bin"), "/usr/local/bin", "/usr/bin", "/bin"]),
        ONCEFLOW_HOME=str(elsewhere), ONCEFLOW_PG_DSN=dsn, AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW_CONN_ONCEFLOW_PG=airflow_connection_json(dsn),
        AIRFLOW_CONN_SPARK_DEFAULT=spark_connection(None),
        PYSPARK_PYTHON=str(python), PYSPARK_DRIVER_PYTHON=str(python), PYTHONUNBUFFERED="1")

    def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(args, cwd=elsewhere, env=env, input=stdin, capture_output=True,
                              text=True, timeout=1500)

    where = run(str(python), "-c", "import sys, onceflow, onceflow.spark, pageviews; "
                                   "from importlib import metadata as m; print(sys.path); "
                                   "print(*(m.version(p) for p in ('apache-airflow', "
                                   "'apache-airflow-task-sdk', 'pyspark'))); "
                                   "print(onceflow.__file__)")
    assert where.returncode == 0, where.stderr
    assert str(ROOT) not in where.stdout and where.stdout.split()[-1].startswith(str(venv))
    airflow, task_sdk, pyspark = where.stdout.splitlines()[-2].split()
    assert (airflow, task_sdk, pyspark) == (pins["apache-airflow"], pins.get(
        "apache-airflow-task-sdk", task_sdk), pins["pyspark"])
    assert "ModuleNotFoundError: No module named 'onceflow.dev'" in \
        run(str(python), "-c", "import onceflow.dev").stderr
    listed = run("onceflow", "pipelines")
    assert listed.returncode == 0, listed.stderr
    assert [line.split(":")[0] for line in listed.stdout.splitlines()] == ["page_views"]
    pg = run("onceflow", "pg")
    assert pg.returncode == 2 and "development command of onceflow's checkout" in pg.stderr
    assert "ONCEFLOW_PG_DSN" in pg.stderr and "Traceback" not in pg.stderr
    # The jar is built against the oldest pyspark and serves every supported minor.
    jar = run("onceflow", "spark", "jar")
    assert jar.returncode == 0 and jar.stdout.strip().startswith(str(venv)), jar.stderr
    assert f"built for Spark {BUILT_AGAINST}" in jar.stderr

    # the DAG file from the package (docs/install.md)
    dag_file = run("onceflow", "dags")
    assert dag_file.returncode == 0 and "transaction_dags()" in dag_file.stdout
    (home / "dags" / "onceflow_pipelines.py").write_text(dag_file.stdout)
    assert run("airflow", "db", "migrate").returncode == 0
    assert run("onceflow", "init").returncode == 0
    if task_sdk == "1.1.0":
        # Airflow 3.1.0's dag.test() needs the DAG in the metadata database already (3.1.1
        # and later write it there themselves): a user of 3.1.0 reserializes first.
        reserialized = run("airflow", "dags", "reserialize")
        assert reserialized.returncode == 0, reserialized.stderr[-3000:]
    records = payloads(300, seed=11)
    produced = run("onceflow", "produce", "--pipeline", "page_views",
                   stdin="\n".join(records) + "\n")
    assert "produced 300 records" in produced.stdout, produced.stderr
    script = elsewhere / "run_dag.py"
    script.write_text(RUN_DAG)

    # The first run, killed in its commit: this test locks the second state table for
    # writing (readers go on; only the commit writes it), so the commit's transaction writes
    # views_per_country and blocks on views_per_page, and the process running it (dag.test()
    # runs tasks in its own process) is killed.
    log = tmp_path / "doomed.log"
    locker = psycopg2.connect(dsn)
    with locker.cursor() as cur:
        cur.execute("LOCK TABLE views_per_page IN EXCLUSIVE MODE")
    with open(log, "w") as out:
        doomed = subprocess.Popen([str(python), str(script)], cwd=elsewhere, stdout=out,
                                  stderr=subprocess.STDOUT, env=env)
    try:
        backend = _wait_until("the commit blocked on views_per_page", lambda: table(conn, """
            SELECT w.pid FROM pg_locks w
            WHERE NOT w.granted AND w.relation = 'views_per_page'::regclass
              AND EXISTS (SELECT FROM pg_locks a WHERE a.pid = w.pid AND a.granted
                          AND a.relation = 'views_per_country'::regclass
                          AND a.mode = 'RowExclusiveLock')"""), 900, doomed, log)[0][0]
        holder = table(conn, "SELECT holder FROM transactions WHERE txid = 1")[0][0]
        assert holder.endswith(f" pid {doomed.pid}"), holder
        tree = [doomed, *psutil.Process(doomed.pid).children(recursive=True)]
        for proc in tree:
            proc.send_signal(signal.SIGKILL)
        assert doomed.wait(timeout=60) == -signal.SIGKILL
        psutil.wait_procs(tree[1:], timeout=30)
    finally:
        if doomed.poll() is None:
            doomed.kill()
            doomed.wait()
        locker.rollback()  # the commit's statement goes on, finds its client gone: rolled back
        locker.close()
    _wait_until("the killed commit's backend ended", lambda: not table(
        conn, "SELECT pid FROM pg_stat_activity WHERE pid = %s", (backend,)), 60)
    assert table(conn, "SELECT txid, attempt, state FROM transactions") == [(1, 1, "planned")]
    assert table(conn, "SELECT (SELECT count(*) FROM views_per_country), "
                       "(SELECT count(*) FROM views_per_page)") == [(0, 0)]
    killed_s = time.monotonic() - started

    # The recovery a user makes: free the dead run's txid, run the DAG again.
    released = run("onceflow", "release", "--pipeline", "page_views", "--txid", "1", "--force")
    assert released.returncode == 0 and "released txid 1 attempt 1" in released.stdout, \
        released.stdout + released.stderr
    ran = run(str(python), str(script), "--read-json-lines")
    lines = [x for x in ran.stdout.splitlines() if x.startswith("RESULT ")]
    assert ran.returncode == 0 and lines, ran.stdout[-3000:] + ran.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["state"] == "success"
    assert table(conn, "SELECT txid, attempt, state FROM transactions") == [(1, 2, "committed")]
    assert table(conn, "SELECT attempt, outcome FROM transaction_attempts ORDER BY attempt") \
        == [(1, "abandoned"), (2, "committed")]
    countries, pages, rejected, failing = oracle(records)
    assert dict(table(conn, "SELECT key, value FROM views_per_country")) == dict(countries)
    assert dict(table(conn, "SELECT key, value FROM views_per_page")) == dict(pages)
    assert table(conn, "SELECT count(*) FROM rejected_records") == [(rejected,)]
    parked = table(conn, "SELECT count(*) FROM backflow_items")[0][0] + \
        table(conn, "SELECT count(*) FROM dead_letters")[0][0]
    assert parked == failing > 0

    assert result["jvm_reader"] is result["read_in_the_jvm"] is True
    assert result["rows"] == ["a", "b"] and result["spark"] == pyspark
    assert "another minor version" not in ran.stdout + ran.stderr

    # The Spark Connect path (docs/install.md): onceflow's local server, the connection of
    # type spark_connect, a run with `airflow dags test`; this client's retry policy is built
    # from what its DefaultPolicy takes.
    port = _free_port()
    env.update(ONCEFLOW_SPARK_CONNECT_PORT=str(port), AIRFLOW_CONN_SPARK_DEFAULT=json.dumps(
        {"conn_type": "spark_connect", "host": "127.0.0.1", "port": port}))
    server = run("onceflow", "spark", "start")
    try:
        assert server.returncode == 0, server.stdout + server.stderr[-3000:]
        more = payloads(200, seed=12)
        assert "produced 200 records" in run("onceflow", "produce", "--pipeline", "page_views",
                                             stdin="\n".join(more) + "\n").stdout
        tested = run("airflow", "dags", "test", "onceflow_page_views")
        assert tested.returncode == 0, tested.stdout[-3000:] + tested.stderr[-3000:]
        assert "on sc://127.0.0.1:" in tested.stdout + tested.stderr  # processed on Connect
        # the jar on the Connect server: JSON lines read in its JVM
        read = run(str(python), str(script), "--connect", f"sc://127.0.0.1:{port}")
        lines = [x for x in read.stdout.splitlines() if x.startswith("RESULT ")]
        assert read.returncode == 0 and lines, read.stdout[-3000:] + read.stderr[-3000:]
        on_connect = json.loads(lines[-1].removeprefix("RESULT "))
        assert on_connect == {"jvm_reader": True, "read_in_the_jvm": True, "rows": ["a", "b"],
                              "spark": pyspark}, on_connect
    finally:
        run("onceflow", "spark", "stop")
    assert table(conn, "SELECT txid, state FROM transactions ORDER BY txid") == [
        (1, "committed"), (2, "committed")]
    countries, pages, rejected, _ = oracle(records + more)
    assert dict(table(conn, "SELECT key, value FROM views_per_country")) == dict(countries)
    assert dict(table(conn, "SELECT key, value FROM views_per_page")) == dict(pages)
    assert "TypeError" not in tested.stdout + tested.stderr
    status = run("onceflow", "status", "--pipeline", "page_views", "--json")
    assert status.returncode in (0, 1) and "Traceback" not in status.stderr, status.stderr
    assert json.loads(status.stdout)["last_committed"] == 2
    print(f"{cell} (Airflow {airflow}, pyspark {pyspark}): installed in {installed_s:.0f}s, "
          f"killed in its commit at {killed_s:.0f}s, committed once at "
          f"{time.monotonic() - started:.0f}s")


# Run in the fresh virtualenv: the user's pipeline's DAG from the DAGs folder; with
# --read-json-lines, then the packaged jar in a local Spark reading JSON lines.
RUN_DAG = """
import json, os, sys, time
from pathlib import Path

try:
    from airflow.dag_processing.dagbag import DagBag
except ImportError:  # Airflow 3.1
    from airflow.models.dagbag import DagBag

connect = sys.argv[sys.argv.index("--connect") + 1] if "--connect" in sys.argv else None
if connect is None:
    bag = DagBag(dag_folder=os.path.join(os.environ["AIRFLOW_HOME"], "dags"))
    assert not bag.import_errors, bag.import_errors
    run = bag.get_dag("onceflow_page_views").test()
    if "--read-json-lines" not in sys.argv:
        print("RESULT " + json.dumps({"state": str(run.state)}), flush=True)
        sys.exit(0)

from onceflow.core import db
from onceflow.core.planner import PartitionRange
from onceflow.sources.landing import LandingFolder
from onceflow.sources.jvm import jvm_reader
from onceflow.spark.session import get_spark

folder = Path("lines-connect" if connect else "lines")
folder.mkdir()
(folder / "a.jsonl").write_bytes(b'{"s": "a"}\\n{"s": "b"}\\n')
os.utime(folder / "a.jsonl", (time.time() - 5, time.time() - 5))
source = LandingFolder(topic="fresh_lines_connect" if connect else "fresh_lines",
                       path=str(folder.resolve()), settle_s=0.0, json_schema="s string")
dsn = os.environ["ONCEFLOW_PG_DSN"]
with db.connection(dsn) as conn:
    source.ensure(conn, create=True)
    with conn.cursor() as cur:
        source.positions(cur)
    conn.commit()
if connect:
    os.environ["SPARK_REMOTE"] = connect
    spark = get_spark("fresh-venv")
else:
    spark = get_spark("fresh-venv", master="local[1]")
df = source.read(spark, dsn, [PartitionRange(0, 0, 2)])
plan = df._explain_string(extended=True) if connect else df._jdf.queryExecution().toString()
result = {"jvm_reader": jvm_reader(spark), "read_in_the_jvm": "onceflow JSON lines" in plan,
          "rows": [r["s"] for r in df.orderBy("offset").collect()], "spark": spark.version}
if not connect:
    result["state"] = str(run.state)
print("RESULT " + json.dumps(result), flush=True)
spark.stop()
"""
