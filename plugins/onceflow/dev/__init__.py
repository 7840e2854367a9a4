"""The helpers of onceflow's checkout: a local PostgreSQL (localpg), the embedded Airflow and
Spark environment of the demo, the UI and the tests (localenv), the demo's DAG runner (demo).

Not part of the package: pyproject.toml leaves this folder out of the wheel, and the checkout's
editable install (run.sh) is where it imports. The `onceflow` commands that use it (pg, ui,
backfill --via local) say so where onceflow is installed from its package.
"""

import os
import sys
from pathlib import Path

from onceflow.core import settings
from onceflow.core.errors import ConfigError

CHECKOUT = Path(__file__).resolve().parents[3]  # plugins/onceflow/dev -> the checkout


def project_dir() -> Path:
    """The project folder: ``ONCEFLOW_HOME`` (run.sh sets it to the checkout), else the
    current directory. ``.airflow/``, ``.pgdata/`` and ``.run/`` live there."""
    return Path(settings.get("home") or Path.cwd())


def use_examples() -> list[str]:
    """Register the checkout's examples in this process and in those it starts, as
    `bash run.sh demo` does: their folders (the code) and the folder run.sh installs their
    metadata into (their entry points: pipelines, a DAG), off the virtualenv's own path,
    go first on sys.path and PYTHONPATH. Only the demo, the tests and the benchmarks see
    them; `bash run.sh ui` and `onceflow` show a user's own pipelines alone. Returns the
    folders."""
    installed = Path(sys.prefix) / "examples"
    if not list(installed.glob("*.dist-info")):
        raise ConfigError(f"the examples are not installed for {sys.executable} (their entry "
                          f"points belong in {installed}): `bash run.sh` installs them")
    folders = [str(p.parent) for p in sorted((CHECKOUT / "examples").glob("*/pyproject.toml"))]
    folders.append(str(installed))
    python_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [*folders, *[p for p in python_path if p not in folders]])
    sys.path[:0] = [f for f in folders if f not in sys.path]
    return folders
