"""The React view's module (``static/onceflow-view.js``), which Airflow's UI loads as the
plugin's ``react_apps`` bundle from the view's FastAPI app (``/onceflow/static/...``).

It is a plain ES module: it takes React, React Router and Chakra UI from the globals
Airflow's UI sets for its plugins (``globalThis.React``, ``ReactRouterDOM``, ``ChakraUI``),
so it renders in the UI's own tree, theme and router, and there is nothing to build.
"""

from __future__ import annotations

import hashlib
from functools import cache
from importlib.resources import files

MODULE = "onceflow-view.js"


@cache
def _files() -> dict[str, bytes]:
    folder = files("onceflow.airflow.ui") / "static"
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.name.endswith(".js")}


def read(name: str) -> bytes | None:
    """A static file of the view by its name (None: no such file)."""
    return _files().get(name)


def digest(name: str = MODULE) -> str:
    """A short digest of a static file: the version its URL carries, so a browser keeps a
    version for good and fetches a new one."""
    return hashlib.sha256(_files()[name]).hexdigest()[:16]


def url(mount: str) -> str:
    """The module's URL relative to Airflow's base URL (how ``bundle_url`` is read)."""
    return f"{mount.strip('/')}/static/{MODULE}?v={digest()}"
