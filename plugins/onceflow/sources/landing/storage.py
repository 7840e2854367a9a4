"""Where a landing folder's files are: pyarrow's file system for a local path or any URI it
reads (``s3://``, ``hdfs://``, ``file://``), and the folder checked visible on this machine.

pyarrow is imported here at the top, as in the modules that list, index and read the folder:
the declaration (LandingFolder) reaches them only when a transaction asks, so a DAG parse
loads no pyarrow.
"""

from __future__ import annotations

from pyarrow import fs

from onceflow.sources.folders import not_visible


def open_filesystem(path: str):
    """(file system, path within it) of a local path or a URI."""
    if "://" in path:
        return fs.FileSystem.from_uri(path)
    return fs.LocalFileSystem(), path


def require_folder(folder: str, filesystem, *, field: str | None = None) -> None:
    """FolderNotVisible unless ``folder`` is a folder in ``filesystem`` as this machine sees
    it (see onceflow.sources.folders)."""
    if filesystem.get_file_info(folder).type != fs.FileType.Directory:
        raise not_visible(folder, field=field)
