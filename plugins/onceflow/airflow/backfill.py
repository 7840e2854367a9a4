"""How `onceflow backfill` starts its runs: queued for the Airflow scheduler (the default), or
run here with dag.test() (the checkout's `--via local`). What to re-run is decided by
onceflow.ops.backfill."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from onceflow.airflow import airflow_cli
from onceflow.ops.backfill import StartRun


def trigger_airflow(dag_id: str, txid: int) -> str:
    """Queue a run for the scheduler. Returns its run id."""
    run_id = f"onceflow_backfill__txid_{txid}__{datetime.now(UTC):%Y%m%dT%H%M%S%f}"
    subprocess.run(
        airflow_cli("dags", "trigger", dag_id, "--run-id", run_id,
                    "--conf", json.dumps({"txid": txid})),
        check=True, stdout=subprocess.DEVNULL,
    )
    return run_id


def run_local(dag, txid: int, offset_s: int) -> tuple[str, str]:
    """Run the DAG here with dag.test(). Returns (run id, state)."""
    logical_date = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=offset_s)
    dr = dag.test(logical_date=logical_date, run_conf={"txid": txid})
    return dr.run_id, str(dr.state)


def starter(via: str, dag_id: str, load_dag: Callable | None = None) -> StartRun:
    """``via="airflow"``: each txid queued as a run of ``dag_id``; ``"local"``: the DAG that
    ``load_dag()`` returns, run here."""
    if via == "airflow":
        return lambda txid, _: (trigger_airflow(dag_id, txid), "queued")
    dag = None

    def start(txid: int, i: int) -> tuple[str, str]:
        nonlocal dag
        dag = dag or load_dag()
        return run_local(dag, txid, i)

    return start
