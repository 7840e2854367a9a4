"""Development helpers: a local PostgreSQL, the embedded Airflow / Spark environment, the demo
runner and a pytest plugin for testing pipelines against real services."""

import os
from pathlib import Path


def project_dir() -> Path:
    """The project folder: ``ONCEFLOW_HOME`` (run.sh sets it to the checkout), else the
    current directory. ``.airflow/``, ``.pgdata/`` and ``.run/`` live there."""
    return Path(os.environ.get("ONCEFLOW_HOME") or Path.cwd())
