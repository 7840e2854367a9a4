"""onceflow as an Airflow provider: transaction DAGs (dags), the begin / process / commit
operators and the one-task transaction operator (operators), the triggers (triggers), the
coordinator's hook (hooks), the onceflow view (ui).

Airflow's providers manager imports this package while Airflow's configuration is still
loading (for get_provider_info): it imports nothing of Airflow's, and the DAG builders load
only when a DAG file asks for them."""

import sys
from typing import Any

__all__ = ["transaction_dag", "transaction_dags"]


def airflow_cli(*args: str) -> list[str]:
    """The command line of ``airflow ARGS`` in this interpreter, for a subprocess. ``-P``
    keeps the current directory off sys.path: run from a checkout, its onceflow.egg-info
    there made Airflow find onceflow twice and report its plugin as an import error
    ("already registered")."""
    return [sys.executable, "-P", "-m", "airflow", *args]


def __getattr__(name: str) -> Any:
    if name in __all__:
        # imported here: dags imports Airflow, whose configuration may be loading this package
        # (its providers manager reads get_provider_info): at the top, that is a circular
        # import and no Airflow command starts
        from onceflow.airflow import dags

        return getattr(dags, name)
    raise AttributeError(name)
