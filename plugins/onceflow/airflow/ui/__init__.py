"""onceflow inside Airflow's own UI and api-server (Airflow 3 plugin ``onceflow``).

- ``plugin``: the ``AirflowPlugin``: the FastAPI app mounted by the api-server at
  ``/onceflow``, the "onceflow" entry of the UI's navigation (the React view, a
  ``react_apps`` entry), the "onceflow view" extra link of transaction tasks, and the
  run-notes listener;
- ``bundle``: the React view's module (``static/onceflow-view.js``), a plain ES module on
  the React and Chakra UI of Airflow's UI: nothing to build;
- ``app``: the FastAPI app: the JSON API the view reads (a paged, filtered timeline, the
  series of its charts), the view's module, plain server-rendered pages, and the actions
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
