"""onceflow inside Airflow's own UI and api-server (Airflow 3 plugin ``onceflow``).

- ``plugin``: the ``AirflowPlugin``: the FastAPI app mounted by the api-server at
  ``/onceflow``, the "onceflow" entry of the UI's navigation (an external view embedding
  it), and the run-notes listener;
- ``app``: the FastAPI app: server-rendered pages, JSON data endpoints and the actions
  (replay dead letters, or ask for an approved replay when the pipeline declares
  ``dead_letter_approval``; backfill open txids), all behind Airflow's own authentication
  and the auth manager's DAG permissions;
- ``data``: what the pages show and what the actions do, from onceflow's own functions
  (``onceflow.ops.status``, ``onceflow.core.backflow``, ``onceflow.ops.backfill``) reading
  onceflow's PostgreSQL (the Airflow connection ``onceflow_pg``);
- ``notes``: every DAG run's note says its txid and outcome (a listener: Airflow tasks cannot
  set their run's note).

Registered by the entry point ``onceflow = "onceflow.airflow.ui.plugin:OnceflowPlugin"`` in
the group ``airflow.plugins``.
"""
