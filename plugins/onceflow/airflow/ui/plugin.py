"""The Airflow plugin ``onceflow``: the onceflow view in Airflow's UI and the run notes.

Registered by the entry point (group ``airflow.plugins``)::

    onceflow = "onceflow.airflow.ui.plugin:OnceflowPlugin"

- ``fastapi_apps``: the view's FastAPI app (``onceflow.airflow.ui.app``), mounted by the
  api-server at ``/onceflow``, behind Airflow's authentication: its JSON API, its actions,
  the React view's module and the plain pages;
- ``react_apps``: "onceflow" in the UI's navigation (``/plugin/onceflow``): the React view
  (``static/onceflow-view.js``, see ``onceflow.airflow.ui.bundle``), rendered in the UI's own
  page, theme and router;
- ``global_operator_extra_links``: "onceflow view" on each task of a transaction DAG's runs,
  back to the view at that run's txid;
- ``listeners``: ``onceflow.airflow.ui.notes``, which writes each transaction run's note when
  it ends (in the scheduler, ``dag.test()`` and the API).

Every process that loads plugins imports this module (task processes too, for their
listeners), so the app is built on its first request, not here.
"""

from __future__ import annotations

from urllib.parse import quote, urlencode, urlsplit

from airflow.configuration import conf
from airflow.plugins_manager import AirflowPlugin
from airflow.sdk import BaseOperatorLink

from onceflow.airflow.ui import bundle, notes
from onceflow.airflow.ui.app import create_app

MOUNT = "/onceflow"
ROUTE = "onceflow"  # the view in the UI: /plugin/onceflow
DAG_PREFIX = "onceflow_"  # a pipeline's DAG is onceflow_<pipeline> (data.dag_id_of)
# onceflow's operators, by class name: the tasks of a transaction DAG
TRANSACTION_TASKS = frozenset({"BeginBatchOperator", "ProcessBatchOperator",
                               "CommitBatchOperator", "TransactionOperator"})

# A small SVG (a circle with a "1": once) for the navigation entry, dark on light and light
# on dark.
ICON, ICON_DARK = (
    "data:image/svg+xml;utf8,<svg xmlns='http://www.w3.org/2000/svg' viewBox='0 0 24 24' "
    f"fill='none' stroke='%23{colour}' stroke-width='2'><circle cx='12' cy='12' r='9'/>"
    "<path d='M10 9l2-1.5V17'/></svg>" for colour in ("000", "fff"))


def view_path(pipeline: str | None = None, **query: str | int) -> str:
    """The view's path in Airflow's UI (under the path of ``[api] base_url``, as Airflow's
    own links are): the overview, or a pipeline's page with ``query`` (``txid``, ``run_id``)."""
    base = urlsplit(conf.get("api", "base_url", fallback="") or "").path.rstrip("/")
    path = f"{base}/plugin/{ROUTE}"
    if pipeline is not None:
        path += f"/pipelines/{quote(pipeline, safe='')}"
    return path + (f"?{urlencode(query)}" if query else "")


class OnceflowViewLink(BaseOperatorLink):
    """"onceflow view" on the tasks of a transaction DAG: the pipeline's page at the txid of
    the task's run (the view finds it by the run's id). Airflow's api-server asks for it when
    it shows a task instance; other tasks get no link (an empty one is not shown)."""

    name = "onceflow view"

    def get_link(self, operator, *, ti_key) -> str:
        dag_id = ti_key.dag_id
        if getattr(operator, "task_type", None) not in TRANSACTION_TASKS or \
                not dag_id.startswith(DAG_PREFIX):
            return ""
        return view_path(dag_id.removeprefix(DAG_PREFIX), run_id=ti_key.run_id)


class LazyApp:
    """An ASGI app that builds the FastAPI app on its first call (only the api-server calls
    it), so processes that load plugins for their listeners do not build it."""

    def __init__(self) -> None:
        self._app = None

    @property
    def app(self):
        if self._app is None:
            self._app = create_app()
        return self._app

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)


class OnceflowPlugin(AirflowPlugin):
    name = "onceflow"
    fastapi_apps = [{"app": LazyApp(), "url_prefix": MOUNT, "name": "onceflow"}]
    react_apps = [{
        "name": "onceflow",
        "bundle_url": bundle.url(MOUNT),
        "url_route": ROUTE,
        "destination": "nav",
        "icon": ICON,
        "icon_dark_mode": ICON_DARK,
    }]
    global_operator_extra_links = [OnceflowViewLink()]
    listeners = [notes]
