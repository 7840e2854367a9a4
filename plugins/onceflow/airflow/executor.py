"""An Airflow LocalExecutor whose task processes start with onceflow's task modules loaded.

Every task a LocalExecutor runs is a process forked from one of its worker processes, which
are forked from the scheduler when the executor starts. A onceflow task then imports what it
needs: the task runtime, the operators, the Spark Connect client and pyspark (about 1 CPU
second per task on two cores, measured). ``PreloadingLocalExecutor`` imports those modules
in the scheduler before it forks its workers, so every task inherits them (copy-on-write)
instead of importing them again. The scheduler grows by about 110 MB for it, shared
copy-on-write with its workers (LocalExecutor freezes the garbage collector while it forks
them). Choose it with::

    AIRFLOW__CORE__EXECUTOR=onceflow.airflow.executor.PreloadingLocalExecutor

Extra modules (say, the heavy libraries your bolts import) go in
``AIRFLOW__ONCEFLOW__PRELOAD_MODULES`` (comma-separated). Preload libraries, not your
pipeline's own modules: a preloaded module keeps the code it had when the scheduler started,
so a change to it reaches tasks only after the scheduler restarts (as upgrading any
installed package does). A module that fails to import is logged and skipped: the task then
imports it itself, as under the plain LocalExecutor. With the ``spawn`` start method (macOS)
workers do not inherit the scheduler's modules, and nothing is preloaded.

Besides modules, a task's first DAG parse and template rendering fill caches of Airflow's
own that every task process otherwise fills again: the providers' asset URI handlers (found
by importing every provider's asset module, the first time an Asset is made), the Jinja
environment's extensions, the ABC checks of a DAG's timetable; and onceflow's registry reads
every installed package's metadata for its entry points. ``rehearse`` fills them in the
scheduler by making a throwaway DAG and Asset (nothing is registered or stored) and reading
the entry points (names and references, kept until a directory on sys.path changes):
measured on two cores, 0.2-0.4 CPU s less per task. It loads no user code, so nothing it
keeps goes stale.

A worker is free for its next task when its supervisor (Airflow's ``ActivitySubprocess``)
has seen the task process exit. The supervisor waits on the process's sockets for up to
``[workers] min_heartbeat_interval`` (5 s) at a time and looks at the exit after each wait;
when the sockets close a moment before the process is gone (it is still exiting), the next
wait has no socket left to wake it, and the worker sits out the whole 5 s (seen: two of ten
benchmark tasks, four of six no-op tasks; the next run's task waited for a worker meanwhile).
``hasten_exit_notice`` makes the supervisors of this executor's workers look every
EXIT_POLL_S instead while only the exit is awaited.
"""

from __future__ import annotations

import importlib
import multiprocessing
import time
from collections.abc import Iterable

from airflow.executors.local_executor import LocalExecutor

# What a onceflow task imports beyond the scheduler's own: the task runtime (what a worker's
# first task otherwise pays for), what parsing a DAG file commonly needs (timetables, the
# @task decorator), the DAG file's and the operators' modules, begin's and commit's, the
# processing task's Spark side (the Spark Connect client with pandas, pyarrow and grpc).
TASK_MODULES = (
    "airflow.sdk.execution_time.supervisor",
    "airflow.sdk.execution_time.task_runner",
    "airflow.sdk.definitions.timetables.interval",
    "airflow.sdk.definitions.timetables.trigger",
    "airflow.sdk.definitions.decorators",
    "airflow.sdk.bases.sensor",  # these two: what expanding a mapped task imports
    "airflow.providers.standard.operators.empty",
    "jinja2.ext",  # the template environment's extensions, loaded by name for every task
    "onceflow.airflow.dags",
    "onceflow.airflow.operators",
    "onceflow.airflow.assets",
    "onceflow.airflow.triggers",
    "onceflow.core.begin",
    "onceflow.core.commit",
    "onceflow.core.registration",
    "onceflow.core.registry",
    "spark_tasks.processing",
    "spark_tasks.session",
    "pyspark.sql.functions",
    "pyspark.sql.connect.session",
    "pyarrow.compute",
    "pyarrow.fs",
    "pyarrow.acero",
)


