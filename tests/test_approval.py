"""Operating onceflow from Airflow's trigger forms: replaying dead letters only after a person
approves (onceflow.airflow.approval, Airflow's human-in-the-loop ApprovalOperator), and trigger
forms that refuse bad values with a message instead of running with them.

The approval is answered the way Airflow's UI answers it: the HITL REST API
(``PATCH /api/v2/dags/{dag}/dagRuns/{run}/taskInstances/approve/-1/hitlDetails``) of an
Airflow API app on the same metadata database, from a thread, while ``dag.test()`` keeps the
run waiting in ``awaiting_input``. Real PostgreSQL, real Airflow, real local Spark for the
transaction that makes the dead letters (records of an unknown country fail every time; with
``max_replays=0`` the first failure is a dead letter)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest

from helpers import (
    outside_pipeline,
    run_transaction,
    table,
)

DAG_ID = "onceflow_page_views_replay_dead_letters"


def approved():
    """The outside pipeline, replays of its dead letters approved by a person
    (a reference names it: test_approval:approved)."""
    from pageviews.pipelines import PAGE_VIEWS

    return dataclasses.replace(PAGE_VIEWS, max_replays=0, dead_letter_approval=True)


@pytest.fixture
def pipeline(monkeypatch, dsn, conn):
    with outside_pipeline(monkeypatch, "test_approval:approved", conn) as found:
        yield found


@pytest.fixture
def dead_letters(pipeline, conn, dsn, spark):
    """One committed transaction that leaves 5 dead letters: 3 of 'zz', 2 of 'Zz'."""
    countries = ["de", "zz", "fr", "zz", "Zz", "de", "zz", "Zz", "nl"]
    pipeline.source.append(conn, [json.dumps({"country": c, "page": "/"}) for c in countries])
    _, result = run_transaction(spark, dsn, conn, pipeline, "run-1")
    assert result.status == "committed"
    assert table(conn, "SELECT count(*) FROM dead_letters") == [(5,)]
    return table(conn, 'SELECT partition, "offset" FROM dead_letters ORDER BY 1, 2')


# -- answering the request, as the UI does --------------------------------------------------------
_api: dict = {}
ALL_ADMINS = "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS"


@pytest.fixture(autouse=True, scope="module")
def _all_admins():
    """Airflow's API app in this process lets every request in as an admin (no login), for
    this module's tests only: an api-server that a later test starts must ask for a login."""
    before = os.environ.get(ALL_ADMINS)
    os.environ[ALL_ADMINS] = "True"
    yield
    _api.clear()
    if before is None:
        os.environ.pop(ALL_ADMINS, None)
    else:
        os.environ[ALL_ADMINS] = before


def api():
    """A client of Airflow's API app (all users admins: no login) on this run's database."""
    if "client" not in _api:
        from airflow.api_fastapi.app import create_app
        from fastapi.testclient import TestClient

        _api["client"] = TestClient(create_app())
    return _api["client"]


def signed_in(user: str) -> dict[str, str]:
    """Headers of a request that ``user`` (an admin) makes: a token the API app's own auth
    manager signed for them. The all-admins middleware adds its token after this one, and the
    API reads the first."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    api()  # the app made: its auth manager is initialised
    token = get_auth_manager().generate_jwt(SimpleAuthManagerUser(username=user, role="admin"))
    return {"Authorization": f"Bearer {token}"}


class Answer(threading.Thread):
    """Waits until the run's approval task asks, reads what it shows, optionally does
    ``meanwhile(shown)``, then answers ``option`` through the HITL REST API. Should anything
    go wrong, the task is failed instead, so that dag.test() ends."""

    def __init__(self, option: str, meanwhile=None, as_user: str | None = None):
        super().__init__(daemon=True)
        self.option, self.meanwhile, self.as_user = option, meanwhile, as_user
        self.shown: dict = {}
        self.status: int | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()  # the run ended: stop waiting

    def _asking(self, deadline: float):
        from airflow.models.taskinstance import TaskInstance
        from airflow.utils.session import create_session
        from airflow.utils.state import TaskInstanceState
        from sqlalchemy import select

        while time.monotonic() < deadline and not self.done.is_set():
            with create_session() as session:
                ti = session.scalar(select(TaskInstance).where(
                    TaskInstance.dag_id == DAG_ID, TaskInstance.task_id == "approve",
                    TaskInstance.state == TaskInstanceState.AWAITING_INPUT))
                if ti is not None:
                    return ti.run_id
            time.sleep(0.3)
        raise TimeoutError("the approval task never asked")

    def run(self) -> None:
        try:
            run_id = self._asking(time.monotonic() + 240)
            url = (f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/approve/-1/"
                   "hitlDetails")
            got = api().get(url)
            assert got.status_code == 200, got.text
            self.shown = got.json()
            if self.meanwhile:
                self.meanwhile(self.shown)
            answer = api().patch(url, json={"chosen_options": [self.option],
                                            "params_input": {}},
                                 headers=signed_in(self.as_user) if self.as_user else None)
            self.status = answer.status_code
            assert answer.status_code == 200, answer.text
        except BaseException as error:
            self.error = error
            if not self.done.is_set():
                self._give_up()

    @staticmethod
    def _give_up() -> None:
        from airflow.models.taskinstance import TaskInstance
        from airflow.utils.session import create_session
        from airflow.utils.state import TaskInstanceState
        from sqlalchemy import update

        with create_session() as session:
            session.execute(update(TaskInstance).where(
                TaskInstance.dag_id == DAG_ID,
                TaskInstance.state == TaskInstanceState.AWAITING_INPUT,
            ).values(state=TaskInstanceState.FAILED))


def choose(**conf) -> dict:
    """A whole trigger form: dag.test() runs every task of the same DAG object in this
    process, and Airflow keeps a run's conf in the DAG's Params (Param.resolve sets its
    value), so a value left out would be the previous run's."""
    return {"records": [], "error_contains": None, "last_error": None, "all": False, **conf}


