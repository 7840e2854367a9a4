"""The Spark client's two distributions, which must be one version.

pyspark (the whole of Spark, for local mode and spark-submit) and pyspark-client (Spark
Connect only, which Airflow's Spark provider requires) install into the same ``pyspark/``
folder. pip installs each to its own requirements, so the two may end up of different
versions, each overwriting some of the other's files: a client that says one version and runs
parts of another. Nothing here imports pyspark: the check runs before it is loaded.
"""

from __future__ import annotations

from importlib import metadata

from onceflow.core.errors import ConfigError


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check_pyspark_pair() -> None:
    """Refuse a pyspark and a pyspark-client of different versions in one environment,
    naming both and the fix; either one alone is fine."""
    full, client = installed("pyspark"), installed("pyspark-client")
    if full is None or client is None or full == client:
        return
    raise ConfigError(
        f"pyspark {full} and pyspark-client {client} are installed together: both write the "
        "same pyspark/ folder, so this Spark client is a mix of two versions. Install one "
        f"version of both: pip install --force-reinstall --no-deps pyspark=={full} "
        f"pyspark-client=={full} (or =={client} for both)")
