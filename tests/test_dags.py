"""The DAG files: integrity (per file) and whole-DAG runs on real Airflow, Spark, PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from helpers import assert_exact, table, tweets_events, tweets_pipeline

DAGS = Path(__file__).resolve().parents[1] / "dags"
DAG_FILES = sorted(p.name for p in DAGS.glob("*.py"))
TRANSACTION = {"begin": {"process", "commit"}, "process": {"commit"}, "commit": set()}
# every registered pipeline gets its transaction DAG from dags/onceflow_pipelines.py
EXPECTED_GRAPH = {f"onceflow_{name}": TRANSACTION
                  for name in ("tweets", "tweets_files", "tweets_first_seen")}
# a DAG the tweets example ships (entry point group onceflow.dags)
EXPECTED_GRAPH["tweets_top_domains"] = {"report_top_domains": set()}


@pytest.fixture(scope="module")
def dagbag(airflow_db):
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS))


@pytest.mark.parametrize("dag_file", DAG_FILES)
def test_dag_file_imports_cleanly(dagbag, dag_file):
    errors = {Path(k).name: v for k, v in dagbag.import_errors.items()}
    assert dag_file not in errors, errors.get(dag_file)
    dags = [d for d in dagbag.dags.values() if Path(d.fileloc).name == dag_file]
    assert dags, f"{dag_file} defines no DAG"
    for dag in dags:
        assert dag.tags, f"{dag.dag_id} has no tags"
        assert not dag.catchup
        for task in dag.tasks:
            assert task.retries >= 1, f"{dag.dag_id}.{task.task_id} has no retries"


@pytest.mark.parametrize("dag_id", sorted(EXPECTED_GRAPH))
def test_dag_has_the_expected_task_graph(dagbag, dag_id):
    dag = dagbag.get_dag(dag_id)
    graph = {t.task_id: set(t.downstream_task_ids) for t in dag.tasks}
    assert graph == EXPECTED_GRAPH[dag_id]
    if dag_id.startswith("onceflow_"):
        assert dag.max_active_runs > 1  # processing of consecutive transactions may overlap


def test_the_wait_for_a_place_past_max_pending_is_configurable_and_checked(monkeypatch):
    from onceflow.airflow.dags import transaction_dag
    from onceflow.airflow.operators import BeginBatchOperator
    from onceflow.core.errors import ConfigError
    from onceflow.core.registry import get_pipeline

    dag = transaction_dag("tweets")  # one run past max_pending may start: it waits in begin
    assert dag.max_active_runs == get_pipeline("tweets").max_pending + 1
    # a one-task DAG lets two (onceflow.airflow.dags.STANDBY_RUNS)
    single = transaction_dag("tweets", shape="single")
    assert single.max_active_runs == get_pipeline("tweets").max_pending + 2
    assert dag.get_task("begin").wait_for_slot == 300
    monkeypatch.setenv("ONCEFLOW_BEGIN_WAIT_S", "0")
    assert BeginBatchOperator(task_id="b", pipeline="tweets").wait_for_slot == 0
    monkeypatch.setenv("ONCEFLOW_BEGIN_WAIT_S", "soon")
    with pytest.raises(ConfigError,
                       match="ONCEFLOW_BEGIN_WAIT_S='soon' is invalid: give a number of sec"):
        BeginBatchOperator(task_id="b", pipeline="tweets")
    with pytest.raises(ConfigError, match="wait_for_slot=-1 is invalid: give a number of seconds"):
        BeginBatchOperator(task_id="b", pipeline="tweets", wait_for_slot=-1)
    monkeypatch.setenv("ONCEFLOW_RETRY_DELAY_SECONDS", "ten")
    with pytest.raises(ConfigError, match="ONCEFLOW_RETRY_DELAY_SECONDS='ten' is invalid"):
        transaction_dag("tweets")


@pytest.mark.timeout(420)
def test_three_transactions_through_the_dag(dagbag, conn, dsn, caplog, warm_spark):
    pipeline = tweets_pipeline(conn, events=2400, batch_size=1000)
    dag = dagbag.get_dag("onceflow_tweets")
    base = datetime.now(UTC).replace(microsecond=0)
    states, run_ids = [], []
    for i in range(3):
        dr = dag.test(logical_date=base + timedelta(seconds=i), run_conf={"batch_size": 1000})
        states.append(str(dr.state))
        run_ids.append(dr.run_id)
    assert states == ["success"] * 3

    # the commit task's log carries one commit line per transaction
    for txid in (1, 2, 3):
        assert f"COMMIT pipeline=tweets txid={txid} attempt=1 prev_txid={txid - 1}" in caplog.text

    # each batch: replays of earlier failures first, then the source, 1000 records at most
    txns = table(conn, "SELECT txid, state, records, replayed FROM transactions ORDER BY txid")
    assert [(t, s) for t, s, _, _ in txns] == [(1, "committed"), (2, "committed"),
                                                (3, "committed")]
    assert txns[0][2:] == (1000, 0) and txns[1][2] + txns[1][3] == 1000
    assert sum(records for _, _, records, _ in txns) == 2400
    # offsets advanced exactly to the planned ends: here every record produced
    ends = table(conn, """SELECT partition, max(end_offset) FROM batch_ranges
                          GROUP BY partition ORDER BY 1""")
    assert table(conn, 'SELECT partition, "offset" FROM partition_offsets ORDER BY 1') == ends
    assert sum(end for _, end in ends) == 2400
    # the state against the tests' own oracle, from the records the test produced
    found = assert_exact(conn, pipeline, tweets_events(2400), read_all=True)
    assert found.read == 2400 and found.rejected > 0

    # each commit emitted one event per state table, with what it committed
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session

    with create_session() as session:
        events = session.query(AssetModel.name, AssetEvent.extra).join(
            AssetModel, AssetEvent.asset_id == AssetModel.id).filter(
            AssetEvent.source_run_id.in_(run_ids)).all()  # other tests' runs share the db
    by_table: dict = {}
    for name, extra in events:
        by_table.setdefault(name, []).append(extra["txid"])
    assert {k: sorted(v) for k, v in by_table.items()} == {
        "onceflow/tweets/url_counts": [1, 2, 3], "onceflow/tweets/domain_counts": [1, 2, 3]}
    assert all(extra["ranges"] and extra["rows"] > 0 for _, extra in events)
    # each table's event says that table's own rows of the commit; both make the commit's
    rows = {(name, extra["txid"]): extra["rows"] for name, extra in events}
    url, domain = "onceflow/tweets/url_counts", "onceflow/tweets/domain_counts"
    for txid, applied in table(conn, "SELECT txid, rows_applied FROM transactions"):
        assert rows[url, txid] + rows[domain, txid] == applied
    # the last commit wrote every key now at txid 3 (the two tables: different counts)
    assert (rows[url, 3], rows[domain, 3]) == (
        table(conn, "SELECT count(*) FROM url_counts WHERE txid = 3")[0][0],
        table(conn, "SELECT count(*) FROM domain_counts WHERE txid = 3")[0][0])
    assert rows[url, 3] != rows[domain, 3]
    # a run that commits nothing (txid 1 again) succeeds without an event
    noop = dag.test(logical_date=base + timedelta(seconds=3), run_conf={"txid": 1})
    assert str(noop.state) == "success"
    with create_session() as session:
        assert session.query(AssetEvent).filter(
            AssetEvent.source_run_id == noop.run_id).count() == 0
    # the downstream DAG is scheduled on that data, and reads it
    downstream = dagbag.get_dag("tweets_top_domains")
    assert "onceflow/tweets/domain_counts" in str(downstream.timetable.asset_condition)
    assert str(downstream.test().state) == "success"


def test_the_commit_task_produces_the_state_tables(airflow_db):
    """Airflow's lineage, as its Assets view shows it (the DAG files serialized by `airflow
    dags reserialize`): the commit task produces each state table's Asset and consumes none."""
    from airflow.models.asset import AssetModel
    from airflow.utils.session import create_session

    with create_session() as session:
        for name in ("url_counts", "domain_counts"):
            asset = session.query(AssetModel).filter(
                AssetModel.name == f"onceflow/tweets/{name}").one()
            assert {(t.dag_id, t.task_id) for t in asset.producing_tasks} == {
                ("onceflow_tweets", "commit")}
            assert {t.dag_id for t in asset.consuming_tasks} <= {"tweets_top_domains"}


def test_entry_points_are_read_once_until_a_package_is_installed(tmp_path, monkeypatch):
    """The registry reads the installed packages' entry points once (the scheduler reads
    them for the tasks it forks), also after a directory without packages joins sys.path (a
    task's DAG parse adds the DAG folder), and again when a package is installed."""
    import time
    from importlib.metadata import entry_points

    from onceflow.core.registry import GROUP, installed_entry_points

    monkeypatch.syspath_prepend(str(tmp_path))
    first = installed_entry_points(GROUP)
    assert [ep.value for ep in first] == [ep.value for ep in entry_points(group=GROUP)]
    assert any(ep.value.startswith("tweets_example") for ep in first), first
    assert installed_entry_points(GROUP) is first  # remembered: nothing read again
    dags = tmp_path.parent / f"{tmp_path.name}-dags"
    dags.mkdir()
    (dags / "pipelines.py").write_text("")
    monkeypatch.syspath_prepend(str(dags))
    assert installed_entry_points(GROUP) is first
    time.sleep(0.05)  # (a directory's modification time has a clock tick's resolution)
    info = tmp_path / "onceflow_probe-1.0.dist-info"  # a package installed there
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: onceflow-probe\n"
                                   "Version: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{GROUP}]\nprobe = onceflow_probe:PIPELINE\n")
    after = installed_entry_points(GROUP)
    assert after is not first
    assert "onceflow_probe:PIPELINE" in [ep.value for ep in after]


def test_the_provider_declares_no_executor():
    """Airflow's providers manager finds onceflow as a provider, with no executor of its own:
    the tasks run on whatever executor the team runs."""
    from airflow.providers_manager import ProvidersManager

    manager = ProvidersManager()
    assert "onceflow" in manager.providers
    assert not [name for name, package in manager.executor_without_check
                if package == "onceflow"]


def test_a_transaction_dags_task_does_not_load_the_shipped_dags(monkeypatch):
    from onceflow.airflow.dags import shipped_dags

    built = {"onceflow_tweets": object()}
    assert "tweets_top_domains" in shipped_dags(built)  # the scheduler's parse: everything
    monkeypatch.setenv("_AIRFLOW_PARSING_CONTEXT_DAG_ID", "onceflow_tweets")
    assert shipped_dags(built) == {}  # a task of a DAG the file built before
    monkeypatch.setenv("_AIRFLOW_PARSING_CONTEXT_DAG_ID", "tweets_top_domains")
    assert list(shipped_dags(built)) == ["tweets_top_domains"]  # a report's own task
