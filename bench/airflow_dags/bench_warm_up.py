"""The benchmark's warm-up DAG (bench/airflow_run.py): PARALLELISM no-op tasks at once, run
before the clock starts, so that each of the executor's worker processes has run a task, as
on an Airflow that has been up for a while (a LocalExecutor worker's first task imports the
task runtime). It touches no onceflow state."""

from __future__ import annotations

import os
from datetime import datetime

from airflow.sdk import DAG, task

with DAG(dag_id="onceflow_bench_warm_up", schedule=None, start_date=datetime(2026, 1, 1),
         catchup=False, tags=["bench"]) as dag:

    @task
    def noop(i: int) -> int:
        return i

    noop.expand(i=list(range(int(os.environ.get("AIRFLOW__CORE__PARALLELISM", "6")))))
