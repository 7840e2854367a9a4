"""Running transaction DAGs locally, for demos, backfills by hand and tests: find a DAG in a
DAGs folder, run N runs of it with dag.test() (Spark through spark-submit, as in Airflow),
with Airflow's and Spark's own output sent to a log file.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time
from collections.abc import Mapping
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from onceflow.core.errors import ConfigError
from onceflow.dev.localenv import spark_ready

log = logging.getLogger(__name__)


def prepare_dag_test() -> bool:
    """Build Airflow's in-process execution API now, rather than in the first task of the
    first dag.test(), and import the modules the tasks import. dag.test() serves its tasks'
    calls from that API, whose first request generates every version of every route
    (Cadwyn): seconds of CPU, a large part of a demo's first run. Called while the Spark server's
    JVM starts (embedded_env(wait_spark=False)), it costs no wall time: the process would
    only wait. Airflow's own cache (supervisor.in_process_api_server) keeps the API for the
    runs. Returns whether it is built, routes and all; a failure only loses the head start
    (the first task builds it then)."""
    try:  # Airflow's execution API loads only for a demo run
        import httpx
        from airflow.sdk.execution_time.supervisor import in_process_api_server

        api = in_process_api_server()
        httpx.Client(transport=api.transport, base_url="http://in-process.invalid./") \
            .get("health/ping")
        # the first processing task would import the Spark Connect client itself
        import pyspark.sql.connect.session  # noqa: F401

        import onceflow.spark.processing  # noqa: F401
        return bool(getattr(api.app, "_cadwyn_initialized", False))
    except Exception as error:  # noqa: BLE001 (logged; the first task builds it then)
        log.info("building Airflow's in-process execution API ahead failed: %r", error)
        return False


def load_dag(dags_folder: Path, dag_id: str):
    """The DAG ``dag_id`` from the DAG files of ``dags_folder``."""
    from airflow.sdk import DAG  # Airflow loads only when a demo runs a DAG

    found = []
    for path in sorted(Path(dags_folder).glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"onceflow_dagfile_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        dags = {d.dag_id: d for d in vars(module).values() if isinstance(d, DAG)}
        dags.update({d.dag_id: d for d in vars(module).get("DAGS", {}).values()})
        if dag_id in dags:
            return dags[dag_id]
        found += dags
    raise ConfigError(f"dag_id={dag_id!r} is not in {dags_folder} (DAGs there: "
                      f"{', '.join(sorted(found)) or 'none'})")


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


def run_transactions(dag, count: int, conf: Mapping[str, Any], log_file: Path
                     ) -> list[tuple[str, str, float]]:
    """Run ``count`` DAG runs one after the other: (run_id, state, seconds) for each (once
    the Spark server embedded_env(wait_spark=False) started answers)."""
    spark_ready()
    results = []
    last = None
    for _ in range(count):
        started = time.monotonic()
        # dag.test() starts a run at its logical date: now, so that Airflow's pages show the
        # run's true duration (a date before it would add the runs before to it)
        when = datetime.now(UTC)
        if last is not None and when <= last:  # a run id per logical date
            when = last + timedelta(milliseconds=1)
        last = when
        with output_to(log_file):
            dr = dag.test(logical_date=when, run_conf=dict(conf))
        results.append((dr.run_id, str(dr.state), time.monotonic() - started))
        print(f"  run {dr.run_id}: {dr.state} in {results[-1][2]:.1f}s", flush=True)
    return results
