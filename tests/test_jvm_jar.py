"""The JVM reader's jar is built with the package (setup.py) and only found at run time: no
javac needed, nothing compiled or cached. Its recorded Spark version is checked against the
Spark that would load it: another minor version, a jar older than its sources or no jar at
all leaves the reading to Python workers with a warning that names both versions and the fix,
and `onceflow spark jar` refuses with the same words."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from onceflow.cli import main
from onceflow.core.planner import PartitionRange
from onceflow.sources import jvm

ROOT = Path(__file__).resolve().parents[1]
JAR = jvm.JAR  # the packaged jar (tests put others in its place)


@pytest.fixture
def packaged(monkeypatch, tmp_path):
    """Make onceflow.sources.jvm see ``jar`` (a path) as the packaged jar, and ``sources`` (a
    folder, or None) beside it; its per-process memory of the jar and its warnings reset."""
    def use(jar: Path, sources: Path | None = None) -> None:
        monkeypatch.setattr(jvm, "JAR", jar)
        monkeypatch.setattr(jvm, "SOURCES", sources or tmp_path / "no-sources")
        monkeypatch.setattr(jvm, "_warned", set())
        monkeypatch.setattr(jvm, "_CONNECT_SESSIONS", {})
        jvm._jar_state.cache_clear()

    yield use
    jvm._jar_state.cache_clear()


def rebuilt(tmp_path: Path, **attrs: str) -> Path:
    """A copy of the packaged jar whose manifest says ``attrs`` instead (same classes)."""
    out = tmp_path / "onceflow-spark.jar"
    manifest = {**jvm.manifest(JAR), **attrs}
    with zipfile.ZipFile(JAR) as src, zipfile.ZipFile(out, "w") as dst:
        for item in src.infolist():
            if item.filename != "META-INF/MANIFEST.MF":
                dst.writestr(item, src.read(item))
        dst.writestr("META-INF/MANIFEST.MF",
                     "".join(f"{k}: {v}\n" for k, v in manifest.items()))
    return out


def test_the_packaged_jar_records_its_spark_and_matches_its_sources():
    attrs = jvm.manifest()
    assert attrs["Onceflow-Spark-Version"] == metadata.version("pyspark")
    assert attrs["Onceflow-Sources-Digest"] == jvm.sources_digest()
    with zipfile.ZipFile(jvm.JAR) as archive:
        assert "onceflow/spark/JsonLinesSource.class" in archive.namelist()
    assert jvm.unusable(metadata.version("pyspark")) is None
    assert jvm.unusable("4.2.9") is None  # a patch release of the same minor: the same API


def test_a_jar_serves_its_minor_through_the_newest_proved(tmp_path, packaged):
    """The wheel's jar is compiled against the oldest supported Spark (4.0) and serves each
    minor from there through NEWEST_MINOR (bench/matrix.py runs each); not an older Spark,
    which may lack an API it was compiled against, nor a newer one nobody ran."""
    packaged(rebuilt(tmp_path, **{"Onceflow-Spark-Version": "4.0.0"}))
    newest = ".".join(map(str, jvm.NEWEST_MINOR))
    for served in ("4.0.0", "4.0.5", "4.1.4", "4.2.0", f"{newest}.0"):
        assert jvm.unusable(served) is None, served
    for refused in ("3.5.6", f"4.{jvm.NEWEST_MINOR[1] + 1}.0", "5.0.0"):
        problem = jvm.unusable(refused)
        assert problem is not None and f"serves Spark 4.0 through {newest}; this Spark is " \
            f"{refused}" in problem, refused


def test_a_session_gets_the_jar_without_javac_and_nothing_is_compiled(tmp_path):
    """With no javac anywhere (a JRE-only machine), the conf still brings the jar, and no
    cache of compiled jars is written."""
    code = ("import json; from onceflow.sources.jvm import jvm_conf; "
            "print(json.dumps(jvm_conf()))")
    env = {k: v for k, v in os.environ.items() if k not in ("JAVA_HOME", "ONCEFLOW_JVM_READER")}
    env.update(PATH=str(tmp_path / "empty"), XDG_CACHE_HOME=str(tmp_path / "cache"),
               HOME=str(tmp_path / "home"), ONCEFLOW_JVM_CACHE=str(tmp_path / "jvm"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    conf = json.loads(done.stdout)
    assert conf["spark.jars"] == str(jvm.JAR) and conf["spark.onceflow.jvmReader"] == "true"
    assert not [p for p in tmp_path.rglob("*") if p.suffix == ".jar"]


def test_a_jar_of_another_spark_minor_is_not_used_and_says_why(spark, conn, dsn, tmp_path,
                                                                packaged, caplog):
    """A jar built for a Spark newer than the session's (4.3 in front of 4.2): not given to
    a new session, not used by the running one (its landing read is Python's, same rows), one
    warning naming both versions and the fix; the CLI refuses with the same words."""
    from onceflow.sources.landing import LandingFolder

    packaged(rebuilt(tmp_path, **{"Onceflow-Spark-Version": "4.3.0"}))
    with caplog.at_level(logging.WARNING, logger="onceflow.sources.jvm"):
        assert jvm.jvm_conf({"spark.ui.enabled": "false"}) == {"spark.ui.enabled": "false"}
        assert not jvm.jvm_reader(spark)
        assert not jvm.jvm_reader(spark)
    warnings = [r.getMessage() for r in caplog.records if r.name == "onceflow.sources.jvm"]
    assert len(warnings) == 1, warnings
    assert "built for Spark 4.3.0 and serves Spark 4.3 through " in warnings[0]
    assert f"; this Spark is {spark.version}, another minor version" in warnings[0]
    assert "JSON lines are read by Python workers instead" in warnings[0]
    assert "Fix: run a Spark the jar serves, or build" in warnings[0]

    folder = tmp_path / "lines"
    folder.mkdir()
    source = LandingFolder(topic="jar_versions", path=str(folder), settle_s=0.0,
                           json_schema="s string")
    source.ensure(conn, create=True)
    (folder / "a.jsonl").write_bytes(b'{"s": "a"}\n{"s": "b"}\n')
    os.utime(folder / "a.jsonl", (time.time() - 5, time.time() - 5))
    with conn, conn.cursor() as cur:
        source.positions(cur)
    df = source.read(spark, dsn, [PartitionRange(0, 0, 2)])
    assert "onceflow JSON lines" not in df._jdf.queryExecution().toString()
    assert [r["s"] for r in df.orderBy("offset").collect()] == ["a", "b"]


def test_the_cli_refuses_a_jar_of_another_spark_naming_both(tmp_path, packaged, capsys):
    packaged(rebuilt(tmp_path, **{"Onceflow-Spark-Version": "3.5.1"}))
    assert main(["spark", "jar"]) == 2
    err = capsys.readouterr().err
    newest = ".".join(map(str, jvm.NEWEST_MINOR))
    assert err.startswith("onceflow spark: error: onceflow's JVM reader was built for Spark "
                          f"3.5.1 and serves Spark 3.5 through {newest}; this Spark is "
                          f"{metadata.version('pyspark')}")
    assert "docs/deployment.md" in err and len(err.strip().splitlines()) == 1


def test_a_missing_or_stale_jar_is_named_with_its_fix(tmp_path, packaged, capsys):
    packaged(tmp_path / "nowhere.jar")
    assert main(["spark", "jar"]) == 2
    err = capsys.readouterr().err
    assert "its jar is missing from this installation" in err and "bash run.sh" in err
    assert jvm.jvm_conf() == {}

    sources = tmp_path / "java"
    shutil.copytree(ROOT / "spark_tasks" / "java", sources)
    packaged(JAR, sources)
    assert jvm.unusable(None) is None  # the same sources: the jar is theirs
    changed = next(sources.rglob("LineDecoder.java"))
    changed.write_text(changed.read_text() + "\n// changed\n")
    packaged(JAR, sources)
    assert "older than the sources" in jvm.unusable(None)
    assert main(["spark", "jar"]) == 2
    assert "pip install --no-build-isolation --no-deps -e ." in capsys.readouterr().err


def test_building_without_javac_fails_and_says_what_is_missing(tmp_path):
    """A wheel without the jar would only show up later as slower reads: the build stops."""
    from test_wheel import source_tree

    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["PATH"] = str(Path(sys.executable).parent)  # pip, python; no javac there
    assert shutil.which("javac", path=env["PATH"]) is None
    tree = source_tree(tmp_path / "src")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "wheels"), str(tree)], env=env, capture_output=True, text=True,
        timeout=600)
    assert done.returncode != 0 and not list(tmp_path.glob("wheels/*.whl"))
    assert "compiles its JVM reader (spark_tasks/java) into the package: javac is missing: " \
           "install a JDK 17" in done.stdout + done.stderr