def run_with_answer(dag, conf: dict, answer: Answer, when: datetime):
    from airflow.models import import_all_models

    import_all_models()  # mapped here: the thread's first query must not configure them
    api()
    answer.start()
    try:
        run = dag.test(logical_date=when, run_conf=conf)
    finally:
        answer.done.set()
        answer.join(timeout=30)
    if answer.error is not None:
        raise answer.error
    return run, {ti.task_id: str(ti.state) for ti in run.get_task_instances()}


# -- approval and rejection -----------------------------------------------------------------------
@pytest.mark.timeout(500)
def test_dead_letters_are_replayed_only_after_approval(pipeline, dead_letters, conn,
                                                       airflow_db):
    from onceflow.airflow.approval import replay_dead_letters_dag
    from onceflow.core import txlog
    from onceflow.core.backflow import replay_dead_letters
    from onceflow.core.db import connection, transaction

    dag = replay_dead_letters_dag("page_views")
    assert dag.dag_id == DAG_ID
    assert [t.task_id for t in dag.tasks] == ["preview", "approve", "replay"]
    base = datetime.now(UTC).replace(microsecond=0)

    # rejected: nothing changes, the replay is skipped
    rejecting = Answer("Reject")
    run, tasks = run_with_answer(dag, choose(error_contains="'zz'"), rejecting, base)
    assert str(run.state) == "success"
    assert tasks == {"preview": "success", "approve": "success", "replay": "skipped"}
    shown = rejecting.shown
    assert shown["subject"] == "Replay 3 dead letters of page_views?"
    assert "unknown country 'zz' | 3 |" in shown["body"]
    assert "'Zz'" not in shown["body"]  # only what error_contains chose
    assert shown["options"] == ["Approve", "Reject"] and shown["defaults"] == ["Reject"]
    assert table(conn, "SELECT count(*) FROM dead_letters") == [(5,)]
    assert table(conn, "SELECT count(*) FROM backflow_items") == [(0,)]

    # approved: exactly what was shown goes back; one of them was put back by someone else
    # while the request waited, so it is left alone
    moved_meanwhile = []

    def someone_else(_shown):
        with connection(os.environ["ONCEFLOW_PG_DSN"]) as other, transaction(other) as cur:
            txlog.lock_pipeline(cur, "page_views")
            moved_meanwhile.append(replay_dead_letters(
                cur, "page_views", positions=[tuple(dead_letters[0])]))

    approving = Answer("Approve", meanwhile=someone_else)
    run, tasks = run_with_answer(dag, choose(all=True), approving, base + timedelta(seconds=1))
    assert str(run.state) == "success", tasks
    assert tasks == {"preview": "success", "approve": "success", "replay": "success"}
    assert moved_meanwhile == [1]
    assert approving.shown["subject"] == "Replay 5 dead letters of page_views?"
    body = approving.shown["body"]
    assert "unknown country 'zz' | 3 |" in body and "unknown country 'Zz' | 2 |" in body
    assert all(f"| p{p}:{o} |" in body for p, o in dead_letters)  # the newest, one by one
    assert table(conn, "SELECT count(*) FROM dead_letters") == [(0,)]
    queued = table(conn, "SELECT partition, \"offset\", failures, errors[array_upper(errors, 1)] "
                         "FROM backflow_items ORDER BY 1, 2")
    assert [(p, o) for p, o, _, _ in queued] == [tuple(x) for x in dead_letters]
    assert all(failures == 0 and last == "put back from the dead letters by a user"
               for _, _, failures, last in queued)
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        row = session.scalar(select(XComModel).where(
            XComModel.dag_id == DAG_ID, XComModel.run_id == run.run_id,
            XComModel.task_id == "replay", XComModel.key == "return_value"))
        result = XComModel.deserialize_value(row)
    assert (result["replayed"], result["shown"], result["gone"]) == (4, 5, 1)
    assert result["approved_by"] and result["approved_by"] != "?"


