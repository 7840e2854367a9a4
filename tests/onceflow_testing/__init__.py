"""onceflow's own test tools, kept with the tests (the wheel ships none of them): the pytest
plugin of the suite (``plugin``: real PostgreSQL, Spark and Airflow fixtures; pyproject.toml's
addopts load it, ``pythonpath`` puts tests/ on the path) and the fault harness (``faults``,
also for tests/fault_run.py)."""
