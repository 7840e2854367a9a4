"""The version matrix: every supported pyspark minor and Airflow minor, each in a new virtualenv.

Each cell of tests/test_wheel.py's ``CELLS`` (a lock file, with another Airflow or pyspark
pinned in it) installs Airflow alone, then onceflow's wheel and a user's package (no package
Airflow installed may change version), and runs the package's pipeline through its Airflow
DAG on spark-submit (a commit killed and recommitted once included), the JVM reader reading
JSON lines in a local Spark, then a transaction on the Spark Connect path with the JVM reader
on that server. The wheel is built once, as a user builds it (``pip wheel .``, isolated: its
JVM reader compiled against the oldest supported pyspark), and installed in every cell.

The cells run one at a time (the machine may be shared; each takes minutes: pip installs
Airflow and pyspark):

    python bench/matrix.py                     # every cell, a table on stdout
    python bench/matrix.py --cells oldest newest
    python bench/matrix.py --write             # and the table into bench/RESULTS.md

It exits non-zero when a cell fails. docs/deployment.md's supported versions are what its
last run proved (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "RESULTS.md"
HEADING = "## Version matrix (bench/matrix.py)"
TEST = "test_a_fresh_virtualenv_runs_a_users_pipeline_through_airflow"


def cells() -> list[str]:
    """The cells tests/test_wheel.py defines (read from its source: no import of the tests)."""
    tree = ast.parse((ROOT / "tests" / "test_wheel.py").read_text())
    found = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                 and any(getattr(t, "id", None) == "CELLS" for t in node.targets))
    return list(ast.literal_eval(found))


def run(chosen: list[str]) -> tuple[list[dict], str]:
    """Run the chosen cells in one pytest (the wheel built once), one after another."""
    with tempfile.TemporaryDirectory(prefix="onceflow-matrix-") as tmp:
        junit = Path(tmp) / "junit.xml"
        keyword = f"{TEST} and ({' or '.join(f'[{c}]' for c in chosen)})"
        command = ["bash", str(ROOT / "run.sh"), "test", "tests/test_wheel.py", "-m",
                   "fresh_venv", "-k", keyword, "-n", "0", "-p", "no:cacheprovider",
                   f"--junitxml={junit}", "-o", "junit_logging=system-out"]
        load_before = os.getloadavg()
        started = time.monotonic()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        total = time.monotonic() - started
        load = f"{load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after; " \
               f"{os.cpu_count()} CPUs; {total:.0f}s for the run"
        rows = []
        if junit.exists():
            for case in ET.parse(junit).iter("testcase"):
                cell = re.search(r"\[(.+)\]$", case.get("name", ""))
                if not cell:
                    continue
                failed = case.find("failure") if case.find("failure") is not None \
                    else case.find("error")
                out = case.findtext("system-out") or ""
                said = re.search(rf"^{re.escape(cell.group(1))} \(Airflow (\S+), pyspark "
                                 r"(\S+)\): (.*)$", out, re.M)
                rows.append({
                    "cell": cell.group(1), "seconds": float(case.get("time", 0)),
                    "passed": failed is None and case.find("skipped") is None,
                    "airflow": said.group(1) if said else "?",
                    "pyspark": said.group(2).rstrip(")") if said else "?",
                    "said": said.group(3) if said else
                    (failed.get("message", "")[:300] if failed is not None else "no result")})
        if not rows:
            print(done.stdout[-4000:], done.stderr[-4000:], sep="\n", file=sys.stderr)
        return rows, load


COLUMNS = ("| cell | Airflow | pyspark | spark-submit + killed commit, JVM reader, Spark Connect "
           "+ JVM reader | seconds | run at, load average, CPUs |")


def table(rows: list[dict], load: str, earlier: dict[str, str] | None = None) -> str:
    """The section: a row per cell, this run's rows in place of those an earlier run wrote."""
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = {cell: line for cell, line in (earlier or {}).items()}
    for r in rows:
        outcome = "passed" if r["passed"] else "FAILED"
        lines[r["cell"]] = (f"| {r['cell']} | {r['airflow']} | {r['pyspark']} | {outcome}: "
                            f"{r['said'].replace('|', '/')} | {r['seconds']:.0f} | {when}; "
                            f"{load} |")
    order = [c for c in cells() if c in lines] + [c for c in lines if c not in cells()]
    return "\n".join([HEADING, "", "Each cell a new virtualenv; a row is replaced when its cell "
                      "runs again.", "", COLUMNS, "| --- | --- | --- | --- | --- | --- |",
                      *(lines[c] for c in order)]) + "\n"


def _section(current: str) -> tuple[str, str, str]:
    """bench/RESULTS.md split around the matrix section: before, the section, after."""
    if HEADING not in current:
        return current.rstrip("\n") + "\n\n", "", ""
    head, rest = current.split(HEADING, 1)
    after = re.search(r"^## ", rest, re.M)
    return head, HEADING + (rest[:after.start()] if after else rest), \
        rest[after.start():] if after else ""


def earlier_rows() -> dict[str, str]:
    _, section, _ = _section(RESULTS.read_text() if RESULTS.exists() else "")
    return {m.group(1): m.group(0) for m in re.finditer(r"^\| ([\w.-]+) \| .*$", section, re.M)
            if m.group(1) not in ("cell", "---")}


def write(text: str) -> None:
    """Replace the matrix section of bench/RESULTS.md (or add it at the end)."""
    head, _, after = _section(RESULTS.read_text() if RESULTS.exists() else "")
    RESULTS.write_text(head + text + ("\n" + after if after else ""))


def main(argv: list[str] | None = None) -> int:
    known = cells()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", nargs="+", choices=known, default=known)
    parser.add_argument("--write", action="store_true", help="put the table in RESULTS.md")
    args = parser.parse_args(argv)
    rows, load = run(args.cells)
    text = table(rows, load, earlier_rows())
    print(text)
    if args.write and rows:
        write(text)
    ran = {r["cell"] for r in rows}
    return 0 if ran == set(args.cells) and all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