@pytest.mark.timeout(300)
def test_a_replay_with_nothing_chosen_or_nothing_matching(pipeline, conn, airflow_db):
    from onceflow.airflow.approval import replay_dead_letters_dag

    dag = replay_dead_letters_dag("page_views")
    base = datetime.now(UTC).replace(microsecond=0)
    nothing = dag.test(logical_date=base)
    assert str(nothing.state) == "failed"
    no_match = dag.test(logical_date=base + timedelta(seconds=1), run_conf=choose(all=True))
    assert str(no_match.state) == "success"
    assert {ti.task_id: str(ti.state) for ti in no_match.get_task_instances()} == {
        "preview": "skipped", "approve": "skipped", "replay": "skipped"}


# -- trigger forms --------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_trigger_forms_refuse_bad_values_with_a_message(pipeline, conn, airflow_db):
    from airflow.sdk import DAG

    from onceflow.airflow import transaction_dag
    from onceflow.airflow.approval import replay_dead_letters_dag

    transactions = transaction_dag(pipeline)
    replays = replay_dead_letters_dag(pipeline)
    assert isinstance(transactions, DAG)
    cases = [
        (transactions, {"batch_size": 0}, "batch_size", "less than the minimum of 1"),
        (transactions, {"batch_size": -5}, "batch_size", "less than the minimum of 1"),
        (transactions, {"batch_size": "many"}, "batch_size", "is not of type 'integer'"),
        (transactions, {"groups": 0}, "groups", "less than the minimum of 1"),
        (transactions, {"txid": 0}, "txid", "less than the minimum of 1"),
        (replays, {"records": ["2-1041"]}, "records", "does not match"),
        (replays, {"error_contains": ""}, "error_contains", "should be non-empty"),
    ]
    base = datetime.now(UTC).replace(microsecond=0)
    for i, (dag, conf, param, says) in enumerate(cases):
        with pytest.raises(Exception, match=f"Invalid input for param {param}: .*{says}"):
            dag.test(logical_date=base + timedelta(seconds=i), run_conf=conf)
    # the form of Airflow's UI posts to the REST API: refused there with the same message
    refused = api().post("/api/v2/dags/onceflow_page_views/dagRuns",
                         json={"logical_date": None, "conf": {"batch_size": 0}})
    assert refused.status_code == 400, refused.text
    assert "Invalid input for param batch_size: 0 is less than the minimum of 1" in refused.text
    # nothing ran: no transaction was planned with a bad value
    assert table(conn, "SELECT count(*) FROM transactions") == [(0,)]
    # Airflow's trigger form gives a top-level "minimum" to its number field, which turns 0
    # into 1 without a word: the minimum is checked inside allOf (tests/test_ui.py types 0
    # in the form itself)
    for name in ("batch_size", "groups", "txid"):
        schema = transactions.params.get_param(name).schema
        assert "minimum" not in schema and {"minimum": 1} in schema["allOf"], (name, schema)


