"""onceflow's build: setuptools as pyproject.toml configures it, plus one step of its own.

``build_py`` also compiles the JVM reader (spark_tasks/java, ``onceflow.spark.*``) with javac
against the pyspark of the build environment and puts the jar in the package
(spark_tasks/jars/onceflow-spark.jar): in the wheel, or in the source tree for an editable
install. The jar's manifest records the Spark version it was compiled against and a digest of
its sources; onceflow/sources/jvm.py checks both when it is used and never compiles anything.

pyspark is a build requirement (pyproject.toml, pinned to the version constraints.txt locks):
an isolated build (``pip wheel .``, ``python -m build``) installs it in the build environment.
``--no-build-isolation`` compiles against the environment's own pyspark instead (run.sh's
editable install: the Spark it will run, and no second copy of pyspark's 450 MB). Without
javac or pyspark the build fails, naming what is missing: a wheel without the jar would only
show up later as slower reads.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SOURCES = ROOT / "spark_tasks" / "java"
# the jar in the source tree, and in the built package (spark_tasks/ is onceflow.spark)
JAR = Path("spark_tasks", "jars", "onceflow-spark.jar")
BUILT_JAR = Path("onceflow", "spark", "jars", "onceflow-spark.jar")
JAVA_RELEASE = "17"


def sources_digest() -> str:
    """The digest of the reader's sources (onceflow.sources.jvm.sources_digest, the same)."""
    digest = hashlib.sha256()
    for path in sorted(SOURCES.rglob("*.java")):
        digest.update(path.relative_to(SOURCES).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _fail(message: str):
    sys.exit(f"error: onceflow's build compiles its JVM reader (spark_tasks/java) into the "
             f"package: {message}")


def _spark() -> tuple[Path, str]:
    """pyspark's jars folder in the build environment and the Spark version of its jars."""
    spec = importlib.util.find_spec("pyspark")
    jars = Path(next(iter(spec.submodule_search_locations))) / "jars" \
        if spec is not None and spec.submodule_search_locations else None
    if jars is None or not jars.is_dir():
        _fail("pyspark (with its jars) is not installed in the build environment. An isolated "
              "build installs it (a build requirement); with --no-build-isolation install "
              "pyspark first (pip install -c constraints.txt pyspark)")
    cores = [re.fullmatch(r"spark-core_[0-9.]+-(.+)\.jar", p.name) for p in jars.iterdir()]
    versions = sorted({m.group(1) for m in cores if m})
    if len(versions) != 1:
        _fail(f"pyspark's jars in {jars} hold no single spark-core jar ({versions or 'none'})")
    return jars, versions[0]


def _javac() -> str:
    home = os.environ.get("JAVA_HOME")
    found = shutil.which("javac", path=os.pathsep.join(filter(None, [
        str(Path(home) / "bin") if home else None, os.environ.get("PATH")])))
    if found is None:
        _fail("javac is missing: install a JDK 17, not only a JRE (Debian: apt-get install "
              "openjdk-17-jdk-headless), or set JAVA_HOME to one")
    return found


def _manifest(jar: Path) -> dict[str, str]:
    try:
        with zipfile.ZipFile(jar) as archive:
            text = archive.read("META-INF/MANIFEST.MF").decode()
    except (OSError, KeyError, zipfile.BadZipFile):
        return {}
    return dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)


def build_jar(out: Path, reuse: bool = False) -> None:
    """Compile the sources into ``out``; ``reuse``: unless it holds them already, compiled
    against this Spark (an editable install again: run.sh after a change of dependencies)."""
    jars, spark_version = _spark()
    digest = sources_digest()
    current = _manifest(out) if reuse else {}
    if current.get("Onceflow-Sources-Digest") == digest and \
            current.get("Onceflow-Spark-Version") == spark_version:
        return
    javac = _javac()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        classes = Path(tmp) / "classes"
        sources = sorted(str(p) for p in SOURCES.rglob("*.java"))
        print(f"compiling onceflow's JVM reader against Spark {spark_version} ({jars})",
              file=sys.stderr)
        done = subprocess.run(
            [javac, "-d", str(classes), "-cp", str(jars / "*"), "--release", JAVA_RELEASE,
             "-nowarn", "-Xlint:-path", *sources], capture_output=True, text=True)
        if done.returncode != 0:
            _fail(f"javac failed:\n{done.stderr[-4000:]}")
        built = Path(tmp) / out.name
        with zipfile.ZipFile(built, "w", zipfile.ZIP_DEFLATED) as archive:
            archive.writestr("META-INF/MANIFEST.MF", (
                "Manifest-Version: 1.0\n"
                "Created-By: onceflow setup.py\n"
                f"Onceflow-Spark-Version: {spark_version}\n"
                f"Onceflow-Sources-Digest: {digest}\n"
                f"Onceflow-Java-Release: {JAVA_RELEASE}\n"))
            for path in sorted(classes.rglob("*.class")):
                archive.write(path, path.relative_to(classes).as_posix())
        shutil.move(built, out.with_suffix(".tmp"))
        os.replace(out.with_suffix(".tmp"), out)  # a reader never finds half a jar


class BuildPy(build_py):
    """build_py, then the jar: into the build folder, or (editable) into the source tree,
    where the editable install maps onceflow.spark."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            build_jar(ROOT / JAR, reuse=True)
        else:
            build_jar(Path(self.build_lib) / BUILT_JAR)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        jar = str(Path(self.build_lib) / BUILT_JAR)
        return outputs if jar in outputs else [*outputs, jar]

    def get_output_mapping(self) -> dict[str, str]:
        built = str(Path(self.build_lib) / BUILT_JAR)
        return {**super().get_output_mapping(), built: str(ROOT / JAR)}


setup(cmdclass={"build_py": BuildPy})
