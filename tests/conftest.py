"""The suite's fixtures come from onceflow's pytest plugin (onceflow.dev.testing, loaded by
pyproject.toml's addopts): a real PostgreSQL with a fresh database per test, one local
SparkSession, an Airflow home of the run's own."""
