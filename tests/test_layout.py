"""The code's shape, checked: the layers and no import cycles (import-linter), the library
knows nothing of the demo, every package folder ships but the checkout's own, begin and commit
stay free of pyspark, the jar is built against the locked pyspark, the dependencies' ranges run
from the oldest lock to the newest. (The wheel itself, installed: tests/test_wheel.py.)"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = [ROOT / "plugins" / "onceflow", ROOT / "spark_tasks"]


def _module_name(path: Path) -> str:
    """The import name of a library file: plugins/onceflow/ is onceflow, spark_tasks/ is
    onceflow.spark (pyproject.toml's package-dir)."""
    if "plugins" in path.parts:
        parts = list(path.relative_to(ROOT / "plugins").with_suffix("").parts)
    else:
        parts = ["onceflow", "spark", *path.relative_to(ROOT / "spark_tasks").with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, package: str) -> set[str]:
    """Modules imported at module level (not inside functions, not under TYPE_CHECKING)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return found


def test_the_layers_hold(tmp_path):
    """pyproject.toml's import-linter contracts (one-way layers, no cycle between a package's
    modules), checked on the package as it installs: spark_tasks/ as onceflow.spark. Imports
    inside functions count too."""
    package = tmp_path / "onceflow"
    shutil.copytree(ROOT / "plugins" / "onceflow", package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "spark_tasks", package / "spark",
                    ignore=shutil.ignore_patterns("__pycache__", "java", "jars"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([str(Path(sys.executable).with_name("lint-imports")), "--no-cache",
                           str(ROOT / "pyproject.toml")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken." in done.stdout


def test_the_library_knows_nothing_of_the_demo():
    offenders = []
    for folder in [*LIBRARY, ROOT / "sql", ROOT / "dags"]:
        for path in folder.rglob("*"):
            if path.is_file() and path.suffix in (".py", ".sql") and \
                    "tweet" in path.read_text().lower():
                offenders.append(str(path.relative_to(ROOT)))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "tweet" not in repr([project["project"], project["tool"]["setuptools"]]).lower()
    assert not offenders, f"these library files mention the demo: {offenders}"


# The checkout's own helpers (a local PostgreSQL, the demo runner, the checkout's Airflow
# environment): importable in the editable install, never in the wheel.
DEV_ONLY = "onceflow.dev"


def test_every_package_folder_ships_but_the_checkouts_own():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {_module_name(p.parent / "__init__.py") for folder in LIBRARY
             for p in folder.rglob("__init__.py")}
    shipped = {m for m in found if m != DEV_ONLY and not m.startswith(DEV_ONLY + ".")}
    assert shipped - {"onceflow.migrations"} <= listed, shipped - listed
    assert not {m for m in listed if m.startswith(DEV_ONLY)}
    assert "onceflow.migrations" in listed and (ROOT / "sql" / "__init__.py").exists()


def test_the_shipped_library_imports_nothing_of_the_checkouts_own():
    """onceflow.dev is not in the wheel: a module of the package that imports it at module
    level would fail to import there (the CLI imports it inside the checkout's commands)."""
    offenders = []
    for folder in LIBRARY:
        for path in folder.rglob("*.py"):
            name = _module_name(path)
            if name.startswith(DEV_ONLY):
                continue
            package = name if path.name == "__init__.py" else name.rpartition(".")[0]
            if any(i == DEV_ONLY or i.startswith(DEV_ONLY + ".") for i in _imports(path, package)):
                offenders.append(name)
    assert not offenders, offenders


def test_begin_and_commit_do_not_load_pyspark_or_pyarrow():
    """Nor the CLI and the Airflow operators: pyarrow and numpy load in the functions that
    read or write Arrow data (docs/design.md)."""
    code = (
        "import sys\n"
        "import onceflow.airflow.operators, onceflow.airflow.triggers, onceflow.cli\n"
        "import onceflow.core.begin, onceflow.core.commit, onceflow.ops.status\n"
        "from onceflow.core.registry import pipelines\n"
        "assert pipelines(), 'no pipeline registered'\n"
        "print(sorted(m for m in sys.modules\n"
        "             if m.split('.')[0] in ('pyspark', 'pyarrow', 'numpy')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


DECLARE = """
import sys
import onceflow
from onceflow import FileSegments, KafkaSource, LandingFolder, PostgresLog, TableSource
schema = "url string, n bigint, x double"
sources = [
    PostgresLog(topic="log"), PostgresLog(topic="log", json_schema=schema),
    FileSegments(topic="files", path="/nowhere"), FileSegments(topic="files", json_schema=schema),
    LandingFolder(topic="landed", path="/nowhere"),
    LandingFolder(topic="landed", path="/nowhere", json_schema=schema),
    LandingFolder(topic="landed", path="s3://bucket/landed", format="csv", csv_header=True),
    LandingFolder(topic="landed", path="/nowhere", format="parquet", schema=schema, typed=True),
    TableSource(topic="rows", table="public.rows", key="id"),
    TableSource(topic="rows", table="public.rows", key="id", json_schema=schema),
    KafkaSource(topic="events"), KafkaSource(topic="events", json_schema=schema),
]
for source in sources:
    source.validate()
    assert source.read_ddl and source.describe()
print(sorted({m.split('.')[0] for m in sys.modules} & {'pyspark', 'pyarrow', 'numpy'}))
"""


def test_declaring_every_source_kind_loads_no_pyarrow_or_pyspark():
    """A DAG parse imports onceflow and declares its pipelines' sources, in every task
    process (issue 52): that loads neither pyarrow, numpy nor pyspark (the modules that read
    and write Arrow data import it at their top, and the declarations reach them only when a
    transaction asks; docs/design.md). The DAG file's own parse: tests/test_declarations.py."""
    out = subprocess.run([sys.executable, "-c", DECLARE], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"


def _unexplained_imports(path: Path) -> list[str]:
    """The imports inside functions of ``path`` that give no reason: none on their own lines,
    and none on the line above them (a comment, or a ``try:`` that says why) or above the
    run of imports they belong to."""
    lines = path.read_text().splitlines()
    found = set()
    for function in ast.walk(ast.parse(path.read_text())):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(function):
            for block in (getattr(node, f, None) for f in ("body", "orelse", "finalbody")):
                first = None  # the first line of the run of imports a statement is in
                for statement in block if isinstance(block, list) else ():
                    if not isinstance(statement, ast.Import | ast.ImportFrom):
                        first = None
                        continue
                    first = first or statement.lineno
                    own = lines[statement.lineno - 1:statement.end_lineno]
                    if not any("#" in line for line in own) and "#" not in lines[first - 2]:
                        found.add(f"{path.relative_to(ROOT)}:{statement.lineno}: "
                                  f"{lines[statement.lineno - 1].strip()}")
    return sorted(found)


def test_every_import_inside_a_function_says_why():
    """An import inside a function is for a heavy or optional dependency, a layer above, or
    a cycle it breaks (docs/design.md); the comment beside it says which."""
    offenders = [o for folder in LIBRARY for path in sorted(folder.rglob("*.py"))
                 for o in _unexplained_imports(path)]
    assert not offenders, "\n".join(offenders)


# The function-level pyarrow import left, saying why on its line: the Source base's replays
# (core reaches no module above it).
ARROW_INSIDE_FUNCTIONS = {"plugins/onceflow/core/source.py"}


def test_pyarrow_is_imported_at_the_top_where_it_is_used():
    """pyarrow and numpy are imported at the top of the modules that read and write Arrow
    data; a declaration reaches those modules where it needs them (docs/design.md). An
    import of either inside a function is one of the few known ones, and says why on its
    own line."""
    found = {}
    for folder in LIBRARY:
        for path in sorted(folder.rglob("*.py")):
            lines = path.read_text().splitlines()
            for function in ast.walk(ast.parse(path.read_text())):
                if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                for node in ast.walk(function):
                    names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                        [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                    if any(n.split(".")[0] in ("pyarrow", "numpy") for n in names):
                        line = lines[node.lineno - 1]
                        found[f"{path.relative_to(ROOT)}:{node.lineno}"] = "#" in line
    assert {where.split(":")[0] for where in found} <= ARROW_INSIDE_FUNCTIONS, sorted(found)
    assert all(found.values()), sorted(w for w, why in found.items() if not why)


def test_the_jar_is_built_against_the_oldest_pyspark():
    """The build requirement (the pyspark an isolated build compiles the JVM reader against)
    is the oldest supported, the version constraints-oldest.txt locks: one jar for every
    supported minor (onceflow.sources.jvm.NEWEST_MINOR is the range's ceiling)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    locked = [line for line in (ROOT / "constraints-oldest.txt").read_text().splitlines()
              if line.startswith("pyspark==")]
    assert len(locked) == 1
    assert locked[0] in project["build-system"]["requires"]
    assert "setup.py" in (ROOT / "run.sh").read_text()  # a build input: a change reinstalls


def _lock(name: str) -> dict[str, str]:
    pins = (line.split("==") for line in (ROOT / name).read_text().splitlines()
            if "==" in line and not line.startswith("#"))
    return {canonicalize_name(package): version for package, version in pins}


def test_the_version_ranges_are_the_two_locks():
    """Each dependency's range is tested at both ends (tests/test_wheel.py installs the wheel
    with each lock): its floor is what constraints-oldest.txt locks, and what constraints.txt
    locks is inside it. pyspark and pyspark-client share a folder: equal in both locks."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    oldest, newest = _lock("constraints-oldest.txt"), _lock("constraints.txt")
    for line in project["dependencies"]:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        floors = [s.version for s in req.specifier if s.operator == ">="]
        assert floors == [oldest[name]], f"{line}: the floor is not the oldest lock's {name}"
        assert req.specifier.contains(newest[name]), f"{line}: the newest lock has {name} " \
            f"{newest[name]}"
    # One distribution writes the pyspark/ folder: pyspark with its Spark Connect libraries,
    # up to the newest minor the JVM reader is proved on; pyspark-client in no requirement,
    # the Spark provider below 6.0 (6.x requires pyspark-client, which has no 4.3).
    from onceflow.sources.jvm import NEWEST_MINOR

    spark = [Requirement(line) for line in project["dependencies"]
             if Requirement(line).name == "pyspark"]
    assert len(spark) == 1 and spark[0].extras == {"connect"}
    ceiling = f"{NEWEST_MINOR[0]}.{NEWEST_MINOR[1] + 1}"
    assert [s.version for s in spark[0].specifier if s.operator == "<"] == [ceiling]
    everything = [*project["dependencies"],
                  *(r for extra in project["optional-dependencies"].values() for r in extra)]
    assert not [line for line in everything
                if canonicalize_name(Requirement(line).name) == "pyspark-client"]
    provider = next(Requirement(line) for line in project["dependencies"]
                    if line.startswith("apache-airflow-providers-apache-spark"))
    assert not provider.specifier.contains("6.0.0") and provider.specifier.contains("5.6.0")
    for lock in (oldest, newest):
        assert "pyspark-client" not in lock
    # the suite's own pins are no part of the published metadata
    assert "test" not in project["optional-dependencies"]
    assert "pytest==9.1.1" in tomllib.loads((ROOT / "pyproject.toml").read_text())[
        "dependency-groups"]["test"]


def test_every_repository_path_a_comment_names_exists():
    """A comment that points a reader at a file of the checkout points at one that is there
    (a module moved leaves its old path behind in the comments that named it)."""
    named = re.compile(r"\b(?:spark_tasks|plugins/onceflow|sql|dags|examples|bench|docs|tests)"
                       r"/[A-Za-z0-9_./-]+\.(?:py|java|sql|md|toml|yml)\b")
    missing = set()
    for folder in ("plugins", "spark_tasks", "bench", "tests", "dags", "sql"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".java", ".sql") and "__pycache__" not in path.parts:
                missing |= {f"{path.relative_to(ROOT)}: {name}"
                            for name in named.findall(path.read_text())
                            if not (ROOT / name).exists()}
    assert not missing, "\n".join(sorted(missing))