def test_begin_refuses_a_plan_setting_below_one_naming_it(pipeline, conn):
    """Whatever starts a run without the trigger form's check (an operator's argument, a
    param of another schema), begin refuses a batch_size, groups or txid below 1 or not a
    whole number, naming it and where it came from: never another value."""
    from airflow.sdk.exceptions import AirflowFailException

    from onceflow.airflow.operators import BeginBatchOperator

    form = BeginBatchOperator(task_id="begin", pipeline="page_views")
    for params, says in [
        ({"batch_size": 0}, "batch_size=0 (the run's param) is invalid: give a whole number, "
                            "1 or more, or leave it empty for the pipeline's own"),
        ({"groups": -1}, "groups=-1 (the run's param) is invalid"),
        ({"batch_size": 2.5}, "batch_size=2.5 (the run's param) is invalid"),
        ({"batch_size": True}, "batch_size=True (the run's param) is invalid"),
        ({"txid": "0"}, "txid='0' (the run's param) is invalid: give a whole number, 1 or "
                        "more, or leave it empty for the next txid"),
    ]:
        with pytest.raises(AirflowFailException, match=re.escape(says)):
            form.execute({"params": params, "run_id": "run-1"})
    argument = BeginBatchOperator(task_id="begin", pipeline="page_views", batch_size=0)
    with pytest.raises(AirflowFailException,
                       match=re.escape("batch_size=0 (the task's argument) is invalid")):
        argument.execute({"params": {"batch_size": 400}, "run_id": "run-1"})
    assert table(conn, "SELECT count(*) FROM transactions") == [(0,)]
    # a whole number given as text or 5.0 is that number
    (batch,) = form.execute({"params": {"batch_size": "5", "groups": 1.0}, "run_id": "run-2"})
    assert (batch["records"], batch["groups"]) == (0, 1)  # nothing produced: an empty batch


# -- the exact reason the onceflow view replays ---------------------------------------------------
def test_the_preview_chooses_the_dead_letters_of_one_whole_last_error(pipeline, conn):
    """last_error (what the onceflow view's buttons send): the letters whose last error is
    exactly that text, not those sharing its first 80 characters nor one that had it before."""
    from onceflow.airflow.approval import DeadLetterPreviewOperator, preview_text
    from onceflow.core import backflow

    prefix = "bolt country: LookupError: the geo service does not know the country code of " \
             "this page view; "
    first, second = prefix + "'zz' is unknown", prefix + "'Zz' is unknown"
    with conn.cursor() as cur:
        backflow.ensure_pointers(cur, "page_views")
        for partition, offset, errors in [(0, 1, [first]), (0, 2, [second, first]),
                                          (1, 4, [second]), (2, 9, [first, second])]:
            cur.execute(
                """INSERT INTO dead_letters (pipeline, partition, "offset", payload, failures,
                                             errors, txid)
                   VALUES ('page_views', %s, %s, '{}', %s, %s, 1)""",
                (partition, offset, len(errors), errors))
    conn.commit()
    preview = DeadLetterPreviewOperator(task_id="preview", pipeline="page_views")
    shown = preview.execute({"params": choose(last_error=second)})
    assert shown["count"] == 2
    assert sorted((p, o) for p, o, _ in shown["shown"]) == [(1, 4), (2, 9)]
    assert shown["by_reason"] == [[second, 2]]
    # the request shows a long reason cut at a word, with an ellipsis
    _, body, _ = preview_text("page_views", "x", [(0, 1, 1, "word " * 60, 1, datetime.now(UTC))],
                              0)
    assert f"| {'word ' * 39}word… | 1 |" in body


# -- approvers: someone other than the one who asked ----------------------------------------------
def approved_by_bob():
    """The approval pipeline with approvers bob and carol (a reference names it:
    test_approval:approved_by_bob)."""
    return dataclasses.replace(approved(), approvers=("bob", "carol"))


def test_approvers_must_be_declared_names_and_need_approvals():
    from helpers import TWEETS_APPROVED
    from onceflow.airflow.approval import approver_refused
    from onceflow.core.errors import ConfigError

    for bad, says in [(("alice", "alice"), "distinct"), (["alice"], "a tuple"),
                      (("",), "a tuple"), ((" bob",), "a tuple")]:
        with pytest.raises(ConfigError, match=rf"pipeline.approvers=.* is invalid: .*{says}"):
            dataclasses.replace(TWEETS_APPROVED, approvers=bad).validate()
    with pytest.raises(ConfigError, match="set dead_letter_approval=True too"):
        dataclasses.replace(TWEETS_APPROVED, dead_letter_approval=False,
                            approvers=("alice",)).validate()
    assert dataclasses.replace(TWEETS_APPROVED, approvers=("alice", "bob")).validate()
    # who counts: with approvers, one of them who did not ask (the run's triggering user)
    assert "someone else must approve ('bob')" in approver_refused(("alice", "bob"), "alice",
                                                                   "alice")
    assert "only 'alice', 'bob' may approve" in approver_refused(("alice", "bob"), "carol",
                                                                 "mallory")
    assert approver_refused(("alice", "bob"), "alice", "bob") is None
    assert approver_refused((), "alice", "alice") is None  # no approvers: as before


