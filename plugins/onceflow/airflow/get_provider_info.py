"""onceflow as an Airflow provider: what Airflow's providers manager reads through the
``apache_airflow_provider`` entry point (see pyproject.toml)."""

from __future__ import annotations

from onceflow import __version__
from onceflow.core import settings

# The release that made onceflow's settings options of Airflow's configuration.
CONFIG_SINCE = "0.2.0"


def config() -> dict:
    """The section [onceflow] of Airflow's configuration: the settings Airflow's processes use
    (onceflow.core.settings), so Airflow's config view lists them with their defaults."""
    return {settings.SECTION: {
        "description": "onceflow's settings that Airflow's processes use. The environment "
                       "variable ONCEFLOW_<OPTION> wins over the option; a process that has "
                       "not loaded Airflow (the CLI, a Spark driver) reads that variable only.",
        "options": {s.key: {"description": f"{s.description} Environment variable: {s.env}.",
                            "version_added": CONFIG_SINCE, "type": s.kind,
                            "example": s.example, "default": s.default_text()}
                    for s in settings.REGISTRY if s.airflow},
    }}


def get_provider_info() -> dict:
    return {
        "package-name": "onceflow",
        "name": "onceflow",
        "description": "Exactly-once batch transactions on Airflow, Spark and PostgreSQL, "
                       "after Apache Storm's transactional topologies.",
        "versions": [__version__],
        "integrations": [{"integration-name": "onceflow", "tags": ["software"]}],
        "hooks": [{"integration-name": "onceflow",
                   "python-modules": ["onceflow.airflow.hooks.onceflow"]}],
        "operators": [{"integration-name": "onceflow",
                       "python-modules": ["onceflow.airflow.operators.begin",
                                          "onceflow.airflow.operators.process",
                                          "onceflow.airflow.operators.commit",
                                          "onceflow.airflow.operators.transaction"]}],
        "triggers": [{"integration-name": "onceflow",
                      "python-modules": ["onceflow.airflow.triggers.commit_turn",
                                         "onceflow.airflow.triggers.source_watch"]}],
        "asset-uris": [{"schemes": ["onceflow"]}],
        "config": config(),
        # the UI plugin registers itself by its own entry point (airflow.plugins): listed here
        # too, Airflow would load it twice
    }
