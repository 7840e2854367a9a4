"""The suite's fixtures come from onceflow's pytest plugin (onceflow_testing.plugin, beside
this file, loaded by pyproject.toml's addopts): a real PostgreSQL with a fresh database per
test, one local SparkSession, an Airflow home of the run's own.

The suite runs on two pytest-xdist workers (``-n 2 --dist loadgroup --no-loadscope-reorder``
in addopts; ``-n 0`` runs it in one process). Each worker has its own of the session's
fixtures (SparkSession, Spark Connect server, Airflow home, template database). Tests are
handed out one at a time in collection order, the longest files first, so that the two
workers finish together; a file with fixtures of module scope (a cluster, a Redis server, a
private PostgreSQL, an API server) runs whole on one worker, as an xdist group."""

from __future__ import annotations

import pytest

# Test files by their tests' total time in CI, longest first; the rest keep their order after
# them. (A file left out only runs later: nothing depends on this order.) The keep-up and UI
# files go first: each runs whole on one worker (an Airflow of its own, a browser), the
# longest stretches that cannot be shared out at the end. Then the benchmarks' tiny runs,
# whose longest (an Airflow each, minutes) come first in their file.
LONGEST_FIRST = (
    "test_keepup_airflow.py", "test_ui.py", "test_bench.py", "test_kafka_source.py",
    "test_celery_cluster.py", "test_dag_failures.py", "test_spark_connect.py",
    "test_faults.py", "test_cluster.py", "test_stateful.py", "test_faults_outside.py",
    "test_orders.py", "test_table_source.py", "test_commit.py",
    "test_dags.py", "test_single_task_dag.py", "test_outside_pipeline.py",
    "test_commit_wait.py", "test_topology.py", "test_landing.py", "test_backflow.py",
)


def _wider_than_a_test(item) -> bool:
    """Whether the test uses a fixture of module (or class, package) scope."""
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(
        fixture.scope in ("class", "module", "package")
        for fixtures in info.name2fixturedefs.values() for fixture in fixtures)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order kept
    whole = {item.path for item in items if _wider_than_a_test(item)}
    for item in items:
        if item.path in whole:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))


_ungrouped: list[str] = []  # on an xdist worker: the grouped tests whose group did not take


def pytest_collection_finish(session) -> None:
    """pytest-xdist's loadgroup sends a group to one worker by the ``@group`` it appends to
    each test's id, which some pytest versions (9.2) ignore: the module-scoped fixtures above
    would then start on both workers. Each test then fails, saying so (an error raised here
    on a worker would reach the terminal as xdist's internal error, without its text)."""
    if getattr(session.config.option, "loadgroup", False):  # set on xdist's workers
        _ungrouped[:] = [item.nodeid for item in session.items if "@" not in item.nodeid
                         and item.get_closest_marker("xdist_group")]


def pytest_runtest_setup(item) -> None:
    if _ungrouped:
        pytest.fail(f"pytest-xdist's loadgroup did not group {_ungrouped[0]} (and "
                    f"{len(_ungrouped) - 1} more): this pytest ({pytest.__version__}) ignores "
                    "the group in a test's id. Install the test dependencies of constraints.txt "
                    "(bash run.sh test does)", pytrace=False)
