"""onceflow as an Airflow provider: what Airflow's providers manager reads through the
``apache_airflow_provider`` entry point (see pyproject.toml)."""

from __future__ import annotations


def get_provider_info() -> dict:
    from onceflow import __version__

    return {
        "package-name": "onceflow",
        "name": "onceflow",
        "description": "Exactly-once batch transactions on Airflow, Spark and PostgreSQL, "
                       "after Apache Storm's transactional topologies.",
        "versions": [__version__],
        "integrations": [{"integration-name": "onceflow", "tags": ["software"]}],
        "operators": [{"integration-name": "onceflow",
                       "python-modules": ["onceflow.airflow.operators"]}],
        "triggers": [{"integration-name": "onceflow",
                      "python-modules": ["onceflow.airflow.triggers"]}],
        "asset-uris": [{"schemes": ["onceflow"]}],
        # the UI plugin registers itself by its own entry point (airflow.plugins): listed here
        # too, Airflow would load it twice
    }
