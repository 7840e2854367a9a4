"""`onceflow demo`: the whole product end to end on embedded defaults.

PostgreSQL found or started, schema applied, demo events produced, N transactions run through
the Airflow DAG (dag.test(), Spark in local mode through spark-submit), then the commit log and
an independent verify. Exit status 1 when verify fails or a run fails.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

DAG_ID = "onceflow_tweets"


def load_dag(dags_folder: Path, dag_id: str = DAG_ID):
    """The DAG ``dag_id`` from the DAGs folder (the file named after it)."""
    path = dags_folder / f"{dag_id}.py"
    if not path.exists():
        raise FileNotFoundError(f"dag_id={dag_id!r}: no {path}; DAG files are named after their "
                                "DAG id in the DAGs folder")
    spec = importlib.util.spec_from_file_location(f"onceflow_dag_{dag_id}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.dag


@contextmanager
def output_to(path: Path):
    """Send this process's stdout and stderr (file descriptors too: spark-submit's output,
    Airflow's task logs) to ``path`` for the duration."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def run_transactions(dag, count: int, batch_size: int, log_file: Path
                     ) -> list[tuple[str, str, float]]:
    """Run ``count`` DAG runs one after the other: (run_id, state, seconds) for each."""
    results = []
    base = datetime.now(UTC).replace(microsecond=0)
    for i in range(count):
        started = time.monotonic()
        with output_to(log_file):
            dr = dag.test(logical_date=base + timedelta(seconds=i),
                          run_conf={"batch_size": batch_size})
        results.append((dr.run_id, str(dr.state), time.monotonic() - started))
        print(f"  run {dr.run_id}: {dr.state} in {results[-1][2]:.1f}s", flush=True)
    return results
