"""Run the demo DAG once with dag.test() in a process of its own (dag.test() cannot run from
threads), for tests that need several runs at the same time.

    python tests/dag_runner.py LOGICAL_DATE_ISO [CONF_JSON [DAG_ID]]

Prints one last line: {"run_id": ..., "state": ..., "tasks": {task_id: state}, "tries": ...,
"api_prebuilt": whether Airflow's in-process API was built ahead (onceflow.dev.demo)}.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path

from onceflow.dev.demo import load_dag, prepare_dag_test


def main() -> None:
    logical_date = datetime.fromisoformat(sys.argv[1])
    conf = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    dag_id = sys.argv[3] if len(sys.argv) > 3 else "onceflow_tweets"
    prebuilt = prepare_dag_test()  # as the demo does: Airflow's in-process API built ahead
    dag = load_dag(Path(__file__).resolve().parents[1] / "dags", dag_id)
    # run_after = the logical date: the run's id is the same each time a date is run
    # (dag.test() replaces that date's run, as a Clear of the whole run would)
    dr = dag.test(logical_date=logical_date, run_after=logical_date, run_conf=conf)
    tis = dr.get_task_instances()
    tasks = {f"{ti.task_id}[{ti.map_index}]": str(ti.state) for ti in tis}
    tries = {f"{ti.task_id}[{ti.map_index}]": ti.try_number for ti in tis}
    print(json.dumps({"run_id": dr.run_id, "state": str(dr.state), "tasks": tasks,
                      "tries": tries, "api_prebuilt": prebuilt}))


if __name__ == "__main__":
    main()
