"""onceflow's JVM side: Spark classes of its own, in one jar that is built with the package
(setup.py compiles spark_tasks/java with javac against pyspark's jars) and ships inside it,
at onceflow/spark/jars/onceflow-spark.jar. Nothing is compiled at run time.

What is in it: ``onceflow.spark.JsonLinesSource``, the landing folder's JSON-lines reader in
the JVM (onceflow.sources.landing uses it when the session has the jar): the same rows as the
Python reader, without a Python worker decoding lines and handing them over through Arrow;
and ``onceflow.spark.SegmentsSource``, the same decoding of the payloads of file segments
that declare ``json_schema`` (onceflow.sources.segments), read from their Parquet row groups.

The jar's manifest records the Spark version it was compiled against: the wheel's is
compiled against the oldest supported pyspark (pyproject.toml's build requirement) and serves
each minor from that one through ``NEWEST_MINOR``, every one of them run by the version matrix
(bench/matrix.py). A Spark outside that span does not get it: the Spark onceflow starts
here is checked before the jar is added (the installed pyspark), any session when a read asks
for the reader (``spark.version``, which covers a cluster's Spark and a Connect server). On a
mismatch a warning names both versions and the fix, and the Python reader does the work (the
same rows, more CPU), as it does on a Spark that onceflow did not start without the jar, or with
ONCEFLOW_JVM_READER=off (or 0). A jar older than the sources beside it (a checkout whose
Java changed since its last install) is not used either.

``jvm_conf()`` is what a session needs for it (the jar, and ``spark.onceflow.jvmReader`` that
tells the readers it is there). No pyspark import: the Airflow operators read this too.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import zipfile
from importlib import metadata
from pathlib import Path

from onceflow.core import settings

log = logging.getLogger(__name__)

# The jar is package data of onceflow.spark (the checkout's spark_tasks/ folder): found by its
# spec, without importing the Spark side into the sources.
_SPARK = Path(importlib.util.find_spec("onceflow.spark").submodule_search_locations[0])
JAR = _SPARK / "jars" / "onceflow-spark.jar"
SOURCES = _SPARK / "java"  # in a checkout only: the wheel has the jar alone
READER = "onceflow.spark.JsonLinesSource"
SEGMENTS_READER = "onceflow.spark.SegmentsSource"  # decoding file segments' payloads
ENABLED = "spark.onceflow.jvmReader"
FALLBACK = ("JSON lines are read by Python workers instead (decoded file segments too): the "
            "same rows, more CPU")
FIX = ("run a Spark the jar serves, or build onceflow's wheel against your "
       "pyspark (`pip wheel --no-deps --no-build-isolation` of onceflow's source, with that "
       "pyspark and a JDK installed: docs/deployment.md); ONCEFLOW_JVM_READER=off silences "
       "this")


def sources_digest() -> str | None:
    """The digest of the sources beside the package (setup.py records the same in the jar);
    None where there are none (an installed wheel)."""
    files = sorted(SOURCES.rglob("*.java")) if SOURCES.is_dir() else []
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(SOURCES).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def manifest(path: Path = JAR) -> dict[str, str]:
    """The jar's manifest attributes (empty when there is no readable jar)."""
    try:
        with zipfile.ZipFile(path) as archive:
            text = archive.read("META-INF/MANIFEST.MF").decode()
    except (OSError, KeyError, zipfile.BadZipFile):
        return {}
    return dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)


def built_for() -> str | None:
    """The Spark version the packaged jar was compiled against."""
    return _jar_state()[1]


@functools.lru_cache(maxsize=1)
def _jar_state() -> tuple[Path | None, str | None, str | None]:
    """(the jar, its Spark version, why it is not usable): read once per process."""
    attrs = manifest(JAR)
    version = attrs.get("Onceflow-Spark-Version")
    if not version:
        return None, None, (f"its jar is missing from this installation ({JAR}): onceflow "
                            "was installed without building it. Its build compiles it, with "
                            "a JDK: in a checkout `bash run.sh` (any command), or `pip "
                            "install --no-build-isolation --no-deps -e .`")
    digest = sources_digest()
    if digest is not None and digest != attrs.get("Onceflow-Sources-Digest"):
        return None, version, (f"its jar ({JAR}) is older than the sources in {SOURCES}: "
                               "rebuild it with `bash run.sh` (any command) or `pip install "
                               "--no-build-isolation --no-deps -e .`")
    return JAR, version, None


# The newest Spark minor the jar is run on (the ceiling of pyproject.toml's pyspark range;
# tests/test_layout.py holds the two together), each minor a cell of the version matrix.
NEWEST_MINOR = (4, 3)


def _major_minor(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:2])


def unusable(spark_version: str | None) -> str | None:
    """Why the packaged jar cannot serve a Spark of ``spark_version`` (None: unknown), or
    None when it can: a Spark of the jar's major version, from the minor it was compiled
    against through NEWEST_MINOR (an older Spark may lack an API it was compiled against)."""
    _, version, problem = _jar_state()
    if problem is not None:
        return f"onceflow's JVM reader is not available ({FALLBACK}): {problem}"
    if spark_version and not (
            _major_minor(version) <= _major_minor(spark_version) <= NEWEST_MINOR
            and _major_minor(spark_version)[0] == _major_minor(version)[0]):
        newest = ".".join(map(str, NEWEST_MINOR))
        return (f"onceflow's JVM reader was built for Spark {version} and serves Spark "
                f"{'.'.join(version.split('.')[:2])} through {newest}; this Spark is "
                f"{spark_version}, another minor version, which may not load it ({FALLBACK}). "
                f"Fix: {FIX}")
    return None


_warned: set[str] = set()


def compatible(spark_version: str | None) -> bool:
    """Whether the packaged jar can serve a Spark of ``spark_version``; when not, a warning
    (once per reason) says why and that Python workers read JSON lines instead."""
    problem = unusable(spark_version)
    if problem is not None and problem not in _warned:
        _warned.add(problem)
        log.warning("%s", problem)
    return problem is None


def jar(spark_version: str | None = None) -> Path | None:
    """The packaged jar, when it serves a Spark of ``spark_version`` (None: the Spark of
    the installed pyspark, if any); None, logged once, when it does not."""
    return JAR if compatible(spark_version or installed_spark()) else None


def installed_spark() -> str | None:
    """The version of the Spark this environment starts (its pyspark's), without importing
    pyspark; None when only the Spark Connect client is installed."""
    try:
        return metadata.version("pyspark")
    except metadata.PackageNotFoundError:
        return None


def _turned_off() -> bool:
    return not settings.get("jvm_reader")


def jvm_conf(conf: dict[str, str] | None = None) -> dict[str, str]:
    """``conf`` (Spark settings, e.g. an operator's) plus what gives a session onceflow's JVM
    classes: the jar added to its ``spark.jars`` and the flag. Static settings: for a Spark
    that onceflow starts (a local session, spark-submit, the local Connect server), checked
    against the installed pyspark's version (a cluster's Spark is checked when a read asks:
    ``jvm_reader``)."""
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
    """Whether ``spark`` can use onceflow's JVM reader: its Spark was started with the jar,
    and is of the version the jar was built for (asked once per Spark Connect session: round
    trips to the server)."""
    if _turned_off():
        return False
    session = getattr(spark, "session_id", None)
    if session is not None and session in _CONNECT_SESSIONS:
        return _CONNECT_SESSIONS[session]
    enabled = str(spark.conf.get(ENABLED, "false")).lower() == "true" and \
        compatible(spark.version)
    if session is not None:
        _CONNECT_SESSIONS[session] = enabled
    return enabled
