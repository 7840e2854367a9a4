"""Where pipelines are found: the same answer in every process that needs one.

Two ways, both working in Airflow (DAG parsing and tasks), in the Spark driver (spark-submit,
a Spark Connect client, in-process) and in the CLI:

1. an installed distribution's entry point in the group ``onceflow.pipelines``::

       [project.entry-points."onceflow.pipelines"]
       page_views = "my_company.pipelines:PIPELINES"

2. an explicit reference ``package.module:attribute``, given to ``transaction_dag(...)``, to
   the CLI (``--pipelines``) or in the environment variable ``ONCEFLOW_PIPELINES`` (several,
   separated by commas).

A reference names a Pipeline, a list / tuple / dict of them, or a function without arguments
returning one of those. Every pipeline remembers its reference (``Pipeline.ref``), which the
processing task hands to Spark, so the Spark driver finds it the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points

from onceflow.core import settings
from onceflow.core.errors import ConfigError
from onceflow.core.pipeline import Pipeline, check_shared_tables, resolve

log = logging.getLogger(__name__)

GROUP = "onceflow.pipelines"
ENV = settings.env_name("pipelines")

_cache: dict[tuple[str, ...], tuple[dict[str, Pipeline], dict[str, Invalid]]] = {}
_entry_points: dict[str, tuple[tuple, list[EntryPoint]]] = {}
_bare: dict[str, int] = {}  # directory -> its modification time when it held no package


def _holds_packages(path: str) -> bool:
    try:
        with os.scandir(path or ".") as entries:
            return any(e.name.endswith((".dist-info", ".egg-info")) for e in entries)
    except OSError:  # not a directory (a zip), or unreadable: counted as holding some
        return True


def _path_stamp() -> tuple:
    """Each directory on sys.path that holds installed packages' metadata, with its
    modification time: installing or removing a package adds or removes its metadata folder
    there, which changes the time. A directory without any (a DAG folder a task's DAG
    parse puts on sys.path, the working directory) is left out until it changes."""
    stamp = []
    for path in sys.path:
        try:
            mtime = os.stat(path or ".").st_mtime_ns
        except OSError:  # not there: nothing installed (made later, it is looked at then)
            continue
        if _bare.get(path) == mtime:
            continue
        if not _holds_packages(path):
            _bare[path] = mtime
            continue
        stamp.append((path, mtime))
    return tuple(stamp)


def installed_entry_points(group: str) -> list[EntryPoint]:
    """The installed packages' entry points in ``group``, remembered until a directory on
    sys.path that holds packages changes or one is added. Finding them reads every installed
    package's metadata, which every DAG parse would otherwise pay; a task's DAG parse adds the
    DAG folder to sys.path, which holds no package and so reads nothing again. Only names and
    references are kept, never loaded code."""
    stamp = _path_stamp()
    known = _entry_points.get(group)
    if known is None or known[0] != stamp:
        known = (stamp, list(entry_points(group=group)))
        _entry_points[group] = known
    return known[1]


@dataclass(frozen=True)
class Invalid:
    """A registered pipeline (or a reference) that cannot be used: its declaration is
    refused, or its module cannot be loaded. The others are used without it."""

    name: str  # the pipeline's name (an entry point's name, or the reference, if not known)
    where: str  # the entry point (name = module:attribute) or the module:attribute reference
    error: str  # the refusal, naming the field, the value and the fix

    def message(self) -> str:
        return (f"pipeline {self.name!r} (from {self.where}) is invalid: {self.error}. Fix "
                "its declaration there; the other pipelines are not affected")


def _as_pipelines(value, where: str) -> list[Pipeline]:
    if callable(value) and not isinstance(value, Pipeline):
        value = value()
    if isinstance(value, Pipeline):
        value = [value]
    elif isinstance(value, Mapping):
        value = list(value.values())
    if not isinstance(value, list | tuple) or not all(isinstance(p, Pipeline) for p in value):
        raise ConfigError(f"{where} names {type(value).__name__}: it must name a Pipeline, a "
                          "list, tuple or dict of them, or a function returning one of those")
    return list(value)


def env_refs() -> list[str]:
    return [r.strip() for r in settings.get("pipelines").split(",") if r.strip()]


def load_ref(ref: str) -> list[Pipeline]:
    """The pipelines a ``module:attribute`` reference names, each remembering ``ref``."""
    value = resolve(ref, "pipeline reference")
    return [p if p.ref else _with_ref(p, ref) for p in _as_pipelines(value, repr(ref))]


def _with_ref(pipeline: Pipeline, ref: str) -> Pipeline:
    return dataclasses.replace(pipeline, ref=ref)


def _add(found: dict[str, Pipeline], invalid: dict[str, Invalid], pipeline: Pipeline,
         where: str) -> None:
    old = found.get(pipeline.name)
    if old is not None and old != pipeline:
        raise ConfigError(f"pipeline {pipeline.name!r} is declared twice, differently: by "
                          f"{old.ref} and by {where}; give one of them another name")
    if old is None and pipeline.name not in invalid:
        try:
            found[pipeline.name] = pipeline.validate()
        except ConfigError as error:
            _refuse(invalid, Invalid(str(pipeline.name), where, str(error)))


def _refuse(invalid: dict[str, Invalid], bad: Invalid) -> None:
    invalid[bad.name] = bad
    log.warning("%s", bad.message())


def _registered(refs: Iterable[str]) -> tuple[dict[str, Pipeline], dict[str, Invalid]]:
    """(the usable pipelines, the invalid ones) by name: entry points, then
    ``ONCEFLOW_PIPELINES``, then ``refs``. Cached per set of references. One pipeline whose
    declaration is refused, or whose module cannot be loaded, is left out of the usable ones
    (and named, with where it comes from, in the invalid ones): it stops no other."""
    key = tuple(env_refs()) + tuple(refs)
    if key in _cache:
        return _cache[key]
    found: dict[str, Pipeline] = {}
    invalid: dict[str, Invalid] = {}
    for ep in installed_entry_points(GROUP):
        where = f"entry point {ep.name} = {ep.value} (group {GROUP})"
        try:
            value = _as_pipelines(ep.load(), f"entry point {ep.name} = {ep.value!r}")
        except Exception as error:  # a user's module: whatever it raises names it
            _refuse(invalid, Invalid(ep.name, where, f"it cannot be loaded: "
                                                    f"{type(error).__name__}: {error}"))
            continue
        for pipeline in value:
            _add(found, invalid, pipeline if pipeline.ref else _with_ref(pipeline, ep.value),
                 where)
    for ref in key:
        try:
            loaded = load_ref(ref)
        except Exception as error:  # a user's module: whatever it raises names it
            _refuse(invalid, Invalid(ref, ref, f"it cannot be loaded: "
                                               f"{type(error).__name__}: {error}"))
            continue
        for pipeline in loaded:
            _add(found, invalid, pipeline, ref)
    check_shared_tables(found.values())
    _cache[key] = (found, invalid)
    return found, invalid


def pipelines(refs: Iterable[str] = ()) -> dict[str, Pipeline]:
    """Every usable pipeline this process can see (see ``_registered``)."""
    return _registered(refs)[0]


def invalid_pipelines(refs: Iterable[str] = ()) -> dict[str, Invalid]:
    """The registered pipelines that cannot be used, each with where it comes from and why."""
    return _registered(refs)[1]


def get_pipeline(name: str, refs: Iterable[str] = (), **overrides) -> Pipeline:
    """The pipeline ``name``, with optional setting overrides (e.g. batch_size). An invalid
    one is refused naming where it comes from, the field, the value and the fix."""
    known, invalid = _registered(refs)
    if name in invalid:
        raise ConfigError(invalid[name].message())
    if name not in known:
        listing = ", ".join(sorted(known)) or "none"
        bad = "".join(f"; {i.message()}" for i in invalid.values())
        raise ConfigError(
            f"pipeline={name!r} is not registered: known pipelines are {listing}. Register "
            f"yours with an entry point in the group {GROUP!r}, or name its module in "
            f"{ENV}=package.module:attribute (or --pipelines){bad}")
    pipeline = known[name]
    return pipeline.with_settings(**overrides) if overrides else pipeline


def reference_of(pipeline: Pipeline) -> str | None:
    """Where ``pipeline`` can be loaded from in another process (its ``ref``, or the entry
    point / environment reference that declares a pipeline of that name)."""
    if pipeline.ref:
        return pipeline.ref
    try:
        registered = pipelines().get(pipeline.name)
    except ConfigError:
        registered = None
    if registered is not None and registered.ref:
        return registered.ref
    # Declared at the top level of an importable module (not a DAG file, which Airflow loads
    # under a name no other process can import).
    for name, module in list(sys.modules.items()):
        if module is None or name == "__main__" or name.startswith("unusual_prefix_"):
            continue
        for attr, value in list(getattr(module, "__dict__", {}).items()):
            if value is pipeline:
                return f"{name}:{attr}"
    return None


def clear_cache() -> None:
    _cache.clear()
