"""The code's shape, checked: no import cycles, the library knows nothing of the demo, every
package folder ships but the checkout's own, begin and commit stay free of pyspark, the jar is
built against the locked pyspark. (The wheel itself, installed: tests/test_wheel.py.)"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = [ROOT / "plugins" / "onceflow", ROOT / "spark_tasks"]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT / "plugins") if "plugins" in path.parts else path.relative_to(ROOT)
    parts = list(rel.with_suffix("").parts)
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


def test_no_import_cycles():
    modules = {}
    for folder in LIBRARY:
        for path in folder.rglob("*.py"):
            name = _module_name(path)
            package = name if path.name == "__init__.py" else name.rpartition(".")[0]
            modules[name] = _imports(path, package)
    graph = {m: {i for i in imports if i in modules and i != m} for m, imports in
             modules.items()}
    # a package's __init__ runs when a submodule is imported: parent -> child edges count
    for m in modules:
        parent = m.rpartition(".")[0]
        if parent in graph:
            graph[m].add(parent)
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    # package -> its own submodule -> package is how __init__ re-exports work: not a cycle
    real = [c for c in cycles if not all(a.startswith(c[0] + ".") or c[0].startswith(a)
                                         for a in c)]
    assert not real, f"import cycles: {real}"


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


def test_begin_and_commit_do_not_load_pyspark():
    code = (
        "import sys\n"
        "import onceflow.airflow.operators, onceflow.airflow.triggers\n"
        "import onceflow.core.begin, onceflow.core.commit, onceflow.ops.status\n"
        "from onceflow.core.registry import pipelines\n"
        "assert pipelines(), 'no pipeline registered'\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'pyspark'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_the_jar_is_built_against_the_locked_pyspark():
    """The build requirement (the pyspark an isolated build compiles the JVM reader against)
    is the version constraints.txt locks, which the tests and run.sh run."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    locked = [line for line in (ROOT / "constraints.txt").read_text().splitlines()
              if line.startswith("pyspark==")]
    assert len(locked) == 1
    assert locked[0] in project["build-system"]["requires"]
    assert "setup.py" in (ROOT / "run.sh").read_text()  # a build input: a change reinstalls
