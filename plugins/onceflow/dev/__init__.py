"""Development helpers: a local PostgreSQL, the embedded Airflow / Spark environment, the demo
runner and a pytest plugin for testing pipelines against real services."""