def preload(modules: Iterable[str]) -> tuple[list[str], dict[str, str]]:
    """Import ``modules`` in order: (the names imported, {name: why not} for the others)."""
    loaded: list[str] = []
    failed: dict[str, str] = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 (reported; the task imports it itself)
            failed[name] = f"{type(e).__name__}: {e}"
        else:
            loaded.append(name)
    return loaded, failed


def rehearse() -> str | None:
    """Fill the per-process caches of Airflow that a task's DAG parse and rendering fill (see
    the module's documentation) by making a DAG, its template environment and an Asset that
    nothing keeps. Returns why not, when it failed (the tasks then fill them themselves)."""
    try:
        from airflow.sdk import DAG, Asset

        dag = DAG(dag_id="onceflow_preload_rehearsal", schedule=None,
                  render_template_as_native_obj=True)
        dag.get_template_env().from_string("{{ params.rehearsal }}")
        Asset(name="onceflow/preload/rehearsal", uri="onceflow://preload/rehearsal",
              group="onceflow")
        # the entry points of pipelines and shipped DAGs (names and references, not code)
        from onceflow.airflow.dags import SHIPPED_DAGS
        from onceflow.core.registry import GROUP, installed_entry_points

        for group in (GROUP, SHIPPED_DAGS):
            installed_entry_points(group)
    except Exception as e:  # noqa: BLE001 (reported; nothing depends on it)
        return f"{type(e).__name__}: {e}"
    return None


# How often a supervisor looks for its task process's exit once every socket of it closed.
EXIT_POLL_S = 0.05


def hasten_exit_notice() -> str | None:
    """Have task supervisors created in this process (and its forks) notice a task process's
    exit within EXIT_POLL_S of it once the process's sockets are all closed (see the module's
    documentation). Returns why not, when Airflow's supervisor is not the one this knows."""
    import functools

    try:
        import attrs
        from airflow.sdk.execution_time.supervisor import ActivitySubprocess
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    service = getattr(ActivitySubprocess, "_service_subprocess", None)
    fields = attrs.fields_dict(ActivitySubprocess)
    if service is None or not {"_open_sockets", "_exit_code"} <= set(fields):
        return "Airflow's ActivitySubprocess has no _service_subprocess, _open_sockets or " \
               "_exit_code"
    if getattr(service, "onceflow_exit_poll", False):
        return None  # (already)

    @functools.wraps(service)
    def hastened(self, max_wait_time: float, *args, **kwargs):
        if self._exit_code is None and not self._open_sockets:
            max_wait_time = min(max_wait_time, EXIT_POLL_S)
        return service(self, max_wait_time, *args, **kwargs)

    hastened.onceflow_exit_poll = True
    ActivitySubprocess._service_subprocess = hastened
    return None


def extra_modules() -> list[str]:
    """The modules named in ``[onceflow] preload_modules`` (AIRFLOW__ONCEFLOW__PRELOAD_MODULES)."""
    from airflow.configuration import conf

    value = conf.get("onceflow", "preload_modules", fallback="") or ""
    return [m.strip() for m in value.split(",") if m.strip()]


class PreloadingLocalExecutor(LocalExecutor):
    """LocalExecutor that imports onceflow's task modules (and ``[onceflow] preload_modules``)
    before it forks its worker processes. See the module's documentation."""

    def start(self) -> None:
        forks = getattr(self, "is_mp_using_fork", multiprocessing.get_start_method() == "fork")
        if forks:
            started = time.monotonic()
            loaded, failed = preload([*TASK_MODULES, *extra_modules()])
            why = rehearse()
            self.log.info("onceflow: preloaded %d modules for the task processes in %.1fs",
                          len(loaded), time.monotonic() - started)
            if why:
                self.log.warning("onceflow: could not warm Airflow's caches for the task "
                                 "processes (%s); each task fills them itself", why)
            if why := hasten_exit_notice():
                self.log.warning("onceflow: a worker may notice its task's end up to [workers]"
                                 " min_heartbeat_interval late (%s)", why)
            for name, why in failed.items():
                self.log.warning("onceflow: could not preload %s (%s); tasks that need it "
                                 "import it themselves", name, why)
        else:
            self.log.info("onceflow: nothing preloaded: the multiprocessing start method is "
                          "not fork, so the workers would not inherit it")
        super().start()
