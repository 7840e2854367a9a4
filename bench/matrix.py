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
    python bench/matrix.py --cells oldest pyspark4.3
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
        load = f"load average {load_before[0]:.2f} before, " \
               f"{os.getloadavg()[0]:.2f} after; {os.cpu_count()} CPUs; {total:.0f}s in all"
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


def table(rows: list[dict], load: str) -> str:
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [HEADING, "", f"Run {when}; {load}.", "",
             "| cell | Airflow | pyspark | spark-submit + crash, JVM reader, Spark Connect + "
             "JVM reader | seconds |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        outcome = "passed" if r["passed"] else "FAILED"
        lines.append(f"| {r['cell']} | {r['airflow']} | {r['pyspark']} | {outcome}: "
                     f"{r['said'].replace('|', '/')} | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def write(text: str) -> None:
    """Replace the matrix section of bench/RESULTS.md (or add it at the end)."""
    current = RESULTS.read_text() if RESULTS.exists() else ""
    if HEADING in current:
        head, rest = current.split(HEADING, 1)
        after = re.search(r"^## ", rest, re.M)
        current = head + text + ("\n" + rest[after.start():] if after else "")
    else:
        current = current.rstrip("\n") + "\n\n" + text
    RESULTS.write_text(current)


def main(argv: list[str] | None = None) -> int:
    known = cells()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", nargs="+", choices=known, default=known)
    parser.add_argument("--write", action="store_true", help="put the table in RESULTS.md")
    args = parser.parse_args(argv)
    rows, load = run(args.cells)
    text = table(rows, load)
    print(text)
    if args.write and rows:
        write(text)
    ran = {r["cell"] for r in rows}
    return 0 if ran == set(args.cells) and all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
