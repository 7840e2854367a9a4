"""onceflow's JVM side: Spark classes of its own, in one jar built from spark_tasks/java
on first use (javac, against the installed pyspark's jars; a few seconds, once per version of
the sources and of pyspark) and cached under ONCEFLOW_JVM_CACHE (default
~/.cache/onceflow/jvm).

What is in it: ``onceflow.spark.JsonLinesSource``, the landing folder's JSON-lines reader in
the JVM (onceflow.sources.landing uses it when the session has the jar): the same rows as the
Python reader, without a Python worker decoding lines and handing them over through Arrow.

``jvm_conf()`` is what a session needs for it (the jar, and ``spark.onceflow.jvmReader`` that
tells the readers it is there); empty when no jar can be had (no javac: a JRE only), and then
the Python reader does the work, as it does on a Spark that onceflow did not start (a
cluster's Connect server without the jar). ONCEFLOW_JVM_READER=off (or 0) turns it off.
No pyspark import: the Airflow operators read this too.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

from spark_tasks.conf import env_flag

log = logging.getLogger(__name__)

SOURCES = Path(__file__).parent / "java"
READER = "onceflow.spark.JsonLinesSource"
ENABLED = "spark.onceflow.jvmReader"


def _pyspark_jars() -> Path | None:
    spec = importlib.util.find_spec("pyspark")
    if spec is None or not spec.submodule_search_locations:
        return None
    jars = Path(next(iter(spec.submodule_search_locations))) / "jars"
    return jars if jars.is_dir() else None


def _cache() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "onceflow" / "jvm"
    return Path(os.environ.get("ONCEFLOW_JVM_CACHE") or default)


def _version() -> str:
    """A digest of the sources and of the pyspark jars they compile against."""
    digest = hashlib.sha256()
    for path in sorted(SOURCES.rglob("*.java")):
        digest.update(path.relative_to(SOURCES).as_posix().encode())
        digest.update(path.read_bytes())
    jars = _pyspark_jars()
    for jar in sorted(jars.glob("spark-*.jar")) if jars else ():
        digest.update(jar.name.encode())
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def jar() -> Path | None:
    """The jar, built if missing; None (logged once) when it cannot be built here."""
    jars = _pyspark_jars()
    javac = shutil.which("javac", path=os.pathsep.join(filter(None, [
        str(Path(os.environ["JAVA_HOME"]) / "bin") if os.environ.get("JAVA_HOME") else None,
        os.environ.get("PATH")])))
    out = _cache() / f"onceflow-spark-{_version()}.jar"
    if out.exists():
        return out
    if jars is None or javac is None:
        log.warning("onceflow's JVM reader is not available (%s): JSON lines are read by "
                    "Python workers instead", "no javac: install a JDK, not only a JRE"
                    if javac is None else "pyspark's jars are missing")
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        classes = Path(tmp) / "classes"
        sources = sorted(str(p) for p in SOURCES.rglob("*.java"))
        done = subprocess.run(
            [javac, "-d", str(classes), "-cp", str(jars / "*"), "--release", "17",
             "-nowarn", "-Xlint:-path", *sources], capture_output=True, text=True)
        if done.returncode != 0:
            log.warning("onceflow's JVM reader did not compile (Python workers read JSON "
                        "lines instead):\n%s", done.stderr[-3000:])
            return None
        built = Path(tmp) / out.name
        with zipfile.ZipFile(built, "w", zipfile.ZIP_DEFLATED) as archive:
            archive.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\n")
            for path in sorted(classes.rglob("*.class")):
                archive.write(path, path.relative_to(classes).as_posix())
        os.replace(built, out)  # atomic: a task building at the same time finds it whole
    log.info("built %s", out)
    return out


def _turned_off() -> bool:
    return not env_flag("ONCEFLOW_JVM_READER", True)


def jvm_conf(conf: dict[str, str] | None = None) -> dict[str, str]:
    """``conf`` (Spark settings, e.g. an operator's) plus what gives a session onceflow's JVM
    classes: the jar added to its ``spark.jars`` and the flag. Static settings: for a Spark
    that onceflow starts (a local session, spark-submit, the local Connect server)."""
    out = dict(conf or {})
    path = None if _turned_off() else jar()
    if path is None:
        return out
    jars = [j for j in out.get("spark.jars", "").split(",") if j.strip()]
    out["spark.jars"] = ",".join([*jars, str(path)])
    out.setdefault(ENABLED, "true")
    return out


_CONNECT_SESSIONS: dict[str, bool] = {}  # Spark Connect session id -> has the reader


def jvm_reader(spark) -> bool:
    """Whether ``spark`` can use onceflow's JVM reader: its Spark was started with the jar
    (asked once per Spark Connect session: a round trip to the server)."""
    if _turned_off():
        return False
    session = getattr(spark, "session_id", None)
    if session is not None and session in _CONNECT_SESSIONS:
        return _CONNECT_SESSIONS[session]
    enabled = str(spark.conf.get(ENABLED, "false")).lower() == "true"
    if session is not None:
        _CONNECT_SESSIONS[session] = enabled
    return enabled
