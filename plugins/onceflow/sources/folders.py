"""The folders a source reads (a landing folder, a file-segments root) are read on several
machines: the Airflow workers that run begin and process (the folder's listing, the failed
records' payloads) and the Spark executors that read the batch. They must all see the same
folder at the same path (a shared mount, or a URI every one of them reads): that and the
coordinator's PostgreSQL are all they share (docs/deployment.md). A machine that does not see
it fails the batch saying so, not with a bare file-not-found.

No pyspark import: Spark executors and Airflow workers both call this.
"""

from __future__ import annotations

import os
import socket
from pathlib import PurePosixPath

from onceflow.core.errors import ConfigError

SHARED = ("every Airflow worker and Spark executor must see the same folder "
          "(see docs/deployment.md)")


class FolderNotVisible(ConfigError):
    """A source's folder is missing on the machine that reads it."""


def require_folder(folder: str, *, field: str | None = None) -> None:
    """FolderNotVisible unless ``folder`` is a folder here; ``field``: the setting that
    names the folder, put before the message (e.g. ``source.path``). A folder in another
    file system: onceflow.sources.landing.storage.require_folder."""
    if not os.path.isdir(folder):
        raise not_visible(folder, field=field)


def not_visible(folder: str, *, field: str | None = None) -> FolderNotVisible:
    """The error for a source's folder this machine does not see."""
    where = f"{field}={folder!r}: " if field else ""
    return FolderNotVisible(f"{where}the folder {folder!r} is not visible here (host "
                            f"{socket.gethostname()}): {SHARED}; create or mount it")


def require_roots(paths, levels: int = 1) -> None:
    """``require_folder`` for the folder ``levels`` up of each local path in ``paths`` (each
    folder once): the root a source's files lie under. A URI's file system is asked by
    whoever opens it."""

    roots = {str(PurePosixPath(p).parents[levels - 1]) for p in paths if "://" not in str(p)}
    for root in sorted(roots):
        require_folder(root)
