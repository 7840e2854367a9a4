"""What differs between the Airflow 3 minors onceflow supports, in one place."""

from __future__ import annotations

try:
    from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException
except ImportError:  # Airflow 3.1 keeps AirflowFailException in airflow.exceptions only
    from airflow.exceptions import AirflowFailException, AirflowSkipException

__all__ = ["AirflowFailException", "AirflowSkipException"]
