"""onceflow inside Airflow's UI (onceflow.airflow.ui), in a real browser: a real Airflow
api-server with the plugin loaded (one for the module, on a free port of 127.0.0.1), the
test's onceflow database (the Airflow connection onceflow_pg in Airflow's metadata database,
as the server sees it), real DAG runs with dag.test() whose notes the plugin's listener
writes, and Debian's Chromium driven by Playwright: the run list shows each run's txid and
outcome, the onceflow view shows the commit timeline, replaying a dead letter through the view
moves it exactly once, a backfill queues a run with its txid; a read-only user sees no
buttons and may not act; an anonymous request is refused.

Needs Chromium (Debian: ``apt-get install chromium``; another binary: ``ONCEFLOW_CHROMIUM``)
and the ``playwright`` package; without them the browser test is skipped, except on CI.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import parse_qs, quote, unquote, urlsplit

import pytest

from helpers import table, tweets_pipeline
from onceflow.airflow import airflow_cli
from onceflow.dev.localenv import spark_connection

TESTS = Path(__file__).resolve().parent
APPROVED = "helpers:TWEETS_APPROVED"  # the tweets pipeline with dead_letter_approval=True
CHROMIUM = os.environ.get("ONCEFLOW_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SHIM = '''"""Loads onceflow's Airflow plugin (written by tests/test_ui.py: no entry point)."""
from onceflow.airflow.ui.plugin import OnceflowPlugin  # noqa: F401
'''


# -- the run notes, without services ---------------------------------------------------------------
def _now(state, attempt=1, run_id="other", reason=None):
    return SimpleNamespace(state=state, attempt=attempt, run_id=run_id, reason=reason)


def test_run_notes_say_txid_and_outcome():
    from onceflow.airflow.ui import notes

    planned = notes.planned("tweets", 18, 1, 20_000)
    committed = notes.committed("tweets", 17, 1, records=20_000, failed=5, dead=3, waited_s=4.2)
    assert committed["text"] == ("txid 17 · committed · 20,000 records · 2 queued for replay · "
                                 "3 dead letters · waited 4s for txid 16")
    assert notes.no_op("tweets", 12)["text"] == "txid 12 already committed (no-op)"
    assert notes.committed("tweets", 5, 2, records=1, earlier_try=True)["text"] == \
        "txid 5 · committed · 1 record · attempt 2 · on an earlier try of the commit task"

    def text(failed, said, now=None):
        return notes.note_text("onceflow_tweets", "run-1", failed, said,
                               lookup=lambda pipeline, txid: now)

    assert text(False, [planned, committed]) == committed["text"]
    # a failed run: the reason its attempt recorded in onceflow's transaction log
    assert text(True, [planned], _now("failed", reason="process failed in run run-1: "
                                                       "RuntimeError('boom')")) == \
        "txid 18 failed: process failed: RuntimeError('boom')"
    # fenced by a newer attempt (a duplicate run) while it failed
    assert text(True, [planned], _now("planned", attempt=2, run_id="run-2")) == \
        "superseded: txid 18 attempt 1 is fenced: attempt 2 is current (run run-2, planned)"
    # a duplicate run whose attempt was fenced ends skipped: its task said so
    fenced = notes.superseded("tweets", "txid 18 attempt 1 of tweets is fenced: attempt 2 is "
                                        "current", 18, 1)
    assert text(False, [planned, fenced]) == ("superseded: txid 18 attempt 1 of tweets is "
                                              "fenced: attempt 2 is current")
    assert text(False, [notes.nothing_planned("tweets", "max_pending=3 reached")]) == \
        "no transaction: max_pending=3 reached"
    assert text(True, []) == "failed before a txid was given (see the begin task's log)"
    assert notes.note_text("other_dag", "run-1", True, []) is None  # not onceflow's


def test_a_note_a_user_wrote_stays_below():
    from onceflow.airflow.ui import notes

    class Note(SimpleNamespace):
        pass

    run = SimpleNamespace(dag_run_note=Note(content="txid 3 · planned · 10 records\n\nmine",
                                            user_id="alice"))
    notes.set_note(run, "txid 3 · committed · 10 records")
    assert run.dag_run_note.content == "txid 3 · committed · 10 records\n\nmine"
    run = SimpleNamespace(dag_run_note=Note(content="txid 3 · backfill queued", user_id=None))
    notes.set_note(run, "txid 3 failed: x")
    assert run.dag_run_note.content == "txid 3 failed: x"


# -- a real api-server ---------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plugin_loaded_here() -> None:
    """The plugin in this process (dag.test() runs the listener here) and in the server's
    (same AIRFLOW_HOME, so the same plugins folder): by entry point, or by a one-line file in
    the plugins folder of this run's own Airflow home."""
    from airflow import plugins_manager, settings
    from airflow.listeners.listener import get_listener_manager

    if any(p.name == "onceflow" for p in plugins_manager._get_plugins()[0]):
        return
    folder = Path(settings.PLUGINS_FOLDER)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "onceflow_ui_plugin.py").write_text(SHIM)
    for cached in (plugins_manager._get_plugins, plugins_manager._get_ui_plugins,
                   plugins_manager.get_fastapi_plugins, get_listener_manager):
        cached.cache_clear()
    assert any(p.name == "onceflow" for p in plugins_manager._get_plugins()[0])


@pytest.fixture(scope="module")
def api_server(airflow_db, tmp_path_factory):
    """``airflow api-server`` on a free port of 127.0.0.1 with users admin (admin) and viewer
    (viewer). Its onceflow DSN comes from the connection onceflow_pg in the metadata
    database (each test points it at its own database). Yields url, passwords, log."""
    _plugin_loaded_here()
    folder = tmp_path_factory.mktemp("api-server")
    passwords = {"admin": secrets.token_urlsafe(12), "viewer": secrets.token_urlsafe(12)}
    (folder / "passwords.json").write_text(json.dumps(passwords))
    port = _free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("AIRFLOW_CONN_ONCEFLOW_PG", "ONCEFLOW_PG_DSN")}
    env.update({
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,viewer:viewer",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(folder / "passwords.json"),
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(port),
        # a pipeline whose dead letters are replayed only after approval, as a user adds one
        "ONCEFLOW_PIPELINES": ",".join(filter(None, [env.get("ONCEFLOW_PIPELINES"), APPROVED])),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")])),
    })
    log = folder / "api-server.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            airflow_cli("api-server", "-H", "127.0.0.1", "-p", str(port), "-w", "1"), env=env,
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        # it starts while the test makes its transactions: wait_up() before using it
        yield SimpleNamespace(url=url, passwords=passwords, log=log,
                              wait_up=lambda: _wait_until_up(url, server, log))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _wait_until_up(url: str, server, log: Path) -> None:
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the api-server exited ({server.returncode}):\n{_tail(log)}")
        try:
            if httpx.get(f"{url}/onceflow/api/pipelines", timeout=2).status_code == 401:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"the api-server did not answer in 120 s:\n{_tail(log)}")


def _tail(log: Path, lines: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture
def onceflow_connection(dsn, api_server):
    """The Airflow connection onceflow_pg, in the metadata database, at this test's
    database: what the api-server reads."""
    from airflow.models.connection import Connection
    from airflow.utils.session import create_session
    from psycopg2.extensions import parse_dsn

    p = parse_dsn(dsn)
    with create_session() as session:
        session.query(Connection).filter(Connection.conn_id == "onceflow_pg").delete()
        session.add(Connection(conn_id="onceflow_pg", conn_type="postgres",
                               host=p.get("host", "127.0.0.1"), port=int(p.get("port", 5432)),
                               login=p.get("user"), password=p.get("password"),
                               schema=p["dbname"]))
    yield
    with create_session() as session:
        session.query(Connection).filter(Connection.conn_id == "onceflow_pg").delete()


def _token(api_server, user: str) -> str:
    import httpx

    answer = httpx.post(f"{api_server.url}/auth/token", timeout=10,
                        json={"username": user, "password": api_server.passwords[user]})
    assert answer.status_code == 201, answer.text
    return answer.json()["access_token"]


# -- the browser ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chromium():
    """Chromium and Playwright are there (checked before any work). Launch it with
    ``launched()`` only after the DAG runs: Playwright's sync API keeps an event loop running
    in this thread, where dag.test() runs its triggers with asyncio.run()."""
    if not Path(CHROMIUM).exists() or shutil.which(CHROMIUM) is None:
        _missing(f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        _missing("the playwright package is not installed")
    return CHROMIUM


@contextmanager
def launched(executable: str):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def _missing(why: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


@contextmanager
def screenshots_on_failure(tmp_path: Path, log: Path | None = None, **pages):
    """On a failure, a screenshot of each page (with what its iframe shows) in the test's
    tmp folder, and the end of the api-server's log."""
    try:
        yield
    except BaseException:
        if log is not None:
            print(f"api-server log ({log}):\n{_tail(log, 40)}")
        for name, page in pages.items():
            try:
                page.screenshot(path=str(tmp_path / f"{name}.png"), full_page=True)
                print(f"screenshot: {tmp_path / f'{name}.png'} ({page.url})")
            except Exception as error:  # the page may be gone
                print(f"no screenshot of {name}: {error}")
        raise


def _log_in(browser, api_server, user: str, next_path: str, theme: str | None = None):
    """A logged-in page at ``next_path``; ``theme``: in Airflow's light or dark theme (its
    colour mode, which the UI keeps in the browser's local storage), else the system's."""
    context = browser.new_context(viewport={"width": 1500, "height": 1000})
    context.set_default_timeout(20_000)
    if theme is not None:
        context.add_init_script(f"localStorage.setItem('theme', {json.dumps(theme)})")
    page = context.new_page()
    page.goto(f"{api_server.url}/auth/login?next={api_server.url}{next_path}")
    page.get_by_label("Username").fill(user)
    page.get_by_label("Password").fill(api_server.passwords[user])
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"{api_server.url}{next_path}*")
    return context, page


# -- the transactions the view shows ---------------------------------------------------------------
def _dead_letters(conn, pipeline: str) -> None:
    """Three records the backflow gave up on (as a commit leaves them), two for one reason."""
    from onceflow.core import backflow

    with conn.cursor() as cur:
        backflow.ensure_pointers(cur, pipeline)
        for partition, offset, error in [(0, 3, "bolt normalize_domain: ValueError: bad host"),
                                         (1, 7, "bolt normalize_domain: ValueError: bad host"),
                                         (2, 11, "bolt lookup: TimeoutError: slow")]:
            cur.execute(
                """INSERT INTO dead_letters (pipeline, partition, "offset", payload, failures,
                                             errors, txid)
                   VALUES (%s, %s, %s, %s, 4, %s, 1)""",
                (pipeline, partition, offset, json.dumps({"id": offset}), [error] * 4))
    conn.commit()


def _process_when_planned(spark, dsn: str, pipeline, txid: int, then_commit) -> threading.Thread:
    """In a thread: once a DAG run's begin planned ``txid``, process it here (the shared local
    Spark session), then commit the earlier txid ``then_commit`` (a TransactionAttempt): the
    run's commit waits for it and commits after it."""
    from onceflow.core.commit import commit
    from onceflow.core.db import connect
    from onceflow.core.txlog import TransactionAttempt
    from onceflow.spark.processing import process_batch

    errors: list[BaseException] = []

    def work():
        conn = connect(dsn)
        try:
            deadline = time.monotonic() + 120
            row = []
            while not row and time.monotonic() < deadline:
                row = table(conn, "SELECT attempt, groups FROM transactions WHERE pipeline = %s "
                                  "AND txid = %s", (pipeline.name, txid))
                time.sleep(0.2)
            assert row, f"txid {txid} was never planned"
            attempt, groups = row[0]
            for group in range(groups):
                process_batch(spark, dsn, pipeline, TransactionAttempt(txid, attempt), group)
            assert commit(conn, pipeline, then_commit).status == "committed"
        except BaseException as error:
            errors.append(error)
        finally:
            conn.close()

    thread = threading.Thread(target=work, name=f"process-txid-{txid}", daemon=True)
    thread.errors = errors
    thread.start()
    return thread


def _note_in_run_list(page, run_id: str) -> str:
    """The note of ``run_id`` as the DAG's run list shows it (its Note button)."""
    row = page.locator("tr", has=page.get_by_role("link", name=run_id, exact=True))
    row.get_by_role("button", name="Note").click()
    dialog = page.get_by_role("dialog")
    dialog.wait_for()
    text = dialog.inner_text()
    page.keyboard.press("Escape")
    dialog.wait_for(state="hidden")
    return text


@pytest.mark.timeout(400)
def test_run_notes_and_the_onceflow_view_in_a_browser(chromium, api_server, onceflow_connection,
                                                      dsn, conn, spark, monkeypatch, tmp_path):

    from helpers import run_transaction
    from onceflow.airflow import transaction_dag
    from onceflow.core.begin import begin
    from onceflow.spark.processing import process_batch

    started = time.monotonic()
    pipeline = tweets_pipeline(conn, events=1000, batch_size=200, malformed_share=0.05,
                               poison_share=0, flaky_share=0)
    run_transaction(spark, dsn, conn, pipeline, "lib-1")  # txid 1
    second = begin(conn, pipeline, "lib-2")  # txid 2: processed, committed later
    for group in range(second.groups):
        process_batch(spark, dsn, pipeline, second.attempt, group)
    _dead_letters(conn, pipeline.name)

    # txid 3 through the DAG: its commit waits until txid 2 commits; the run's
    # processing happens in this test's thread on the shared Spark session (process marked
    # success in Airflow), so no spark-submit is started.
    dag = transaction_dag("tweets", default_args={"retries": 0})
    base = datetime.now(UTC).replace(microsecond=0)
    worker = _process_when_planned(spark, dsn, pipeline, 3, second.attempt)
    committed_run = dag.test(logical_date=base, run_conf={"batch_size": 200},
                             mark_success_pattern="process")
    worker.join(60)
    assert not worker.errors, worker.errors
    assert str(committed_run.state) == "success"
    # txid 4 through the DAG: processing fails, no retries: its Spark connection names a
    # Spark Connect server that does not answer (a port nothing listens on)
    nowhere = _free_port()
    with monkeypatch.context() as run_env:
        run_env.setenv("AIRFLOW_CONN_SPARK_DEFAULT", spark_connection(nowhere))
        failed_run = dag.test(logical_date=base + timedelta(seconds=1),
                              run_conf={"batch_size": 200})
    assert str(failed_run.state) == "failed"
    # txid 1 again (a backfill of a committed txid): nothing to do
    noop_run = dag.test(logical_date=base + timedelta(seconds=2), run_conf={"txid": 1})
    assert str(noop_run.state) == "success"
    assert table(conn, "SELECT txid, state FROM transactions ORDER BY txid") == [
        (1, "committed"), (2, "committed"), (3, "committed"), (4, "failed")]
    # the DAG's commit of txid 3 waited for txid 2, which the thread committed after
    # processing txid 3 (how long depends on the machine: 0.45 s was seen on a fast one)
    waited = table(conn, "SELECT commit_wait_s FROM transactions WHERE txid = 3")[0][0]
    assert waited > 0
    assert table(conn, "SELECT txid FROM transactions WHERE txid IN (2, 3) "
                       "ORDER BY committed_at") == [(2,), (3,)]
    setup_s = time.monotonic() - started

    api_server.wait_up()
    browsing = time.monotonic()
    with launched(chromium) as browser:
        _browse(browser, api_server, conn, tmp_path, committed_run, failed_run, noop_run,
                f"sc://127.0.0.1:{nowhere}")
    browsing_s = time.monotonic() - browsing
    _check_api(api_server, conn)
    _check_lineage_and_events(api_server, conn, committed_run, noop_run)
    print(f"setup {setup_s:.1f}s, browsing {browsing_s:.1f}s")


def _browse(browser, api_server, conn, tmp_path, committed_run, failed_run, noop_run,
            nowhere: str) -> None:
    import httpx
    from playwright.sync_api import expect

    committed_note = "txid 3 · committed · 200 records"
    failed_note = (f"txid 4 failed: process failed: OnceflowError('the Spark Connect server at "
                   f"{nowhere} does not answer (connection refused or timed out)")
    noop_note = "txid 1 already committed (no-op)"
    context, page = _log_in(browser, api_server, "admin", "/dags/onceflow_tweets/runs")
    with screenshots_on_failure(tmp_path, api_server.log, admin=page):
        # the run list: each run's note says its txid and outcome
        assert committed_note in _note_in_run_list(page, committed_run.run_id)
        assert failed_note in _note_in_run_list(page, failed_run.run_id)
        # (and through Airflow's REST API, as any client sees it)
        run = httpx.get(f"{api_server.url}/api/v2/dags/onceflow_tweets/dagRuns/"
                        f"{quote(noop_run.run_id, safe='')}", timeout=30,
                        headers={"Authorization": f"Bearer {_token(api_server, 'viewer')}"})
        assert run.status_code == 200, run.text
        assert run.json()["note"] == noop_note
        # the server found onceflow's plugin once (a second copy would be an import error)
        errors = httpx.get(f"{api_server.url}/api/v2/plugins/importErrors", timeout=30,
                           headers={"Authorization": f"Bearer {_token(api_server, 'admin')}"})
        assert errors.status_code == 200 and errors.json()["total_entries"] == 0, errors.text
        _trigger_form_refuses_a_batch_size_of_zero(page, api_server)

        # the onceflow view, from the UI's navigation: a React view in Airflow's own page
        page.get_by_test_id("nav-sidebar").get_by_role("link", name="onceflow").click()
        page.locator("#onceflow-pipelines tr[data-pipeline='tweets']").get_by_role(
            "link", name="tweets", exact=True).click()
        page.wait_for_url(f"{api_server.url}/plugin/onceflow/pipelines/tweets")
        timeline = page.locator("#onceflow-timeline")
        timeline.locator("tbody tr[data-state]").first.wait_for()
        assert page.locator("iframe").count() == 0
        states = {int(r.get_attribute("data-txid")): r.get_attribute("data-state")
                  for r in timeline.locator("tbody tr[data-state]").all()}
        assert states == {1: "committed", 2: "committed", 3: "committed", 4: "failed"}
        assert f"{nowhere} does not answer" in timeline.locator("tr[data-txid='4']").inner_text()
        assert committed_run.run_id in timeline.locator("tr[data-txid='3']").inner_text()
        stuck = page.locator("#onceflow-open tr[data-txid='4']").inner_text()
        assert "failed" in stuck and "onceflow backfill --pipeline tweets" in stuck
        assert page.locator("#onceflow-dead-total").inner_text() == "3"
        reasons = page.locator("#onceflow-dead-reasons").inner_text()
        assert "bolt normalize_domain: ValueError: bad host" in reasons
        assert "bolt lookup: TimeoutError: slow" in reasons

        # replay one dead letter: the dialog says what it would do and dims the whole UI;
        # cancelled, nothing moves; confirmed, it moves
        replay = page.locator("#onceflow-dead-letters tr[data-record='0:3']").get_by_role(
            "button", name="Replay…")
        dialog = page.locator("#onceflow-confirm")
        replay.click()
        dialog.wait_for()
        assert "Put 1 dead letter(s) of tweets (record(s) p0:3) back" in dialog.inner_text()
        backdrop = page.locator("[data-scope='dialog'][data-part='backdrop']").bounding_box()
        assert (backdrop["x"], backdrop["y"], backdrop["width"], backdrop["height"]) == (
            0, 0, 1500, 1000), backdrop
        page.locator("#onceflow-confirm-cancel").click()
        dialog.wait_for(state="hidden")
        assert table(conn, "SELECT count(*) FROM dead_letters") == [(3,)]
        replay.click()
        dialog.wait_for()
        page.locator("#onceflow-confirm-ok").click()
        page.locator("#onceflow-flash").filter(
            has_text="1 dead letter(s) of tweets put back").wait_for()
        expect(page.locator("#onceflow-dead-total")).to_have_text("2")

        # backfill the failed txid: one queued run with conf {"txid": 4}
        page.locator("#onceflow-backfill").click()
        dialog.wait_for()
        assert "Trigger 1 run(s) of onceflow_tweets" in dialog.inner_text()
        assert "txid 4 (failed" in dialog.inner_text()
        page.locator("#onceflow-confirm-ok").click()
        page.locator("#onceflow-flash").filter(
            has_text="Triggered 1 run(s) of onceflow_tweets").wait_for()

        # from a txid to its task's log, and from there back to the view at that txid
        _from_txid_to_log_and_back(page, api_server, committed_run, 3)
    context.close()

    # moved exactly once: out of the dead letters, into the backflow (the from-queue, which
    # became the to-queue at once: the to-queue was empty) once, its failures reset
    assert table(conn, """SELECT partition, "offset" FROM dead_letters ORDER BY 1""") == \
        [(1, 7), (2, 11)]
    moved = table(conn, """SELECT failures, errors[array_upper(errors, 1)], claimed_txid
                           FROM backflow_items WHERE partition = 0 AND "offset" = 3""")
    assert moved == [(0, "put back from the dead letters by a user", None)]
    admin = {"Authorization": f"Bearer {_token(api_server, 'admin')}",
             "X-Requested-By": "test"}
    again = httpx.post(f"{api_server.url}/onceflow/api/pipelines/tweets/dead-letters/replay",
                       headers=admin, json={"records": ["0:3"], "confirm": True}, timeout=30)
    assert again.status_code == 200 and again.json()["count"] == 0
    assert table(conn, """SELECT count(*) FROM backflow_items
                          WHERE partition = 0 AND "offset" = 3""") == [(1,)]
    _check_backfill_run(4)

    # a read-only user: the view without buttons; the actions refused
    context, page = _log_in(browser, api_server, "viewer", "/plugin/onceflow/pipelines/tweets")
    with screenshots_on_failure(tmp_path, api_server.log, viewer=page):
        page.locator("#onceflow-timeline tr[data-txid='3']").wait_for()
        page.locator("#onceflow-dead-letters tr[data-record]").first.wait_for()
        assert page.locator("#onceflow-dead-letters tr[data-record]").count() == 2
        assert page.locator(".onceflow-action").count() == 0
        assert page.locator("#onceflow-backfill, #onceflow-replay-all").count() == 0
        # the plain page too
        page.goto(f"{api_server.url}/onceflow/pipelines/tweets")
        page.locator("#timeline tr[data-txid='3']").wait_for()
        assert page.locator("button[data-post]").count() == 0
    context.close()


def _from_txid_to_log_and_back(page, api_server, run, txid: int) -> None:
    """The txid's "commit" link opens that task's page of its run in Airflow's UI, on its
    log; the task's extra link "onceflow view" leads back to the view at the txid."""
    page.locator(f"#onceflow-timeline tr[data-txid='{txid}'] .onceflow-logs "
                 "a[data-task='commit']").click()
    task = f"/dags/onceflow_tweets/runs/{quote(run.run_id, safe='')}/tasks/commit"
    page.wait_for_url(lambda url: unquote(urlsplit(url).path) == unquote(task))
    # the task's page opens on its log (dag.test() runs the task here, so it holds no lines)
    page.get_by_text("Log message source details").wait_for()
    assert page.get_by_role("link", name=run.run_id, exact=True).count() >= 1  # its run
    page.goto(f"{api_server.url}{task}/details")
    back = page.get_by_role("link", name="onceflow view")
    back.wait_for()
    href = urlsplit(back.get_attribute("href"))
    assert (href.path, parse_qs(href.query)) == ("/plugin/onceflow/pipelines/tweets",
                                                 {"run_id": [run.run_id]})
    back.click()
    page.wait_for_url(f"{api_server.url}/plugin/onceflow/pipelines/tweets?txid={txid}")
    highlighted = page.locator("#onceflow-highlight")
    highlighted.wait_for()
    assert highlighted.get_attribute("data-txid") == str(txid)


def _trigger_form_refuses_a_batch_size_of_zero(page, api_server) -> None:
    """Airflow's trigger form keeps a batch_size of 0 as typed (its number field would turn
    it into 1 if the param's schema had a top-level minimum) and shows the refusal; no run."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session

    def runs() -> int:
        with create_session() as session:
            return session.query(DagRun).filter(DagRun.dag_id == "onceflow_tweets").count()

    before = runs()
    page.goto(f"{api_server.url}/dags/onceflow_tweets")
    page.get_by_role("button", name="Trigger").first.click()
    dialog = page.get_by_role("dialog")
    field = dialog.locator("input[name=element_batch_size]")
    field.fill("0")
    field.blur()
    assert field.input_value() == "0"
    dialog.get_by_role("button", name="Trigger").click()
    dialog.get_by_text("Invalid input for param batch_size: 0 is less than the minimum of 1"
                       ).wait_for()
    page.keyboard.press("Escape")
    dialog.wait_for(state="hidden")
    assert runs() == before


def _check_lineage_and_events(api_server, conn, committed_run, noop_run) -> None:
    """What Airflow's Assets view shows: the commit task produces each state table (and does
    not consume it); the DAG run that committed txid 3 gave each table an event with that
    table's own rows; the no-op run gave none."""
    import httpx

    viewer = {"Authorization": f"Bearer {_token(api_server, 'viewer')}"}
    assets = httpx.get(f"{api_server.url}/api/v2/assets", headers=viewer, timeout=30,
                       params={"name_pattern": "onceflow/tweets/"}).json()["assets"]
    by_name = {a["name"]: a for a in assets}
    for name in ("url_counts", "domain_counts"):
        asset = by_name[f"onceflow/tweets/{name}"]
        assert [(t["dag_id"], t["task_id"]) for t in asset["producing_tasks"]] == [
            ("onceflow_tweets", "commit")]
        assert "onceflow_tweets" not in {t["dag_id"] for t in asset.get("consuming_tasks", [])}
    events = {}
    for run in (committed_run, noop_run):
        answer = httpx.get(f"{api_server.url}/api/v2/assets/events", headers=viewer, timeout=30,
                           params={"source_run_id": run.run_id})
        assert answer.status_code == 200, answer.text
        events[run.run_id] = {e["name"]: e["extra"] for e in answer.json()["asset_events"]}
    assert events[noop_run.run_id] == {}
    rows = {}
    for name in ("url_counts", "domain_counts"):
        extra = events[committed_run.run_id][f"onceflow/tweets/{name}"]
        assert extra["txid"] == 3
        rows[name] = extra["rows"]
        # txid 3 is the last commit: the keys at txid 3 are what it applied
        assert rows[name] == table(conn, f"SELECT count(*) FROM {name} WHERE txid = 3")[0][0]
    assert sum(rows.values()) == table(conn, "SELECT rows_applied FROM transactions "
                                             "WHERE txid = 3")[0][0]


def _check_api(api_server, conn) -> None:
    """The data endpoints refuse a read-only user's actions and anonymous requests."""
    import httpx

    admin = {"Authorization": f"Bearer {_token(api_server, 'admin')}",
             "X-Requested-By": "test"}
    viewer = {"Authorization": f"Bearer {_token(api_server, 'viewer')}",
              "X-Requested-By": "test"}
    base_url = f"{api_server.url}/onceflow/api/pipelines/tweets"
    assert httpx.get(base_url, headers=viewer, timeout=30).json()["can_operate"] is False
    for path, body in [("/dead-letters/replay", {"all": True, "confirm": True}),
                       ("/backfill", {"confirm": True})]:
        refused = httpx.post(base_url + path, headers=viewer, json=body, timeout=30)
        assert refused.status_code == 403, refused.text
    assert table(conn, "SELECT count(*) FROM dead_letters") == [(2,)]

    # anonymous: refused, the pages send to the login
    for url in (f"{api_server.url}/onceflow/api/pipelines", base_url):
        assert httpx.get(url, timeout=30).status_code == 401
    assert httpx.post(base_url + "/dead-letters/replay", timeout=30,
                      headers={"X-Requested-By": "test"},
                      json={"all": True, "confirm": True}).status_code == 401
    page_answer = httpx.get(f"{api_server.url}/onceflow/pipelines/tweets", timeout=30)
    assert page_answer.status_code == 307
    assert page_answer.headers["location"].startswith("/auth/login")
    # an action without the header a cross-site form cannot send
    assert httpx.post(base_url + "/dead-letters/replay", headers=admin | {"X-Requested-By": ""},
                      json={"all": True, "confirm": True}, timeout=30).status_code == 400
    assert table(conn, "SELECT count(*) FROM dead_letters") == [(2,)]


def _check_backfill_run(txid: int) -> None:
    """The backfill queued one run of the DAG with conf {"txid": N} (no scheduler runs here:
    it stays queued), then removed so no later test meets it."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session

    with create_session() as session:
        runs = session.query(DagRun).filter(DagRun.dag_id == "onceflow_tweets",
                                            DagRun.run_id.like(f"onceflow_backfill__txid_{txid}__%")
                                            ).all()
        assert [(r.conf, str(r.state)) for r in runs] == [({"txid": txid}, "queued")]
        assert runs[0].note.startswith(f"txid {txid} · backfill queued by admin")
        for run in runs:
            session.delete(run)


# -- what the view says, against onceflow's own records (a real api-server, no browser) -----------
def _headers(api_server, user: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {_token(api_server, user)}", "X-Requested-By": "test"}


def _get(api_server, path: str, user: str = "admin"):
    import httpx

    return httpx.get(f"{api_server.url}/onceflow{path}", headers=_headers(api_server, user),
                     timeout=30)


def _post(api_server, path: str, body: dict, user: str = "admin"):
    import httpx

    return httpx.post(f"{api_server.url}/onceflow{path}", headers=_headers(api_server, user),
                      json=body, timeout=30)


def _by_id(page: str, element_id: str) -> str:
    """The text of the element ``element_id`` of a server-rendered page (no markup inside)."""
    import html
    import re

    found = re.search(rf'id="{element_id}"[^>]*>([^<]*)<', page)
    assert found, f"no #{element_id} in the page"
    return html.unescape(found.group(1)).strip()


def _buttons(page: str) -> list[tuple[str, dict]]:
    """(endpoint, JSON body) of every action button of a server-rendered page."""
    import html
    import re

    return [(path, json.loads(html.unescape(body))) for path, body in re.findall(
        r'data-post="([^"]+)"\s+data-body=\'([^\']*)\'', page)]


def test_an_unknown_pipeline_answers_404_with_the_known_names(api_server, onceflow_connection):
    import html

    api_server.wait_up()
    known = [p["pipeline"] for p in _get(api_server, "/api/pipelines").json()]
    assert {"tweets", "tweets_approved"} <= set(known)
    says = f"no pipeline 'tweet' here: known pipelines are {', '.join(known)}"
    page = _get(api_server, "/pipelines/tweet")
    assert page.status_code == 404
    assert says in html.unescape(page.text)
    answer = _get(api_server, "/api/pipelines/tweet")
    assert answer.status_code == 404 and answer.json()["detail"] == says


def test_the_lag_card_counts_the_records_waiting_in_the_backflow(
        api_server, onceflow_connection, conn, dsn, spark, capsys):
    from helpers import run_transaction
    from onceflow.cli import main

    pipeline = tweets_pipeline(conn, events=1000, batch_size=400, malformed_share=0,
                               poison_share=0.05, flaky_share=0)
    _, result = run_transaction(spark, dsn, conn, pipeline, "lib-1")
    assert result.status == "committed" and result.failed > result.dead  # some wait to replay
    waiting = table(conn, "SELECT count(*) FROM backflow_items")[0][0]
    assert waiting == result.failed - result.dead
    assert main(["status", "--pipeline", "tweets", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    lag = sum(p["lag"] for p in status["partitions"])
    assert lag == 600
    assert status["backflow"]["to_items"] + status["backflow"]["from_items"] == waiting

    api_server.wait_up()
    page = _get(api_server, "/pipelines/tweets").text
    assert (_by_id(page, "lag"), _by_id(page, "backflow-waiting"), _by_id(page, "behind")) == (
        f"{lag:,}", f"{waiting:,}", f"{lag + waiting:,}")
    view = _get(api_server, "/api/pipelines/tweets").json()
    assert (view["lag"], view["backflow_waiting"], view["behind"]) == (
        lag, waiting, lag + waiting)
    overview = {p["pipeline"]: p for p in _get(api_server, "/api/pipelines").json()}["tweets"]
    assert (overview["lag"], overview["backflow_waiting"], overview["behind"]) == (
        lag, waiting, lag + waiting)


def test_processing_txids_say_what_they_do_and_only_a_processed_one_waits(
        api_server, onceflow_connection, conn, dsn, spark):
    import re

    from onceflow.core.begin import begin
    from onceflow.core.commit import commit
    from onceflow.spark.processing import process_batch

    pipeline = tweets_pipeline(conn, events=400, batch_size=100, groups=2, malformed_share=0,
                               poison_share=0, flaky_share=0)
    first, second = begin(conn, pipeline, "run-1"), begin(conn, pipeline, "run-2")
    assert (first.attempt.txid, second.attempt.txid, second.groups) == (1, 2, 2)
    process_batch(spark, dsn, pipeline, second.attempt, 0)
    api_server.wait_up()

    def holds() -> dict[int, str]:
        return {t["txid"]: t["holds"] for t in _get(api_server, "/api/pipelines/tweets")
                .json()["open"]}

    now = holds()
    assert re.match(r"processing since \d\d:\d\d:\d\d UTC: 0 of 2 group\(s\) staged \(run run-1, "
                    r"attempt 1\); held by ", now[1]), now[1]
    assert re.match(r"processing since \d\d:\d\d:\d\d UTC: 1 of 2 group\(s\) staged \(run "
                    r"run-2, attempt 1\); held by ", now[2]), now[2]
    assert "waits" not in now[1] + now[2]

    # processed, its commit asked for: it waits for txid 1, for as long as it has been waiting
    process_batch(spark, dsn, pipeline, second.attempt, 1)
    assert commit(conn, pipeline, second.attempt).status == "waiting"
    now = holds()
    waited = table(conn, "SELECT EXTRACT(EPOCH FROM now() - commit_requested_at)::float "
                         "FROM transactions WHERE txid = 2")[0][0]
    found = re.match(r"processed; its commit waits for txid 1 to commit: waiting "
                     r"(\d+\.\d)s so far \(run run-2, attempt 1\); held by ", now[2])
    assert found, now[2]
    assert 0 <= float(found.group(1)) <= waited + 0.05
    # `onceflow status` says the same
    from onceflow.ops.status import pipeline_status, render

    with conn.cursor() as cur:
        lines = "\n".join(render(pipeline_status(cur, pipeline.source, "tweets")))
    conn.commit()
    assert "txid 2 (planned): processed; its commit waits for txid 1 to commit: waiting" in lines


LONG = ("bolt enrich_author: LookupError: the profile service answered 404 for the author of "
        "this tweet; ")


def test_a_long_reason_is_shown_whole_and_replays_exactly_its_dead_letters(
        api_server, onceflow_connection, conn):
    """Reasons longer than 80 characters that share their first 80: the page shows each whole
    (its title; the cell cut at a word), and its Replay button replays exactly the dead
    letters whose last error it is, not the others, nor one that had it as an earlier error."""
    import html
    import re

    from onceflow.core import backflow

    first, second = LONG + "user 1001 is gone", LONG + "user 2002 is private"
    tweets_pipeline(conn)
    letters = [(0, 3, [first, first]), (1, 7, [first]), (2, 11, [second]),
               (3, 5, [first, "bolt enrich_author: TimeoutError: slow"])]
    with conn.cursor() as cur:
        backflow.ensure_pointers(cur, "tweets")
        for partition, offset, errors in letters:
            cur.execute(
                """INSERT INTO dead_letters (pipeline, partition, "offset", payload, failures,
                                             errors, txid)
                   VALUES ('tweets', %s, %s, '{}', %s, %s, 1)""",
                (partition, offset, len(errors), errors))
    conn.commit()

    api_server.wait_up()
    page = _get(api_server, "/pipelines/tweets").text
    titles = [html.unescape(t) for t in re.findall(r'class="err reason" title="([^"]*)"', page)]
    assert sorted(titles) == sorted([first, second, "bolt enrich_author: TimeoutError: slow"])
    buttons = [body for path, body in _buttons(page)
               if path.endswith("/dead-letters/replay") and "last_error" in body]
    assert {b["last_error"] for b in buttons} == set(titles)
    (body,) = [b for b in buttons if b["last_error"] == first]
    preview = _post(api_server, "/api/pipelines/tweets/dead-letters/replay", body)
    assert preview.status_code == 200 and preview.json()["count"] == 2, preview.text
    done = _post(api_server, "/api/pipelines/tweets/dead-letters/replay", {**body, "confirm": True})
    assert done.status_code == 200 and done.json()["count"] == 2, done.text
    assert table(conn, 'SELECT partition, "offset" FROM dead_letters ORDER BY 1') == [
        (2, 11), (3, 5)]
    assert table(conn, 'SELECT partition, "offset" FROM backflow_items ORDER BY 1') == [
        (0, 3), (1, 7)]


def _sync_dags() -> None:
    """The DAG files' DAGs into Airflow's metadata database, as this process builds them now
    (what ``airflow dags reserialize`` and dag.test() do)."""
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import BundleDagBag, sync_bag_to_db

    manager = DagBundlesManager()
    manager.sync_bundles_to_db()
    for bundle in manager.get_all_dag_bundles():
        if not bundle.is_initialized:
            bundle.initialize()
        bag = BundleDagBag(dag_folder=bundle.path, bundle_path=bundle.path,
                           bundle_name=bundle.name)
        assert not bag.import_errors, bag.import_errors
        sync_bag_to_db(bag, bundle.name, bundle.version)


def test_replays_of_a_pipeline_that_needs_approval_go_through_its_approval_dag(
        api_server, onceflow_connection, conn, monkeypatch):
    """A pipeline with dead_letter_approval: the replay endpoint refuses even a direct POST;
    the page's buttons ask for the approval, which queues a run of the approval DAG with the
    same choice (nothing replayed); a read-only user may not ask."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session

    from onceflow.airflow.approval import replay_dag_id
    from onceflow.core.registration import register
    from onceflow.core.registry import clear_cache, get_pipeline

    monkeypatch.setenv("ONCEFLOW_PIPELINES", APPROVED)
    clear_cache()
    pipeline = get_pipeline("tweets_approved")
    assert pipeline.dead_letter_approval
    register(conn, pipeline, create_source=True)
    _dead_letters(conn, pipeline.name)
    _sync_dags()  # its approval DAG, as Airflow's DAG processor would have it
    dag_id = replay_dag_id(pipeline.name)
    path = f"/api/pipelines/{pipeline.name}/dead-letters"
    reason = "bolt normalize_domain: ValueError: bad host"
    api_server.wait_up()
    try:
        # a direct replay is refused, with the way to ask
        for confirm in (False, True):
            refused = _post(api_server, f"{path}/replay", {"all": True, "confirm": confirm})
            assert refused.status_code == 409, refused.text
            assert dag_id in refused.json()["detail"]
            assert "request-approval" in refused.json()["detail"]
        # the page: every button asks for the approval, none replays; the DAG is named
        page = _get(api_server, f"/pipelines/{pipeline.name}").text
        buttons = _buttons(page)
        assert len(buttons) == 6  # two reasons, three dead letters, all
        assert {p for p, _ in buttons} == {f"{path}/request-approval"}
        assert "dead-letters/replay" not in page
        assert f'href="/dags/{dag_id}"' in page and 'id="approval-note"' in page
        # what frees them, as the view and `onceflow status` say it: the approval DAG
        fix = _get(api_server, f"/api/pipelines/{pipeline.name}").json()["dead_letters"]["fix"]
        assert dag_id in fix and "onceflow replay-dead-letters" not in fix
        assert _by_id(page, "dead-fix") == f"What frees them: {fix}."
        # asking: first what it would ask, then a queued run of the approval DAG
        body = {"last_error": reason}
        asked = _post(api_server, f"{path}/request-approval", body)
        assert asked.status_code == 200 and asked.json()["count"] == 2, asked.text
        assert "nothing is replayed unless it is approved" in asked.json()["message"]
        done = _post(api_server, f"{path}/request-approval", {**body, "confirm": True})
        assert done.status_code == 200, done.text
        run_id = done.json()["run_id"]
        with create_session() as session:
            run = session.query(DagRun).filter(DagRun.dag_id == dag_id,
                                               DagRun.run_id == run_id).one()
            assert (run.conf, str(run.state)) == ({"records": [], "error_contains": None,
                                                   "last_error": reason, "all": False},
                                                  "queued")
            assert run.note.startswith("replay of dead letters asked for by admin")
        assert table(conn, "SELECT count(*) FROM dead_letters") == [(3,)]  # nothing replayed
        # a read-only user sees no buttons and may not ask
        assert _buttons(_get(api_server, f"/pipelines/{pipeline.name}", "viewer").text) == []
        refused = _post(api_server, f"{path}/request-approval", {**body, "confirm": True},
                        "viewer")
        assert refused.status_code == 403, refused.text
        # a pipeline without dead_letter_approval has nothing to ask
        assert _post(api_server, "/api/pipelines/tweets/dead-letters/request-approval",
                     {"all": True}).status_code == 409
    finally:
        with create_session() as session:
            for run in session.query(DagRun).filter(DagRun.dag_id == dag_id).all():
                session.delete(run)
        clear_cache()


# -- the React view: pages, filters, charts, theme and refresh ---------------------------------
CLEAN = {"malformed_share": 0, "poison_share": 0, "flaky_share": 0}


def _processed(spark, dsn: str, pipeline, batch) -> None:
    from onceflow.spark.processing import process_batch

    for group in range(batch.groups):
        process_batch(spark, dsn, pipeline, batch.attempt, group)


def _txids(answer) -> list[int]:
    assert answer.status_code == 200, answer.text
    return [t["txid"] for t in answer.json()["transactions"]]


def test_the_timeline_pages_and_filters_and_the_series_measure_each_txid(
        api_server, onceflow_connection, conn, dsn, spark):
    """Five txids: 1 and 2 planned together (2 in flight behind 1), 3 after 500 more records
    arrived, 4 failed, 5 in flight. The timeline pages through them both ways and filters by
    txids and states; each txid names its runs and the paths of its tasks' logs. The series
    say per committed txid what the charts plot, against onceflow's own records: the lag
    when it was planned, its records per second, its commit time and its freshness."""
    from helpers import produce, run_transaction, tweets_events
    from onceflow.core.begin import begin, mark_failed
    from onceflow.core.commit import commit

    pipeline = tweets_pipeline(conn, events=1000, batch_size=200, **CLEAN)
    # one COPY: every record of the first 1,000 arrived at the same moment
    arrivals = table(conn, "SELECT DISTINCT produced_at FROM source_log")
    assert len(arrivals) == 1
    (arrived,) = arrivals[0]
    first, second = begin(conn, pipeline, "lib-1"), begin(conn, pipeline, "lib-2")
    _processed(spark, dsn, pipeline, first)
    _processed(spark, dsn, pipeline, second)
    assert commit(conn, pipeline, first.attempt).status == "committed"
    assert commit(conn, pipeline, second.attempt).status == "committed"
    produce(conn, pipeline.topic, tweets_events(500, seed=11, **CLEAN))
    run_transaction(spark, dsn, conn, pipeline, "lib-3")
    fourth, fifth = begin(conn, pipeline, "lib-4"), begin(conn, pipeline, "lib-5")
    assert mark_failed(conn, pipeline.name, fourth.attempt, "a test's failure")
    assert (fourth.attempt.txid, fifth.attempt.txid) == (4, 5)
    api_server.wait_up()
    timeline = "/api/pipelines/tweets/timeline"

    # pages, newest first, both ways
    assert _txids(_get(api_server, timeline)) == [5, 4, 3, 2, 1]
    pages = {}
    for query in ("limit=2", "limit=2&before=4", "limit=2&before=2", "limit=2&after=3"):
        answer = _get(api_server, f"{timeline}?{query}").json()
        pages[query] = ([t["txid"] for t in answer["transactions"]], answer["older"],
                        answer["newer"])
    assert pages == {"limit=2": ([5, 4], True, False), "limit=2&before=4": ([3, 2], True, True),
                     "limit=2&before=2": ([1], False, True),
                     "limit=2&after=3": ([5, 4], True, False)}
    # filters: a txid range, states (repeated or comma-separated), both
    assert _txids(_get(api_server, f"{timeline}?min_txid=2&max_txid=4")) == [4, 3, 2]
    assert _txids(_get(api_server, f"{timeline}?state=committed")) == [3, 2, 1]
    assert _txids(_get(api_server, f"{timeline}?state=failed&state=planned")) == [5, 4]
    assert _txids(_get(api_server, f"{timeline}?state=failed,planned")) == [5, 4]
    assert _txids(_get(api_server, f"{timeline}?state=abandoned")) == []
    assert _txids(_get(api_server, f"{timeline}?min_txid=2&max_txid=4&state=committed"
                                   "&limit=1&before=3")) == [2]
    # each txid's runs and the paths of its tasks' logs in Airflow's UI
    rows = {t["txid"]: t for t in _get(api_server, timeline).json()["transactions"]}
    assert rows[4]["state"] == "failed" and rows[4]["reason"] == "a test's failure"
    assert rows[3]["run"] == "dags/onceflow_tweets/runs/lib-3"
    assert [log["path"] for log in rows[3]["logs"]] == [
        "dags/onceflow_tweets/runs/lib-3/tasks/begin",
        *(f"dags/onceflow_tweets/runs/lib-3/tasks/process/mapped/{g}"
          for g in range(pipeline.groups)),
        "dags/onceflow_tweets/runs/lib-3/tasks/commit"]
    assert [(a["attempt"], a["run_id"], a["outcome"]) for a in rows[4]["attempts"]] == [
        (1, "lib-4", "failed")]
    # the txid of a run (the "onceflow view" link of a run's task asks for it)
    found = _get(api_server, "/api/pipelines/tweets/txid?run_id=lib-2")
    assert found.status_code == 200 and found.json()["txid"] == 2
    missing = _get(api_server, "/api/pipelines/tweets/txid?run_id=nobody")
    assert missing.status_code == 404 and "'nobody' of onceflow_tweets has no txid" in \
        missing.json()["detail"]
    # bad input: 400, naming the field, the value and what to give
    for query, says in [
            ("state=done", "state='done' is not a transaction state: choose from planned, "
                           "committed, failed, superseded, abandoned"),
            ("min_txid=4&max_txid=2", "min_txid=4 is above max_txid=2"),
            ("limit=0", "limit=0: Input should be greater than or equal to 1"),
            ("limit=many", "limit=many: Input should be a valid integer"),
            ("before=3&after=1", "give before or after, not both")]:
        answer = _get(api_server, f"{timeline}?{query}")
        assert answer.status_code == 400 and says in answer.json()["detail"], answer.text

    # the series, against the transactions table
    points = {p["txid"]: p for p in _get(api_server, "/api/pipelines/tweets/series")
              .json()["points"]}
    assert sorted(points) == [1, 2, 3]
    # lag when planned: txid 1 left 800 of 1,000 behind and had its own 200 in flight; txid 2,
    # planned before 1 committed, left 600 and had 400 in flight; txid 3, planned after both
    # committed and 500 more arrived, left 900 and had its own 200
    assert [points[t]["lag"] for t in (1, 2, 3)] == [1000, 1000, 1100]
    rows = table(conn, """SELECT txid, records, EXTRACT(EPOCH FROM committed_at - planned_at),
                                 EXTRACT(EPOCH FROM committed_at - commit_requested_at),
                                 EXTRACT(EPOCH FROM committed_at - %s)
                          FROM transactions WHERE state = 'committed' ORDER BY txid""",
                 (arrived,))
    for txid, records, duration, commit_s, since_arrival in rows:
        point = points[txid]
        assert point["records"] == records == 200
        assert point["commit_s"] == pytest.approx(float(commit_s), abs=0.002)
        assert point["duration_s"] == pytest.approx(float(duration), abs=0.002)
        # over its own window, planning to commit (not since the commit before it)
        assert point["records_per_s"] == pytest.approx(records / float(duration), abs=0.06)
        assert point["replayed"] == 0
        if txid < 3:  # batches of the first 1,000 records only
            assert point["freshness_s"] == pytest.approx(float(since_arrival), abs=0.002)
    assert "oldest record" in _get(api_server, "/api/pipelines/tweets/series").json()[
        "freshness"]
    assert [p["txid"] for p in _get(api_server, "/api/pipelines/tweets/series?last=1")
            .json()["points"]] == [3]
    assert [p["txid"] for p in _get(api_server, "/api/pipelines/tweets/series?min_txid=2"
                                                "&max_txid=2").json()["points"]] == [2]


def test_the_plugin_serves_its_module_and_links_back_from_transaction_tasks(
        api_server, monkeypatch):
    """Airflow's UI loads the React view from the plugin's bundle_url (the module, versioned
    by its digest, without a login); a transaction DAG's tasks get the "onceflow view" link
    (under the path of [api] base_url), other tasks none."""
    import httpx

    from onceflow.airflow.ui import bundle
    from onceflow.airflow.ui.plugin import OnceflowViewLink

    api_server.wait_up()
    plugins = _get_airflow(api_server, "/api/v2/plugins")
    (ours,) = [p for p in plugins["plugins"] if p["name"] == "onceflow"]
    (app,) = ours["react_apps"]
    assert (app["url_route"], app["destination"]) == ("onceflow", "nav")
    assert app["bundle_url"] == f"onceflow/static/onceflow-view.js?v={bundle.digest()}"
    assert ours["external_views"] == []  # the React view replaces the iframe
    assert any("OnceflowViewLink" in link for link in ours["global_operator_extra_links"])
    module = httpx.get(f"{api_server.url}/{app['bundle_url']}", timeout=30)
    assert module.status_code == 200
    assert module.headers["content-type"].startswith("text/javascript")
    assert "immutable" in module.headers["cache-control"]
    assert "globalThis.AirflowPlugin = OnceflowView" in module.text
    unversioned = httpx.get(f"{api_server.url}/onceflow/static/onceflow-view.js", timeout=30)
    assert unversioned.headers["cache-control"] == "no-cache"
    assert httpx.get(f"{api_server.url}/onceflow/static/other.js",
                     timeout=30).status_code == 404

    link = OnceflowViewLink()

    def url(task_type: str, dag_id: str) -> str:
        return link.get_link(SimpleNamespace(task_type=task_type), ti_key=SimpleNamespace(
            dag_id=dag_id, run_id="manual__2026-01-02T03:04:05+00:00"))

    wanted = "/plugin/onceflow/pipelines/tweets?run_id=manual__2026-01-02T03%3A04%3A05%2B00%3A00"
    for task_type in ("BeginBatchOperator", "ProcessBatchOperator", "CommitBatchOperator",
                      "TransactionOperator"):
        assert url(task_type, "onceflow_tweets") == wanted
    assert url("PythonOperator", "onceflow_tweets") == ""
    assert url("CommitBatchOperator", "reports") == ""
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "https://airflow.example.com/data/")
    assert url("CommitBatchOperator", "onceflow_tweets") == f"/data{wanted}"


def _get_airflow(api_server, path: str) -> dict:
    import httpx

    answer = httpx.get(f"{api_server.url}{path}", timeout=30,
                       headers={"Authorization": f"Bearer {_token(api_server, 'admin')}"})
    assert answer.status_code == 200, answer.text
    return answer.json()


_COLOURS = """() => {
    const card = document.querySelector("#onceflow-view .onceflow-card");
    const probe = document.createElement("div");
    probe.style.background = "var(--chakra-colors-bg-panel)";
    document.body.appendChild(probe);
    const panel = getComputedStyle(probe).backgroundColor;
    probe.remove();
    return {card: getComputedStyle(card).backgroundColor, text: getComputedStyle(card).color,
            panel, dark: document.documentElement.classList.contains("dark"),
            font: getComputedStyle(card).fontFamily,
            airflowFont: getComputedStyle(document.body).fontFamily};
}"""


def _lightness(colour: str) -> float:
    """0 (black) to 1 (white): of a computed CSS colour, rgb() or oklch() (its L)."""
    import re

    numbers = [float(v) for v in re.findall(r"[\d.]+", colour)]
    if colour.startswith("oklch("):
        return numbers[0]
    r, g, b = (v / 255 for v in numbers[:3])
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


@pytest.mark.timeout(500)
def test_the_view_follows_the_theme_pages_filters_and_refreshes_by_itself(
        chromium, api_server, onceflow_connection, conn, dsn, spark, tmp_path):
    """In Airflow's light and dark themes the view's panels take the theme's own colours
    and font; a txid committed while the page is open shows up without a reload (and in the
    charts); the timeline pages both ways and filters by txids and states."""
    from helpers import run_transaction

    pipeline = tweets_pipeline(conn, events=1000, batch_size=200, **CLEAN)
    for n in (1, 2, 3):
        run_transaction(spark, dsn, conn, pipeline, f"lib-{n}")
    api_server.wait_up()
    colours = {}
    with launched(chromium) as browser:
        for theme in ("light", "dark"):
            context, page = _log_in(browser, api_server, "admin",
                                    "/plugin/onceflow/pipelines/tweets", theme=theme)
            with screenshots_on_failure(tmp_path, api_server.log, **{theme: page}):
                page.locator("#onceflow-timeline tr[data-txid='3']").wait_for()
                colours[theme] = page.evaluate(_COLOURS)
                if theme == "light":
                    _refreshes_by_itself(page, spark, dsn, conn, pipeline)
                    _pages_and_filters(page, api_server, conn, pipeline)
            context.close()
    light, dark = colours["light"], colours["dark"]
    assert (light["dark"], dark["dark"]) == (False, True)
    assert light["card"] == light["panel"] and dark["card"] == dark["panel"], colours
    assert light["card"] != dark["card"]
    assert _lightness(light["card"]) > 0.85 and _lightness(dark["card"]) < 0.25, colours
    assert _lightness(light["text"]) < 0.35 and _lightness(dark["text"]) > 0.65, colours
    assert light["font"] == light["airflowFont"] and "Inter" in light["font"]


def _refreshes_by_itself(page, spark, dsn: str, conn, pipeline) -> None:
    from playwright.sync_api import expect

    from helpers import run_transaction

    page.locator("#onceflow-refresh").select_option("5")
    assert page.locator("#onceflow-chart-rate").get_attribute("data-points") == "3"
    page.evaluate("window.onceflowTestMark = 'no reload'")
    _, result = run_transaction(spark, dsn, conn, pipeline, "lib-4")
    assert result.status == "committed"
    page.locator("#onceflow-timeline tr[data-txid='4'][data-state='committed']").wait_for(
        timeout=30_000)
    # the cards and the charts have their own requests: each refreshes by itself too
    expect(page.locator("#onceflow-last-committed")).to_have_text("4")
    page.locator("#onceflow-chart-rate circle[data-txid='4']").wait_for()
    assert page.locator("#onceflow-chart-rate").get_attribute("data-points") == "4"
    assert page.evaluate("window.onceflowTestMark") == "no reload"


def _pages_and_filters(page, api_server, conn, pipeline) -> None:
    from playwright.sync_api import expect

    from onceflow.core.begin import begin, mark_failed

    def shown() -> list[int]:
        return [int(r.get_attribute("data-txid"))
                for r in page.locator("#onceflow-timeline tbody tr[data-state]").all()]

    def wait_for(txids: list[int]) -> None:
        deadline = time.monotonic() + 45  # refreshes every 5 s, each a few requests
        while shown() != txids and time.monotonic() < deadline:
            page.wait_for_timeout(200)
        assert shown() == txids

    page.goto(f"{api_server.url}/plugin/onceflow/pipelines/tweets?limit=2")
    wait_for([4, 3])
    assert page.locator("#onceflow-newer").is_disabled()
    page.locator("#onceflow-older").click()
    wait_for([2, 1])
    assert page.locator("#onceflow-older").is_disabled()
    page.locator("#onceflow-newer").click()
    wait_for([4, 3])
    # a txid range: the timeline and the charts show it
    page.locator("#onceflow-min").fill("2")
    page.locator("#onceflow-max").fill("3")
    page.locator("#onceflow-apply").click()
    wait_for([3, 2])
    page.locator("#onceflow-chart-rate[data-points='2']").wait_for()
    assert parse_qs(urlsplit(page.url).query) == {"min": ["2"], "max": ["3"], "limit": ["2"]}
    # a state: txid 5 fails while the page shows failed ones
    page.locator("#onceflow-clear").click()
    # the form takes the cleared filter from the address first: a state chosen before that
    # would be reset by it
    wait_for([4, 3])
    failed = page.locator(".onceflow-state-filter[data-state='failed']")
    failed.click()
    expect(failed).to_have_attribute("aria-pressed", "true")
    page.locator("#onceflow-apply").click()
    page.get_by_text("No transaction matches this filter.").wait_for()
    batch = begin(conn, pipeline, "lib-5")
    assert batch.attempt.txid == 5
    assert mark_failed(conn, pipeline.name, batch.attempt, "a test's failure")
    wait_for([5])
    assert "a test's failure" in page.locator("#onceflow-timeline tr[data-txid='5']").inner_text()


# -- every figure of the view, against `onceflow status --json` and the transactions' times -------
def _status_json(capsys) -> dict:
    from onceflow.cli import main

    capsys.readouterr()
    assert main(["status", "--pipeline", "tweets", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _points(page, chart: str) -> dict[int, float]:
    """Each point of a chart as drawn: its txid and its value (data-y)."""
    return {int(c.get_attribute("data-txid")): float(c.get_attribute("data-y"))
            for c in page.locator(f"#onceflow-chart-{chart} circle[data-txid]").all()}


def _seconds(card: str) -> float:
    assert card.endswith("s"), card
    return float(card[:-1])


@pytest.mark.timeout(600)
def test_every_card_and_chart_point_is_what_happened(
        chromium, api_server, onceflow_connection, conn, dsn, spark, tmp_path, capsys):
    """The pipeline page in a browser: each card equals `onceflow status --json`
    (freshness p50, p95 and the lag in seconds included), and each chart point equals what
    the transactions' own timestamps give: txids 1 and 2 planned together and committed one
    right after the other (in parallel), txid 3 planned after an idle gap. A txid's records
    per second is over its own window, planning to commit; its records are the timeline's
    and status's. The index names the command for a pipeline not set up; a no-op run of a
    committed txid is listed among its attempts."""
    from helpers import run_transaction
    from onceflow.core.begin import begin
    from onceflow.core.commit import commit

    # flaky lookups fail their first tries: txids 1 and 2 leave them to the backflow, and
    # txid 3 replays some (records and replays counted apart)
    pipeline = tweets_pipeline(conn, events=1000, batch_size=200, malformed_share=0,
                               poison_share=0, flaky_share=0.03)
    ((arrived,),) = table(conn, "SELECT DISTINCT produced_at FROM source_log")
    first, second = begin(conn, pipeline, "lib-1"), begin(conn, pipeline, "lib-2")
    _processed(spark, dsn, pipeline, first)
    _processed(spark, dsn, pipeline, second)
    assert commit(conn, pipeline, first.attempt).status == "committed"
    assert commit(conn, pipeline, second.attempt).status == "committed"
    time.sleep(2.0)  # idle: nothing planned, nothing committed
    run_transaction(spark, dsn, conn, pipeline, "lib-3")
    # a run asked for committed txid 1 again: a no-op, mapped to it without an attempt
    assert begin(conn, pipeline, "noop-run", txid=1).committed
    conn.commit()
    rows = {r[0]: r[1:] for r in table(conn, """
        SELECT txid, records, replayed, planned_at, commit_requested_at, committed_at,
               EXTRACT(EPOCH FROM committed_at - planned_at)::float,
               EXTRACT(EPOCH FROM committed_at - commit_requested_at)::float,
               EXTRACT(EPOCH FROM committed_at - %s)::float
        FROM transactions ORDER BY txid""", (arrived,))}
    assert sorted(rows) == [1, 2, 3]
    replays = rows[3][1]
    assert rows[1][1] == rows[2][1] == 0 and replays > 0
    # in parallel: txid 2 committed right after txid 1, both planned before either committed;
    # txid 3 planned after the gap
    assert rows[2][2] < rows[1][4] < rows[2][4]
    assert (rows[3][2] - rows[2][4]).total_seconds() >= 2.0
    api_server.wait_up()
    before = _status_json(capsys)

    with launched(chromium) as browser:
        context, page = _log_in(browser, api_server, "admin", "/plugin/onceflow")
        with screenshots_on_failure(tmp_path, api_server.log, figures=page):
            # the index: tweets_approved (registered, never set up here) says how to set it up
            row = page.locator("#onceflow-pipelines tr[data-pipeline='tweets_approved']")
            row.wait_for()
            assert "`onceflow init --pipeline tweets_approved` sets it up or says what keeps " \
                   "it from being set up" in row.inner_text()
            assert "its first DAG run registers it" not in row.inner_text()
            page.goto(f"{api_server.url}/plugin/onceflow/pipelines/tweets")
            page.locator("#onceflow-timeline tr[data-txid='3']").wait_for()
            page.locator("#onceflow-chart-rate circle[data-txid='3']").wait_for()
            cards = {name: page.locator(f"#onceflow-{name}").inner_text() for name in (
                "last-committed", "open-count", "lag", "backflow-waiting", "behind",
                "dead-total", "lag-s", "freshness-p50", "freshness-p95")}
            charts = {c: _points(page, c) for c in ("lag", "freshness", "rate", "commit")}
            timeline = {int(r.get_attribute("data-txid")): [
                c.inner_text() for c in r.locator("td").all()]
                for r in page.locator("#onceflow-timeline tbody tr[data-state]").all()}
            rate_note = page.locator("#onceflow-chart-rate").inner_text()
            tip = page.locator("#onceflow-chart-rate circle[data-txid='2'] title").text_content()
            tip3 = page.locator("#onceflow-chart-rate circle[data-txid='3'] title").text_content()
            # txid 1's attempts: its one attempt, then the no-op run
            page.locator("#onceflow-timeline tr[data-txid='1'] "
                         ".onceflow-attempts-toggle").click()
            attempts = [r.inner_text() for r in
                        page.locator("#onceflow-timeline tr.onceflow-attempt[data-txid='1']")
                        .all()]
        context.close()
    after = _status_json(capsys)

    # the cards, against `onceflow status --json`
    lag = sum(p["lag"] for p in before["partitions"])
    waiting = before["backflow"]["to_items"] + before["backflow"]["from_items"]
    assert lag == 400 + replays and before["last_committed"] == 3
    assert cards["last-committed"] == str(before["last_committed"])
    assert cards["open-count"] == "0"
    assert (cards["lag"], cards["backflow-waiting"], cards["behind"], cards["dead-total"]) == (
        f"{lag:,}", f"{waiting:,}", f"{lag + waiting:,}", f"{before['dead_letters']['total']:,}")
    fresh = before["freshness"]
    assert fresh["p50_s"] is not None and fresh["p95_s"] is not None
    assert _seconds(cards["freshness-p50"]) == pytest.approx(fresh["p50_s"], abs=0.051)
    assert _seconds(cards["freshness-p95"]) == pytest.approx(fresh["p95_s"], abs=0.051)
    assert after["freshness"]["p50_s"] == fresh["p50_s"]  # committed: it does not move
    # the lag in seconds grows while the page is read: between the two status readings
    assert before["freshness"]["lag_s"] - 0.051 <= _seconds(cards["lag-s"]) <= \
        after["freshness"]["lag_s"] + 0.051

    # each chart point, against the transactions' own timestamps
    assert {c: sorted(p) for c, p in charts.items()} == {c: [1, 2, 3] for c in charts}
    for txid, (records, replayed, _planned, _asked, _committed, window, commit_s,
               since_arrival) in rows.items():
        assert records + replayed == 200  # a batch: its replays first, then the source's
        assert charts["rate"][txid] == pytest.approx(records / window, rel=0.002, abs=0.06)
        assert charts["commit"][txid] == pytest.approx(commit_s, abs=0.002)
        assert charts["freshness"][txid] == pytest.approx(since_arrival, abs=0.002)
        # "records" is one thing: the timeline's records column, status's records
        assert timeline[txid][3] == f"{records:,}" and timeline[txid][4] == f"{replayed:,}"
        assert {t["txid"]: t["records"] for t in before["transactions"]}[txid] == records
    # lag when planned: txids 1 and 2 saw all 1,000 (800 and 600 left, 200 and 400 in
    # flight); txid 3, planned after both committed, 600 (what it left, and its own)
    assert charts["lag"] == {1: 1000.0, 2: 1000.0, 3: 600.0}
    # committed right after txid 1, txid 2's rate is still its own work's, not records over
    # the few milliseconds since the commit before it; after the gap, txid 3's is its own
    since_previous = (rows[2][4] - rows[1][4]).total_seconds()
    assert 200 / since_previous > 3 * charts["rate"][2]
    assert (rows[3][4] - rows[2][4]).total_seconds() > rows[3][5]  # the gap is not in it
    assert "over its own window, from its planning to its commit" in rate_note
    assert "txid 2 · 200 records in" in tip and "replayed" not in tip
    assert f"txid 3 · {200 - replays} records (+ {replays} replayed) in" in tip3
    assert len(attempts) == 2, attempts
    assert "attempt 1" in attempts[0] and "lib-1" in attempts[0]
    assert "no-op run" in attempts[1] and "noop-run" in attempts[1]
    assert "committed already: nothing to do" in attempts[1]