def _one_dead_letter(conn) -> None:
    from onceflow.core import backflow

    with conn.cursor() as cur:
        backflow.ensure_pointers(cur, "page_views")
        cur.execute("""INSERT INTO dead_letters (pipeline, partition, "offset", payload,
                                                 failures, errors, txid)
                       VALUES ('page_views', 0, 3, '{}', 1, ARRAY['unknown country'], 1)""")
    conn.commit()


def asker_and_carol():
    """Approvers dag_test (the user dag.test() asks as) and carol
    (test_approval:asker_and_carol)."""
    return dataclasses.replace(approved(), approvers=("dag_test", "carol"))


@pytest.mark.timeout(500)
def test_with_approvers_only_another_of_them_approves(monkeypatch, conn, airflow_db):
    """Each answer through Airflow's HITL REST API, as the user named: with approvers bob and
    carol, Anonymous's Approve replays nothing and fails the replay, saying who may approve;
    with approvers dag_test and carol and a run asked for by dag_test (dag.test()'s user),
    dag_test's own Approve is refused the same way, saying someone else must approve, and
    carol's Approve of the next request replays."""
    from onceflow.airflow.approval import replay_dead_letters_dag

    base = datetime.now(UTC).replace(microsecond=0)
    with outside_pipeline(monkeypatch, "test_approval:approved_by_bob", conn) as pipeline:
        assert pipeline.approvers == ("bob", "carol")
        _one_dead_letter(conn)
        answer = Answer("Approve")
        run, tasks = run_with_answer(replay_dead_letters_dag("page_views"), choose(all=True),
                                     answer, base)
        assert tasks == {"preview": "success", "approve": "success", "replay": "failed"}
        assert "Only `bob`, `carol` may approve, not `dag_test`, who asked" in \
            answer.shown["body"]
        assert _responder(run.run_id) == "Anonymous"
        assert table(conn, "SELECT count(*) FROM dead_letters") == [(1,)]
    with outside_pipeline(monkeypatch, "test_approval:asker_and_carol", conn) as pipeline:
        assert pipeline.approvers == ("dag_test", "carol")
        dag = replay_dead_letters_dag("page_views")
        own = Answer("Approve", as_user="dag_test")
        run, tasks = run_with_answer(dag, choose(all=True), own, base + timedelta(seconds=1))
        assert tasks == {"preview": "success", "approve": "success", "replay": "failed"}
        assert run.triggering_user_name == "dag_test"
        assert own.status == 200  # Airflow took the answer; onceflow did not count it
        assert _responder(run.run_id) == "dag_test"  # the approval really was the asker's
        assert table(conn, "SELECT count(*) FROM dead_letters") == [(1,)]
        assert table(conn, "SELECT count(*) FROM backflow_items") == [(0,)]
        assert any("asked for this replay and approved it: someone else must approve "
                   "('carol')" in text for text in _replay_notes(run.run_id)), \
            _replay_notes(run.run_id)

        carols = Answer("Approve", as_user="carol")
        run, tasks = run_with_answer(dag, choose(all=True), carols, base + timedelta(seconds=2))
        assert tasks == {"preview": "success", "approve": "success", "replay": "success"}
        assert _responder(run.run_id) == "carol"
        assert table(conn, "SELECT count(*) FROM dead_letters") == [(0,)]
        assert table(conn, "SELECT partition, \"offset\" FROM backflow_items") == [(0, 3)]


def _responder(run_id: str) -> str | None:
    """Who answered the run's approval, as Airflow recorded it."""
    from airflow.models.hitl import HITLDetail
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        detail = session.scalar(select(HITLDetail).join(
            TaskInstance, TaskInstance.id == HITLDetail.ti_id).where(
            TaskInstance.dag_id == DAG_ID, TaskInstance.run_id == run_id,
            TaskInstance.task_id == "approve"))
        return (detail.responded_by or {}).get("name") if detail is not None else None


def _replay_notes(run_id: str) -> list[str]:
    """What the run's replay task said for the run's note (onceflow.airflow.ui.notes)."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    from onceflow.airflow.ui.notes import NOTE_KEY

    with create_session() as session:
        rows = session.scalars(select(XComModel).where(
            XComModel.dag_id == DAG_ID, XComModel.run_id == run_id,
            XComModel.task_id == "replay", XComModel.key == NOTE_KEY)).all()
        return [str(XComModel.deserialize_value(row).get("text")) for row in rows]
