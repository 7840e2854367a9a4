"""The DAG file every onceflow user puts in Airflow's DAGs folder, as text: `onceflow dags`
prints it (``onceflow dags > $AIRFLOW_HOME/dags/onceflow_pipelines.py``), so a user of the wheel
needs nothing from onceflow's checkout. The checkout's dags/onceflow_pipelines.py is this text
(tests/test_cli.py holds the two equal)."""

TEXT = '''"""
### onceflow: one transaction DAG per registered pipeline (Airflow DAG file)

Wiring only. Every pipeline this Airflow can see, by entry point (group `onceflow.pipelines`)
or in `ONCEFLOW_PIPELINES` (`package.module:attribute`), gets its DAG `onceflow_<name>`:
begin >> process >> commit, one run per attempt of one transaction, committed exactly once and
in txid order. A DAG of your own settings is one call in a file of its own:
`dag = transaction_dag(MY_PIPELINE, schedule="@hourly")` (onceflow.airflow). Installed
packages may ship more DAGs (entry points in the group `onceflow.dags`), e.g. reports that
run when a pipeline commits (scheduled on its state tables' Assets).
"""

from __future__ import annotations

from onceflow.airflow.dags import shipped_dags, transaction_dags

DAGS = transaction_dags()
DAGS.update(shipped_dags(built=DAGS))
globals().update(DAGS)
'''
