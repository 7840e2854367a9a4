"""The Airflow plugin ``onceflow``: the onceflow view in Airflow's UI and the run notes.

Registered by the entry point (group ``airflow.plugins``)::

    onceflow = "onceflow.airflow.ui.plugin:OnceflowPlugin"

- ``fastapi_apps``: the view's FastAPI app (``onceflow.airflow.ui.app``), mounted by the
  api-server at ``/onceflow``, behind Airflow's authentication;
- ``external_views``: "onceflow" in the UI's navigation (``/plugin/onceflow``), embedding the
  view;
- ``listeners``: ``onceflow.airflow.ui.notes``, which writes each transaction run's note when
  it ends (in the scheduler, ``dag.test()`` and the API).

Every process that loads plugins imports this module (task processes too, for their
listeners), so the app is built on its first request, not here.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from onceflow.airflow.ui import notes

MOUNT = "/onceflow"

# A small SVG (a circle with a "1": once) for the navigation entry.
ICON = ("data:image/svg+xml;utf8,<svg xmlns='http://www.w3.org/2000/svg' viewBox='0 0 24 24' "
        "fill='none' stroke='%23000' stroke-width='2'><circle cx='12' cy='12' r='9'/>"
        "<path d='M10 9l2-1.5V17'/></svg>")


class LazyApp:
    """An ASGI app that builds the FastAPI app on its first call (only the api-server calls
    it), so processes that load plugins for their listeners do not build it."""

    def __init__(self) -> None:
        self._app = None

    @property
    def app(self):
        if self._app is None:
            from onceflow.airflow.ui.app import create_app

            self._app = create_app()
        return self._app

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)


class OnceflowPlugin(AirflowPlugin):
    name = "onceflow"
    fastapi_apps = [{"app": LazyApp(), "url_prefix": MOUNT, "name": "onceflow"}]
    external_views = [{
        "name": "onceflow",
        "href": MOUNT.lstrip("/") + "/",
        "url_route": "onceflow",
        "destination": "nav",
        "icon": ICON,
    }]
    listeners = [notes]
