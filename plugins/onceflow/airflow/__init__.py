"""onceflow in Airflow: transaction DAGs (dags), the begin / process / commit operators and
the one-task transaction operator (operators) and the commit's trigger (triggers). Names load
lazily, so the triggerer importing the trigger does not load the operators and their
providers."""

from typing import Any

__all__ = ["transaction_dag", "transaction_dags"]


def airflow_cli(*args: str) -> list[str]:
    """The command line of ``airflow ARGS`` in this interpreter, for a subprocess. ``-P``
    keeps the current directory off sys.path: run from a checkout, its onceflow.egg-info
    there made Airflow find onceflow twice and report its plugin as an import error
    ("already registered")."""
    import sys

    return [sys.executable, "-P", "-m", "airflow", *args]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from onceflow.airflow import dags

        return getattr(dags, name)
    raise AttributeError(name)
