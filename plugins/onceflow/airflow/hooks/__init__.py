"""onceflow's hooks: the coordinator's PostgreSQL (onceflow.py)."""

from onceflow.airflow.hooks.onceflow import OnceflowHook

__all__ = ["OnceflowHook"]
